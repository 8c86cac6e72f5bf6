"""``select_experts`` and ``route`` in one launch for small batches, and the ``triton`` backend
of op ``fused_moe_from_logits`` built on it.

At decode batch sizes each routing launch (one program per token for the top-k, then one
program sorting the routes by expert, :mod:`flotilla.kernels.triton_routing`) costs a launch's
latency for a few hundred operations. When a call's routes fit one program
(:func:`fits_one_program`), :func:`select_and_route` does both in ONE program:

1. the top-k of every token at once, over a ``[T_PAD, E_PAD]`` tile of scores (the single-token
   kernel's algorithm: softmax or sigmoid, correction bias for the choice, repeated max taking
   the lowest id among ties, renormalize, scale), written as ``topk_weights``/``topk_ids``;
2. the routing of :func:`~flotilla.kernels.triton_routing.route` from the chosen ids still in
   registers: each route's local expert (through ``expert_map``), its rank among the routes of
   that expert (counted, not taken by atomics: routes keep their order inside a segment),
   the padded segments, the expert of every row block and the sorted route list.

Outputs equal those of the two launches: ids, the segment layout and ``route_expert``
exactly; weights to the last bit where the two kernels reduce the softmax sum in the same
order (the Triton interpreter), otherwise to an ulp (a reduction over a 2-D tile may group the
sum differently on the GPU). ``sorted_route`` lists a segment's routes in route order, which
is the order the route kernel's atomics give in the interpreter; on the GPU they may give
another order inside a segment, which changes no result (each row is computed alone and the
route sum goes by route index).

The kernel zeroes the down kernel's column-tile counters too, when that kernel folds the route
sum (:attr:`~flotilla.kernels.triton_routing.Routing.tile_counts`). CUDA-graph capturable: no
host synchronisation, buffers and grid from shapes only.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flotilla.kernels import triton_moe
from flotilla.kernels.registry import register
from flotilla.kernels.triton_pdl import launch_options, start_dependent
from flotilla.kernels.triton_routing import MAX_EXPERTS, Routing, _exp, routing_rows, select_experts, zero_tile_counts

MAX_ROUTES = 64  # padded T x k routes of the one-program path; larger calls take two launches
MAX_TILE = 8192  # padded T x E scores (and local experts x routes) one program holds
_CHUNK = 256  # rows handled per step of the sorted-route fill


@triton.jit
def _top_k_rows(
    logits_ptr, bias_ptr, num_tokens, num_experts, stride_t, scaling,
    TOP_K: tl.constexpr, T_PAD: tl.constexpr, K_PAD: tl.constexpr, E_PAD: tl.constexpr,
    SIGMOID: tl.constexpr, HAS_BIAS: tl.constexpr, RENORMALIZE: tl.constexpr,
):  # fmt: skip
    """``(top_w[T_PAD, K_PAD] float32, top_id[T_PAD, K_PAD] int32)``, best first: the
    ``_select_experts_kernel`` algorithm on every token's row at once."""
    rows = tl.arange(0, T_PAD)
    offs = tl.arange(0, E_PAD)
    valid = offs < num_experts
    # NOTE: padding rows repeat the last token (finite scores, never stored).
    src = tl.minimum(rows, num_tokens - 1).to(tl.int64)
    x = tl.load(logits_ptr + src[:, None] * stride_t + offs[None, :], mask=valid[None, :], other=float("-inf"))
    x = x.to(tl.float32)
    if SIGMOID:
        scores = tl.math.div_rn(tl.full([T_PAD, E_PAD], 1.0, tl.float32), 1.0 + _exp(-x))
    else:
        e = tl.where(valid[None, :], _exp(x - tl.max(x, axis=1)[:, None]), 0.0)
        scores = tl.math.div_rn(e, tl.zeros([T_PAD, E_PAD], tl.float32) + tl.sum(e, axis=1)[:, None])
    key = scores
    if HAS_BIAS:
        key = scores + tl.load(bias_ptr + offs, mask=valid, other=0.0).to(tl.float32)[None, :]
    k_offs = tl.arange(0, K_PAD)[None, :]
    top_w = tl.zeros([T_PAD, K_PAD], tl.float32)
    top_id = tl.zeros([T_PAD, K_PAD], tl.int32)
    taken = (rows[:, None] < 0) | ~valid[None, :]  # padding lanes are never chosen
    for j in range(TOP_K):
        masked = tl.where(taken, float("-inf"), key)
        best = tl.max(masked, axis=1)
        # NOTE: lowest id among equal keys; `~taken` keeps a row of -inf keys choosing distinct
        # experts; the clamp keeps a NaN row's ids in range (as in _select_experts_kernel).
        idx = tl.min(tl.where((masked == best[:, None]) & ~taken, offs[None, :], E_PAD), axis=1)
        idx = tl.minimum(idx, num_experts - 1)
        hit = offs[None, :] == idx[:, None]
        top_w = tl.where(k_offs == j, tl.sum(tl.where(hit, scores, 0.0), axis=1)[:, None], top_w)
        top_id = tl.where(k_offs == j, idx[:, None], top_id)
        taken = taken | hit
    if RENORMALIZE:
        # NOTE: the reference's epsilon, for sigmoid scores that all underflow.
        top_w = tl.math.div_rn(top_w, tl.zeros([T_PAD, K_PAD], tl.float32) + (tl.sum(top_w, axis=1) + 1e-20)[:, None])
    return top_w * scaling, top_id


