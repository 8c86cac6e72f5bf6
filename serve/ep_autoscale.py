"""The elastic EP autoscaling policy: when to ask a running expert-parallel deployment to grow.

Pure policy (no Ray, no torch, no I/O besides ``logging``). A driver samples the
deployment's load every few seconds, hands each :class:`LoadSample` to
:meth:`ElasticEPAutoscaler.observe`, and on a :class:`ScaleDecision` sends
``POST /scale_elastic_ep`` with :meth:`ScaleDecision.request_body` (the vLLM/SGLang admin
API); it reports how the scale ended with :meth:`ElasticEPAutoscaler.record_outcome`.

The rules:

- A sample is *above* when at least one enabled signal exceeds its threshold (strictly):
  waiting requests per DP rank (``waiting / ep_size``: in the elastic layout
  ep == dp, so each EP rank is one DP rank), the KV usage fraction, or the TTFT p90 of
  the requests that finished prefill in the sample. A sample with no TTFT (no request
  finished) is judged by the other signals only. :func:`signals_above` names them.
- *Pressure* is a run of consecutive above samples spanning at least ``window_s``
  (first to last sample of the run), with no gap between samples longer than
  ``max_sample_gap_s`` (a stalled sampler is not evidence of sustained load). Different
  samples may be above on different signals. A sample that is not above, a gap, a
  sample taken while a scale is in progress, or a change of ``ep_size`` restarts the run:
  load measured during a commit pause or at the old size says nothing about the
  capacity now. A scale request or outcome restarts it too (its evidence is spent).
- No request while a scale is in progress (``sample.scaling``), within ``cooldown_s``
  of the last scale request or of the last outcome (success or failure alike), or at
  ``max_ep_size``. The target is ``ep_size + step`` clamped to ``max_ep_size``.
  Evidence keeps accumulating during the cooldown, so a deployment still overloaded at
  its new size (for a full window) scales again as soon as the cooldown ends.
- Every decision is logged with its inputs (``logging.getLogger(__name__)``, the inputs
  also as the record's ``ep_autoscale`` attribute): scale requests at INFO, holds at
  DEBUG, except a hold at ``max_ep_size`` under pressure, at INFO once per window.

Memory is bounded: the window keeps only the current run's samples from the last
``window_s`` (at most ``MAX_WINDOW_SAMPLES``); the run's start is kept apart, so dropping
old samples never shortens the run. Not thread-safe: one driver owns an autoscaler.
"""

from __future__ import annotations

import logging
import math
from collections import deque
from dataclasses import asdict, dataclass, field
from typing import Any

logger = logging.getLogger(__name__)

# A hard bound on the samples kept for one window (a runaway sampling rate only coarsens
# the logged summary; the decision depends on the run's start and its latest sample).
MAX_WINDOW_SAMPLES = 4096

# Hold reasons (the first word of a hold's log line and the ``hold`` key of its inputs).
HOLD_SCALING = "scaling"
HOLD_COOLDOWN = "cooldown"
HOLD_BELOW = "below_thresholds"
HOLD_WINDOW = "window_not_full"
HOLD_AT_MAX = "at_max_ep_size"


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return _is_int(value) or (isinstance(value, float) and math.isfinite(value))


