"""Weight-only FP8 in Triton: the ``triton`` backend of ops ``fp8_grouped_moe`` and ``fp8_block_linear``.

For block-quantized FP8 checkpoints: float8 weights are widened to the activations' dtype in
registers and each tile's product is scaled by its 128x128 block scale; activations are not
quantized. Both ops match the float32 reference (:mod:`flotilla.kernels.fp8`) to bfloat16
rounding and are CUDA-graph capturable.

- ``fp8_grouped_moe`` runs the fused-MoE kernels of :mod:`flotilla.kernels.triton_moe` with
  their ``W_FP8`` path (decode reads half the bytes of bfloat16 experts);
- ``fp8_block_linear`` is a dense kernel (``_fp8_linear_kernel``); it is not yet faster than
  bfloat16 cuBLAS (see ``_LINEAR_CONFIGS``).

Importing this module imports Triton: the registry imports it only when the ``triton``
backend is asked for, so a machine without Triton gets the registry's "not available" error.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flotilla.kernels.fp8 import _check_scales
from flotilla.kernels.registry import register
from flotilla.kernels.triton_moe import fused_moe_with_config


@register("fp8_grouped_moe", "triton")
def fp8_grouped_moe(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w13_scale_inv: torch.Tensor,
    w2: torch.Tensor,
    w2_scale_inv: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    activation: str = "silu",
    expert_map: torch.Tensor | None = None,
) -> torch.Tensor:
    """:func:`~flotilla.kernels.fp8.fp8_grouped_moe` with the fused-MoE kernels reading float8
    weights: each weight tile is widened to ``hidden.dtype`` in registers and its product
    scaled by the tile's 128x128 block scale (weight-only FP8: activations are not
    quantized, so the result matches the float32 reference to bfloat16 rounding; decode
    reads half the bytes of bfloat16 experts). Needs ``moe_intermediate_size % 128 == 0``.
    """
    _check_scales(w13, w13_scale_inv, "w13")
    _check_scales(w2, w2_scale_inv, "w2")
    return fused_moe_with_config(
        hidden, w13, w2, topk_weights, topk_ids, activation, expert_map,
        w13_scale_inv=w13_scale_inv, w2_scale_inv=w2_scale_inv,
    )


# --------------------------------------------------------------------------- dense FP8 linear


@triton.jit
def _fp8_linear_kernel(
    x_ptr,
    w_ptr,
    scale_ptr,
    bias_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_sn,
    stride_om,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < M
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + tl.where(row_ok, rows, 0).to(tl.int64)[:, None] * stride_xm + offs_k[None, :]
    w_ptrs = w_ptr + tl.where(n_ok, offs_n, 0).to(tl.int64)[None, :] * stride_wn + offs_k[:, None]
    s_ptr = scale_ptr + (pid_n * BLOCK_N // 128) * stride_sn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            a = tl.load(x_ptrs)
            b = tl.load(w_ptrs)
        else:
            k_ok = k0 + offs_k < K
            a = tl.load(x_ptrs, mask=k_ok[None, :], other=0.0)
            b = tl.load(w_ptrs, mask=k_ok[:, None], other=0.0)
        acc += tl.dot(a, b.to(a.dtype)) * tl.load(s_ptr + k0 // 128)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    out_ptrs = out_ptr + rows.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & n_ok[None, :])


# (largest M served, (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages)); tiles divide 128.
# NOTE: measured on H200 at N 4096, K 7168: M=1 ~33 us, M=128 ~47 us: correct but about 2x
# slower than cuBLAS on the same weight in bfloat16 (18.5 / 21.6 us); a split-K or wider-K
# kernel is the next step before it pays for decode.
_LINEAR_CONFIGS = [(16, (16, 32, 128, 4, 4)), (256, (64, 32, 128, 4, 4)), (1 << 62, (128, 64, 64, 8, 3))]


@register("fp8_block_linear", "triton")
def fp8_block_linear(
    x: torch.Tensor, weight: torch.Tensor, weight_scale_inv: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """:func:`~flotilla.kernels.fp8.fp8_block_linear` reading the float8 weight directly
    (weight-only FP8, activations in ``x.dtype``, bfloat16/float16). Capturable."""
    return fp8_linear_with_config(x, weight, weight_scale_inv, bias)


def fp8_linear_with_config(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale_inv: torch.Tensor,
    bias: torch.Tensor | None = None,
    config: tuple[int, int, int, int, int] | None = None,
) -> torch.Tensor:
    """:func:`fp8_block_linear` with tiles ``(BLOCK_M, BLOCK_N, BLOCK_K, warps, stages)`` (None:
    the table), for tuning."""
    _check_scales(weight, weight_scale_inv, "weight")
    if x.dtype not in (torch.bfloat16, torch.float16) or not x.is_cuda:
        raise ValueError(f"the triton fp8_block_linear needs bfloat16/float16 CUDA input, got {x.dtype} on {x.device}")
    n, k = weight.shape
    if x.shape[-1] != k:
        raise ValueError(f"x has {x.shape[-1]} features, weight {tuple(weight.shape)} wants {k}")
    x2 = x.reshape(-1, k).contiguous()
    m = x2.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m:
        bm, bn, bk, warps, stages = config or next(c for limit, c in _LINEAR_CONFIGS if m <= limit)
        if 128 % bn or 128 % bk:
            raise ValueError(f"FP8 tiles must divide 128 (scale blocks), got BLOCK_N={bn}, BLOCK_K={bk}")
        scales = weight_scale_inv.float().contiguous()
        weight = weight.contiguous()
        _fp8_linear_kernel[(triton.cdiv(m, bm), triton.cdiv(n, bn))](
            x2, weight, scales, bias if bias is not None else scales, out, m, n, k,
            x2.stride(0), weight.stride(0), scales.stride(0), out.stride(0),
            HAS_BIAS=bias is not None, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, EVEN_K=k % bk == 0,
            num_warps=warps, num_stages=stages,
        )
    return out.reshape(*x.shape[:-1], n)
