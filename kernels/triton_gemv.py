"""A Triton GEMV for decode-sized batches: ``y[M, N] = x[M, K] @ w[N, K]^T (+ b)`` for
``M <= 4``, written to stream the weight once at close to the memory roofline, and the same
kernel with SiLU-and-mul fused into its input (a gated MLP's down projection).

At decode batch sizes a linear layer is a pure weight read: every weight byte is used
``M`` times, so the kernel's only job is to keep enough loads in flight. Each program owns
``BLOCK_N`` output columns and walks K in ``BLOCK_K`` chunks, multiplying the weight tile
with every row of ``x`` into a float32 accumulator that is reduced once at the end.

Measured on an H200 against cuBLAS (the gemv probe (removed in 004bdbd; in git history), Llama-3.1-8B shapes,
bf16, one row, CUDA-graph replays, weights rotated past the L2 cache): q/k/v 14.9 vs
15.5 us, o 11.4 vs 13.5 us, down 29.7 vs 31.3 us (cuBLAS runs split-K plus a reduce kernel
on these), gate/up 57.2 vs 55.9 us; at 2 and 4 rows cuBLAS wins. So the ``triton``
``linear`` backend (:func:`decode_linear`) takes one-row inputs and hands every other
shape to ``F.linear``. :func:`rms_norm_gemv` is the same stream with the RMSNorm before it
folded in (``rms_norm_linear``).

On SM90+ every kernel here is launched as a programmatic dependent (:mod:`.triton_pdl`): it reads its
first weight tile, lets the next kernel launch, then waits for the kernel before it (whose
output is its input). Back-to-back projections then overlap one's drain with the next one's
start: one Llama-3.1-8B layer's four projections took 111.3 us with it and 116.5 us without
(the fused probe, removed in 004bdbd), the batch-1 decode graph 4.20 ms and 4.38 ms.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.language.extra import cuda as tl_cuda

from flotilla.kernels.registry import register
from flotilla.kernels.triton_pdl import launch_options

MAX_ROWS = 4  # the largest M this kernel is meant for; larger batches use cuBLAS
MIN_PROGRAMS = 128  # programs a narrow output's GEMV aims for (see default_config)
# One-row launch configurations, by weight shape (N, K), where the H200 sweep's best beats the
# default rule by more than its noise (the fused probe's --shapes qwen3-30b-a3b run (the probe was removed in 004bdbd), in
# us per call, default -> tuned). Empty them to fall back to the rules (an A/B).
TUNED_ONE_ROW: dict[tuple[int, int], dict[str, int]] = {
    (2048, 4096): {"BLOCK_N": 4, "BLOCK_K": 2048, "num_warps": 4},  # Qwen3-30B-A3B o: 7.1 -> 5.6
    (128, 2048): {"BLOCK_N": 2, "BLOCK_K": 2048, "num_warps": 4},  # Qwen3-30B-A3B router: 1.4 -> 1.1
}
TUNED_NORM: dict[tuple[int, int], dict[str, int]] = {
    (5120, 2048): {"BLOCK_N": 8, "BLOCK_K": 512, "num_warps": 4},  # Qwen3-30B-A3B norm + q/k/v: 7.1 -> 6.6
}


@triton.jit
def _weight_tile(w_rows, k, col_ok, K, EVEN_K: tl.constexpr):
    """The ``[BLOCK_N, BLOCK_K]`` weight tile at columns ``k`` (zeros past N and K)."""
    if EVEN_K:
        return tl.load(w_rows + k[None, :], mask=col_ok[:, None], other=0.0)
    else:
        return tl.load(w_rows + k[None, :], mask=col_ok[:, None] & (k < K)[None, :], other=0.0)


@triton.jit
def _gemv_accumulate(acc, w, x_rows, k, row_ok, K, EVEN_K: tl.constexpr, SILU_MUL: tl.constexpr):
    """``acc[M, N, K] += w * x`` for the tile at columns ``k`` (x loaded here)."""
    # NOTE: with SILU_MUL, x is a gated MLP's [M, 2K] gate|up output and the GEMV's input is
    # silu(gate) * up, rounded to x's dtype as the separate activation kernel would store it.
    if EVEN_K:
        x_ok = row_ok[:, None]
    else:
        x_ok = row_ok[:, None] & (k < K)[None, :]
    x = tl.load(x_rows + k[None, :], mask=x_ok, other=0.0)
    if SILU_MUL:
        gate = x.to(tl.float32)
        up = tl.load(x_rows + K + k[None, :], mask=x_ok, other=0.0).to(tl.float32)
        x = (gate / (1.0 + tl.exp(-gate)) * up).to(x.dtype)
    return acc + w.to(tl.float32)[None, :, :] * x.to(tl.float32)[:, None, :]


@triton.jit
def _gemv_kernel(
    x_ptr, w_ptr, b_ptr, y_ptr, N, K, stride_xm, stride_wn, stride_ym,
    M: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr, SILU_MUL: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    rows = tl.arange(0, BLOCK_M)
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    row_ok = rows < M
    col_ok = cols < N
    acc = tl.zeros((BLOCK_M, BLOCK_N, BLOCK_K), dtype=tl.float32)
    w_rows = w_ptr + cols[:, None].to(tl.int64) * stride_wn
    x_rows = x_ptr + rows[:, None] * stride_xm
    k_start = 0
    if PDL:
        # Launched as a programmatic dependent: this program may run while the kernel before
        # drains. The weights do not depend on that kernel (x does), so the first weight tile
        # is read before waiting for it; the next kernel may launch as soon as we run.
        w = _weight_tile(w_rows, ks, col_ok, K, EVEN_K)
        tl_cuda.gdc_launch_dependents()
        tl_cuda.gdc_wait()
        acc = _gemv_accumulate(acc, w, x_rows, ks, row_ok, K, EVEN_K, SILU_MUL)
        k_start = BLOCK_K
    for k0 in range(k_start, K, BLOCK_K):
        k = k0 + ks
        w = _weight_tile(w_rows, k, col_ok, K, EVEN_K)
        acc = _gemv_accumulate(acc, w, x_rows, k, row_ok, K, EVEN_K, SILU_MUL)
    y = tl.sum(acc, axis=2)
    if HAS_BIAS:
        y += tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    out = y_ptr + rows[:, None] * stride_ym + cols[None, :]
    tl.store(out, y.to(y_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _norm_accumulate(acc, squares, w, x_ptr, r_ptr, g_ptr, r_out_ptr, k, K, store_residual, HAS_RESIDUAL: tl.constexpr):
    """One K tile of :func:`_norm_gemv_kernel`: ``(acc + w * g * h, squares + h * h)`` where
    ``h`` is the row (plus the residual, rounded to the dtype and stored by one program)."""
    k_ok = k < K
    h = tl.load(x_ptr + k, mask=k_ok, other=0.0)
    if HAS_RESIDUAL:
        h = (h.to(tl.float32) + tl.load(r_ptr + k, mask=k_ok, other=0.0).to(tl.float32)).to(h.dtype)
        tl.store(r_out_ptr + k, h, mask=k_ok & store_residual)
    hf = h.to(tl.float32)
    xk = tl.load(g_ptr + k, mask=k_ok, other=0.0).to(tl.float32) * hf
    return acc + w.to(tl.float32) * xk[None, :], squares + hf * hf


@triton.jit
def _norm_gemv_kernel(
    x_ptr, r_ptr, g_ptr, w_ptr, b_ptr, y_ptr, r_out_ptr, N, K, stride_wn, eps,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, HAS_RESIDUAL: tl.constexpr, HAS_BIAS: tl.constexpr,
    EVEN_K: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    # One row, one pass over K: y = rstd * sum_k w[n, k] * g[k] * h[k], the sum of squares for
    # rstd gathered in the same loop (each program owns BLOCK_N columns and reads the row from
    # L2 as it goes). The residual sum is rounded to the model dtype as the reference rounds
    # it; the normalized row is not, so y can differ from the reference's roundings by about
    # one ulp of the row's elements. (A first pass for rstd, so the row could be rounded
    # first, cost 1.5x the weight read on the H200: the weight stream waits for it.)
    pid = tl.program_id(0)
    ks = tl.arange(0, BLOCK_K)
    cols = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    w_rows = w_ptr + cols[:, None].to(tl.int64) * stride_wn
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    squares = tl.zeros((BLOCK_K,), dtype=tl.float32)
    k_start = 0
    if PDL:
        # As in _gemv_kernel: the first weight tile is read before waiting for the row.
        w = _weight_tile(w_rows, ks, col_ok, K, EVEN_K)
        tl_cuda.gdc_launch_dependents()
        tl_cuda.gdc_wait()
        acc, squares = _norm_accumulate(acc, squares, w, x_ptr, r_ptr, g_ptr, r_out_ptr, ks, K, pid == 0, HAS_RESIDUAL)
        k_start = BLOCK_K
    for k0 in range(k_start, K, BLOCK_K):
        k = k0 + ks
        w = _weight_tile(w_rows, k, col_ok, K, EVEN_K)
        acc, squares = _norm_accumulate(acc, squares, w, x_ptr, r_ptr, g_ptr, r_out_ptr, k, K, pid == 0, HAS_RESIDUAL)
    rstd = 1.0 / tl.sqrt(tl.sum(squares, axis=0) / K + eps)
    y = tl.sum(acc, axis=1) * rstd
    if HAS_BIAS:
        y += tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    tl.store(y_ptr + cols, y.to(y_ptr.dtype.element_ty), mask=col_ok)


def gemv_configs(n: int, k: int, m: int) -> list[dict[str, int]]:
    """The launch configurations a tuning sweep tries for an ``[m, k] x [n, k]^T`` GEMV."""
    return [
        {"BLOCK_N": bn, "BLOCK_K": bk, "num_warps": warps}
        for bn in (2, 4, 8, 16)
        for bk in (256, 512, 1024)
        for warps in (4, 8)
        if bn * bk * max(1, m) <= 16384
    ]


def default_config(n: int, k: int, m: int) -> dict[str, int]:
    """The launch configuration :func:`gemv` uses when none is given: the best of the
    H200 sweep for one row (8 columns a program, K in chunks of 1024, or 512 where 1024
    does not divide K). A narrow output (an MoE router's 64-128 experts) takes fewer columns
    a program, down to 2, so that the weight is read by at least ~64 programs instead of 8-16.
    One row of a shape in :data:`TUNED_ONE_ROW` takes the configuration measured there."""
    if m == 1 and (n, k) in TUNED_ONE_ROW:
        return dict(TUNED_ONE_ROW[(n, k)])
    block_n = 8
    while block_n > 2 and n // block_n < MIN_PROGRAMS:
        block_n //= 2
    return {"BLOCK_N": block_n, "BLOCK_K": 1024 if k % 1024 == 0 else 512, "num_warps": 4}


def norm_config(n: int, k: int) -> dict[str, int]:
    """The launch configuration :func:`rms_norm_gemv` uses when none is given: within a
    microsecond of the best of the H200 sweep on both Llama-3.1-8B shapes it runs
    (the fused probe, removed in 004bdbd: q/k/v 15.9 us, gate/up 59.1 us, one row); a shape in
    :data:`TUNED_NORM` takes the configuration measured there."""
    if (n, k) in TUNED_NORM:
        return dict(TUNED_NORM[(n, k)])
    return {"BLOCK_N": 4, "BLOCK_K": 1024 if k % 1024 == 0 else 512, "num_warps": 4}


def gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    config: dict[str, int] | None = None,
    silu_mul: bool = False,
) -> torch.Tensor:
    """``x[M, K] @ weight[N, K]^T + bias[N]`` for ``M <= MAX_ROWS`` (CUDA tensors of one dtype).

    With ``silu_mul`` ``x`` is ``[M, 2K]`` (gate columns, then up columns) and the product
    is ``silu_and_mul(x) @ weight^T``, the activation never stored."""
    m, k = x.shape[0], x.shape[1] // 2 if silu_mul else x.shape[1]
    n = weight.shape[0]
    if x.dim() != 2 or m > MAX_ROWS:
        raise ValueError(f"gemv takes x[M, K] with at most {MAX_ROWS} rows; got x with shape {tuple(x.shape)}")
    if weight.shape[1] != k or weight.stride(1) != 1 or x.stride(1) != 1 or (silu_mul and x.shape[1] != 2 * k):
        raise ValueError(
            f"gemv needs row-major x[M, {'2K' if silu_mul else 'K'}] and weight[N, K]; "
            f"got x {tuple(x.shape)} and weight {tuple(weight.shape)}"
        )
    cfg = dict(config or default_config(n, k, m))
    block_n, block_k = cfg.pop("BLOCK_N"), cfg.pop("BLOCK_K")
    y = torch.empty((m, n), device=x.device, dtype=x.dtype)
    _gemv_kernel[(triton.cdiv(n, block_n),)](
        x, weight, bias if bias is not None else weight, y, n, k, x.stride(0), weight.stride(0), y.stride(0),
        M=m, BLOCK_M=triton.next_power_of_2(m), BLOCK_N=block_n, BLOCK_K=block_k,
        HAS_BIAS=bias is not None, EVEN_K=k % block_k == 0, SILU_MUL=silu_mul, **cfg, **launch_options(x.device),
    )  # fmt: skip
    return y


def rms_norm_gemv(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    config: dict[str, int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rms_norm(x + residual) @ weight^T + bias, x + residual)`` for ONE row ``x[1, K]``
    (without ``residual``: the norm of ``x``, and ``x`` itself as the second result), in one
    launch and one pass over the weight: the RMSNorm fused into the GEMV of the projection
    that consumes it. The residual sum is rounded as the torch reference rounds it
    (``kernels/norm.py``); the normalized row stays in float32 (``rstd`` scales the product
    at the end), so the output differs from the reference by up to about one ulp of the
    row's elements. ``config`` is a launch configuration (default :func:`norm_config`).
    Inputs are not modified."""
    k = x.shape[-1]
    n = weight.shape[0]
    if x.dim() != 2 or x.shape[0] != 1 or x.stride(-1) != 1:
        raise ValueError(f"rms_norm_gemv takes one contiguous row x[1, K]; got x with shape {tuple(x.shape)}")
    if weight.shape[1] != k or weight.stride(1) != 1 or norm_weight.shape != (k,):
        raise ValueError(
            f"rms_norm_gemv needs weight[N, {k}] row-major and norm_weight[{k}]; "
            f"got weight {tuple(weight.shape)} and norm_weight {tuple(norm_weight.shape)}"
        )
    if residual is not None and (residual.shape != x.shape or residual.stride(-1) != 1):
        raise ValueError(f"residual must match x {tuple(x.shape)}; got {tuple(residual.shape)}")
    cfg = dict(config or norm_config(n, k))
    block_n, block_k = cfg.pop("BLOCK_N"), cfg.pop("BLOCK_K")
    y = torch.empty((1, n), device=x.device, dtype=x.dtype)
    new_residual = torch.empty_like(x) if residual is not None else x
    _norm_gemv_kernel[(triton.cdiv(n, block_n),)](
        x, residual if residual is not None else x, norm_weight, weight, bias if bias is not None else weight,
        y, new_residual, n, k, weight.stride(0), eps,
        BLOCK_N=block_n, BLOCK_K=block_k, HAS_RESIDUAL=residual is not None, HAS_BIAS=bias is not None,
        EVEN_K=k % block_k == 0, **cfg, **launch_options(x.device),
    )  # fmt: skip
    return y, new_residual


def _one_row(x: torch.Tensor) -> bool:
    """Whether :func:`gemv` beats cuBLAS on ``x``: one row of a half dtype on CUDA."""
    return x.dim() == 2 and x.shape[0] == 1 and x.stride(-1) == 1 and x.is_cuda and x.dtype != torch.float32


@register("linear", "triton")
def decode_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear``'s contract; a one-row input (a batch-1 decode step) runs :func:`gemv`."""
    return gemv(x, weight, bias) if _one_row(x) else F.linear(x, weight, bias)


@register("rms_norm_linear", "triton")
def rms_norm_linear(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """:func:`rms_norm_gemv` for a one-row ``x`` (a batch-1 decode step); None for any other
    input, which the caller runs as the norm, then the linear layer."""
    if not _one_row(x) or (residual is not None and residual.stride(-1) != 1):
        return None
    return rms_norm_gemv(x, residual, norm_weight, eps, weight, bias)


@register("silu_and_mul_linear", "triton")
def silu_and_mul_linear(x: torch.Tensor, weight: torch.Tensor, silu_and_mul) -> torch.Tensor:
    """``silu_and_mul(x) @ weight^T`` for a gated MLP's ``x[T, 2K]``: one fused kernel for a
    one-row ``x``, else ``silu_and_mul`` (the elementwise backend's op) then ``F.linear``."""
    return gemv(x, weight, silu_mul=True) if _one_row(x) else F.linear(silu_and_mul(x), weight)
