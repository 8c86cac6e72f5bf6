"""The fused ``qkv_prepare`` Triton kernel (kernels/triton_qkv.py) against the separate torch
reference ops it replaces: ``rms_norm`` on q and k (optional), ``rotary_embedding``, then
``write_kv`` of K and V, on a CUDA GPU.

Grid: T in 1/5/64 (1 and 5 run one head a program, 64 several: ``heads_per_program``);
(Hq, Hkv, D) in (32,8,128), (16,4,64), (9,3,64), (32,4,128); q/k norm on and off;
rotary_dim D and D/2; bf16 and fp16; cache blocks of 16 and 1; ragged, shuffled
slot mappings into caches pre-filled with random values (so untouched slots are checked);
rows of qkv strided (a view of a wider buffer). Also: GPT-J (interleaved) RoPE, negative
slots, zero tokens, CUDA-graph capture and replay, and paged attention reading the cache the
kernel wrote (``k=None``/``v=None``) against the unfused flashinfer path.

Tolerances: the kernel rounds to the model dtype exactly where the references' intermediate
tensors do, and every operation between those points is an exact float32 product of two
bf16/fp16 values or one float32 add/sub, the same in torch and Triton. So:

- without q/k norm, q and both caches are bit-identical to the references;
- with q/k norm, only ``rstd = rsqrt(mean(x^2) + eps)`` can differ (the kernel sums the
  squares in another order: ~1e-7 relative), which can flip the rounding of a normalised
  element ``n`` by one ulp. Through RoPE's ``r(r(n1*c) - r(n2*s))`` (|c|, |s| <= 1) such a
  flip moves an output by at most ``2 ulp(n1) + 2 ulp(n2) + ulp(out)``; ``check_close``
  allows twice that per element, and at most 1% of elements may differ at all (a flip
  needs x*rstd within ~1e-7 of a rounding boundary: ~1e-4 of elements). A wrong rounding
  point (e.g. float32 cos/sin, or the weight applied before rounding) changes a large
  fraction of the elements, a wrong partner or frequency changes them by O(1).
- V is copied bit for bit.

Float8 caches (e4m3fn, e5m2; scale 1.0): the kernel stores K and V as ``write_kv`` does
(saturate, round to nearest even), so without q/k norm both caches are bit-identical to the
reference's; with q/k norm a one-ulp flip of a normalised element (above) can carry into a
different float8 value, at most one float8 step away (a bf16 ulp is 1/16 of an e4m3 step, so
flips that cross a float8 rounding boundary are rarer still): at most 1% of K elements may
differ, each by at most one step. Inputs scaled past the formats' range check saturation.

Run on a GPU machine: ``FLOTILLA_GPU_TESTS=1 pytest tests/gpu/test_triton_qkv.py``. The
helpers take a ``device`` so the same checks run under Triton's CPU interpreter
(``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

import importlib
import math

import pytest
import torch

from flotilla.kernels.attention import write_kv
from flotilla.kernels.kv_dtype import FP8_KV_DTYPES, storage_view, to_cache_dtype
from flotilla.kernels.norm import rms_norm
from flotilla.kernels.rotary import rope_cache, rotary_embedding

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
pytest.importorskip("triton")

EPS = 1e-6
MAX_POSITION = 8192
MAX_FLIP_FRACTION = 0.01
HEAD_CONFIGS = [(32, 8, 128), (16, 4, 64), (9, 3, 64), (32, 4, 128)]
_MANTISSA_BITS = {torch.bfloat16: 7, torch.float16: 10}


def qkv_prepare():
    importlib.import_module("flotilla.kernels.triton_qkv")  # registers the op, whatever the registry table says
    from flotilla.kernels.registry import get

    return get("qkv_prepare", "triton")


def make_inputs(tokens, heads, rotary_fraction, dtype, qk_norm, block_size, device, seed=0):
    """Random inputs of one case: (qkv view, positions, cos_sin_cache, rotary_dim, weights, k_cache,
    v_cache, slot_mapping). Slots are a random subset of the cache in random order."""
    num_q, num_kv, head_dim = heads
    gen = torch.Generator().manual_seed(seed)
    width = (num_q + 2 * num_kv) * head_dim
    # NOTE: a wider buffer with an offset, so qkv rows are strided and the start is not at 0.
    buffer = (torch.randn(tokens, width + 3 * head_dim, generator=gen) * 2).to(dtype)
    qkv = buffer.to(device)[:, head_dim : head_dim + width]
    positions = torch.randint(0, MAX_POSITION, (tokens,), generator=gen)
    rotary_dim = int(head_dim * rotary_fraction)
    cos_sin_cache = rope_cache(rotary_dim, MAX_POSITION, 1_000_000.0)
    weights = None
    if qk_norm:
        weights = tuple((1 + 0.5 * torch.randn(head_dim, generator=gen)).to(dtype).to(device) for _ in range(2))
    num_blocks = -(-(2 * tokens + 3) // block_size)
    cache_shape = (num_blocks, block_size, num_kv, head_dim)
    k_cache = torch.randn(cache_shape, generator=gen).to(dtype).to(device)
    v_cache = torch.randn(cache_shape, generator=gen).to(dtype).to(device)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:tokens]
    return (
        qkv,
        positions.to(device),
        cos_sin_cache.to(device),
        rotary_dim,
        weights,
        k_cache,
        v_cache,
        slots.to(device),
    )


def reference(qkv, positions, cos_sin_cache, rotary_dim, is_neox, weights, k_cache, v_cache, slots, heads):
    """The unfused path: ``(q, normalised q-or-None, normalised k-or-None, k_cache, v_cache)``
    (the caches are written copies)."""
    num_q, num_kv, head_dim = heads
    tokens = qkv.shape[0]
    q, k, v = qkv.split([num_q * head_dim, num_kv * head_dim, num_kv * head_dim], dim=-1)
    q, k = q.view(tokens, num_q, head_dim), k.view(tokens, num_kv, head_dim)
    v = v.view(tokens, num_kv, head_dim)
    q_normed = k_normed = None
    if weights is not None:
        q = q_normed = rms_norm(q, weights[0], EPS)
        k = k_normed = rms_norm(k, weights[1], EPS)
    q, k = rotary_embedding(positions, q, k, cos_sin_cache, rotary_dim, is_neox)
    k_cache, v_cache = k_cache.clone(), v_cache.clone()
    write_kv(k_cache, slots, k)
    write_kv(v_cache, slots, v)
    return q, q_normed, k_normed, k_cache, v_cache


def ulp(x: torch.Tensor, dtype) -> torch.Tensor:
    """The spacing of ``dtype`` values just above ``|x|`` (float32; subnormals ignored)."""
    exponent = torch.floor(torch.log2(x.float().abs().clamp(min=2.0**-60)))
    return torch.exp2(exponent - _MANTISSA_BITS[dtype])


def partner_index(head_dim, rotary_dim, is_neox, device) -> torch.Tensor:
    """For each dim of a head, the other element of its rotation pair (itself past rotary_dim)."""
    cols = torch.arange(head_dim, device=device)
    half = rotary_dim // 2
    if is_neox:
        partner = torch.where(cols < half, cols + half, cols - half)
    else:
        partner = cols ^ 1
    return torch.where(cols < rotary_dim, partner, cols)


def check_close(got, want, normed, rotary_dim, is_neox, what):
    """``got`` equals ``want`` bitwise when ``normed`` is None; else within the norm-flip bound
    of the module docstring, on at most MAX_FLIP_FRACTION of the elements."""
    assert got.shape == want.shape and got.dtype == want.dtype, f"{what}: {got.shape}/{got.dtype} vs {want.shape}/{want.dtype}"
    differ = got != want
    if normed is None:
        if differ.any():
            where = torch.nonzero(differ)[:5].tolist()
            pytest.fail(f"{what}: {int(differ.sum())}/{differ.numel()} elements differ (expected bitwise), e.g. at {where}")
        return
    dtype = want.dtype
    partner = normed[..., partner_index(want.shape[-1], rotary_dim, is_neox, want.device)]
    bound = 2 * (2 * ulp(normed, dtype) + 2 * ulp(partner, dtype) + ulp(want, dtype))
    err = (got.float() - want.float()).abs()
    over = err > bound
    fraction = differ.float().mean().item()
    assert not over.any(), (
        f"{what}: {int(over.sum())} elements beyond the one-ulp-norm-flip bound; worst |err|={err.max().item():.4g} "
        f"at {torch.nonzero(over)[0].tolist()}"
    )
    assert fraction <= MAX_FLIP_FRACTION, f"{what}: {fraction:.2%} of elements differ (rounding flips should be rare)"


def run_case(tokens, heads, rotary_fraction, dtype, qk_norm, block_size, is_neox=True, device="cuda", seed=0):
    """One grid case: the kernel's q and caches against the unfused references."""
    qkv, positions, cache, rotary_dim, weights, k_cache, v_cache, slots = make_inputs(
        tokens, heads, rotary_fraction, dtype, qk_norm, block_size, device, seed
    )
    want_q, q_normed, k_normed, want_k_cache, want_v_cache = reference(
        qkv, positions, cache, rotary_dim, is_neox, weights, k_cache, v_cache, slots, heads
    )
    norm_args = {} if weights is None else dict(q_norm_weight=weights[0], k_norm_weight=weights[1], eps=EPS)
    q = qkv_prepare()(qkv, positions, cache, rotary_dim, is_neox, k_cache, v_cache, slots, heads[0], heads[1], **norm_args)
    assert q.is_contiguous() and q.shape == (tokens, heads[0], heads[2])
    label = f"T={tokens} heads={heads} rot={rotary_dim} {dtype} norm={qk_norm} block={block_size} neox={is_neox}"
    check_close(q, want_q, q_normed, rotary_dim, is_neox, f"q ({label})")
    assert torch.equal(v_cache, want_v_cache), f"v_cache ({label}): differs from the reference writes"
    # NOTE: written slots against the rotated keys, every other slot unchanged bit for bit.
    flat, want_flat = k_cache.view(-1, heads[1], heads[2]), want_k_cache.view(-1, heads[1], heads[2])
    untouched = torch.ones(flat.shape[0], dtype=torch.bool, device=flat.device)
    untouched[slots] = False
    assert torch.equal(flat[untouched], want_flat[untouched]), f"k_cache ({label}): a slot outside slot_mapping changed"
    check_close(flat[slots], want_flat[slots], k_normed, rotary_dim, is_neox, f"k_cache ({label})")


