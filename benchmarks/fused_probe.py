"""The fused batch-1 decode ops against the separate ops they replace, on the Llama-3.1-8B
shapes: for each projection, the norm (or activation) kernel followed by cuBLAS or the Triton
GEMV, against the Triton kernels that fuse them, over launch configurations. Each call is
timed as CUDA-graph replays with the weight rotated through enough copies to defeat the L2
cache (as in ``gemv_probe.py``).

    python benchmarks/fused_probe.py [--json OUT]
    python benchmarks/fused_probe.py --shapes qwen3-30b-a3b [--json OUT]

``--shapes qwen3-30b-a3b`` times the Qwen3-30B-A3B attention-side projections instead (the
norm + q/k/v GEMV, the o GEMV, the router GEMV; K = 2048 or 4096) over a wider grid of
launch configurations, with PDL only, and no layer chain.

Every kernel row is measured with the Triton kernels launched as programmatic dependents
(``kernels/triton_pdl.py``, the default on SM90) and again without (``(no pdl)``); ``layer`` chains
one decoder layer's four projections both ways.

Rows per shape (microseconds per call):
- ``separate_cublas`` / ``separate_gemv``: flashinfer's fused-add RMSNorm (or SiLU-and-mul)
  then ``F.linear`` / the Triton GEMV (the path with the ``linear`` backend ``torch`` /
  without the fused op);
- ``fused[...]``: ``rms_norm_gemv`` (the norm's sum of squares gathered in the product's
  pass) or the SiLU-fused GEMV, per launch configuration (``BLOCK_N x BLOCK_K w num_warps``).

Measured on the H200 (session of 2026-11-30): a first version of ``rms_norm_gemv`` that
summed the squares in a pass of its own before streaming the weight, over a grid capped at a
few programs per SM, took 26.6 us on q/k/v and 85.1 us on gate/up (cuBLAS alone: 15.5 and
56.3); gathering the squares in the product's pass brought them to 15.9 and 59.1 us.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from flotilla.deploy.bench_env import write_result
from graph_timing import replay_us  # benchmarks/graph_timing.py (run as a script from here)

NORM_SHAPES = {"qkv": (6144, 4096), "gate_up": (28672, 4096)}
SILU_SHAPES = {"down": (4096, 14336)}
# Qwen3-30B-A3B (hidden 2048, 32 q / 4 kv heads of 128, 128 experts): norm + q/k/v, then plain GEMVs.
QWEN_MOE_NORM_SHAPES = {"qkv": (5120, 2048)}
QWEN_MOE_PLAIN_SHAPES = {"o": (2048, 4096), "router": (128, 2048)}
WIDE_CONFIGS = [
    {"BLOCK_N": bn, "BLOCK_K": bk, "num_warps": warps}
    for bn in (2, 4, 8)
    for bk in (512, 1024, 2048, 4096)
    for warps in (4, 8)
    if bn * bk <= 8192
]
L2_DEFEAT_BYTES = 512 << 20
CONFIGS = [
    {"BLOCK_N": bn, "BLOCK_K": bk, "num_warps": warps}
    for bn in (4, 8, 16)
    for bk in (512, 1024)
    for warps in (4, 8)
]


def _rotating(n: int, k: int) -> tuple[list[torch.Tensor], dict[str, int]]:
    copies = max(2, L2_DEFEAT_BYTES // (n * k * 2))
    return [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies)], {"i": 0}


def _timed(fn, label: str, row: dict[str, float]) -> None:
    try:
        row[label] = replay_us(fn)
    except Exception as exc:  # a configuration the compiler rejects: report and go on
        print(f"  {label}: {type(exc).__name__}: {str(exc)[:100]}")


def probe_norm(n: int, k: int, configs: list[dict[str, int]] = CONFIGS) -> dict[str, float]:
    from flotilla.kernels import registry
    from flotilla.kernels.triton_gemv import gemv, rms_norm_gemv

    norm = registry.get("rms_norm", "flashinfer")
    weights, state = _rotating(n, k)
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    residual = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    g = torch.ones(k, device="cuda", dtype=torch.bfloat16)

    def nxt() -> torch.Tensor:
        state["i"] = (state["i"] + 1) % len(weights)
        return weights[state["i"]]

    row: dict[str, float] = {}
    # NOTE: flashinfer's fused-add norm works in place; the values drift over replays, the time does not.
    _timed(lambda: F.linear(norm(x, g, 1e-5, residual)[0], nxt()), "separate_cublas", row)
    _timed(lambda: gemv(norm(x, g, 1e-5, residual)[0], nxt()), "separate_gemv", row)
    _timed(lambda: F.linear(x, nxt()), "cublas_alone", row)
    for cfg in configs:
        tag = f"{cfg['BLOCK_N']}x{cfg['BLOCK_K']}w{cfg['num_warps']}"
        _timed(lambda: rms_norm_gemv(x, residual, g, 1e-5, nxt(), config=cfg), f"fused[{tag}]", row)
    _timed(lambda: rms_norm_gemv(x, residual, g, 1e-5, nxt()), "fused_default", row)
    return row


def probe_plain(n: int, k: int, configs: list[dict[str, int]] = WIDE_CONFIGS) -> dict[str, float]:
    """A plain one-row GEMV: cuBLAS, the Triton GEMV's default, and each launch configuration
    (labelled ``fused[...]`` like the other probes' kernel rows, so the summary ranks them)."""
    from flotilla.kernels.triton_gemv import gemv

    weights, state = _rotating(n, k)
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)

    def nxt() -> torch.Tensor:
        state["i"] = (state["i"] + 1) % len(weights)
        return weights[state["i"]]

    row: dict[str, float] = {}
    _timed(lambda: F.linear(x, nxt()), "cublas_alone", row)
    _timed(lambda: gemv(x, nxt()), "gemv_default", row)
    for cfg in configs:
        tag = f"{cfg['BLOCK_N']}x{cfg['BLOCK_K']}w{cfg['num_warps']}"
        _timed(lambda: gemv(x, nxt(), config=cfg), f"fused[{tag}]", row)
    return row


