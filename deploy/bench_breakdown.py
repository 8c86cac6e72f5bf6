"""Where a decode step's time goes, for ``flotilla bench latency``: the decode CUDA graph
replayed alone on the device (:func:`time_graph_replay`) against the step's wall time, and the
host phases of each step of the last iteration (:class:`PhaseClock`), put together by
:func:`decode_breakdown`.
"""

from __future__ import annotations

import functools
import time
from typing import Any, Callable, Sequence

from flotilla.deploy.bench_roofline import WeightBytes, mbu
from flotilla.deploy.bench_run import BatchTrace, StepClock, percentile, reset_prefix_cache, run_batch, summary

# The host phases of an engine step, in order (see PhaseClock).
HOST_PHASES = ("schedule", "prepare_inputs", "plan", "forward", "sample", "update")
# Graph replays timed back to back by time_graph_replay.
REPLAY_ITERS = 50
_ABSENT = object()


class PhaseClock:
    """Times the host phases of every decode-only engine step while attached (a context
    manager), by wrapping bound methods of the engine's objects as instance attributes
    (undone on exit): ``engine.step``, ``scheduler.schedule``, ``runner.execute``,
    ``runner.step_logits``, ``runner.prepare_inputs`` and ``runner.planner.plan``.

    Per step, in :data:`HOST_PHASES` order: ``schedule``, ``prepare_inputs`` and ``plan`` as
    timed; ``forward`` = ``step_logits`` less those two (filling the graph's static buffers and
    launching its replay, or the eager forward and LM head); ``sample`` = ``execute`` less
    ``step_logits``; ``update`` = the rest of ``engine.step`` (sampling rows,
    ``scheduler.update``, the deltas). A step's phases add up to its time.

    NOTE: CUDA kernels run asynchronously: ``forward`` is the host time to launch them and the
    wait for the device lands in ``sample`` (its read of the sampled tokens); under overlap
    scheduling the runner's ``launch`` stands for ``execute`` and the wait, for the step
    launched before, lands in ``update``.

    Attributes:
        reason: why nothing is timed (None when the runner steps in this process).
        records: per timed step, its seconds per phase and in all (``"step"``).
    """

    def __init__(self, engine: Any, clock: StepClock):
        self.clock = clock
        self.records: list[dict[str, float]] = []
        self._spans: dict[str, float] = {}
        self._undo: list[tuple[Any, str, Any]] = []
        runner = engine.runner
        missing = [n for n in ("step_logits", "prepare_inputs", "planner") if not hasattr(runner, n)]
        self.reason = (
            f"the runner ({type(runner).__name__}) has no in-process step to time (no {', '.join(missing)})"
            if missing
            else None
        )
        if self.reason is None:
            self._wrap(engine, "step", self._step_timer)
            # NOTE: under overlap scheduling the engine runs launch (no wait) instead of execute:
            # its span counts as "execute", and the wait for the step before lands in "update".
            execute = clock.method
            for owner, name, span in ((engine.scheduler, "schedule", "schedule"), (runner, execute, "execute"),
                                      (runner, "step_logits", "step_logits"), (runner, "prepare_inputs", "prepare_inputs"),
                                      (runner.planner, "plan", "plan")):  # fmt: skip
                self._wrap(owner, name, functools.partial(self._span_timer, span))

    def _wrap(self, owner: Any, name: str, make: Callable[[Callable], Callable]) -> None:
        """Replace ``owner.name`` by ``make(owner.name)`` until :meth:`close`."""
        self._undo.append((owner, name, owner.__dict__.get(name, _ABSENT)))
        setattr(owner, name, make(getattr(owner, name)))

    def _span_timer(self, name: str, method: Callable) -> Callable:
        spans = self._spans

        def timed(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                spans[name] = spans.get(name, 0.0) + time.perf_counter() - started

        return timed

    def _step_timer(self, step: Callable) -> Callable:
        def timed(*args: Any, **kwargs: Any) -> Any:
            self._spans.clear()
            self.clock.last = None
            started = time.perf_counter()
            out = step(*args, **kwargs)
            seconds = time.perf_counter() - started
            if self.clock.last_decode_only:
                self.records.append(_phases(self._spans, seconds))
            return out

        return timed

    def close(self) -> None:
        for owner, name, before in reversed(self._undo):
            if before is _ABSENT:
                owner.__dict__.pop(name, None)
            else:
                setattr(owner, name, before)
        self._undo.clear()

    def __enter__(self) -> "PhaseClock":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def report(self) -> dict[str, Any]:
        """``host_phases_ms`` (p50 of each phase), ``host_phases_mean_ms`` (means: they add up
        to the mean step), ``host_step_ms`` (the timed steps' summary), ``host_phase_steps``;
        the phases are None with ``host_phases_reason`` when nothing was timed."""
        if self.reason is not None or not self.records:
            reason = self.reason or "no decode-only step was timed"
            return {"host_phases_ms": None, "host_phases_mean_ms": None, "host_step_ms": None,
                    "host_phase_steps": 0, "host_phases_reason": reason}  # fmt: skip
        columns = {name: [r[name] for r in self.records] for name in (*HOST_PHASES, "step")}
        return {
            "host_phases_ms": {name: 1e3 * percentile(columns[name], 50) for name in HOST_PHASES},
            "host_phases_mean_ms": {name: 1e3 * sum(columns[name]) / len(self.records) for name in HOST_PHASES},
            "host_step_ms": summary(columns["step"], 1e3),
            "host_phase_steps": len(self.records),
            "host_phases_reason": None,
        }


def _phases(spans: dict[str, float], seconds: float) -> dict[str, float]:
    """One step's :data:`HOST_PHASES` (and ``"step"``) from its method spans (see :class:`PhaseClock`)."""
    # NOTE: prepare_inputs and plan run inside step_logits, step_logits inside execute, execute
    # inside step: each difference is of nested spans (clamped against float rounding).
    schedule, prepare, plan = spans.get("schedule", 0.0), spans.get("prepare_inputs", 0.0), spans.get("plan", 0.0)
    logits, execute = spans.get("step_logits", 0.0), spans.get("execute", 0.0)
    return {
        "schedule": schedule,
        "prepare_inputs": prepare,
        "plan": plan,
        "forward": max(0.0, logits - prepare - plan),
        "sample": max(0.0, execute - logits),
        "update": max(0.0, seconds - schedule - execute),
        "step": seconds,
    }


def time_graph_replay(runner: Any, batch_size: int, iters: int = REPLAY_ITERS) -> dict[str, Any]:
    """``graph_replay_ms``: GPU milliseconds of one replay of the decode CUDA graph a batch of
    ``batch_size`` replays at (``graph_batch_size``), from ``graph_replay_iters`` replays back
    to back (:meth:`~flotilla.cluster.engine.cuda_graphs.DecodeGraphs.time_replay`); None with
    ``graph_replay_reason`` when the runner has no such graph. Call between steps."""
    graphs = getattr(runner, "graphs", None)
    size = graphs.padded_size(batch_size) if graphs is not None else None
    if size is None:
        if graphs is not None:
            why = f"batch {batch_size} is above the largest captured decode graph ({graphs.max_bs})"
        else:
            why = getattr(runner, "graphs_off_reason", None) or (
                f"the runner ({type(runner).__name__}) holds no decode CUDA graphs in this process"
            )
        return {"graph_replay_ms": None, "graph_batch_size": None, "graph_replay_iters": 0, "graph_replay_reason": why}
    try:
        ms = graphs.time_replay(batch_size, iters)
    except Exception as exc:  # NOTE: a diagnostic must not cost the run its measured results
        return {"graph_replay_ms": None, "graph_batch_size": size, "graph_replay_iters": 0,
                "graph_replay_reason": f"timing the replay failed: {exc!r}"}  # fmt: skip
    return {"graph_replay_ms": ms, "graph_batch_size": size, "graph_replay_iters": iters, "graph_replay_reason": None}


def decode_breakdown(
    replay: dict[str, Any],
    step_ms_p50: float | None,
    phases: PhaseClock,
    weights: WeightBytes,
    kv_bytes_per_token: int,
    peak: float,
    devices: int,
) -> dict[str, Any]:
    """Where a decode step's time goes: :func:`time_graph_replay`'s ``replay`` (the graph alone
    on the device), ``step_wall_ms_p50`` (TPOT p50), ``host_overhead_ms`` (step less replay:
    host time the device waits for), ``graph_mbu`` (``graph_bytes`` / replay / peak) and
    :meth:`PhaseClock.report`'s host phases.

    NOTE: the replay runs padding rows (one token of context, identical rows), so
    ``graph_bytes`` is the weights one token reads plus one KV token per row; a real step's
    further KV and expert reads land in ``host_overhead_ms`` (small at batch 1)."""
    replay_ms = replay["graph_replay_ms"]
    graph_bytes = None
    if replay_ms is not None:
        graph_bytes = weights.per_step(1) + replay["graph_batch_size"] * kv_bytes_per_token
    return {
        **replay,
        "step_wall_ms_p50": step_ms_p50,
        "host_overhead_ms": step_ms_p50 - replay_ms if replay_ms is not None and step_ms_p50 is not None else None,
        "graph_bytes": graph_bytes,
        "graph_mbu": None if replay_ms is None else mbu(graph_bytes, replay_ms / 1e3, peak * devices),
        **phases.report(),
    }


def run_latency(
    engine: Any, clock: StepClock, prompt_batches: Sequence[list[list[int]]], params: Any
) -> tuple[list[BatchTrace], PhaseClock]:
    """Run each batch of prompts to completion (prefix cache forgotten after each); the last
    batch also times its steps' host phases (:class:`PhaseClock`, a few perf_counter calls
    per step)."""
    traces = []
    for prompts in prompt_batches[:-1]:
        traces.append(run_batch(engine, clock, prompts, params))
        reset_prefix_cache(engine)
    with PhaseClock(engine, clock) as phases:
        traces.append(run_batch(engine, clock, prompt_batches[-1], params))
    reset_prefix_cache(engine)
    return traces, phases
