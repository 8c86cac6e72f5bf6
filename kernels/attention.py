"""Paged attention: the batch layout every attention backend consumes, and the
torch reference implementation.

A step processes ``T`` new tokens belonging to ``B`` sequences, flattened in
sequence order (a varlen batch). Sequence ``b`` owns new tokens
``query_start[b]:query_start[b+1]``; after this step its context (cached plus
new tokens) is ``seq_lens[b]`` long, and its new tokens sit at the last
positions of that context. KV caches are paged: ``k_cache[num_blocks,
block_size, num_kv_heads, head_dim]``; ``block_tables[b, i]`` is the cache block
holding context tokens ``i*block_size .. (i+1)*block_size-1`` of sequence ``b``;
``slot_mapping[t] = block * block_size + offset`` is where new token ``t``'s K/V
is written.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from flotilla.kernels.registry import register


@dataclass
class AttentionMetadata:
    """Where a step's new tokens go and what each sequence attends to.

    Attributes:
        slot_mapping: ``[T]`` int64 cache slot of each new token.
        query_start: ``[B+1]`` int64 cumulative new-token counts (``query_start[0] == 0``).
        seq_lens: ``[B]`` int64 context length of each sequence after this step.
        block_tables: ``[B, max_blocks]`` int64 cache blocks per sequence (padding is 0).
        max_query_len: the largest new-token count in the batch.
        max_seq_len: the largest ``seq_lens`` entry.
        block_size: tokens per cache block.
    """

    slot_mapping: torch.Tensor
    query_start: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    max_query_len: int
    max_seq_len: int
    block_size: int

    @property
    def num_seqs(self) -> int:
        return int(self.seq_lens.shape[0])

    @property
    def is_decode(self) -> bool:
        """Every sequence contributes exactly one new token."""
        return self.max_query_len == 1

    @property
    def query_lens(self) -> torch.Tensor:
        return self.query_start[1:] - self.query_start[:-1]


@register("write_kv", "torch")
def write_kv(cache: torch.Tensor, slot_mapping: torch.Tensor, values: torch.Tensor) -> None:
    """Store ``values[T, ...]`` at ``slot_mapping`` in ``cache[num_blocks, block_size, ...]``."""
    flat = cache.view(-1, *cache.shape[2:])
    flat.index_copy_(0, slot_mapping, values.to(cache.dtype))


def context_slots(meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
    """``(slots[B, max_seq_len], valid[B, max_seq_len])``: the cache slot of every
    context position of every sequence, and which positions exist."""
    positions = torch.arange(meta.max_seq_len, device=meta.block_tables.device)
    blocks = meta.block_tables.gather(
        1, (positions // meta.block_size).clamp(max=meta.block_tables.shape[1] - 1).expand(meta.num_seqs, -1)
    )
    slots = blocks * meta.block_size + positions % meta.block_size
    valid = positions.unsqueeze(0) < meta.seq_lens.unsqueeze(1)
    return slots, valid


@register("gather_kv", "torch")
def gather_kv(cache: torch.Tensor, meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
    """Each sequence's whole context from the paged cache: ``([B, max_seq_len, ...], valid[B, max_seq_len])``.
    Invalid (padding) positions hold arbitrary values."""
    blocks_needed = -(-meta.max_seq_len // meta.block_size)
    if meta.block_tables.shape[1] < blocks_needed:
        slots, valid = context_slots(meta)
        flat = cache.view(-1, *cache.shape[2:])
        return flat[slots.masked_fill(~valid, 0)], valid
    # NOTE: gathering whole blocks (one index per block, not per token) is several times
    # faster on CPU; the tail past each sequence's length is padding.
    tables = meta.block_tables[:, :blocks_needed]
    blocks = cache.flatten(1).index_select(0, tables.flatten())  # index_select: ~10x faster than cache[tables]
    context = blocks.view(meta.num_seqs, blocks_needed * meta.block_size, *cache.shape[2:])[:, : meta.max_seq_len]
    positions = torch.arange(meta.max_seq_len, device=meta.seq_lens.device)
    return context, positions.unsqueeze(0) < meta.seq_lens.unsqueeze(1)


def causal_context_mask(meta: AttentionMetadata) -> torch.Tensor:
    """``[B, max_query_len, max_seq_len]`` bool: new token ``i`` of sequence ``b``
    (at context position ``seq_lens[b] - query_len[b] + i``) sees positions ``<=`` its own."""
    query_lens = meta.query_lens
    q_index = torch.arange(meta.max_query_len, device=query_lens.device)
    q_pos = (meta.seq_lens - query_lens).unsqueeze(1) + q_index.unsqueeze(0)  # [B, Q]
    k_pos = torch.arange(meta.max_seq_len, device=query_lens.device)
    mask = k_pos.view(1, 1, -1) <= q_pos.unsqueeze(2)
    mask &= (k_pos.view(1, 1, -1) < meta.seq_lens.view(-1, 1, 1))
    return mask & (q_index.view(1, -1, 1) < query_lens.view(-1, 1, 1))


def pad_queries(x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
    """Scatter varlen rows ``x[T, ...]`` into ``[B, max_query_len, ...]`` (zeros as padding)."""
    if meta.is_decode:
        return x.unsqueeze(1)
    out = x.new_zeros(meta.num_seqs, meta.max_query_len, *x.shape[1:])
    index = _query_index(meta)
    out.view(-1, *x.shape[1:])[index] = x
    return out


def unpad_queries(x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
    """The inverse of :func:`pad_queries`: ``[B, max_query_len, ...] -> [T, ...]``."""
    if meta.is_decode:
        return x.squeeze(1)
    return x.reshape(-1, *x.shape[2:])[_query_index(meta)]


def _query_index(meta: AttentionMetadata) -> torch.Tensor:
    lens = meta.query_lens
    seq = torch.repeat_interleave(torch.arange(meta.num_seqs, device=lens.device), lens)
    within = torch.arange(int(lens.sum()), device=lens.device) - meta.query_start[:-1].repeat_interleave(lens)
    return seq * meta.max_query_len + within


@register("paged_attention", "torch")
def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Causal attention of the new tokens over their whole paged context.

    ``q[T, Hq, D]``, ``k``/``v[T, Hkv, D]`` (GQA when ``Hq > Hkv``). Writes the new
    K/V into the caches first, then attends. Returns ``[T, Hq, Dv]``; an empty batch
    (``T == 0``, zero sequences: an idle DP-attention rank) gives ``[0, Hq, Dv]`` and
    leaves the caches untouched.
    """
    if q.shape[0] == 0:
        # NOTE: nothing to write or attend to; return before building zero-size masks and
        # calling SDPA on an empty batch (the CPU path copes, not every SDPA backend is known to).
        return q.new_empty(0, q.shape[1], v.shape[-1])
    write_kv(k_cache, meta.slot_mapping, k)
    write_kv(v_cache, meta.slot_mapping, v)
    keys, valid = gather_kv(k_cache, meta)  # [B, L, Hkv, D]
    values, _ = gather_kv(v_cache, meta)
    # NOTE: a decode's one new token is the last of its context, so causality is just validity.
    mask = valid.unsqueeze(1) if meta.is_decode else causal_context_mask(meta)  # [B, Q, L]
    if sliding_window is not None:
        q_pos = (meta.seq_lens - meta.query_lens).unsqueeze(1) + torch.arange(meta.max_query_len).unsqueeze(0)
        k_pos = torch.arange(meta.max_seq_len)
        mask &= k_pos.view(1, 1, -1) > (q_pos.unsqueeze(2) - sliding_window)
    queries = pad_queries(q, meta).transpose(1, 2)  # [B, Hq, Q, D]
    keys = keys.transpose(1, 2).to(q.dtype)  # [B, Hkv, L, D]
    values = values.transpose(1, 2).to(q.dtype)
    # NOTE: enable_gqa shares each K/V head among its Hq/Hkv query heads without copying them.
    out = F.scaled_dot_product_attention(
        queries, keys, values, attn_mask=mask.unsqueeze(1), scale=scale, enable_gqa=q.shape[1] != k.shape[1]
    )
    return unpad_queries(out.transpose(1, 2), meta)
