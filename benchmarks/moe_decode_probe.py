"""The MoE half of a Qwen3-30B-A3B decoder layer at decode batch sizes, today's launches against
the fused ones, on one GPU (H 2048, I 768, 128 experts, top 8, bf16):

    cd benchmarks && python moe_decode_probe.py [--json OUT] [--budget-s 150] [--no-sweep]

Side by side, in one process, each sequence timed as CUDA-graph replays (``graph_timing.py``:
20 calls captured in one graph) with four copies of the layer's weights rotated through the
calls (4.8 GB, so the experts come from HBM, and each copy's router picks its own experts):

- ``today``: flashinfer's fused-add RMSNorm, the router GEMV (``linear``: the Triton GEMV for
  one row, cuBLAS otherwise), the Triton ``select_experts``, then ``fused_moe`` with its route,
  gate/up, down and route-sum kernels (seven launches at batch 1);
- ``norm_router``: the norm fused into the router (``rms_norm_and_linear``; one row only, so
  at batch 4 this row runs today's norm and router), then as today (six);
- ``select_route``: plus ``select_experts`` and the route in one launch (five);
- ``fused``: plus the route sum folded into the down kernel: what the model runs now (four).

Then small sweeps of the fused sequence's launch settings, each timed the same way: the
one-program routing kernel's warps (batches 1 and 4), the fused norm-router GEMV's launch
configuration (batch 1), and at batch 1 the expert kernels' tiles (``MoEConfig``: the gate/up
and down kernels' block_n, block_k, warps, stages, one kernel varied at a time around the
default, ~45 configurations, then the best of each together).
A sweep stops when ``--budget-s`` seconds have passed since the start (each configuration
compiles its kernels first; on a cold Triton cache that dominates), and says so.

Prints microseconds per call (lower is better), the bytes/s of the weights a call reads
(active experts plus the router), the best few of each sweep; ``--json`` writes everything.
Needs a CUDA GPU, Triton and (for today's norm) flashinfer; see docs/gpu.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import torch
from graph_timing import replay_us  # benchmarks/graph_timing.py (run as a script from here)

EXPERTS, TOP_K, HIDDEN, INTER = 128, 8, 2048, 768
DTYPE, DEVICE = torch.bfloat16, "cuda"
EPS = 1e-6
COPIES = 4  # 4 x 1.2 GB of experts: far past the L2 cache
BATCHES = (1, 4)


def _layers() -> list[dict[str, torch.Tensor]]:
    gen = torch.Generator(device=DEVICE).manual_seed(0)

    def rand(*shape, scale):
        return (torch.randn(*shape, device=DEVICE, generator=gen) * scale).to(DTYPE)

    return [
        {
            "w13": rand(EXPERTS, 2 * INTER, HIDDEN, scale=HIDDEN**-0.5),
            "w2": rand(EXPERTS, HIDDEN, INTER, scale=INTER**-0.5),
            "router": rand(EXPERTS, HIDDEN, scale=HIDDEN**-0.5),
            "norm": (1 + rand(HIDDEN, scale=0.1).float()).to(DTYPE),
        }
        for _ in range(COPIES)
    ]


class Rotation:
    """Hands out the weight copies in turn, one per call (captured calls bind theirs)."""

    def __init__(self, layers):
        self.layers, self.i = layers, 0

    def next(self) -> dict[str, torch.Tensor]:
        self.i = (self.i + 1) % len(self.layers)
        return self.layers[self.i]


def _ops():
    from flotilla.kernels import registry

    try:
        norm, norm_backend = registry.get("rms_norm", "flashinfer"), "flashinfer"
    except ValueError:  # no flashinfer here: today's norm on the torch reference (slower)
        norm, norm_backend = registry.get("rms_norm", "torch"), "torch"
    return {
        "norm": norm,
        "norm_backend": norm_backend,
        "linear": registry.get("linear", "triton"),
        "norm_router": registry.get("rms_norm_and_linear", "triton"),
        "select": registry.get("select_experts", "triton"),
        "moe": registry.get("fused_moe_from_logits", "triton"),
    }


def _sequences(ops, x, residual, rot: Rotation):
    """The four sequences of the module docstring, each a no-argument call."""
    from flotilla.kernels import triton_moe, triton_select_route

    def norm_then_router(w):
        # NOTE: flashinfer's fused-add norm works in place: the values drift over replays, the times do not.
        normed, new_residual = ops["norm"](x, w["norm"], EPS, residual)
        return ops["linear"](normed, w["router"]), normed

    def norm_router(w):
        fused = ops["norm_router"](x, residual, w["norm"], EPS, w["router"])
        if fused is None:  # more than one row: the model runs the separate ops
            return norm_then_router(w)
        logits, _, normed = fused
        return logits, normed

    def separate_moe(w, logits, normed):
        weights, ids = ops["select"](logits, TOP_K, True)
        return triton_moe.fused_moe_with_config(normed, w["w13"], w["w2"], weights, ids, fold_sum=False)

    def today():
        w = rot.next()
        separate_moe(w, *norm_then_router(w))

    def with_norm_router():
        w = rot.next()
        separate_moe(w, *norm_router(w))

    def with_select_route():
        w = rot.next()
        logits, normed = norm_router(w)
        cfg = triton_moe.pick_config(logits.shape[0] * TOP_K, EXPERTS)
        weights, _, routing = triton_select_route.select_and_route(logits, TOP_K, True, "softmax", None, 1.0, EXPERTS, None, cfg.block_m)
        triton_moe.run_experts(normed, w["w13"], w["w2"], weights, routing, TOP_K, "silu", cfg)

    def fused():
        w = rot.next()
        logits, normed = norm_router(w)
        ops["moe"](normed, logits, w["w13"], w["w2"], TOP_K, True)

    return {"today": today, "norm_router": with_norm_router, "select_route": with_select_route, "fused": fused}


def _time(fn, label: str, row: dict[str, float]) -> None:
    try:
        row[label] = replay_us(fn)
    except Exception as exc:  # a configuration the compiler or the GPU rejects: report and go on
        print(f"    {label}: {type(exc).__name__}: {str(exc)[:120]}")


def _moved_bytes(ops, x, residual, layers) -> float:
    """Bytes of weights one call reads: the distinct experts each copy's router picks, plus the router."""
    total = 0
    for w in layers:
        logits = ops["linear"](ops["norm"](x.clone(), w["norm"], EPS, residual.clone())[0], w["router"])
        active = ops["select"](logits, TOP_K, True)[1].unique().numel()
        total += active * 3 * HIDDEN * INTER * 2 + EXPERTS * HIDDEN * 2
    return total / len(layers)


