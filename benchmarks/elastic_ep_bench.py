"""Elastic EP scale-up: the pause the commit causes and the time from request to serving at the
new size, measured on the engine an engine replica holds (an ``AsyncEngine`` over a Ray worker
group), while streams are in flight.

Workload: a Qwen3-MoE-shaped model with random weights (``--load-format dummy``; the shape is
set below and recorded in the JSON), elastic layout ``--tp 1 --dp 1 --ep 1
--enable-dp-attention --enable-dp-lm-head --elastic-ep-backend ray --max-ep-size 2``. ``streams``
greedy requests stream ``output_len`` tokens each; once every stream has produced
``warmup_tokens`` tokens the engine is grown to EP 2 (``AsyncEngine.grow_elastic_ep``, the call
behind ``POST /scale_elastic_ep``). Per stream every token's arrival time is recorded.

Reported (seconds):

- ``commit_pause_s``: the engine thread's pause for the commit (``JoinReport``);
- ``max_token_gap_during_scale_s``: the longest time in which no stream received a token, from
  the scale request to its end (what a client sees: the commit pause plus the step it waited
  for), against ``median_token_gap_s``, the median gap between consecutive tokens of any stream
  outside the scale window;
- ``prepare_s`` (placement group, joiner start and load, the group serving meanwhile) and
  ``scale_to_serving_s`` (request to serving at the new size);
- ``tokens_while_preparing`` and the median gap then (the joiners' loading shares the box);
- ``median_token_gap_after_scale_s``: a second wave of as many streams after the commit, routed
  over both DP ranks (``dp_rank_requests``: requests admitted per DP rank).

Usage::

    .venv/bin/python benchmarks/elastic_ep_bench.py --json benchmarks/results/elastic-ep-cpu.json
    # 2 GPUs (NCCL), torch kernels until the GPU kernel backends land:
    python3 benchmarks/elastic_ep_bench.py --json elastic-ep-h200x2.json attention_backend=torch_native
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from flotilla.deploy.bench_env import write_result

sys.path.insert(0, str(Path(__file__).parent))
from serve_bench import server_flags  # noqa: E402

# A Qwen3-MoE shape small enough for a 2-core CPU box, big enough that loading is not free:
# 16 experts top-4 in every layer, ~50M parameters.
SHAPE = dict(
    architectures=["Qwen3MoeForCausalLM"],
    model_type="qwen3_moe",
    vocab_size=8192,
    hidden_size=512,
    intermediate_size=1024,
    moe_intermediate_size=256,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=64,
    num_hidden_layers=6,
    num_experts=16,
    num_experts_per_tok=4,
    norm_topk_prob=True,
    max_position_embeddings=2048,
    rms_norm_eps=1e-6,
    rope_theta=1000000.0,
    tie_word_embeddings=False,
)
ELASTIC = dict(
    tp_size=1, dp_size=1, ep_size=1, enable_dp_attention=True, enable_dp_lm_head=True,
    elastic_ep_backend="ray", max_ep_size=2, disable_cuda_graph=True, load_format="dummy",
    max_total_tokens=8192, disable_radix_cache=True,
)


async def _stream(engine, request, arrivals: list[float]) -> int:
    tokens = 0
    async for chunk in engine.generate(request):
        for completion in chunk.completions:
            for _ in completion.token_ids:
                arrivals.append(time.perf_counter())
                tokens += 1
    return tokens


async def _measure(engine, joiner_config, args) -> dict:
    from flotilla import SamplingParams
    from flotilla.serve.types import GenerateRequest

    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    arrivals: list[list[float]] = [[] for _ in range(args.streams)]
    tasks = []
    for i in range(args.streams):
        prompt = [(7 * i + 13 * j) % (SHAPE["vocab_size"] - 3) + 3 for j in range(args.input_len)]
        request = GenerateRequest(f"bench-{i}", prompt, params, time.time())
        tasks.append(asyncio.create_task(_stream(engine, request, arrivals[i])))
    while min(len(a) for a in arrivals) < args.warmup_tokens:
        await asyncio.sleep(0.01)
    scale_started = time.perf_counter()
    tokens_before_scale = sum(len(a) for a in arrivals)
    report = await engine.grow_elastic_ep(joiner_config, 2, args.scale_timeout)
    scale_ended = time.perf_counter()
    alive_at_commit = sum(1 for task in tasks if not task.done())
    counts = await asyncio.gather(*tasks)
    assert all(c == args.output_len for c in counts), counts
    # A second wave after the commit: routed over both DP ranks.
    after: list[list[float]] = [[] for _ in range(args.streams)]
    second = []
    for i in range(args.streams):
        prompt = [(11 * i + 5 * j) % (SHAPE["vocab_size"] - 3) + 3 for j in range(args.input_len)]
        request = GenerateRequest(f"bench-after-{i}", prompt, params, time.time())
        second.append(asyncio.create_task(_stream(engine, request, after[i])))
    await asyncio.gather(*second)
    every = sorted(t for a in arrivals for t in a)
    prepared_at = scale_started + report.prepare_s
    inside = [scale_started] + [t for t in every if scale_started <= t <= scale_ended] + [scale_ended]

    def gaps(streams, lo=float("-inf"), hi=float("inf"), outside=False):
        found = []
        for stream in streams:
            for a, b in zip(stream, stream[1:]):
                within = lo <= a and b <= hi
                if within != outside:
                    found.append(b - a)
        return found

    return {
        "old_ep_size": report.old_size,
        "new_ep_size": report.new_size,
        "commit_pause_s": report.commit_pause_s,
        "prepare_s": report.prepare_s,
        "scale_to_serving_s": report.total_s,
        "streams_alive_at_commit": alive_at_commit,
        "max_token_gap_during_scale_s": max(b - a for a, b in zip(inside, inside[1:])),
        "median_token_gap_s": statistics.median(gaps(arrivals, scale_started, scale_ended, outside=True)),
        "median_token_gap_while_preparing_s": statistics.median(gaps(arrivals, scale_started, prepared_at) or [float("nan")]),
        "median_token_gap_after_scale_s": statistics.median(gaps(after)),
        "tokens_while_preparing": sum(1 for t in every if scale_started <= t <= prepared_at),
        "tokens_before_scale": tokens_before_scale,
        "dp_rank_requests": engine.dp_rank_requests(),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=320)
    parser.add_argument("--warmup-tokens", type=int, default=16, help="tokens every stream has before the scale")
    parser.add_argument("--scale-timeout", type=float, default=300.0)
    parser.add_argument("--rounds", type=int, default=2, help="fresh engine per round")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("flags", nargs="*", help="more server fields as key=value (e.g. attention_backend=torch_native)")
    args = parser.parse_args(argv)
    flags = {**ELASTIC, **server_flags(args.flags)}

    import ray

    from flotilla.cluster.models.sources import resolve_model_source
    from flotilla.cluster.platform import probe
    from flotilla.serve.async_engine import AsyncEngine
    from flotilla.serve.plan import plan_serving

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    # NOTE: address="local": a cluster of its own, even where another process's cluster runs here.
    ray.init(address="local", include_dashboard=False, num_cpus=4, log_to_driver=False, configure_logging=False)
    rounds = []
    with tempfile.TemporaryDirectory() as model_dir:
        (Path(model_dir) / "config.json").write_text(json.dumps(SHAPE))
        # NOTE: the serving plan resolves the primary and its joiners, as flotilla serve does.
        plan = plan_serving({"model_path": model_dir, **flags}, platform=probe())
        config, source = plan.config, resolve_model_source(model_dir)
        joiner_config = plan.options.elastic_plan.joiner_config(1, 2)
        for index in range(args.rounds):
            engine = AsyncEngine.from_config(config, source, None, 4 * args.streams, replica_id=f"bench-{index}")
            try:
                result = asyncio.run(_measure(engine, joiner_config, args))
            finally:
                engine.shutdown()
            print(json.dumps(result), flush=True)
            rounds.append(result)
    ray.shutdown()
    keys = (
        "commit_pause_s", "max_token_gap_during_scale_s", "median_token_gap_s", "median_token_gap_while_preparing_s",
        "median_token_gap_after_scale_s", "prepare_s", "scale_to_serving_s",
    )
    summary = {k: statistics.median(r[k] for r in rounds) for k in keys}
    out = {"shape": SHAPE, "flags": flags, "device": config.device, "args": {k: str(v) for k, v in vars(args).items()}, "rounds": rounds, "median": summary}
    print(json.dumps(summary, indent=2))
    if args.json:
        write_result(args.json, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
