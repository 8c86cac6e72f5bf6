"""The elastic EP autoscaler's driver: an asyncio task in the engine replica that feeds the
pure policy (:mod:`flotilla.serve.ep_autoscale`) and carries out its decisions.

Every ``interval_s`` it builds a :class:`~flotilla.serve.ep_autoscale.LoadSample` from the
engine's load snapshot (waiting, running, KV usage), the TTFT p90 of the requests whose
first token came since the previous sample (from the replica's metrics), the EP size and
whether a scale is running; on a :class:`~flotilla.serve.ep_autoscale.ScaleDecision` it
calls :meth:`ElasticEPScaler.scale_to` itself (the replica is where the group lives, so
no HTTP round trip). Outcomes reach the policy through the scaler's outcome listener, so
a scale an operator requested through ``POST /scale_elastic_ep`` starts the cooldown too.

Off unless ``ServeOptions.elastic_autoscale.enabled`` (``flotilla serve
--elastic-ep-autoscale``); :meth:`ElasticEPAutoscaleDriver.stop` cancels it on replica
shutdown. :func:`elastic_autoscale_options` reads those options from the
``--elastic-ep-autoscale-*`` flags (or the ``serve run`` arguments of the same names).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from typing import Any, Callable, Mapping

from flotilla.resolution import ArgumentError
from flotilla.serve.ep_autoscale import AutoscalePolicyConfig, ElasticEPAutoscaler, LoadSample, ScaleDecision
from flotilla.serve.types import ElasticAutoscaleOptions

logger = logging.getLogger(__name__)

# The elastic EP autoscaler's arguments (``flotilla serve --elastic-ep-autoscale-*`` flags,
# build() arguments of the same names) -> ElasticAutoscaleOptions fields.
AUTOSCALE_ARGS = {
    "elastic_ep_autoscale": "enabled",
    "elastic_ep_autoscale_interval": "interval_s",
    "elastic_ep_autoscale_waiting_per_rank": "waiting_per_rank_threshold",
    "elastic_ep_autoscale_kv_usage": "kv_usage_threshold",
    "elastic_ep_autoscale_ttft_p90": "ttft_p90_threshold_s",
    "elastic_ep_autoscale_window": "window_s",
    "elastic_ep_autoscale_cooldown": "cooldown_s",
    "elastic_ep_autoscale_step": "step",
}
# Thresholds a value of "off" (or "none") turns off.
_AUTOSCALE_THRESHOLDS = ("waiting_per_rank_threshold", "kv_usage_threshold", "ttft_p90_threshold_s")


def elastic_autoscale_options(args: Mapping[str, Any]) -> ElasticAutoscaleOptions:
    """:class:`ElasticAutoscaleOptions` from :data:`AUTOSCALE_ARGS` (strings as on the
    command line, or typed values; None or absent: the default). A threshold of
    ``off`` (or ``none``) turns its signal off. Raises :class:`ArgumentError` naming the
    flag and value, also for a knob given without ``--elastic-ep-autoscale``."""
    values: dict[str, Any] = {}
    for name, value in args.items():
        if name not in AUTOSCALE_ARGS or value is None:
            continue
        field_name, flag = AUTOSCALE_ARGS[name], _flag(name)
        text = str(value).strip().lower()
        try:
            if field_name == "enabled":
                if text not in ("true", "false", "1", "0", "yes", "no"):
                    raise ValueError
                values[field_name] = text in ("true", "1", "yes")
            elif field_name in _AUTOSCALE_THRESHOLDS and text in ("off", "none"):
                values[field_name] = None
            elif field_name == "step":
                values[field_name] = int(text)
            else:
                values[field_name] = float(text)
        except ValueError:
            want = {"enabled": "true or false", "step": "an integer"}.get(field_name, "a number")
            if field_name in _AUTOSCALE_THRESHOLDS:
                want += " or off"
            raise ArgumentError(f"{flag} expects {want}, got {value!r}") from None
    if not values.get("enabled", False):
        knobs = [_flag(n) for n, v in args.items() if n in AUTOSCALE_ARGS and n != "elastic_ep_autoscale" and v is not None]
        if knobs:
            raise ArgumentError(f"{', '.join(knobs)} need --elastic-ep-autoscale")
    try:
        return ElasticAutoscaleOptions(**values)
    except ValueError as exc:
        message = str(exc)
        for name, field_name in AUTOSCALE_ARGS.items():
            if f"{field_name}=" in message:
                message = f"{_flag(name)}: {message}"
                break
        raise ArgumentError(message) from None


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def p90(values: list[float]) -> float | None:
    """The 90th percentile of ``values`` (nearest rank), or None when empty."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, math.ceil(0.9 * len(ordered)) - 1)]