@dataclass(frozen=True)
class AutoscalePolicyConfig:
    """When the autoscaler asks for a join. A threshold of None turns its signal off.

    Attributes:
        max_ep_size: the EP size never to exceed (``--max-ep-size``).
        waiting_per_rank_threshold: waiting (queued, unscheduled) requests per DP rank
            above which a sample is under pressure; 0 means any queued request.
        kv_usage_threshold: KV usage fraction above which a sample is under pressure, in (0, 1).
        ttft_p90_threshold_s: TTFT p90 (seconds) above which a sample is under pressure.
        window_s: how long (seconds) every sample must stay above before a join is requested.
        cooldown_s: no request within this long (seconds) of the last scale request or outcome.
        step: ranks to add per join.
        max_sample_gap_s: a gap between samples longer than this (seconds) restarts the window.
    """

    max_ep_size: int
    waiting_per_rank_threshold: float | None = 4.0
    kv_usage_threshold: float | None = 0.85
    ttft_p90_threshold_s: float | None = 2.0
    window_s: float = 60.0
    cooldown_s: float = 300.0
    step: int = 1
    max_sample_gap_s: float = 15.0

    def __post_init__(self) -> None:
        def check(name: str, ok: bool, want: str) -> None:
            value = getattr(self, name)
            _require(ok, f"AutoscalePolicyConfig.{name} must be {want} (got {name}={value!r})")

        w, kv, t = self.waiting_per_rank_threshold, self.kv_usage_threshold, self.ttft_p90_threshold_s
        check("max_ep_size", _is_int(self.max_ep_size) and self.max_ep_size >= 1, "an integer >= 1 (--max-ep-size)")
        check("step", _is_int(self.step) and self.step >= 1, "an integer >= 1")
        check("waiting_per_rank_threshold", w is None or (_is_number(w) and w >= 0), "a number >= 0, or None (off)")
        check("kv_usage_threshold", kv is None or (_is_number(kv) and 0 < kv < 1), "a fraction in (0, 1), or None (off)")
        check("ttft_p90_threshold_s", t is None or (_is_number(t) and t > 0), "a number of seconds > 0, or None (off)")
        check("window_s", _is_number(self.window_s) and self.window_s > 0, "a number of seconds > 0")
        check("cooldown_s", _is_number(self.cooldown_s) and self.cooldown_s >= 0, "a number of seconds >= 0")
        check("max_sample_gap_s", _is_number(self.max_sample_gap_s) and self.max_sample_gap_s > 0, "a number of seconds > 0")
        _require(
            not (w is None and kv is None and t is None),
            "AutoscalePolicyConfig needs at least one signal: waiting_per_rank_threshold, kv_usage_threshold "
            "and ttft_p90_threshold_s are all None, so the autoscaler could never scale",
        )


@dataclass(frozen=True)
class LoadSample:
    """The deployment's load at one instant, summed over its DP ranks.

    Attributes:
        time_s: when it was taken (any monotonic clock, seconds); samples come in time order.
        ep_size: the EP size serving when it was taken.
        waiting: requests queued, not yet scheduled, over all ranks.
        running: requests being generated, over all ranks (logged, not a signal).
        kv_usage: KV blocks in use as a fraction of all, in [0, 1] (the deployment-wide fraction).
        ttft_p90_s: TTFT p90 of the requests whose first token came since the previous sample;
            None when none did.
        scaling: a scale is in progress (``GET /is_scaling_elastic_ep``).
    """

    time_s: float
    ep_size: int
    waiting: int = 0
    running: int = 0
    kv_usage: float = 0.0
    ttft_p90_s: float | None = None
    scaling: bool = False

    def __post_init__(self) -> None:
        def check(name: str, ok: bool, want: str) -> None:
            value = getattr(self, name)
            _require(ok, f"LoadSample.{name} must be {want} (got {name}={value!r})")

        check("time_s", _is_number(self.time_s), "a finite number of seconds")
        check("ep_size", _is_int(self.ep_size) and self.ep_size >= 1, "an integer >= 1")
        check("waiting", _is_int(self.waiting) and self.waiting >= 0, "an integer >= 0")
        check("running", _is_int(self.running) and self.running >= 0, "an integer >= 0")
        check("kv_usage", _is_number(self.kv_usage) and 0 <= self.kv_usage <= 1, "a fraction in [0, 1]")
        t = self.ttft_p90_s
        check("ttft_p90_s", t is None or (_is_number(t) and t >= 0), "a number of seconds >= 0, or None")
        check("scaling", isinstance(self.scaling, bool), "a bool")

    @property
    def waiting_per_rank(self) -> float:
        """Waiting requests per DP rank (ep == dp in the elastic layout)."""
        return self.waiting / self.ep_size


