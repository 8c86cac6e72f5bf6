"""Float8 KV caches on the torch reference (kernels/kv_dtype.py, kernels/attention.py):
what a float8 cache stores, that the paged reads give it back, and how far attention over
a float8 cache is from attention over a bfloat16 cache of the same values.

Tolerance of the attention comparison, derived (and measured: e4m3 0.034, e5m2 0.068 relative
RMS over three seeds of the batch below). Rounding to nearest with ``p`` mantissa bits errs by
a relative ``u`` uniform in ``±2^-p/2`` of the binade's spacing; for N(0,1) values (mantissas
roughly log-uniform) its RMS is ``eps = 2^-p / sqrt(12) * sqrt(E[1/m^2]) ~= 0.21 * 2^-p``
(``E[1/m^2] = 0.541`` for ``m`` log-uniform in [1, 2)): 0.027 for e4m3 (p=3), 0.053 for e5m2
(p=2). With q, k, v ~ N(0,1):

- V's errors reach the output as ``sum_i p_i dv_i``: relative RMS ``eps`` of the output's own
  ``sqrt(sum_i p_i^2 v_i^2)`` scale;
- K's errors move each logit by ``scale * sum_j q_j dk_ij``, RMS ``eps`` (``scale = 1/sqrt(D)``
  against ``D`` terms of unit variance), and so the probabilities by ``p_i * eps``: again a
  relative ``eps`` of the output.

Together ``sqrt(2) * eps``: 0.038 (e4m3), 0.075 (e5m2) of the bf16-cache output's norm. The test
allows 1.5x that over the batch and 3x on any one query row (a single row's error is one
draw), and requires at least a quarter of it: a cache that silently kept bfloat16 (7 mantissa
bits, ``sqrt(2) * eps ~= 0.004``) fails the floor, and a cache read from the wrong slots or as
raw bytes is off by O(1).
"""

import math

import pytest
import torch

from flotilla.kernels.attention import gather_kv, paged_attention, write_kv
from flotilla.kernels.kv_dtype import FP8_KV_DTYPES, is_fp8, storage_view, to_cache_dtype

HEAD_DIM, Q_HEADS, KV_HEADS, BLOCK = 64, 8, 2, 16
# sqrt(2) * eps per format (module docstring).
EXPECTED_RELATIVE_ERROR = {
    torch.float8_e4m3fn: math.sqrt(2) * 0.21 * 2**-3,
    torch.float8_e5m2: math.sqrt(2) * 0.21 * 2**-2,
}
FP8_IDS = ["e4m3", "e5m2"]


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    return storage_view(t)


def test_fp8_dtypes_are_the_two_ocp_formats():
    assert FP8_KV_DTYPES == (torch.float8_e4m3fn, torch.float8_e5m2)
    assert all(is_fp8(d) for d in FP8_KV_DTYPES)
    assert not any(is_fp8(d) for d in (torch.bfloat16, torch.float16, torch.float32, torch.uint8))


@pytest.mark.parametrize(
    "dtype, values, stored",
    [
        # ties go to the even mantissa; beyond 448 saturates (e4m3fn has no inf); 2^-10 is
        # half the smallest subnormal 2^-9: a tie, to zero
        (
            torch.float8_e4m3fn,
            [1.0625, 1.1875, -1.0625, 500.0, -1e6, float("inf"), 448.0, 2**-10, 2**-9, -0.0],
            [1.0, 1.25, -1.0, 448.0, -448.0, 448.0, 448.0, 0.0, 2**-9, -0.0],
        ),
        (
            torch.float8_e5m2,
            [1.125, 1.375, -1.125, 6e4, -1e9, float("inf"), 57344.0, 2**-17, 2**-16, -0.0],
            [1.0, 1.5, -1.0, 57344.0, -57344.0, 57344.0, 57344.0, 0.0, 2**-16, -0.0],
        ),
    ],
    ids=FP8_IDS,
)
def test_to_cache_dtype_rounds_to_nearest_even_and_saturates(dtype, values, stored):
    out = to_cache_dtype(torch.tensor(values), dtype)
    assert out.dtype == dtype
    expected = torch.tensor(stored)
    assert torch.equal(out.float(), expected), f"{out.float().tolist()} != {stored}"
    assert torch.equal(out.float().signbit(), expected.signbit()), "the sign of zero is kept"