@pytest.mark.parametrize("block_size", [16, 1])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rotary_fraction", [1.0, 0.5])
@pytest.mark.parametrize("qk_norm", [False, True])
@pytest.mark.parametrize("heads", HEAD_CONFIGS)
@pytest.mark.parametrize("tokens", [1, 5, 64])
def test_matches_separate_reference_ops(tokens, heads, qk_norm, rotary_fraction, dtype, block_size):
    run_case(tokens, heads, rotary_fraction, dtype, qk_norm, block_size)


@pytest.mark.parametrize("qk_norm", [False, True])
@pytest.mark.parametrize("heads", [(32, 8, 128), (9, 3, 64)])
def test_interleaved_rope_matches_reference(heads, qk_norm):
    run_case(5, heads, 1.0, torch.bfloat16, qk_norm, 16, is_neox=False)
    run_case(5, heads, 0.5, torch.bfloat16, qk_norm, 16, is_neox=False)


def test_negative_slots_write_nothing_and_zero_tokens_launch_nothing(device="cuda"):
    heads = (16, 4, 64)
    qkv, positions, cache, rotary_dim, _, k_cache, v_cache, slots = make_inputs(6, heads, 1.0, torch.bfloat16, False, 16, device)
    slots[::2] = -1
    keep = slots >= 0
    want_q, _, _, want_k, want_v = reference(
        qkv[keep], positions[keep], cache, rotary_dim, True, None, k_cache, v_cache, slots[keep], heads
    )
    q = qkv_prepare()(qkv, positions, cache, rotary_dim, True, k_cache, v_cache, slots, 16, 4)
    assert torch.equal(q[keep], want_q) and torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)
    empty = qkv_prepare()(qkv[:0], positions[:0], cache, rotary_dim, True, k_cache, v_cache, slots[:0], 16, 4)
    assert empty.shape == (0, 16, 64)
    assert torch.equal(k_cache, want_k), "zero tokens must leave the cache untouched"


