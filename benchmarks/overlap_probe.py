"""Can a decode step's memory-bound attention run under its compute-bound GEMMs? For the
Llama-3.1-8B shape at a large decode batch, split in two halves A and B: time A's paged
decode attention over ``--layers`` layers alone, B's projection GEMMs alone, the two one
after the other on one stream, and the two on two streams with no dependency between them
(the most a two-micro-batch schedule could overlap). Also times a plain read of a large
buffer, the bandwidth a memory-bound kernel could reach, beside the device-to-device copy.

With ``--green-sms N,M,...`` it also splits the SMs with CUDA green contexts: N SMs for the
attention's stream, the rest for the GEMMs', and times each alone on its share, the two halves
concurrently, and a two-micro-batch pipeline over the layers (A's attention of layer l beside
B's GEMMs, with each micro-batch's layers in order), eagerly and replayed from a CUDA graph,
against the whole batch's attention and GEMMs one after the other on the whole device.

    python benchmarks/overlap_probe.py [--half-batch 256] [--context 1500] [--layers 8] [--green-sms 66] [--json OUT]

Each layer has its own KV cache and weights (nothing stays in L2 between layers).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch
from flotilla.deploy.bench_env import write_result
from graph_timing import events_ms  # benchmarks/graph_timing.py (run as a script from here)

HEADS, KV_HEADS, HEAD_DIM, HIDDEN, INTERMEDIATE, PAGE = 32, 8, 128, 4096, 14336, 16
# (out_features, in_features) of one Llama-3.1-8B layer's projections (qkv and gate_up fused).
PROJECTIONS = ((6144, HIDDEN), (HIDDEN, HIDDEN), (2 * INTERMEDIATE, HIDDEN), (HIDDEN, INTERMEDIATE))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--half-batch", type=int, default=256)
    parser.add_argument("--context", type=int, default=1500)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--green-sms", default="", help="comma-separated SM counts for the attention's green context (0: plain streams)")
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
    if opts.green_sms:
        row["green"] = green_context_rows(opts, caches, weights, workspace, decode, q, x, mid)
    print(json.dumps(row, indent=1), flush=True)
    if opts.json:
        write_result(opts.json, row)
    return 0


def green_context_rows(opts, caches, weights, workspace, half_decode, q, x, mid) -> list[dict]:
    """The SM-partitioned schedules, one row per attention share in ``opts.green_sms``."""
    import flashinfer

    dev, dt = "cuda", torch.bfloat16
    batch = opts.half_batch
    pages_per_seq = math.ceil(opts.context / PAGE)
    num_pages = batch * pages_per_seq
    as_int = dict(dtype=torch.int32, device=dev)
    # The whole batch: 2 x half_batch sequences reading the half batch's pages twice over
    # (12 GB a pass does not stay in a 60 MB L2, so the second reader pays the bytes again).
    full = flashinfer.BatchDecodeWithPagedKVCacheWrapper(torch.zeros_like(workspace), "NHD", use_tensor_cores=True, backend="fa2")
    pages = torch.randperm(num_pages, device=dev).to(torch.int32)
    full.plan(torch.arange(0, 2 * num_pages + 1, pages_per_seq, **as_int), torch.cat([pages, pages.flip(0)]),
              torch.full((2 * batch,), opts.context - (pages_per_seq - 1) * PAGE, **as_int), HEADS, KV_HEADS, HEAD_DIM, PAGE,
              q_data_type=dt, kv_data_type=dt)  # fmt: skip
    q_full, x_full, mid_full = torch.cat([q, q]), torch.cat([x, x]), torch.cat([mid, mid])

    def layer_gemms(layer, rows, inner):
        qkv, o, gate_up, down = weights[layer]
        torch.nn.functional.linear(rows, qkv)
        torch.nn.functional.linear(rows, o)
        torch.nn.functional.linear(rows, gate_up)
        torch.nn.functional.linear(inner, down)

    def whole_batch():
        for layer, kv in enumerate(caches):
            full.run(q_full, kv)
            layer_gemms(layer, x_full, mid_full)

    baseline_ms = events_ms(whole_batch, reps=5)
    total_sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows = []
    for attention_sms in (int(n) for n in opts.green_sms.split(",")):
        row = {"attention_sms": attention_sms, "gemm_sms": total_sms - attention_sms, "whole_batch_sequential_ms": baseline_ms}
        try:
            row.update(_partitioned(attention_sms, total_sms - attention_sms, caches, layer_gemms, half_decode, q, x, mid))
            row["pipeline_over_sequential"] = row["pipeline_ms"] / baseline_ms
            row["pipeline_graph_over_sequential"] = row["pipeline_graph_ms"] / baseline_ms
        except Exception as exc:  # a share the driver refuses, or capture across contexts
            row["error"] = f"{type(exc).__name__}: {exc}"
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def _partitioned(attention_sms, gemm_sms, caches, layer_gemms, decode, q, x, mid) -> dict:
    from torch.cuda.green_contexts import GreenContext

    if attention_sms == 0:  # the control: two plain streams sharing every SM
        attention_stream, gemm_stream = torch.cuda.Stream(), torch.cuda.Stream()
    else:
        # NOTE: a green context is destroyed with its Python object, streams and all, so both
        # stay referenced until the timings below are done.
        shares = (GreenContext.create(num_sms=attention_sms), GreenContext.create(num_sms=gemm_sms))
        attention_stream, gemm_stream = shares[0].Stream(), shares[1].Stream()

    def on(stream, fn):
        origin = torch.cuda.current_stream()
        stream.wait_stream(origin)
        with torch.cuda.stream(stream):
            fn()
        origin.wait_stream(stream)

    def attention():
        for kv in caches:
            decode.run(q, kv)

    def gemms():
        for layer in range(len(caches)):
            layer_gemms(layer, x, mid)

    def concurrent():
        origin = torch.cuda.current_stream()
        attention_stream.wait_stream(origin)
        gemm_stream.wait_stream(origin)
        with torch.cuda.stream(gemm_stream):
            gemms()
        with torch.cuda.stream(attention_stream):
            attention()
        origin.wait_stream(gemm_stream)
        origin.wait_stream(attention_stream)

    def pipeline():
        # Each micro-batch runs gemms(l) -> attention(l) -> gemms(l + 1) ...; issuing A then B
        # per layer lets the GEMM stream run B's layer l while the attention stream runs A's.
        origin = torch.cuda.current_stream()  # the capture stream while capturing
        attention_stream.wait_stream(origin)
        gemm_stream.wait_stream(origin)
        done_attention = {}
        for layer, kv in enumerate(caches):
            for micro in "AB":
                if micro in done_attention:
                    gemm_stream.wait_event(done_attention[micro])
                with torch.cuda.stream(gemm_stream):
                    layer_gemms(layer, x, mid)
                gemms_done = gemm_stream.record_event()
                attention_stream.wait_event(gemms_done)
                with torch.cuda.stream(attention_stream):
                    decode.run(q, kv)
                done_attention[micro] = attention_stream.record_event()
        origin.wait_stream(gemm_stream)
        origin.wait_stream(attention_stream)

    result = {
        "attention_alone_ms": events_ms(lambda: on(attention_stream, attention), reps=5),
        "gemm_alone_ms": events_ms(lambda: on(gemm_stream, gemms), reps=5),
        "concurrent_ms": events_ms(concurrent, reps=5),
        "pipeline_ms": events_ms(pipeline, reps=5),
    }
    capture = torch.cuda.Stream()
    capture.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(capture):
        pipeline()  # NOTE: warm-up on the capture stream before capturing
        torch.cuda.synchronize()
        with torch.cuda.graph(graph, stream=capture):
            pipeline()
    result["pipeline_graph_ms"] = events_ms(graph.replay, reps=5)
    torch.cuda.synchronize()
    del graph
    return result


if __name__ == "__main__":
    sys.exit(main())
