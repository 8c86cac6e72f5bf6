"""Sampling ops: turn a step's logits into truncated sampling probabilities.

The torch backend is the reference; a FlashInfer backend (top-k/top-p/min-p from
probabilities) registers under its own name with the same signature.
"""

from __future__ import annotations

import torch

from flotilla.kernels.registry import register


@register("sampling_probs", "torch")
def sampling_probs(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
) -> torch.Tensor:
    """Per row of ``logits[B, V]``: divide by ``temperature[B]``, keep the ``top_k[B]``
    most likely tokens (``>= V`` keeps all), then the smallest set whose mass reaches
    ``top_p[B]`` (renormalised over the top-k set), then drop tokens below
    ``min_p[B]`` times the most likely one. Returns probabilities ``[B, V]`` with
    truncated tokens at exactly 0."""
    logits = logits / temperature.unsqueeze(1)
    vocab = logits.shape[1]
    if bool((top_k < vocab).any()) or bool((top_p < 1.0).any()):
        logits = _top_k_top_p(logits, top_k, top_p)
    probs = torch.softmax(logits, dim=-1)
    if bool((min_p > 0.0).any()):
        threshold = min_p.unsqueeze(1) * probs.amax(dim=-1, keepdim=True)
        probs = probs.masked_fill(probs < threshold, 0.0)
    return probs


def _top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    position = torch.arange(logits.shape[1], device=logits.device).unsqueeze(0)
    sorted_logits = sorted_logits.masked_fill(position >= top_k.unsqueeze(1), float("-inf"))
    sorted_probs = torch.softmax(sorted_logits, dim=-1)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    # NOTE: the most likely token always survives (its mass_before is 0 < top_p).
    sorted_logits = sorted_logits.masked_fill(mass_before >= top_p.unsqueeze(1), float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter_(1, order, sorted_logits)
