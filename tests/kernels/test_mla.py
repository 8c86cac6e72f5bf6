"""Absorbed MLA over a paged latent cache against naive un-absorbed MLA
(k = [c W_uk, k_pe], v = c W_uv) computed per sequence over its full context."""

import math

import pytest
import torch

from flotilla.kernels.registry import get

HEADS, NOPE, ROPE, RANK, VDIM = 4, 16, 8, 32, 12


def _naive(q_nope, q_pe, c, k_pe, w_kc, w_vc, scale, cached_len):
    """One sequence: queries are its last len(q) context positions; c/k_pe cover the whole context."""
    k_nope = torch.einsum("sr,hnr->hsn", c, w_kc)  # [H, S, Dn]
    keys = torch.cat([k_nope, k_pe.unsqueeze(0).expand(HEADS, -1, -1)], dim=-1)
    values = torch.einsum("sr,hrd->hsd", c, w_vc)
    queries = torch.cat([q_nope, q_pe], dim=-1).transpose(0, 1)  # [H, Q, Dn + Dr]
    scores = queries @ keys.transpose(1, 2) * scale
    q_pos = cached_len + torch.arange(q_nope.shape[0])
    allowed = torch.arange(c.shape[0]).unsqueeze(0) <= q_pos.unsqueeze(1)
    scores = scores.masked_fill(~allowed, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1).transpose(0, 1)  # [Q, H]
    return (scores.softmax(-1) @ values).transpose(0, 1), lse


def test_absorbed_mla_equals_naive(paged_batch):
    torch.manual_seed(0)
    batch, meta = paged_batch, paged_batch.meta
    num_new = int(meta.query_start[-1])
    w_kc, w_vc = torch.randn(HEADS, NOPE, RANK) * 0.3, torch.randn(HEADS, RANK, VDIM)
    scale = 1 / math.sqrt(NOPE + ROPE)
    contexts = [(torch.randn(s.numel(), RANK), torch.randn(s.numel(), ROPE)) for s in batch.slots]
    cache = torch.randn(batch.num_blocks, meta.block_size, 1, RANK + ROPE)  # garbage where unwritten
    for (c, k_pe), slots, cached in zip(contexts, batch.slots, batch.cached_lens):
        get("write_kv")(cache, slots[:cached], torch.cat([c[:cached], k_pe[:cached]], -1).unsqueeze(1))
    kv_c = torch.cat([c[cached:] for (c, _), cached in zip(contexts, batch.cached_lens)])
    k_pe_new = torch.cat([k[cached:] for (_, k), cached in zip(contexts, batch.cached_lens)])
    q_nope, q_pe = torch.randn(num_new, HEADS, NOPE), torch.randn(num_new, HEADS, ROPE)

    out, lse = get("mla_attention")(q_nope, q_pe, kv_c, k_pe_new, cache, meta, w_kc, w_vc, scale, return_lse=True)
    assert out.shape == (num_new, HEADS, VDIM)
    for b, start, end in batch.new_token_ranges():
        c, k_pe = contexts[b]
        expected, expected_lse = _naive(
            q_nope[start:end], q_pe[start:end], c, k_pe, w_kc, w_vc, scale, batch.cached_lens[b]
        )
        # fp32, absorbed against expanded: other sums in another order. A K-term sum of |terms|
        # adding up to S moves by ~u * S (u = 2^-24 = 6e-8). Values c @ w_vc: K = 32, S <= 36
        # (2e-6); scores: S <= 10 after the 1/sqrt(24) scale (6e-7), which moves the output by
        # ~6e-7 * |v| <= 1.3e-5. Measured <= 7e-6 on |out| <= 20 (MKL_CBWR, ATEN_CPU_CAPABILITY,
        # 1-3 threads) -> atol 5e-5. The LSE carries only the score error (measured <= 1e-6):
        # atol 1e-5. A key from the wrong slot or position, or a wrong w_kc / w_vc, moves both
        # by O(0.1) or more.
        torch.testing.assert_close(out[start:end], expected, rtol=0, atol=5e-5)
        torch.testing.assert_close(lse[start:end], expected_lse, rtol=0, atol=1e-5)
    # The new latents landed in the cache (a copy: exact).
    flat = cache.view(-1, RANK + ROPE)
    torch.testing.assert_close(flat[meta.slot_mapping], torch.cat([kv_c, k_pe_new], -1), rtol=0, atol=0)


def test_cache_width_mismatch_is_rejected(paged_batch):
    meta = paged_batch.meta
    t = int(meta.query_start[-1])
    cache = torch.zeros(paged_batch.num_blocks, meta.block_size, 1, RANK)
    with pytest.raises(ValueError, match="MLA cache rows"):
        get("mla_attention")(
            torch.zeros(t, HEADS, NOPE), torch.zeros(t, HEADS, ROPE), torch.zeros(t, RANK), torch.zeros(t, ROPE),
            cache, meta, torch.zeros(HEADS, NOPE, RANK), torch.zeros(HEADS, RANK, VDIM), 1.0,
        )
