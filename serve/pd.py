"""Prefill/decode disaggregation on the ingress side: :class:`PDEngineClient`.

In PD mode (``flotilla serve --disaggregation-mode pd``) the application has two engine
pools, ``prefill`` and ``decode`` (both :class:`~flotilla.serve.engine_replica.EngineReplica`
in a role), and the ingress talks to them through this client. Per request:

1. ``prefill(request)`` on a prefill replica (its router prefers the replica that holds
   the prompt's prefix): the prompt's KV and first token are computed and the KV blocks
   stay held under a lease; the answer is a :class:`~flotilla.cluster.engine.kv_contract.PrefillTicket`.
2. When the first token already ends the request (``max_tokens`` 1, a stop token), the
   ticket's own chunk is the answer. Otherwise ``generate_prefilled(request, ticket)``
   streams from a decode replica: it allocates blocks, READs the prefill blocks (NIXL, or
   the Ray fallback), emits the first token and decodes on.
3. As soon as the decode stream yields its first chunk (the blocks were read, or the
   decode side gave up on them) or fails, ``release_kv`` goes to the prefill replica
   that holds them, pinned to it by a :class:`~flotilla.serve.types.ReplicaPin`. A
   release that never arrives (the ingress died) is covered by the lease.

Failures (``kv_load_failure_policy``): a failed KV read is the decode replica's to handle
(``recompute``: it computes the prompt itself; ``fail``: the stream fails before any
chunk). A prefill that fails for a reason other than bad input or overload (its replica
died, its engine is dead) is, under ``recompute``, sent whole to a decode replica, which
computes the prompt itself; under ``fail`` the client gets a 503 naming the cause.
Requests the handoff does not carry (``n`` > 1, ``logprobs``) run whole on a decode
replica.

A client that leaves must not pin the prefill blocks: when the proxy cancels the ingress's
request it cancels, through Ray (``ray.cancel`` is recursive), every actor call submitted
in that request's context, and a call cancelled just as it finished loses its answer. So
the prefill call and the release run in contexts of their own (see
:meth:`PDEngineClient._in_background`; the release bounded by :data:`RELEASE_TIMEOUT_S`): a
prefill whose caller left runs to its end and its ticket is released when it arrives.

Each pool is watched (:class:`PoolWatch`: a bounded health probe every
:data:`PROBE_INTERVAL_S`). While the prefill pool has no healthy replica, new requests run
whole on a decode replica under ``recompute`` (a prefill waiting for the pool when it goes
down is cancelled and goes there too) and get a 503 under ``fail``; :meth:`PDEngineClient.health`
reports the endpoint ``degraded``, not down.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import time
from typing import Any, AsyncIterator, Awaitable, Callable

from flotilla.cluster.engine.kv_contract import PrefillTicket, check_policy
from flotilla.serve.handles import call, engine_error, stream_chunks
from flotilla.serve.types import (
    EngineOverloadedError,
    EngineUnavailableError,
    GenerateChunk,
    GenerateRequest,
    ReplicaPin,
)

logger = logging.getLogger(__name__)

PREFILL_DEPLOYMENT = "prefill"
DECODE_DEPLOYMENT = "decode"
# Bound on one release call; the lease frees the blocks when a release is lost.
RELEASE_TIMEOUT_S = 10.0
# Each pool's health is probed this often (sooner after a failed prefill) ...
PROBE_INTERVAL_S = 1.0
# ... and a probe not answered within this long counts as "no healthy replica".
PROBE_TIMEOUT_S = 2.0
# health() waits at most this long (only for a pool's first probe, when it has none yet).
HEALTH_WAIT_S = 0.8


# -- configuration ---------------------------------------------------------------------------


def takes_handoff(params: Any) -> bool:
    """Whether a KV handoff can carry a request with these sampling parameters: one
    completion and no logprobs (``LLMEngine.add_prefilled_request``'s limits), not an
    embedding request (it ends where its prompt does); other requests run whole on a
    decode replica."""
    return params.n == 1 and params.logprobs is None and getattr(params, "pooling", None) is None


def ends_at_first_token(request: GenerateRequest, ticket: PrefillTicket) -> bool:
    """Whether the ticket's chunk is the request's whole answer: the first token ended
    the completion (a stop) or it was the only token asked for."""
    return ticket.finish_reason == "stop" or request.params.max_tokens == 1


class PoolWatch:
    """Whether an engine pool has a healthy replica, as this ingress last saw it: a probe
    (``probe()``, the pool's ``health`` call) every :data:`PROBE_INTERVAL_S`, each bounded by
    :data:`PROBE_TIMEOUT_S`, on this event loop. A probe that raises, times out (Serve has no
    replica to route it to) or answers unhealthy marks the pool down; the next healthy answer
    marks it up. Until the first answer the pool counts as up.

    Args:
        pool: the pool's name, for messages (``prefill``, ``decode``).
        probe: returns the replica's health (a dict with ``healthy`` and ``reason``).
    """

    def __init__(self, pool: str, probe: Callable[[], Awaitable[Any]]):
        self.pool = pool
        self._probe = probe
        self.healthy = True
        self.reason: str | None = None
        self.since = time.monotonic()
        self.probed = asyncio.Event()  # NOTE: set at the first answer (asyncio binds it on first use)
        self._down = asyncio.Event()
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        """Start probing on the running event loop (once; again if the loop task ended)."""
        if self._task is None or self._task.done():
            # NOTE: a context of its own: no request's cancellation reaches the probes.
            self._task = asyncio.get_running_loop().create_task(self._run(), context=contextvars.Context())

    def probe_soon(self) -> None:
        """Probe now rather than at the next interval (a call to the pool just failed)."""
        self._wake.set()

    async def until_down(self) -> None:
        """Return once the pool is (or goes) down."""
        await self._down.wait()

    def state(self) -> dict[str, Any]:
        """``healthy``, ``reason`` (None when healthy) and ``for_s`` (seconds in this state)."""
        return {"healthy": self.healthy, "reason": self.reason, "for_s": round(time.monotonic() - self.since, 3)}

    async def _run(self) -> None:
        while True:
            await self.probe_once()
            try:
                await _within(self._wake.wait(), PROBE_INTERVAL_S)
            except asyncio.TimeoutError:
                pass
            self._wake.clear()

    async def probe_once(self) -> None:
        """One bounded probe; updates the state."""
        try:
            answer = await _within(self._probe(), PROBE_TIMEOUT_S)
            healthy = bool(answer.get("healthy")) if isinstance(answer, dict) else bool(answer)
            reason = None if healthy else (answer.get("reason") if isinstance(answer, dict) else None) or "unhealthy"
        except asyncio.TimeoutError:
            healthy, reason = False, f"no replica answered within {PROBE_TIMEOUT_S:g} s"
        except Exception as exc:  # noqa: BLE001 - any failure to answer is "down"
            error = engine_error(exc)
            healthy, reason = False, f"{type(error).__name__}: {error}"
        self._set(healthy, reason)

    def _set(self, healthy: bool, reason: str | None) -> None:
        if healthy != self.healthy:
            self.since = time.monotonic()
            if healthy:
                logger.warning("the %s pool has a healthy replica again", self.pool)
            else:
                logger.warning("the %s pool has no healthy replica: %s", self.pool, reason)
        self.healthy, self.reason = healthy, reason
        (self._down.clear if healthy else self._down.set)()
        self.probed.set()


class PDEngineClient:
    """:class:`~flotilla.serve.types.EngineClient` over a prefill pool and a decode pool.

    Args:
        prefill: the ``DeploymentHandle`` of the prefill deployment.
        decode: the ``DeploymentHandle`` of the decode deployment.
        policy: ``kv_load_failure_policy``, ``"recompute"`` or ``"fail"`` (what happens when
            the prefill side fails or has no healthy replica; the decode replicas apply it to
            failed KV reads).
        metrics_timeout_s: bound on gathering the replicas' metrics.
    """

    def __init__(self, prefill: Any, decode: Any, policy: str = "recompute", metrics_timeout_s: float = 5.0):
        check_policy(policy)
        self.policy = policy
        self._prefill = prefill
        self._decode = decode
        self._release = prefill.options(method_name="release_kv")
        self._prefill_call = prefill.options(method_name="prefill")
        self._decode_whole = decode.options(stream=True, method_name="generate")
        self._decode_prefilled = decode.options(stream=True, method_name="generate_prefilled")
        self._metrics_timeout_s = metrics_timeout_s
        self._background: set[asyncio.Future] = set()
        prefill_health, decode_health = prefill.options(method_name="health"), decode.options(method_name="health")
        self.pools = {
            PREFILL_DEPLOYMENT: PoolWatch(PREFILL_DEPLOYMENT, lambda: _awaited(call(prefill_health))),
            DECODE_DEPLOYMENT: PoolWatch(DECODE_DEPLOYMENT, lambda: _awaited(call(decode_health))),
        }

    def _watch(self) -> PoolWatch:
        """The prefill pool's watch (every watch started)."""
        for watch in self.pools.values():
            watch.start()
        return self.pools[PREFILL_DEPLOYMENT]

    async def generate(self, request: GenerateRequest) -> AsyncIterator[GenerateChunk]:
        """Stream the request's chunks: prefill on the prefill pool, decode on the decode
        pool (see the module docstring). Closing the iterator early cancels the decode
        call (the decode replica aborts and frees its blocks) and releases the prefill's."""
        prefill_pool = self._watch()
        # NOTE: a migrated request (resumed_token_ids) is computed whole by a decode replica.
        if request.resumed_token_ids or not takes_handoff(request.params):
            async for chunk in stream_chunks(call(self._decode_whole, request)):
                yield chunk
            return
        ticket = None
        if prefill_pool.healthy:
            ticket = await self._prefill_or_none(request)
        elif self.policy == "fail":
            raise EngineUnavailableError(
                f"the prefill pool has no healthy replica ({prefill_pool.reason}); kv_load_failure_policy='fail'"
            )
        if ticket is None:
            # NOTE: recompute: the prefill side failed or is down; a decode replica computes the prompt.
            async for chunk in stream_chunks(call(self._decode_whole, request)):
                yield chunk
            return
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                self._in_background(self._release_now(ticket))

        if ends_at_first_token(request, ticket):
            release()
            ticket.chunk.prefill_replica_id = ticket.replica_id
            yield ticket.chunk
            return
        stream = stream_chunks(call(self._decode_prefilled, request, ticket), on_first=release, wrap_unknown=True)
        first = True
        try:
            async for chunk in stream:
                if first:
                    chunk.prefill_replica_id, first = ticket.replica_id, False
                yield chunk
        finally:
            release()

    async def _prefill_or_none(self, request: GenerateRequest) -> PrefillTicket | None:
        """The prefill's ticket; None when the prefill side failed (or its pool went down
        while the call waited) and the policy is ``recompute``. Bad input and overload raise
        as they are under either policy. A caller that leaves does not cancel the prefill: it
        runs to its end and its ticket is released when it comes back.

        NOTE: the call is made in a context of its own, outside the HTTP request's task tree
        (see :meth:`_in_background`). Cancelling a Serve call that has just finished loses its
        result (Serve: "the request may actually have run to completion"), and with it the
        ticket of blocks the prefill replica now holds: they would stay leased until the lease
        ends. The proxy's recursive cancel of a client that leaves would do exactly that."""
        response = contextvars.Context().run(call, self._prefill_call, request)
        pending = asyncio.ensure_future(_awaited(response))
        down = asyncio.ensure_future(self.pools[PREFILL_DEPLOYMENT].until_down())
        try:
            await asyncio.wait((pending, down), return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            self._abandon_prefill(response, pending, cancel=False)
            raise
        finally:
            down.cancel()
        if pending.done():
            try:
                return pending.result()
            except Exception as exc:  # noqa: BLE001 - sorted out below
                error = engine_error(exc)
        else:
            # NOTE: the pool went down while the call waited for (or on) a replica: no ticket
            # is coming from a replica that is gone, and a call still waiting for one must end.
            self._abandon_prefill(response, pending, cancel=True)
            reason = self.pools[PREFILL_DEPLOYMENT].reason
            error = EngineUnavailableError(f"the prefill pool has no healthy replica ({reason})")
        if isinstance(error, (ValueError, EngineOverloadedError)):
            raise error from None
        self.pools[PREFILL_DEPLOYMENT].probe_soon()
        if self.policy == "fail":
            raise EngineUnavailableError(
                f"the prefill of request {request.request_id!r} failed ({type(error).__name__}: {error}); "
                "kv_load_failure_policy='fail'"
            ) from None
        logger.warning(
            "prefill of request %s failed (%s: %s); the decode pool computes the prompt (kv_load_failure_policy=recompute)",
            request.request_id,
            type(error).__name__,
            error,
        )
        return None

    def _abandon_prefill(self, response: Any, pending: asyncio.Future, cancel: bool) -> None:
        """Nobody waits for this prefill any more: release its ticket when it arrives; with
        ``cancel``, cancel the call too (the replica aborts the prefill, or frees its blocks if
        it had finished)."""
        if cancel:
            response.cancel()

        def release_late_ticket(done: asyncio.Future) -> None:
            self._background.discard(done)
            if not done.cancelled() and done.exception() is None and isinstance(done.result(), PrefillTicket):
                self._in_background(self._release_now(done.result()))

        self._background.add(pending)
        pending.add_done_callback(release_late_ticket)

    def _in_background(self, coroutine) -> None:
        """Run ``coroutine`` on this event loop without waiting for it (kept referenced
        until done, so it is not collected half-way).

        NOTE: in a context of its own (no Serve request context, no Ray task of the HTTP
        request): when the client leaves, the proxy cancels the ingress's request with a
        recursive ``ray.cancel``, which also cancels every actor call submitted in that
        request's context; a release must outlive its request."""
        task = asyncio.get_running_loop().create_task(coroutine, context=contextvars.Context())
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _release_now(self, ticket: PrefillTicket) -> None:
        try:
            release = call(self._release, ReplicaPin(ticket.replica_id), ticket.prefill_request_id)
            await asyncio.wait_for(_awaited(release), RELEASE_TIMEOUT_S)
        except Exception as exc:  # noqa: BLE001 - the lease frees the blocks anyway
            logger.warning(
                "releasing the prefill blocks of request %s on replica %s failed (%s: %s); its lease frees them",
                ticket.request_id,
                ticket.replica_id,
                type(exc).__name__,
                exc,
            )

    async def health(self) -> dict[str, Any]:
        """The endpoint's health: ``status`` ``"ok"``, ``"degraded"`` (the prefill pool has no
        healthy replica and ``kv_load_failure_policy`` is ``recompute``: the decode pool serves
        every request whole) or ``"down"`` (no healthy decode replica, or the prefill pool down
        under ``fail``), and ``pools``: each pool's :meth:`PoolWatch.state`. Answers from the
        watches' last probes, within :data:`HEALTH_WAIT_S` (the wait for a first probe)."""
        self._watch()
        first = [asyncio.ensure_future(w.probed.wait()) for w in self.pools.values() if not w.probed.is_set()]
        if first:
            _, late = await asyncio.wait(first, timeout=HEALTH_WAIT_S)
            for waiter in late:
                waiter.cancel()
        prefill, decode = self.pools[PREFILL_DEPLOYMENT], self.pools[DECODE_DEPLOYMENT]
        if not decode.healthy or (not prefill.healthy and self.policy == "fail"):
            status = "down"
        else:
            status = "ok" if prefill.healthy else "degraded"
        pools = {name: watch.state() for name, watch in self.pools.items()}
        return {"status": status, "kv_load_failure_policy": self.policy, "pools": pools}

    async def is_healthy(self) -> bool:
        """Whether the endpoint serves (``/health``): :meth:`health` is not ``"down"``."""
        return (await self.health())["status"] != "down"

    async def metrics_text(self) -> str:
        """Every live engine replica's ``flotilla:`` metrics (both pools, a ``pool``
        label on each series), merged, from the namespace's metrics hub."""
        from flotilla.serve.metrics import collect_metrics_text

        return await collect_metrics_text(self._metrics_timeout_s)


async def _awaited(response: Any) -> Any:
    """Await a Serve ``DeploymentResponse`` (a plain coroutine, for tasks and ``wait_for``)."""
    return await response


async def _within(awaitable: Awaitable[Any], timeout_s: float) -> Any:
    """``awaitable``'s result, or ``asyncio.TimeoutError`` (it is cancelled) after
    ``timeout_s``. NOTE: unlike ``asyncio.wait_for`` before Python 3.12, a cancellation of
    the caller is never swallowed when the awaitable finishes at the same moment (the probe
    loop would outlive its event loop)."""
    task = asyncio.ensure_future(awaitable)
    try:
        done, _ = await asyncio.wait((task,), timeout=timeout_s)
    except asyncio.CancelledError:
        task.cancel()
        raise
    if not done:
        task.cancel()
        raise asyncio.TimeoutError
    return task.result()
