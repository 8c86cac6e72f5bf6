"""MoE routing in Triton: which experts each token goes to, and the rows sorted by expert.

- ``select_experts`` (backend ``triton`` of the op; the torch reference is
  :func:`flotilla.kernels.moe.select_experts`): one launch, one program per token. The
  program loads the token's ``E`` logits (padded to a power of two), scores them (softmax
  or sigmoid), adds the correction bias for the choice, takes the ``top_k`` best by
  repeated max, renormalizes, scales and writes ``topk_weights[T, k]`` float32 and
  ``topk_ids[T, k]`` int64, best first. Group-limited routing and ``E > MAX_EXPERTS``
  are delegated to the torch reference inside the same function, so one backend name
  serves every model.
- :func:`route` (used by :mod:`flotilla.kernels.triton_moe`): one launch that sorts a
  call's (token, k) pairs by local expert into ``BLOCK_M``-padded segments.

Ties: among equal scores the lowest expert id is taken first, which is the set CUDA
``torch.topk`` keeps (its ``gatherTopK`` fills the last places with the first-seen values
equal to the k-th). Scores match the reference to ~2 ulp (an accurate ``exp``, IEEE
divisions); the reduction order of the softmax sum differs, so two experts whose scores
differ by an ulp or two at the k-th place may be chosen differently.

Both kernels are CUDA-graph capturable: no host synchronisation, grids from shapes only.
Importing this module imports Triton (see :mod:`flotilla.kernels.triton_moe`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from flotilla.kernels import moe
from flotilla.kernels.registry import register
from flotilla.kernels.triton_pdl import launch_options, start_dependent

MAX_EXPERTS = 1024  # more experts than this route through the torch reference
_ROUTE_CHUNK = 1024  # routes handled per step of the routing program's loops


# --------------------------------------------------------------------------- select_experts


@triton.jit
def _exp(x):
    """``exp(x)`` in float32 to ~1 ulp (``tl.exp`` rounds ``x * log2(e)`` first: ~1e-6
    relative error at ``|x| ~ 20``). Cody-Waite reduction ``x = n ln2 + r``, a degree-7
    polynomial for ``exp(r)``, and ``2^n`` built from exponent bits."""
    x = tl.minimum(tl.maximum(x, -104.0), 89.0)  # exp(-104) rounds to 0, exp(89) to inf
    n = tl.floor(x * 1.4426950408889634 + 0.5)
    r = tl.fma(n, -0.693145751953125, x)  # ln2, high bits: n * ln2_hi is exact
    r = tl.fma(n, -1.428606765330187e-06, r)  # ln2, low bits
    p = tl.fma(r, 1.0 / 5040.0, 1.0 / 720.0)
    p = tl.fma(p, r, 1.0 / 120.0)
    p = tl.fma(p, r, 1.0 / 24.0)
    p = tl.fma(p, r, 1.0 / 6.0)
    p = tl.fma(p, r, 0.5)
    p = tl.fma(p, r, 1.0)
    p = tl.fma(p, r, 1.0)
    # NOTE: n lies in [-150, 128]; two factors 2^(n/2) keep each power a normal float.
    half = n.to(tl.int32) // 2
    lo = ((half + 127) << 23).to(tl.float32, bitcast=True)
    hi = ((n.to(tl.int32) - half + 127) << 23).to(tl.float32, bitcast=True)
    return p * lo * hi


@triton.jit
def _select_experts_kernel(
    logits_ptr,
    bias_ptr,
    weights_ptr,
    ids_ptr,
    num_experts,
    stride_t,
    scaling,
    TOP_K: tl.constexpr,
    K_PAD: tl.constexpr,
    E_PAD: tl.constexpr,
    SIGMOID: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    PDL: tl.constexpr,
):
    start_dependent(PDL)  # NOTE: first: the logits come from the kernel before
    token = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, E_PAD)
    valid = offs < num_experts
    x = tl.load(logits_ptr + token * stride_t + offs, mask=valid, other=float("-inf")).to(tl.float32)
    if SIGMOID:
        scores = tl.math.div_rn(tl.full([E_PAD], 1.0, tl.float32), 1.0 + _exp(-x))
    else:
        e = tl.where(valid, _exp(x - tl.max(x, axis=0)), 0.0)
        scores = tl.math.div_rn(e, tl.zeros([E_PAD], tl.float32) + tl.sum(e, axis=0))
    key = scores
    if HAS_BIAS:
        key = scores + tl.load(bias_ptr + offs, mask=valid, other=0.0).to(tl.float32)
    k_offs = tl.arange(0, K_PAD)
    top_w = tl.zeros([K_PAD], tl.float32)
    top_id = tl.zeros([K_PAD], tl.int32)
    taken = ~valid  # padding lanes are never chosen
    for j in range(TOP_K):
        masked = tl.where(taken, float("-inf"), key)
        best = tl.max(masked, axis=0)
        # NOTE: lowest id among equal keys (see the module docstring); `~taken` keeps a row of
        # -inf keys choosing distinct experts; the clamp keeps a NaN row's ids in range.
        idx = tl.min(tl.where((masked == best) & ~taken, offs, E_PAD), axis=0)
        idx = tl.minimum(idx, num_experts - 1)
        hit = offs == idx
        top_w = tl.where(k_offs == j, tl.sum(tl.where(hit, scores, 0.0), axis=0), top_w)
        top_id = tl.where(k_offs == j, idx, top_id)
        taken = taken | hit
    if RENORMALIZE:
        # NOTE: the reference's epsilon, for sigmoid scores that all underflow.
        top_w = tl.math.div_rn(top_w, tl.zeros([K_PAD], tl.float32) + (tl.sum(top_w, axis=0) + 1e-20))
    top_w = top_w * scaling
    k_ok = k_offs < TOP_K
    tl.store(weights_ptr + token * TOP_K + k_offs, top_w, mask=k_ok)
    tl.store(ids_ptr + token * TOP_K + k_offs, top_id.to(tl.int64), mask=k_ok)


def launch_select_experts(
    router_logits: torch.Tensor,
    top_k: int,
    renormalize: bool,
    scoring: str,
    correction_bias: torch.Tensor | None,
    routed_scaling_factor: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel of :func:`select_experts` on any tensors Triton can address, without the
    delegation and device checks (the Triton interpreter runs it on CPU tensors)."""
    num_tokens, num_experts = router_logits.shape
    if router_logits.stride(1) != 1:
        router_logits = router_logits.contiguous()
    device = router_logits.device
    weights = torch.empty(num_tokens, top_k, dtype=torch.float32, device=device)
    ids = torch.empty(num_tokens, top_k, dtype=torch.int64, device=device)
    if num_tokens == 0:
        return weights, ids
    e_pad = triton.next_power_of_2(num_experts)
    _select_experts_kernel[(num_tokens,)](
        router_logits,
        correction_bias if correction_bias is not None else router_logits,  # unused pointer without bias
        weights,
        ids,
        num_experts,
        router_logits.stride(0),
        float(routed_scaling_factor),
        TOP_K=top_k,
        K_PAD=triton.next_power_of_2(top_k),
        E_PAD=e_pad,
        SIGMOID=scoring == "sigmoid",
        HAS_BIAS=correction_bias is not None,
        RENORMALIZE=renormalize,
        num_warps=max(1, min(4, e_pad // 256)),
        **launch_options(device),
    )
    return weights, ids


@register("select_experts", "triton")
def select_experts(
    router_logits: torch.Tensor,
    top_k: int,
    renormalize: bool,
    scoring: str = "softmax",
    num_expert_group: int | None = None,
    topk_group: int | None = None,
    correction_bias: torch.Tensor | None = None,
    routed_scaling_factor: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick ``top_k`` experts per token in one Triton launch; the torch reference's
    arguments and result (:func:`flotilla.kernels.moe.select_experts`): ``(topk_weights[T, k]
    float32, topk_ids[T, k] int64)``, best first, ties to the lowest id.

    Group-limited routing (``num_expert_group > 1``) and more than ``MAX_EXPERTS`` experts
    run the torch reference (several launches, still without host synchronisation).
    """
    if scoring not in ("softmax", "sigmoid"):
        raise ValueError(f"scoring must be 'softmax' or 'sigmoid', got scoring={scoring!r}")
    grouped = num_expert_group is not None or topk_group is not None
    if (grouped and not (num_expert_group == 1 and topk_group is not None)) or router_logits.shape[-1] > MAX_EXPERTS:
        return moe.select_experts(
            router_logits, top_k, renormalize, scoring, num_expert_group, topk_group, correction_bias,
            routed_scaling_factor,
        )
    if not router_logits.is_cuda:
        raise ValueError(
            f"the triton select_experts needs CUDA tensors, got router_logits on {router_logits.device}; "
            f"use the torch backend"
        )
    if router_logits.dim() != 2:
        raise ValueError(f"router_logits must be [T, E], got shape {tuple(router_logits.shape)}")
    num_experts = router_logits.shape[1]
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k={top_k} must be between 1 and the number of experts ({num_experts})")
    if correction_bias is not None and (correction_bias.shape != (num_experts,) or not correction_bias.is_contiguous()):
        raise ValueError(
            f"correction_bias must be a contiguous [{num_experts}] tensor, got shape {tuple(correction_bias.shape)}"
        )
    return launch_select_experts(router_logits, top_k, renormalize, scoring, correction_bias, routed_scaling_factor)


# --------------------------------------------------------------------------- rows sorted by expert


@triton.jit
def _route_kernel(
    topk_ids_ptr,
    expert_map_ptr,
    counts_ptr,
    starts_ptr,
    route_rank_ptr,
    route_expert_ptr,
    sorted_route_ptr,
    block_expert_ptr,
    num_routes,
    num_local,
    max_rows,
    max_blocks,
    HAS_MAP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    CHUNK: tl.constexpr,
    E_PAD: tl.constexpr,
    B_CHUNK: tl.constexpr,
    PDL: tl.constexpr,
):
    start_dependent(PDL)  # NOTE: before the counters are zeroed: no write may precede the wait
    offs = tl.arange(0, CHUNK)
    e_offs = tl.arange(0, E_PAD)
    e_ok = e_offs < num_local
    # Phase 0: zero the per-expert counters here rather than in a separate memset launch.
    tl.store(counts_ptr + e_offs, tl.zeros([E_PAD], dtype=tl.int32), mask=e_ok)
    tl.debug_barrier()
    # Phase 1: each route's local expert (-1 when not held here) and its rank in that expert.
    for start in range(0, num_routes, CHUNK):
        r = start + offs
        in_range = r < num_routes
        ids = tl.load(topk_ids_ptr + r, mask=in_range, other=0)
        if HAS_MAP:
            local = tl.load(expert_map_ptr + ids, mask=in_range, other=-1).to(tl.int32)
        else:
            local = ids.to(tl.int32)
        valid = in_range & (local >= 0) & (local < num_local)
        local = tl.where(valid, local, -1)
        rank = tl.atomic_add(counts_ptr + tl.where(valid, local, 0), 1, mask=valid)
        tl.store(route_rank_ptr + r, rank, mask=valid)
        tl.store(route_expert_ptr + r, local, mask=in_range)
    # NOTE: one program, so a barrier orders phase 1's writes before the reads below
    # (volatile loads skip L1; the atomics completed before their results were stored).
    tl.debug_barrier()
    # Phase 2: padded segment of each expert, the expert of every row block, sentinel rows.
    counts = tl.load(counts_ptr + e_offs, mask=e_ok, other=0, volatile=True)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, axis=0)
    tl.store(starts_ptr + e_offs, ends - padded, mask=e_ok)
    b_offs = tl.arange(0, B_CHUNK)
    for b0 in range(0, max_blocks, B_CHUNK):
        b = b0 + b_offs
        first_row = b * BLOCK_M
        # The expert of a row is the number of segments ending at or before it.
        expert = tl.sum((first_row[:, None] >= ends[None, :]).to(tl.int32), axis=1)
        expert = tl.where(expert < num_local, expert, -1)
        tl.store(block_expert_ptr + b, expert, mask=b < max_blocks)
    for s0 in range(0, max_rows, CHUNK):
        s = s0 + offs
        tl.store(sorted_route_ptr + s, tl.zeros([CHUNK], dtype=tl.int32) + num_routes, mask=s < max_rows)
    tl.debug_barrier()
    # Phase 3: each route's row = its expert's segment start + its rank.
    for start in range(0, num_routes, CHUNK):
        r = start + offs
        in_range = r < num_routes
        local = tl.load(route_expert_ptr + r, mask=in_range, other=-1, volatile=True)
        valid = local >= 0
        rank = tl.load(route_rank_ptr + r, mask=valid, other=0, volatile=True)
        seg_start = tl.load(starts_ptr + tl.where(valid, local, 0), mask=valid, other=0, volatile=True)
        tl.store(sorted_route_ptr + seg_start + rank, r, mask=valid)


@dataclass
class Routing:
    """Rows of one fused-MoE call sorted by expert; all on the device."""

    sorted_route: torch.Tensor  # [max_rows] int32: route of each row, num_routes = padding
    block_expert: torch.Tensor  # [max_blocks] int32: local expert of each row block, -1 = none
    route_expert: torch.Tensor  # [num_routes] int32: local expert of each route, -1 = not here
    block_m: int


def route(topk_ids: torch.Tensor, num_local: int, expert_map: torch.Tensor | None, block_m: int) -> Routing:
    """Sort ``topk_ids[T, k]``'s routes (global ids, mapped through ``expert_map`` when given)
    by local expert into ``block_m``-padded segments; one launch.

    Buffers are sized from host integers only (``T*k + min(E, T*k) * (block_m - 1)`` rows,
    the most that padding can need), so the shapes are fixed for a given batch size.
    """
    num_routes = topk_ids.numel()
    device = topk_ids.device
    max_rows = num_routes + min(num_local, num_routes) * (block_m - 1)
    max_blocks = triton.cdiv(max_rows, block_m)
    counts = torch.empty(num_local, dtype=torch.int32, device=device)  # zeroed by the kernel
    starts = torch.empty(num_local, dtype=torch.int32, device=device)
    route_rank = torch.empty(num_routes, dtype=torch.int32, device=device)
    route_expert = torch.empty(num_routes, dtype=torch.int32, device=device)
    sorted_route = torch.empty(max_rows, dtype=torch.int32, device=device)
    block_expert = torch.empty(max_blocks, dtype=torch.int32, device=device)
    e_pad = triton.next_power_of_2(num_local + 1)
    ids = topk_ids.reshape(-1)
    _route_kernel[(1,)](
        ids,
        expert_map if expert_map is not None else ids,
        counts,
        starts,
        route_rank,
        route_expert,
        sorted_route,
        block_expert,
        num_routes,
        num_local,
        max_rows,
        max_blocks,
        HAS_MAP=expert_map is not None,
        BLOCK_M=block_m,
        CHUNK=_ROUTE_CHUNK,
        E_PAD=e_pad,
        B_CHUNK=max(16, 4096 // e_pad),
        num_warps=8,
        **launch_options(device),
    )
    return Routing(sorted_route, block_expert, route_expert, block_m)
