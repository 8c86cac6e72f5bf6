"""The measured part of ``flotilla bench``: drive an :class:`LLMEngine` over a token-id
workload step by step and turn the step and token times into latency and throughput figures.

Each ``engine.step()`` is timed on the host. On a GPU the step ends with the sampled tokens
copied to the host, so its wall time covers the device work of the step. The runner's
``execute`` is wrapped (:class:`StepClock`) to record what each step held: how many sequences,
how many new tokens, whether every sequence decoded one token (a decode-only step), and the
context lengths its attention read.

``bench latency`` also says where a decode step's time goes: see
:mod:`flotilla.deploy.bench_breakdown`.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

from flotilla.cluster.engine.gc_pauses import frozen_heap
from flotilla.deploy.bench_roofline import WeightBytes, mbu


def random_prompts(num: int, length: int, vocab_size: int, seed: int) -> list[list[int]]:
    """``num`` prompts of ``length`` token ids drawn uniformly from the vocabulary (seeded)."""
    rng = random.Random(seed)
    return [[rng.randrange(vocab_size) for _ in range(length)] for _ in range(num)]


def percentile(values: Sequence[float], q: float) -> float | None:
    """The ``q``-th percentile (0..100) with linear interpolation between order statistics
    (numpy's default); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    low = int(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def summary(values: Sequence[float], scale: float = 1.0) -> dict[str, float | None]:
    """p50, p90, mean, min, max and count of ``values`` times ``scale``."""
    scaled = [v * scale for v in values]
    return {
        "p50": percentile(scaled, 50),
        "p90": percentile(scaled, 90),
        "mean": sum(scaled) / len(scaled) if scaled else None,
        "min": min(scaled) if scaled else None,
        "max": max(scaled) if scaled else None,
        "count": len(scaled),
    }


@dataclass(frozen=True)
class StepRecord:
    """One engine step: its wall time and what it held."""

    seconds: float
    num_seqs: int
    num_tokens: int
    decode_only: bool
    context_tokens: int  # sum over the step's sequences of their length after the step


class StepClock:
    """Wraps the runner method the engine runs a step with (``execute``, or ``launch`` under
    overlap scheduling; an instance attribute, undone by :meth:`close`) to note each step's
    composition for the caller's wall-clock timing of ``engine.step()``.

    NOTE: under overlap scheduling an ``engine.step()`` launches one step and waits for the
    one before it, so its wall time is still one step's in a steady stream of steps."""

    def __init__(self, runner: Any, method: str = "execute"):
        self.runner = runner
        self.method = method
        self._execute = getattr(runner, method)
        self.last: tuple[int, int, bool, int] | None = None
        setattr(runner, method, self._timed_execute)

    @classmethod
    def for_engine(cls, engine: Any) -> "StepClock":
        """The clock of the method ``engine`` steps its runner with."""
        return cls(engine.runner, "launch" if getattr(engine, "overlap", False) else "execute")

    def _timed_execute(self, step: Any, rows: Any, *args: Any) -> Any:
        items = list(getattr(step, "scheduled", []))
        # NOTE: a decode appends one generated token: its position is past the prompt.
        decode = bool(items) and all(
            it.num_new_tokens == 1 and it.start_position >= it.request.num_prompt_tokens for it in items
        )
        context = sum(it.start_position + it.num_new_tokens for it in items)
        self.last = (len(items), sum(it.num_new_tokens for it in items), decode, context)
        return self._execute(step, rows, *args)

    @property
    def last_decode_only(self) -> bool:
        """Whether the last step seen was a decode-only step."""
        return self.last is not None and self.last[2]

    def close(self) -> None:
        if self.runner.__dict__.get(self.method) == self._timed_execute:
            del self.runner.__dict__[self.method]


@dataclass
class BatchTrace:
    """Timings of one batch of requests submitted at once and run to completion."""

    started: float
    finished: float
    input_tokens: int
    output_tokens: list[int]
    first_token: list[float]
    last_token: list[float]
    steps: list[StepRecord] = field(default_factory=list)

    @property
    def wall_s(self) -> float:
        return self.finished - self.started

    def ttfts(self) -> list[float]:
        return [t - self.started for t in self.first_token]

    def tpots(self) -> list[float]:
        """Per request: time between its first and last token over the tokens in between."""
        return [
            (last - first) / (n - 1)
            for first, last, n in zip(self.first_token, self.last_token, self.output_tokens)
            if n > 1
        ]

    def decode_steps(self) -> list[StepRecord]:
        return [s for s in self.steps if s.decode_only]


def run_batch(engine: Any, clock: StepClock, prompts: list[list[int]], params: Any) -> BatchTrace:
    """Submit ``prompts`` at once and step until all finish (the start-up heap frozen out of
    the cycle collector, as ``LLM.generate`` and the serving loop run; see
    :mod:`flotilla.cluster.engine.gc_pauses`); RuntimeError when a request failed."""
    started = time.perf_counter()
    ids = [engine.add_request(p, params) for p in prompts]
    first: dict[str, float] = {}
    last: dict[str, float] = {}
    steps: list[StepRecord] = []
    with frozen_heap():
        while engine.has_unfinished_requests():
            clock.last = None
            t0 = time.perf_counter()
            deltas = engine.step()
            now = time.perf_counter()
            if clock.last is not None:
                steps.append(StepRecord(now - t0, *clock.last))
            for delta in deltas:
                if delta.token_ids:
                    first.setdefault(delta.request_id, now)
                    last[delta.request_id] = now
    finished = time.perf_counter()
    outputs = [engine.pop_output(i) for i in ids]
    if engine.dead is not None:
        raise RuntimeError(f"the engine failed during the benchmark: {engine.dead}")
    failed = [o for o in outputs if o.error]
    if failed:
        raise RuntimeError(f"request {failed[0].request_id} failed: {failed[0].error}")
    return BatchTrace(
        started=started,
        finished=finished,
        input_tokens=sum(len(p) for p in prompts),
        output_tokens=[len(o.outputs[0].token_ids) for o in outputs],
        first_token=[first[i] for i in ids],
        last_token=[last[i] for i in ids],
        steps=steps,
    )


def reset_prefix_cache(engine: Any) -> None:
    """Forget cached prefixes so a warm-up or earlier iteration cannot speed up the next."""
    pool = getattr(engine.scheduler, "pool", None)
    if pool is not None and hasattr(pool, "reset_prefix_cache"):
        pool.reset_prefix_cache()
    host_tier = getattr(engine.scheduler, "host_tier", None)
    if host_tier is not None:
        host_tier.clear()  # NOTE: the host tier of the prefix cache (--enable-hierarchical-cache)


def decode_roofline(
    steps: Sequence[StepRecord], weights: WeightBytes, kv_bytes_per_token: int, peak: float, devices: int
) -> dict[str, Any]:
    """MBU over decode-only steps: aggregate (all bytes over all time) and per-step p50/p90,
    plus the bytes the model says the steps read."""
    if not steps:
        return {"decode_steps": 0, "mbu": None, "mbu_embedding_counted": None}
    bandwidth = peak * devices
    per_step, per_step_emb = [], []
    total = total_emb = seconds = 0.0
    for s in steps:
        kv = s.context_tokens * kv_bytes_per_token
        moved = weights.per_step(s.num_seqs) + kv
        moved_emb = weights.per_step(s.num_seqs, count_embedding=True) + kv
        total += moved
        total_emb += moved_emb
        seconds += s.seconds
        per_step.append(mbu(moved, s.seconds, bandwidth))
        per_step_emb.append(mbu(moved_emb, s.seconds, bandwidth))
    kv_total = sum(s.context_tokens for s in steps) * kv_bytes_per_token
    return {
        "decode_steps": len(steps),
        "decode_seconds": seconds,
        "bytes_per_step_mean": total / len(steps),
        "weight_bytes_per_step_mean": (total - kv_total) / len(steps),
        "kv_bytes_per_step_mean": kv_total / len(steps),
        "mbu": mbu(total, seconds, bandwidth),
        "mbu_p50": percentile(per_step, 50),
        "mbu_p90": percentile(per_step, 90),
        "mbu_embedding_counted": mbu(total_emb, seconds, bandwidth),
        "mbu_embedding_counted_p50": percentile(per_step_emb, 50),
    }


def latency_results(
    traces: Sequence[BatchTrace], weights: WeightBytes, kv_bytes_per_token: int, peak: float, devices: int
) -> dict[str, Any]:
    """Latency figures over measured iterations of one batch: TTFT (until the batch's last
    first token: the prefill), time per output token (decode-only step wall times), total."""
    decode = [s for t in traces for s in t.decode_steps()]
    batch = len(traces[0].output_tokens)
    out_tokens = sum(sum(t.output_tokens) for t in traces)
    wall = sum(t.wall_s for t in traces)
    return {
        "iterations": len(traces),
        "batch_size": batch,
        "output_tokens": out_tokens,
        "input_tokens": sum(t.input_tokens for t in traces),
        "ttft_ms": summary([max(t.ttfts()) for t in traces], 1e3),
        "tpot_ms": summary([s.seconds for s in decode], 1e3),
        "latency_s": summary([t.wall_s for t in traces]),
        "output_tok_s": out_tokens / wall,
        "iteration_details": [
            {
                "wall_s": t.wall_s,
                "ttft_s": max(t.ttfts()),
                "steps": len(t.steps),
                "decode_steps": len(t.decode_steps()),
                "decode_ms_mean": 1e3 * sum(s.seconds for s in t.decode_steps()) / max(1, len(t.decode_steps())),
            }
            for t in traces
        ],
        "roofline": decode_roofline(decode, weights, kv_bytes_per_token, peak, devices),
    }


def offline_results(
    trace: BatchTrace, weights: WeightBytes, kv_bytes_per_token: int, peak: float, devices: int
) -> dict[str, Any]:
    """Throughput of one batch run to completion, per-request TTFT/TPOT percentiles and the
    MBU of its decode-only steps (steps mixing in prefill chunks are not counted there)."""
    out_tokens = sum(trace.output_tokens)
    wall = trace.wall_s
    ttfts, tpots = trace.ttfts(), trace.tpots()
    return {
        "wall_s": wall,
        "requests": len(trace.output_tokens),
        "input_tokens": trace.input_tokens,
        "output_tokens": out_tokens,
        "input_tok_s": trace.input_tokens / wall,
        "output_tok_s": out_tokens / wall,
        "total_tok_s": (trace.input_tokens + out_tokens) / wall,
        "ttft_s": summary(ttfts),
        "tpot_ms": summary(tpots, 1e3),
        "mean_ttft_s": sum(ttfts) / len(ttfts),
        "ms_per_output_token": 1e3 * sum(tpots) / len(tpots) if tpots else None,
        "steps": len(trace.steps),
        "max_batch_seqs": max((s.num_seqs for s in trace.steps), default=0),
        "roofline": decode_roofline(trace.decode_steps(), weights, kv_bytes_per_token, peak, devices),
        "step_windows": step_windows(trace.steps),
    }


def step_windows(steps: Sequence[StepRecord], windows: int = 40) -> list[dict[str, Any]]:
    """The run's steps in about ``windows`` consecutive windows of equal step count, each with
    its wall time, step count, decode-only steps, mean sequences a step, tokens and mean
    context tokens a step: where a long run's time went (prefill, full decode, the tail)."""
    size = max(1, -(-len(steps) // windows))
    out = []
    for first in range(0, len(steps), size):
        chunk = steps[first : first + size]
        out.append(
            {
                "first_step": first,
                "steps": len(chunk),
                "seconds": sum(s.seconds for s in chunk),
                "decode_only_steps": sum(s.decode_only for s in chunk),
                "mean_seqs": sum(s.num_seqs for s in chunk) / len(chunk),
                "tokens": sum(s.num_tokens for s in chunk),
                "mean_context_tokens": sum(s.context_tokens for s in chunk) / len(chunk),
            }
        )
    return out
