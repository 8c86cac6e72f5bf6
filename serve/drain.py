"""Graceful drain of a ``flotilla serve`` deployment (``--shutdown-timeout``).

Serve stops a replica gracefully only when the replica alone goes (a redeploy, a scale-down,
``serve delete``): the routers stop picking it, it finishes its ongoing requests for up to
its ``graceful_shutdown_timeout_s`` and is killed after. ``serve.shutdown()`` kills the HTTP
proxy in its first control-loop tick (Ray 2.60), which cuts every stream at once whatever
the replicas' timeouts say, and Serve offers no hook at the start of a replica's drain. So
``flotilla serve`` drains the application itself on SIGTERM or Ctrl-C, before it removes it:

1. At deploy, the driver creates a :class:`DrainBoard`, one small named actor
   (:data:`DRAIN_BOARD_NAME` in :data:`DRAIN_BOARD_NAMESPACE`) that dies with the driver.
2. Every ingress replica runs a :class:`DrainWatch`: it long-polls the board
   (:meth:`DrainBoard.wait_for_drain`), so the drain reaches it at once.
3. On the signal the driver calls :func:`drain`: the board's state turns to a
   :class:`DrainState` (why, and until when). The ingress answers every new request
   (``/health`` included, ``/metrics`` excepted) 503 with ``Retry-After`` and the reason,
   lets its in-flight requests run, and reports how many are left every
   :data:`REPORT_INTERVAL_S`.
4. When the ingress replicas report none left, or the deadline passes, the driver goes on
   to ``serve.shutdown()`` (or ``serve.delete``). At the deadline the ingress ends each
   stream still running with an error frame naming the timeout (never a cut connection)
   and answers a request still waiting for its first byte 503.

Under ``serve run`` or KubeRay there is no driver and no board: the watches find none and
the ingress serves as before; Serve's own replica drain applies.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import sys
import time
from typing import Any

logger = logging.getLogger(__name__)

DRAIN_BOARD_NAME = "flotilla-drain-board"
# NOTE: the metrics hub's namespace: the driver and the replicas find the same board.
DRAIN_BOARD_NAMESPACE = "flotilla"
# How long one long-poll of the board waits before it is renewed.
WATCH_POLL_S = 30.0
# How often a draining ingress replica reports its in-flight requests.
REPORT_INTERVAL_S = 0.2
# How often a watch looks for a board that is not there (no driver: `serve run`, KubeRay).
LOOKUP_RETRY_S = 5.0
# A watch whose last report is older than this is taken for gone (its replica died).
STALE_REPORT_S = 5.0
# Bound on each of the driver's calls to the board.
BOARD_CALL_TIMEOUT_S = 10.0
# After the deadline the ingress ends what still runs with error frames; the driver gives
# those frames this long to leave before the proxy goes.
CUT_GRACE_S = 2.0


@dataclasses.dataclass(frozen=True)
class DrainState:
    """A drain under way: ``reason`` (what the client is told) and ``deadline`` (wall-clock
    ``time.time()`` after which what still runs is ended), ``timeout_s`` the drain's length."""

    reason: str
    deadline: float
    timeout_s: float

    def remaining_s(self, now: float | None = None) -> float:
        return max(0.0, self.deadline - (time.time() if now is None else now))

    def retry_after_s(self, now: float | None = None) -> int:
        """The ``Retry-After`` of a refused request: when this server is gone (at least 1 s)."""
        return max(1, math.ceil(self.remaining_s(now)))


class DrainBoard:
    """Where the driver announces a drain and the ingress replicas report their in-flight
    requests (a plain class; :func:`start_drain_board` makes it a named Ray actor).
    ``clock``: the monotonic clock of the reports' ages (tests pass their own)."""

    def __init__(self, clock: Any = time.monotonic) -> None:
        self._clock = clock
        self._state: DrainState | None = None
        self._began = asyncio.Event()
        self._watchers: set[str] = set()
        # ingress id -> (the clock's time of its report, in-flight requests)
        self._reports: dict[str, tuple[float, int]] = {}
        self._began_at = 0.0

    async def wait_for_drain(self, ingress_id: str, timeout_s: float = WATCH_POLL_S) -> DrainState | None:
        """The drain's state once it begins, or None after ``timeout_s`` without one."""
        self._watchers.add(ingress_id)
        try:
            await asyncio.wait_for(self._began.wait(), timeout_s)
        except asyncio.TimeoutError:
            return None
        return self._state

    def begin(self, reason: str, timeout_s: float) -> DrainState:
        """Start the drain (once; a second call returns the first's state)."""
        if self._state is None:
            self._state = DrainState(reason=reason, deadline=time.time() + timeout_s, timeout_s=float(timeout_s))
            self._began_at = self._clock()
            self._began.set()
        return self._state

    def report(self, ingress_id: str, in_flight: int) -> None:
        self._watchers.add(ingress_id)
        self._reports[ingress_id] = (self._clock(), int(in_flight))

    def in_flight(self) -> dict[str, int | None]:
        """Each live watch's in-flight requests since the drain began (None: not reported
        yet). A watch silent for :data:`STALE_REPORT_S` (since the drain began, or since its
        last report) is left out: its replica is gone."""
        now = self._clock()
        out: dict[str, int | None] = {}
        for ingress_id in self._watchers:
            at, count = self._reports.get(ingress_id, (None, 0))
            if at is None or at < self._began_at:
                if now - self._began_at < STALE_REPORT_S:
                    out[ingress_id] = None
            elif now - at < STALE_REPORT_S:
                out[ingress_id] = count
        return out


