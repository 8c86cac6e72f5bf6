"""MoE routing in Triton: which experts each token goes to, and the rows sorted by expert.

- ``select_experts`` (backend ``triton`` of the op; the torch reference is
  :func:`flotilla.kernels.moe.select_experts`): one launch, one program per token. The
  program loads the token's ``E`` logits (padded to a power of two), scores them (softmax
  or sigmoid), adds the correction bias for the choice, takes the ``top_k`` best by
  repeated max, renormalizes, scales and writes ``topk_weights[T, k]`` float32 and
  ``topk_ids[T, k]`` int64, best first. Group-limited routing and ``E > MAX_EXPERTS``
  are delegated to the torch reference inside the same function, so one backend name
  serves every model.
- ``router_select`` (op ``router_select``, backend ``triton``; :func:`router_select_experts`):
  ONE token's router GEMV and selection in one launch, a batch-1 decode step's routing. The
  programs compute the logits as the one-row GEMV does (:func:`~flotilla.kernels.triton_gemv.gemv`,
  same jit code and launch configuration), each stores its ``BLOCK_N`` logits rounded to the
  router's dtype and counts in on a counter; the program that brings it to the number of
  programs runs ``select_experts``' selection on the stored logits, so weights and ids are
  bit-identical to the two launches. :data:`FUSED_ROUTER_SELECT` turns it off.
- :func:`route` (used by :mod:`flotilla.kernels.triton_moe`): one launch that sorts a
  call's (token, k) pairs by local expert into ``BLOCK_M``-padded segments.

Ties: among equal scores the lowest expert id is taken first, which is the set CUDA
``torch.topk`` keeps (its ``gatherTopK`` fills the last places with the first-seen values
equal to the k-th). Scores match the reference to ~2 ulp (an accurate ``exp``, IEEE
divisions, the softmax denominator a fixed-point integer sum, so the same bits whatever the
launch's ``num_warps``); torch's float sum rounds differently, so two experts whose scores
differ by an ulp or two at the k-th place may be chosen differently.

The kernels are CUDA-graph capturable: no host synchronisation, grids from shapes only.
Importing this module imports Triton (see :mod:`flotilla.kernels.triton_moe`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from flotilla.kernels import moe
from flotilla.kernels.registry import register
from flotilla.kernels.triton_gemv import default_config, gemv_block
from flotilla.kernels.triton_pdl import launch_options, start_dependent

MAX_EXPERTS = 1024  # more experts than this route through the torch reference
# One token's router GEMV and selection in one launch (op router_select). Off: the op declines
# every call and the router's GEMV and select_experts run as two launches, for an A/B.
FUSED_ROUTER_SELECT = True
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
def _order_free_sum(v):
    """``sum(v)`` of float32 ``v`` in ``[0, 1]`` (at most 2^10 terms; a NaN makes it NaN) with
    the same bits whatever the layout. ``tl.sum`` of floats adds in the order of the layout,
    which follows ``num_warps``, so the same row would round differently in kernels launched
    with different warps; integer sums do not depend on the order. Each term is scaled by 2^52
    and truncated to an int64 (at most 2^10 * 2^52 < 2^63), losing under 2^-52 each; for a
    softmax denominator (at least 1: the largest term is ``exp(0)``) that is under 2^-42
    relative before the one rounding to float32."""
    ok = v == v
    fixed = (tl.where(ok, v, 0.0) * 4503599627370496.0).to(tl.int64)  # 2^52
    total = tl.sum(fixed, axis=0).to(tl.float32) * 2.220446049250313e-16  # 2^-52: exact
    return tl.where(tl.min(ok.to(tl.int32), axis=0) == 0, float("nan"), total)


@triton.jit
def _order_bits(bits):
    """A float32's int32 bits -> an int32 whose signed order is the floats' order (negative
    floats get their magnitude bits flipped), and back: the map is its own inverse."""
    return bits ^ ((bits >> 31) & 0x7FFFFFFF)


@triton.jit
def _select_token(
    logits_ptr,
    bias_ptr,
    weights_ptr,
    ids_ptr,
    num_experts,
    scaling,
    TOP_K: tl.constexpr,
    K_PAD: tl.constexpr,
    E_PAD: tl.constexpr,
    SIGMOID: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    CACHE: tl.constexpr,
):
    """One token's choice: its ``num_experts`` logits at ``logits_ptr`` (loaded with cache
    modifier ``CACHE``) -> ``TOP_K`` float32 weights at ``weights_ptr`` and int64 ids at
    ``ids_ptr``, best first. Every reduction here is exact or :func:`_order_free_sum`, so the
    result does not depend on ``num_warps``: the one-launch router + selection
    (:func:`_router_select_kernel`) and :func:`_select_experts_kernel` give the same bits."""
    offs = tl.arange(0, E_PAD)
    valid = offs < num_experts
    x = tl.load(logits_ptr + offs, mask=valid, other=float("-inf"), cache_modifier=CACHE).to(tl.float32)
    if SIGMOID:
        scores = tl.math.div_rn(tl.full([E_PAD], 1.0, tl.float32), 1.0 + _exp(-x))
    else:
        e = tl.where(valid, _exp(x - tl.max(x, axis=0)), 0.0)
        scores = tl.math.div_rn(e, tl.zeros([E_PAD], tl.float32) + _order_free_sum(e))
    key = scores
    if HAS_BIAS:
        key = scores + tl.load(bias_ptr + offs, mask=valid, other=0.0).to(tl.float32)
    k_offs = tl.arange(0, K_PAD)
    top_w = tl.zeros([K_PAD], tl.float32)
    top_id = tl.zeros([K_PAD], tl.int32)
    chosen_sum = tl.zeros((), tl.float32)  # the chosen weights, added in rank order
    # Each lane's key and id in one int64, the key's order-preserving bits above E_PAD-1-id: one
    # max per rank finds the best key and, among equal keys, the lowest id (see the module
    # docstring). Keys are never -0.0 (scores are +0.0 or more), so equal floats are equal bits.
    packed = (_order_bits(key.to(tl.int32, bitcast=True)).to(tl.int64) << 32) | (E_PAD - 1 - offs).to(tl.int64)
    taken = ~valid  # padding lanes are never chosen, nor a chosen lane again (below any key, -inf's too)
    for j in range(TOP_K):
        best = tl.max(tl.where(taken, -9223372036854775808, packed), axis=0)
        # NOTE: the clamp keeps the ids of a row of NaN keys in range.
        idx = tl.minimum(E_PAD - 1 - (best & (E_PAD - 1)).to(tl.int32), num_experts - 1)
        hit = offs == idx
        if HAS_BIAS:
            weight = tl.sum(tl.where(hit, scores, 0.0), axis=0)  # NOTE: one term: exact
        else:
            weight = _order_bits((best >> 32).to(tl.int32)).to(tl.float32, bitcast=True)  # the key is the score
        top_w = tl.where(k_offs == j, weight, top_w)
        top_id = tl.where(k_offs == j, idx, top_id)
        chosen_sum += weight
        taken = taken | hit
    if RENORMALIZE:
        # NOTE: the reference's epsilon, for sigmoid scores that all underflow.
        top_w = tl.math.div_rn(top_w, tl.zeros([K_PAD], tl.float32) + (chosen_sum + 1e-20))
    top_w = top_w * scaling
    k_ok = k_offs < TOP_K
    tl.store(weights_ptr + k_offs, top_w, mask=k_ok)
    tl.store(ids_ptr + k_offs, top_id.to(tl.int64), mask=k_ok)


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
    _select_token(
        logits_ptr + token * stride_t, bias_ptr, weights_ptr + token * TOP_K, ids_ptr + token * TOP_K, num_experts,
        scaling, TOP_K, K_PAD, E_PAD, SIGMOID, HAS_BIAS, RENORMALIZE, "",
    )  # fmt: skip


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


# --------------------------------------------------------------------------- router GEMV + select, one token


@triton.jit
def _router_select_kernel(
    x_ptr,
    w_ptr,
    logits_ptr,
    bias_ptr,
    weights_ptr,
    ids_ptr,
    counter_ptr,
    num_experts,
    hidden_size,
    stride_xm,
    stride_wn,
    scaling,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    TOP_K: tl.constexpr,
    K_PAD: tl.constexpr,
    E_PAD: tl.constexpr,
    SIGMOID: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    PDL: tl.constexpr,
):
    # The one-row GEMV's program (the dependent-launch handshake inside), its store...
    y = gemv_block(x_ptr, w_ptr, num_experts, hidden_size, stride_xm, stride_wn, 1, 1, BLOCK_N, BLOCK_K, EVEN_K, False, PDL)
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    tl.store(logits_ptr + cols[None, :], y.to(logits_ptr.dtype.element_ty), mask=(cols < num_experts)[None, :])
    # ...then the last program to count in selects over every program's logits.
    # Memory ordering (the interpreter runs one program at a time, so CPU tests check the
    # counting and the arithmetic, not this):
    # - every thread stored its logits before the barrier; one thread then runs the scalar
    #   acq_rel atomic at GPU scope, whose release is cumulative over what the barrier ordered;
    # - the last program's atomic acquires every earlier release on the counter (one release
    #   sequence of read-modify-writes); Triton hands the atomic's result to the other threads
    #   through shared memory behind a barrier, so their loads follow the acquire; the loads
    #   are .cg (L2, the coherence point), never a stale L1 line;
    # - the reset is a plain store: no program of this launch touches the counter after the
    #   last increment, and the next launch's increments follow this launch's completion
    #   (stream order, or griddepcontrol.wait, which every increment comes after).
    tl.debug_barrier()
    arrived = tl.atomic_add(counter_ptr, 1, sem="acq_rel", scope="gpu")
    if arrived == tl.num_programs(0) - 1:
        _select_token(
            logits_ptr, bias_ptr, weights_ptr, ids_ptr, num_experts, scaling,
            TOP_K, K_PAD, E_PAD, SIGMOID, HAS_BIAS, RENORMALIZE, ".cg",
        )  # fmt: skip
        tl.store(counter_ptr, 0)


# The router_select counter of each device: zeroed once here and back at zero after every call
# (the selecting program resets it), so CUDA graphs captured after the first call hold it for good.
# NOTE: one counter per device serves every layer and call: calls on a device run in stream
# order (each program counts in after griddepcontrol.wait, so after the kernel before it, and
# so every kernel before it, completed), and the count sought is the launch's own program
# count. Two calls must not run at the same time on two streams; the engine runs the model on
# one stream at a time. (A counter per layer would buy nothing for a buffer per layer.)
_SELECT_COUNTERS: dict[torch.device, torch.Tensor] = {}


def _select_counter(device: torch.device) -> torch.Tensor:
    """The zeroed int32 router_select counter of ``device``."""
    counter = _SELECT_COUNTERS.get(device)
    if counter is None:
        counter = torch.zeros(1, dtype=torch.int32, device=device)
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            # NOTE: no call before the capture: this buffer and its zeroing belong to the graph
            # (replayed with it), so it is not kept here.
            return counter
        _SELECT_COUNTERS[device] = counter
    return counter


_HALF_OR_FLOAT = (torch.bfloat16, torch.float16, torch.float32)


def _check_router_select(x, weight, top_k, scoring, correction_bias) -> None:
    """ValueError naming the parameter for inputs :func:`router_select_experts` does not take."""
    if scoring not in ("softmax", "sigmoid"):
        raise ValueError(f"scoring must be 'softmax' or 'sigmoid', got scoring={scoring!r}")
    if x.dim() != 2 or x.shape[0] != 1 or x.stride(-1) != 1:
        raise ValueError(
            f"router_select takes one token, a row x[1, H] with unit stride; got x with shape {tuple(x.shape)} "
            f"and strides {x.stride()}"
        )
    if weight.dim() != 2 or weight.shape[1] != x.shape[1] or weight.stride(-1) != 1:
        raise ValueError(
            f"weight must be the router's row-major [E, {x.shape[1]}] matrix, got shape {tuple(weight.shape)} "
            f"and strides {weight.stride()}"
        )
    if x.dtype not in _HALF_OR_FLOAT or weight.dtype not in (x.dtype, torch.float32):
        raise ValueError(
            f"router_select takes x in bfloat16/float16/float32 and the weight in x's dtype or float32 (as "
            f"MoERouter keeps it), got x.dtype={x.dtype}, weight.dtype={weight.dtype}"
        )
    num_experts = weight.shape[0]
    if num_experts > MAX_EXPERTS:
        raise ValueError(f"router_select takes at most MAX_EXPERTS={MAX_EXPERTS} experts, got weight with {num_experts}")
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k={top_k} must be between 1 and the number of experts ({num_experts})")
    if correction_bias is not None and (correction_bias.shape != (num_experts,) or not correction_bias.is_contiguous()):
        raise ValueError(
            f"correction_bias must be a contiguous [{num_experts}] tensor, got shape {tuple(correction_bias.shape)}"
        )


def launch_router_select(
    x: torch.Tensor,
    weight: torch.Tensor,
    top_k: int,
    renormalize: bool,
    scoring: str = "softmax",
    correction_bias: torch.Tensor | None = None,
    routed_scaling_factor: float = 1.0,
    config: dict[str, int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The kernel of :func:`router_select_experts` on any tensors Triton can address (the
    interpreter runs it on CPU tensors), checked but without the device check:
    ``(topk_weights[1, k] float32, topk_ids[1, k] int64, logits[1, E])``, the logits in
    ``weight``'s dtype as the separate GEMV stores them. ``config``: the GEMV's launch
    configuration (default :func:`~flotilla.kernels.triton_gemv.default_config`, which the
    separate GEMV uses; another one rounds the logits differently)."""
    _check_router_select(x, weight, top_k, scoring, correction_bias)
    num_experts, hidden_size = weight.shape
    device = x.device
    cfg = dict(config or default_config(num_experts, hidden_size, 1))
    block_n, block_k = cfg.pop("BLOCK_N"), cfg.pop("BLOCK_K")
    logits = torch.empty(1, num_experts, dtype=weight.dtype, device=device)
    weights = torch.empty(1, top_k, dtype=torch.float32, device=device)
    ids = torch.empty(1, top_k, dtype=torch.int64, device=device)
    _router_select_kernel[(triton.cdiv(num_experts, block_n),)](
        x, weight, logits, correction_bias if correction_bias is not None else logits,  # unused pointer without bias
        weights, ids, _select_counter(device), num_experts, hidden_size, x.stride(0), weight.stride(0),
        float(routed_scaling_factor),
        BLOCK_N=block_n, BLOCK_K=block_k, EVEN_K=hidden_size % block_k == 0, TOP_K=top_k,
        K_PAD=triton.next_power_of_2(top_k), E_PAD=triton.next_power_of_2(num_experts), SIGMOID=scoring == "sigmoid",
        HAS_BIAS=correction_bias is not None, RENORMALIZE=renormalize, **cfg, **launch_options(device),
    )  # fmt: skip
    return weights, ids, logits