def probe_silu(n: int, k: int) -> dict[str, float]:
    from flotilla.kernels import registry
    from flotilla.kernels.triton_gemv import gemv

    act = registry.get("silu_and_mul", "flashinfer")
    weights, state = _rotating(n, k)
    x = torch.randn(1, 2 * k, device="cuda", dtype=torch.bfloat16)

    def nxt() -> torch.Tensor:
        state["i"] = (state["i"] + 1) % len(weights)
        return weights[state["i"]]

    row: dict[str, float] = {}
    _timed(lambda: F.linear(act(x), nxt()), "separate_cublas", row)
    _timed(lambda: gemv(act(x), nxt()), "separate_gemv", row)
    for cfg in CONFIGS:
        tag = f"{cfg['BLOCK_N']}x{cfg['BLOCK_K']}w{cfg['num_warps']}"
        _timed(lambda: gemv(x, nxt(), config=cfg, silu_mul=True), f"fused[{tag}]", row)
    return row


def probe_layer_chain() -> dict[str, float]:
    """One Llama-3.1-8B decoder layer's projections back to back, as the decode graph runs
    them (norm + q/k/v, o, norm + gate/up, SiLU + down; attention left out), with and without
    programmatic dependent launch: microseconds per layer."""
    from flotilla.kernels import triton_gemv, triton_pdl

    dims = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
    copies = max(2, L2_DEFEAT_BYTES // (sum(n * k for n, k in dims.values()) * 2))
    layers = [
        {name: torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for name, (n, k) in dims.items()}
        for _ in range(copies)
    ]
    h = torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16)
    g = torch.ones(4096, device="cuda", dtype=torch.bfloat16)
    attn = torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16)
    state = {"i": 0}

    def layer():
        state["i"] = (state["i"] + 1) % copies
        w = layers[state["i"]]
        triton_gemv.rms_norm_gemv(h, h, g, 1e-5, w["qkv"])
        o = triton_gemv.gemv(attn, w["o"])
        gate_up, _ = triton_gemv.rms_norm_gemv(o, h, g, 1e-5, w["gate_up"])
        triton_gemv.gemv(gate_up, w["down"], silu_mul=True)

    row: dict[str, float] = {}
    for pdl in (True, False):
        triton_pdl.ENABLED = pdl
        _timed(layer, f"layer_pdl_{'on' if pdl else 'off'}", row)
    triton_pdl.ENABLED = True
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path)
    parser.add_argument("--shapes", choices=("llama-3.1-8b", "qwen3-30b-a3b"), default="llama-3.1-8b")
    opts = parser.parse_args(argv)
    from flotilla.kernels import triton_pdl

    results: dict[str, dict[str, float]] = {}
    if opts.shapes == "qwen3-30b-a3b":
        for name, (n, k) in QWEN_MOE_NORM_SHAPES.items():
            results[name] = probe_norm(n, k, WIDE_CONFIGS)
        for name, (n, k) in QWEN_MOE_PLAIN_SHAPES.items():
            results[name] = probe_plain(n, k)
    else:
        results["layer"] = probe_layer_chain()
    for pdl in (True, False) if opts.shapes == "llama-3.1-8b" else ():
        triton_pdl.ENABLED = pdl
        suffix = "" if pdl else " (no pdl)"
        for name, (n, k) in NORM_SHAPES.items():
            results[name + suffix] = probe_norm(n, k)
        for name, (n, k) in SILU_SHAPES.items():
            results[name + suffix] = probe_silu(n, k)
    triton_pdl.ENABLED = True
    for name, row in results.items():
        best = min(((us, label) for label, us in row.items() if label.startswith("fused")), default=(float("nan"), "-"))
        print(f"{name}: " + ", ".join(f"{label} {us:.1f}" for label, us in row.items() if not label.startswith("fused["))
              + f"; best fused {best[0]:.1f} us {best[1]}")
        for label, us in sorted(row.items(), key=lambda item: item[1])[:6]:
            print(f"    {us:7.1f} us  {label}")
    if opts.json:
        write_result(opts.json, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
