"""The decode step's projection GEMMs at large batches: cuBLAS as ``F.linear`` picks it, cuBLAS
with every algorithm tried once (PyTorch's TunableOp), and a Triton GEMM autotuned over tile
shapes, for the Llama-3.1-8B layer's four projections (qkv and gate_up fused) and its LM head.

    python benchmarks/gemm_probe.py [--rows 256,512] [--json OUT]

Each case chains ``--copies`` calls over distinct weight copies (no weight stays in L2) in one
CUDA graph and reports the mean microseconds of one call and its TFLOPS. The decode profile of
docs/benchmarks.md's seventh pass had the M = 512 projection GEMMs at ~765 TFLOPS in all, the
smaller qkv and o GEMMs well below that (their tiles fill one or two waves of 132 SMs).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from flotilla.deploy.bench_env import write_result
from graph_timing import replay_us  # benchmarks/graph_timing.py (run as a script from here)

HIDDEN, INTERMEDIATE, VOCAB = 4096, 14336, 128256
# (name, out_features, in_features) of one Llama-3.1-8B layer's projections and its LM head.
SHAPES = (("qkv", 6144, HIDDEN), ("o", HIDDEN, HIDDEN), ("gate_up", 2 * INTERMEDIATE, HIDDEN),
          ("down", HIDDEN, INTERMEDIATE), ("lm_head", VOCAB, HIDDEN))  # fmt: skip


def triton_linear():
    """A plain autotuned Triton GEMM ``x @ w.T`` (bf16 in, float32 accumulate, bf16 out)."""
    import triton
    import triton.language as tl

    configs = [
        triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 8}, num_warps=w, num_stages=s)
        for bm, bn, bk, w, s in (
            (128, 128, 64, 8, 3), (128, 128, 64, 4, 4), (128, 64, 64, 4, 4), (64, 128, 64, 4, 4),
            (128, 256, 64, 8, 3), (64, 64, 64, 4, 5), (128, 128, 128, 8, 3), (64, 256, 64, 8, 3),
        )
    ]  # fmt: skip

    @triton.autotune(configs=configs, key=["M", "N", "K"])
    @triton.jit
    def kernel(x_ptr, w_ptr, out_ptr, M, N, K, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):  # fmt: skip
        pid = tl.program_id(0)
        grid_m, grid_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
        group = pid // (GROUP_M * grid_n)
        first_m = group * GROUP_M
        size_m = min(grid_m - first_m, GROUP_M)
        pid_m = first_m + (pid % (GROUP_M * grid_n)) % size_m
        pid_n = (pid % (GROUP_M * grid_n)) // size_m
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        ks = tl.arange(0, BLOCK_K)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in range(0, K, BLOCK_K):
            a = tl.load(x_ptr + rows[:, None] * K + (k + ks)[None, :], mask=rows[:, None] < M, other=0.0)
            b = tl.load(w_ptr + cols[:, None] * K + (k + ks)[None, :], mask=cols[:, None] < N, other=0.0)
            acc = tl.dot(a, tl.trans(b), acc)
        tl.store(out_ptr + rows[:, None] * N + cols[None, :], acc.to(tl.bfloat16), mask=(rows[:, None] < M) & (cols[None, :] < N))

    def linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        m, k = x.shape
        n = w.shape[0]
        out = torch.empty(m, n, device=x.device, dtype=x.dtype)
        kernel[lambda meta: (triton.cdiv(m, meta["BLOCK_M"]) * triton.cdiv(n, meta["BLOCK_N"]),)](x, w, out, m, n, k)
        return out

    return linear


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="256,512")
    parser.add_argument("--copies", type=int, default=8)
    parser.add_argument("--json", type=Path)
    opts = parser.parse_args(argv)
    dev, dt = "cuda", torch.bfloat16
    tri = triton_linear()
    rows_out = []
    for name, n, k in SHAPES:
        weights = [torch.randn(n, k, device=dev, dtype=dt) * 0.02 for _ in range(opts.copies if name != "lm_head" else 2)]
        for m in (int(r) for r in opts.rows.split(",")):
            x = torch.randn(m, k, device=dev, dtype=dt)
            flops = 2 * m * n * k
            row = {"gemm": name, "M": m, "N": n, "K": k}

            def chain(fn, x=x, weights=weights):
                return lambda: [fn(x, w) for w in weights]

            row["cublas_us"] = replay_us(chain(torch.nn.functional.linear), reps=1) / len(weights)
            err = (tri(x, weights[0]).float() - torch.nn.functional.linear(x, weights[0]).float()).abs().max().item()
            row["triton_us"] = replay_us(chain(tri), reps=1) / len(weights)
            row["triton_max_abs_diff"] = err
            torch.cuda.tunable.enable(True)
            torch.cuda.tunable.tuning_enable(True)
            torch.cuda.tunable.set_max_tuning_iterations(30)
            torch.nn.functional.linear(x, weights[0])  # NOTE: tunes this shape (outside capture)
            torch.cuda.synchronize()
            torch.cuda.tunable.tuning_enable(False)
            row["tunableop_us"] = replay_us(chain(torch.nn.functional.linear), reps=1) / len(weights)
            torch.cuda.tunable.enable(False)
            for key in ("cublas", "triton", "tunableop"):
                row[f"{key}_tflops"] = flops / row[f"{key}_us"] / 1e6
            print(json.dumps(row), flush=True)
            rows_out.append(row)
        weights = None
        torch.cuda.empty_cache()
    if opts.json:
        write_result(opts.json, rows_out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
