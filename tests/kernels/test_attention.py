"""paged_attention (the lead's torch reference) against naive causal attention
computed per sequence over its full context: MHA/GQA/MQA, prefill, ragged and
chunked prefill (cached + new), decode, sliding window."""

import math

import pytest
import torch

from flotilla.kernels.attention import AttentionMetadata, context_slots
from flotilla.kernels.registry import get

HEAD_DIM, Q_HEADS = 16, 4


def _naive(q, k, v, cached_len, sliding_window):
    """One sequence: q[Q, Hq, D] at the last Q context positions; k/v[S, Hkv, D] the whole context."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scores = torch.einsum("qhd,shd->hqs", q, k) / math.sqrt(HEAD_DIM)
    q_pos = (cached_len + torch.arange(q.shape[0])).unsqueeze(1)
    k_pos = torch.arange(k.shape[0]).unsqueeze(0)
    allowed = k_pos <= q_pos
    if sliding_window is not None:
        allowed &= k_pos > q_pos - sliding_window  # the window counts the token itself
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hqs,shd->qhd", scores.softmax(-1), v)


@pytest.mark.parametrize("kv_heads", [4, 2, 1], ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize("sliding_window", [None, 3])
def test_paged_attention_equals_naive(paged_batch, kv_heads, sliding_window):
    torch.manual_seed(0)
    batch, meta = paged_batch, paged_batch.meta
    num_new = int(meta.query_start[-1])
    contexts = [(torch.randn(s.numel(), kv_heads, HEAD_DIM), torch.randn(s.numel(), kv_heads, HEAD_DIM)) for s in batch.slots]
    shape = (batch.num_blocks, meta.block_size, kv_heads, HEAD_DIM)
    k_cache, v_cache = torch.randn(shape), torch.randn(shape)  # garbage where unwritten
    for (k, v), slots, cached in zip(contexts, batch.slots, batch.cached_lens):
        get("write_kv")(k_cache, slots[:cached], k[:cached])
        get("write_kv")(v_cache, slots[:cached], v[:cached])
    k_new = torch.cat([k[c:] for (k, _), c in zip(contexts, batch.cached_lens)])
    v_new = torch.cat([v[c:] for (_, v), c in zip(contexts, batch.cached_lens)])
    q = torch.randn(num_new, Q_HEADS, HEAD_DIM)

    out = get("paged_attention")(
        q, k_new, v_new, k_cache, v_cache, meta, scale=1 / math.sqrt(HEAD_DIM), sliding_window=sliding_window
    )
    assert out.shape == (num_new, Q_HEADS, HEAD_DIM)
    for b, start, end in batch.new_token_ranges():
        k, v = contexts[b]
        expected = _naive(q[start:end], k, v, batch.cached_lens[b], sliding_window)
        # fp32, SDPA against einsum: the same sums in another order. A K-term sum of |terms|
        # adding up to S moves by ~u * S (u = 2^-24 = 6e-8): scores sum 16 terms of |q||k| / 4
        # (S <= 6: 4e-7), moving the output by about that times |v| <= 4; the values sum <= 13
        # terms of p|v|. Measured <= 7e-7 on |out| <= 4 (MKL_CBWR, ATEN_CPU_CAPABILITY, 1-3
        # threads) -> atol 1e-5. A wrong mask, window or slot moves outputs by O(0.1).
        torch.testing.assert_close(out[start:end], expected, rtol=0, atol=1e-5)


def test_context_slots_follow_block_tables(paged_batch):
    slots, valid = context_slots(paged_batch.meta)
    for b, seq_slots in enumerate(paged_batch.slots):
        assert valid[b].sum() == seq_slots.numel()
        assert torch.equal(slots[b, : seq_slots.numel()], seq_slots)


def test_sliding_window_changes_the_result(make_paged_batch):
    """The window is not silently ignored: a long prefill differs with and without it."""
    torch.manual_seed(0)
    meta = make_paged_batch([0], [8]).meta
    num_blocks = int(meta.block_tables.max()) + 1
    q, k, v = torch.randn(8, 2, HEAD_DIM), torch.randn(8, 2, HEAD_DIM), torch.randn(8, 2, HEAD_DIM)
    outs = []
    for window in (None, 2):
        cache_shape = (num_blocks, meta.block_size, 2, HEAD_DIM)
        outs.append(get("paged_attention")(q, k, v, torch.zeros(cache_shape), torch.zeros(cache_shape), meta, 0.25, window))
    torch.testing.assert_close(outs[0][:2], outs[1][:2])  # the first two tokens see the same keys
    assert not torch.allclose(outs[0][2:], outs[1][2:])


@pytest.mark.parametrize("sliding_window", [None, 3])
def test_empty_batch_returns_no_rows_and_leaves_the_cache(sliding_window):
    """An idle DP-attention rank runs a step of zero tokens and zero sequences (the
    metadata ``ModelRunner.prepare_inputs`` builds for an empty part)."""
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(0, dtype=torch.long),
        query_start=torch.zeros(1, dtype=torch.long),
        seq_lens=torch.zeros(0, dtype=torch.long),
        block_tables=torch.zeros(0, 1, dtype=torch.long),
        max_query_len=0,
        max_seq_len=0,
        block_size=4,
    )
    k_cache, v_cache = torch.randn(3, 4, 2, HEAD_DIM), torch.randn(3, 4, 2, HEAD_DIM)
    before = (k_cache.clone(), v_cache.clone())
    q, kv = torch.randn(0, Q_HEADS, HEAD_DIM), torch.randn(0, 2, HEAD_DIM)
    out = get("paged_attention")(q, kv, kv, k_cache, v_cache, meta, 0.25, sliding_window)
    assert out.shape == (0, Q_HEADS, HEAD_DIM) and out.dtype == q.dtype
    assert torch.equal(k_cache, before[0]) and torch.equal(v_cache, before[1])
