"""One Triton launch for what sits between the q/k/v projection and paged attention: the
``triton`` backend of op ``qkv_prepare``.

Per layer the unfused path runs q RMSNorm, k RMSNorm, RoPE and two KV-cache index copies
(five launches); :func:`qkv_prepare` does all of it in one, over a grid of tokens x groups
of heads (query heads, then KV heads; one head a program for a few tokens, up to eight for a
prefill chunk, see :func:`heads_per_program`). A program normalises (optionally) and rotates
its heads; query heads go into a new contiguous ``q[T, Hq, D]``, key heads to the token's
cache slot, each with its value head copied there unchanged.

Numerics: the separate torch references' rounding points, reproduced exactly (float32 math,
rounding to the model dtype wherever the reference's intermediate tensors live in it):

- RMSNorm (``kernels/norm.py``): ``rstd`` in float32, ``x * rstd`` rounded to the model
  dtype, then ``weight * that`` rounded again;
- RoPE (``kernels/rotary.py``, HF's convention): cos/sin rounded to the model dtype, each of
  ``x1 * cos`` and ``x2 * sin`` rounded, then their difference/sum rounded. A product of two
  bf16/fp16 values is exact in float32, so every rounding here equals torch's.

So without q/k norm the outputs are bit-identical to the references; with it, only ``rstd``
can differ (the sum of squares is reduced in another order), by a float32 ulp or so, which
flips the rounding of a normalised element by at most one ulp now and then.

A float8 cache (``float8_e4m3fn`` / ``float8_e5m2``, scale 1.0, see
:mod:`flotilla.kernels.kv_dtype`) gets K and V as the reference's ``write_kv`` stores them:
the model-dtype value saturated at the format's largest value and rounded to nearest even.
The rounding is done in float32 on the float8 grid (:func:`_fp8_grid`, exact), so the final
conversion only re-encodes a representable value: this does not lean on the conversion
instruction's rounding, and Triton's interpreter (whose float8 conversion mis-rounds where
the mantissa carries into the exponent) stores the same bytes as the GPU.

Importing this module imports Triton: the registry imports it only when the ``triton``
backend is asked for.
"""

from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl

from flotilla.kernels.registry import register
from flotilla.kernels.triton_pdl import launch_options, start_dependent

_HALF_DTYPES = (torch.float16, torch.bfloat16)
_FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
# The magic number that rounds a float32 below 2**22 in magnitude to an integer, ties to even:
# (y + 1.5 * 2**23) - 1.5 * 2**23 (float32 arithmetic; nothing here may reassociate it).
_ROUND_MAGIC = tl.constexpr(12582912.0)
# NOTE: Triton's interpreter runs the kernel on CPU tensors (used to check it without a GPU).
_INTERPRETER = os.environ.get("TRITON_INTERPRET") == "1"
# Launch shape: steps of at most ONE_HEAD_TOKENS tokens run one head per program; longer ones
# up to MAX_HEADS_PER_PROGRAM heads of a token per program (measured on an H200: an 8192-token
# Llama-3.1-8B prefill chunk, docs/benchmarks.md).
ONE_HEAD_TOKENS = 16
MAX_HEADS_PER_PROGRAM = 8


@triton.jit
def _round(x, dtype: tl.constexpr):
    """``x`` (float32) rounded to ``dtype`` and widened back: one rounding of the reference."""
    return x.to(dtype).to(tl.float32)


