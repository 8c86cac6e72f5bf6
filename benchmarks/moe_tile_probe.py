"""Tile sweep of the Triton fused MoE (``kernels/triton_moe.py``) at decode batch sizes, timed
the way the decode graph runs it.

    python benchmarks/moe_tile_probe.py --json OUT [--batches 1,2,4] [--rounds 5] [--quick]
    PYTHONPATH=/tmp/tritonsite:... TRITON_INTERPRET=1 python benchmarks/moe_tile_probe.py --cpu-smoke [--json OUT]

Shape: Qwen3-30B-A3B's experts by default (hidden 2048, moe intermediate 768, 128 experts,
top-8, bf16; ``--hidden`` etc. change it), random weights.

Timing: one CUDA graph per configuration holds ``--layers`` MoE calls back to back, each
call's output the next one's input, each on its own routing (distinct random experts per
token, fixed at capture) and on one of ``--weight-sets`` weight sets in turn, so that a call
finds none of its experts in L2 (8 sets of 1.2 GB against the H200's 50 MB). One sample is
``--replays`` replays timed by CUDA events, in microseconds per MoE call. Every stage of the
sweep (``moe_tile_sweep.py``) measures its configurations once per round, in a new order each
round, with today's default (``pick_config``) in every round; configurations are ranked by
their median over rounds and the JSON keeps min/median/max, the spread and the median of
each sample's ratio to the default's sample of the same round.

Correctness: the default's output is checked against the float32 torch reference
(``kernels/moe.py``) once per batch size, every other configuration's output against the
default's before it is timed; a configuration the compiler rejects or that computes a wrong
result is reported under ``rejected`` and never timed. Tolerance (the GPU tests' bounds):
relative norm error < 1e-2 and every element within 2e-2 * (|want| + max|want| / 4). Two
correct configurations differ only in the float32 summation order, which can move a rounding
of the bf16 intermediate or output by one ulp (2^-8 relative) on a few elements; a wrong tile
(columns or K blocks missed or doubled) is off by O(1).

Compiles: each configuration is a new Triton compile per kernel. ``--compile-workers`` spawned
processes compile a stage's configurations in parallel (each runs them once on the GPU, which
fills Triton's on-disk cache); the main process then loads them from that cache.

``--cpu-smoke`` (Triton's interpreter, no GPU): tiny shape, float16 (the Triton 3.6
interpreter's ``tl.dot`` multiplies bfloat16 operands as their raw 16-bit integers), every
(BLOCK_N, BLOCK_K) of the grid for each kernel checked against the torch reference at every
batch size (the interpreter ignores num_warps and num_stages), then the whole sweep on the
quick grid with eager wall-clock timing in place of graphs. Exit status 1 on a wrong result.
"""

from __future__ import annotations

import argparse
import importlib
import math
import os
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from flotilla.deploy.bench_env import write_result

# benchmarks/ (the probe runs as a script from the repository root)
from moe_tile_bench import QWEN3_30B_A3B, SMOKE_SHAPE, BatchBench, Shape, make_weights, moe_config
from moe_tile_compile import Precompiler, quiet_interpreter
from moe_tile_sweep import QUICK_GRID, SweepResult, TileGrid, TilePair, Tiles, sweep

H200_SMEM_PER_BLOCK = 232448  # bytes a block may opt into on sm_90 (when torch does not say)


# --------------------------------------------------------------------------- report


def programs(pair: TilePair, shape: Shape, batch: int) -> dict[str, int]:
    """Programs each GEMM kernel launches (row blocks x column tiles; idle row blocks exit at once)."""
    routes = batch * shape.top_k
    row_blocks = math.ceil((routes + min(shape.experts, routes) * (pair.block_m - 1)) / pair.block_m)
    return {
        "gate_up": row_blocks * math.ceil(shape.intermediate / pair.gate_up.block_n),
        "down": row_blocks * math.ceil(shape.hidden / pair.down.block_n),
    }


