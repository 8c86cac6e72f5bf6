"""The serving path's cost: the same workload through HTTP (Ray Serve + the OpenAI ingress)
and through the in-process engine.

    python benchmarks/serve_bench.py [--num-requests 96] [--concurrency 32] [--input-len 64]
                                     [--output-len 32] [--rounds 2] [--json OUT] [--stream-batch-ms MS]
                                     [--one-engine-at-a-time] [server flags as key=value]

Workload: ``--num-requests`` random token-id prompts (seeded) through ``/v1/completions``
(streaming, greedy, ``ignore_eos``: exactly ``--output-len`` tokens each), ``--concurrency``
in flight (a closed loop, :mod:`flotilla.deploy.loadgen`). The in-process run drives an
:class:`~flotilla.serve.async_engine.AsyncEngine` (the engine an engine replica holds) with
the same prompts and concurrency, no HTTP and no Serve. Rounds alternate HTTP and in-process
so drift on a noisy machine hits both; the report gives each round and the ratio of the
medians: output tokens/s (HTTP / in-process) and the TTFT overhead (HTTP - in-process).
The prefix cache is off so repeated rounds do not get faster.

``--one-engine-at-a-time`` is for one GPU, where the Serve replica's engine and the
in-process one cannot both hold the model and a KV pool: every HTTP round runs first, Serve
is shut down (its replica process exits and frees the device), then the in-process rounds run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

from flotilla.deploy.bench_env import write_result


def random_token_prompts(num: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    """``num`` seeded random token-id prompts of ``length`` (ids 0-2 left out: special tokens)."""
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(length)] for _ in range(num)]


def _flag_value(text: str):
    """``"true"``/``"false"`` as booleans, integers as ints, anything else as given."""
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    return int(text) if text.lstrip("-").isdigit() else text


def server_flags(pairs: list[str]) -> dict:
    """Server fields from ``key=value`` arguments (integers as ints, true/false as
    booleans); the prefix cache off
    unless given, so repeated rounds do not get faster."""
    flags = dict(pair.split("=", 1) for pair in pairs)
    flags = {k: _flag_value(v) for k, v in flags.items()}
    flags.setdefault("disable_radix_cache", True)
    return flags


def wait_for_device_memory(timeout_s: float = 120.0, free_share: float = 0.9) -> None:
    """After ``serve.shutdown()``: wait until the replica's process has given the GPU back
    (``free_share`` of it free), so the in-process engine sizes its KV pool as the replica
    did. Nothing to wait for without CUDA; RuntimeError after ``timeout_s``."""
    import torch

    if not torch.cuda.is_available():
        return
    deadline = time.monotonic() + timeout_s
    while True:
        free, total = torch.cuda.mem_get_info()
        if free >= free_share * total:
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"the GPU still has {(total - free) / 2**30:.1f} GiB in use {timeout_s:.0f} s after Serve shut down")
        time.sleep(1.0)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-requests", type=int, default=96)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument(
        "--stream-batch-ms",
        type=float,
        default=None,
        help="the Serve replica's stream batching interval (default: flotilla serve's, 50 ms); the in-process "
        "engine is never batched",
    )
    parser.add_argument(
        "--one-engine-at-a-time",
        action="store_true",
        help="all HTTP rounds, then Serve down, then the in-process rounds (one GPU holds one engine)",
    )
    parser.add_argument("flags", nargs="*", help="server fields as key=value (e.g. max_total_tokens=8192)")
    opts = parser.parse_args(argv)
    flags = server_flags(opts.flags)

    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    from ray import serve

    from flotilla.cluster.models.sources import resolve_model_source
    from flotilla.deploy.loadgen import engine_load, http_load
    from flotilla.deploy.serve_cmd import deploy
    from flotilla.serve.app import ensure_ray
    from flotilla.serve.plan import plan_serving
    from flotilla.serve.async_engine import AsyncEngine

    ensure_ray(None, num_cpus=4)
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    plan = plan_serving({**flags, "port": port}, stream_batch_ms=opts.stream_batch_ms)
    config, options = plan.config, plan.options
    source = resolve_model_source(options.model)
    prompts = random_token_prompts(opts.num_requests, opts.input_len, int(source.config_dict["vocab_size"]), opts.seed)
    warm = prompts[:4]

    url = deploy(plan)

    def run_http():
        return asyncio.run(http_load(url, options.served_model_name, prompts, opts.output_len, opts.concurrency))

    def run_local():
        return asyncio.run(engine_load(engine, prompts, opts.output_len, opts.concurrency))

    asyncio.run(http_load(url, options.served_model_name, warm, 4, 4))  # warm-up both paths
    rounds = []
    if opts.one_engine_at_a_time:
        http_rounds = [run_http().summary() for _ in range(opts.rounds)]
        serve.shutdown()
        wait_for_device_memory()
        engine = AsyncEngine.from_config(config, source, None, options.max_queued_requests)
        asyncio.run(engine_load(engine, warm, 4, 4))
        for http in http_rounds:
            rounds.append({"http": http, "in_process": run_local().summary()})
            print(json.dumps(rounds[-1]), flush=True)
        engine.shutdown()
    else:
        engine = AsyncEngine.from_config(config, source, None, options.max_queued_requests)
        asyncio.run(engine_load(engine, warm, 4, 4))
        for _ in range(opts.rounds):
            http = run_http().summary()
            local = run_local().summary()
            rounds.append({"http": http, "in_process": local})
            print(json.dumps(rounds[-1]), flush=True)
        engine.shutdown()
        serve.shutdown()

    http_tps = statistics.median(r["http"]["output_tok_s"] for r in rounds)
    local_tps = statistics.median(r["in_process"]["output_tok_s"] for r in rounds)
    http_ttft = statistics.median(r["http"]["ttft_median_s"] for r in rounds)
    local_ttft = statistics.median(r["in_process"]["ttft_median_s"] for r in rounds)
    results = {
        "workload": {
            k: getattr(opts, k)
            for k in ("num_requests", "concurrency", "input_len", "output_len", "seed", "one_engine_at_a_time")
        },
        "stream_batch_ms": options.stream_batch_ms,
        "server_flags": flags,
        "model": options.served_model_name,
        "rounds": rounds,
        "http_output_tok_s_median": http_tps,
        "in_process_output_tok_s_median": local_tps,
        "http_over_in_process": round(http_tps / local_tps, 3),
        "ttft_median_http_s": http_ttft,
        "ttft_median_in_process_s": local_ttft,
        "ttft_overhead_s": round(http_ttft - local_ttft, 4),
    }
    print(json.dumps({k: v for k, v in results.items() if k != "rounds"}, indent=2))
    if opts.json:
        write_result(opts.json, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
