"""Block-quantized FP8 GEMMs (DeepSeek-style checkpoints): a dense linear and grouped MoE experts.

A checkpoint stores each weight ``W[N, K]`` as ``weight`` (``float8_e4m3fn``) plus
``weight_scale_inv[ceil(N/128), ceil(K/128)]`` (float32): the real weight is
``weight * weight_scale_inv`` blockwise (despite the name, the scale multiplies). Stacked
expert weights carry a leading expert dimension on both.

Backends:

- ``torch`` (the oracle): dequantize the weight to float32 and multiply in float32, the exact
  math the checkpoint means; activations stay unquantized.
- ``deep_gemm`` (SM90, sgl-deep-gemm): activations are quantized per token per 128 columns to
  e4m3 (scale = amax / 448) and multiplied with ``deep_gemm.fp8_gemm_nt`` /
  ``m_grouped_fp8_gemm_nt_contiguous`` (bfloat16 output). DeepGEMM JIT-compiles each kernel
  configuration on first use (needs ``CUDA_HOME``/nvcc; cached under ``$HOME/.deep_gemm``), so
  run every shape once before CUDA-graph capture.

DeepGEMM's layouts (SM90, recipe ``(1, 128, 128)``): A ``[M, K]`` and B ``[N, K]`` K-major;
A's scales ``[M, K/128]`` float32, column-major with the M stride padded to 4 (TMA-aligned;
other layouts are accepted but transposed by a copy on every call); B's scales
``[ceil(N/128), ceil(K/128)]`` float32 contiguous, exactly the checkpoint's tensor; D bfloat16
``[M, N]`` row-major. The grouped "contiguous" GEMM takes A's rows sorted by expert, each
expert's segment padded to ``get_mk_alignment_for_contiguous_layout()`` (128) rows, and
``m_indices[M]`` int32 naming each row's expert, ``-1`` for padding rows (skipped).
"""

from __future__ import annotations

import torch

from flotilla.kernels.moe import _ACTIVATIONS
from flotilla.kernels.registry import register

FP8_BLOCK = 128  # the checkpoint's (and DeepGEMM's) quantization block, rows and columns
FP8_MAX = 448.0  # largest finite float8_e4m3fn


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _check_scales(weight: torch.Tensor, scale_inv: torch.Tensor, name: str) -> None:
    if weight.dtype != torch.float8_e4m3fn:
        raise ValueError(f"{name} must be float8_e4m3fn, got {weight.dtype}")
    n, k = weight.shape[-2:]
    want = (*weight.shape[:-2], _ceil_div(n, FP8_BLOCK), _ceil_div(k, FP8_BLOCK))
    if tuple(scale_inv.shape) != want:
        raise ValueError(
            f"{name}_scale_inv has shape {tuple(scale_inv.shape)}, expected {want} for {name} {tuple(weight.shape)} "
            f"(one scale per {FP8_BLOCK}x{FP8_BLOCK} block)"
        )