def _pair_report(bench: BatchBench, pair: TilePair, stats) -> dict:
    return {
        "label": pair.label,
        "config": asdict(moe_config(pair)),
        "programs": programs(pair, bench.shape, bench.batch),
        **stats.as_dict(),
        "gbps": round(bench.weight_bytes_per_call / (stats.median_us * 1e-6) / 1e9, 1),
        "kernels_us": bench.kernel_us(pair),
    }


def batch_report(bench: BatchBench, result: SweepResult, copy_tbps: float, seconds: float) -> dict:
    """One batch size's part of the JSON: default and best (from the last stage that ran, the
    confirmation unless time ran out), every stage's table, the rejected and the checks."""
    checks = bench.checks.values()
    report: dict = {
        "routes": bench.batch * bench.shape.top_k,
        "unique_experts_per_call": round(bench.unique_experts_per_call, 3),
        "weight_bytes_per_call": int(bench.weight_bytes_per_call),
        "floor_us_at_copy_bandwidth": round(bench.weight_bytes_per_call / (copy_tbps * 1e12) * 1e6, 3),
        "default": None,
        "best": None,
        "configs": result.pooled(),
        "stages": {name: {label: s.as_dict() for label, s in stats.items()} for name, stats in result.stages.items()},
        "rejected": result.rejected,
        "skipped_stages": result.skipped_stages,
        "correctness": {
            "default_vs_reference": bench.default_vs_reference,
            "configs_checked": len(bench.checks),
            "max_rel_norm_err_vs_default": max((c[0] for c in checks), default=0.0),
            "max_worst_elem_ratio_vs_default": max((c[1] for c in checks), default=0.0),
            "max_rel_norm_err_vs_reference": max((c[2] for c in checks), default=0.0),
        },
        "seconds": round(seconds, 1),
    }
    if result.best is not None:
        stage = result.stages[result.best_stage]
        base, best = stage[result.default.label], stage[result.best.label]
        report["default"] = {"stage": result.best_stage, **_pair_report(bench, result.default, base)}
        report["best"] = {
            "stage": result.best_stage,
            **_pair_report(bench, result.best, best),
            "ratio_to_default": round(best.median_us / base.median_us, 4),
        }
    return report


# --------------------------------------------------------------------------- main


def _int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, help="write the results here (after every batch size)")
    parser.add_argument("--batches", type=_int_list, default=[1, 2, 4], help="decode batch sizes (default 1,2,4)")
    parser.add_argument("--rounds", type=int, default=None, help="rounds per stage (default 5; --quick 3; smoke 2)")
    parser.add_argument("--layers", type=int, default=None, help="MoE calls per graph (default 24; --quick 8; smoke 2)")
    parser.add_argument("--weight-sets", type=int, default=8, help="weight sets the layers rotate over (default 8)")
    parser.add_argument("--replays", type=int, default=10, help="timed graph replays per sample (default 10)")
    parser.add_argument("--hidden", type=int, default=None, help="default 2048 (smoke 256)")
    parser.add_argument("--intermediate", type=int, default=None, help="moe intermediate size, default 768 (smoke 256)")
    parser.add_argument("--experts", type=int, default=None, help="default 128 (smoke 16)")
    parser.add_argument("--top-k", type=int, default=None, help="default 8 (smoke 4)")
    parser.add_argument("--quick", action="store_true", help="a tiny grid (BLOCK_N 32/64, BLOCK_K 128, 4 warps, 3-4 stages)")
    parser.add_argument("--refine-top", type=int, default=4, help="tile shapes per kernel swept over stages (default 4)")
    parser.add_argument("--confirm-top", type=int, default=3, help="best tiles per kernel crossed at the end (default 3)")
    parser.add_argument("--compile-workers", type=int, default=None,
                        help="processes compiling in parallel (default min(8, CPUs - 1) on GPU, 0 in the smoke)")
    parser.add_argument("--budget-s", type=float, default=270.0,
                        help="no stage starts after this many seconds (default 270: a stage runs < 1 min)")
    parser.add_argument("--copy-bandwidth-tbps", type=float, default=4.28, help="for the floor in the report (H200)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cpu-smoke", action="store_true", help="Triton interpreter on CPU: correctness and plumbing")
    opts = parser.parse_args(argv)
    for name in ("rounds", "layers", "weight_sets", "replays", "refine_top", "confirm_top"):
        value = getattr(opts, name)
        if value is not None and value < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    if opts.compile_workers is not None and opts.compile_workers < 0:
        parser.error(f"--compile-workers must be >= 0, got {opts.compile_workers}")
    return opts


