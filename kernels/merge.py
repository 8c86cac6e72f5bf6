"""Merging partial attention results computed over disjoint slices of a context
(decode context parallelism: each rank attends over its shard of the KV cache)."""

from __future__ import annotations

import torch

from flotilla.kernels.registry import register


@register("merge_attention_states", "torch")
def merge_attention_states(
    out_a: torch.Tensor,
    lse_a: torch.Tensor,
    out_b: torch.Tensor,
    lse_b: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Combine two softmax-normalised partial outputs into the output over the union.

    Args:
        out_a, out_b: ``[T, H, D]`` attention outputs, each normalised over its own keys.
        lse_a, lse_b: ``[T, H]`` natural-log sum-exp of each part's scaled scores; ``-inf``
            for a part with no keys (its output is ignored, even if NaN).

    Returns ``(out[T, H, D] in out_a.dtype, lse[T, H] float32)``. When both parts are
    empty, ``out`` is 0 and ``lse`` is ``-inf``.
    """
    lse_a, lse_b = lse_a.float(), lse_b.float()
    top = torch.maximum(lse_a, lse_b)
    # NOTE: when both are -inf, subtract 0 instead of -inf so no inf - inf = NaN appears.
    top = torch.where(torch.isneginf(top), torch.zeros_like(top), top)
    weight_a, weight_b = torch.exp(lse_a - top), torch.exp(lse_b - top)
    total = weight_a + weight_b
    part_a = torch.where((weight_a > 0).unsqueeze(-1), out_a.float() * weight_a.unsqueeze(-1), 0.0)
    part_b = torch.where((weight_b > 0).unsqueeze(-1), out_b.float() * weight_b.unsqueeze(-1), 0.0)
    safe_total = torch.where(total > 0, total, torch.ones_like(total)).unsqueeze(-1)
    out = (part_a + part_b) / safe_total
    lse = top + torch.log(total)  # log(0) = -inf for two empty parts
    return out.to(out_a.dtype), lse


@register("merge_attention_states_n", "torch")
def merge_attention_states_n(outs: torch.Tensor, lses: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Combine ``N`` partial outputs (e.g. one per DCP rank) into the output over the union.

    Args:
        outs: ``[N, T, H, D]`` attention outputs, each normalised over its own keys.
        lses: ``[N, T, H]`` their natural-log sum-exps; ``-inf`` for a part with no keys
            (its output is ignored, even if NaN).

    Returns ``(out[T, H, D] in outs.dtype, lse[T, H] float32)``; where every part is empty,
    ``out`` is 0 and ``lse`` is ``-inf``. Equals folding :func:`merge_attention_states`
    over the parts, in one pass.
    """
    lses = lses.float()
    top = lses.max(dim=0).values
    # NOTE: as in the pairwise merge: subtract 0, not -inf, where every part is empty.
    top = torch.where(torch.isneginf(top), torch.zeros_like(top), top)
    weights = torch.exp(lses - top)  # [N, T, H]; exactly 0 for empty parts
    total = weights.sum(dim=0)
    parts = torch.where((weights > 0).unsqueeze(-1), outs.float() * weights.unsqueeze(-1), 0.0)
    safe_total = torch.where(total > 0, total, torch.ones_like(total)).unsqueeze(-1)
    return (parts.sum(dim=0) / safe_total).to(outs.dtype), top + torch.log(total)
