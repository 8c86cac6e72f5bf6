"""DeepSeek sparse attention ops (torch reference): the indexer's top-k over a paged context
against a per-query brute force of its formula, the DCP-sharded indexer (each rank's shard, the
group's top-k merged) against the whole cache, and sparse MLA against dense MLA over exactly the
selected tokens.

The scenario: a ragged step of prompts of 3, 9 and 14 tokens (the first sees fewer tokens than
the top-k of 6 keeps), a second chunk of 5 for one of them over its cached context, then decode
steps; blocks of 4 tokens, shuffled.

Tolerance: the selections are compared as exact position sets. Both sides compute each score with
the same float32 formula in a different summation order (~1e-6 on scores of magnitude ~3), so a
selection could differ only where two scores lie closer than that; the test data is continuous
random (no ties), and the brute force checks that every boundary here is wider than 1e-4. Scores:
atol 1e-5. Sparse against dense MLA over the same tokens: atol 1e-5 (the same float32 sums; the
masked keys add exact zeros).
"""

from __future__ import annotations

import torch

from flotilla.kernels.dcp import dcp_local_view
from flotilla.kernels.dsa import merge_topk, selection_mask, topk_width
from flotilla.kernels.registry import get
from helpers.paged import build_meta

HEADS, DIM, TOPK = 5, 8, 6
SCALE = DIM**-0.5
BLOCK = 4


def _steps():
    """Each step: ``[(seq, start, count)]``; sequence lengths grow 3, 9, 14 -> +5 -> decodes."""
    return [
        [(0, 0, 3), (1, 0, 9), (2, 0, 14)],
        [(1, 9, 5)],
        [(0, 3, 1), (1, 14, 1), (2, 14, 1)],
        [(0, 4, 1), (1, 15, 1), (2, 15, 1)],
    ]


def _tables(num_blocks: int = 24) -> list[list[int]]:
    order = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(3)).tolist()
    return [order[0:6], order[6:12], order[12:18]]


def _brute_force(q, w, keys_of_seq, start):
    """Per query of one chunk: the index scores over positions 0..its own, and the top-k set."""
    out = []
    for i in range(q.shape[0]):
        pos = start + i
        k = keys_of_seq[: pos + 1]  # [pos+1, D]
        scores = (w[i].unsqueeze(1) * torch.relu(SCALE * q[i] @ k.T)).sum(0)  # [pos+1]
        count = min(TOPK, pos + 1)
        best = scores.topk(count)
        if pos + 1 > TOPK:
            ordered = scores.sort(descending=True).values
            assert float(ordered[TOPK - 1] - ordered[TOPK]) > 1e-4, "test data with a near-tie"
        out.append((set(best.indices.tolist()), best.values))
    return out


def test_indexer_selects_the_top_k_of_each_querys_visible_context():
    generator = torch.Generator().manual_seed(0)
    indexer = get("dsa_indexer")
    tables = _tables()
    cache = torch.zeros(24, BLOCK, 1, DIM)
    keys = {b: torch.randn(20, DIM, generator=generator) for b in range(3)}
    for step in _steps():
        chunks = [(start, count) for _, start, count in step]
        meta = build_meta(chunks, [tables[b] for b, _, _ in step], BLOCK)
        q = torch.randn(sum(c for _, c in chunks), HEADS, DIM, generator=generator)
        w = torch.randn(q.shape[0], HEADS, generator=generator)
        k = torch.cat([keys[b][start : start + count] for b, start, count in step])
        values, positions = indexer(q, w, k, cache, meta, TOPK, SCALE)
        width = topk_width(meta, TOPK)
        assert positions.shape == values.shape == (q.shape[0], width)
        row = 0
        for b, start, count in step:
            expected = _brute_force(q[row : row + count], w[row : row + count], keys[b], start)
            for i, (want, want_values) in enumerate(expected):
                got = positions[row + i]
                assert set(got[got >= 0].tolist()) == want
                assert int((got < 0).sum()) == width - len(want)  # padding past what the query sees
                torch.testing.assert_close(values[row + i, : len(want)], want_values, atol=1e-5, rtol=0)
            row += count


def _dcp_run(dcp: int):
    """The scenario's selections with the index cache sharded over ``dcp`` ranks (each rank
    scores its shard, the group's top-k merged), and on one rank; returns both per step."""
    generator = torch.Generator().manual_seed(1)
    indexer = get("dsa_indexer")
    tables = _tables()
    whole = torch.zeros(24, BLOCK * dcp, 1, DIM)
    shards = [torch.zeros(24, BLOCK, 1, DIM) for _ in range(dcp)]
    keys = {b: torch.randn(20, DIM, generator=generator) for b in range(3)}
    results = []
    for step in _steps():
        chunks = [(start, count) for _, start, count in step]
        meta = build_meta(chunks, [tables[b] for b, _, _ in step], BLOCK * dcp)
        q = torch.randn(sum(c for _, c in chunks), HEADS, DIM, generator=generator)
        w = torch.randn(q.shape[0], HEADS, generator=generator)
        k = torch.cat([keys[b][start : start + count] for b, start, count in step])
        _, single = indexer(q, w, k, whole, meta, TOPK, SCALE)
        candidates = [indexer(q, w, k, shards[r], meta, TOPK, SCALE, local=dcp_local_view(meta, dcp, r)) for r in range(dcp)]
        merged = merge_topk(
            torch.stack([v for v, _ in candidates]), torch.stack([p for _, p in candidates]), topk_width(meta, TOPK)
        )
        results.append((meta, single, merged))
    return results, shards