def dequantize_block_fp8(weight: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    """``weight[..., N, K]`` float8 times its blockwise ``scale_inv[..., ceil(N/128), ceil(K/128)]``, float32."""
    _check_scales(weight, scale_inv, "weight")
    n, k = weight.shape[-2:]
    scale = scale_inv.float().repeat_interleave(FP8_BLOCK, dim=-2)[..., :n, :]
    scale = scale.repeat_interleave(FP8_BLOCK, dim=-1)[..., :k]
    return weight.float() * scale


def quantize_block_fp8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse, for tests and random-weight models: ``weight[..., N, K]`` -> ``(fp8, scale_inv)``
    with one scale per 128x128 block (``amax / 448``, at least 1e-4 / 448)."""
    n, k = weight.shape[-2:]
    pn, pk = _ceil_div(n, FP8_BLOCK) * FP8_BLOCK, _ceil_div(k, FP8_BLOCK) * FP8_BLOCK
    padded = torch.zeros(*weight.shape[:-2], pn, pk, dtype=torch.float32, device=weight.device)
    padded[..., :n, :k] = weight.float()
    blocks = padded.unflatten(-1, (pk // FP8_BLOCK, FP8_BLOCK)).unflatten(-3, (pn // FP8_BLOCK, FP8_BLOCK))
    # blocks: [..., N/128, 128, K/128, 128]
    amax = blocks.abs().amax(dim=(-3, -1), keepdim=True).clamp(min=1e-4)
    scale = amax / FP8_MAX
    q = (blocks / scale).to(torch.float8_e4m3fn).flatten(-4, -3).flatten(-2, -1)[..., :n, :k].contiguous()
    return q, scale.squeeze(-1).squeeze(-2).contiguous()


def quantize_per_token_group(x: torch.Tensor, column_major_scales: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """``x[M, K]`` (K a multiple of 128) -> ``(x_fp8[M, K] e4m3, scales[M, K/128] float32)``,
    one scale per token per 128 columns (``amax / 448``, at least 1e-4 / 448).

    ``column_major_scales``: lay the scales out as DeepGEMM reads them (M contiguous, the
    M stride padded to a multiple of 4), so it need not transpose them.
    """
    m, k = x.shape
    if k % FP8_BLOCK:
        raise ValueError(f"per-token FP8 quantization needs K % {FP8_BLOCK} == 0, got K={k}")
    groups = x.float().view(m, k // FP8_BLOCK, FP8_BLOCK)
    scale = groups.abs().amax(dim=-1).clamp(min=1e-4) / FP8_MAX
    q = (groups / scale.unsqueeze(-1)).to(torch.float8_e4m3fn).view(m, k)
    if not column_major_scales:
        return q, scale
    aligned_m = _ceil_div(m, 4) * 4
    scales = torch.empty(k // FP8_BLOCK, aligned_m, dtype=torch.float32, device=x.device).t()[:m]
    scales.copy_(scale)
    return q, scales


# --------------------------------------------------------------------------- torch reference


@register("fp8_block_linear", "torch")
def fp8_block_linear(
    x: torch.Tensor, weight: torch.Tensor, weight_scale_inv: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``x[..., K] @ dequant(weight[N, K])^T + bias[N]`` in float32; returns ``x.dtype``."""
    w = dequantize_block_fp8(weight, weight_scale_inv)
    y = x.float() @ w.t()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


@register("fp8_grouped_moe", "torch")
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
    """:func:`~flotilla.kernels.moe.fused_moe` over block-FP8 experts, in float32.

    Args:
        hidden: ``[T, H]``.
        w13, w13_scale_inv: ``[E_local, 2I, H]`` float8 (gate rows, then up rows) and
            ``[E_local, ceil(2I/128), ceil(H/128)]`` scales.
        w2, w2_scale_inv: ``[E_local, H, I]`` float8 and ``[E_local, ceil(H/128), ceil(I/128)]``.
        topk_weights, topk_ids, activation, expert_map: as ``fused_moe``.

    Returns ``[T, H]`` in ``hidden.dtype``.
    """
    if activation not in _ACTIVATIONS:
        raise ValueError(f"activation must be one of {sorted(_ACTIVATIONS)}, got activation={activation!r}")
    _check_scales(w13, w13_scale_inv, "w13")
    _check_scales(w2, w2_scale_inv, "w2")
    act_and_mul = _ACTIVATIONS[activation]
    x_all = hidden.float()
    out = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
    flat_ids = topk_ids.reshape(-1)
    flat_weights = topk_weights.reshape(-1).float()
    token_of_route = torch.arange(hidden.shape[0], device=hidden.device).repeat_interleave(topk_ids.shape[1])
    for expert in flat_ids.unique().tolist():
        local = expert if expert_map is None else int(expert_map[expert])
        if local < 0:
            continue
        routes = (flat_ids == expert).nonzero(as_tuple=True)[0]
        tokens = token_of_route[routes]
        h = act_and_mul(x_all[tokens] @ dequantize_block_fp8(w13[local], w13_scale_inv[local]).t())
        y = h @ dequantize_block_fp8(w2[local], w2_scale_inv[local]).t()
        out.index_add_(0, tokens, y * flat_weights[routes, None])
    return out.to(hidden.dtype)


# --------------------------------------------------------------------------- deep_gemm


def _deep_gemm():
    """Import DeepGEMM (lazily: only the ``deep_gemm`` backend needs it)."""
    try:
        import deep_gemm
    except Exception as exc:  # ImportError, or its loader's assertion when CUDA_HOME is missing
        raise ImportError(
            f"deep_gemm (sgl-deep-gemm 0.2.1) could not be imported ({exc!r}); it needs apache-tvm-ffi and "
            f"CUDA_HOME (nvcc) for its JIT"
        ) from exc
    return deep_gemm


def _check_deep_gemm_inputs(x2: torch.Tensor, k: int, n: int) -> None:
    if k % FP8_BLOCK:
        raise ValueError(f"the deep_gemm FP8 path needs K % {FP8_BLOCK} == 0, got K={k}")
    if n % 8:
        raise ValueError(f"the deep_gemm FP8 path needs N % 8 == 0 (16-byte output rows), got N={n}")
    if not x2.is_cuda:
        raise ValueError(f"the deep_gemm FP8 path needs CUDA tensors, got x on {x2.device}")


@register("fp8_block_linear", "deep_gemm")
def fp8_block_linear_deep_gemm(
    x: torch.Tensor, weight: torch.Tensor, weight_scale_inv: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """:func:`fp8_block_linear` with per-token FP8 activations on DeepGEMM (bfloat16 GEMM output,
    cast to ``x.dtype``). ``weight_scale_inv`` should already be float32 and contiguous."""
    dg = _deep_gemm()
    n, k = weight.shape
    x2 = x.reshape(-1, k)
    _check_deep_gemm_inputs(x2, k, n)
    _check_scales(weight, weight_scale_inv, "weight")
    out = torch.empty(x2.shape[0], n, dtype=torch.bfloat16, device=x.device)
    if x2.shape[0]:
        x_fp8, x_scales = quantize_per_token_group(x2)
        dg.fp8_gemm_nt((x_fp8, x_scales), (weight, weight_scale_inv.float().contiguous()), out)
    if bias is not None:
        out = out + bias.to(out.dtype)
    return out.to(x.dtype).reshape(*x.shape[:-1], n)


def contiguous_layout(
    topk_ids: torch.Tensor, num_local: int, expert_map: torch.Tensor | None, alignment: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rows for DeepGEMM's grouped "contiguous" GEMM, without a host synchronisation.

    Each local expert's routes get a segment padded to ``alignment`` rows, segments back to
    back. Returns ``(dest[T*k] int64, valid[T*k] bool, m_indices[M] int32)``: the row of each
    route (routes not held here point at the last ``alignment`` rows, a block of ``-1`` that
    DeepGEMM skips), and each row's expert or ``-1``. ``M`` depends only on shapes:
    ``align(T*k + min(E, T*k) * (alignment - 1), alignment) + alignment``.
    """
    flat = topk_ids.reshape(-1)
    num_routes = flat.numel()
    local = expert_map[flat] if expert_map is not None else flat
    valid = (local >= 0) & (local < num_local)
    key = torch.where(valid, local, num_local)
    counts = torch.zeros(num_local + 1, dtype=torch.int64, device=flat.device)
    counts.scatter_add_(0, key, torch.ones_like(key))
    counts = counts[:num_local]
    padded = (counts + alignment - 1) // alignment * alignment
    seg_start = torch.cumsum(padded, 0) - padded
    first_of_expert = torch.cumsum(counts, 0) - counts
    order = torch.sort(key, stable=True).indices  # routes grouped by expert
    position = torch.empty_like(order)
    position[order] = torch.arange(num_routes, device=flat.device)
    safe = key.clamp(max=num_local - 1)
    body = _ceil_div(num_routes + min(num_local, num_routes) * (alignment - 1), alignment) * alignment
    dest = torch.where(valid, seg_start[safe] + position - first_of_expert[safe], body)
    m_indices = torch.full((body + alignment,), -1, dtype=torch.int32, device=flat.device)
    m_indices[dest] = torch.where(valid, local, -1).to(torch.int32)
    return dest, valid, m_indices


@register("fp8_grouped_moe", "deep_gemm")
def fp8_grouped_moe_deep_gemm(
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
    """:func:`fp8_grouped_moe` on DeepGEMM's grouped contiguous FP8 GEMM.

    Tokens are quantized per 128 columns, copied into their routes' rows of the padded
    layout (:func:`contiguous_layout`), multiplied by the gate/up experts, activated in
    float32, quantized again, multiplied by the down experts, and summed per token with the
    routing weights. No host synchronisation (capturable once DeepGEMM has compiled).
    Needs ``H % 128 == 0`` and ``I % 128 == 0``.
    """
    if activation not in _ACTIVATIONS:
        raise ValueError(f"activation must be one of {sorted(_ACTIVATIONS)}, got activation={activation!r}")
    dg = _deep_gemm()
    _check_scales(w13, w13_scale_inv, "w13")
    _check_scales(w2, w2_scale_inv, "w2")
    num_tokens, top_k = topk_ids.shape
    num_local, two_i, h = w13.shape
    inter = two_i // 2
    _check_deep_gemm_inputs(hidden, h, two_i)
    _check_deep_gemm_inputs(hidden, inter, h)
    out = torch.empty_like(hidden)
    if num_tokens == 0:
        return out
    alignment = int(dg.get_mk_alignment_for_contiguous_layout())
    dest, valid, m_indices = contiguous_layout(topk_ids, num_local, expert_map, alignment)
    rows = m_indices.shape[0]
    token_of_route = torch.arange(num_tokens, device=hidden.device).repeat_interleave(top_k)

    # Gate/up: quantize each token once, then copy it into its routes' rows.
    # NOTE: padding rows stay zero (float8 copied as bytes: index_put has no float8 kernels).
    x_fp8, x_scales = quantize_per_token_group(hidden, column_major_scales=False)
    a = torch.zeros(rows, h, dtype=torch.uint8, device=hidden.device)
    a[dest] = x_fp8.view(torch.uint8)[token_of_route]
    a_scales = torch.empty(h // FP8_BLOCK, rows, dtype=torch.float32, device=hidden.device).t()
    a_scales.fill_(1.0)
    a_scales[dest] = x_scales[token_of_route]
    gate_up = torch.empty(rows, two_i, dtype=torch.bfloat16, device=hidden.device)
    dg.m_grouped_fp8_gemm_nt_contiguous(
        (a.view(torch.float8_e4m3fn), a_scales), (w13, w13_scale_inv.float()), gate_up, m_indices
    )

    # Down: rows in -1 blocks hold garbage in gate_up; DeepGEMM skips them again, and their
    # results are never read (the combine below uses valid routes only).
    h_act = _ACTIVATIONS[activation](gate_up.float())
    h_fp8, h_scales = quantize_per_token_group(h_act)
    down = torch.empty(rows, h, dtype=torch.bfloat16, device=hidden.device)
    dg.m_grouped_fp8_gemm_nt_contiguous((h_fp8, h_scales), (w2, w2_scale_inv.float()), down, m_indices)

    routed = down[dest].float() * topk_weights.reshape(-1, 1).float()
    routed = torch.where(valid.unsqueeze(1), routed, 0.0)
    return routed.view(num_tokens, top_k, h).sum(dim=1).to(hidden.dtype)