@triton.jit
def _fp8_grid(x, MANT_BITS: tl.constexpr, MIN_EXP: tl.constexpr, MAX: tl.constexpr):
    """``x`` (float32) saturated at ``±MAX`` and rounded to nearest even on the grid of a float8
    format with ``MANT_BITS`` mantissa bits and smallest normal exponent ``MIN_EXP`` (its
    subnormals share that exponent's step); still float32, exactly representable in the format.
    NaN is not kept (it stores as ``±MAX``; torch's cast keeps it): a NaN key is lost anyway."""
    # NOTE: the sign goes back as a bit (Triton's unary minus is 0 - x, which loses -0.0).
    sign = (x.to(tl.int32, bitcast=True) >> 31) << 31
    a = tl.minimum(tl.abs(x), MAX)
    exponent = tl.maximum(((a.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127, MIN_EXP) - MANT_BITS
    step = ((exponent + 127) << 23).to(tl.float32, bitcast=True)  # 2 ** exponent: the grid's spacing at a
    inverse = ((127 - exponent) << 23).to(tl.float32, bitcast=True)  # 2 ** -exponent
    # NOTE: a * inverse < 2 ** (MANT_BITS + 1), far below 2**22; products with powers of two are
    # exact (no division: Triton's float32 division is approximate), so the one rounding is the
    # magic number's, to nearest even.
    rounded = ((a * inverse + _ROUND_MAGIC) - _ROUND_MAGIC) * step
    return (rounded.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)


@triton.jit
def _to_cache(x, CACHE_DTYPE: tl.constexpr, FP8_MANT_BITS: tl.constexpr, FP8_MIN_EXP: tl.constexpr, FP8_MAX: tl.constexpr):
    """``x`` (float32, or the model dtype) as a KV-cache element: float8 caches (``FP8_MAX > 0``)
    through :func:`_fp8_grid`, any other cache dtype by a plain conversion."""
    if FP8_MAX > 0:
        x = _fp8_grid(x.to(tl.float32), FP8_MANT_BITS, FP8_MIN_EXP, FP8_MAX)
    return x.to(CACHE_DTYPE)


@triton.jit
def _prepare_heads(
    row_ptr,
    heads,
    valid,
    is_q,
    q_norm_ptr,
    k_norm_ptr,
    eps,
    cos_ptr,
    cols,
    DTYPE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    ROT_DIM: tl.constexpr,
    IS_NEOX: tl.constexpr,
    HAS_NORM: tl.constexpr,
):
    """Heads ``heads`` (a vector of indices into the token's q and k heads, q first; rows not
    ``valid`` are masked) of the qkv row at ``row_ptr``, normalised (``q_norm_ptr`` for rows
    ``is_q``, ``k_norm_ptr`` for the rest) and rotated: ``[len(heads), BLOCK_D]`` float32
    values already rounded to ``DTYPE``. ``cos_ptr`` is the token's cos/sin cache row."""
    half: tl.constexpr = ROT_DIM // 2
    in_head = cols < HEAD_DIM
    base = row_ptr + heads[:, None] * HEAD_DIM
    x = tl.load(base + cols[None, :], mask=valid[:, None] & in_head[None, :], other=0.0).to(tl.float32)
    # Each rotated dim's partner (the other element of its rotation pair), its frequency
    # (cos/sin column) and whether it takes the minus sign (first of its pair).
    if IS_NEOX:
        first = cols < half
        partner = tl.where(first, cols + half, cols - half)
        freq = tl.where(first, cols, cols - half)
    else:
        first = (cols % 2) == 0
        partner = cols ^ 1
        freq = cols // 2
    rotated = cols < ROT_DIM
    x_partner = tl.load(base + partner[None, :], mask=valid[:, None] & rotated[None, :], other=0.0).to(tl.float32)
    if HAS_NORM:
        # NOTE: the reference normalises the whole head (rotated dims and the rest alike).
        rstd = tl.math.rsqrt(tl.sum(x * x, axis=1) * (1.0 / HEAD_DIM) + eps)[:, None]
        w = tl.where(
            is_q[:, None],
            tl.load(q_norm_ptr + cols, mask=in_head, other=0.0).to(tl.float32)[None, :],
            tl.load(k_norm_ptr + cols, mask=in_head, other=0.0).to(tl.float32)[None, :],
        )
        w_partner = tl.where(
            is_q[:, None],
            tl.load(q_norm_ptr + partner, mask=rotated, other=0.0).to(tl.float32)[None, :],
            tl.load(k_norm_ptr + partner, mask=rotated, other=0.0).to(tl.float32)[None, :],
        )
        x = _round(w * _round(x * rstd, DTYPE), DTYPE)
        x_partner = _round(w_partner * _round(x_partner * rstd, DTYPE), DTYPE)
    cos = _round(tl.load(cos_ptr + freq, mask=rotated, other=0.0), DTYPE)[None, :]
    sin = _round(tl.load(cos_ptr + half + freq, mask=rotated, other=0.0), DTYPE)[None, :]
    x_cos = _round(x * cos, DTYPE)
    partner_sin = _round(x_partner * sin, DTYPE)
    out = _round(tl.where(first[None, :], x_cos - partner_sin, x_cos + partner_sin), DTYPE)
    return tl.where(rotated[None, :], out, x)


@triton.jit
def _qkv_prepare_kernel(
    qkv_ptr,
    positions_ptr,
    cos_sin_ptr,
    q_norm_ptr,
    k_norm_ptr,
    q_out_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    eps,
    stride_qkv_t,
    stride_cos_p,
    stride_kc_block,
    stride_kc_offset,
    stride_kc_head,
    stride_vc_block,
    stride_vc_offset,
    stride_vc_head,
    NUM_Q_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    ROT_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    CACHE_BLOCK_SIZE: tl.constexpr,
    IS_NEOX: tl.constexpr,
    HAS_NORM: tl.constexpr,
    FP8_MANT_BITS: tl.constexpr,
    FP8_MIN_EXP: tl.constexpr,
    FP8_MAX: tl.constexpr,
    PDL: tl.constexpr,
):
    start_dependent(PDL)  # NOTE: first: qkv comes from the kernel before
    token = tl.program_id(0)
    first_head = tl.program_id(1) * HEADS
    # This program's HEADS heads of the token, counted over q heads then k heads (a k head's
    # program also copies the matching v head).
    heads = first_head + tl.arange(0, HEADS)
    valid = heads < NUM_Q_HEADS + NUM_KV_HEADS
    is_q = heads < NUM_Q_HEADS
    cols = tl.arange(0, BLOCK_D)
    in_head = (cols < HEAD_DIM)[None, :]
    DTYPE: tl.constexpr = q_out_ptr.dtype.element_ty
    CACHE_DTYPE: tl.constexpr = k_cache_ptr.dtype.element_ty
    row = qkv_ptr + token.to(tl.int64) * stride_qkv_t
    position = tl.load(positions_ptr + token).to(tl.int64)
    cos_row = cos_sin_ptr + position * stride_cos_p
    out = _prepare_heads(
        row, heads, valid, is_q, q_norm_ptr, k_norm_ptr, eps, cos_row, cols, DTYPE, HEAD_DIM, ROT_DIM, IS_NEOX, HAS_NORM
    )
    if first_head < NUM_Q_HEADS:
        q_dst = q_out_ptr + (token.to(tl.int64) * NUM_Q_HEADS + heads[:, None]) * HEAD_DIM + cols[None, :]
        tl.store(q_dst, out.to(DTYPE), mask=(valid & is_q)[:, None] & in_head)
    if first_head + HEADS > NUM_Q_HEADS:
        slot = tl.load(slot_ptr + token).to(tl.int64)
        # NOTE: a negative slot (a padding row some callers mark with -1) writes nothing.
        if slot >= 0:
            block = slot // CACHE_BLOCK_SIZE
            offset = slot % CACHE_BLOCK_SIZE
            is_kv = valid & (heads >= NUM_Q_HEADS)
            kv_head = tl.where(is_kv, heads - NUM_Q_HEADS, 0)[:, None]
            kv_mask = is_kv[:, None] & in_head
            k_dst = k_cache_ptr + block * stride_kc_block + offset * stride_kc_offset + kv_head * stride_kc_head
            # NOTE: out is already rounded to the model dtype, as the reference's k is before write_kv.
            k = _to_cache(out, CACHE_DTYPE, FP8_MANT_BITS, FP8_MIN_EXP, FP8_MAX)
            tl.store(k_dst + cols[None, :], k, mask=kv_mask)
            v = tl.load(row + (NUM_Q_HEADS + NUM_KV_HEADS + kv_head) * HEAD_DIM + cols[None, :], mask=kv_mask)
            v = _to_cache(v, CACHE_DTYPE, FP8_MANT_BITS, FP8_MIN_EXP, FP8_MAX)
            v_dst = v_cache_ptr + block * stride_vc_block + offset * stride_vc_offset + kv_head * stride_vc_head
            tl.store(v_dst + cols[None, :], v, mask=kv_mask)


def heads_per_program(tokens: int, heads: int) -> int:
    """Heads one program of :func:`qkv_prepare` handles: one for a few tokens (decode: the
    most programs, each a warp), up to :data:`MAX_HEADS_PER_PROGRAM` for a prefill's many
    (one-head programs of a few hundred bytes each leave a chunk's launch latency-bound)."""
    if tokens <= ONE_HEAD_TOKENS:
        return 1
    return min(MAX_HEADS_PER_PROGRAM, triton.next_power_of_2(heads))


def _check_inputs(
    qkv, positions, cos_sin_cache, rotary_dim, q_norm_weight, k_norm_weight, k_cache, v_cache, slot_mapping,
    num_q_heads, num_kv_heads,
) -> int:
    """ValueError naming the first argument the kernel cannot take; returns the head dim."""
    if qkv.dim() != 2 or qkv.stride(-1) != 1:
        raise ValueError(
            f"qkv must be [T, (Hq + 2*Hkv) * D] with unit last stride, got shape={tuple(qkv.shape)}, stride={qkv.stride()}"
        )
    if qkv.dtype not in _HALF_DTYPES or not (qkv.is_cuda or _INTERPRETER):
        raise ValueError(
            f"qkv_prepare (triton) takes CUDA float16/bfloat16 qkv, got dtype={qkv.dtype}, device={qkv.device}"
        )
    if num_q_heads < 1 or num_kv_heads < 1:
        raise ValueError(f"num_q_heads={num_q_heads} and num_kv_heads={num_kv_heads} must be positive")
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(
            f"k_cache and v_cache must both be [num_blocks, block_size, Hkv, D], got "
            f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}"
        )
    head_dim = k_cache.shape[-1]
    width = (num_q_heads + 2 * num_kv_heads) * head_dim
    if qkv.shape[1] != width:
        raise ValueError(
            f"qkv has {qkv.shape[1]} columns; num_q_heads={num_q_heads}, num_kv_heads={num_kv_heads}, "
            f"head_dim={head_dim} (from k_cache) need {width}"
        )
    if k_cache.shape[2] != num_kv_heads:
        raise ValueError(f"k_cache holds {k_cache.shape[2]} KV heads, num_kv_heads={num_kv_heads}")
    if k_cache.dtype != v_cache.dtype:
        raise ValueError(f"k_cache and v_cache must share a dtype, got {k_cache.dtype} and {v_cache.dtype}")
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        if cache.dtype not in (qkv.dtype, *_FP8_DTYPES) or cache.stride(-1) != 1:
            raise ValueError(
                f"{name} must be in qkv's dtype {qkv.dtype} or a float8 dtype {_FP8_DTYPES}, with unit last stride; "
                f"got dtype={cache.dtype}, stride={cache.stride()}"
            )
    if cos_sin_cache.dtype != torch.float32 or cos_sin_cache.dim() != 2 or cos_sin_cache.stride(-1) != 1:
        raise ValueError(
            f"cos_sin_cache must be float32 [max_position, rotary_dim] with unit last stride, got "
            f"dtype={cos_sin_cache.dtype}, shape={tuple(cos_sin_cache.shape)}"
        )
    if rotary_dim != cos_sin_cache.shape[1] or rotary_dim % 2 or not 0 < rotary_dim <= head_dim:
        raise ValueError(
            f"rotary_dim={rotary_dim} must be even, at most head_dim={head_dim}, and equal the cos_sin_cache "
            f"width {cos_sin_cache.shape[1]}"
        )
    tokens = qkv.shape[0]
    for name, index in (("positions", positions), ("slot_mapping", slot_mapping)):
        if index.shape != (tokens,) or index.dtype not in (torch.int32, torch.int64) or not index.is_contiguous():
            raise ValueError(
                f"{name} must be a contiguous int32/int64 [T={tokens}] vector, got shape={tuple(index.shape)}, "
                f"dtype={index.dtype}"
            )
    if (q_norm_weight is None) != (k_norm_weight is None):
        raise ValueError("pass both q_norm_weight and k_norm_weight, or neither")
    for name, weight in (("q_norm_weight", q_norm_weight), ("k_norm_weight", k_norm_weight)):
        if weight is not None and (weight.shape != (head_dim,) or not weight.is_contiguous()):
            raise ValueError(f"{name} must be a contiguous [head_dim={head_dim}] vector, got shape={tuple(weight.shape)}")
    return head_dim


def _fp8_format(dtype: torch.dtype) -> tuple[int, int, float]:
    """``(mantissa bits, smallest normal exponent, largest finite value)`` of a float8 cache
    dtype (e4m3fn: 3, -6, 448; e5m2: 2, -14, 57344); ``(0, 0, 0.0)`` for any other dtype."""
    if dtype not in _FP8_DTYPES:
        return 0, 0, 0.0
    info = torch.finfo(dtype)
    return round(-math.log2(info.eps)), round(math.log2(info.tiny)), float(info.max)


@register("qkv_prepare", "triton")
def qkv_prepare(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    rotary_dim: int,
    is_neox: bool,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    num_q_heads: int,
    num_kv_heads: int,
    q_norm_weight: torch.Tensor | None = None,
    k_norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
) -> torch.Tensor:
    """q/k RMSNorm (optional), RoPE and the KV-cache write of one attention layer in one launch.

    Args:
        qkv: ``[T, (Hq + 2*Hkv) * D]`` the fused projection output (q heads, then k, then v),
            fp16/bf16 on CUDA; rows may be strided (a view), the last stride must be 1.
        positions: ``[T]`` int64 (or int32) position of each token; each must be below
            ``cos_sin_cache.shape[0]`` (not checked: that would read the GPU back).
        cos_sin_cache: float32 ``[max_position, rotary_dim]`` (cos half, then sin half), from
            :func:`~flotilla.kernels.rotary.rope_cache`.
        rotary_dim: leading dims of each head that rotate (the cache width, even, ``<= D``);
            the rest pass through (after the norm).
        is_neox: True rotates halves (HF Llama); False rotates adjacent pairs, kept interleaved.
        k_cache, v_cache: ``[num_blocks, block_size, Hkv, D]`` in qkv's dtype or both in one
            float8 dtype (any strides with a unit last one): the new K (normalised, rotated) and V
            go to ``slot_mapping`` (float8: saturated and rounded as ``write_kv`` stores them).
        slot_mapping: ``[T]`` int64 (or int32) ``block * block_size + offset`` of each token;
            a negative slot writes nothing for that token.
        num_q_heads, num_kv_heads: ``Hq`` and ``Hkv`` of this rank.
        q_norm_weight, k_norm_weight: ``[D]`` per-head RMSNorm weights (Qwen3), both or neither.
        eps: the RMSNorm epsilon.

    Returns the new contiguous ``q[T, Hq, D]``. Bit-identical to the torch references
    (``rms_norm``, then ``rotary_embedding``, then ``write_kv``) except where q/k norm's
    float32 ``rstd`` differs (see the module docstring). CUDA-graph capturable: no host sync,
    and the only allocation (``q``) depends on shapes alone.
    """
    head_dim = _check_inputs(
        qkv, positions, cos_sin_cache, rotary_dim, q_norm_weight, k_norm_weight, k_cache, v_cache, slot_mapping,
        num_q_heads, num_kv_heads,
    )
    tokens = qkv.shape[0]
    q = torch.empty(tokens, num_q_heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    if tokens == 0:
        return q  # NOTE: a zero-size grid is a launch error
    has_norm = q_norm_weight is not None
    block_d = triton.next_power_of_2(head_dim)
    fp8 = _fp8_format(k_cache.dtype)
    heads = heads_per_program(tokens, num_q_heads + num_kv_heads)
    _qkv_prepare_kernel[(tokens, triton.cdiv(num_q_heads + num_kv_heads, heads))](
        qkv,
        positions,
        cos_sin_cache,
        q_norm_weight if has_norm else qkv,  # NOTE: never read without HAS_NORM
        k_norm_weight if has_norm else qkv,
        q,
        k_cache,
        v_cache,
        slot_mapping,
        float(eps),
        qkv.stride(0),
        cos_sin_cache.stride(0),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        NUM_Q_HEADS=num_q_heads,
        NUM_KV_HEADS=num_kv_heads,
        HEADS=heads,
        HEAD_DIM=head_dim,
        ROT_DIM=rotary_dim,
        BLOCK_D=block_d,
        CACHE_BLOCK_SIZE=k_cache.shape[1],
        IS_NEOX=bool(is_neox),
        HAS_NORM=has_norm,
        FP8_MANT_BITS=fp8[0],
        FP8_MIN_EXP=fp8[1],
        FP8_MAX=fp8[2],
        # NOTE: one head: a warp for D <= 128, two above (as measured before several heads a
        # program existed); several heads: a warp per 256 values, at most 8.
        num_warps=max(1 if block_d <= 128 else 2, min(8, heads * block_d // 256)),
        # NOTE: no mul+add -> FMA contraction: it would skip the rounding of a product that the
        # reference rounds (LLVM otherwise fuses r(x*cos) - r(x'*sin) into one bf16 FMA).
        enable_fp_fusion=False,
        **launch_options(qkv.device),
    )
    return q
