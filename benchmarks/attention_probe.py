"""Decode attention at small batches: flashinfer's paged decode on tensor cores (its prefill
kernels, what flotilla picks for GQA groups >= 4, plus its merge kernel) against the Triton
split-KV kernel (``kernels/triton_decode_attention.py``, what the flashinfer planner runs for
decode batches of at most ``MAX_BATCH``), for the Llama-3.1-8B (32 query heads, 8 KV heads)
and Qwen3-30B-A3B (32/4) head layouts, head dim 128, bf16, 16-token pages, timed as CUDA-graph
replays of 20 back-to-back calls.

    python benchmarks/attention_probe.py [--json OUT] [--batches 1,2,4,8,16] [--kv-lens 256,640,2048,8192] [--sweep]
        [--merge-group N] [--kv-dtype float8_e4m3fn]

``--kv-dtype float8_e4m3fn`` times a float8 cache (both kernels widen it to bf16 as they load);
each row also has the KV bytes one call reads over flashinfer's time (``flashinfer_tb_s``).

``--sweep`` also times the Triton kernel over launch configurations
(``programs/BLOCK_N/min chunk/stages``, see ``TritonDecode``'s tuning arguments). The Triton
kernel is timed with its merge folded into the split kernel (the default: two levels, groups
of ``MERGE_GROUP`` splits then the groups), with the fold in one level (``merge_group`` of
``MAX_SPLITS``: one program merges all of a KV head's splits, which long contexts feel) and with
the separate merge launch (``fold_merge=False``). ``--merge-group`` times the default fold
with another group size (a power of two; ``TritonDecode``'s ``merge_group``).

Back-to-back calls of one kernel overlap a little more under programmatic dependent launch
than the same kernel between a decode step's projections; the end-to-end side by side is
``flotilla bench latency`` with and without ``FLOTILLA_TRITON_DECODE=0`` (docs/benchmarks.md).
Before the Triton kernel existed this probe also timed flashinfer's CUDA-core decode kernel
(0.5 us faster than tensor cores at batch 1, slower from batch 4; results/h200-issue8/attention-probe-cuda-cores.json).
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch
from flotilla.deploy.bench_env import write_result
from graph_timing import replay_us  # benchmarks/graph_timing.py (run as a script from here)

LAYOUTS = {"llama-3.1-8b": (32, 8), "qwen3-30b-a3b": (32, 4)}
HEAD_DIM, PAGE = 128, 16


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path)
    parser.add_argument("--batches", default="1,2,4,8,16")
    parser.add_argument("--kv-lens", default="256,640,2048,8192")
    parser.add_argument("--sweep", action="store_true", help="time the Triton kernel's launch configurations too")
    parser.add_argument("--merge-group", type=int, default=None, help="splits per group of the folded merge")
    parser.add_argument("--kv-dtype", choices=("bfloat16", "float8_e4m3fn"), default="bfloat16")
    opts = parser.parse_args(argv)
    kv_dtype = getattr(torch, opts.kv_dtype)
    import flashinfer

    from flotilla.kernels.triton_decode_attention import TritonDecode

    workspace = torch.zeros(256 << 20, dtype=torch.uint8, device="cuda")
    results = []
    for layout, (heads, kv_heads) in LAYOUTS.items():
        for batch in (int(b) for b in opts.batches.split(",")):
            for kv_len in (int(n) for n in opts.kv_lens.split(",")):
                row = {"layout": layout, "batch": batch, "kv_len": kv_len, "kv_dtype": opts.kv_dtype,
                       **_probe(flashinfer, TritonDecode, workspace, heads, kv_heads, batch, kv_len, opts.sweep,
                                 opts.merge_group, kv_dtype)}  # fmt: skip
                kv_bytes = 2 * batch * kv_len * kv_heads * HEAD_DIM * kv_dtype.itemsize
                row["flashinfer_tb_s"] = kv_bytes / row["flashinfer_us"] / 1e6
                print(f"{layout:14} batch {batch:3} kv {kv_len:5}: flashinfer {row['flashinfer_us']:7.2f} us, "
                      f"triton {row['triton_us']:7.2f} us ({row['flashinfer_us'] / row['triton_us']:.2f}x, "
                      f"max diff {row['max_diff']:.1e}), one-level fold {row['triton_one_level_us']:7.2f} us, "
                      f"with the merge launch {row['triton_merge_launch_us']:7.2f} us (diff {row['fold_max_diff']:.1e}), "
                      f"flashinfer reads {row['flashinfer_tb_s']:.2f} TB/s of KV",
                      flush=True)  # fmt: skip
                if opts.sweep:
                    best = min(row["sweep_us"], key=row["sweep_us"].get)
                    print(f"    best config {best}: {row['sweep_us'][best]:.2f} us", flush=True)
                results.append(row)
    if opts.json:
        write_result(opts.json, results)
    return 0


SWEEP = [
    dict(target_programs=programs, block_n=block_n, min_chunk=min_chunk, num_stages=stages)
    for programs in (256, 512, 1024)
    for block_n in (32, 64)
    for min_chunk in (32, 64)
    for stages in (2,)
]


def _label(config: dict[str, int]) -> str:
    return "{target_programs}/{block_n}/c{min_chunk}/s{num_stages}".format(**config)


def _probe(flashinfer, TritonDecode, workspace, heads, kv_heads, batch, kv_len, sweep=False, merge_group=None,
           kv_dtype=torch.bfloat16) -> dict:
    from flotilla.kernels.triton_decode_attention import MAX_SPLITS, MERGE_GROUP

    pages = (kv_len + PAGE - 1) // PAGE
    num_pages = batch * pages
    k_cache = torch.randn(num_pages, PAGE, kv_heads, HEAD_DIM, device="cuda").to(kv_dtype)
    v_cache = torch.randn(num_pages, PAGE, kv_heads, HEAD_DIM, device="cuda").to(kv_dtype)
    q = torch.randn(batch, heads, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    # NOTE: pages in a shuffled order, as a long-running pool hands them out.
    indices_cpu = torch.randperm(num_pages, dtype=torch.int32)
    indptr_cpu = torch.arange(0, num_pages + 1, pages, dtype=torch.int32)
    last_cpu = torch.full((batch,), kv_len - (pages - 1) * PAGE, dtype=torch.int32)
    indptr, indices, last = (t.cuda() for t in (indptr_cpu, indices_cpu, last_cpu))
    wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
        workspace, "NHD", use_cuda_graph=True, use_tensor_cores=True, backend="fa2",
        paged_kv_indptr_buffer=indptr.clone(), paged_kv_indices_buffer=indices.clone(),
        paged_kv_last_page_len_buffer=last.clone(),
    )  # fmt: skip
    wrapper.plan(indptr, indices, last, heads, kv_heads, HEAD_DIM, PAGE,
                 q_data_type=torch.bfloat16, kv_data_type=kv_dtype)  # fmt: skip
    expected = wrapper.run(q, (k_cache, v_cache))

    def triton(**config):
        decode = TritonDecode(heads, kv_heads, HEAD_DIM, page_size=PAGE, scale=1 / math.sqrt(HEAD_DIM), sliding_window=None,
                              max_batch=batch, max_num_pages=num_pages, device="cuda", **config)  # fmt: skip
        decode.plan(indptr_cpu, indices_cpu, last_cpu)
        return decode

    default = triton(merge_group=merge_group or MERGE_GROUP)
    one_level = triton(merge_group=MAX_SPLITS)
    merge_launch = triton(fold_merge=False)
    got = default.run(q, (k_cache, v_cache))
    row = {
        "flashinfer_us": replay_us(lambda: wrapper.run(q, (k_cache, v_cache))),
        "triton_us": replay_us(lambda: default.run(q, (k_cache, v_cache))),
        "triton_one_level_us": replay_us(lambda: one_level.run(q, (k_cache, v_cache))),
        "triton_merge_launch_us": replay_us(lambda: merge_launch.run(q, (k_cache, v_cache))),
        "max_diff": (got.float() - expected.float()).abs().max().item(),
        "fold_max_diff": (got.float() - merge_launch.run(q, (k_cache, v_cache)).float()).abs().max().item(),
    }
    if sweep:
        row["sweep_us"] = {}
        for config in SWEEP:
            decode = triton(**config)
            diff = (decode.run(q, (k_cache, v_cache)).float() - expected.float()).abs().max().item()
            assert diff < 0.05, f"config {_label(config)} is off by {diff}"
            row["sweep_us"][_label(config)] = replay_us(lambda d=decode: d.run(q, (k_cache, v_cache)))
    return row


if __name__ == "__main__":
    sys.exit(main())
