"""Decode context parallelism: the rank-local view of a step's metadata, and DCP-local MLA
over every rank's shard merged by LSE against mla_attention over the whole paged cache.

The scenario: sequences with prompts of 1 (shorter than dcp_size, so some ranks hold none
of its context), 5, 9 and 14 tokens prefilled in one ragged step, a second chunk for one of
them, then decode steps; local blocks of 2 tokens, so logical blocks of ``2 * dcp_size``
and every sequence's positions cross several block boundaries. Blocks are shuffled.

Tolerance: float32, atol 5e-5 on outputs, 1e-5 on the LSE. Each shard's attention is the same
float32 computation over a subset of the keys, summed in another order; the merge rescales by
exp(lse_shard - lse) and sums dcp_size parts. A K-term sum of |terms| adding up to S moves by
~u * S when reassociated (u = 2^-24 = 6e-8): the values c @ w_vc have K = 16, S <= 22 (1.3e-6),
and the score error (~u * 5) moves the output by about itself times |v| <= 14, the merge's
rescaling likewise. Measured <= 2.9e-6 on |out| <= 16 and 5e-7 on the LSE (MKL_CBWR,
ATEN_CPU_CAPABILITY, 1-3 threads). A key on the wrong rank, a wrong true position in the causal
mask or a NaN from an empty shard moves them by O(0.1) or more.
"""

import math

import pytest
import torch

from flotilla.kernels.dcp import build_dcp_local_view, dcp_local_view, local_context_lens
from flotilla.kernels.registry import get
from helpers.paged import build_meta

HEADS, NOPE, ROPE, RANK, VDIM = 3, 8, 4, 16, 6
LOCAL_BLOCK = 2
PROMPTS = (1, 5, 9, 14)
DECODE_STEPS = 3


def test_local_context_lens_counts_positions_of_the_rank():
    seq_lens = torch.tensor([0, 1, 2, 3, 7])
    for dcp in (1, 2, 3):
        for rank in range(dcp):
            expected = [sum(1 for p in range(n) if p % dcp == rank) for n in seq_lens.tolist()]
            assert local_context_lens(seq_lens, dcp, rank).tolist() == expected


