"""The prefill/decode (PD) handoff of one :class:`~flotilla.serve.async_engine.AsyncEngine`.

Prefill/decode disaggregation (:mod:`flotilla.serve.pd`) adds three commands, applied on
the engine thread like every other:

- :meth:`AsyncEngine.prefill` runs the prompt with ``max_tokens=1`` and ``hold_kv=True``;
  when it finishes the thread grants a :class:`~flotilla.serve.kv_leases.BlockLeases`
  lease on its blocks and answers a :class:`PrefillOutcome`. A lease ends by
  :meth:`AsyncEngine.release_kv` or by expiring: the idle thread wakes for the next
  deadline, so blocks of a reader that never came back are freed on time.
- :meth:`AsyncEngine.generate_prefilled` (decode side) connects the runner to the
  ticket's KV peer (once per peer id), then ``LLMEngine.add_prefilled_request`` reads the
  prefill blocks through ``runner.kv_read`` (timed and counted in the ``kv_transfer``
  metrics) and streams like :meth:`AsyncEngine.generate`.
- Small calls (release, the ``fail_next_reads`` test seam) run as ``_Call`` s.

:class:`PDCommands` is the asyncio side (mixed into ``AsyncEngine``); :class:`KVHandoff`
owns the engine-thread side: the leases on prefilled blocks and the KV peers.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import AsyncIterator, Callable

from flotilla.cluster.engine.kv_handoff import KVHandoffError, check_policy
from flotilla.cluster.engine.llm_engine import LLMEngine
from flotilla.serve.async_engine_commands import _Abort, _AddPrefilled, _Prefill
from flotilla.serve.kv_leases import BlockLeases
from flotilla.serve.metrics import EngineMetrics
from flotilla.serve.pd import ends_at_first_token, takes_handoff
from flotilla.serve.types import EngineUnavailableError, GenerateChunk, GenerateRequest, PrefillTicket

logger = logging.getLogger(__name__)

# KV peers (prefill engine incarnations) a decode engine stays connected to; the least
# recently used one is forgotten beyond this (a restarted prefill replica is a new peer).
MAX_KV_PEERS = 64
# The decode side reads a ticket's blocks only while the request is younger than this
# fraction of the ticket's lease (the lease started after the request's arrival, so a
# younger request's lease has not expired; the rest is margin for the read itself and
# for clock skew between nodes). Older: the KV counts as lost (the failure policy applies).
LEASE_READ_FRACTION = 0.9


@dataclass
class PrefillOutcome:
    """What :meth:`AsyncEngine.prefill` computed: a prompt whose KV blocks the prefill
    engine holds under a lease (the engine side of a
    :class:`~flotilla.serve.types.PrefillTicket`).

    Attributes:
        prefill_request_id: the engine's id for the held blocks (release them under it).
        first_token: the token sampled after the prompt.
        block_ids: the blocks holding the prompt's KV, in position order.
        finish_reason: ``"length"`` (decoding goes on elsewhere) or ``"stop"`` (the first
            token ends the completion).
        chunk: the prefill's final chunk (the first token, its text, usage).
    """

    prefill_request_id: str
    first_token: int
    block_ids: list[int]
    finish_reason: str
    chunk: GenerateChunk

    def ticket(
        self, request: GenerateRequest, replica_id: str, peer_id: str, peer_metadata: list[bytes], lease_s: float
    ) -> PrefillTicket:
        """The :class:`PrefillTicket` a decode engine needs, for ``request`` prefilled by
        replica ``replica_id`` whose KV endpoint is ``peer_id`` (``peer_metadata``: per rank)."""
        return PrefillTicket(
            request_id=request.request_id,
            prefill_request_id=self.prefill_request_id,
            replica_id=replica_id,
            peer_id=peer_id,
            peer_metadata=list(peer_metadata),
            prompt_token_ids=list(request.prompt_token_ids),
            first_token=self.first_token,
            block_ids=list(self.block_ids),
            finish_reason=self.finish_reason,
            chunk=self.chunk,
            lease_s=lease_s,
        )


class KVTransferExpired(RuntimeError):
    """A ticket's blocks were not read: the request is too old for its lease to be sure
    to hold (see :data:`LEASE_READ_FRACTION`); the failure policy applies."""


class PDCommands:
    """The asyncio side of the PD commands, mixed into
    :class:`~flotilla.serve.async_engine.AsyncEngine`: they queue through its command list
    (``_enqueue``, ``_chunks``, ``_call``, ``_submit``) and its :class:`KVHandoff`
    (``_handoff``) does their engine-thread work.
    """

    async def prefill(self, request: GenerateRequest, lease_s: float) -> PrefillOutcome:
        """Compute the prompt's KV and first token, and hold the KV blocks for a decode
        engine to read (prefill side of a KV handoff).

        The request runs with ``n=1`` and ``max_tokens=1`` (its other sampling parameters
        as given); its blocks stay held under a lease of ``lease_s`` seconds, until
        :meth:`release_kv` or the lease expires. Raises like :meth:`generate` (``ValueError``,
        :class:`EngineOverloadedError`, :class:`EngineUnavailableError`, also when the
        engine dies meanwhile). Cancelling the call aborts the prefill (or releases its
        blocks, when it finished already).
        """
        if not isinstance(lease_s, (int, float)) or isinstance(lease_s, bool) or not lease_s > 0:
            raise ValueError(f"lease_s must be a positive number of seconds (got lease_s={lease_s!r})")
        params = dataclasses.replace(request.params, n=1, max_tokens=1)
        engine_id, stream = self._enqueue(dataclasses.replace(request, params=params), _Prefill, lease_s=float(lease_s))
        answered = False
        try:
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    answered = True
                    raise item
                if isinstance(item, PrefillOutcome):
                    answered = True
                    return item
                if item.finished:
                    # NOTE: a final chunk instead of an outcome: the engine died under it.
                    answered = True
                    raise EngineUnavailableError(f"the prefill failed: {item.error or 'the engine stopped'}")
        finally:
            if not answered:
                self._submit(_Abort(engine_id))

    async def release_kv(self, prefill_request_id: str) -> bool:
        """End the lease of a :meth:`prefill` and free its blocks; False when there is
        none (never granted, released already, expired, or the engine is gone)."""
        try:
            return await self._call(lambda: self._handoff.release_lease(str(prefill_request_id)))
        except EngineUnavailableError:
            return False

    async def generate_prefilled(
        self, request: GenerateRequest, ticket: PrefillTicket, policy: str = "recompute", timeout_s: float = 30.0
    ) -> AsyncIterator[GenerateChunk]:
        """Stream a request whose prompt a prefill engine computed (decode side of a KV
        handoff): the engine allocates blocks, reads the ticket's blocks from its peer
        (``runner.kv_read``, bounded by ``timeout_s``), takes the ticket's first token as
        the completion's first and decodes on. Chunks, errors and aborts as :meth:`generate`.

        When the connect or the read fails, ``policy`` decides: ``"recompute"`` computes the
        prompt here (the stream shows no error; ``kv_transfer_failures_total`` counts it),
        ``"fail"`` raises :class:`~flotilla.cluster.engine.kv_handoff.KVHandoffError` before
        any chunk. A request older than :data:`LEASE_READ_FRACTION` of the ticket's lease
        (from its ``arrival_time``) is not read at all (its blocks may be gone) and goes
        through the policy the same way.
        When the ticket already answers the request (:func:`ends_at_first_token`) its chunk
        is the stream. Requests a handoff cannot carry (``n > 1``, ``logprobs``) run here as
        ordinary requests, prompt included; the ticket is not used.
        """
        check_policy(policy)
        if not isinstance(timeout_s, (int, float)) or isinstance(timeout_s, bool) or not timeout_s > 0:
            raise ValueError(f"timeout_s must be a positive number of seconds (got timeout_s={timeout_s!r})")
        if not takes_handoff(request.params):
            async for chunk in self.generate(request):
                yield chunk
            return
        if list(ticket.prompt_token_ids) != list(request.prompt_token_ids):
            raise ValueError(
                f"ticket: the ticket of request {ticket.request_id!r} holds another prompt than request "
                f"{request.request_id!r} ({len(ticket.prompt_token_ids)} vs {len(request.prompt_token_ids)} tokens)"
            )
        if ends_at_first_token(request, ticket):
            self.metrics.record_finished(ticket.finish_reason or "length")
            yield ticket.chunk
            return
        engine_id, stream = self._enqueue(
            request, _AddPrefilled, ticket=ticket, policy=policy, timeout_s=float(timeout_s)
        )
        async for chunk in self._chunks(engine_id, stream):
            yield chunk

    async def kv_set_fail_next_reads(self, n: int) -> None:
        """Test seam: make the runner's next ``n`` KV reads fail (on every local rank)."""
        await self._call(lambda: self.engine.runner.kv_set_fail_next_reads(int(n)))


