"""merge_attention_states: attention over a split context, merged, equals attention
over the whole context; empty shards contribute nothing and never produce NaN."""

import torch

from flotilla.kernels.registry import get

T, H, D, L = 3, 2, 8, 10


def _inputs():
    torch.manual_seed(0)
    return torch.randn(T, H, D), torch.randn(L, H, D), torch.randn(L, H, D)


def _attend_v(q, k, v, keep):
    """Attention of q[T,H,D] over the keys where keep[L]: (out, lse); no keys gives (NaN, -inf)."""
    scores = torch.einsum("thd,lhd->thl", q, k).masked_fill(~keep, float("-inf"))
    return torch.einsum("thl,lhd->thd", scores.softmax(-1), v), torch.logsumexp(scores, -1)


def test_split_context_merges_to_full_attention():
    q, k, v = _inputs()
    shard = torch.arange(L) % 3 == 0  # an interleaved split, as DCP shards the cache
    out_a, lse_a = _attend_v(q, k, v, shard)
    out_b, lse_b = _attend_v(q, k, v, ~shard)
    out, lse = get("merge_attention_states")(out_a, lse_a, out_b, lse_b)
    full_out, full_lse = _attend_v(q, k, v, torch.ones(L, dtype=torch.bool))
    # fp32, the same scores (one einsum, then masked); the softmax sums, the 10-term value sums
    # (sum p|v| <= 2.5: ~u * 2.5 = 1.5e-7, u = 2^-24) and the merge differ. The merge's
    # exp(lse_part - lse) carries the rounding of |lse| <= 5 (~2u * 5 = 6e-7 relative) into
    # |out| <= 1.5: <= 9e-7. Measured <= 2.4e-7 on both (MKL_CBWR, ATEN_CPU_CAPABILITY, 1-3
    # threads) -> atol 2e-6. A missing or doubled shard moves them by O(0.1).
    torch.testing.assert_close(out, full_out, rtol=0, atol=2e-6)
    torch.testing.assert_close(lse, full_lse, rtol=0, atol=2e-6)


def test_empty_shard_contributes_nothing():
    q, k, v = _inputs()
    everything = torch.ones(L, dtype=torch.bool)
    out_a, lse_a = _attend_v(q, k, v, everything)
    out_b, lse_b = _attend_v(q, k, v, ~everything)  # no keys: NaN output, -inf lse
    assert torch.isnan(out_b).all() and torch.isneginf(lse_b).all()
    out, lse = get("merge_attention_states")(out_a, lse_a, out_b, lse_b)
    torch.testing.assert_close(out, out_a, rtol=0, atol=0)
    torch.testing.assert_close(lse, lse_a, rtol=0, atol=0)
    out, lse = get("merge_attention_states")(out_b, lse_b, out_a, lse_a)  # either side
    torch.testing.assert_close(out, out_a, rtol=0, atol=0)


def test_two_empty_shards_give_zero_and_neg_inf():
    nan_out, empty_lse = torch.full((T, H, D), float("nan")), torch.full((T, H), float("-inf"))
    out, lse = get("merge_attention_states")(nan_out, empty_lse, nan_out, empty_lse)
    assert torch.equal(out, torch.zeros(T, H, D))
    assert torch.isneginf(lse).all()


def test_bf16_output_keeps_dtype():
    q, k, v = _inputs()
    shard = torch.arange(L) < 4
    out_a, lse_a = _attend_v(q, k, v, shard)
    out_b, lse_b = _attend_v(q, k, v, ~shard)
    out, lse = get("merge_attention_states")(out_a.bfloat16(), lse_a, out_b.bfloat16(), lse_b)
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    full_out, _ = _attend_v(q, k, v, torch.ones(L, dtype=torch.bool))
    # Inputs rounded to bf16 (rel 2^-8) then merged and rounded again: ~1e-2 at |out| ~ 1.
    torch.testing.assert_close(out.float(), full_out, rtol=0, atol=2e-2)


# --- the LSE property under DCP-style sharding ----------------------------------------


def _merge_pairwise(outs, lses):
    out, lse = outs[0], lses[0]
    for o, l in zip(outs[1:], lses[1:]):
        out, lse = get("merge_attention_states")(out, lse, o, l)
    return out, lse


def test_random_shards_including_empty_merge_to_full_attention():
    """Property: for random shapes and a random assignment of the context's keys to
    ``n`` shards (some of them empty, for some queries every shard but one), attention
    over each shard merged by LSE, pairwise and n-way, equals attention over the whole
    context.

    Tolerance: atol 1e-5 in float32. Each shard's softmax is exact up to rounding
    (~1e-7 relative); the merge rescales by exp(lse_part - lse) and sums <= 6 parts, so
    outputs of magnitude ~3 (unit-normal values) move by a few 1e-7. A wrong weight (a
    missing or doubled shard, a NaN from an empty one) moves them by O(0.1) or more.
    """
    generator = torch.Generator().manual_seed(0)
    merge_n = get("merge_attention_states_n")
    empty_shards = 0
    for trial in range(40):
        t, h, d = (int(torch.randint(1, 6, (1,), generator=generator)) for _ in range(3))
        length = int(torch.randint(1, 24, (1,), generator=generator))
        shards = int(torch.randint(2, 7, (1,), generator=generator))
        q, k, v = (torch.randn(n, h, d, generator=generator) for n in (t, length, length))
        owner = torch.randint(0, shards, (length,), generator=generator)
        owner[torch.randperm(length, generator=generator)[: length // 3]] = 0  # skew: some shards stay empty
        outs, lses = zip(*(_attend_v(q, k, v, owner == s) for s in range(shards)))
        empty_shards += sum(int(not (owner == s).any()) for s in range(shards))
        full_out, full_lse = _attend_v(q, k, v, torch.ones(length, dtype=torch.bool))
        for out, lse in (_merge_pairwise(outs, lses), merge_n(torch.stack(outs), torch.stack(lses))):
            assert not torch.isnan(out).any(), trial
            torch.testing.assert_close(out, full_out, rtol=0, atol=1e-5, msg=lambda m: f"trial {trial}: {m}")
            torch.testing.assert_close(lse, full_lse, rtol=0, atol=1e-5, msg=lambda m: f"trial {trial}: {m}")
    assert empty_shards >= 10  # the property was exercised with empty shards


def test_n_way_merge_of_all_empty_parts_gives_zero_and_neg_inf():
    outs = torch.full((3, T, H, D), float("nan"))
    out, lse = get("merge_attention_states_n")(outs, torch.full((3, T, H), float("-inf")))
    assert torch.equal(out, torch.zeros(T, H, D))
    assert torch.isneginf(lse).all()
