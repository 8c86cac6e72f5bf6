"""Where a large batch's GPU time goes, prefill and decode apart: build a bundled model shape with
random weights, queue ``--num-prompts`` prompts of ``--input-len`` tokens, profile the engine
steps up to every request's first token (the prefill phase: chunked prefill, with the decode
rows that ride along), then ``--decode-steps`` decode-only steps, and print each phase's wall
time and kernel time by family (the families of ``decode_profile.py``).

    python benchmarks/dev/phase_profile.py --shape llama-3.1-8b --num-prompts 64 --input-len 1000
        [--decode-steps 8] [--cprofile-steps N] [--json OUT] [any server flag as --name value]

Each phase also reports its GEMM throughput (2 x the model's projection parameters x the
phase's tokens, over the GEMM family's kernel time; the prefill phase counts its prompt
tokens only, not the decode rows riding along, so its figure is a lower bound) beside torch's
own ``F.linear`` on the same weight shapes at ``--reference-m`` rows, timed in the same
process, and the time the device sat idle within the phase (waiting on the host).
``--cprofile-steps N`` then runs N more decode steps under cProfile, without the torch
profiler, and lists the host functions by own time. This is the measurement behind the
offline workload's device-bound reading in docs/gpu.md ("Where the targets stand").

Needs a CUDA GPU and the GPU wheels (docs/gpu.md); the numbers are for reading, not for CI.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

from flotilla.deploy.bench_env import write_result

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode_profile import _server_flags, family_of  # noqa: E402
from step_timeline import busy_time, device_events  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", required=True, help="a bundled model shape (random weights)")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=1000)
    parser.add_argument("--decode-steps", type=int, default=8)
    parser.add_argument("--reference-m", type=int, default=8192, help="rows of the F.linear reference GEMMs")
    parser.add_argument("--cprofile-steps", type=int, default=0,
                        help="after the profiled phases, this many more decode steps under cProfile (host time by function)")
    parser.add_argument("--json", type=Path)
    opts, rest = parser.parse_known_args(argv)
    return _run(opts, _server_flags(rest))


def _run(opts: argparse.Namespace, flags: dict[str, object]) -> int:
    from flotilla.cluster.engine.llm import LLM
    from flotilla.cluster.engine.sampling_params import SamplingParams
    from flotilla.deploy.bench import shape_config

    with tempfile.TemporaryDirectory(prefix="flotilla-phase-") as tmp:
        (Path(tmp) / "config.json").write_text(json.dumps(shape_config(opts.shape)))
        llm = LLM(tmp, load_format="dummy", skip_tokenizer_init=True, dtype=flags.pop("dtype", "bfloat16"), **flags)
    engine = llm.engine
    shapes = _projection_shapes(engine.runner.model)
    params_per_token = sum(n * k for n, k in shapes)
    warm = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    llm.generate([{"prompt_token_ids": list(range(1, 65))}] * 4, warm)

    prompts = [[1 + (i * 7919 + j) % 30000 for j in range(opts.input_len)] for i in range(opts.num_prompts)]
    # NOTE: long enough that no request finishes inside the phases (the first ones to prefill
    # decode while later ones still do); every request is aborted after the decode phase.
    params = SamplingParams(temperature=0, max_tokens=1 << 20, ignore_eos=True)
    ids = [engine.add_request(p, params) for p in prompts]
    first = set()

    def prefill_done(deltas) -> bool:
        first.update(d.request_id for d in deltas)
        return first.issuperset(ids)

    report = {"shape": opts.shape, "num_prompts": opts.num_prompts, "input_len": opts.input_len, "phases": {}}
    prefill = _profile_phase(engine, prefill_done, tokens=opts.num_prompts * opts.input_len)
    report["phases"]["prefill"] = prefill
    counter = {"n": 0}

    def decoded(_deltas) -> bool:
        counter["n"] += 1
        return counter["n"] >= opts.decode_steps

    context_before = sum(request.num_tokens for request in engine.scheduler.running)
    decode = _profile_phase(engine, decoded, tokens=opts.num_prompts * opts.decode_steps)
    report["phases"]["decode"] = decode
    kv_bytes = _kv_bytes_per_token(shape_config(opts.shape), engine.runner)
    # Context read per decode step: the running requests' tokens, averaged over the phase.
    context = (context_before + sum(request.num_tokens for request in engine.scheduler.running)) / 2
    attention_s = decode["families_ms"].get("attention", 0.0) / 1e3
    decode["kv_bytes_per_step"] = context * kv_bytes
    decode["attention_tb_s"] = context * kv_bytes * opts.decode_steps / attention_s / 1e12 if attention_s else None
    if opts.cprofile_steps:
        report["host_profile"] = _host_profile(engine, opts.cprofile_steps)
    for request_id in ids:
        engine.abort(request_id)
    while engine.has_unfinished_requests():
        engine.step()
    for request_id in ids:
        engine.pop_output(request_id)

    reference = _reference_gemm_tflops(shapes, opts.reference_m, engine.runner.device)
    report["projection_params"] = params_per_token
    report["reference_linear_tflops"] = reference
    for name, phase in report["phases"].items():
        gemm_s = phase["families_ms"].get("gemm", 0.0) / 1e3
        phase["gemm_tflops"] = 2 * params_per_token * phase["tokens"] / gemm_s / 1e12 if gemm_s else None
        if "attention_tb_s" in phase:
            print(f"{name}: attention reads ~{phase['kv_bytes_per_step'] / 1e9:.1f} GB of KV a step, "
                  f"~{phase['attention_tb_s'] or 0:.2f} TB/s (context: the running requests' tokens, mean over the phase)")
        print(f"{name}: {phase['steps']} steps, wall {phase['wall_s']:.3f} s, kernels {phase['kernel_ms'] / 1e3:.3f} s, "
              f"device idle {phase['device_idle_s']:.3f} s of its {phase['device_span_s']:.3f} s span, "
              f"{phase['tokens']} tokens, GEMM {phase['gemm_tflops'] or 0:.0f} TFLOPS")  # fmt: skip
        for family, ms in sorted(phase["families_ms"].items(), key=lambda item: -item[1]):
            print(f"  {family:<20} {ms / 1e3:8.3f} s  {100 * ms / max(phase['kernel_ms'], 1e-9):5.1f}%")
        print("  top kernels:")
        for kernel in phase["kernels"][:12]:
            print(f"    {kernel['total_us'] / 1e3:9.1f} ms  x{kernel['count']:<6} {kernel['family']:<10} {kernel['name'][:100]}")
    if "host_profile" in report:
        host = report["host_profile"]
        print(f"host: {host['steps']} decode steps (no torch profiler) in {host['wall_s']:.3f} s; functions by own time:")
        for row in host["functions"][:25]:
            print(f"  {row['tottime_s']:8.3f} s own {row['cumtime_s']:8.3f} s cum  x{row['calls']:<7} {row['function']}")
    print(f"F.linear at M={opts.reference_m}: " + ", ".join(f"{k} {v:.0f}" for k, v in reference.items()) + " TFLOPS")
    if opts.json:
        write_result(opts.json, report)
    llm.shutdown()
    return 0


def _profile_phase(engine, done, tokens: int) -> dict:
    """Step ``engine`` under the profiler until ``done(deltas)``; wall time, kernels by family."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    steps = 0
    torch.cuda.synchronize()
    start = time.perf_counter()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        while True:
            steps += 1
            if done(engine.step()):
                break
        torch.cuda.synchronize()
    wall = time.perf_counter() - start
    with tempfile.TemporaryDirectory(prefix="flotilla-phase-trace-") as tmp:
        trace_path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(trace_path))
        events = device_events(json.loads(trace_path.read_text()))
    span, idle = device_idle(events)
    kernels = [
        {"name": e.key, "count": e.count, "total_us": e.device_time_total, "family": family_of(e.key)}
        for e in prof.key_averages()
        if e.device_time_total > 0 and e.count > 0
    ]
    kernels.sort(key=lambda k: -k["total_us"])
    families: dict[str, float] = defaultdict(float)
    for kernel in kernels:
        families[kernel["family"]] += kernel["total_us"] / 1e3
    return {"steps": steps, "wall_s": wall, "tokens": tokens, "kernel_ms": sum(families.values()),
            "device_span_s": span, "device_idle_s": idle,
            "families_ms": dict(families), "kernels": kernels}  # fmt: skip