class KVHandoff:
    """The engine-thread side of the KV handoff: the leases a prefill engine holds on
    finished prompts' blocks, and the KV peers a decode engine reads from. Only the engine
    thread calls it.

    Args:
        engine: the engine the thread drives.
        metrics: the replica's metrics (``kv_transfer`` failures, reads).
        publish_load: publishes the engine's load; called after leases free blocks.
    """

    def __init__(self, engine: LLMEngine, metrics: EngineMetrics, publish_load: Callable[[], None]):
        self.engine = engine
        self.metrics = metrics
        self._publish_load = publish_load
        # NOTE: BlockLeases holds the leased blocks; the deadlines are kept here too, so the
        # idle thread knows when to wake.
        self.leases = BlockLeases()
        self._kv_peers: OrderedDict[str, None] = OrderedDict()

    def add_prefilled(self, command: _AddPrefilled) -> None:
        """Queue a prefilled request: connect to its peer, then let the engine copy the
        blocks in (``policy`` applies to a failed connect as to a failed read)."""
        request, ticket = command.request, command.ticket
        try:
            self._connect_peer(ticket.peer_id, ticket.peer_metadata)
        except Exception as exc:  # noqa: BLE001 - any connect failure goes through the policy
            self.metrics.kv_transfer_failures.inc()
            logger.warning(
                "replica %s: connecting to KV peer %r failed (%s: %s)",
                self.metrics.replica_id, ticket.peer_id, type(exc).__name__, exc,
            )
            if command.policy == "fail":
                raise KVHandoffError(
                    f"request {request.request_id!r}: connecting to the prefill replica's KV endpoint "
                    f"{ticket.peer_id!r} failed ({type(exc).__name__}: {exc}); kv_load_failure_policy='fail'"
                ) from exc
            self.engine.add_request(
                request.prompt_token_ids, request.params, request_id=command.engine_id, priority=request.priority
            )
            return

        def copy_blocks(src: list[int], dst: list[int]) -> None:
            # NOTE: blocks past their lease may be freed and reused on the prefill side:
            # reading them would decode from someone else's KV without an error.
            age_s = time.time() - command.arrival_wall
            if age_s >= LEASE_READ_FRACTION * ticket.lease_s:
                self.metrics.kv_transfer_failures.inc()
                raise KVTransferExpired(
                    f"request {request.request_id!r} arrived {age_s:.1f} s ago: the prefill replica's "
                    f"{ticket.lease_s} s lease on its KV blocks may have ended; not reading them"
                )
            self._read_blocks(ticket.peer_id, src, dst, command.timeout_s)

        self.engine.add_prefilled_request(
            request.prompt_token_ids,
            ticket.first_token,
            ticket.block_ids,
            copy_blocks,
            request.params,
            request_id=command.engine_id,
            policy=command.policy,
            priority=request.priority,
        )

    def _connect_peer(self, peer_id: str, peer_metadata: list[bytes]) -> None:
        """Connect the runner to a prefill engine's KV endpoint, once per peer id."""
        if peer_id in self._kv_peers:
            self._kv_peers.move_to_end(peer_id)
            return
        self.engine.runner.kv_connect(peer_id, list(peer_metadata))
        self._kv_peers[peer_id] = None
        while len(self._kv_peers) > MAX_KV_PEERS:
            old, _ = self._kv_peers.popitem(last=False)
            try:
                self.engine.runner.kv_forget(old)
            except Exception:  # noqa: BLE001 - a peer that cannot be forgotten costs memory only
                logger.debug("replica %s: forgetting KV peer %r failed", self.metrics.replica_id, old, exc_info=True)

    def _read_blocks(self, peer_id: str, src: list[int], dst: list[int], timeout_s: float) -> None:
        """``copy_blocks`` of a KV handoff: ``runner.kv_read``, timed and counted."""
        if not src:
            return
        started = time.monotonic()
        try:
            moved = self.engine.runner.kv_read(peer_id, list(src), list(dst), timeout_s)
        except Exception as exc:
            self.metrics.kv_transfer_failures.inc()
            logger.warning(
                "replica %s: reading %d KV blocks from peer %r failed (%s: %s)",
                self.metrics.replica_id, len(src), peer_id, type(exc).__name__, exc,
            )
            raise
        self.metrics.record_kv_transfer(int(moved or 0), time.monotonic() - started)

    def finish_prefill(self, command: _Prefill, chunk: GenerateChunk) -> PrefillOutcome | Exception:
        """A prefill finished: lease its blocks and answer the outcome, or free them and
        answer the error."""
        completion = next((c for c in chunk.completions if c.index == 0), None)
        reason = None if completion is None else completion.finish_reason
        blocks = self.engine.held_kv_blocks(command.engine_id)
        if reason in ("length", "stop") and blocks and completion.token_ids:
            self.leases.grant(command.engine_id, blocks, command.lease_s)
            return PrefillOutcome(command.engine_id, completion.token_ids[0], blocks, reason, chunk)
        self.engine.release_kv(command.engine_id)
        return EngineUnavailableError(
            f"the prefill of request {command.request.request_id!r} ended with {reason!r}: {chunk.error or 'no token'}"
        )

    def release_lease(self, prefill_request_id: str) -> bool:
        """End a lease and free its blocks; False when there is none."""
        if self.leases.release(prefill_request_id) is None:
            return False
        released = self.engine.release_kv(prefill_request_id)
        self._publish_load()
        return released

    def expire_leases(self) -> None:
        """Free the blocks of every lease past its deadline (nobody read and released them)."""
        expired = self.leases.expire()
        for prefill_request_id in expired:
            logger.warning(
                "replica %s: the KV lease of %s expired unreleased; freeing its blocks",
                self.metrics.replica_id, prefill_request_id,
            )
            self.engine.release_kv(prefill_request_id)
        if expired:
            self._publish_load()

    def release_all(self) -> None:
        """End every lease (the engine is going away); a broken engine does not keep one."""
        for prefill_request_id in list(self.leases.held()):
            try:
                self.release_lease(prefill_request_id)
            except Exception:  # noqa: BLE001 - the engine may be broken; the leases end anyway
                self.leases.release(prefill_request_id)
