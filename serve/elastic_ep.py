"""Elastic EP on the serve side: the scaler that grows a running engine group.

The layout (``--elastic-ep-backend ray --max-ep-size M`` over ``--tp N --dp N --ep N
--enable-dp-attention --enable-dp-lm-head``): one engine replica holds the whole group,
``tp == dp == ep == N``; growing to ``M`` adds ``M - N`` ranks, each a new DP rank.

- :func:`flotilla.serve.plan.elastic_plan_for` (driver, build time) resolves the
  configuration of every joining group the deployment may ever need into an
  :class:`~flotilla.serve.types.ElasticEPPlan`; nothing is resolved at scale time: the plan
  travels to the replica in ``ServeOptions``.
- :class:`ElasticEPScaler` (engine replica): one scale at a time through
  ``AsyncEngine.grow_elastic_ep``; what the admin API answers is in its errors'
  ``status`` (400 bad size, 409 a scale is running, 500 the join failed, 503 the
  engine is dead). A failed join leaves the group serving at its old size.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Callable

from flotilla.cluster.elastic import ElasticJoinError
from flotilla.resolution import ResolvedConfig
from flotilla.serve.types import ElasticEPPlan, EngineUnavailableError

logger = logging.getLogger(__name__)

# The admin API's body field, and vLLM's spelling of it (accepted as an alias).
NEW_EP_SIZE = "new_ep_size"
NEW_EP_SIZE_ALIAS = "new_data_parallel_size"


# -- errors: what the admin API answers ------------------------------------------------------


class ElasticScaleError(RuntimeError):
    """A scale request that did not grow the group; ``status`` is the HTTP status the
    ingress answers with (OpenAI error envelope), ``code`` its error code.

    Attributes:
        status: 400 (a bad ``new_ep_size``), 409 (a scale is running), 500 (the join
            failed), 503 (the engine is unavailable), 404 (the deployment is not elastic).
        code: the envelope's ``code``.
        param: the request parameter at fault, or None.
    """

    status = 500
    code = "elastic_ep_scale_failed"
    param: str | None = None

    def __reduce__(self):
        return (type(self), (str(self),))


class ScaleRequestError(ElasticScaleError, ValueError):
    """``new_ep_size`` is not a size this deployment can grow to (400)."""

    status = 400
    code = "invalid_new_ep_size"
    param = NEW_EP_SIZE


class ScaleInProgressError(ElasticScaleError):
    """Another scale is running; retry when ``GET /is_scaling_elastic_ep`` says false (409)."""

    status = 409
    code = "elastic_ep_scale_in_progress"


class ScaleFailedError(ElasticScaleError):
    """The join failed (500) or the engine is unavailable (503); the group keeps
    serving at its old size."""

    def __init__(self, message: str, status: int = 500):
        super().__init__(message)
        self.status = status

    def __reduce__(self):
        return (ScaleFailedError, (str(self), self.status))


class ElasticEPDisabledError(ElasticScaleError):
    """The deployment was not started elastic (404)."""

    status = 404
    code = "not_found"


def not_elastic_message(what: str) -> str:
    """The 404 message of an admin route on a deployment that is not elastic."""
    return (
        f"{what}: this deployment is not elastic; start it with --elastic-ep-backend ray and "
        "--max-ep-size larger than --tp-size (with --enable-dp-attention --enable-dp-lm-head)"
    )


# -- the plan ------------------------------------------------------------------------------


# -- the scaler ----------------------------------------------------------------------------

# The loggers of elastic EP's decisions and outcomes (scales, autoscale decisions).
ELASTIC_LOGGERS = ("flotilla.serve.elastic_ep", "flotilla.serve.ep_autoscale", "flotilla.serve.ep_autoscale_driver")


def configure_elastic_log(handler: logging.Handler | None = None) -> None:
    """Let the elastic EP loggers' INFO records (every scale, every autoscale decision with
    its inputs) through, to ``handler`` (default: stderr) when the root logger has no
    handler; for processes whose logging nobody configured, such as a Serve replica
    (whose root logger drops INFO)."""
    if handler is None and not logging.getLogger().handlers:
        handler = logging.StreamHandler()
    if handler is not None:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    for name in ELASTIC_LOGGERS:
        log = logging.getLogger(name)
        log.setLevel(logging.INFO)
        if handler is not None and not log.handlers:
            log.addHandler(handler)
            log.propagate = False


# outcome listener: (ok, time_s on the scaler's clock)
OutcomeListener = Callable[[bool, float], None]


class ElasticEPScaler:
    """Grows one engine's group, one scale at a time (used by the engine replica).

    Args:
        engine: the replica's :class:`~flotilla.serve.async_engine.AsyncEngine` (its
            ``ep_size`` and ``grow_elastic_ep``).
        plan: the deployment's :class:`ElasticEPPlan`.
        metrics: the replica's :class:`~flotilla.serve.metrics.ElasticEPMetrics`, or None.
        clock: the clock of the timings and of the outcome listeners (monotonic seconds).
    """

    def __init__(self, engine: Any, plan: ElasticEPPlan, metrics: Any = None, clock: Callable[[], float] = time.monotonic):
        self.engine, self.plan, self.metrics, self.clock = engine, plan, metrics, clock
        self._scaling = False
        self._last_error: str | None = None
        self._listeners: list[OutcomeListener] = []

    @property
    def ep_size(self) -> int:
        """The EP size serving now."""
        return int(self.engine.ep_size)

    @property
    def is_scaling(self) -> bool:
        """Whether a scale is running (set for the whole of :meth:`scale_to`)."""
        return self._scaling

    @property
    def last_error(self) -> str | None:
        """Why the last join failed; None when it succeeded (or none ran)."""
        return self._last_error

    def state(self) -> dict[str, Any]:
        """``ep_size``, ``max_ep_size``, ``initial``, ``scaling``, ``last_error``."""
        return {
            "ep_size": self.ep_size,
            "max_ep_size": self.plan.max_ep_size,
            "initial": self.plan.initial_size,
            "scaling": self._scaling,
            "last_error": self._last_error,
        }

    def add_outcome_listener(self, listener: OutcomeListener) -> None:
        """Call ``listener(ok, time_s)`` when a scale that started ends (success or
        failure; refused requests are not scales). The autoscaler driver listens, so
        scales an operator requests start its cooldown too."""
        self._listeners.append(listener)

    def check_new_size(self, new_size: Any) -> int:
        """``new_size`` as an int this deployment may grow to from its current size;
        :class:`ScaleRequestError` naming ``new_ep_size``, the value and the limit."""
        if isinstance(new_size, bool) or not isinstance(new_size, int):
            raise ScaleRequestError(f"{NEW_EP_SIZE} must be an integer (got {NEW_EP_SIZE}={new_size!r})")
        if new_size < 1:
            raise ScaleRequestError(f"{NEW_EP_SIZE} must be at least 1 (got {NEW_EP_SIZE}={new_size})")
        if new_size > self.plan.max_ep_size:
            raise ScaleRequestError(
                f"{NEW_EP_SIZE}={new_size} exceeds this deployment's max_ep_size={self.plan.max_ep_size} "
                "(--max-ep-size); ask for a size up to it"
            )
        current = self.ep_size
        if new_size <= current:
            top = self.plan.max_ep_size
            hint = f"ask for a size in {current + 1}..{top}" if current < top else f"it is already at max_ep_size={top}"
            raise ScaleRequestError(
                f"{NEW_EP_SIZE}={new_size} is not above the current ep_size={current}: elastic EP only grows "
                f"(no scale-down); {hint}"
            )
        return new_size

    async def scale_to(self, new_size: Any) -> dict[str, Any]:
        """Grow the group to ``new_size`` ranks; returns ``message``, ``old_ep_size``,
        ``new_ep_size`` and the timings (``scale_s``: request to serving at the new size;
        ``prepare_s``, ``commit_pause_s``, ``total_s`` as the engine reports them).

        Raises :class:`ScaleInProgressError` (another scale is running),
        :class:`ScaleRequestError` (bad size), :class:`ScaleFailedError` (the join failed
        or the engine is unavailable; the group keeps serving at its old size; logged at
        ERROR and counted in ``ep_scale_total{outcome="failure"}``). A caller that is
        cancelled (the client left) does not cancel the scale: it runs to its end.
        """
        if self._scaling:
            raise ScaleInProgressError(
                f"an elastic EP scale is already running (ep_size={self.ep_size}); retry when "
                "GET /is_scaling_elastic_ep answers false"
            )
        new = self.check_new_size(new_size)
        old = self.ep_size
        joiner = self.plan.joiner_config(old, new)
        # NOTE: set before the first await, so a concurrent call sees it; the task clears it.
        self._scaling = True
        try:
            task = asyncio.ensure_future(self._grow(joiner, old, new, self.clock()))
            # NOTE: a caller that left never reads the outcome; it is logged and counted already.
            task.add_done_callback(lambda t: t.cancelled() or t.exception())
        except BaseException:
            self._scaling = False
            raise
        return await asyncio.shield(task)

    async def _grow(self, joiner: ResolvedConfig, old: int, new: int, start: float) -> dict[str, Any]:
        ok = False
        try:
            logger.info("elastic EP: scaling %d -> %d (timeout %.0f s)", old, new, self.plan.scale_timeout_s)
            try:
                report = await self.engine.grow_elastic_ep(joiner, new, self.plan.scale_timeout_s)
            except Exception as exc:  # noqa: BLE001 - every failure is reported, none kills the replica
                raise self._failed(exc, old, new) from exc
            ok = True
            scale_s = self.clock() - start
            self._last_error = None
            timings = {name: float(getattr(report, name)) for name in ("prepare_s", "commit_pause_s", "total_s")}
            if self.metrics is not None:
                self.metrics.record_scale(True, scale_s, timings["commit_pause_s"])
            logger.info(
                "elastic EP: scaled %d -> %d in %.2f s (prepare %.2f s, commit pause %.3f s)",
                old, new, scale_s, timings["prepare_s"], timings["commit_pause_s"],
            )
            return {
                "message": f"scaled elastic EP from {old} to {new} ranks",
                "old_ep_size": old,
                "new_ep_size": new,
                "scale_s": scale_s,
                **timings,
            }
        finally:
            self._scaling = False
            self._notify(ok)

    def _failed(self, exc: Exception, old: int, new: int) -> ScaleFailedError:
        """The error of a join that raised ``exc`` (logged at ERROR, counted)."""
        status = 503 if isinstance(exc, EngineUnavailableError) else 500
        reason = str(exc) or type(exc).__name__
        self._last_error = reason
        if self.metrics is not None:
            self.metrics.record_scale(False)
        if isinstance(exc, (ElasticJoinError, EngineUnavailableError)):
            logger.error("elastic EP: scaling %d -> %d failed: %s; serving at ep_size=%d", old, new, reason, old)
        else:
            logger.exception("elastic EP: scaling %d -> %d failed unexpectedly; serving at ep_size=%d", old, new, old)
        return ScaleFailedError(
            f"scaling elastic EP from {old} to {new} ranks failed: {reason}; the deployment keeps serving at "
            f"ep_size={old}",
            status,
        )

    def _notify(self, ok: bool) -> None:
        now = self.clock()
        for listener in self._listeners:
            try:
                listener(ok, now)
            except Exception:  # noqa: BLE001 - a listener never breaks a scale's answer
                logger.exception("elastic EP: outcome listener %r failed", listener)