def device_idle(events: list[dict]) -> tuple[float, float]:
    """(span, idle) in seconds over ``events`` sorted by start (as ``device_events`` gives
    them): the first operation's start to the last one's end, and the part of that no kernel,
    copy or memset covered (the device waiting on the host)."""
    if not events:
        return 0.0, 0.0
    busy, end = busy_time(events)
    span = end - events[0]["start"]
    return span / 1e6, (span - busy) / 1e6


def _host_profile(engine, steps: int) -> dict:
    """``steps`` more engine steps under cProfile: wall time and the host functions by own time
    (a step's wait for the device shows up in the synchronising call)."""
    import cProfile
    import pstats

    import torch

    torch.cuda.synchronize()
    profiler = cProfile.Profile()
    start = time.perf_counter()
    profiler.enable()
    for _ in range(steps):
        engine.step()
    torch.cuda.synchronize()
    profiler.disable()
    wall = time.perf_counter() - start
    stats = pstats.Stats(profiler)
    rows = []
    for (filename, line, name), (_cc, calls, tottime, cumtime, _callers) in stats.stats.items():
        rows.append({"function": f"{Path(filename).name}:{line}:{name}", "calls": calls, "tottime_s": tottime, "cumtime_s": cumtime})
    rows.sort(key=lambda r: -r["tottime_s"])
    return {"steps": steps, "wall_s": wall, "functions": rows[:60]}


def _kv_bytes_per_token(config: dict, runner) -> int:
    """Bytes of K and V one token holds across all layers (the runner's KV dtype)."""
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads", config["num_attention_heads"])
    import torch

    itemsize = getattr(torch, runner.startup_report()["kv_cache_dtype"]).itemsize
    return 2 * config["num_hidden_layers"] * kv_heads * head_dim * itemsize


def _projection_shapes(model) -> list[tuple[int, int]]:
    """(out, in) of every 2-D projection weight a token passes through (embedding and LM head
    left out: the head runs on sampled rows only). Dense models only: an MoE model's experts
    are 3-D weights a token meets k of, not counted here, so its GEMM TFLOPS means nothing."""
    return [
        tuple(p.shape)
        for name, p in model.named_parameters()
        if p.dim() == 2 and "embed" not in name and "lm_head" not in name
    ]


def _reference_gemm_tflops(shapes: list[tuple[int, int]], m: int, device) -> dict[str, float]:
    """torch ``F.linear`` TFLOPS for each distinct weight shape at ``m`` rows (bf16, CUDA events)."""
    import torch
    import torch.nn.functional as F

    out = {}
    for n, k in sorted(set(shapes)):
        x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
        w = torch.randn(n, k, device=device, dtype=torch.bfloat16)
        for _ in range(3):
            F.linear(x, w)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(10):
            F.linear(x, w)
        end.record()
        torch.cuda.synchronize()
        out[f"{n}x{k}"] = 2 * m * n * k * 10 / (start.elapsed_time(end) / 1e3) / 1e12
    return out


if __name__ == "__main__":
    sys.exit(main())
