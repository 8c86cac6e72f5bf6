"""DeepSeek sparse attention (DSA: DeepSeek-V3.2, GLM-5) over a paged cache: the lightning
indexer's per-query top-k, and MLA restricted to the selected tokens. Torch reference backend
(the oracle; CUDA kernels register under their own names).

The indexer keys live in the paged KV pool beside the MLA latent cache: one more per-token
component, ``index_cache[num_blocks, block_size, 1, index_head_dim]``, written at the same slots
(``meta.slot_mapping``). For new token ``t`` at position ``p_t`` and a context token ``s <= p_t``
the index score is

    I(t, s) = sum_h w[t, h] * relu(scale * q[t, h] . k[s])

(``q``: the indexer's rotated query heads, ``k``: its rotated, LayerNorm-ed key, ``w``: its
per-head weights ``weights_proj(x) / sqrt(index_n_heads)``, ``scale = index_head_dim ** -0.5``),
as HF transformers' ``DeepseekV32Indexer`` computes it: DeepSeek's reference kernels add a
Hadamard rotation, which is orthogonal and leaves every ``q . k`` unchanged, and FP8 scoring, a
precision optimisation. Each query keeps the ``index_topk`` context tokens of highest score (all
of them when it sees no more), as true positions ``[T, W]``, ``-1`` padding, ``W =
min(index_topk, max_seq_len)``; sparse attention is then MLA over those tokens only.

Under decode context parallelism (``local``: a :class:`~flotilla.kernels.dcp.DCPLocalView`)
each rank scores the tokens of its own shard; :func:`merge_topk` picks the group's top-k from the
ranks' candidates (the model all-gathers them), and each rank attends to the selected tokens it
holds (the partial outputs merge by LSE as for dense MLA).
"""

from __future__ import annotations

import torch

from flotilla.kernels.attention import (
    AttentionMetadata,
    causal_context_mask,
    gather_kv,
    pad_queries,
    unpad_queries,
    write_kv,
)
from flotilla.kernels.dcp import DCPLocalView
from flotilla.kernels.mla import mla_attention
from flotilla.kernels.registry import register


def topk_width(meta: AttentionMetadata, topk: int) -> int:
    """How many tokens a step's selection names per query: ``min(topk, max_seq_len)``."""
    return max(0, min(int(topk), int(meta.max_seq_len)))


def index_scores(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, scale: float) -> torch.Tensor:
    """``I[B, Q, L]`` float32 from padded queries ``q[B, Q, H, D]``, head weights ``w[B, Q, H]``
    and context keys ``keys[B, L, D]`` (see the module docstring; no masking)."""
    scores = torch.einsum("bqhd,bld->bqhl", q.float(), keys.float()) * scale
    return torch.einsum("bqh,bqhl->bql", weights.float(), torch.relu(scores))


