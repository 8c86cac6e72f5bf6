"""Can a decode step's memory-bound attention run under its compute-bound GEMMs? For the
Llama-3.1-8B shape at a large decode batch, split in two halves A and B: time A's paged
decode attention over ``--layers`` layers alone, B's projection GEMMs alone, the two one
after the other on one stream, and the two on two streams with no dependency between them
(the most a two-micro-batch schedule could overlap). Also times a plain read of a large
buffer, the bandwidth a memory-bound kernel could reach, beside the device-to-device copy.

    python benchmarks/overlap_probe.py [--half-batch 256] [--context 1500] [--layers 8] [--json OUT]

Each layer has its own KV cache and weights (nothing stays in L2 between layers).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch
from graph_timing import events_ms  # benchmarks/graph_timing.py (run as a script from here)

HEADS, KV_HEADS, HEAD_DIM, HIDDEN, INTERMEDIATE, PAGE = 32, 8, 128, 4096, 14336, 16
# (out_features, in_features) of one Llama-3.1-8B layer's projections (qkv and gate_up fused).
PROJECTIONS = ((6144, HIDDEN), (HIDDEN, HIDDEN), (2 * INTERMEDIATE, HIDDEN), (HIDDEN, INTERMEDIATE))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--half-batch", type=int, default=256)
    parser.add_argument("--context", type=int, default=1500)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--json", type=Path)
    opts = parser.parse_args(argv)
    import flashinfer

    dev, dt = "cuda", torch.bfloat16
    batch, layers = opts.half_batch, opts.layers
    pages_per_seq = math.ceil(opts.context / PAGE)
    num_pages = batch * pages_per_seq
    caches = [
        (torch.randn(num_pages, PAGE, KV_HEADS, HEAD_DIM, device=dev, dtype=dt),
         torch.randn(num_pages, PAGE, KV_HEADS, HEAD_DIM, device=dev, dtype=dt))
        for _ in range(layers)
    ]  # fmt: skip
    weights = [[torch.randn(n, k, device=dev, dtype=dt) * 0.02 for n, k in PROJECTIONS] for _ in range(layers)]
    workspace = torch.zeros(256 << 20, dtype=torch.uint8, device=dev)
    decode = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD", use_tensor_cores=True, backend="fa2")
    as_int = dict(dtype=torch.int32, device=dev)
    decode.plan(torch.arange(0, num_pages + 1, pages_per_seq, **as_int), torch.randperm(num_pages, device=dev).to(torch.int32),
                torch.full((batch,), opts.context - (pages_per_seq - 1) * PAGE, **as_int), HEADS, KV_HEADS, HEAD_DIM, PAGE,
                q_data_type=dt, kv_data_type=dt)  # fmt: skip
    q = torch.randn(batch, HEADS, HEAD_DIM, device=dev, dtype=dt)
    x = torch.randn(batch, HIDDEN, device=dev, dtype=dt)
    mid = torch.randn(batch, INTERMEDIATE, device=dev, dtype=dt)

    def attention():
        for kv in caches:
            decode.run(q, kv)

    def gemms():
        for qkv, o, gate_up, down in weights:
            torch.nn.functional.linear(x, qkv)
            torch.nn.functional.linear(x, o)
            torch.nn.functional.linear(x, gate_up)
            torch.nn.functional.linear(mid, down)

    side = torch.cuda.Stream()

    def sequential():
        attention()
        gemms()

    def concurrent():
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            gemms()
        attention()
        torch.cuda.current_stream().wait_stream(side)

    big = torch.empty(4 << 30, dtype=torch.uint8, device=dev)
    read_ms = events_ms(lambda: big.view(torch.int64).sum(), reps=5)
    copy_dst = torch.empty_like(big)
    copy_ms = events_ms(lambda: copy_dst.copy_(big), reps=5)
    kv_bytes = 2 * batch * opts.context * KV_HEADS * HEAD_DIM * 2 * layers
    flops = 2 * batch * sum(n * k for n, k in PROJECTIONS) * layers
    row = {
        "half_batch": batch, "context": opts.context, "layers": layers,
        "attention_ms": events_ms(attention, reps=5), "gemm_ms": events_ms(gemms, reps=5),
        "sequential_ms": events_ms(sequential, reps=5), "concurrent_ms": events_ms(concurrent, reps=5),
        "read_tb_s": big.numel() / read_ms / 1e9, "copy_tb_s": 2 * big.numel() / copy_ms / 1e9,
    }  # fmt: skip
    row["attention_tb_s"] = kv_bytes / row["attention_ms"] / 1e9
    row["gemm_tflops"] = flops / row["gemm_ms"] / 1e9
    row["concurrent_over_sequential"] = row["concurrent_ms"] / row["sequential_ms"]
    print(json.dumps(row, indent=1), flush=True)
    if opts.json:
        opts.json.write_text(json.dumps(row, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
