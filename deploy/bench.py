"""``flotilla bench latency`` and ``flotilla bench offline``: the in-process engine on a
token-id workload, with the memory roofline measured in the same run.

    flotilla bench latency (--shape NAME | --model DIR) [--batch-size 1] [--input-len 128]
                           [--output-len 128] [--num-iters 3] [--warmup-steps 8]
                           [--output-json OUT] [server flags]...
    flotilla bench offline (--shape NAME | --model DIR) [--num-prompts 32] [--input-len 128]
                           [--output-len 128] [--compare-hf] [--output-json OUT] [server flags]...

``--shape`` (llama-3.1-8b, qwen3-8b, qwen3-30b-a3b, deepseek-v2-lite) runs a model of that
published config.json with random weights (``--load-format dummy``: nothing is downloaded);
``--model DIR`` runs a local model (add ``--load-format dummy`` for random weights). Prompts are
random token ids (seeded), generation is greedy with ``ignore_eos``, so every request makes
exactly ``--output-len`` tokens; the tokenizer is never loaded.

latency: ``--batch-size`` prompts submitted together, ``--num-iters`` times after a warm-up
batch of ``--warmup-steps`` decode steps. TTFT is the time until the batch's last first token
(the prefill); time per output token (TPOT) is the wall time of a decode step (every sequence
adds one token); latency is submit to finish. Then the decode CUDA graph of the batch is replayed
alone (device time against the step's wall time), and the last iteration's steps are split into
host phases (schedule, prepare_inputs, plan, forward, sample, update).

offline: ``--num-prompts`` prompts submitted at once and run to completion: output and total
(input + output) tokens/s over the wall time; TTFT and TPOT percentiles per request.

Both report MBU (bytes of weights + KV a decode step reads / step time / peak bandwidth, see
:mod:`flotilla.deploy.bench_roofline`) against a device-to-device copy measured first in the
same run, the start-up times, the machine and the resolved configuration's key fields, print
a short summary and write everything to ``--output-json``.

With ``--speculative-algorithm`` (and the other ``--speculative-*`` server flags) the run
speculates; the results add its acceptance (drafted and accepted tokens, per round) and its
speedup: the same workload is run again right after without speculation, on the same runner.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Sequence

from flotilla.deploy.bench_env import write_result
from flotilla.resolution import ArgumentError, ResolutionError
from flotilla.resolution.args import _Parser, add_server_flags, reject_unknown, server_flag_names
from flotilla.resolution.fields import FIELDS

SHAPES_DIR = Path(__file__).resolve().parent / "bench_shapes"
BENCHMARKS = ("latency", "offline")
USAGE = (
    "usage: flotilla bench {latency,offline} [options] [server flags]\n"
    "  latency  one batch, TTFT and time per output token (run `flotilla bench latency --help`)\n"
    "  offline  many prompts at once, tokens/s (run `flotilla bench offline --help`)\n"
)
# Prompts in the warm-up batch of `bench offline` (its prefill and decode kernels warm up
# at any batch; the decode CUDA graphs were captured at start).
OFFLINE_WARMUP_PROMPTS = 8
# Resolved fields the JSON reports (the whole config is behind config_digest).
CONFIG_FIELDS = (
    "device", "dtype", "tp_size", "load_format", "attention_backend", "sampling_backend", "moe_runner_backend",
    "page_size", "kv_cache_dtype", "chunked_prefill_size", "max_prefill_tokens", "max_running_requests",
    "max_total_tokens", "mem_fraction_static", "context_length", "disable_cuda_graph", "cuda_graph_bs_decode",
    "cuda_graph_max_bs_decode", "disable_radix_cache",
)  # fmt: skip


def shape_names() -> list[str]:
    """The bundled ``--shape`` names (``deploy/bench_shapes/*.json``)."""
    return sorted(p.stem for p in SHAPES_DIR.glob("*.json"))


def shape_config(name: str) -> dict[str, Any]:
    """The config.json of a bundled shape; ValueError naming the known shapes."""
    path = SHAPES_DIR / f"{name}.json"
    if not path.is_file():
        raise ValueError(f"--shape {name!r} is not a bundled model shape; choose one of {', '.join(shape_names())}")
    return json.loads(path.read_text())


def build_parser(kind: str) -> argparse.ArgumentParser:
    """The option parser of ``flotilla bench KIND``: the benchmark's options and every server flag."""
    description = __doc__.split("\n\n")[3 if kind == "latency" else 4]
    parser = _Parser(prog=f"flotilla bench {kind}", add_help=False, description=description)
    own = parser.add_argument_group("benchmark options")
    own.add_argument("--help", "-h", action="help", help="show this help and exit")
    shapes = ", ".join(shape_names())
    own.add_argument("--shape", default=None, help=f"a bundled model shape with random weights: {shapes}")
    if kind == "latency":
        own.add_argument("--batch-size", type=int, default=1, help="prompts decoded together (default 1)")
        own.add_argument("--num-iters", type=int, default=3, help="measured iterations after the warm-up (default 3)")
    else:
        own.add_argument("--num-prompts", type=int, default=32, help="prompts in the workload (default 32)")
        own.add_argument("--compare-hf", action="store_true", help="also run HF generate (real weights only)")
        own.add_argument("--hf-sequential-prompts", type=int, default=None, help="HF batch-1 on the first N prompts")
    own.add_argument("--input-len", type=int, default=128, help="tokens per prompt (default 128)")
    own.add_argument("--output-len", type=int, default=128, help="tokens generated per prompt (default 128)")
    own.add_argument("--warmup-steps", type=int, default=8, help="decode steps of the warm-up batch (default 8; 0: none)")
    own.add_argument("--seed", type=int, default=0, help="seed of the random prompts (default 0)")
    own.add_argument("--bandwidth-bytes", type=int, default=None, help="buffer size of the copy-bandwidth probe")
    own.add_argument("--output-json", "--json", dest="output_json", metavar="OUT", help="write the results as JSON to OUT")
    add_server_flags(parser, FIELDS.values())
    return parser


def run_bench(argv: Sequence[str]) -> int:
    """Entry of ``flotilla bench``; returns the exit status."""
    argv = list(argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE, end="")
        return 0 if argv else 2
    kind = argv[0]
    if kind not in BENCHMARKS:
        print(f"flotilla bench: unknown benchmark {kind!r} (known: {', '.join(BENCHMARKS)})", file=sys.stderr)
        return 2
    parser = build_parser(kind)
    try:
        opts, unknown = parser.parse_known_args(argv[1:])
        reject_unknown(unknown, server_flag_names() + [o for a in parser._actions for o in a.option_strings])
        flags = _check_options(kind, opts)
        results = run(kind, opts, flags)
    except (ArgumentError, ResolutionError, ValueError) as exc:
        print(f"flotilla bench {kind}: error: {exc}", file=sys.stderr)
        return 2
    results["command"] = ["flotilla", "bench", *argv]
    print(format_summary(results))
    if opts.output_json:
        print(f"\nwrote {write_result(opts.output_json, results, sort_keys=True)}")
    return 0


def _check_options(kind: str, opts: argparse.Namespace) -> dict[str, Any]:
    """Validate the benchmark options; returns the server flags given."""
    positive = ["input_len", "output_len"] + (["batch_size", "num_iters"] if kind == "latency" else ["num_prompts"])
    for name in positive:
        if getattr(opts, name) < 1:
            raise ArgumentError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(opts, name)}")
    if opts.warmup_steps < 0:
        raise ArgumentError(f"--warmup-steps must be 0 or more, got {opts.warmup_steps}")
    flags = {k: v for k, v in vars(opts).items() if k in FIELDS}
    if opts.shape is not None:
        if "model_path" in flags:
            raise ArgumentError(
                f"give --shape or --model, not both (got --shape {opts.shape} --model {flags['model_path']})"
            )
        if flags.get("load_format", "dummy") != "dummy":
            raise ArgumentError(
                f"--shape runs random weights: --load-format must be dummy (got {flags['load_format']})"
            )
        shape_config(opts.shape)  # NOTE: an unknown shape fails before anything loads
    if kind == "offline" and opts.compare_hf and (opts.shape is not None or flags.get("load_format") == "dummy"):
        raise ArgumentError(
            "--compare-hf loads the model's checkpoint into HF transformers; with random weights "
            "(--shape or --load-format dummy) run benchmarks/hf_peer_bench.py for the HF side"
        )
    return flags


def run(kind: str, opts: argparse.Namespace, flags: dict[str, Any]) -> dict[str, Any]:
    """Build the engine, measure the copy bandwidth and the workload; returns the results."""
    with tempfile.TemporaryDirectory(prefix="flotilla-bench-") as tmp:
        if opts.shape is not None:
            # NOTE: the model directory holds only the published config.json; the weights are random.
            (Path(tmp) / "config.json").write_text(json.dumps(shape_config(opts.shape)))
            flags = {**flags, "model_path": tmp, "load_format": "dummy"}
        return _run_engine(kind, opts, flags)


def _run_engine(kind: str, opts: argparse.Namespace, flags: dict[str, Any]) -> dict[str, Any]:
    import torch

    from flotilla.cluster.engine.llm import LLM
    from flotilla.deploy.bench_env import probe_device
    from flotilla.deploy.bench_roofline import measure_copy_bandwidth

    device = probe_device(flags.get("device"))
    bandwidth = measure_copy_bandwidth(device, opts.bandwidth_bytes)  # NOTE: before the KV cache takes the memory
    started = time.perf_counter()
    llm = LLM(flags.pop("model_path", None), skip_tokenizer_init=True, **flags)
    load_s = time.perf_counter() - started
    try:
        return _measure(kind, opts, llm, device, bandwidth, load_s)
    finally:
        llm.shutdown()  # NOTE: a worker group's actors go even when a step failed
        del llm
        if device.type == "cuda":
            torch.cuda.empty_cache()


def _measure(kind: str, opts: argparse.Namespace, llm: Any, device: Any, bandwidth: dict, load_s: float) -> dict:
    """Warm up, run the workload on ``llm``'s engine and assemble the results."""
    from flotilla.cluster.engine.sampling_params import SamplingParams
    from flotilla.deploy.bench_env import describe_engine, environment, runner_startup_report
    from flotilla.deploy.bench_roofline import WeightBytes
    from flotilla.deploy.bench_breakdown import decode_breakdown, run_latency, time_graph_replay
    from flotilla.deploy.bench_run import (
        StepClock, latency_results, offline_results, random_prompts, reset_prefix_cache, run_batch,
    )  # fmt: skip

    engine = llm.engine
    described = describe_engine(llm, CONFIG_FIELDS)
    weights = WeightBytes.from_config(llm.source.config_dict, described["weight_element_size"])
    devices = int(llm.config.tp_size or 1)
    # NOTE: kv_layout counts one rank's bytes per token; the attention of every rank reads its own.
    kv_bytes_per_token = int(engine.runner.kv_layout.bytes_per_token) * devices
    peak = bandwidth["peak_bytes_per_s"]
    batch = opts.batch_size if kind == "latency" else opts.num_prompts
    params = SamplingParams(temperature=0, max_tokens=opts.output_len, ignore_eos=True)
    clock = StepClock.for_engine(engine)
    speculator = getattr(engine, "speculator", None)
    try:
        warmup_s = 0.0
        if opts.warmup_steps:
            warm_batch = batch if kind == "latency" else min(batch, OFFLINE_WARMUP_PROMPTS)
            warm = SamplingParams(temperature=0, max_tokens=opts.warmup_steps + 1, ignore_eos=True)
            started = time.perf_counter()
            warm_prompts = random_prompts(warm_batch, opts.input_len, engine.vocab_size, opts.seed + 7919)
            run_batch(engine, clock, warm_prompts, warm)
            warmup_s = time.perf_counter() - started
            reset_prefix_cache(engine)
        pool = getattr(engine.scheduler, "pool", None)
        hits_before = (getattr(pool, "prefix_hit_tokens", 0), getattr(pool, "prefix_query_tokens", 0))
        spec_before = _spec_counts(speculator)
        host_tier = getattr(engine.scheduler, "host_tier", None)  # --enable-hierarchical-cache
        host_before = (host_tier.stored_blocks, host_tier.loaded_blocks) if host_tier is not None else (0, 0)
        if kind == "latency":
            vocab = engine.vocab_size
            batches = [random_prompts(batch, opts.input_len, vocab, opts.seed + i) for i in range(opts.num_iters)]
            traces, phases = run_latency(engine, clock, batches, params)
            measured = latency_results(traces, weights, kv_bytes_per_token, peak, devices)
            replay = time_graph_replay(engine.runner, batch)
            measured["breakdown"] = decode_breakdown(
                replay, measured["tpot_ms"]["p50"], phases, weights, kv_bytes_per_token, peak, devices
            )
        else:
            prompts = random_prompts(batch, opts.input_len, engine.vocab_size, opts.seed)
            trace = run_batch(engine, clock, prompts, params)
            measured = offline_results(trace, weights, kv_bytes_per_token, peak, devices)
            query = getattr(pool, "prefix_query_tokens", 0) - hits_before[1]
            hit = getattr(pool, "prefix_hit_tokens", 0) - hits_before[0]
            measured["prefix_cache_hit_rate"] = hit / query if query else 0.0
            measured["num_preemptions"] = getattr(engine.scheduler, "num_preemptions", None)
            if host_tier is not None:  # blocks the run offloaded to the host tier and loaded back
                measured["host_kv"] = {
                    "stored_blocks": host_tier.stored_blocks - host_before[0],
                    "loaded_blocks": host_tier.loaded_blocks - host_before[1],
                }
        if speculator is not None:
            workload = batches if kind == "latency" else [prompts]
            measured["speculative_decoding"] = _speculation_results(
                llm, speculator, spec_before, workload, params, measured["output_tok_s"]
            )
    finally:
        clock.close()
    startup_report = runner_startup_report(engine.runner)  # NOTE: after the run: a runner may add lazy JIT times
    results: dict[str, Any] = {
        "benchmark": kind,
        "model": {
            "shape": opts.shape,
            "path": None if opts.shape else str(llm.source.path),
            "architecture": llm.source.architecture,
            "load_format": llm.config.load_format,
            "params": weights.total // weights.element_size,
        },
        "workload": {
            "batch_size" if kind == "latency" else "num_prompts": batch,
            "input_len": opts.input_len,
            "output_len": opts.output_len,
            "num_iters": opts.num_iters if kind == "latency" else 1,
            "warmup_steps": opts.warmup_steps,
            "seed": opts.seed,
            "sampling": "greedy, ignore_eos, token-id prompts",
        },
        "environment": environment(device),
        **described,
        "startup": {"load_s": load_s, "warmup_s": warmup_s, "runner": startup_report},
        "bandwidth": bandwidth,
        "weights": weights.as_dict(),
        "kv_bytes_per_token": kv_bytes_per_token,
        "kv_cache": {
            "block_size": engine.runner.kv_layout.block_size,
            "num_blocks": engine.runner.kv_layout.num_blocks,
            "tokens": engine.runner.kv_layout.num_tokens,
            "bytes_per_token_per_rank": engine.runner.kv_layout.bytes_per_token,
            "dtype": startup_report.get("kv_cache_dtype") if isinstance(startup_report, dict) else None,
        },
        "devices": devices,
        "flotilla": measured,
    }
    if kind == "offline" and opts.compare_hf:
        from flotilla.deploy.bench_hf import compare_with_hf

        results.update(compare_with_hf(llm, prompts, opts.output_len, opts.hf_sequential_prompts))
        ours = measured["output_tok_s"]
        results["ratios"] = {
            "vs_hf_sequential": ours / results["hf_sequential"]["output_tok_s"],
            "vs_hf_batched": ours / results["hf_batched"]["output_tok_s"],
        }
    return results


def _spec_counts(speculator: Any) -> tuple[int, int, int]:
    if speculator is None:
        return (0, 0, 0)
    stats = speculator.stats
    return (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens)


def _speculation_results(
    llm: Any, speculator: Any, before: tuple[int, int, int], workload: list[list[list[int]]], params: Any, spec_tok_s: float
) -> dict[str, Any]:
    """The measured run's acceptance, and its speedup over the same workload without
    speculation, run right after on the same runner (same weights, same KV cache)."""
    from flotilla.cluster.engine.llm_engine import LLMEngine
    from flotilla.deploy.bench_run import StepClock, reset_prefix_cache, run_batch
    from flotilla.resolution import ResolvedConfig
    from flotilla.resolution.frozen import thaw

    rounds, drafted, accepted = (now - then for now, then in zip(_spec_counts(speculator), before))
    config = ResolvedConfig.build({**thaw(llm.config.config), "speculative_algorithm": None}, dict(llm.config.env), ())
    baseline = LLMEngine(config, llm.source, None, runner=llm.engine.runner)
    reset_prefix_cache(llm.engine)
    clock = StepClock.for_engine(baseline)
    try:
        traces = [run_batch(baseline, clock, prompts, params) for prompts in workload]
    finally:
        clock.close()
    base_tok_s = sum(sum(t.output_tokens) for t in traces) / sum(t.wall_s for t in traces)
    return {
        "algorithm": speculator.name,
        "num_draft_tokens": speculator.num_draft_tokens,
        "rounds": rounds,
        "draft_tokens": drafted,
        "accepted_tokens": accepted,
        "acceptance_rate": accepted / drafted if drafted else 0.0,
        "mean_accepted_per_round": accepted / rounds if rounds else 0.0,
        "baseline_output_tok_s": base_tok_s,
        "speedup": spec_tok_s / base_tok_s,
    }


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _breakdown_lines(breakdown: dict[str, Any]) -> list[str]:
    """Where a decode step's time goes: the graph replay alone against the step, host phases."""
    step, replay = breakdown["step_wall_ms_p50"], breakdown["graph_replay_ms"]
    if replay is None:
        first = f"decode step p50 {_fmt(step, '.3f')} ms; graph replay not timed ({breakdown['graph_replay_reason']})"
    else:
        first = (
            f"decode step p50 {_fmt(step, '.3f')} ms = graph replay {replay:.3f} ms on the device (bs "
            f"{breakdown['graph_batch_size']}, MBU {_fmt(breakdown['graph_mbu'], '.3f')}) + "
            f"{_fmt(breakdown['host_overhead_ms'], '.3f')} ms not overlapped"
        )
    phases = breakdown["host_phases_ms"]
    if phases is None:
        return [first, f"host phases not timed ({breakdown['host_phases_reason']})"]
    named = ", ".join(f"{name} {ms:.3f}" for name, ms in phases.items())
    steps = breakdown["host_phase_steps"]
    return [first, f"host phases p50 ms over {steps} steps: {named} (on CUDA, sample includes the wait for the device)"]


def format_summary(results: dict[str, Any]) -> str:
    """A few lines for the terminal; the JSON holds everything."""
    model, work, env, res = results["model"], results["workload"], results["environment"], results["flotilla"]
    roof = res["roofline"]
    name = model["shape"] or model["path"]
    lines = [
        f"flotilla bench {results['benchmark']}: {name} ({model['architecture']}, {model['params'] / 1e9:.2f}B params, "
        f"{model['load_format']} weights, {results['weight_dtype']}) on {env['device_name']}, tp {results['devices']}",
    ]
    if results["benchmark"] == "latency":
        lines += [
            f"batch {work['batch_size']} x {work['input_len']} in / {work['output_len']} out, "
            f"{work['num_iters']} iterations after a {work['warmup_steps']}-step warm-up",
            f"TTFT p50 {_fmt(res['ttft_ms']['p50'], '.2f')} ms | TPOT p50 {_fmt(res['tpot_ms']['p50'], '.3f')} ms, "
            f"p90 {_fmt(res['tpot_ms']['p90'], '.3f')} ms | latency p50 {_fmt(res['latency_s']['p50'], '.3f')} s | "
            f"{res['output_tok_s']:.1f} output tok/s",
            *_breakdown_lines(res["breakdown"]),
        ]
    else:
        lines += [
            f"workload: {work['num_prompts']} prompts x {work['input_len']} in / {work['output_len']} out, all at once",
            f"{'run':<26} {'reqs':>5} {'wall s':>9} {'in tok/s':>10} {'out tok/s':>10} {'ms/out tok':>11} "
            f"{'prefix hit':>11}",
        ]
        rows = [("flotilla (all at once)", res), ("hf generate batch-1 seq", results.get("hf_sequential")),
                ("hf generate padded batch", results.get("hf_batched"))]  # fmt: skip
        for label, row in rows:
            if row is not None:
                lines.append(
                    f"{label:<26} {row['requests']:>5} {row['wall_s']:>9.2f} {row['input_tok_s']:>10.1f} "
                    f"{row['output_tok_s']:>10.1f} {_fmt(row.get('ms_per_output_token'), '.2f'):>11} "
                    f"{_fmt(row.get('prefix_cache_hit_rate'), '.1%'):>11}"
                )
        lines.append(
            f"output {res['output_tok_s']:.1f} tok/s, total {res['total_tok_s']:.1f} tok/s | TTFT p50 "
            f"{_fmt(res['ttft_s']['p50'], '.3f')} s, p90 {_fmt(res['ttft_s']['p90'], '.3f')} s | TPOT p50 "
            f"{_fmt(res['tpot_ms']['p50'], '.2f')} ms, p90 {_fmt(res['tpot_ms']['p90'], '.2f')} ms"
        )
        ratios = results.get("ratios")
        if ratios:
            lines.append(
                f"flotilla output tok/s vs HF batch-1 sequential: {ratios['vs_hf_sequential']:.2f}x; "
                f"vs HF padded batch: {ratios['vs_hf_batched']:.2f}x"
            )
    spec = res.get("speculative_decoding")
    if spec is not None:
        lines.append(
            f"speculative decoding {spec['algorithm']} ({spec['num_draft_tokens']} drafts per step): acceptance "
            f"{spec['acceptance_rate']:.1%}, {spec['mean_accepted_per_round']:.2f} accepted per round; "
            f"{spec['speedup']:.2f}x the {spec['baseline_output_tok_s']:.1f} output tok/s without it (same run)"
        )
    bw = results["bandwidth"]["peak_bytes_per_s"]
    lines.append(
        f"MBU {_fmt(roof['mbu'], '.3f')} (embedding table counted: {_fmt(roof['mbu_embedding_counted'], '.3f')}) over "
        f"{roof['decode_steps']} decode-only steps against {bw / 1e9:.1f} GB/s copy bandwidth; per step "
        f"{_fmt(roof.get('weight_bytes_per_step_mean', 0) / 1e9, '.2f')} GB weights + "
        f"{_fmt(roof.get('kv_bytes_per_step_mean', 0) / 1e9, '.3f')} GB KV"
    )
    startup = results["startup"]
    line = f"start-up: engine {startup['load_s']:.1f} s, warm-up batch {startup['warmup_s']:.1f} s"
    runner = startup.get("runner") or {}
    if "graph_batch_sizes" in runner:
        sizes = runner["graph_batch_sizes"]
        line += (
            f"; decode CUDA graphs {sizes[0]}..{sizes[-1]} ({len(sizes)} sizes) captured in "
            f"{runner.get('graph_capture_s', 0):.1f} s"
            if sizes
            else f"; no decode CUDA graphs ({runner.get('graphs_off_reason')})"
        )
    lines.append(line)
    kernels = results.get("kernel_backends") or {}
    named = ", ".join(f"{k} {v}" for k, v in kernels.items() if isinstance(v, str)) or "-"
    kv = results["kv_cache"]
    lines.append(f"kernels: {named}; KV cache {kv['tokens']} tokens ({kv.get('dtype') or 'dtype not reported'})")
    return "\n".join(lines)
