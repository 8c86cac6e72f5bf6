"""Where a decode step's device time goes outside its CUDA graph.

``flotilla bench latency`` splits a batch-1 decode step into the graph's replay time and
"not overlapped" time (step less replay). This probe looks at the second part: it runs the
same random-weight engine as the bench, profiles ``--steps`` decode steps with the torch
profiler, and reports for the middle steps every device operation that is not one of the
graph's kernels (input copies, planning copies, sampling, the token's copy back), their
device time, and the idle gaps between operations, per step.

Run on a GPU machine from the repository root (nothing is downloaded: a random-weight model
of a bundled shape)::

    python3 benchmarks/dev/step_timeline.py --shape qwen3-30b-a3b --batch-size 1 --json OUT.json

What to read: ``graph_us`` is the span from the first to the last kernel of a replay,
``outside`` lists the other operations of one step, ``idle_us`` the time the device sat idle
within the step. Their sum is the step's device period.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from collections import defaultdict
from pathlib import Path
from typing import Any

from flotilla.deploy.bench_env import write_result

_DEVICE_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")


def device_events(trace: dict[str, Any]) -> list[dict[str, Any]]:
    """The trace's device operations (kernels, copies, memsets), sorted by start, each as
    ``{"name", "start", "end", "graph"}`` in microseconds; ``graph`` is whether a CUDA graph
    launched it: Kineto gives those a nonzero "graph node id", or the correlation id of the
    ``cudaGraphLaunch`` runtime call that launched them."""
    raw = trace.get("traceEvents", [])
    launches = {
        e.get("args", {}).get("correlation")
        for e in raw
        if e.get("ph") == "X" and str(e.get("name", "")).startswith("cudaGraphLaunch")
    }
    launches.discard(None)
    events = []
    for event in raw:
        if event.get("ph") != "X" or event.get("cat") not in _DEVICE_CATEGORIES:
            continue
        args = event.get("args", {})
        start = float(event["ts"])
        events.append({
            "name": event.get("name", "?"),
            "start": start,
            "end": start + float(event.get("dur", 0.0)),
            "graph": bool(args.get("graph node id", 0)) or args.get("correlation") in launches,
        })  # fmt: skip
    return sorted(events, key=lambda e: e["start"])


def split_steps(events: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """Device operations grouped into steps: a step is one graph replay's run of graph kernels
    plus the non-graph operations after it up to the next replay's first kernel."""
    steps: list[list[dict[str, Any]]] = []
    current: list[dict[str, Any]] = []
    in_graph = False
    for event in events:
        if event["graph"] and not in_graph and current:
            steps.append(current)
            current = []
        in_graph = event["graph"]
        current.append(event)
    if current:
        steps.append(current)
    return [s for s in steps if any(e["graph"] for e in s)]


def busy_time(events: list[dict[str, Any]]) -> tuple[float, float]:
    """``(busy, end)`` of device operations sorted by start: the time (same unit as their
    ``start``/``end``) at least one of them ran, overlaps counted once, and the last end."""
    busy, cursor = 0.0, events[0]["start"] if events else 0.0
    for event in events:
        start = max(event["start"], cursor)
        busy += max(0.0, event["end"] - start)
        cursor = max(cursor, event["end"])
    return busy, cursor


def describe_step(step: list[dict[str, Any]], next_start: float) -> dict[str, Any]:
    """A step's graph span, its other operations and its idle time (up to ``next_start``)."""
    graph = [e for e in step if e["graph"]]
    outside = [e for e in step if not e["graph"]]
    busy, _ = busy_time(step)
    period = next_start - step[0]["start"]
    return {
        "period_us": period,
        "graph_us": graph[-1]["end"] - graph[0]["start"],
        "graph_kernels": len(graph),
        "outside": [{"name": e["name"][:90], "us": e["end"] - e["start"]} for e in outside],
        "outside_busy_us": sum(e["end"] - e["start"] for e in outside),
        "idle_us": period - busy,
    }


def summarize(steps: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians over the described steps, and the outside operations by name (median us)."""
    by_name: dict[str, list[float]] = defaultdict(list)
    for step in steps:
        for op in step["outside"]:
            by_name[op["name"]].append(op["us"])

    def med(key: str) -> float:
        return statistics.median(s[key] for s in steps)

    return {
        "steps": len(steps),
        "period_us_p50": med("period_us"),
        "graph_us_p50": med("graph_us"),
        "outside_busy_us_p50": med("outside_busy_us"),
        "idle_us_p50": med("idle_us"),
        "outside_ops_us_p50": {name: statistics.median(v) for name, v in sorted(by_name.items())},
        "outside_ops_per_step": statistics.median(len(s["outside"]) for s in steps),
    }


def profile_steps(opts: argparse.Namespace) -> dict[str, Any]:
    """Build the bench's engine for ``opts.shape``, warm up, profile one batch's decode."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from flotilla.cluster.engine.llm import LLM
    from flotilla.cluster.engine.sampling_params import SamplingParams
    from flotilla.deploy.bench import shape_config
    from flotilla.deploy.bench_run import StepClock, random_prompts, run_batch

    with tempfile.TemporaryDirectory(prefix="flotilla-timeline-") as tmp:
        (Path(tmp) / "config.json").write_text(json.dumps(shape_config(opts.shape)))
        llm = LLM(tmp, skip_tokenizer_init=True, load_format="dummy", dtype=opts.dtype)
        try:
            engine = llm.engine
            clock = StepClock.for_engine(engine)
            vocab = engine.vocab_size
            warm = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
            run_batch(engine, clock, random_prompts(opts.batch_size, opts.input_len, vocab, 1), warm)
            params = SamplingParams(temperature=0, max_tokens=opts.steps, ignore_eos=True)
            prompts = random_prompts(opts.batch_size, opts.input_len, vocab, 2)
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                run_batch(engine, clock, prompts, params)
                torch.cuda.synchronize()
            clock.close()
        finally:
            llm.shutdown()
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        trace = json.loads(path.read_text())
    events = device_events(trace)
    steps = split_steps(events)
    # NOTE: the middle steps: the first replays follow the prefill, the last the finish.
    middle = steps[len(steps) // 4 : 3 * len(steps) // 4]
    starts = [s[0]["start"] for s in steps]
    first = len(steps) // 4
    described = [describe_step(s, starts[first + i + 1]) for i, s in enumerate(middle) if first + i + 1 < len(starts)]
    return {
        "shape": opts.shape,
        "batch_size": opts.batch_size,
        "graph_launched_events": sum(e["graph"] for e in events),
        "summary": summarize(described),
        "example_step": described[len(described) // 2] if described else None,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="qwen3-30b-a3b")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=48, help="decode steps profiled (default 48)")
    parser.add_argument("--json", type=Path)
    opts = parser.parse_args(argv)
    result = profile_steps(opts)
    summary = result["summary"]
    if not result["graph_launched_events"]:
        print("no kernel carries a graph node id: this torch/CUPTI does not mark graph kernels", file=sys.stderr)
    print(json.dumps({k: v for k, v in summary.items() if k != "outside_ops_us_p50"}, indent=1))
    for name, us in summary["outside_ops_us_p50"].items():
        print(f"  outside {us:8.2f} us  {name}")
    if result["example_step"]:
        print("example step, in order:")
        for op in result["example_step"]["outside"]:
            print(f"  {op['us']:8.2f} us  {op['name']}")
    if opts.json:
        write_result(opts.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