def router_select_experts(
    x: torch.Tensor,
    weight: torch.Tensor,
    top_k: int,
    renormalize: bool,
    scoring: str = "softmax",
    correction_bias: torch.Tensor | None = None,
    routed_scaling_factor: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token's experts in one launch: ``select_experts(gemv(x.to(weight.dtype), weight), ...)``
    bit for bit (the Triton GEMV and Triton selection), ``(topk_weights[1, k] float32,
    topk_ids[1, k] int64)``, best first, ties to the lowest id.

    Args:
        x: the token, ``[1, H]`` CUDA tensor with unit stride, bfloat16/float16/float32.
        weight: the router ``[E, H]`` (row-major), in ``x``'s dtype or float32 (a router kept
            in float32: ``x`` is widened in registers, exactly, and the logits are float32).
        top_k, renormalize, scoring, correction_bias, routed_scaling_factor: as
            :func:`flotilla.kernels.moe.select_experts` (no group-limited routing).

    Raises ValueError naming the parameter for anything else. CUDA-graph capturable; call it
    once before a capture (a per-device counter, zeroed once, is made on the first call).
    """
    if not x.is_cuda:
        raise ValueError(f"router_select needs CUDA tensors, got x on {x.device}; run the router, then select_experts")
    return launch_router_select(x, weight, top_k, renormalize, scoring, correction_bias, routed_scaling_factor)[:2]


def router_select_covers(
    x: torch.Tensor, weight: torch.Tensor, num_expert_group: int | None, topk_group: int | None
) -> bool:
    """Whether :func:`router_select` takes a call: :data:`FUSED_ROUTER_SELECT` on, one CUDA row
    ``x[1, H]`` with unit stride, no group-limited routing (``num_expert_group`` of 1 is none),
    at most :data:`MAX_EXPERTS` experts, a router in ``x``'s half dtype or float32. Exactly
    where ``MoERouter`` on the ``triton`` linear op runs the one-row GEMV and the ``triton``
    ``select_experts`` runs its kernel, the two launches this one replaces (a float32 router,
    whose separate GEMV is cuBLAS's, is the exception: see :func:`router_select`)."""
    grouped = num_expert_group is not None or topk_group is not None
    return (
        FUSED_ROUTER_SELECT
        and x.is_cuda
        and x.dim() == 2
        and x.shape[0] == 1
        and x.stride(-1) == 1
        and not (grouped and not (num_expert_group == 1 and topk_group is not None))
        and weight.dim() == 2
        and weight.shape[0] <= MAX_EXPERTS
        and x.dtype in (torch.bfloat16, torch.float16)
        and weight.dtype in (x.dtype, torch.float32)
    )


@register("router_select", "triton")
def router_select(
    x: torch.Tensor,
    weight: torch.Tensor,
    top_k: int,
    renormalize: bool,
    scoring: str = "softmax",
    num_expert_group: int | None = None,
    topk_group: int | None = None,
    correction_bias: torch.Tensor | None = None,
    routed_scaling_factor: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """A MoE router's GEMV and ``select_experts`` in one launch for one token (a batch-1 decode
    step): ``(topk_weights[1, k] float32, topk_ids[1, k] int64)`` logical ids, or None for a
    call it does not take (:func:`router_select_covers`: the caller runs the router's linear op,
    then ``select_experts``). ``select_experts``' arguments, with the token ``x[1, H]`` (model
    dtype) and the router ``weight[E, H]`` in place of the logits.

    Bit-identical to the router on the ``triton`` linear op followed by the ``triton``
    ``select_experts``, except for a float32 router: there the separate path's ``linear`` runs
    cuBLAS (the one-row GEMV takes half dtypes only) and this op the Triton GEMV in float32, so
    the logits may differ in float32 rounding (summation order), and with them a near tie.
    """
    if not router_select_covers(x, weight, num_expert_group, topk_group):
        return None
    return router_select_experts(x, weight, top_k, renormalize, scoring, correction_bias, routed_scaling_factor)


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
