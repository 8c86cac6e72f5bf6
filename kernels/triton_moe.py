"""Fused mixture-of-experts in Triton: the ``triton`` backend of op ``fused_moe``.

Same signature and meaning as the torch reference (:func:`flotilla.kernels.moe.fused_moe`):
``w13[E_local, 2I, H]`` (gate rows, then up rows), ``w2[E_local, H, I]``, ``topk_ids[T, k]``
global ids mapped through ``expert_map`` (``-1``: another rank computes that pair).

How it runs (four launches, no host synchronisation, so it can be captured in a CUDA graph;
one token skips the first: each of its k routes, k distinct experts, gets a row block of its
own, its expert read from ``topk_ids`` through ``expert_map``; and, with
:data:`FOLD_ROUTE_SUM`, the last, so one token takes two launches):

1. ``_route_kernel`` (one program, :func:`flotilla.kernels.triton_routing.route`): zeroes the
   per-expert counters, then each (token, k) pair ("route") gets its local expert and its
   rank inside that expert (atomics); per-expert row counts are padded up to ``BLOCK_M``
   and laid out back to back, so every ``BLOCK_M`` block of the sorted row list belongs to one
   expert (``block_expert``; ``-1`` past the end). ``sorted_route[row]`` names the route a row
   computes, or ``num_routes`` for padding rows.
2. ``_gate_up_kernel``: per (row block, column tile) the gathered tokens times the block's
   expert's gate and up rows, then ``act(gate) * up`` into ``inter[rows, I]``.
3. ``_down_kernel``: ``inter`` times the expert's down projection, scaled by each route's
   routing weight, written per route into ``routed[T*k, H]`` (float32).
4. ``_sum_routes_kernel``: ``out[t] = sum_j routed[t*k + j]`` over the routes computed here.
   One token with :data:`FOLD_ROUTE_SUM` folds this launch into the down kernel: the last of
   the k route programs of each column tile sums the tile's k rows (see ``_sum_tile_if_last``),
   in the same order, so the output is bit-identical to the separate launch.

Buffers are sized from host integers only (``T*k + min(E, T*k) * (BLOCK_M - 1)`` rows, the
most that padding can need), so the launch grid is fixed for a given batch size; blocks past
the routed rows exit at once. Block sizes come from a small table keyed by the expected rows
per active expert (decode is memory-bound: small ``BLOCK_M``, narrow ``BLOCK_N`` for many
programs streaming weights; large batches get compute-sized tiles).

The kernels also read block-quantized float8 expert weights (``W_FP8``: each tile widened in
registers and scaled by its 128x128 block scale); the FP8 ops built on them live in
:mod:`flotilla.kernels.triton_fp8`.

Importing this module imports Triton: the registry imports it only when the ``triton``
backend is asked for, so a machine without Triton gets the registry's "not available" error.
It also registers the ``triton`` backend of ``select_experts`` (through
:mod:`flotilla.kernels.triton_routing`), which :class:`~flotilla.cluster.models.moe_layer.FusedMoE`
picks up with the ``triton`` ``fused_moe``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from flotilla.kernels.registry import register
from flotilla.kernels.triton_pdl import launch_options, start_dependent

# NOTE: importing triton_routing also registers ("select_experts", "triton").
from flotilla.kernels.triton_routing import Routing, route

_ACTIVATION_CODES = {"silu": 0, "gelu": 1, "gelu_tanh": 2}
# NOTE: Triton's interpreter runs the kernels on CPU tensors (to check tile configs without a GPU).
_INTERPRETER = os.environ.get("TRITON_INTERPRET") == "1"


@dataclass(frozen=True)
class MoEConfig:
    """Tile sizes of one fused-MoE call (``*_1``: gate/up kernel, ``*_2``: down kernel)."""

    block_m: int
    block_n_1: int
    block_k_1: int
    warps_1: int
    stages_1: int
    block_n_2: int
    block_k_2: int
    warps_2: int
    stages_2: int


# Keyed by the largest expected rows per active expert each entry serves (ascending).
# NOTE: decode (1-16 rows per expert) is bound by reading each active expert's weights once:
# many narrow programs keep every SM streaming. Tuned with the MoE tile probe on the GPU (removed in 004bdbd; in git history).
# Measured on H200 at the Qwen3-30B-A3B shape (H 2048, I 768, 128 experts, top-8, CUDA graph):
# batch 1 ~35 us/call (75.5 MB of weights, ~2.6 TB/s in the two GEMM kernels), batch 256
# ~331 us/call (1.2 GB, ~3.6 TB/s). Tiles must divide 128 for the FP8 path (scale blocks).
CONFIGS: list[tuple[int, MoEConfig]] = [
    (8, MoEConfig(16, 64, 128, 4, 4, 64, 128, 4, 4)),
    (48, MoEConfig(32, 64, 128, 4, 4, 64, 128, 4, 4)),
    (96, MoEConfig(64, 64, 64, 4, 4, 128, 64, 4, 4)),
    (1 << 62, MoEConfig(128, 64, 64, 8, 3, 128, 64, 8, 3)),
]


# One token (batch-1 decode): every expert block holds a single real row, so the kernels are
# pure weight streams; long K tiles with fewer pipeline stages keep more bytes in flight per
# program. H200, Qwen3-30B-A3B shape, the MoE tile probe, removed in 004bdbd (24 chained calls in a CUDA
# graph, 8 weight sets, medians of 10 rounds): 31.2 us/call against 41.0 for CONFIGS[0]
# (floor 17.6 us at the copy bandwidth). BLOCK_K 256 does not divide the FP8 scale blocks,
# so block-FP8 experts keep the table.
SINGLE_TOKEN: MoEConfig | None = MoEConfig(16, 64, 256, 4, 3, 128, 256, 4, 3)
# One token skips the routing launch: route j computes in row block j, its expert read from
# topk_ids (see fused_moe_with_config). Off: the sort runs as for any batch.
SINGLE_TOKEN_DIRECT = True
# With SINGLE_TOKEN_DIRECT, the down kernel also sums the token's k routes (the last program of
# each column tile does it; no route-sum launch). Off: the separate _sum_routes_kernel, for an A/B.
FOLD_ROUTE_SUM = True


def pick_config(num_routes: int, num_local_experts: int, num_tokens: int | None = None, w_fp8: bool = False) -> MoEConfig:
    """The tiles for ``num_routes`` (token, expert) pairs over ``num_local_experts``:
    :data:`SINGLE_TOKEN` for one token of bf16/fp16 experts, else the :data:`CONFIGS` entry
    for the expected rows per active expert."""
    if num_tokens == 1 and not w_fp8 and SINGLE_TOKEN is not None:
        return SINGLE_TOKEN
    rows_per_expert = num_routes / max(1, min(num_local_experts, num_routes))
    for limit, config in CONFIGS:
        if rows_per_expert <= limit:
            return config
    return CONFIGS[-1][1]


# --------------------------------------------------------------------------- kernels


@triton.jit
def _activate(gate, ACTIVATION: tl.constexpr):
    if ACTIVATION == 0:  # silu
        out = gate * tl.sigmoid(gate)
    elif ACTIVATION == 1:  # exact (erf) gelu
        out = 0.5 * gate * (1.0 + tl.erf(gate * 0.7071067811865476))
    else:  # tanh gelu; tanh(u) = 2 * sigmoid(2u) - 1
        inner = 0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)
        out = 0.5 * gate * (2.0 * tl.sigmoid(2.0 * inner))
    return out


@triton.jit
def _block_expert(block_expert_ptr, expert_map_ptr, pid_m, DIRECT: tl.constexpr, HAS_MAP: tl.constexpr):
    """The local expert of row block ``pid_m`` (-1: none here): from the routing sort, or with
    ``DIRECT`` the block's route's global id (``block_expert_ptr`` is then ``topk_ids``) mapped
    through ``expert_map`` when there is one."""
    expert = tl.load(block_expert_ptr + pid_m)
    if DIRECT and HAS_MAP:
        expert = tl.load(expert_map_ptr + expert)
    return expert


@triton.jit
def _block_routes(sorted_route_ptr, rows, pid_m, num_routes, BLOCK_M: tl.constexpr, DIRECT: tl.constexpr):
    """The route each row of block ``pid_m`` computes (``num_routes``: a padding row): from the
    routing sort, or with ``DIRECT`` (one token, no sort) route ``pid_m`` in the block's first row."""
    if DIRECT:
        return tl.where(tl.arange(0, BLOCK_M) == 0, pid_m, num_routes)
    else:
        return tl.load(sorted_route_ptr + rows)


