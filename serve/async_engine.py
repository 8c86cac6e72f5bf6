"""``AsyncEngine``: the asyncio face of one :class:`LLMEngine` inside one process.

Threading design (the one invariant: only the engine thread ever touches the LLMEngine):

- One dedicated engine thread runs the step loop. asyncio callers never call the engine;
  :meth:`AsyncEngine.generate` appends an *add* command (and closing a stream early an
  *abort* command) to a list guarded by a ``threading.Condition``. The thread takes the
  whole list between steps, applies it in order, then steps. With no command and no
  unfinished request it sleeps on the condition (a bounded wait), so an idle engine costs
  nothing. Going idle after serving, it first gives the C heap's free pages back to the OS
  (:func:`release_free_heap`, at most every :data:`HEAP_TRIM_INTERVAL_S`).
- What a step produced goes back per request: the thread turns the engine's deltas into
  :class:`GenerateChunk` s and hands them, one ``loop.call_soon_threadsafe`` per event loop
  per step, to the requests' ``asyncio.Queue`` s (each request remembers the loop that
  called ``generate``). Errors of ``add_request`` (a ``ValueError`` naming the parameter)
  travel the same way, so they raise from the stream before its first chunk.
- Load (running, waiting, KV usage) is published by the thread as a snapshot after every
  change; the queue bound and :meth:`AsyncEngine.load` read the snapshot plus the adds not
  yet applied, under the same lock, so the bound is exact.

Text comes from the engine's own incremental detokenizer and stop-string matching (the
engine holds the tokenizer); ``stream_interval > 1`` (``--stream-interval``) batches that
many tokens per chunk, except the first chunk and finishes, which go out at once.

Prefill/decode disaggregation adds three commands (:meth:`AsyncEngine.prefill`,
:meth:`AsyncEngine.generate_prefilled`, :meth:`AsyncEngine.release_kv`), applied on the
same thread; they live in :mod:`flotilla.serve.async_engine_pd`. Elastic EP
(:meth:`AsyncEngine.grow_elastic_ep`) lives in :mod:`flotilla.serve.async_engine_elastic`.
The commands themselves are in :mod:`flotilla.serve.async_engine_commands`.

No error path leaks a block or leaves a caller waiting: a prefill whose caller leaves
is aborted (or its lease released, when it already finished), a failed prefill frees
its blocks, a decode stream whose consumer leaves is aborted, and a dying engine
answers every queued command and frees every lease.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import functools
import itertools
import logging
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable

from flotilla.cluster.engine.gc_pauses import frozen_heap
from flotilla.cluster.engine.kv_contract import KVHandoffError
from flotilla.cluster.engine.llm_engine import EngineDeadError, LLMEngine
from flotilla.cluster.engine.outputs import CompletionDelta
from flotilla.cluster.engine.request import RequestStatus
from flotilla.serve.async_engine_commands import _Abort, _Add, _AddPrefilled, _Call, _Command, _Prefill, _Stream
from flotilla.serve.async_engine_elastic import ElasticEPCommands
from flotilla.serve.async_engine_pd import KVHandoff, KVTransferExpired, PDCommands
from flotilla.serve.metrics import EngineMetrics
from flotilla.serve.types import (
    CompletionChunk,
    EngineOverloadedError,
    GenerateChunk,
    GenerateRequest,
    ReplicaLoad,
    ReplicaLostError,
)

# The pause before a second attempt to rebuild a failed runner; it doubles at each next one.
RESTART_BACKOFF_S = 1.0

# NOTE: KVTransferExpired is re-exported: it is part of this module's API.
__all__ = ["AsyncEngine", "KVTransferExpired"]

logger = logging.getLogger(__name__)

# Longest sleep of an idle engine thread between checks for shutdown (commands wake it at once).
IDLE_WAIT_S = 1.0
# Prefix keys remembered for prefix-affinity routing.
RECENT_PREFIX_KEYS = 256
# How long shutdown() waits for the engine thread to finish its step.
SHUTDOWN_WAIT_S = 60.0
# How long an engine holds queue room for the prompts of a multi-prompt request that have not
# arrived yet (they are sent together; one routed to another replica never comes), and
# remembers a refused one so that its later prompts are refused too.
GROUP_HOLD_S = 5.0
# Multi-prompt requests remembered at most (held or refused); the oldest are forgotten first.
MAX_GROUPS = 4096
# An engine that served and is now idle gives the C heap's free pages back to the OS
# (glibc's malloc_trim), at most this often: glibc keeps what the steps freed for reuse, in
# up to 8 arenas per core, so a replica's RSS creeps up with the shapes it has run.
HEAP_TRIM_INTERVAL_S = 5.0


@dataclass(eq=False)
class _Live:
    """Engine-thread state of one request the engine holds."""

    add: _Add
    child_ids: list[str]
    queue_time_s: float | None = None
    first_token_at: float | None = None
    sent_first: bool = False
    last_sent_at: float = 0.0  # time.monotonic() of the last chunk handed to the stream
    last_token_at: dict[int, float] = field(default_factory=dict)
    pending: dict[int, CompletionChunk] = field(default_factory=dict)
    pending_tokens: int = 0
    num_tokens: int = 0
    finished_indexes: set[int] = field(default_factory=set)


@dataclass(eq=False)
class _Group:
    """The queue room an engine holds for the prompts of one multi-prompt request
    (:attr:`GenerateRequest.group_id`) still to come, or that the request was refused."""

    expires: float  # time.monotonic() when it is forgotten (and its room released)
    held: int  # prompts still to come, each with a queue slot held for it
    refused: bool = False


class AsyncEngine(PDCommands, ElasticEPCommands):
    """Runs an :class:`LLMEngine` on its own thread and streams its requests to asyncio
    callers; implements :class:`~flotilla.serve.types.EngineClient`.

    Args:
        engine: the engine to drive; from now on only this object's thread touches it.
        max_queued_requests: requests may wait (queued in the engine or not yet added) up to
            this many; beyond, :meth:`generate` raises :class:`EngineOverloadedError`.
        replica_id: the ``replica`` label of the metrics.
        retry_after_s: the ``Retry-After`` hint of :class:`EngineOverloadedError`.
        pool: the ``pool`` label of the metrics (``colocated``, ``prefill``, ``decode``).
        stream_batch_s: a request's next chunk waits until this long after its last one
            (its tokens gather meanwhile); the first chunk and the last go out at once.
            0: a chunk as soon as ``stream_interval`` tokens are pending. The engine replica
            sets it from ``ServeOptions.stream_batch_ms``: every chunk crosses Ray streaming
            hops and becomes an SSE frame, which cost more than the engine's step on a GPU.
        restart_attempts: when the runner fails (a rank died), the engine thread rebuilds it
            (``LLMEngine.restart``: a fresh worker group, the gang restarted) up to this many
            times, :data:`RESTART_BACKOFF_S` apart, before the engine is dead. Meanwhile new
            requests are refused with :class:`ReplicaLostError` (the ingress migrates them:
            :mod:`~flotilla.serve.migration`), ``healthy`` is False and ``restarting`` says
            why. 0 (default): the first failure kills the engine (Serve replaces the replica).

    The PD commands (:meth:`prefill`, :meth:`generate_prefilled`, mixed in from
    :class:`~flotilla.serve.async_engine_pd.PDCommands`) need a runner with a KV
    endpoint attached (``runner.kv.attach``; :class:`~flotilla.serve.engine_replica.EngineReplica`
    has its runner built with one in the ``prefill`` and ``decode`` pools). The elastic EP commands are mixed in
    from :class:`~flotilla.serve.async_engine_elastic.ElasticEPCommands`.
    """

    def __init__(
        self,
        engine: LLMEngine,
        max_queued_requests: int = 256,
        *,
        replica_id: str = "0",
        retry_after_s: int = 1,
        pool: str = "colocated",
        stream_batch_s: float = 0.0,
        restart_attempts: int = 0,
    ):
        if isinstance(restart_attempts, bool) or not isinstance(restart_attempts, int) or restart_attempts < 0:
            raise ValueError(f"restart_attempts must be an integer >= 0, got restart_attempts={restart_attempts!r}")
        self.restart_attempts = restart_attempts
        if isinstance(max_queued_requests, bool) or not isinstance(max_queued_requests, int) or max_queued_requests < 1:
            raise ValueError(
                f"max_queued_requests must be an integer >= 1, got max_queued_requests={max_queued_requests!r}"
            )
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.max_queued_requests = max_queued_requests
        self.retry_after_s = retry_after_s
        self.stream_interval = max(1, int(getattr(engine.config, "stream_interval", 1) or 1))
        if not stream_batch_s >= 0:
            raise ValueError(f"stream_batch_s must be >= 0 seconds, got stream_batch_s={stream_batch_s!r}")
        self.stream_batch_s = float(stream_batch_s)
        self.metrics = EngineMetrics(replica_id, pool)
        self._ids = itertools.count()
        self._cond = threading.Condition()
        # Guarded by _cond: the command list, adds not yet reflected in the snapshot, the
        # snapshot (running, waiting, kv usage), and the life flags.
        self._commands: list[_Command] = []
        self._queued_adds = 0
        self._snapshot: tuple[int, int, float] = (0, 0, 0.0)
        self._dead: str | None = None
        self._restarting: str | None = None  # NOTE: why the runner is being rebuilt, meanwhile
        self._stopping = False
        self._prefix_keys: OrderedDict[int, None] = OrderedDict()
        # Multi-prompt requests seen lately (oldest first) and the queue slots held for them.
        self._groups: OrderedDict[str, _Group] = OrderedDict()
        self._held = 0
        # Requests admitted per DP rank (index: DP rank), for per-rank metrics.
        self._dp_rank_requests: list[int] = [0] * int(getattr(engine.scheduler, "dp_size", 1))
        # Engine-thread state.
        self._live: dict[str, _Live] = {}
        self._unscheduled: set[str] = set()
        self._orphans: list[_Command] = []
        self._prefix_seen = (0, 0)
        self._spec_seen = (0, 0, 0)  # speculative (rounds, draft tokens, accepted) already counted
        self._stepped_since_trim = False
        self._trimmed_at = time.monotonic()
        # Engine-thread state of the KV handoff (leases, KV peers).
        self._handoff = KVHandoff(engine, self.metrics, lambda: self._publish_load(0))
        self._publish_load(0)
        self._thread = threading.Thread(target=self._run, name=f"flotilla-engine-{replica_id}", daemon=True)
        self._thread.start()

    @classmethod
    def from_config(
        cls,
        config: Any,
        source: Any,
        tokenizer: Any = None,
        max_queued_requests: int = 256,
        *,
        replica_id: str = "0",
        pool: str = "colocated",
        runner_spec: Any = None,
        stream_batch_s: float = 0.0,
        restart_attempts: int = 0,
    ) -> "AsyncEngine":
        """Build the :class:`LLMEngine` (``config``: the ResolvedConfig, ``source``: the
        ModelSource, ``tokenizer``: an HF tokenizer or None, ``runner_spec``: how its runner is
        built, a :class:`~flotilla.cluster.engine.runner_factory.RunnerSpec` or None, see
        ``LLMEngine``) and drive it (``stream_batch_s``, ``restart_attempts``: see the class)."""
        engine = LLMEngine(config, source, tokenizer, runner_spec=runner_spec)
        return cls(
            engine, max_queued_requests, replica_id=replica_id, pool=pool, stream_batch_s=stream_batch_s,
            restart_attempts=restart_attempts,
        )  # fmt: skip

    # -- the asyncio side ------------------------------------------------------------

    async def generate(self, request: GenerateRequest) -> AsyncIterator[GenerateChunk]:
        """Stream the request's chunks (see :class:`GenerateChunk`).

        Raises, from the first iteration step and before any chunk: ``ValueError`` (bad
        input, naming the parameter), :class:`EngineOverloadedError` (the queue is full;
        nothing was queued), :class:`EngineUnavailableError` (the engine is dead or shut
        down). Closing or cancelling the iteration early aborts the request; the engine
        thread frees its KV blocks before its next step.
        """
        await self.compile_constraint(request.params)
        engine_id, stream = self._enqueue(request, _Add)
        # NOTE: aclosing: closing this stream closes the inner one now (its abort goes out at
        # once), not when the garbage collector finalizes it.
        async with contextlib.aclosing(self._chunks(engine_id, stream, group_id=request.group_id)) as chunks:
            async for chunk in chunks:
                yield chunk

    async def compile_constraint(self, params: Any) -> None:
        """Compile a constrained request's grammar (``params.guided``) on a worker thread,
        into the engine's cache, so that the engine thread never compiles; ValueError naming
        the request parameter when it does not compile. Nothing to do without a constraint
        or without a backend (the engine then refuses the request itself)."""
        grammars = getattr(self.engine, "grammars", None)
        if params.guided is not None and grammars is not None:
            await asyncio.to_thread(grammars.compile, params.guided)

    def _enqueue(self, request: GenerateRequest, kind: type[_Add], **extra: Any) -> tuple[str, _Stream]:
        """Queue an add command of ``kind`` under the queue bound; its id and stream."""
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        engine_id = f"{request.request_id}~{next(self._ids)}"
        now = time.monotonic()
        arrival = request.arrival_time if request.arrival_time and request.arrival_time > 0 else time.time()
        with self._cond:
            self._raise_if_unavailable()
            self._admit(request, now, grouped=kind is not _AddPrefilled)
            self._queued_adds += 1
            self._commands.append(kind(engine_id, request, stream, now, arrival, **extra))
            if request.prefix_key is not None:
                self._prefix_keys[request.prefix_key] = None
                self._prefix_keys.move_to_end(request.prefix_key)
                if len(self._prefix_keys) > RECENT_PREFIX_KEYS:
                    self._prefix_keys.popitem(last=False)
            self._cond.notify()
        return engine_id, stream

    def _admit(self, request: GenerateRequest, now: float, grouped: bool = True) -> None:
        """The queue bound, under ``_cond``: raises :class:`EngineOverloadedError` when the
        request does not fit (``ValueError`` naming ``prompt`` when it never can).

        With ``grouped``, a prompt of a multi-prompt request (``request.group_id``) counts as
        the whole request: the first of its prompts to arrive is admitted only when all
        ``group_size`` fit, and a slot is held for each of the others (for
        :data:`GROUP_HOLD_S`); when they do not fit, every prompt of the request is refused,
        so none of them runs. A request a prefill replica admitted already
        (``_AddPrefilled``) counts as itself."""
        self._forget_groups(now)
        limit = self.max_queued_requests
        group_id, size = request.group_id, int(request.group_size or 1)
        group = self._groups.get(group_id) if grouped and group_id is not None and size > 1 else None
        if group is not None and group.refused:
            raise EngineOverloadedError(
                f"the engine replica refused this request's other prompts (max_queued_requests={limit}); "
                f"retry after {self.retry_after_s} s",
                self.retry_after_s,
            )
        if group is not None and group.held > 0:
            group.held -= 1
            self._held -= 1
            return  # NOTE: its slot was held when the request's first prompt came
        queued = self._snapshot[1] + self._queued_adds + self._held
        if group is None and grouped and group_id is not None and size > 1:
            if size > limit:
                raise ValueError(
                    f"prompt holds {size} prompts and an engine replica queues at most {limit} requests "
                    f"(max_queued_requests={limit}); send at most {limit} prompts per request"
                )
            if queued + size > limit:
                self._remember_group(group_id, _Group(now + GROUP_HOLD_S, 0, refused=True))
                raise EngineOverloadedError(
                    f"the engine replica's queue has no room for this request's {size} prompts ({queued} requests "
                    f"waiting, max_queued_requests={limit}); retry after {self.retry_after_s} s",
                    self.retry_after_s,
                )
            self._remember_group(group_id, _Group(now + GROUP_HOLD_S, size - 1))
            self._held += size - 1
            return
        if queued >= limit:
            raise EngineOverloadedError(
                f"the engine replica's queue is full ({queued} requests waiting, "
                f"max_queued_requests={limit}); retry after {self.retry_after_s} s",
                self.retry_after_s,
            )

    def _remember_group(self, group_id: str, group: _Group) -> None:
        self._groups[group_id] = group
        while len(self._groups) > MAX_GROUPS:
            self._held -= self._groups.popitem(last=False)[1].held

    def _forget_groups(self, now: float) -> None:
        """Forget the groups past their hold, releasing the slots they still held (under ``_cond``)."""
        while self._groups:
            group_id, group = next(iter(self._groups.items()))
            if group.expires > now:
                return
            del self._groups[group_id]
            self._held -= group.held

    def _give_up_group(self, group_id: str) -> None:
        """A prompt of ``group_id`` was left by its consumer (the HTTP request is gone): the
        slots held for its other prompts are released and any still to come are refused."""
        with self._cond:
            group = self._groups.get(group_id)
            if group is not None:
                self._held -= group.held
                group.held, group.refused = 0, True

    async def _chunks(
        self, engine_id: str, stream: _Stream, group_id: str | None = None
    ) -> AsyncIterator[GenerateChunk]:
        """The chunks of a queued request until its last; aborts it when left early.

        Chunks that queued up while the consumer was busy go out as one (a consumer that
        keeps up gets every chunk as it comes): on a fast GPU the engine makes a chunk per
        request every few milliseconds, and each item costs the serving path (a Ray
        streaming item, an SSE frame) more than the tokens in it."""
        finished = False
        try:
            while True:
                item = await stream.queue.get()
                failure = None
                while not isinstance(item, BaseException) and not item.finished and not stream.queue.empty():
                    later = stream.queue.get_nowait()
                    if isinstance(later, BaseException):
                        failure = later  # NOTE: what came before the error still goes out first
                        break
                    item.absorb(later)
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished or failure is not None
                yield item
                if failure is not None:
                    raise failure
                if finished:
                    return
        finally:
            if not finished:
                # NOTE: the consumer left (aclose, cancellation, a dropped connection).
                self._submit(_Abort(engine_id))
                if group_id is not None:
                    self._give_up_group(group_id)

    async def _call(self, fn: Callable[[], Any]) -> Any:
        """``fn()`` run on the engine thread between steps; raises what it raised, or
        :class:`EngineUnavailableError` when the engine is (or goes) down first."""
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        with self._cond:
            self._raise_if_unavailable()
            self._commands.append(_Call(fn, stream))
            self._cond.notify()
        item = await stream.queue.get()
        if isinstance(item, BaseException):
            raise item
        return item

    def load(self) -> ReplicaLoad:
        """The replica's load for the router; ``waiting`` counts adds not yet applied."""
        with self._cond:
            running, waiting, usage = self._snapshot
            return ReplicaLoad(
                running=running,
                waiting=waiting + self._queued_adds,
                kv_usage=usage,
                max_queued=self.max_queued_requests,
                prefix_keys=tuple(self._prefix_keys),
            )

    async def is_healthy(self) -> bool:
        """False once the engine died (a failed step) or shut down."""
        return self.healthy

    @property
    def healthy(self) -> bool:
        with self._cond:
            ok = self._dead is None and self._restarting is None and not self._stopping
        return ok and self._thread.is_alive()

    @property
    def restarting(self) -> str | None:
        """Why the engine thread is rebuilding a failed runner (see ``restart_attempts``), or None."""
        with self._cond:
            return self._restarting

    @property
    def dead_reason(self) -> str | None:
        """Why the engine died, or None."""
        with self._cond:
            return self._dead

    async def metrics_text(self) -> str:
        """This replica's ``flotilla:`` metrics (Prometheus text format)."""
        return self.metrics.exposition()

    def shutdown(self, timeout_s: float = SHUTDOWN_WAIT_S) -> None:
        """Stop the engine thread (in-flight requests get a final ``"error"`` chunk, queued
        ones :class:`EngineUnavailableError`, leases are released), close the runner's KV
        endpoints and release its workers; idempotent."""
        with self._cond:
            already = self._stopping
            self._stopping = True
            self._cond.notify()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout_s)
        if not already:
            # NOTE: the runner's shutdown closes its KV endpoints too (runner.kv.detach()).
            stop = getattr(self.engine.runner, "shutdown", None)
            if stop is not None:
                stop()

    def _raise_if_unavailable(self) -> None:
        if self._dead is not None:
            raise ReplicaLostError(f"the engine replica is dead: {self._dead}")
        if self._stopping:
            raise ReplicaLostError("the engine replica is shutting down")
        if self._restarting is not None:
            raise ReplicaLostError(f"the engine replica is restarting its worker group ({self._restarting})")

    def _submit(self, command: _Abort) -> None:
        with self._cond:
            if self._dead is None and not self._stopping:
                self._commands.append(command)
                self._cond.notify()

    # -- the engine thread ---------------------------------------------------------------

    def _run(self) -> None:
        # NOTE: the start-up heap stays out of the cycle collector while the loop runs (no
        # full-collection pauses between steps; see flotilla.cluster.engine.gc_pauses).
        with frozen_heap():
            self._loop()

    def _loop(self) -> None:
        try:
            while True:
                commands = self._next_commands()
                if commands is None:
                    break
                self._apply(commands)
                # NOTE: a prefilled request whose KV read ended joins the batch now, and its
                # first token goes out at once, not with the next step's token.
                self.engine.observe_kv_reads()
                pending = self.engine.take_pending()
                if pending:
                    self._emit(pending, time.monotonic())
                if commands or self.engine.has_unfinished_requests():
                    self._step()
                    self._stepped_since_trim = True
                if self._handoff.leases:
                    self._handoff.expire_leases()
                if self.engine.dead is not None and not self._restart(str(self.engine.dead)):
                    self._die(str(self.engine.dead))
                    return
                if self._heap_trim_due() and not self.engine.has_unfinished_requests():
                    self._stepped_since_trim, self._trimmed_at = False, time.monotonic()
                    release_free_heap()
        except Exception as exc:  # noqa: BLE001 - a bug must fail the requests, not hang them
            logger.exception("the engine loop of replica %s failed", self.metrics.replica_id)
            self._die(f"the engine loop failed: {type(exc).__name__}: {exc}")
            return
        self._die("the engine replica shut down", dead=False)

    def _next_commands(self) -> list[_Command] | None:
        """The commands queued since the last call (waiting while idle, or while every
        waiting request waits for leased blocks, but no later than the next lease deadline);
        None on shutdown."""
        with self._cond:
            while not (self._commands or self._stopping or self._can_step()):
                if self._heap_trim_due() and not self.engine.has_unfinished_requests():
                    break  # NOTE: idle with a heap trim due: the loop trims, outside the lock
                wait_s = IDLE_WAIT_S
                if self._handoff.leases:
                    due_in = self._handoff.leases.next_deadline() - time.monotonic()
                    if due_in <= 0:
                        break
                    wait_s = min(wait_s, due_in)
                self._cond.wait(wait_s)
            if self._stopping:
                return None
            commands, self._commands = self._commands, []
            return commands

    def _can_step(self) -> bool:
        """Whether a step can make progress: unfinished requests, unless the last step
        admitted nothing because leased (held) blocks fill the pool. NOTE: then only a
        command (a release, an abort) or a lease's expiry changes anything; stepping on
        would spin the thread."""
        blocked = getattr(self.engine.scheduler, "waiting_for_held_blocks", False)
        return self.engine.has_unfinished_requests() and not blocked

    def _heap_trim_due(self) -> bool:
        return self._stepped_since_trim and time.monotonic() - self._trimmed_at >= HEAP_TRIM_INTERVAL_S

    def _apply(self, commands: list[_Command]) -> None:
        adds = 0
        for index, command in enumerate(commands):
            try:
                if isinstance(command, _Add):
                    adds += 1
                    self._add(command)
                elif isinstance(command, _Call):
                    self._answer(command)
                elif command.engine_id in self._live:
                    self.engine.abort(command.engine_id)
                elif command.engine_id in self._handoff.leases:
                    # NOTE: a prefill whose caller left after it finished: nobody will read it.
                    self._handoff.release_lease(command.engine_id)
            except Exception:
                # NOTE: the loop dies; the commands not applied yet must still get an answer.
                self._orphans = [c for c in commands[index + 1 :] if isinstance(c, (_Add, _Call))]
                raise
        self._publish_load(adds)

    def _answer(self, command: _Call) -> None:
        try:
            result: Any = command.fn()
        except Exception as exc:  # noqa: BLE001 - the caller gets it; the engine is untouched
            result = exc
        self._deliver([("", command.stream, result)])

    def _add(self, command: _Add) -> None:
        request = command.request
        try:
            if isinstance(command, _AddPrefilled):
                if request.resumed_token_ids:
                    raise ValueError("resumed_token_ids: a migrated request is computed whole, never from a prefill ticket")
                self._handoff.add_prefilled(command)
            else:
                hold_kv = isinstance(command, _Prefill)
                self.engine.add_request(
                    request.prompt_token_ids,
                    request.params,
                    request_id=command.engine_id,
                    hold_kv=hold_kv,
                    priority=request.priority,
                    resumed_token_ids=request.resumed_token_ids,
                )
        except (ValueError, KVHandoffError, NotImplementedError) as exc:
            # NOTE: bad input, or a failed KV load under policy "fail": nothing was queued.
            self._deliver([(command.engine_id, command.stream, exc)])
            return
        except EngineDeadError as exc:
            self._deliver([(command.engine_id, command.stream, ReplicaLostError(str(exc)))])
            return
        except Exception as exc:
            # NOTE: not a bad input: the engine's state is suspect, so the loop dies (the
            # replica turns unhealthy) after this request gets its error (a fresh exception:
            # this one is still being raised on this thread).
            error = RuntimeError(f"the engine failed to add the request: {type(exc).__name__}: {exc}")
            self._deliver([(command.engine_id, command.stream, error)])
            raise
        n = request.params.n
        children = [command.engine_id] if n == 1 else [f"{command.engine_id}#{i}" for i in range(n)]
        rank = self.engine.dp_rank_of(children[0])
        if rank is not None:
            with self._cond:
                self._dp_rank_requests[rank] += 1
        self._live[command.engine_id] = _Live(command, children)
        self._unscheduled.add(command.engine_id)

    def _step(self) -> None:
        started = time.monotonic()
        self._emit(self.engine.step(), started)

    def _emit(self, deltas: list[CompletionDelta], step_started: float) -> None:
        """Turn deltas (a step's, or those made between steps) into chunks and hand them
        to their streams; publish the load."""
        now, wall = time.monotonic(), time.time()
        self._mark_scheduled(step_started)
        grouped: dict[str, list[CompletionDelta]] = {}
        for delta in deltas:
            grouped.setdefault(delta.request_id, []).append(delta)
        out = []
        for engine_id, request_deltas in grouped.items():
            live = self._live.get(engine_id)
            if live is None:
                continue
            chunk = self._absorb(live, request_deltas, now, wall)
            if chunk is not None and isinstance(live.add, _Prefill):
                # NOTE: a prefill answers once, when it finished, with its outcome.
                if chunk.finished:
                    out.append((engine_id, live.add.stream, self._handoff.finish_prefill(live.add, chunk)))
            elif chunk is not None:
                out.append((engine_id, live.add.stream, chunk))
        if self.stream_batch_s > 0:
            out.extend(self._overdue_chunks(grouped, now))
        self._record_prefix_cache()
        self._record_speculation()
        self._publish_load(0)
        self._deliver(out)

    def _mark_scheduled(self, step_started: float) -> None:
        """Queue time of requests whose first step was this one (measured to its start)."""
        scheduler = self.engine.scheduler
        for engine_id in list(self._unscheduled):
            live = self._live[engine_id]
            started = any(
                (r := scheduler.get(child)) is not None and r.status is not RequestStatus.WAITING
                for child in live.child_ids
            ) or any(c.token_ids for c in self.engine.get_output(engine_id).outputs)
            if started:
                live.queue_time_s = max(0.0, step_started - live.add.submitted)
                self.metrics.request_queue_time.observe(live.queue_time_s)
                self._unscheduled.discard(engine_id)

    def _absorb(self, live: _Live, deltas: list[CompletionDelta], now: float, wall: float) -> GenerateChunk | None:
        """Fold one step's deltas of a request into its pending chunk; the chunk to send, if due."""
        metrics, tokens = self.metrics, 0
        for delta in deltas:
            chunk = live.pending.get(delta.index)
            if chunk is None:
                chunk = live.pending[delta.index] = CompletionChunk(delta.index, [], "")
            chunk.token_ids += delta.token_ids
            chunk.text += delta.text
            if delta.logprobs is not None:
                chunk.logprobs = (chunk.logprobs or []) + list(delta.logprobs)
            if delta.embedding is not None:
                chunk.embedding = delta.embedding
            if delta.finish_reason is not None:
                chunk.finish_reason, chunk.stop_reason = delta.finish_reason, delta.stop_reason
                live.finished_indexes.add(delta.index)
                metrics.record_finished(delta.finish_reason)
            if delta.token_ids:
                tokens += len(delta.token_ids)
                last = live.last_token_at.get(delta.index)
                if last is not None:
                    metrics.inter_token_latency.observe(now - last)
                live.last_token_at[delta.index] = now
        if tokens:
            metrics.generation_tokens.inc(tokens)
            live.pending_tokens += tokens
            live.num_tokens += tokens
            if live.first_token_at is None:
                live.first_token_at = now
                metrics.time_to_first_token.observe(max(0.0, wall - live.add.arrival_wall))
                metrics.prompt_tokens.inc(len(live.add.request.prompt_token_ids))
        engine_id = live.add.engine_id
        output = self.engine.get_output(engine_id)
        if output.finished:
            self.engine.pop_output(engine_id)
            del self._live[engine_id]
            self._unscheduled.discard(engine_id)
            if any(c.finish_reason in ("stop", "length") for c in output.outputs):
                metrics.e2e_request_latency.observe(max(0.0, wall - live.add.arrival_wall))
            chunk = self._take_chunk(live, now)
            chunk.finished = True
            chunk.prompt_tokens = len(output.prompt_token_ids)
            chunk.completion_tokens = sum(len(c.token_ids) for c in output.outputs)
            chunk.cached_tokens = output.num_cached_tokens
            chunk.error = output.error
            # NOTE: failed because the runner did (a rank died), not because of the request.
            chunk.replica_failed = output.error is not None and self.engine.dead is not None
            return chunk
        if live.pending and (not live.sent_first or self._due(live, now)):
            return self._take_chunk(live, now)
        return None

    def _due(self, live: _Live, now: float) -> bool:
        """Whether a request's pending tokens (after its first chunk) go out now."""
        if any(c.finish_reason for c in live.pending.values()):
            return True
        return live.pending_tokens >= self.stream_interval and now - live.last_sent_at >= self.stream_batch_s

    def _overdue_chunks(self, handled: dict[str, Any], now: float) -> list[tuple[str, _Stream, GenerateChunk]]:
        """Chunks of requests that gained no token this step but hold pending tokens past
        their ``stream_batch_s`` (a preempted or waiting request must not sit on them)."""
        out = []
        for engine_id, live in self._live.items():
            if engine_id in handled or not live.pending or isinstance(live.add, _Prefill) or not self._due(live, now):
                continue
            out.append((engine_id, live.add.stream, self._take_chunk(live, now)))
        return out

    def _take_chunk(self, live: _Live, now: float) -> GenerateChunk:
        chunk = GenerateChunk(live.add.request.request_id, [live.pending[i] for i in sorted(live.pending)])
        live.pending, live.pending_tokens, live.last_sent_at = {}, 0, now
        if not live.sent_first:
            chunk.queue_time_s, chunk.replica_id = live.queue_time_s, self.metrics.replica_id
            live.sent_first = True
        return chunk

    def _record_prefix_cache(self) -> None:
        pool = self.engine.scheduler.pool
        seen = (pool.prefix_query_tokens, pool.prefix_hit_tokens)
        queries, hits = seen[0] - self._prefix_seen[0], seen[1] - self._prefix_seen[1]
        if queries > 0:
            self.metrics.prefix_cache_queries.inc(queries)
        if hits > 0:
            self.metrics.prefix_cache_hits.inc(hits)
        self._prefix_seen = seen

    def _record_speculation(self) -> None:
        speculator = getattr(self.engine, "speculator", None)
        if speculator is None:
            return
        stats = speculator.stats
        seen = (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens)
        self.metrics.record_speculation(*(now - before for now, before in zip(seen, self._spec_seen)), stats.take_accepted_lengths())
        self._spec_seen = seen

    def _publish_load(self, adds_applied: int) -> None:
        scheduler = self.engine.scheduler
        snapshot = (scheduler.num_running, scheduler.num_waiting, float(scheduler.pool.usage))
        with self._cond:
            # NOTE: the applied adds leave the queued count only now that the snapshot counts
            # them as waiting, so the queue bound never undercounts.
            self._queued_adds -= adds_applied
            self._snapshot = snapshot
            queued = self._queued_adds
        self.metrics.set_load(snapshot[0], snapshot[1] + queued, snapshot[2], scheduler.pool.num_used_blocks)
        self.metrics.kv_transfer_leased_blocks.set(self._handoff.leases.num_blocks)

    def _restart(self, reason: str) -> bool:
        """The runner failed: fail what the engine held (its requests migrate) and rebuild the
        runner, up to ``restart_attempts`` times; whether the engine serves again."""
        if self.restart_attempts <= 0 or self._stopping:
            return False
        with self._cond:
            self._restarting = reason
        logger.error("engine replica %s: %s; restarting its worker group", self.metrics.replica_id, reason)
        self._fail_held(reason)
        for attempt in range(self.restart_attempts):
            if attempt:
                time.sleep(RESTART_BACKOFF_S * 2 ** (attempt - 1))
            started = time.monotonic()
            try:
                self.engine.restart()
            except Exception:  # noqa: BLE001 - logged; the next attempt, or the engine dies
                logger.exception("engine replica %s: restart %d of %d failed", self.metrics.replica_id, attempt + 1, self.restart_attempts)
                continue
            self.metrics.engine_restarts.inc()
            logger.warning(
                "engine replica %s restarted its worker group in %.1f s (attempt %d of %d)",
                self.metrics.replica_id, time.monotonic() - started, attempt + 1, self.restart_attempts,
            )  # fmt: skip
            with self._cond:
                self._restarting = None
            self._publish_load(0)
            return True
        return False

    def _die(self, reason: str, dead: bool = True) -> None:
        """Fail every request still held and every queued add; refuse new requests."""
        with self._cond:
            if dead:
                self._dead = reason
                logger.error("engine replica %s is dead: %s", self.metrics.replica_id, reason)
        self._fail_held(reason)

    def _fail_held(self, reason: str) -> None:
        """Fail every request still held (a last chunk with ``replica_failed``) and every
        queued add or call (:class:`ReplicaLostError`), for ``reason``; release the leases."""
        with self._cond:
            commands, self._commands = self._orphans + self._commands, []
            self._orphans, self._queued_adds = [], 0
        out: list[tuple[str, _Stream, Any]] = []
        for command in commands:
            if isinstance(command, _Add):
                out.append((command.engine_id, command.stream, ReplicaLostError(reason)))
            elif isinstance(command, _Call):
                out.append(("", command.stream, ReplicaLostError(reason)))
        self._handoff.release_all()
        for engine_id, live in list(self._live.items()):
            try:
                self.engine.abort(engine_id)
            except Exception:  # noqa: BLE001 - the engine may be broken; the stream still ends
                pass
            for child in range(len(live.child_ids)):
                if child not in live.finished_indexes:
                    chunk = live.pending.setdefault(child, CompletionChunk(child, [], ""))
                    chunk.finish_reason = "error"
                    self.metrics.record_finished("error")
            chunk = self._take_chunk(live, time.monotonic())
            # NOTE: the request is not at fault: the ingress may migrate it (flotilla.serve.migration).
            chunk.finished, chunk.error, chunk.replica_failed = True, reason, True
            chunk.prompt_tokens = len(live.add.request.prompt_token_ids)
            chunk.completion_tokens = live.num_tokens
            out.append((engine_id, live.add.stream, chunk))
        self._live.clear()
        self._unscheduled.clear()
        try:
            self._publish_load(0)
        except Exception:  # noqa: BLE001
            pass
        self._deliver(out)

    def _deliver(self, items: list[tuple[str, _Stream, Any]]) -> None:
        """Hand chunks (or exceptions) to their streams: one thread-safe call per event loop."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[str, asyncio.Queue, Any]]] = {}
        for engine_id, stream, item in items:
            by_loop.setdefault(stream.loop, []).append((engine_id, stream.queue, item))
        for loop, batch in by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, batch)
            except RuntimeError:
                # NOTE: the caller's event loop is closed: nobody will read these streams.
                for engine_id, _, _ in batch:
                    if engine_id in self._live:
                        self.engine.abort(engine_id)
                    elif engine_id in self._handoff.leases:
                        self._handoff.release_lease(engine_id)


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    try:
        return ctypes.CDLL(None).malloc_trim  # NOTE: glibc only (not musl, not macOS)
    except (OSError, AttributeError):
        return None


def release_free_heap() -> bool:
    """Give the free pages of every C heap arena back to the OS (glibc's ``malloc_trim(0)``,
    a few milliseconds); False where the C library has no such call."""
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True


def _put_all(batch: list[tuple[str, asyncio.Queue, Any]]) -> None:
    for _, queue, item in batch:
        queue.put_nowait(item)