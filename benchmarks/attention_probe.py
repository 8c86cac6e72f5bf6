"""Decode attention at small batches: flashinfer's paged decode on tensor cores (its prefill
kernels, what flotilla picks for GQA groups >= 4) against its CUDA-core decode kernel, for
the Llama-3.1-8B head layout (32 query heads, 8 KV heads, head dim 128, bf16, 16-token
pages), timed as CUDA-graph replays of 20 back-to-back calls.

    python benchmarks/attention_probe.py [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from graph_timing import replay_us  # benchmarks/graph_timing.py (run as a script from here)

HEADS, KV_HEADS, HEAD_DIM, PAGE = 32, 8, 128, 16


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path)
    opts = parser.parse_args(argv)
    import flashinfer

    workspace = torch.zeros(256 << 20, dtype=torch.uint8, device="cuda")
    results = []
    for batch in (1, 4, 16, 64):
        for kv_len in (256, 640, 2048):
            pages = (kv_len + PAGE - 1) // PAGE
            num_pages = batch * pages
            k_cache = torch.randn(num_pages, PAGE, KV_HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
            v_cache = torch.randn_like(k_cache)
            q = torch.randn(batch, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
            indptr = torch.arange(0, num_pages + 1, pages, dtype=torch.int32, device="cuda")
            indices = torch.arange(num_pages, dtype=torch.int32, device="cuda")
            last = torch.full((batch,), kv_len - (pages - 1) * PAGE, dtype=torch.int32, device="cuda")
            row = {"batch": batch, "kv_len": kv_len}
            outs = {}
            for tensor_cores in (True, False):
                wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                    workspace, "NHD", use_cuda_graph=True, use_tensor_cores=tensor_cores, backend="fa2",
                    paged_kv_indptr_buffer=indptr.clone(), paged_kv_indices_buffer=indices.clone(),
                    paged_kv_last_page_len_buffer=last.clone(),
                )  # fmt: skip
                wrapper.plan(indptr, indices, last, HEADS, KV_HEADS, HEAD_DIM, PAGE,
                             q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16)  # fmt: skip
                outs[tensor_cores] = wrapper.run(q, (k_cache, v_cache))
                key = "tensor_cores_us" if tensor_cores else "cuda_cores_us"
                row[key] = replay_us(lambda w=wrapper: w.run(q, (k_cache, v_cache)))
            row["max_diff"] = (outs[True].float() - outs[False].float()).abs().max().item()
            print(f"batch {batch:3} kv {kv_len:5}: tensor cores {row['tensor_cores_us']:7.2f} us, "
                  f"CUDA cores {row['cuda_cores_us']:7.2f} us (max diff {row['max_diff']:.1e})")  # fmt: skip
            results.append(row)
    if opts.json:
        opts.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