def test_to_cache_dtype_is_a_plain_cast_for_other_dtypes():
    values = torch.randn(16) * 1e3
    assert torch.equal(to_cache_dtype(values, torch.bfloat16), values.to(torch.bfloat16))
    assert to_cache_dtype(values, torch.float32) is values


@pytest.mark.parametrize("dtype", FP8_KV_DTYPES, ids=FP8_IDS)
def test_write_kv_stores_float8_and_gather_kv_reads_it_back(make_paged_batch, dtype):
    torch.manual_seed(0)
    batch = make_paged_batch([5, 0, 9], [3, 6, 1])
    meta = batch.meta
    cache = (torch.randn(batch.num_blocks, meta.block_size, KV_HEADS, HEAD_DIM) * 3).to(dtype)
    before = cache.clone()
    values = (torch.randn(meta.slot_mapping.numel(), KV_HEADS, HEAD_DIM) * 100).to(torch.bfloat16)
    write_kv(cache, meta.slot_mapping, values)

    flat, flat_before = as_bytes(cache).view(-1, KV_HEADS, HEAD_DIM), as_bytes(before).view(-1, KV_HEADS, HEAD_DIM)
    assert torch.equal(flat[meta.slot_mapping], as_bytes(to_cache_dtype(values, dtype)))
    untouched = torch.ones(flat.shape[0], dtype=torch.bool)
    untouched[meta.slot_mapping] = False
    assert torch.equal(flat[untouched], flat_before[untouched]), "a slot outside slot_mapping changed"

    context, valid = gather_kv(cache, meta)
    assert context.dtype == dtype
    for b, slots in enumerate(batch.slots):
        n = slots.numel()
        assert bool(valid[b, :n].all()) and not bool(valid[b, n:].any())
        assert torch.equal(as_bytes(context[b, :n]), flat[slots]), f"sequence {b} read back other bytes"


def _attention_over(cache_dtype, batch, contexts, q):
    """The reference over caches of ``cache_dtype`` holding ``contexts`` (new tokens written
    by the call itself), queries in float32."""
    shape = (batch.num_blocks, BLOCK, KV_HEADS, HEAD_DIM)
    k_cache, v_cache = torch.zeros(shape, dtype=cache_dtype), torch.zeros(shape, dtype=cache_dtype)
    for (k, v), slots, cached in zip(contexts, batch.slots, batch.cached_lens):
        write_kv(k_cache, slots[:cached], k[:cached])
        write_kv(v_cache, slots[:cached], v[:cached])
    k_new = torch.cat([k[c:] for (k, _), c in zip(contexts, batch.cached_lens)])
    v_new = torch.cat([v[c:] for (_, v), c in zip(contexts, batch.cached_lens)])
    out = paged_attention(q, k_new, v_new, k_cache, v_cache, batch.meta, 1 / math.sqrt(HEAD_DIM))
    return out, k_cache


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("dtype", FP8_KV_DTYPES, ids=FP8_IDS)
def test_attention_over_a_float8_cache_is_within_rounding_of_a_bf16_cache(make_paged_batch, dtype, seed):
    # decodes after 100 and 37 cached tokens, a fresh 40-token prompt, an 8-token chunk after 250
    batch = make_paged_batch([100, 0, 250, 37], [1, 40, 8, 1], block_size=BLOCK, seed=seed)
    generator = torch.Generator().manual_seed(seed)
    contexts = [
        tuple(torch.randn(s.numel(), KV_HEADS, HEAD_DIM, generator=generator).to(torch.bfloat16) for _ in range(2))
        for s in batch.slots
    ]
    q = torch.randn(int(batch.meta.query_start[-1]), Q_HEADS, HEAD_DIM, generator=generator)
    expected, _ = _attention_over(torch.bfloat16, batch, contexts, q)
    out, k_cache = _attention_over(dtype, batch, contexts, q)

    assert k_cache.dtype == dtype and out.dtype == torch.float32
    err = out - expected
    relative = float(err.norm() / expected.norm())
    rows = err.norm(dim=-1) / expected.norm(dim=-1)
    bound = EXPECTED_RELATIVE_ERROR[dtype]
    assert 0.25 * bound <= relative <= 1.5 * bound, f"relative error {relative:.4f}, expected about {bound:.4f}"
    assert float(rows.max()) <= 3 * bound, f"a query row is off by {float(rows.max()):.4f} (bound {3 * bound:.4f})"