def moe_configs() -> list:
    """The batch-1 sweep: each expert kernel's tiles varied around the default (the other kernel
    at its default), tiles whose weight buffers would not fit shared memory left out."""
    from flotilla.kernels import triton_moe

    base = triton_moe.pick_config(TOP_K, EXPERTS)
    configs = []
    for bn in (32, 64, 128):
        for bk in (64, 128, 256):
            for warps, stages in ((4, 3), (4, 4), (8, 4)):
                if bn * bk * 4 * stages <= 200_000:  # gate and up tiles, bf16, per stage
                    configs.append(dataclasses.replace(base, block_n_1=bn, block_k_1=bk, warps_1=warps, stages_1=stages))
                if bn * bk * 2 * stages <= 200_000:
                    configs.append(dataclasses.replace(base, block_n_2=bn, block_k_2=bk, warps_2=warps, stages_2=stages))
    return [base] + [c for c in dict.fromkeys(configs) if c != base]


def _tag(cfg) -> str:
    return (f"gate_up {cfg.block_n_1}x{cfg.block_k_1} w{cfg.warps_1} s{cfg.stages_1} / "
            f"down {cfg.block_n_2}x{cfg.block_k_2} w{cfg.warps_2} s{cfg.stages_2}")  # fmt: skip


def sweep_moe(ops, rot, x, deadline) -> dict[str, float]:
    """Batch 1: the fused routing and experts (from router logits) per ``MoEConfig``; then the
    best gate/up tiles with the best down tiles."""
    from flotilla.kernels import triton_select_route

    logits = {id(w): ops["linear"](x, w["router"]) for w in rot.layers}
    results: dict[str, float] = {}
    configs = moe_configs()

    def run(cfg):
        def call():
            w = rot.next()
            triton_select_route.moe_from_logits_with_config(x, logits[id(w)], w["w13"], w["w2"], TOP_K, True, config=cfg)

        _time(call, _tag(cfg), results)

    for i, cfg in enumerate(configs):
        if time.perf_counter() > deadline:
            print(f"    budget spent: {len(configs) - i} of {len(configs)} tile configurations not run")
            break
        run(cfg)
    base = configs[0]
    by_tag = {_tag(c): c for c in configs}

    def best(field_names):
        varied = [(us, by_tag[t]) for t, us in results.items() if t in by_tag]
        varied = [(us, c) for us, c in varied if all(getattr(c, f) == getattr(base, f) for f in field_names)]
        return min(varied, key=lambda item: item[0])[1] if varied else base

    down_fields = ("block_n_2", "block_k_2", "warps_2", "stages_2")
    gate_fields = ("block_n_1", "block_k_1", "warps_1", "stages_1")
    best_gate, best_down = best(down_fields), best(gate_fields)
    combined = dataclasses.replace(best_gate, **{f: getattr(best_down, f) for f in down_fields})
    if _tag(combined) not in results and time.perf_counter() < deadline:
        run(combined)
    return results