@dataclass(frozen=True)
class Run:
    """The probe's settings once the flags and the device are resolved."""

    smoke: bool
    shape: Shape
    dtype: torch.dtype
    device: torch.device
    grid: TileGrid
    rounds: int
    layers: int
    weight_sets: int
    workers: int
    smem_limit: int

    @classmethod
    def resolve(cls, opts: argparse.Namespace) -> "Run":
        smoke = opts.cpu_smoke
        base = SMOKE_SHAPE if smoke else QWEN3_30B_A3B
        shape = Shape(opts.hidden or base.hidden, opts.intermediate or base.intermediate,
                      opts.experts or base.experts, opts.top_k or base.top_k)
        layers = opts.layers or (2 if smoke else 8 if opts.quick else 24)
        sets = min(opts.weight_sets, layers)
        device, smem_limit = torch.device("cpu"), H200_SMEM_PER_BLOCK
        if not smoke:
            device = torch.device("cuda", torch.cuda.current_device())
            props = torch.cuda.get_device_properties(device)
            smem_limit = getattr(props, "shared_memory_per_block_optin", 0) or H200_SMEM_PER_BLOCK
            set_bytes = shape.experts * shape.expert_bytes(2)
            sets = max(1, min(sets, int(0.6 * torch.cuda.mem_get_info(device)[0]) // set_bytes))
        workers = opts.compile_workers
        if workers is None:
            workers = 0 if smoke else min(8, max(0, (os.cpu_count() or 1) - 1))
        return cls(
            smoke=smoke, shape=shape, dtype=torch.float16 if smoke else torch.bfloat16, device=device,
            grid=QUICK_GRID if (opts.quick or smoke) else TileGrid(),
            rounds=opts.rounds or (2 if smoke else 3 if opts.quick else 5), layers=layers, weight_sets=sets,
            workers=workers, smem_limit=smem_limit,
        )

    def meta(self) -> dict:
        import triton

        out = {
            "device": "cpu (Triton interpreter)" if self.smoke else torch.cuda.get_device_name(self.device),
            "shape": asdict(self.shape), "dtype": str(self.dtype), "layers": self.layers, "rounds": self.rounds,
            "weight_sets": self.weight_sets, "weight_set_bytes": self.shape.experts * self.shape.expert_bytes(2),
            "grid": asdict(self.grid), "smem_per_block": self.smem_limit, "compile_workers": self.workers,
            "smoke": self.smoke, "torch": torch.__version__, "triton": triton.__version__,
        }
        if not self.smoke:
            out["l2_bytes"] = getattr(torch.cuda.get_device_properties(self.device), "L2_cache_size", None)
        return out


def smoke_geometries(run: Run, weight_sets: list, batches: list[int], seed: int) -> list[str]:
    """Every (BLOCK_N, BLOCK_K) of the full grid for each kernel (the other at the default),
    at every batch size, against the torch reference and the default; returns the failures."""
    grid = TileGrid()
    failures = []
    checked = 0
    for batch in batches:
        bench = BatchBench(run.shape, weight_sets, batch, 1, 1, run.dtype, run.device, graphs=False, seed=seed)
        for kernel in ("gate_up", "down"):
            base = bench.default.half(kernel)
            pairs = [bench.default.with_half(kernel, Tiles(bn, bk, base.warps, base.stages))
                     for bn in grid.block_n for bk in grid.block_k]
            errors = bench.prepare(pairs)
            checked += len(pairs)
            failures += [f"batch {batch} {label}: {why}" for label, why in errors.items()]
        worst = max(c[0] for c in bench.checks.values())
        worst_ref = max(c[2] for c in bench.checks.values())
        print(f"  batch {batch}: {len(bench.checks)} tile geometries, worst rel err {worst:.2e} against the default,"
              f" {worst_ref:.2e} against the torch reference", flush=True)
    print(f"geometry check: {checked} runs, {len(failures)} failures", flush=True)
    return failures


def _write(path: Path | None, meta: dict, results: dict, started: float) -> None:
    if path is not None:
        write_result(path, {**meta, "elapsed_s": round(time.monotonic() - started, 1), "per_batch": results})


def probe_batch(run: Run, opts: argparse.Namespace, weight_sets: list, batch: int, precompile, deadline: float) -> dict:
    """Sweep one batch size; its report."""
    started = time.monotonic()
    print(f"batch {batch}:", flush=True)
    bench = BatchBench(run.shape, weight_sets, batch, run.layers, opts.replays, run.dtype, run.device,
                       graphs=not run.smoke, seed=opts.seed)
    bench.warm_up(0.5)
    result = sweep(
        bench.default, run.grid, lambda pairs: bench.prepare(pairs, precompile), bench.measure,
        rounds=run.rounds, smem_limit=run.smem_limit, refine_top=opts.refine_top, confirm_top=opts.confirm_top,
        seed=opts.seed + batch, out_of_time=lambda: time.monotonic() > deadline, log=lambda line: print(line, flush=True),
    )
    report = batch_report(bench, result, opts.copy_bandwidth_tbps, time.monotonic() - started)
    bench.release()
    best, default = report["best"], report["default"]
    if best:
        print(f"batch {batch}: best {best['label']} {best['median_us']:.2f} us/call, default {default['median_us']:.2f}"
              f" (x{best['ratio_to_default']:.3f}, {best['gbps']:.0f} GB/s; floor"
              f" {report['floor_us_at_copy_bandwidth']:.1f} us); MoEConfig{tuple(best['config'].values())}", flush=True)
    return report


def main(argv: list[str] | None = None) -> int:
    opts = parse_args(argv)
    started = time.monotonic()
    if opts.cpu_smoke and os.environ.get("TRITON_INTERPRET") != "1":
        print("--cpu-smoke runs the kernels in Triton's interpreter: set TRITON_INTERPRET=1", file=sys.stderr)
        return 2
    if not opts.cpu_smoke and not torch.cuda.is_available():
        print("the probe times CUDA graphs and needs a GPU; on CPU run it with --cpu-smoke and TRITON_INTERPRET=1",
              file=sys.stderr)
        return 2
    importlib.import_module("flotilla.kernels.triton_moe")  # Triton, and the kernels under test
    run = Run.resolve(opts)
    if run.smoke:
        quiet_interpreter()
    meta = {**run.meta(), "batches": opts.batches, "replays": opts.replays}
    print(f"{meta['device']}: {run.shape}, {run.dtype}, {run.layers} layers over {run.weight_sets} weight sets of"
          f" {meta['weight_set_bytes'] / 1e9:.2f} GB, {run.rounds} rounds x {opts.replays} replays, {run.grid}",
          flush=True)
    weight_sets = [make_weights(run.shape, run.dtype, run.device, opts.seed + 17 * s) for s in range(run.weight_sets)]
    failures = smoke_geometries(run, weight_sets, opts.batches, opts.seed) if run.smoke else []
    meta["smoke_geometry_failures"] = failures
    dims = (run.shape.hidden, run.shape.intermediate, run.shape.experts, run.shape.top_k)
    precompile = Precompiler(run.workers, dims, run.dtype, run.device) if run.workers > 0 else None
    deadline = started + opts.budget_s
    results: dict[str, dict] = {}
    try:
        for batch in opts.batches:
            if time.monotonic() > deadline:
                results[str(batch)] = {"skipped": "out of time (--budget-s)"}
                continue
            results[str(batch)] = probe_batch(run, opts, weight_sets, batch, precompile, deadline)
            _write(opts.json, meta, results, started)  # NOTE: after every batch, so a later failure keeps it
    finally:
        if precompile is not None:
            meta["compile"] = {"configs": precompile.count, "seconds": round(precompile.seconds, 1)}
            precompile.close()
    _write(opts.json, meta, results, started)
    print(f"done in {time.monotonic() - started:.0f} s", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
