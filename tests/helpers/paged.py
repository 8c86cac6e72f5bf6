"""Drive a model over a paged KV cache by hand (model tests without the engine)."""

from __future__ import annotations

import torch

from flotilla.kernels.attention import AttentionMetadata


def build_meta(chunks: list[tuple[int, int]], block_tables: list[list[int]], block_size: int) -> AttentionMetadata:
    """Metadata for one step: sequence ``b`` adds ``chunks[b] = (start, count)`` tokens at
    context positions ``start .. start+count-1``, its blocks being ``block_tables[b]``."""
    slots, query_start, seq_lens = [], [0], []
    for (start, count), blocks in zip(chunks, block_tables):
        slots += [blocks[p // block_size] * block_size + p % block_size for p in range(start, start + count)]
        query_start.append(query_start[-1] + count)
        seq_lens.append(start + count)
    width = max(len(b) for b in block_tables)
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots),
        query_start=torch.tensor(query_start),
        seq_lens=torch.tensor(seq_lens),
        block_tables=torch.tensor([b + [0] * (width - len(b)) for b in block_tables]),
        max_query_len=max(c for _, c in chunks),
        max_seq_len=max(seq_lens),
        block_size=block_size,
    )


class PagedRunner:
    """Steps a model over a paged cache; sequence ``b`` owns blocks ``b+1, b+1+B, ...``
    (interleaved, so no sequence's blocks are contiguous; block 0 stays unused)."""

    def __init__(self, model, num_seqs: int, max_len: int, block_size: int = 4):
        per_seq = -(-max_len // block_size)
        self.model, self.block_size = model, block_size
        self.caches = model.kv_cache_spec().allocate(num_seqs * per_seq + 1, block_size)
        self.tables = [[b + i * num_seqs + 1 for i in range(per_seq)] for b in range(num_seqs)]
        self.lens = [0] * num_seqs

    @torch.no_grad()
    def step(self, new_tokens: dict[int, list[int]]) -> dict[int, torch.Tensor]:
        """Feed ``{seq: tokens}`` as one varlen batch; returns each sequence's logits ``[n, V]``."""
        seqs = sorted(new_tokens)
        chunks = [(self.lens[s], len(new_tokens[s])) for s in seqs]
        ids = torch.tensor([t for s in seqs for t in new_tokens[s]])
        positions = torch.cat([torch.arange(start, start + n) for start, n in chunks])
        meta = build_meta(chunks, [self.tables[s] for s in seqs], self.block_size)
        logits = self.model.compute_logits(self.model(ids, positions, self.caches, meta))
        for s in seqs:
            self.lens[s] += len(new_tokens[s])
        return dict(zip(seqs, logits.split([n for _, n in chunks])))