def test_local_view_maps_logical_slots_to_owner_and_local_slot():
    """Token at position p in logical block b goes to rank p % dcp, local slot
    b * local_block + (p % L) // dcp; local entry j is position j * dcp + rank."""
    dcp, block = 3, LOCAL_BLOCK * 3
    tables = [[4, 1, 7], [2, 5]]
    meta = build_meta([(3, 8), (0, 2)], tables, block)  # positions 3..10 and 0..1
    positions = list(range(3, 11)) + [0, 1]
    seq_of = [0] * 8 + [1] * 2
    seen = []
    for rank in range(dcp):
        view = build_dcp_local_view(meta, dcp, rank)
        assert view.meta.block_size == LOCAL_BLOCK and torch.equal(view.meta.block_tables, meta.block_tables)
        for t, slot in zip(view.write_index.tolist(), view.meta.slot_mapping.tolist()):
            p = positions[t]
            assert p % dcp == rank
            assert slot == tables[seq_of[t]][p // block] * LOCAL_BLOCK + (p % block) // dcp
            seen.append(t)
        assert view.meta.seq_lens.tolist() == [len(range(rank, 11, dcp)), len(range(rank, 2, dcp))]
        assert view.key_positions[0, : view.meta.seq_lens[0]].tolist() == list(range(rank, 11, dcp))
    assert sorted(seen) == list(range(10))  # every new token is written by exactly one rank


def test_local_view_is_cached_per_step_and_rank():
    meta = build_meta([(0, 5)], [[0, 1]], 4)
    first = dcp_local_view(meta, 2, 1)
    assert dcp_local_view(meta, 2, 1) is first
    assert dcp_local_view(meta, 2, 0).dcp_rank == 0


def test_block_size_must_be_a_multiple_of_dcp():
    meta = build_meta([(0, 5)], [[0, 1]], 4)
    with pytest.raises(ValueError, match="dcp_size=3"):
        build_dcp_local_view(meta, 3, 0)
    with pytest.raises(ValueError, match="dcp_rank=2"):
        build_dcp_local_view(meta, 2, 2)


def _mla_inputs(num_new: int, generator: torch.Generator):
    return (
        torch.randn(num_new, HEADS, NOPE, generator=generator),
        torch.randn(num_new, HEADS, ROPE, generator=generator),
        torch.randn(num_new, RANK, generator=generator),
        torch.randn(num_new, ROPE, generator=generator),
    )


@pytest.mark.parametrize("dcp", [2, 3])
def test_dcp_local_mla_merged_equals_full_mla(dcp):
    generator = torch.Generator().manual_seed(dcp)
    block = LOCAL_BLOCK * dcp
    mla, merge_n, merge = get("mla_attention"), get("merge_attention_states_n"), get("merge_attention_states")
    w_kc = torch.randn(HEADS, NOPE, RANK, generator=generator) * 0.3
    w_vc = torch.randn(HEADS, RANK, VDIM, generator=generator)
    scale = 1 / math.sqrt(NOPE + ROPE)
    max_len = max(PROMPTS) + DECODE_STEPS + 4
    per_seq = -(-max_len // block)
    num_blocks = len(PROMPTS) * per_seq + 2
    order = torch.randperm(num_blocks, generator=generator).tolist()
    tables = [order[b * per_seq : (b + 1) * per_seq] for b in range(len(PROMPTS))]
    full_cache = torch.zeros(num_blocks, block, 1, RANK + ROPE)
    # NOTE: garbage in the local caches: anything read that was not written shows up.
    local_caches = [torch.randn(num_blocks, LOCAL_BLOCK, 1, RANK + ROPE, generator=generator) for _ in range(dcp)]

    steps = [[(0, n) for n in PROMPTS], [(PROMPTS[0], 1), (PROMPTS[1], 1), (PROMPTS[2], 4), (PROMPTS[3], 1)]]
    lens = [PROMPTS[0] + 1, PROMPTS[1] + 1, PROMPTS[2] + 4, PROMPTS[3] + 1]
    for _ in range(DECODE_STEPS):
        steps.append([(n, 1) for n in lens])
        lens = [n + 1 for n in lens]
    empty_shard_queries = 0
    for step, chunks in enumerate(steps):
        meta = build_meta(chunks, tables, block)
        inputs = _mla_inputs(int(meta.query_start[-1]), generator)
        full_out, full_lse = mla(*inputs, full_cache, meta, w_kc, w_vc, scale, return_lse=True)
        outs, lses = [], []
        for rank in range(dcp):
            view = dcp_local_view(meta, dcp, rank)
            out, lse = mla(*inputs, local_caches[rank], meta, w_kc, w_vc, scale, return_lse=True, local=view)
            assert not torch.isnan(out).any()
            assert torch.equal(out[torch.isneginf(lse)], torch.zeros_like(out[torch.isneginf(lse)]))
            empty_shard_queries += int(torch.isneginf(lse).any(dim=1).sum())
            outs.append(out)
            lses.append(lse)
        merged_out, merged_lse = merge_n(torch.stack(outs), torch.stack(lses))
        torch.testing.assert_close(merged_out, full_out, rtol=0, atol=5e-5, msg=lambda m: f"step {step}: {m}")
        torch.testing.assert_close(merged_lse, full_lse, rtol=0, atol=1e-5, msg=lambda m: f"step {step}: {m}")
        pairwise_out, pairwise_lse = outs[0], lses[0]
        for out, lse in zip(outs[1:], lses[1:]):
            pairwise_out, pairwise_lse = merge(pairwise_out, pairwise_lse, out, lse)
        torch.testing.assert_close(pairwise_out, full_out, rtol=0, atol=5e-5, msg=lambda m: f"step {step}: {m}")
    assert empty_shard_queries > 0  # the 1-token prompt's first query sees nothing on ranks >= 1

    # Every context token sits on exactly its owner rank, at its local slot.
    full_rows = full_cache.view(-1, RANK + ROPE)
    for b, n in enumerate(lens):
        for p in range(n):
            logical = tables[b][p // block] * block + p % block
            local = tables[b][p // block] * LOCAL_BLOCK + (p % block) // dcp
            assert torch.equal(local_caches[p % dcp].view(-1, RANK + ROPE)[local], full_rows[logical]), (b, p)


def test_dcp_local_mla_handles_an_empty_batch():
    meta = build_meta([(0, 0)], [[0]], 4)
    view = dcp_local_view(meta, 2, 1)
    cache = torch.zeros(2, 2, 1, RANK + ROPE)
    empty = _mla_inputs(0, torch.Generator().manual_seed(0))
    w_kc, w_vc = torch.zeros(HEADS, NOPE, RANK), torch.zeros(HEADS, RANK, VDIM)
    out, lse = get("mla_attention")(*empty, cache, meta, w_kc, w_vc, 1.0, return_lse=True, local=view)
    assert out.shape == (0, HEADS, VDIM) and lse.shape == (0, HEADS)
    out = get("mla_attention")(*empty, cache, meta, w_kc, w_vc, 1.0)
    assert out.shape == (0, HEADS, VDIM)
