"""``flotilla bench offline``: offline throughput of the in-process engine.

    flotilla bench offline [--model M] [--num-prompts 32] [--input-len 128] [--output-len 128]
                           [--seed 0] [--compare-hf] [--hf-sequential-prompts N] [--json OUT]
                           [server flags]...

The workload is ``--num-prompts`` random token-id prompts of ``--input-len`` tokens
(seeded), each generating exactly ``--output-len`` tokens (greedy, ``ignore_eos``), all
submitted at once. The table shows input and output tokens/s over the wall time, the
mean time per output token (after each request's first token, as vLLM defines TPOT),
the prefix-cache hit rate, and a batch-1 run of the first prompt.

``--compare-hf`` runs the same prompts through HF transformers ``generate`` in this
process, with the same weights and dtype: batch-1 sequential (one prompt after the
other) and one padded batch (left padding), and prints flotilla's ratio to each.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import sys
import time
from pathlib import Path
from typing import Any, Sequence

from flotilla.resolution import ArgumentError, ResolutionError
from flotilla.resolution.args import _Parser, add_server_flags, reject_unknown, server_flag_names
from flotilla.resolution.fields import FIELDS

USAGE = "usage: flotilla bench offline [options] [server flags]  (run `flotilla bench offline --help`)\n"


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="flotilla bench offline", add_help=False, description=__doc__.split("\n\n")[1])
    own = parser.add_argument_group("benchmark options")
    own.add_argument("--help", "-h", action="help", help="show this help and exit")
    own.add_argument("--num-prompts", type=int, default=32, help="prompts in the workload (default 32)")
    own.add_argument("--input-len", type=int, default=128, help="tokens per prompt (default 128)")
    own.add_argument("--output-len", type=int, default=128, help="tokens generated per prompt (default 128)")
    own.add_argument("--seed", type=int, default=0, help="seed of the random prompts (default 0)")
    own.add_argument("--compare-hf", action="store_true", help="also run HF transformers generate and print ratios")
    own.add_argument(
        "--hf-sequential-prompts",
        type=int,
        default=None,
        help="time HF batch-1 on only the first N prompts (default: all; throughput is per token either way)",
    )
    own.add_argument("--json", default=None, metavar="OUT", help="write the results as JSON to OUT")
    add_server_flags(parser, FIELDS.values())
    return parser


def run_bench(argv: Sequence[str]) -> int:
    """Entry of ``flotilla bench``; returns the exit status."""
    argv = list(argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE, end="")
        return 0 if argv else 2
    if argv[0] != "offline":
        print(f"flotilla bench: unknown benchmark {argv[0]!r} (known: offline)", file=sys.stderr)
        return 2
    parser = build_parser()
    try:
        opts, unknown = parser.parse_known_args(argv[1:])
        own_flags = [o for a in parser._actions for o in a.option_strings]
        reject_unknown(unknown, server_flag_names() + own_flags)
        for name in ("num_prompts", "input_len", "output_len"):
            if getattr(opts, name) < 1:
                raise ArgumentError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(opts, name)}")
        flags = {k: v for k, v in vars(opts).items() if k in FIELDS}
        results = run_offline(opts, flags)
    except (ArgumentError, ResolutionError, ValueError) as exc:
        print(f"flotilla bench offline: error: {exc}", file=sys.stderr)
        return 2
    results["command"] = ["flotilla", "bench", *argv]
    print(format_table(results))
    if opts.json:
        out = Path(opts.json)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(results, indent=2, sort_keys=True) + "\n")
        print(f"\nwrote {out}")
    return 0


def random_prompts(num: int, length: int, vocab_size: int, seed: int) -> list[list[int]]:
    """``num`` prompts of ``length`` token ids drawn uniformly from the vocabulary."""
    rng = random.Random(seed)
    return [[rng.randrange(vocab_size) for _ in range(length)] for _ in range(num)]


def run_offline(opts: argparse.Namespace, flags: dict[str, Any]) -> dict[str, Any]:
    import torch

    from flotilla.cluster.engine.llm import LLM
    from flotilla.cluster.engine.sampling_params import SamplingParams

    model = flags.pop("model_path", None)
    started = time.perf_counter()
    llm = LLM(model, skip_tokenizer_init=True, **flags)
    load_s = time.perf_counter() - started
    engine = llm.engine
    prompts = random_prompts(opts.num_prompts, opts.input_len, engine.vocab_size, opts.seed)
    params = SamplingParams(temperature=0, max_tokens=opts.output_len, ignore_eos=True)
    time_engine(engine, [prompts[0][:8]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))  # warm-up
    hits_before = (engine.scheduler.pool.prefix_hit_tokens, engine.scheduler.pool.prefix_query_tokens)
    batched = time_engine(engine, prompts, params)
    hit = engine.scheduler.pool.prefix_hit_tokens - hits_before[0]
    query = engine.scheduler.pool.prefix_query_tokens - hits_before[1]
    batched["prefix_cache_hit_rate"] = hit / query if query else 0.0
    batched["num_preemptions"] = engine.scheduler.num_preemptions
    engine.scheduler.pool.reset_prefix_cache()
    single = time_engine(engine, prompts[:1], params)
    results: dict[str, Any] = {
        "model": str(llm.source.path),
        "workload": {
            "num_prompts": opts.num_prompts,
            "input_len": opts.input_len,
            "output_len": opts.output_len,
            "seed": opts.seed,
            "sampling": "greedy, ignore_eos",
        },
        "machine": {
            "cpu_count": os.cpu_count(),
            "torch_threads": torch.get_num_threads(),
            "torch": torch.__version__,
            "python": platform.python_version(),
            "device": llm.config.device,
        },
        "config_digest": llm.config.digest,
        "dtype": str(next(engine.runner.model.parameters()).dtype),
        "kv_cache_tokens": engine.runner.kv_layout.num_tokens,
        "load_s": load_s,
        "flotilla": batched,
        "flotilla_batch1": single,
    }
    if opts.compare_hf:
        from flotilla.deploy.bench_hf import compare_with_hf

        results.update(compare_with_hf(llm, prompts, opts.output_len, opts.hf_sequential_prompts))
        ours = batched["output_tok_s"]
        results["ratios"] = {
            "vs_hf_sequential": ours / results["hf_sequential"]["output_tok_s"],
            "vs_hf_batched": ours / results["hf_batched"]["output_tok_s"],
        }
    return results


def time_engine(engine, prompts: list[list[int]], params) -> dict[str, Any]:
    """Submit ``prompts`` at once, step until all finish; per-request timings from the deltas."""
    started = time.perf_counter()
    ids = [engine.add_request(p, params) for p in prompts]
    first: dict[str, float] = {}
    last: dict[str, float] = {}
    while engine.has_unfinished_requests():
        deltas = engine.step()
        now = time.perf_counter()
        for delta in deltas:
            if delta.token_ids:
                first.setdefault(delta.request_id, now)
                last[delta.request_id] = now
    wall = time.perf_counter() - started
    outputs = [engine.pop_output(i) for i in ids]
    out_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    in_tokens = sum(len(p) for p in prompts)
    tpots = [
        (last[i] - first[i]) / (len(o.outputs[0].token_ids) - 1)
        for i, o in zip(ids, outputs)
        if len(o.outputs[0].token_ids) > 1
    ]
    return {
        "wall_s": wall,
        "requests": len(prompts),
        "input_tokens": in_tokens,
        "output_tokens": out_tokens,
        "input_tok_s": in_tokens / wall,
        "output_tok_s": out_tokens / wall,
        "ms_per_output_token": 1000 * sum(tpots) / len(tpots) if tpots else None,
        "mean_ttft_s": sum(first[i] - started for i in ids) / len(ids),
    }


def format_table(results: dict[str, Any]) -> str:
    w = results["workload"]
    lines = [
        f"model: {results['model']}",
        f"workload: {w['num_prompts']} prompts x {w['input_len']} in / {w['output_len']} out, {w['sampling']}; "
        f"dtype {results['dtype']}, {results['machine']['torch_threads']} torch threads, load {results['load_s']:.1f} s",
        "",
        f"{'run':<26} {'reqs':>5} {'wall s':>9} {'in tok/s':>10} {'out tok/s':>10} {'ms/out tok':>11} {'prefix hit':>11}",
    ]
    rows = [
        ("flotilla (all at once)", results["flotilla"]),
        ("flotilla batch-1", results["flotilla_batch1"]),
        ("hf generate batch-1 seq", results.get("hf_sequential")),
        ("hf generate padded batch", results.get("hf_batched")),
    ]
    for name, row in rows:
        if row is None:
            continue
        tpot = row.get("ms_per_output_token")
        hit = row.get("prefix_cache_hit_rate")
        lines.append(
            f"{name:<26} {row['requests']:>5} {row['wall_s']:>9.2f} {row['input_tok_s']:>10.1f} "
            f"{row['output_tok_s']:>10.1f} {'-' if tpot is None else f'{tpot:.1f}':>11} "
            f"{'-' if hit is None else f'{hit:.1%}':>11}"
        )
    ratios = results.get("ratios")
    if ratios:
        lines.append("")
        lines.append(
            f"flotilla output tok/s vs HF batch-1 sequential: {ratios['vs_hf_sequential']:.2f}x; "
            f"vs HF padded batch: {ratios['vs_hf_batched']:.2f}x"
        )
    lines.append(
        "(ms/out tok: per request; flotilla rows: mean time between a request's tokens after its first; "
        "HF rows: wall / tokens per request, prefill included)"
    )
    return "\n".join(lines)