def test_bad_inputs_raise_clear_errors(device="cuda"):
    heads = (16, 4, 64)
    qkv, positions, cache, rotary_dim, _, k_cache, v_cache, slots = make_inputs(3, heads, 1.0, torch.bfloat16, False, 16, device)
    op = qkv_prepare()
    with pytest.raises(ValueError, match="qkv has"):
        op(qkv, positions, cache, rotary_dim, True, k_cache, v_cache, slots, 8, 4)
    with pytest.raises(ValueError, match="rotary_dim=32"):
        op(qkv, positions, cache, 32, True, k_cache, v_cache, slots, 16, 4)
    with pytest.raises(ValueError, match="k_cache must be in qkv's dtype"):
        op(qkv, positions, cache, rotary_dim, True, k_cache.half(), v_cache.half(), slots, 16, 4)
    with pytest.raises(ValueError, match="k_cache and v_cache must share a dtype"):
        op(qkv, positions, cache, rotary_dim, True, k_cache.to(torch.float8_e4m3fn), v_cache, slots, 16, 4)
    with pytest.raises(ValueError, match="both"):
        op(qkv, positions, cache, rotary_dim, True, k_cache, v_cache, slots, 16, 4, q_norm_weight=qkv[0, :64])
    with pytest.raises(ValueError, match="slot_mapping"):
        op(qkv, positions, cache, rotary_dim, True, k_cache, v_cache, slots[:2], 16, 4)


