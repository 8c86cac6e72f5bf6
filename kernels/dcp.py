"""Decode context parallelism (DCP): one rank's view of a step's attention metadata.

Under DCP the KV cache is sharded by token over the ``dcp_size`` ranks of a DCP group:
the token at context position ``p`` lives on DCP rank ``p % dcp_size``. Every rank
attends over its own shard and the partial results are merged with their log-sum-exp
(:mod:`flotilla.kernels.merge`).

Block layout. The scheduler sees LOGICAL blocks of ``L = dcp_size * local_block_size``
tokens; every rank's cache has the same number of blocks, each ``local_block_size`` long,
and a logical block id names the same block on every rank. Logical slot ``b*L + o`` holds
the token at a position ``p`` with ``p % L == o``, hence ``p % dcp_size == o % dcp_size``
(``L`` is a multiple of ``dcp_size``): it lives on DCP rank ``o % dcp_size`` at local slot
``b*local_block_size + o // dcp_size``. Read the other way, local entry ``j`` of a
sequence (its ``j``-th token on this rank) is position ``j*dcp_size + dcp_rank``, found in
local block ``block_tables[b, j // local_block_size]``, offset ``j % local_block_size``:
the local block tables are the logical ones, unchanged.

:func:`dcp_local_view` derives everything a rank needs from the step's logical
:class:`~flotilla.kernels.attention.AttentionMetadata` once per step (it is cached on the
metadata object, so every layer reuses it).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flotilla.kernels.attention import AttentionMetadata

# Attribute under which the view is cached on the step's metadata (one step, many layers).
_CACHE_ATTR = "_dcp_local_view"


@dataclass
class DCPLocalView:
    """What one DCP rank writes and attends to in one step.

    Attributes:
        dcp_size, dcp_rank: the DCP group width and this rank's index in it.
        write_index: ``[Tw]`` int64 indices (into the step's ``T`` new tokens) of the
            tokens this rank stores.
        meta: the rank-local metadata: ``slot_mapping[Tw]`` = local slots of the tokens in
            ``write_index``; ``seq_lens`` = local context lengths (how many of each
            sequence's positions this rank holds); ``block_tables`` the logical tables
            unchanged; ``block_size`` the local block size; ``query_start`` and
            ``max_query_len`` as in the logical metadata (every rank computes every query).
        key_positions: ``[B, max_local_len]`` int64 true context position of every local
            context entry (``j*dcp_size + dcp_rank``).
        mask: ``[B, max_query_len, max_local_len]`` bool: query ``i`` of sequence ``b`` (at
            true position ``seq_lens[b] - query_len[b] + i``) may see local entry ``j``
            (causal on TRUE positions, ``j`` inside the local context, ``i`` a real query).
    """

    dcp_size: int
    dcp_rank: int
    write_index: torch.Tensor
    meta: AttentionMetadata
    key_positions: torch.Tensor
    mask: torch.Tensor


def local_context_lens(seq_lens: torch.Tensor, dcp_size: int, dcp_rank: int) -> torch.Tensor:
    """How many of positions ``0 .. seq_len-1`` are ``== dcp_rank (mod dcp_size)``:
    ``ceil((seq_len - dcp_rank) / dcp_size)``, at least 0."""
    return torch.div(seq_lens - dcp_rank + dcp_size - 1, dcp_size, rounding_mode="floor").clamp(min=0)


def build_dcp_local_view(meta: AttentionMetadata, dcp_size: int, dcp_rank: int) -> DCPLocalView:
    """The rank-local view of ``meta`` (a step's logical metadata); see :class:`DCPLocalView`.

    Raises ValueError when ``dcp_rank`` is outside ``[0, dcp_size)`` or the logical block
    size ``meta.block_size`` is not a multiple of ``dcp_size``.
    """
    if dcp_size < 1 or not 0 <= dcp_rank < dcp_size:
        raise ValueError(f"dcp_rank={dcp_rank} must be in [0, dcp_size={dcp_size})")
    logical = meta.block_size
    if logical % dcp_size:
        raise ValueError(
            f"the logical block size {logical} must be a multiple of dcp_size={dcp_size} "
            f"(the runner reports dcp_size * local block size)"
        )
    local_block = logical // dcp_size
    offsets = meta.slot_mapping % logical
    write_index = torch.nonzero(offsets % dcp_size == dcp_rank).flatten()
    owned = meta.slot_mapping.index_select(0, write_index)
    local_slots = (owned // logical) * local_block + (owned % logical) // dcp_size
    local_lens = local_context_lens(meta.seq_lens, dcp_size, dcp_rank)
    max_local = int(local_lens.max()) if local_lens.numel() else 0
    device = meta.seq_lens.device
    local_meta = AttentionMetadata(
        slot_mapping=local_slots,
        query_start=meta.query_start,
        seq_lens=local_lens,
        block_tables=meta.block_tables,
        max_query_len=meta.max_query_len,
        max_seq_len=max_local,
        block_size=local_block,
    )
    j = torch.arange(max_local, device=device)
    key_positions = (j * dcp_size + dcp_rank).unsqueeze(0).expand(meta.num_seqs, -1)
    query_lens = meta.query_lens
    q_index = torch.arange(meta.max_query_len, device=device)
    q_pos = (meta.seq_lens - query_lens).unsqueeze(1) + q_index.unsqueeze(0)  # [B, Q] true positions
    mask = key_positions.unsqueeze(1) <= q_pos.unsqueeze(2)
    mask &= j.view(1, 1, -1) < local_lens.view(-1, 1, 1)
    mask &= q_index.view(1, -1, 1) < query_lens.view(-1, 1, 1)
    return DCPLocalView(dcp_size, dcp_rank, write_index, local_meta, key_positions, mask)


def dcp_local_view(meta: AttentionMetadata, dcp_size: int, dcp_rank: int) -> DCPLocalView:
    """:func:`build_dcp_local_view`, computed once per step: the first call stores the view
    on ``meta`` and later calls (the other layers of the same step) return it.

    NOTE: a step's metadata is built fresh every step and never mutated afterwards, so the
    cached view cannot go stale; the cache is keyed by ``(dcp_size, dcp_rank)``.
    """
    cached = getattr(meta, _CACHE_ATTR, None)
    if cached is not None and (cached.dcp_size, cached.dcp_rank) == (dcp_size, dcp_rank):
        return cached
    view = build_dcp_local_view(meta, dcp_size, dcp_rank)
    setattr(meta, _CACHE_ATTR, view)
    return view