@triton.jit
def _gate_up_kernel(
    x_ptr,
    w_ptr,
    out_ptr,
    sorted_route_ptr,
    block_expert_ptr,
    expert_map_ptr,
    num_routes,
    top_k,
    H,
    I,
    stride_xt,
    stride_we,
    stride_wn,
    stride_wk,
    stride_om,
    scale_ptr,
    stride_se,
    stride_sn,
    stride_sk,
    ACTIVATION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    W_FP8: tl.constexpr,
    DIRECT: tl.constexpr,
    HAS_MAP: tl.constexpr,
    PDL: tl.constexpr,
):
    start_dependent(PDL)  # NOTE: first: the routing comes from the kernel before
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = _block_expert(block_expert_ptr, expert_map_ptr, pid_m, DIRECT, HAS_MAP)
    if expert < 0:
        return
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    route = _block_routes(sorted_route_ptr, rows, pid_m, num_routes, BLOCK_M, DIRECT)
    row_ok = route < num_routes
    # NOTE: padding rows read token 0 and columns past I read column 0 (no load masks);
    # their results are never stored.
    token = tl.where(row_ok, route // top_k, 0).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < I
    cols = tl.where(n_ok, offs_n, 0).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + token[:, None] * stride_xt + offs_k[None, :]
    gate_ptrs = w_ptr + expert.to(tl.int64) * stride_we + cols[None, :] * stride_wn + offs_k[:, None] * stride_wk
    up_ptrs = gate_ptrs + I * stride_wn
    acc_gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        if EVEN_K:
            a = tl.load(x_ptrs)
            b_gate = tl.load(gate_ptrs)
            b_up = tl.load(up_ptrs)
        else:
            k_ok = k0 + offs_k < H
            a = tl.load(x_ptrs, mask=k_ok[None, :], other=0.0)
            b_gate = tl.load(gate_ptrs, mask=k_ok[:, None], other=0.0)
            b_up = tl.load(up_ptrs, mask=k_ok[:, None], other=0.0)
        if W_FP8:
            # NOTE: a tile lies inside one 128x128 scale block (BLOCK_N, BLOCK_K divide 128, I % 128 == 0).
            s_base = scale_ptr + expert.to(tl.int64) * stride_se + (k0 // 128) * stride_sk
            s_gate = tl.load(s_base + (pid_n * BLOCK_N // 128) * stride_sn)
            s_up = tl.load(s_base + ((I + pid_n * BLOCK_N) // 128) * stride_sn)
            acc_gate += tl.dot(a, b_gate.to(a.dtype)) * s_gate
            acc_up += tl.dot(a, b_up.to(a.dtype)) * s_up
        else:
            acc_gate = tl.dot(a, b_gate, acc_gate)
            acc_up = tl.dot(a, b_up, acc_up)
        x_ptrs += BLOCK_K
        gate_ptrs += BLOCK_K * stride_wk
        up_ptrs += BLOCK_K * stride_wk
    h = _activate(acc_gate, ACTIVATION) * acc_up
    out_ptrs = out_ptr + rows[:, None].to(tl.int64) * stride_om + offs_n[None, :]
    tl.store(out_ptrs, h.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & n_ok[None, :])


@triton.jit
def _down_kernel(
    a_ptr,
    w_ptr,
    out_ptr,
    topk_weights_ptr,
    sorted_route_ptr,
    block_expert_ptr,
    expert_map_ptr,
    num_routes,
    H,
    I,
    stride_am,
    stride_we,
    stride_wn,
    stride_wk,
    stride_om,
    scale_ptr,
    stride_se,
    stride_sn,
    stride_sk,
    sum_ptr,
    tile_count_ptr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    W_FP8: tl.constexpr,
    DIRECT: tl.constexpr,
    HAS_MAP: tl.constexpr,
    SUM_ROUTES: tl.constexpr,
    PDL: tl.constexpr,
):
    start_dependent(PDL)  # NOTE: first: the routing comes from the kernel before
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = _block_expert(block_expert_ptr, expert_map_ptr, pid_m, DIRECT, HAS_MAP)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < H
    if expert < 0:
        if DIRECT:
            # NOTE: route pid_m is another rank's; its row of `routed` is summed all the same
            # (the sum sees every route of the token as held), so it must hold zeros, and with
            # SUM_ROUTES this program still counts in for its tile.
            tl.store(out_ptr + pid_m.to(tl.int64) * stride_om + offs_n, tl.zeros((BLOCK_N,), tl.float32), mask=n_ok)
            if SUM_ROUTES > 0:
                _sum_tile_if_last(out_ptr, sum_ptr, tile_count_ptr, pid_n, H, stride_om, BLOCK_N, SUM_ROUTES)
        return
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    route = _block_routes(sorted_route_ptr, rows, pid_m, num_routes, BLOCK_M, DIRECT)
    row_ok = route < num_routes
    cols = tl.where(n_ok, offs_n, 0).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    # NOTE: padding rows of `inter` were never written; rows are independent in the product
    # and those rows are not stored, so whatever they hold cannot reach the output.
    a_ptrs = a_ptr + rows[:, None].to(tl.int64) * stride_am + offs_k[None, :]
    w_ptrs = w_ptr + expert.to(tl.int64) * stride_we + cols[None, :] * stride_wn + offs_k[:, None] * stride_wk
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, I, BLOCK_K):
        if EVEN_K:
            a = tl.load(a_ptrs)
            b = tl.load(w_ptrs)
        else:
            k_ok = k0 + offs_k < I
            a = tl.load(a_ptrs, mask=k_ok[None, :], other=0.0)
            b = tl.load(w_ptrs, mask=k_ok[:, None], other=0.0)
        if W_FP8:
            scale = tl.load(
                scale_ptr + expert.to(tl.int64) * stride_se + (pid_n * BLOCK_N // 128) * stride_sn + (k0 // 128) * stride_sk
            )
            acc += tl.dot(a, b.to(a.dtype)) * scale
        else:
            acc = tl.dot(a, b, acc)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K * stride_wk
    weight = tl.load(topk_weights_ptr + route, mask=row_ok, other=0.0).to(tl.float32)
    y = acc * weight[:, None]
    out_ptrs = out_ptr + route[:, None].to(tl.int64) * stride_om + offs_n[None, :]
    tl.store(out_ptrs, y, mask=row_ok[:, None] & n_ok[None, :])
    if SUM_ROUTES > 0:
        _sum_tile_if_last(out_ptr, sum_ptr, tile_count_ptr, pid_n, H, stride_om, BLOCK_N, SUM_ROUTES)


@triton.jit
def _sum_tile_if_last(
    routed_ptr, sum_ptr, tile_count_ptr, pid_n, H, stride_rm, BLOCK_N: tl.constexpr, SUM_ROUTES: tl.constexpr
):
    """One token's folded route sum (``DIRECT``; the down grid's ``SUM_ROUTES`` = k row blocks
    are the token's k routes): count this program in on column tile ``pid_n``'s counter; the
    program that brings it to k writes ``sum[0, tile] = sum_j routed[j, tile]`` (j = 0..k-1,
    float32, rounded once: ``_sum_routes_kernel``'s exact operations, so bit-identical) and
    sets the counter back to 0 for the next call or graph replay.

    Memory ordering (the invariant; Triton's interpreter runs programs one at a time, so CPU
    tests check the arithmetic and the counting, not this):
    - every thread of the program stored its part of ``routed[j, tile]`` before the barrier;
      one thread then runs the scalar ``acq_rel`` atomic at GPU scope, whose release is
      cumulative over what the barrier ordered before it;
    - the last program's atomic acquires every earlier release on that counter (they form one
      release sequence of read-modify-writes), and Triton broadcasts the atomic's result to
      the other threads through shared memory behind a barrier, so their loads come after the
      acquire; the loads are ``.cg`` (L2, the coherence point) so no stale L1 line is read;
    - the reset is a plain store: no program of this launch touches the counter after the
      k-th increment, and the next launch that does runs after this one completes (stream
      order, or ``griddepcontrol.wait`` under PDL, which every increment comes after).
    """
    tl.debug_barrier()
    arrived = tl.atomic_add(tile_count_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
    if arrived == SUM_ROUTES - 1:
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = offs_n < H
        acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
        for j in tl.static_range(SUM_ROUTES):  # NOTE: unrolled: the k loads go out together
            acc += tl.load(routed_ptr + j * stride_rm + offs_n, mask=n_ok, other=0.0, cache_modifier=".cg")
        tl.store(sum_ptr + offs_n, acc.to(sum_ptr.dtype.element_ty), mask=n_ok)
        tl.store(tile_count_ptr + pid_n, 0)


@triton.jit
def _sum_routes_kernel(
    routed_ptr, route_expert_ptr, out_ptr, top_k, H, stride_rm, stride_ot, BLOCK_H: tl.constexpr, PDL: tl.constexpr
):
    start_dependent(PDL)
    token = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = offs < H
    acc = tl.zeros((BLOCK_H,), dtype=tl.float32)
    for j in range(0, top_k):
        route = token * top_k + j
        held = tl.load(route_expert_ptr + route) >= 0
        acc += tl.load(routed_ptr + route.to(tl.int64) * stride_rm + offs, mask=h_ok & held, other=0.0)
    tl.store(out_ptr + token.to(tl.int64) * stride_ot + offs, acc.to(out_ptr.dtype.element_ty), mask=h_ok)


# --------------------------------------------------------------------------- host side

# The folded route sum's per-column-tile counters, by (device, number of tiles): zeroed once
# here, and back at zero after every call (the last program of each tile resets its counter),
# so CUDA graphs captured after the first call hold these buffers for good.
# NOTE: one buffer serves every call on a device: two folded calls must not run at the same
# time (on two streams); the engine runs the model on one stream at a time.
_TILE_COUNTERS: dict[tuple[torch.device, int], torch.Tensor] = {}


def _tile_counters(device: torch.device, count: int) -> torch.Tensor:
    """The zeroed int32 counters of ``count`` down-kernel column tiles on ``device``."""
    key = (device, count)
    counters = _TILE_COUNTERS.get(key)
    if counters is None:
        counters = torch.zeros(count, dtype=torch.int32, device=device)
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            # NOTE: no call before the capture (the docstring asks for one): this buffer and
            # its zeroing belong to the graph (replayed with it), so it is not kept here.
            return counters
        _TILE_COUNTERS[key] = counters
    return counters


def _check(hidden, w13, w2, topk_weights, topk_ids, activation, expert_map, w_fp8=False) -> None:
    if activation not in _ACTIVATION_CODES:
        raise ValueError(f"activation must be one of {sorted(_ACTIVATION_CODES)}, got activation={activation!r}")
    if hidden.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(
            f"the triton fused_moe runs bfloat16/float16 only, got hidden.dtype={hidden.dtype}; use the torch backend"
        )
    weight_dtype = torch.float8_e4m3fn if w_fp8 else hidden.dtype
    if w13.dtype != weight_dtype or w2.dtype != weight_dtype:
        raise ValueError(f"expert weights must be {weight_dtype}, got w13={w13.dtype}, w2={w2.dtype}")
    if w_fp8 and (w13.shape[1] // 2) % 128:
        raise ValueError(f"FP8 experts need moe_intermediate_size % 128 == 0 (scale blocks), got {w13.shape[1] // 2}")
    if not (hidden.is_cuda or _INTERPRETER):
        raise ValueError(f"the triton fused_moe needs CUDA tensors, got hidden on {hidden.device}")
    num_local, two_i, h = w13.shape
    if hidden.dim() != 2 or hidden.shape[1] != h or two_i % 2 or w2.shape != (num_local, h, two_i // 2):
        raise ValueError(
            f"shapes do not fit: hidden={tuple(hidden.shape)}, w13={tuple(w13.shape)} (want [E, 2I, H]), "
            f"w2={tuple(w2.shape)} (want [E, H, I])"
        )
    if topk_ids.shape != topk_weights.shape or topk_ids.dim() != 2 or topk_ids.shape[0] != hidden.shape[0]:
        raise ValueError(
            f"topk_ids={tuple(topk_ids.shape)} and topk_weights={tuple(topk_weights.shape)} must both be [T, k] "
            f"with T={hidden.shape[0]}"
        )
    if expert_map is not None and expert_map.dim() != 1:
        raise ValueError(f"expert_map must be 1-D [E_global], got shape {tuple(expert_map.shape)}")


@register("fused_moe", "triton")
def fused_moe(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    activation: str = "silu",
    expert_map: torch.Tensor | None = None,
) -> torch.Tensor:
    """Triton fused MoE; the reference's arguments and result (see the module docstring).

    CUDA-graph capturable: no host synchronisation, and the grids depend only on shapes.
    Run it once before capture, so that Triton compiles outside the graph.
    """
    return fused_moe_with_config(hidden, w13, w2, topk_weights, topk_ids, activation, expert_map)


def fused_moe_with_config(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    activation: str = "silu",
    expert_map: torch.Tensor | None = None,
    config: MoEConfig | None = None,
    w13_scale_inv: torch.Tensor | None = None,
    w2_scale_inv: torch.Tensor | None = None,
) -> torch.Tensor:
    """:func:`fused_moe` with the tiles given by ``config`` (None: :func:`pick_config`), for tuning.

    With ``w13_scale_inv``/``w2_scale_inv`` the weights are block-quantized float8 (see
    :func:`~flotilla.kernels.triton_fp8.fp8_grouped_moe`)."""
    w_fp8 = w13_scale_inv is not None
    _check(hidden, w13, w2, topk_weights, topk_ids, activation, expert_map, w_fp8)
    num_tokens, top_k = topk_ids.shape
    num_local, two_i, h = w13.shape
    inter_size = two_i // 2
    out = torch.empty_like(hidden)
    if num_tokens == 0:
        return out
    hidden = hidden.contiguous()
    num_routes = num_tokens * top_k
    cfg = config or pick_config(num_routes, num_local, num_tokens, w_fp8)
    if w_fp8 and (128 % cfg.block_n_1 or 128 % cfg.block_k_1 or 128 % cfg.block_n_2 or 128 % cfg.block_k_2):
        raise ValueError(f"FP8 experts need tiles dividing 128, got {cfg}")
    s13 = w13_scale_inv.float().contiguous() if w_fp8 else w13  # unused pointer when not FP8
    s2 = w2_scale_inv.float().contiguous() if w_fp8 else w2
    direct = num_tokens == 1 and SINGLE_TOKEN_DIRECT
    if direct:
        # NOTE: one token's k routes name k distinct experts: each route gets a row block of
        # its own, its expert read from topk_ids (through expert_map). No routing launch; an
        # expert is read once per route naming it (twice only for two replica slots mapped to
        # one local row, which the sort would have merged). route_expert=ids (global ids, never
        # negative): the sum kernel adds every route; the down kernel writes zeros for another
        # rank's.
        ids = topk_ids.reshape(-1)
        routing = Routing(sorted_route=ids, block_expert=ids, route_expert=ids, block_m=cfg.block_m)
        max_blocks, max_rows = num_routes, num_routes * cfg.block_m
    else:
        routing = route(topk_ids, num_local, expert_map, cfg.block_m)
        max_rows = routing.sorted_route.shape[0]
        max_blocks = routing.block_expert.shape[0]

    inter = torch.empty(max_rows, inter_size, dtype=hidden.dtype, device=hidden.device)
    _gate_up_kernel[(max_blocks, triton.cdiv(inter_size, cfg.block_n_1))](
        hidden,
        w13,
        inter,
        routing.sorted_route,
        routing.block_expert,
        expert_map if expert_map is not None else routing.block_expert,  # NOTE: read only with a map
        num_routes,
        top_k,
        h,
        inter_size,
        hidden.stride(0),
        w13.stride(0),
        w13.stride(1),
        w13.stride(2),
        inter.stride(0),
        s13,
        s13.stride(0),
        s13.stride(-2),
        s13.stride(-1),
        ACTIVATION=_ACTIVATION_CODES[activation],
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n_1,
        BLOCK_K=cfg.block_k_1,
        EVEN_K=h % cfg.block_k_1 == 0,
        W_FP8=w_fp8,
        DIRECT=direct,
        HAS_MAP=expert_map is not None,
        num_warps=cfg.warps_1,
        num_stages=cfg.stages_1,
        **launch_options(hidden.device),
    )

    routed = torch.empty(num_routes, h, dtype=torch.float32, device=hidden.device)
    weights = topk_weights.reshape(-1)
    down_tiles = triton.cdiv(h, cfg.block_n_2)
    fold = direct and FOLD_ROUTE_SUM
    tile_counts = _tile_counters(hidden.device, down_tiles) if fold else routed  # NOTE: read only when folding
    _down_kernel[(max_blocks, down_tiles)](
        inter,
        w2,
        routed,
        weights,
        routing.sorted_route,
        routing.block_expert,
        expert_map if expert_map is not None else routing.block_expert,
        num_routes,
        h,
        inter_size,
        inter.stride(0),
        w2.stride(0),
        w2.stride(1),
        w2.stride(2),
        routed.stride(0),
        s2,
        s2.stride(0),
        s2.stride(-2),
        s2.stride(-1),
        out,
        tile_counts,
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n_2,
        BLOCK_K=cfg.block_k_2,
        EVEN_K=inter_size % cfg.block_k_2 == 0,
        W_FP8=w_fp8,
        DIRECT=direct,
        HAS_MAP=expert_map is not None,
        SUM_ROUTES=top_k if fold else 0,
        num_warps=cfg.warps_2,
        num_stages=cfg.stages_2,
        **launch_options(hidden.device),
    )
    if fold:
        return out

    block_h = min(1024, triton.next_power_of_2(h))
    _sum_routes_kernel[(num_tokens, triton.cdiv(h, block_h))](
        routed, routing.route_expert, out, top_k, h, routed.stride(0), out.stride(0), BLOCK_H=block_h, num_warps=4,
        **launch_options(hidden.device),
    )
    return out