# -- float8 caches ----------------------------------------------------------------------------

FP8_IDS = ["e4m3", "e5m2"]
# Input scales that push K and V past each format's largest value (448, 57344) in places.
SATURATING_SCALE = {torch.float8_e4m3fn: 300.0, torch.float8_e5m2: 40000.0}


def fp8_step(x: torch.Tensor) -> torch.Tensor:
    """The spacing of float8 values at ``|x|`` (x float8): the step one rounding flip moves by."""
    info = torch.finfo(x.dtype)
    mantissa_bits = round(-math.log2(info.eps))
    exponent = torch.floor(torch.log2(x.float().abs().clamp(min=info.tiny)))
    return torch.exp2(exponent - mantissa_bits)


def check_fp8_close(got, want, exact: bool, what: str) -> None:
    """Float8 caches: bytewise equal when ``exact``; else at most MAX_FLIP_FRACTION of the
    elements differ, each by at most one float8 step (module docstring)."""
    assert got.dtype == want.dtype and got.shape == want.shape, f"{what}: {got.dtype}/{got.shape} vs {want.dtype}/{want.shape}"
    differ = storage_view(got) != storage_view(want)
    if exact:
        if differ.any():
            where = torch.nonzero(differ)[:5].tolist()
            pytest.fail(f"{what}: {int(differ.sum())}/{differ.numel()} elements differ (expected bytewise), e.g. at {where}")
        return
    step = torch.maximum(fp8_step(got), fp8_step(want))
    over = (got.float() - want.float()).abs() > step
    assert not over.any(), f"{what}: {int(over.sum())} elements more than one float8 step apart, e.g. at {torch.nonzero(over)[0].tolist()}"
    fraction = differ.float().mean().item()
    assert fraction <= MAX_FLIP_FRACTION, f"{what}: {fraction:.2%} of elements differ (rounding flips should be rare)"


def run_fp8_case(tokens, heads, qk_norm, cache_dtype, block_size, scale=1.0, device="cuda", seed=0):
    """One case with float8 caches (pre-filled with random float8 values): q as in
    :func:`run_case`, the caches against ``write_kv``'s float8 stores."""
    qkv, positions, cache, rotary_dim, weights, k_cache, v_cache, slots = make_inputs(
        tokens, heads, 1.0, torch.bfloat16, qk_norm, block_size, device, seed
    )
    if scale != 1.0:
        qkv.mul_(scale)  # NOTE: in place, so qkv stays a strided view
    k_cache, v_cache = to_cache_dtype(k_cache, cache_dtype), to_cache_dtype(v_cache, cache_dtype)
    want_q, q_normed, k_normed, want_k_cache, want_v_cache = reference(
        qkv, positions, cache, rotary_dim, True, weights, k_cache, v_cache, slots, heads
    )
    norm_args = {} if weights is None else dict(q_norm_weight=weights[0], k_norm_weight=weights[1], eps=EPS)
    q = qkv_prepare()(qkv, positions, cache, rotary_dim, True, k_cache, v_cache, slots, heads[0], heads[1], **norm_args)
    label = f"T={tokens} heads={heads} {cache_dtype} norm={qk_norm} block={block_size} scale={scale}"
    check_close(q, want_q, q_normed, rotary_dim, True, f"q ({label})")
    check_fp8_close(v_cache, want_v_cache, True, f"v_cache ({label})")
    check_fp8_close(k_cache, want_k_cache, not qk_norm, f"k_cache ({label})")
    return k_cache, v_cache