def start_drain_board() -> Any:
    """Create the board (or find the one there); the driver calls it before deploying. The
    actor is not detached: it dies with the driver, and the watches then stop finding it."""
    import ray

    actor = ray.remote(num_cpus=0, max_concurrency=1000)(DrainBoard)
    return actor.options(name=DRAIN_BOARD_NAME, namespace=DRAIN_BOARD_NAMESPACE, get_if_exists=True).remote()


@dataclasses.dataclass(frozen=True)
class DrainOutcome:
    """How a :func:`drain` went: ``waited_s``; ``timed_out``, whether the deadline passed with
    requests in flight (the ingress then ended them with an error); ``left``, the in-flight
    requests the ingress replicas still reported at the end (0 once the cut ones ended)."""

    waited_s: float
    timed_out: bool
    left: int


def drain(board: Any, timeout_s: float, reason: str, poll_s: float = REPORT_INTERVAL_S) -> DrainOutcome:
    """Announce the drain on ``board`` and wait until the ingress replicas report no request
    in flight, or ``timeout_s`` (plus :data:`CUT_GRACE_S` for the error frames of what the
    ingress ended at the deadline) has passed."""
    import ray

    start = time.monotonic()
    ray.get(board.begin.remote(reason, float(timeout_s)), timeout=BOARD_CALL_TIMEOUT_S)
    deadline = start + timeout_s
    left = 0
    while True:
        counts = ray.get(board.in_flight.remote(), timeout=BOARD_CALL_TIMEOUT_S)
        unknown = sum(1 for count in counts.values() if count is None)
        left = sum(count for count in counts.values() if count is not None)
        now = time.monotonic()
        if not unknown and not left:
            break
        if now >= deadline + CUT_GRACE_S:
            break
        time.sleep(poll_s)
    return DrainOutcome(waited_s=now - start, timed_out=now >= deadline, left=left)


class DrainWatch:
    """An ingress replica's view of the drain: :attr:`state` (None while serving) and the
    requests it counts in flight: :meth:`enter` gives each a future that resolves when the
    drain's deadline passes (the request is then cut), :meth:`leave` ends it. :meth:`start`
    begins the long-poll on the running event loop; it does nothing outside a Serve replica."""

    def __init__(self, ingress_id: str):
        self.ingress_id = ingress_id
        self.state: DrainState | None = None
        self._task: asyncio.Task | None = None
        self._checked = False
        # NOTE: one future per request in flight, each on its request's loop (tests run several).
        self._cuts: set[asyncio.Future] = set()

    @property
    def in_flight(self) -> int:
        return len(self._cuts)

    def start(self) -> None:
        """Start watching when this process is a Serve replica and an event loop runs (checked
        once: the ingress calls it when it builds its app, and on every request)."""
        if self._checked:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return  # NOTE: no loop yet: the first request starts it
        self._checked = True
        if _in_serve_replica():
            self._task = loop.create_task(self._watch())

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()

    def enter(self) -> asyncio.Future:
        """Count a request in flight; the future resolves when the drain's deadline passes."""
        cut = asyncio.get_running_loop().create_future()
        self._cuts.add(cut)
        if self.state is not None:
            self._arm(cut)
        return cut

    def leave(self, cut: asyncio.Future) -> None:
        self._cuts.discard(cut)
        cut.cancel()

    def begin(self, state: DrainState) -> None:
        """Drain now (what the long-poll does when the board answers; tests call it)."""
        if self.state is not None:
            return
        self.state = state
        logger.warning(
            "ingress %s: draining (%s): new requests get 503; %d in flight, %.0f s to finish",
            self.ingress_id, state.reason, self.in_flight, state.remaining_s(),
        )  # fmt: skip
        for cut in list(self._cuts):
            self._arm(cut)

    def _arm(self, cut: asyncio.Future) -> None:
        cut.get_loop().call_later(self.state.remaining_s(), _resolve, cut)

    async def _watch(self) -> None:
        import ray

        board = None
        while self.state is None:
            try:
                if board is None:
                    board = await asyncio.to_thread(ray.get_actor, DRAIN_BOARD_NAME, namespace=DRAIN_BOARD_NAMESPACE)
                ref = board.wait_for_drain.remote(self.ingress_id, WATCH_POLL_S)
                state = await asyncio.wait_for(asyncio.wrap_future(ref.future()), WATCH_POLL_S + BOARD_CALL_TIMEOUT_S)
                if state is not None:
                    self.begin(state)
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - no board (no driver), or it went: look again later
                board = None
                await asyncio.sleep(LOOKUP_RETRY_S)
        while True:
            try:
                board.report.remote(self.ingress_id, self.in_flight)  # NOTE: fire and forget
            except Exception:  # noqa: BLE001 - the driver (and its board) went: keep draining
                pass
            await asyncio.sleep(REPORT_INTERVAL_S)


def _resolve(cut: asyncio.Future) -> None:
    if not cut.done():
        cut.set_result(None)


def _in_serve_replica() -> bool:
    ray = sys.modules.get("ray")
    if ray is None or not ray.is_initialized():
        return False
    try:
        from ray import serve

        serve.get_replica_context()
        return True
    except Exception:  # noqa: BLE001 - not a Serve replica (tests building the app directly)
        return False
