"""Paged-attention steps for the flashinfer GPU tests: metadata with the CPU page layout the
planners read, random cache blocks (never the scratch block 0), and one cached planner per shape."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from flotilla.kernels.attention import AttentionMetadata, AttentionShape, page_layout


@dataclass
class Step:
    """One step's metadata (device tensors plus the CPU page layout) and its token counts."""

    meta: AttentionMetadata
    cached_lens: list[int]
    new_lens: list[int]

    @property
    def num_tokens(self) -> int:
        return sum(self.new_lens)


def build_step(cached_lens, new_lens, block_size, blocks: list[list[int]], device="cuda") -> Step:
    """Metadata for sequences owning ``blocks[b]`` (enough for their contexts)."""
    seq_lens = [c + n for c, n in zip(cached_lens, new_lens)]
    slots, query_start = [], [0]
    for cached, seq_len, table in zip(cached_lens, seq_lens, blocks):
        slots += [table[p // block_size] * block_size + p % block_size for p in range(cached, seq_len)]
        query_start.append(query_start[-1] + seq_len - cached)
    width = max(len(t) for t in blocks)
    page_indptr, page_indices, last_page_len = page_layout(seq_lens, blocks, block_size)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.long, device=device),
        query_start=torch.tensor(query_start, dtype=torch.long, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.long, device=device),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in blocks], dtype=torch.long, device=device),
        max_query_len=max(new_lens),
        max_seq_len=max(seq_lens),
        block_size=block_size,
        page_indptr=page_indptr,
        page_indices=page_indices,
        last_page_len=last_page_len,
        query_start_cpu=torch.tensor(query_start, dtype=torch.int32),
        seq_lens_cpu=torch.tensor(seq_lens, dtype=torch.int32),
    )
    return Step(meta, list(cached_lens), list(new_lens))


def random_blocks(seq_lens, block_size, num_blocks, generator) -> list[list[int]]:
    """Distinct random blocks per sequence, never the scratch block."""
    order = (torch.randperm(num_blocks - 1, generator=generator) + 1).tolist()
    tables, used = [], 0
    for seq_len in seq_lens:
        pages = -(-seq_len // block_size)
        tables.append(order[used : used + pages])
        used += pages
    assert used <= num_blocks - 1, "test bug: not enough cache blocks"
    return tables


@functools.lru_cache(maxsize=None)
def planner_for(shape: AttentionShape, block_size: int, graph_batch_sizes=(), max_num_pages=4096, triton_decode=True):
    """The flashinfer planner for ``shape``; ``triton_decode=False`` keeps small decode batches
    on flashinfer's decode kernels too (``kernels/triton_decode_attention.py``'s switch)."""
    from flotilla.kernels import triton_decode_attention
    from flotilla.kernels.registry import get

    before = triton_decode_attention.ENABLED
    triton_decode_attention.ENABLED = triton_decode
    try:
        return get("attention_planner", "flashinfer")(
            shape, "cuda", block_size=block_size, max_num_seqs=64, max_num_pages=max_num_pages,
            graph_batch_sizes=graph_batch_sizes,
        )  # fmt: skip
    finally:
        triton_decode_attention.ENABLED = before


def decode_kind(num_seqs: int, triton_decode: bool, graph: bool = False) -> str:
    """The plan kind the flashinfer planner gives a decode step of ``num_seqs`` sequences
    (padding included)."""
    from flotilla.kernels import triton_decode_attention

    on_triton = triton_decode and num_seqs <= triton_decode_attention.MAX_BATCH
    return ("triton-" if on_triton else "") + ("graph-decode" if graph else "decode")