@pytest.mark.parametrize("block_size", [16, 1])
@pytest.mark.parametrize("qk_norm", [False, True])
@pytest.mark.parametrize("heads", [(32, 8, 128), (9, 3, 64)])
@pytest.mark.parametrize("tokens", [1, 64])
@pytest.mark.parametrize("cache_dtype", FP8_KV_DTYPES, ids=FP8_IDS)
def test_float8_caches_hold_what_write_kv_stores(cache_dtype, tokens, heads, qk_norm, block_size, device="cuda"):
    run_fp8_case(tokens, heads, qk_norm, cache_dtype, block_size, device=device)


@pytest.mark.parametrize("cache_dtype", FP8_KV_DTYPES, ids=FP8_IDS)
def test_float8_caches_saturate_out_of_range_values(cache_dtype, device="cuda"):
    k_cache, v_cache = run_fp8_case(64, (16, 4, 64), False, cache_dtype, 16, SATURATING_SCALE[cache_dtype], device=device)
    limit = torch.finfo(cache_dtype).max
    for name, written in (("k", k_cache), ("v", v_cache)):
        values = written.float()
        assert torch.isfinite(values).all(), f"{name}: a non-finite float8 value (no saturation)"
        assert (values.abs() == limit).any(), f"{name}: no value reached {limit}: the case does not test saturation"


