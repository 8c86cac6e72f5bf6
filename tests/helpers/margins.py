"""How decided a discrete choice is: greedy tokens and routed experts compared across two float32
computations (ours and HF's, one rank and several) are equal only if no choice is a near-tie."""

from __future__ import annotations

import torch

# The engine's float32 log-probs differ from HF's, and one layout's from another's (packed
# weights, chunked and batched steps, preemption, TP/DP/EP reduction order), by <= 6e-6 on the
# tiny test models (measured over test_llm's architectures and the tiny Llama; |logits| <= 5).
# A greedy choice that leads the runner-up by more than twice that cannot flip between them;
# ENGINE_MIN_LEAD leaves 4x on top.
ENGINE_MIN_LEAD = 5e-5


def topk_margin(scores: torch.Tensor, k: int = 1) -> float:
    """The smallest gap, over every row of ``scores[..., n]``, between the k-th and the
    (k+1)-th largest score (``k=1``: the greedy token's lead over the runner-up).

    Two computations whose scores differ by less than half of it elementwise choose the same
    top-k set; a test that compares choices asserts its margin is above twice its tolerance.
    """
    values = scores.detach().float().topk(k + 1, dim=-1).values
    return float((values[..., k - 1] - values[..., k]).min())


def greedy_token(logits: torch.Tensor, min_margin: float) -> int:
    """The argmax of one row of logits ``[V]``, which must lead the runner-up by more than
    ``min_margin``: twice the tolerance within which the test's two computations agree, so the
    other computation picks the same token on any CPU. A smaller lead is a near-tie of the
    seeded data (choose other seeds), not a bug of the model."""
    margin = topk_margin(logits)
    assert margin > min_margin, f"greedy near-tie: the top token leads by {margin:.3g} <= {min_margin:.3g}"
    return int(logits.argmax())