class ElasticEPAutoscaleDriver:
    """Samples one replica's load every ``interval_s`` and grows its group when the policy
    says so.

    Args:
        engine: the replica's AsyncEngine (``load()``, ``metrics.ttfts_since``).
        scaler: the replica's :class:`~flotilla.serve.elastic_ep.ElasticEPScaler`.
        policy: the autoscaling policy (its ``max_ep_size`` is the deployment's).
        interval_s: seconds between samples (> 0).
        clock: monotonic seconds; the same clock as the scaler's (its outcome times).
    """

    def __init__(
        self,
        engine: Any,
        scaler: Any,
        policy: AutoscalePolicyConfig,
        interval_s: float,
        clock: Callable[[], float] = time.monotonic,
    ):
        if isinstance(interval_s, bool) or not isinstance(interval_s, (int, float)) or not interval_s > 0:
            raise ValueError(f"interval_s must be a number of seconds > 0 (got interval_s={interval_s!r})")
        self.engine, self.scaler, self.interval_s, self.clock = engine, scaler, float(interval_s), clock
        self.autoscaler = ElasticEPAutoscaler(policy)
        self._ttft_cursor = 0
        self._task: asyncio.Task | None = None
        scaler.add_outcome_listener(self.autoscaler.record_outcome)

    def sample(self) -> LoadSample:
        """The load now; the TTFTs are those observed since the previous sample (the
        first sample takes every one kept)."""
        now = self.clock()
        load = self.engine.load()
        ttfts, self._ttft_cursor = self.engine.metrics.ttfts_since(self._ttft_cursor)
        return LoadSample(
            time_s=now,
            ep_size=self.scaler.ep_size,
            waiting=int(load.waiting),
            running=int(load.running),
            kv_usage=min(1.0, max(0.0, float(load.kv_usage))),
            ttft_p90_s=p90(ttfts),
            scaling=self.scaler.is_scaling,
        )

    async def tick(self) -> ScaleDecision | None:
        """Take one sample and act on the decision; returns the decision (None: hold).
        A scale that fails or is refused is logged (the scaler counts and logs a failed
        join at ERROR); the driver goes on."""
        from flotilla.serve.elastic_ep import ElasticScaleError

        decision = self.autoscaler.observe(self.sample())
        if decision is None:
            return None
        try:
            await self.scaler.scale_to(decision.new_ep_size)
        except ElasticScaleError as exc:
            logger.warning("ep autoscale: scale to %d did not happen: %s", decision.new_ep_size, exc)
        return decision

    async def run_forever(self) -> None:
        """:meth:`tick` every ``interval_s`` until cancelled."""
        while True:
            try:
                await self.tick()
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - the driver must outlive a bad sample
                logger.exception("ep autoscale: a tick failed; trying again in %.1f s", self.interval_s)
            await asyncio.sleep(self.interval_s)

    def start(self) -> asyncio.Task:
        """Run :meth:`run_forever` as a task of the running event loop (idempotent)."""
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self.run_forever(), name="flotilla-ep-autoscale")
            logger.info(
                "ep autoscale: on, a sample every %.1f s, policy %s", self.interval_s, self.autoscaler.config
            )
        return self._task

    def stop(self) -> None:
        """Cancel the task (a scale it started runs on to its end); idempotent."""
        if self._task is not None:
            self._task.cancel()
            self._task = None