@pytest.mark.parametrize("cache_dtype", FP8_KV_DTYPES, ids=FP8_IDS)
def test_float8_store_of_every_bf16_value_matches_write_kv(cache_dtype, device="cuda"):
    """V passes straight to the cache, so V rows holding every finite bf16 value (and both
    infinities) check the kernel's float8 rounding and saturation against torch's, exhaustively."""
    num_q, num_kv, head_dim = 16, 4, 64
    values = torch.arange(1 << 16, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    values = torch.cat([values[torch.isfinite(values.float())], torch.tensor([float("inf"), -float("inf")]).bfloat16()])
    per_token = num_kv * head_dim
    tokens = -(-values.numel() // per_token)
    v = torch.cat([values, torch.zeros(tokens * per_token - values.numel(), dtype=torch.bfloat16)]).view(tokens, per_token)
    qk = torch.randn(tokens, (num_q + num_kv) * head_dim, generator=torch.Generator().manual_seed(0)).bfloat16()
    qkv = torch.cat([qk, v], dim=1).to(device)
    positions = torch.zeros(tokens, dtype=torch.long, device=device)
    cos_sin_cache = rope_cache(head_dim, MAX_POSITION, 10_000.0).to(device)
    shape = (-(-tokens // 16), 16, num_kv, head_dim)
    k_cache = torch.zeros(shape, dtype=cache_dtype, device=device)
    v_cache = torch.zeros(shape, dtype=cache_dtype, device=device)
    slots = torch.arange(tokens, device=device)
    qkv_prepare()(qkv, positions, cos_sin_cache, head_dim, True, k_cache, v_cache, slots, num_q, num_kv)
    written = storage_view(v_cache).view(-1)[: values.numel()].cpu()
    want = storage_view(to_cache_dtype(values, cache_dtype))
    bad = written != want
    assert not bad.any(), f"{int(bad.sum())} values stored differently, e.g. {values[bad][:5].tolist()}"


def test_cuda_graph_replay_follows_new_inputs():
    """Captured once, replayed with new qkv values, positions and slots written into the
    captured input buffers: each replay matches the references."""
    heads, tokens = (32, 8, 128), 4
    op = qkv_prepare()
    qkv, positions, cache, rotary_dim, weights, k_cache, v_cache, slots = make_inputs(
        tokens, heads, 1.0, torch.bfloat16, True, 16, "cuda"
    )
    norm_args = dict(q_norm_weight=weights[0], k_norm_weight=weights[1], eps=EPS)
    op(qkv, positions, cache, rotary_dim, True, k_cache, v_cache, slots, 32, 8, **norm_args)  # compile outside capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        q_out = op(qkv, positions, cache, rotary_dim, True, k_cache, v_cache, slots, 32, 8, **norm_args)
    for seed in (1, 2):
        new_qkv, new_positions, _, _, _, _, _, new_slots = make_inputs(tokens, heads, 1.0, torch.bfloat16, True, 16, "cuda", seed)
        qkv.copy_(new_qkv)
        positions.copy_(new_positions)
        slots.copy_(new_slots % (k_cache.shape[0] * k_cache.shape[1]))
        before_k, before_v = k_cache.clone(), v_cache.clone()
        want_q, q_normed, k_normed, want_k, want_v = reference(
            qkv, positions, cache, rotary_dim, True, weights, before_k, before_v, slots, heads
        )
        graph.replay()
        torch.cuda.synchronize()
        check_close(q_out, want_q, q_normed, rotary_dim, True, f"q (replay {seed})")
        assert torch.equal(v_cache, want_v), f"v_cache (replay {seed})"
        written = k_cache.view(-1, 8, 128)[slots]
        check_close(written, want_k.view(-1, 8, 128)[slots], k_normed, rotary_dim, True, f"k (replay {seed})")


@pytest.mark.timeout(1800)  # a cold flashinfer JIT cache compiles the prefill kernels first
@pytest.mark.parametrize("kv_dtype", [None, torch.float8_e4m3fn], ids=["bf16-cache", "fp8-cache"])
def test_paged_attention_reads_the_kernels_cache(kv_dtype):
    """flashinfer paged attention with ``k=None, v=None`` after the kernel wrote the cache gives
    the unfused flashinfer path's output (same q, same cache contents: bitwise without q/k norm),
    also over a float8 cache."""
    from gpu.paged_steps import build_step, planner_for, random_blocks
    from flotilla.kernels.attention import AttentionShape
    from flotilla.kernels.registry import get

    num_q, num_kv, head_dim, dtype, block_size = 32, 8, 128, torch.bfloat16, 16
    shape = AttentionShape(num_q, num_kv, head_dim, head_dim, 1 / math.sqrt(head_dim), None, dtype, kv_dtype=kv_dtype)
    cached, new = [37, 0, 15], [5, 17, 1]
    seq_lens = [c + n for c, n in zip(cached, new)]
    num_blocks = 32
    step = build_step(cached, new, block_size, random_blocks(seq_lens, block_size, num_blocks, torch.Generator().manual_seed(0)))
    planner_for(shape, block_size).plan(step.meta)
    tokens = step.num_tokens
    gen = torch.Generator(device="cuda").manual_seed(0)
    qkv = torch.randn(tokens, (num_q + 2 * num_kv) * head_dim, generator=gen, device="cuda").to(dtype)
    positions = torch.tensor([c + i for c, n in zip(cached, new) for i in range(n)], device="cuda")
    cos_sin_cache = rope_cache(head_dim, MAX_POSITION, 500_000.0).cuda()
    caches = to_cache_dtype(torch.randn(2, num_blocks, block_size, num_kv, head_dim, generator=gen, device="cuda").to(dtype),
                            shape.cache_dtype)  # fmt: skip
    fused_k, fused_v = caches.clone().unbind(0)
    plain_k, plain_v = caches.clone().unbind(0)
    attention = get("paged_attention", "flashinfer")

    q = qkv_prepare()(qkv, positions, cos_sin_cache, head_dim, True, fused_k, fused_v, step.meta.slot_mapping, num_q, num_kv)
    fused = attention(q, None, None, fused_k, fused_v, step.meta, shape.scale)

    q_ref, k_ref, v_ref = qkv.split([num_q * head_dim, num_kv * head_dim, num_kv * head_dim], dim=-1)
    q_ref, k_ref = rotary_embedding(
        positions, q_ref.view(tokens, num_q, head_dim), k_ref.view(tokens, num_kv, head_dim), cos_sin_cache, head_dim, True
    )
    plain = attention(q_ref, k_ref, v_ref.view(tokens, num_kv, head_dim), plain_k, plain_v, step.meta, shape.scale)
    for fused_cache, plain_cache in ((fused_k, plain_k), (fused_v, plain_v)):
        assert torch.equal(storage_view(fused_cache), storage_view(plain_cache))
    # NOTE: identical inputs to one planned kernel; a tolerance of one bf16 ulp at |out| <~ 4 only
    # guards against run-to-run reduction-order differences.
    torch.testing.assert_close(fused, plain, atol=2**-6, rtol=0)
