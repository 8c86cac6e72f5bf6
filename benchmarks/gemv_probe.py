"""How close a decode-sized GEMM gets to the memory roofline on this GPU: cuBLAS (``F.linear``)
against a Triton GEMV written for ``M <= 4``, over the Llama-3.1-8B projection shapes, each
weight rotated through enough copies to defeat the L2 cache, timed as CUDA-graph replays.

    python benchmarks/gemv_probe.py [--json OUT]

Prints achieved bytes/s per shape and kernel, next to a device-to-device copy's bandwidth
(read + write bytes). NOTE: captured in a graph that copy is a memcpy node run by a copy
engine (2.71 TB/s on the H200), slower than the eager ``copy_`` kernel ``flotilla bench``
measures its peak with (4.27 TB/s): compare the GEMVs with the latter.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from flotilla.deploy.bench_env import write_result
from graph_timing import replay_us  # benchmarks/graph_timing.py (run as a script from here)

LLAMA_8B = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
            "lm_head": (128256, 4096)}  # fmt: skip
L2_DEFEAT_BYTES = 512 << 20


def copy_bandwidth() -> float:
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    us = replay_us(lambda: dst.copy_(src), reps=10)
    return 2 * src.numel() / (us * 1e-6)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path)
    opts = parser.parse_args(argv)
    from flotilla.kernels.triton_gemv import gemv, gemv_configs

    results: dict[str, object] = {"copy_bytes_per_s": copy_bandwidth(), "shapes": {}}
    print(f"copy bandwidth {results['copy_bytes_per_s'] / 1e12:.2f} TB/s")
    for name, (n, k) in LLAMA_8B.items():
        copies = max(2, L2_DEFEAT_BYTES // (n * k * 2))
        weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
        row: dict[str, object] = {}
        for m in (1, 2, 4):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            ref = F.linear(x.float(), weights[0].float())
            got = gemv(x, weights[0])
            err = (got.float() - ref).abs().max().item()
            state = {"i": 0}

            def cublas():
                state["i"] = (state["i"] + 1) % copies
                F.linear(x, weights[state["i"]])

            row[f"cublas_m{m}_us"] = replay_us(cublas)
            best = None
            for cfg in gemv_configs(n, k, m):
                def triton_call(cfg=cfg):
                    state["i"] = (state["i"] + 1) % copies
                    gemv(x, weights[state["i"]], config=cfg)

                try:
                    us = replay_us(triton_call)
                except Exception as exc:  # a config the compiler rejects: report and go on
                    print(f"  {name} m={m} {cfg}: {type(exc).__name__}: {str(exc)[:80]}")
                    continue
                if best is None or us < best[0]:
                    best = (us, cfg)
            row[f"triton_m{m}_us"], row[f"triton_m{m}_cfg"] = best if best else (None, None)
            row[f"triton_m{m}_max_err"] = err
            gbps = lambda us: n * k * 2 / (us * 1e-6) / 1e9  # noqa: E731
            print(f"{name:8} {n}x{k} m={m}: cublas {row[f'cublas_m{m}_us']:7.1f} us ({gbps(row[f'cublas_m{m}_us']):6.0f} GB/s)"
                  + (f"  triton {best[0]:7.1f} us ({gbps(best[0]):6.0f} GB/s) {best[1]}  err {err:.2e}" if best else ""))
        results["shapes"][name] = row
        weights.clear()
        torch.cuda.empty_cache()
    if opts.json:
        write_result(opts.json, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