@register("dsa_indexer", "torch")
def dsa_indexer(
    q: torch.Tensor,
    weights: torch.Tensor,
    k: torch.Tensor,
    index_cache: torch.Tensor,
    meta: AttentionMetadata,
    topk: int,
    scale: float,
    local: DCPLocalView | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Store the new tokens' index keys and select each new token's top-k context tokens.

    Args:
        q: ``[T, H, D]`` the indexer's query heads (rotated).
        weights: ``[T, H]`` the per-head weights (``weights_proj(x) / sqrt(H)``).
        k: ``[T, D]`` the new tokens' index keys (normalised, rotated).
        index_cache: ``[num_blocks, block_size, 1, D]``; the new keys are written at
            ``meta.slot_mapping`` (with ``local``: only the rank's own tokens, at its local slots).
        meta: the step's (logical) batch layout.
        topk: ``index_topk``.
        scale: ``D ** -0.5``.
        local: score this DCP rank's shard only (see the module docstring).

    Returns ``(values[T, W], positions[T, W])``: the selected tokens' scores (float32) and true
    context positions (int64), best first; ``-inf`` / ``-1`` where a query sees fewer than ``W``
    tokens (``W = min(topk, meta.max_seq_len)``). ``T = 0`` gives ``[0, W]`` tensors.
    """
    width = topk_width(meta, topk)
    tokens = q.shape[0]
    if tokens == 0:
        return q.new_empty(0, width, dtype=torch.float32), torch.empty(0, width, dtype=torch.int64, device=q.device)
    if local is None:
        write_kv(index_cache, meta.slot_mapping, k.unsqueeze(1))
        view, mask = meta, causal_context_mask(meta)
        key_positions = None
    else:
        write_kv(index_cache, local.meta.slot_mapping, k.index_select(0, local.write_index).unsqueeze(1))
        view, mask, key_positions = local.meta, local.mask, local.key_positions
    keys, _ = gather_kv(index_cache, view)  # [B, L, 1, D]
    scores = index_scores(pad_queries(q, view), pad_queries(weights, view), keys.squeeze(2), scale)
    scores = scores.masked_fill(~mask, float("-inf"))
    found = min(width, scores.shape[-1])
    values, index = scores.topk(found, dim=-1)  # [B, Q, found]
    positions = index if key_positions is None else key_positions.gather(1, index.flatten(1)).view_as(index)
    positions = positions.masked_fill(torch.isneginf(values), -1)
    values, positions = unpad_queries(values, view), unpad_queries(positions, view)
    if found < width:
        values = torch.nn.functional.pad(values, (0, width - found), value=float("-inf"))
        positions = torch.nn.functional.pad(positions, (0, width - found), value=-1)
    return values, positions


def merge_topk(values: torch.Tensor, positions: torch.Tensor, width: int) -> torch.Tensor:
    """The group's selection from per-rank candidates ``values[n, T, W]`` / ``positions[n, T, W]``
    (each rank's own top-``W``, which together hold the group's top-``W``): positions ``[T,
    width]``, best first, ``-1`` padding."""
    tokens = values.shape[1]
    flat_values = values.permute(1, 0, 2).reshape(tokens, -1)
    flat_positions = positions.permute(1, 0, 2).reshape(tokens, -1)
    best, index = flat_values.topk(min(width, flat_values.shape[-1]), dim=-1)
    return flat_positions.gather(1, index).masked_fill(torch.isneginf(best), -1)


def selection_mask(positions: torch.Tensor, meta: AttentionMetadata, local: DCPLocalView | None = None) -> torch.Tensor:
    """``keep[B, max_query_len, L]`` bool: which context entries each query attends to, from the
    selection ``positions[T, W]`` (true positions, ``-1`` padding). ``L`` is ``meta``'s context
    length, or with ``local`` the rank's local one (entry ``j`` holds position
    ``j * dcp_size + dcp_rank``)."""
    view = meta if local is None else local.meta
    length = int(view.max_seq_len)
    if local is None:
        index = positions
    else:
        mine = (positions >= 0) & (positions % local.dcp_size == local.dcp_rank)
        index = torch.where(mine, torch.div(positions, local.dcp_size, rounding_mode="floor"), -1)
    # NOTE: entries naming nothing here go to one spare column, dropped after the scatter.
    index = torch.where(index >= 0, index, length)
    padded = pad_queries(index, view)  # [B, Q, W]; padding queries (index 0) attend to nothing anyway
    keep = torch.zeros(*padded.shape[:2], length + 1, dtype=torch.bool, device=positions.device)
    keep.scatter_(2, padded, True)
    return keep[..., :length]


@register("dsa_sparse_mla", "torch")
def dsa_sparse_mla(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    kv_c: torch.Tensor,
    k_pe: torch.Tensor,
    cache: torch.Tensor,
    meta: AttentionMetadata,
    w_kc: torch.Tensor,
    w_vc: torch.Tensor,
    scale: float,
    selected: torch.Tensor,
    return_lse: bool = False,
    local: DCPLocalView | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """:func:`~flotilla.kernels.mla.mla_attention` (same arguments and results) over the selected
    context tokens only: ``selected[T, W]``, the indexer's selection (true positions, ``-1``
    padding; a shared IndexShare layer passes the previous full layer's)."""
    if q_nope.shape[0] == 0:
        return mla_attention(q_nope, q_pe, kv_c, k_pe, cache, meta, w_kc, w_vc, scale, return_lse=return_lse, local=local)
    keep = selection_mask(selected, meta, local)
    return mla_attention(
        q_nope, q_pe, kv_c, k_pe, cache, meta, w_kc, w_vc, scale, return_lse=return_lse, local=local, keep=keep
    )