@dataclass(frozen=True)
class ScaleDecision:
    """A join to request: grow to ``new_ep_size``; ``reason`` says why in words and
    ``inputs`` holds what justified it (the window's summary, the latest sample, the policy)."""

    new_ep_size: int
    reason: str
    inputs: dict[str, Any] = field(compare=False)

    def request_body(self) -> dict[str, int]:
        """The body of ``POST /scale_elastic_ep``."""
        return {"new_ep_size": self.new_ep_size}


def signals_above(sample: LoadSample, config: AutoscalePolicyConfig) -> tuple[str, ...]:
    """The names of the enabled signals that ``sample`` shows above their thresholds."""
    above = []
    if config.waiting_per_rank_threshold is not None and sample.waiting_per_rank > config.waiting_per_rank_threshold:
        above.append("waiting_per_rank")
    if config.kv_usage_threshold is not None and sample.kv_usage > config.kv_usage_threshold:
        above.append("kv_usage")
    t = config.ttft_p90_threshold_s
    if t is not None and sample.ttft_p90_s is not None and sample.ttft_p90_s > t:
        above.append("ttft_p90_s")
    return tuple(above)


class ElasticEPAutoscaler:
    """Watches load samples and decides when to request a join (see the module docstring)."""

    def __init__(self, config: AutoscalePolicyConfig):
        self.config = config
        self._policy = asdict(config)
        self._window: deque[tuple[LoadSample, tuple[str, ...]]] = deque(maxlen=MAX_WINDOW_SAMPLES)
        self._run_start_s: float | None = None  # first sample of the current run of above samples
        self._last_time_s: float | None = None
        self._last_ep_size: int | None = None
        self._last_scale_s: float | None = None  # the last scale request or outcome
        self._at_max_logged_s: float | None = None

    def observe(self, sample: LoadSample) -> ScaleDecision | None:
        """Take one sample; return the join to request, or None to hold.

        Raises ValueError for a sample older than the previous one or an ``ep_size``
        beyond ``max_ep_size`` (the autoscaler was built for another deployment).
        """
        cfg = self.config
        _require(
            self._last_time_s is None or sample.time_s >= self._last_time_s,
            f"LoadSample.time_s={sample.time_s!r} is older than the previous sample's time_s={self._last_time_s!r}; "
            "feed samples in time order from one monotonic clock",
        )
        _require(
            sample.ep_size <= cfg.max_ep_size,
            f"LoadSample.ep_size={sample.ep_size} exceeds max_ep_size={cfg.max_ep_size}; "
            "build the autoscaler from the deployment's own --max-ep-size",
        )
        above = signals_above(sample, cfg)
        self._extend_run(sample, above)
        self._last_time_s, self._last_ep_size = sample.time_s, sample.ep_size

        now = sample.time_s
        inputs = self._inputs(sample, above)
        if sample.scaling:
            return self._hold(HOLD_SCALING, "a scale is in progress", inputs)
        if self._last_scale_s is not None and now < self._last_scale_s + cfg.cooldown_s:
            left = self._last_scale_s + cfg.cooldown_s - now
            return self._hold(HOLD_COOLDOWN, f"{left:.1f} s of cooldown left", inputs)
        if not above:
            return self._hold(HOLD_BELOW, "no signal above its threshold", inputs)
        run_s = now - self._run_start_s
        if run_s < cfg.window_s:
            return self._hold(HOLD_WINDOW, f"above for {run_s:.1f} s of a {cfg.window_s:g} s window", inputs)
        if sample.ep_size >= cfg.max_ep_size:
            loud = self._at_max_logged_s is None or now - self._at_max_logged_s >= cfg.window_s
            if loud:
                self._at_max_logged_s = now
            why = f"would scale ({self._pressure_reason(run_s)}) but ep_size is at max_ep_size={cfg.max_ep_size}"
            return self._hold(HOLD_AT_MAX, why, inputs, level=logging.INFO if loud else logging.DEBUG)

        new_size = min(sample.ep_size + cfg.step, cfg.max_ep_size)
        reason = self._pressure_reason(run_s)
        inputs["new_ep_size"] = new_size
        decision = ScaleDecision(new_size, reason, inputs)
        logger.info(
            "ep autoscale: request scale %d -> %d: %s | inputs=%s",
            sample.ep_size, new_size, reason, inputs, extra={"ep_autoscale": inputs},
        )
        self._last_scale_s = now
        self._restart_run()
        return decision

    def record_outcome(self, ok: bool, time_s: float) -> None:
        """Report how the last scale ended (at ``time_s``, the samples' clock); the cooldown
        restarts from it whether it succeeded or failed. Report scales an operator requested
        through the admin API too, so the autoscaler does not pile a join onto theirs."""
        _require(isinstance(ok, bool), f"record_outcome: ok must be a bool (got ok={ok!r})")
        _require(_is_number(time_s), f"record_outcome: time_s must be a finite number of seconds (got time_s={time_s!r})")
        self._last_scale_s = time_s if self._last_scale_s is None else max(self._last_scale_s, time_s)
        self._restart_run()
        inputs = {"ok": ok, "time_s": time_s, "cooldown_until_s": self._last_scale_s + self.config.cooldown_s}
        logger.log(
            logging.INFO if ok else logging.WARNING,
            "ep autoscale: scale %s; cooldown until %.1f | inputs=%s",
            "succeeded" if ok else "failed", inputs["cooldown_until_s"], inputs, extra={"ep_autoscale": inputs},
        )

    # -- the window ----------------------------------------------------------------

    def _extend_run(self, sample: LoadSample, above: tuple[str, ...]) -> None:
        gap = self._last_time_s is not None and sample.time_s - self._last_time_s > self.config.max_sample_gap_s
        resized = self._last_ep_size is not None and sample.ep_size != self._last_ep_size
        if not above or sample.scaling or gap or resized:
            self._restart_run()
        if above and not sample.scaling:
            if self._run_start_s is None:
                self._run_start_s = sample.time_s
            self._window.append((sample, above))
        # NOTE: keep one sample at or before the window's start, so the summary covers it all.
        horizon = sample.time_s - self.config.window_s
        while len(self._window) > 1 and self._window[1][0].time_s <= horizon:
            self._window.popleft()

    def _restart_run(self) -> None:
        self._window.clear()
        self._run_start_s = None

    def _pressure_reason(self, run_s: float) -> str:
        n = len(self._window)
        parts = []
        for name, threshold in self._thresholds().items():
            k = sum(name in a for _, a in self._window)
            if k:
                parts.append(f"{name} above {threshold:g} in {k}/{n} samples")
        return f"{', '.join(parts)}; every sample above for {run_s:.1f} s (window {self.config.window_s:g} s)"

    def _thresholds(self) -> dict[str, float | None]:
        cfg = self.config
        return {
            "waiting_per_rank": cfg.waiting_per_rank_threshold,
            "kv_usage": cfg.kv_usage_threshold,
            "ttft_p90_s": cfg.ttft_p90_threshold_s,
        }

    def _inputs(self, sample: LoadSample, above: tuple[str, ...]) -> dict[str, Any]:
        """What a decision rests on: the latest sample, the run so far, and the policy."""
        samples = [s for s, _ in self._window]
        ttfts = [s.ttft_p90_s for s in samples if s.ttft_p90_s is not None]
        return {
            "sample": asdict(sample),
            "waiting_per_rank": sample.waiting_per_rank,
            "above": list(above),
            "run_start_s": self._run_start_s,
            "window_samples": len(samples),
            "window_min": {
                "waiting_per_rank": min((s.waiting_per_rank for s in samples), default=None),
                "kv_usage": min((s.kv_usage for s in samples), default=None),
                "ttft_p90_s": min(ttfts, default=None),
            },
            "last_scale_s": self._last_scale_s,
            "policy": dict(self._policy),
        }

    def _hold(self, hold: str, why: str, inputs: dict[str, Any], level: int = logging.DEBUG) -> None:
        inputs["hold"] = hold
        if logger.isEnabledFor(level):
            logger.log(level, "ep autoscale: hold (%s): %s | inputs=%s", hold, why, inputs,
                       extra={"ep_autoscale": inputs})
        return None