def test_dcp_shards_merge_to_the_whole_caches_selection():
    for dcp in (2, 3):
        results, _ = _dcp_run(dcp)
        for _, single, merged in results:
            assert [set(r[r >= 0].tolist()) for r in merged] == [set(r[r >= 0].tolist()) for r in single]


def test_selection_mask_marks_the_selected_entries_of_the_whole_and_of_a_shard():
    meta = build_meta([(0, 3), (4, 2)], [[0, 1], [2, 3]], 4)  # seq lens 3 and 6
    selected = torch.tensor([[0, -1], [1, 0], [2, 1], [5, 3], [0, -1]])
    keep = selection_mask(selected, meta)
    assert keep.shape == (2, 3, 6)
    assert keep[0, 1].tolist() == [True, True, False, False, False, False]
    assert keep[1, 0].tolist() == [False, False, False, True, False, True]
    assert keep[1, 1].tolist() == [True, False, False, False, False, False]
    local = dcp_local_view(meta, 2, 1)  # rank 1 holds positions 1, 3, 5
    keep = selection_mask(selected, meta, local)
    assert keep.shape == (2, 3, 3)
    assert keep[0, 1].tolist() == [True, False, False] and keep[1, 0].tolist() == [False, True, True]


def _mla_inputs(tokens: int, generator: torch.Generator):
    heads, nope, rope, rank, vdim = 3, 8, 4, 16, 6
    return (
        torch.randn(tokens, heads, nope, generator=generator),
        torch.randn(tokens, heads, rope, generator=generator),
        torch.randn(tokens, rank, generator=generator),
        torch.randn(tokens, rope, generator=generator),
        torch.randn(heads, nope, rank, generator=generator) / 3,
        torch.randn(heads, rank, vdim, generator=generator) / 4,
    )


def test_sparse_mla_is_dense_mla_over_the_selected_tokens():
    generator = torch.Generator().manual_seed(2)
    sparse, dense = get("dsa_sparse_mla"), get("mla_attention")
    meta = build_meta([(0, 9), (0, 4)], [[3, 0, 5], [1, 4]], 4)
    q_nope, q_pe, kv_c, k_pe, w_kc, w_vc = _mla_inputs(13, generator)
    # Query t of sequence 0 keeps positions {0, t - 1, t}; sequence 1's queries keep up to 3 of theirs
    # (the last one drops itself).
    selected = [[0, t, max(t - 1, 0)] for t in range(9)] + [[0, -1, -1], [0, 1, -1], [0, 1, 2], [0, 1, 2]]
    selected = torch.tensor(selected)
    got = sparse(q_nope, q_pe, kv_c, k_pe, torch.zeros(6, 4, 1, 20), meta, w_kc, w_vc, 0.3, selected)
    # Dense MLA of each query alone over exactly its kept tokens: a one-sequence step whose last row
    # is the query (it sees every row; k_pe is already rotated, so where a key sits does not matter).
    for t in range(13):
        base, pos = (0, t) if t < 9 else (9, t - 9)
        rows = [base + p for p in sorted({int(p) for p in selected[t] if p >= 0})]
        last = torch.tensor([len(rows) - 1])
        out = dense(
            torch.zeros(len(rows), 3, 8).index_copy(0, last, q_nope[t : t + 1]),
            torch.zeros(len(rows), 3, 4).index_copy(0, last, q_pe[t : t + 1]),
            kv_c[rows], k_pe[rows], torch.zeros(6, 4, 1, 20), build_meta([(0, len(rows))], [[0, 1, 2]], 4), w_kc, w_vc, 0.3,
        )  # fmt: skip
        torch.testing.assert_close(got[t], out[-1], atol=1e-5, rtol=0)


def test_a_selection_of_everything_is_dense_mla():
    generator = torch.Generator().manual_seed(4)
    sparse, dense = get("dsa_sparse_mla"), get("mla_attention")
    meta = build_meta([(0, 7), (0, 3)], [[2, 0], [1]], 4)
    inputs = _mla_inputs(10, generator)
    q_nope, q_pe, kv_c, k_pe, w_kc, w_vc = inputs
    everything = torch.tensor([list(range(7))] * 7 + [[0, 1, 2, -1, -1, -1, -1]] * 3)
    got, lse = sparse(q_nope, q_pe, kv_c, k_pe, torch.zeros(3, 4, 1, 20), meta, w_kc, w_vc, 0.3, everything, return_lse=True)
    want, want_lse = dense(q_nope, q_pe, kv_c, k_pe, torch.zeros(3, 4, 1, 20), meta, w_kc, w_vc, 0.3, return_lse=True)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    torch.testing.assert_close(lse, want_lse, atol=1e-5, rtol=0)


def test_an_empty_step_gives_empty_selections():
    meta = build_meta([(0, 1)], [[0]], 4)
    empty = meta.__class__(
        slot_mapping=torch.zeros(0, dtype=torch.int64), query_start=torch.zeros(1, dtype=torch.int64),
        seq_lens=torch.zeros(0, dtype=torch.int64), block_tables=torch.zeros(0, 1, dtype=torch.int64),
        max_query_len=0, max_seq_len=0, block_size=4,
    )  # fmt: skip
    values, positions = get("dsa_indexer")(
        torch.zeros(0, HEADS, DIM), torch.zeros(0, HEADS), torch.zeros(0, DIM), torch.zeros(2, 4, 1, DIM), empty, TOPK, SCALE
    )
    assert values.shape == positions.shape == (0, 0)
    assert meta.num_seqs == 1