@triton.jit
def _segment_rows(local, valid, num_local, P: tl.constexpr, L_PAD: tl.constexpr, BLOCK_M: tl.constexpr):
    """For routes ``local[P]`` (their local expert; ``valid`` where held here), in route order:
    ``(row[P], ends[L_PAD])``: each route's row in the ``BLOCK_M``-padded segments laid out by
    expert, and where each expert's segment ends."""
    p = tl.arange(0, P)
    same = (local[None, :] == local[:, None]) & valid[None, :] & (p[None, :] < p[:, None])
    rank = tl.sum(same.to(tl.int32), axis=1)  # routes of the same expert before this one
    e = tl.arange(0, L_PAD)
    counts = tl.sum(((local[None, :] == e[:, None]) & valid[None, :]).to(tl.int32), axis=1)
    counts = tl.where(e < num_local, counts, 0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, axis=0)
    start_of = tl.sum(tl.where(e[:, None] == local[None, :], (ends - padded)[:, None], 0), axis=0)
    return start_of + rank, ends


@triton.jit
def _select_route_kernel(
    logits_ptr, bias_ptr, expert_map_ptr, weights_ptr, ids_ptr, route_expert_ptr, sorted_route_ptr,
    block_expert_ptr, tile_count_ptr, num_tokens, num_experts, stride_t, scaling, num_local, max_rows, max_blocks,
    num_tiles,
    TOP_K: tl.constexpr, T_PAD: tl.constexpr, K_PAD: tl.constexpr, E_PAD: tl.constexpr, L_PAD: tl.constexpr,
    SIGMOID: tl.constexpr, HAS_BIAS: tl.constexpr, RENORMALIZE: tl.constexpr, HAS_MAP: tl.constexpr,
    BLOCK_M: tl.constexpr, CHUNK: tl.constexpr, B_CHUNK: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    start_dependent(PDL)  # NOTE: first: the logits come from the kernel before, and no write may precede the wait
    zero_tile_counts(tile_count_ptr, num_tiles, CHUNK)
    top_w, top_id = _top_k_rows(
        logits_ptr, bias_ptr, num_tokens, num_experts, stride_t, scaling, TOP_K, T_PAD, K_PAD, E_PAD, SIGMOID,
        HAS_BIAS, RENORMALIZE,
    )  # fmt: skip
    t = tl.arange(0, T_PAD)[:, None]
    j = tl.arange(0, K_PAD)[None, :]
    route = t * TOP_K + j
    in_range = (t < num_tokens) & (j < TOP_K)
    tl.store(weights_ptr + route, top_w, mask=in_range)
    tl.store(ids_ptr + route, top_id.to(tl.int64), mask=in_range)
    if HAS_MAP:
        local = tl.load(expert_map_ptr + top_id, mask=in_range, other=-1).to(tl.int32)
    else:
        local = top_id
    valid = in_range & (local >= 0) & (local < num_local)
    local = tl.where(valid, local, -1)
    tl.store(route_expert_ptr + route, local, mask=in_range)
    # Routes in route order (t, then j) as one vector; padding lanes are not valid.
    flat_local = tl.reshape(local, (T_PAD * K_PAD,))
    flat_valid = tl.reshape(valid.to(tl.int32), (T_PAD * K_PAD,)) != 0
    flat_route = tl.reshape(route, (T_PAD * K_PAD,))
    row, ends = _segment_rows(flat_local, flat_valid, num_local, T_PAD * K_PAD, L_PAD, BLOCK_M)
    # The expert of every row block (the number of segments ending at or before its first row),
    # then sentinel rows, then each route at its row (as the route kernel's phases 2 and 3).
    b_offs = tl.arange(0, B_CHUNK)
    for b0 in range(0, max_blocks, B_CHUNK):
        b = b0 + b_offs
        expert = tl.sum(((b * BLOCK_M)[:, None] >= ends[None, :]).to(tl.int32), axis=1)
        tl.store(block_expert_ptr + b, tl.where(expert < num_local, expert, -1), mask=b < max_blocks)
    s_offs = tl.arange(0, CHUNK)
    for s0 in range(0, max_rows, CHUNK):
        s = s0 + s_offs
        tl.store(sorted_route_ptr + s, tl.zeros([CHUNK], dtype=tl.int32) + num_tokens * TOP_K, mask=s < max_rows)
    # NOTE: one program: the barrier orders the sentinel stores before the route stores over them.
    tl.debug_barrier()
    tl.store(sorted_route_ptr + row, flat_route, mask=flat_valid)


def fits_one_program(num_tokens: int, num_experts: int, top_k: int, num_local: int) -> bool:
    """Whether :func:`select_and_route` takes a call of ``num_tokens`` tokens, ``top_k`` of
    ``num_experts`` experts each, ``num_local`` of them held here: at most :data:`MAX_ROUTES`
    padded routes, and the score and segment tiles within :data:`MAX_TILE`."""
    t_pad, k_pad = triton.next_power_of_2(num_tokens), triton.next_power_of_2(top_k)
    routes = t_pad * k_pad
    return (
        num_tokens >= 1
        and num_experts <= MAX_EXPERTS
        and routes <= MAX_ROUTES
        and t_pad * triton.next_power_of_2(num_experts) <= MAX_TILE
        and triton.next_power_of_2(num_local) * routes <= MAX_TILE
    )


def default_warps(score_tile: int, segment_tile: int) -> int:
    """Warps of the one-program routing kernel: one per 1,024 elements of its largest tile, 1 to
    8 (a batch-1 call's tiles fit one warp, whose reductions need no barrier, as the
    single-token select kernel runs; sm90, no spills up to 8 warps at 64 routes)."""
    return max(1, min(8, max(score_tile, segment_tile) // 1024))


def select_and_route(
    router_logits: torch.Tensor,
    top_k: int,
    renormalize: bool,
    scoring: str,
    correction_bias: torch.Tensor | None,
    routed_scaling_factor: float,
    num_local: int,
    expert_map: torch.Tensor | None,
    block_m: int,
    num_tiles: int = 0,
    num_warps: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, Routing]:
    """``(topk_weights[T, k] float32, topk_ids[T, k] int64, routing)`` in one launch: what
    :func:`~flotilla.kernels.triton_routing.launch_select_experts` and then
    :func:`~flotilla.kernels.triton_routing.route` (``num_local``, ``expert_map``, ``block_m``,
    ``num_tiles``) return, for a call that :func:`fits_one_program`. ``num_warps`` (None:
    :func:`default_warps`) is for tuning. Runs on any tensors Triton can address (the
    interpreter takes CPU tensors); callers check devices and arguments."""
    num_tokens, num_experts = router_logits.shape
    if not fits_one_program(num_tokens, num_experts, top_k, num_local):
        raise ValueError(
            f"select_and_route takes calls that fit one program (fits_one_program); got T={num_tokens}, "
            f"E={num_experts}, top_k={top_k}, num_local={num_local}"
        )
    if router_logits.stride(1) != 1:
        router_logits = router_logits.contiguous()
    device = router_logits.device
    num_routes = num_tokens * top_k
    max_rows, max_blocks = routing_rows(num_routes, num_local, block_m)
    weights = torch.empty(num_tokens, top_k, dtype=torch.float32, device=device)
    ids = torch.empty(num_tokens, top_k, dtype=torch.int64, device=device)
    route_expert = torch.empty(num_routes, dtype=torch.int32, device=device)
    sorted_route = torch.empty(max_rows, dtype=torch.int32, device=device)
    block_expert = torch.empty(max_blocks, dtype=torch.int32, device=device)
    tile_counts = torch.empty(max(1, num_tiles), dtype=torch.int32, device=device)  # zeroed by the kernel
    e_pad = triton.next_power_of_2(num_experts)
    l_pad = triton.next_power_of_2(num_local)
    t_pad, k_pad = triton.next_power_of_2(num_tokens), triton.next_power_of_2(top_k)
    _select_route_kernel[(1,)](
        router_logits, correction_bias if correction_bias is not None else router_logits,
        expert_map if expert_map is not None else ids, weights, ids, route_expert, sorted_route, block_expert,
        tile_counts, num_tokens, num_experts, router_logits.stride(0), float(routed_scaling_factor), num_local,
        max_rows, max_blocks, num_tiles,
        TOP_K=top_k, T_PAD=t_pad, K_PAD=k_pad, E_PAD=e_pad, L_PAD=l_pad, SIGMOID=scoring == "sigmoid",
        HAS_BIAS=correction_bias is not None, RENORMALIZE=renormalize, HAS_MAP=expert_map is not None, BLOCK_M=block_m,
        CHUNK=_CHUNK, B_CHUNK=max(16, 4096 // l_pad), num_warps=num_warps or default_warps(t_pad * e_pad, l_pad * t_pad * k_pad),
        **launch_options(device),
    )  # fmt: skip
    routing = Routing(sorted_route, block_expert, route_expert, block_m, tile_counts if num_tiles else None)
    return weights, ids, routing


@register("fused_moe_from_logits", "triton")
def fused_moe_from_logits(
    hidden: torch.Tensor,
    router_logits: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    top_k: int,
    renormalize: bool,
    scoring: str = "softmax",
    num_expert_group: int | None = None,
    topk_group: int | None = None,
    correction_bias: torch.Tensor | None = None,
    routed_scaling_factor: float = 1.0,
    activation: str = "silu",
    expert_map: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``select_experts`` then ``fused_moe``: the torch reference's arguments and result
    (:func:`flotilla.kernels.moe.fused_moe_from_logits`: ``(out[T, H], topk_weights,
    topk_ids)``). A call that :func:`fits_one_program`, without group-limited routing (a
    single group is no limit), routes in one launch (:func:`select_and_route`) and its down
    kernel folds the route sum (:func:`~flotilla.kernels.triton_moe.folds_sum`): three launches
    in all at batch 1, where the separate ops take five. Other calls run the ``triton``
    ``select_experts`` and ``fused_moe``. CUDA-graph capturable."""
    return moe_from_logits_with_config(
        hidden, router_logits, w13, w2, top_k, renormalize, scoring, num_expert_group, topk_group, correction_bias,
        routed_scaling_factor, activation, expert_map,
    )  # fmt: skip


def moe_from_logits_with_config(
    hidden: torch.Tensor,
    router_logits: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    top_k: int,
    renormalize: bool,
    scoring: str = "softmax",
    num_expert_group: int | None = None,
    topk_group: int | None = None,
    correction_bias: torch.Tensor | None = None,
    routed_scaling_factor: float = 1.0,
    activation: str = "silu",
    expert_map: torch.Tensor | None = None,
    config: triton_moe.MoEConfig | None = None,
    route_warps: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`fused_moe_from_logits` with the expert tiles given by ``config`` (None:
    :func:`~flotilla.kernels.triton_moe.pick_config`) and the routing kernel's warps (None:
    :func:`default_warps`), for tuning (``benchmarks/moe_decode_probe.py``)."""
    if scoring not in ("softmax", "sigmoid"):
        raise ValueError(f"scoring must be 'softmax' or 'sigmoid', got scoring={scoring!r}")
    if router_logits.dim() != 2:
        raise ValueError(f"router_logits must be [T, E], got shape {tuple(router_logits.shape)}")
    num_tokens, num_experts = router_logits.shape
    num_local = w13.shape[0]
    # NOTE: one group of all experts is no group limit (DeepSeek-V2-Lite), as select_experts takes it.
    grouped = (num_expert_group is not None or topk_group is not None) and not (
        num_expert_group == 1 and topk_group is not None
    )
    if grouped or not fits_one_program(num_tokens, num_experts, top_k, num_local):
        weights, ids = select_experts(
            router_logits, top_k, renormalize, scoring, num_expert_group, topk_group, correction_bias,
            routed_scaling_factor,
        )  # fmt: skip
        out = triton_moe.fused_moe_with_config(hidden, w13, w2, weights, ids, activation, expert_map, config)
        return out, weights, ids
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k={top_k} must be between 1 and the number of experts ({num_experts})")
    if correction_bias is not None and (correction_bias.shape != (num_experts,) or not correction_bias.is_contiguous()):
        raise ValueError(
            f"correction_bias must be a contiguous [{num_experts}] tensor, got shape {tuple(correction_bias.shape)}"
        )
    triton_moe.check_experts(hidden, w13, w2, activation, expert_map)
    if num_tokens != hidden.shape[0] or router_logits.device != hidden.device:
        raise ValueError(
            f"router_logits must be [T, E] on hidden's device with T={hidden.shape[0]}; got shape "
            f"{tuple(router_logits.shape)} on {router_logits.device}"
        )
    cfg = config or triton_moe.pick_config(num_tokens * top_k, num_local)
    tiles = triton_moe.down_tiles(hidden.shape[1], cfg) if triton_moe.folds_sum(num_tokens, top_k) else 0
    weights, ids, routing = select_and_route(
        router_logits, top_k, renormalize, scoring, correction_bias, routed_scaling_factor, num_local, expert_map,
        cfg.block_m, tiles, route_warps,
    )  # fmt: skip
    return triton_moe.run_experts(hidden, w13, w2, weights, routing, top_k, activation, cfg), weights, ids
