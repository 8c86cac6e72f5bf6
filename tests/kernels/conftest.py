"""Builds paged batches for the attention tests: each sequence has some cached
context and some new tokens, its blocks scattered over the cache in random order."""

from dataclasses import dataclass

import pytest
import torch

from flotilla.kernels.attention import AttentionMetadata


@dataclass
class PagedBatch:
    """A step's metadata plus what the naive references need.

    Attributes:
        meta: the step's AttentionMetadata (new tokens only in slot_mapping).
        num_blocks: cache blocks to allocate.
        cached_lens, new_lens: per-sequence token counts.
        slots: per sequence, the cache slot of every context position ``[seq_len]``.
    """

    meta: AttentionMetadata
    num_blocks: int
    cached_lens: list[int]
    new_lens: list[int]
    slots: list[torch.Tensor]

    @property
    def cached_slots(self) -> torch.Tensor:
        return torch.cat([s[:c] for s, c in zip(self.slots, self.cached_lens)])

    def new_token_ranges(self):
        """``(seq, start, end)`` of each sequence's new tokens in the flattened batch."""
        start = 0
        for b, n in enumerate(self.new_lens):
            yield b, start, start + n
            start += n


def build_paged_batch(cached_lens, new_lens, block_size=4, seed=0) -> PagedBatch:
    generator = torch.Generator().manual_seed(seed)
    seq_lens = [c + n for c, n in zip(cached_lens, new_lens)]
    blocks_per_seq = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(blocks_per_seq) + 2  # spare blocks stay unused (garbage if read)
    order = torch.randperm(num_blocks, generator=generator)
    block_tables = torch.zeros(len(seq_lens), max(blocks_per_seq), dtype=torch.int64)
    slots, new_slots, used = [], [], 0
    for b, (cached, seq_len, nb) in enumerate(zip(cached_lens, seq_lens, blocks_per_seq)):
        block_tables[b, :nb] = order[used : used + nb]
        used += nb
        positions = torch.arange(seq_len)
        seq_slots = block_tables[b, positions // block_size] * block_size + positions % block_size
        slots.append(seq_slots)
        new_slots.append(seq_slots[cached:])
    query_start = torch.zeros(len(seq_lens) + 1, dtype=torch.int64)
    query_start[1:] = torch.cumsum(torch.tensor(new_lens), 0)
    meta = AttentionMetadata(
        slot_mapping=torch.cat(new_slots),
        query_start=query_start,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int64),
        block_tables=block_tables,
        max_query_len=max(new_lens),
        max_seq_len=max(seq_lens),
        block_size=block_size,
    )
    return PagedBatch(meta, num_blocks, list(cached_lens), list(new_lens), slots)


# Batches every attention test runs over: prefill, ragged prefill, chunked prefill
# (cached + new), decode, and a mix.
BATCH_SHAPES = {
    "prefill": ([0], [7]),
    "ragged-prefill": ([0, 0, 0], [5, 1, 9]),
    "chunked-prefill": ([6, 3], [4, 5]),
    "decode": ([5, 12, 1], [1, 1, 1]),
    "mixed": ([9, 0, 4], [1, 6, 3]),
}


@pytest.fixture(params=list(BATCH_SHAPES))
def paged_batch(request) -> PagedBatch:
    cached, new = BATCH_SHAPES[request.param]
    return build_paged_batch(cached, new)


@pytest.fixture
def make_paged_batch():
    """The :func:`build_paged_batch` builder, for tests that need a specific shape."""
    return build_paged_batch