def sweep_routing(ops, rot, deadline) -> dict[str, float]:
    """The one-program routing kernel alone (select_experts + route), per warp count and batch."""
    from flotilla.kernels import triton_moe, triton_select_route

    results: dict[str, float] = {}
    for batch in BATCHES:
        x = torch.randn(batch, HIDDEN, device=DEVICE).to(DTYPE)
        logits = {id(w): ops["linear"](x, w["router"]) for w in rot.layers}
        tiles = triton_moe.down_tiles(HIDDEN, triton_moe.pick_config(batch * TOP_K, EXPERTS))
        for warps in (1, 2, 4, 8):
            if time.perf_counter() > deadline:
                print("    budget spent: routing sweep cut short")
                return results

            def call(warps=warps, logits=logits):
                w = rot.next()
                triton_select_route.select_and_route(
                    logits[id(w)], TOP_K, True, "softmax", None, 1.0, EXPERTS, None, 16, tiles, num_warps=warps
                )

            _time(call, f"batch={batch} warps={warps}", results)
    return results


def sweep_norm_router(rot, x, residual, deadline) -> dict[str, float]:
    """The fused norm + router GEMV (normalized row kept) per launch configuration, batch 1."""
    from flotilla.kernels import triton_gemv

    results: dict[str, float] = {}
    for bn in (1, 2, 4, 8):
        for bk in (1024, 2048):
            for warps in (4, 8):
                if time.perf_counter() > deadline:
                    print("    budget spent: norm-router sweep cut short")
                    return results
                cfg = {"BLOCK_N": bn, "BLOCK_K": bk, "num_warps": warps}

                def call(cfg=cfg):
                    w = rot.next()
                    triton_gemv.rms_norm_gemv_keep_normed(x, residual, w["norm"], EPS, w["router"], config=cfg)

                _time(call, f"{bn}x{bk} w{warps}", results)
    return results


def _best(row: dict[str, float], n: int = 5) -> list[tuple[str, float]]:
    return sorted(row.items(), key=lambda item: item[1])[:n]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path)
    parser.add_argument("--budget-s", type=float, default=150.0, help="stop the sweeps after this many seconds")
    parser.add_argument("--no-sweep", action="store_true")
    opts = parser.parse_args(argv)
    start = time.perf_counter()
    deadline = start + opts.budget_s
    from flotilla.kernels import triton_gemv, triton_moe, triton_select_route

    ops = _ops()
    layers = _layers()
    rot = Rotation(layers)
    report: dict = {
        "device": torch.cuda.get_device_name(),
        "shape": {"hidden": HIDDEN, "intermediate": INTER, "experts": EXPERTS, "top_k": TOP_K, "dtype": "bfloat16"},
        "norm_backend_today": ops["norm_backend"],
        "defaults": {
            "moe_config_batch1": dataclasses.asdict(triton_moe.pick_config(TOP_K, EXPERTS)),
            "norm_router": triton_gemv.norm_config(EXPERTS, HIDDEN),
            "route_warps_batch1": triton_select_route.default_warps(EXPERTS, EXPERTS * TOP_K),
            "fold_sum_max_routes": triton_moe.FOLD_SUM_MAX_ROUTES,
        },
        "sequences_us": {},
    }
    for batch in BATCHES:
        gen = torch.Generator(device=DEVICE).manual_seed(batch)
        x = torch.randn(batch, HIDDEN, device=DEVICE, generator=gen).to(DTYPE)
        residual = torch.randn(batch, HIDDEN, device=DEVICE, generator=gen).to(DTYPE)
        moved = _moved_bytes(ops, x, residual, layers)
        row: dict[str, float] = {}
        for name, fn in _sequences(ops, x, residual, rot).items():
            _time(fn, name, row)
        report["sequences_us"][f"batch={batch}"] = row
        report.setdefault("weight_bytes_per_call", {})[f"batch={batch}"] = moved
        print(f"batch {batch} ({moved / 1e6:.1f} MB of weights a call):")
        for name, us in row.items():
            gain = f"  {row['today'] / us:5.2f}x today" if "today" in row else ""
            print(f"    {us:7.1f} us  {moved / (us * 1e-6) / 1e12:5.2f} TB/s  {name}{gain}")
    if not opts.no_sweep:
        x1 = torch.randn(1, HIDDEN, device=DEVICE).to(DTYPE)
        r1 = torch.randn(1, HIDDEN, device=DEVICE).to(DTYPE)
        # NOTE: the small sweeps first: the tile sweep compiles the most and may hit the budget.
        sweeps = {
            "routing_warps_us": lambda: sweep_routing(ops, rot, deadline),
            "norm_router_configs_us": lambda: sweep_norm_router(rot, x1, r1, deadline),
            "moe_configs_batch1_us": lambda: sweep_moe(ops, rot, x1, deadline),
        }
        for key, sweep in sweeps.items():
            results = sweep()
            report[key] = results
            print(f"{key} ({len(results)} timed), best:")
            for label, us in _best(results):
                print(f"    {us:7.1f} us  {label}")
    report["wall_s"] = time.perf_counter() - start
    print(f"wall time {report['wall_s']:.0f} s")
    if opts.json:
        opts.json.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
