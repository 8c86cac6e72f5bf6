"""The prefill/decode (PD) handoff of one :class:`~flotilla.serve.async_engine.AsyncEngine`.

Prefill/decode disaggregation (:mod:`flotilla.serve.pd`) adds three commands, applied on
the engine thread like every other:

- :meth:`AsyncEngine.prefill` runs the prompt with ``max_tokens=1`` and ``hold_kv=True``;
  when it finishes the thread grants a :class:`~flotilla.serve.kv_leases.BlockLeases`
  lease on its blocks and answers a :class:`~flotilla.cluster.engine.kv_contract.PrefillTicket`
  (naming this replica and its runner's KV peer). A lease ends by
  :meth:`AsyncEngine.release_kv` or by expiring: the idle thread wakes for the next
  deadline, so blocks of a reader that never came back are freed on time.
- :meth:`AsyncEngine.generate_prefilled` (decode side) hands the ticket to
  ``LLMEngine.add_prefilled_request``: the request waits for its KV while the runner's
  ``kv`` handle reads it on the ranks' own threads (connecting the peer the first time), the
  engine thread steps the other requests meanwhile, and the stream goes on like
  :meth:`AsyncEngine.generate` once the read ended. :class:`KVHandoff` hears each read
  (``kv_transfer`` metrics, a warning per failure).
- Small calls (release, the ``fail_next_reads`` and ``delay_next_reads`` test seams) run as
  ``_Call`` s.

:class:`PDCommands` is the asyncio side (mixed into ``AsyncEngine``); :class:`KVHandoff`
owns the engine-thread side: the leases on prefilled blocks, the lease check of a ticket
before it is read, the reads' metrics.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import AsyncIterator, Callable

from flotilla.cluster.engine.kv_contract import KVHandoffError, PrefillTicket, check_policy
from flotilla.cluster.engine.llm_engine import LLMEngine
from flotilla.serve.async_engine_commands import _Abort, _AddPrefilled, _Prefill
from flotilla.serve.kv_leases import BlockLeases
from flotilla.serve.metrics import EngineMetrics
from flotilla.serve.pd import ends_at_first_token, takes_handoff
from flotilla.serve.types import EngineUnavailableError, GenerateChunk, GenerateRequest

logger = logging.getLogger(__name__)
# The decode side reads a ticket's blocks only while the request is younger than this
# fraction of the ticket's lease (the lease started after the request's arrival, so a
# younger request's lease has not expired; the rest is margin for the read itself and
# for clock skew between nodes). Older: the KV counts as lost (the failure policy applies).
LEASE_READ_FRACTION = 0.9


class KVTransferExpired(RuntimeError):
    """A ticket's blocks were not read: the request is too old for its lease to be sure
    to hold (see :data:`LEASE_READ_FRACTION`); the failure policy applies."""


class PDCommands:
    """The asyncio side of the PD commands, mixed into
    :class:`~flotilla.serve.async_engine.AsyncEngine`: they queue through its command list
    (``_enqueue``, ``_chunks``, ``_call``, ``_submit``) and its :class:`KVHandoff`
    (``_handoff``) does their engine-thread work.
    """

    async def prefill(self, request: GenerateRequest, lease_s: float) -> PrefillTicket:
        """Compute the prompt's KV and first token, and hold the KV blocks for a decode
        engine to read (prefill side of a KV handoff); the ticket names this replica and the
        runner's KV peer (empty when it has no KV endpoint).

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
        await self.compile_constraint(params)
        engine_id, stream = self._enqueue(dataclasses.replace(request, params=params), _Prefill, lease_s=float(lease_s))
        answered = False
        try:
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    answered = True
                    raise item
                if isinstance(item, PrefillTicket):
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
        handoff): the engine allocates blocks and the request waits for its KV while the
        runner's ``kv`` handle reads the ticket's blocks from its peer (off the engine
        thread, bounded by ``timeout_s``; the engine serves its other requests meanwhile);
        then the ticket's first token is the completion's first chunk and it decodes on.
        Chunks, errors and aborts as :meth:`generate`.

        When the connect or the read fails, ``policy`` decides: ``"recompute"`` computes the
        prompt here (the stream shows no error; ``kv_transfer_failures_total`` counts it),
        ``"fail"`` ends the stream with one final chunk whose ``error`` names
        ``kv_load_failure_policy='fail'`` (finish reason ``"error"``, before any token). A
        request older than :data:`LEASE_READ_FRACTION` of the ticket's lease (from its
        ``arrival_time``) is not read at all (its blocks may be gone): ``recompute`` computes
        it, ``fail`` raises :class:`~flotilla.cluster.engine.kv_contract.KVHandoffError`
        before any chunk.
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
        await self.compile_constraint(request.params)
        engine_id, stream = self._enqueue(
            request, _AddPrefilled, ticket=ticket, policy=policy, timeout_s=float(timeout_s)
        )
        async for chunk in self._chunks(engine_id, stream):
            yield chunk

    async def kv_set_fail_next_reads(self, n: int) -> None:
        """Test seam: make the runner's next ``n`` KV reads fail (on every rank)."""
        await self._call(lambda: self.engine.runner.kv.set_fail_next_reads(int(n)))

    async def kv_set_delay_next_reads(self, seconds: float, n: int = 1) -> None:
        """Test seam: each of the runner's next ``n`` KV reads waits ``seconds`` before it
        moves anything (on the ranks' KV threads, within the read's timeout: a slow link)."""
        await self._call(lambda: self.engine.runner.kv.set_delay_next_reads(float(seconds), int(n)))


class KVHandoff:
    """The engine-thread side of the KV handoff: the leases a prefill engine holds on
    finished prompts' blocks, and what a decode engine checks and counts of the tickets it
    reads (the engine's :class:`~flotilla.cluster.engine.kv_contract.KVReadListener`). Only
    the engine thread calls it.

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
        engine.remote_kv.listener = self

    def add_prefilled(self, command: _AddPrefilled) -> None:
        """Queue a prefilled request: the engine reads its KV off this thread (``policy``
        applies to a failed connect as to a failed read). A ticket too old for its lease is
        not read (see :data:`LEASE_READ_FRACTION`)."""
        request, ticket = command.request, command.ticket
        # NOTE: blocks past their lease may be freed and reused on the prefill side:
        # reading them would decode from someone else's KV without an error.
        age_s = time.time() - command.arrival_wall
        if age_s >= LEASE_READ_FRACTION * ticket.lease_s:
            error = KVTransferExpired(
                f"request {request.request_id!r} arrived {age_s:.1f} s ago: the prefill replica's "
                f"{ticket.lease_s} s lease on its KV blocks may have ended; not reading them"
            )
            self.kv_read_failed(ticket.peer_id, len(ticket.block_ids), error)
            if command.policy == "fail":
                raise KVHandoffError(f"request {request.request_id!r}: {error}; kv_load_failure_policy='fail'") from error
            self.engine.add_request(
                request.prompt_token_ids, request.params, request_id=command.engine_id, priority=request.priority
            )
            return
        self.engine.add_prefilled_request(
            ticket,
            request.params,
            request_id=command.engine_id,
            policy=command.policy,
            priority=request.priority,
            timeout_s=command.timeout_s,
        )

    # -- the engine's KVReadListener (on this thread, when the engine observes a read) ------

    def kv_read_done(self, peer_id: str, num_blocks: int, num_bytes: int, seconds: float) -> None:
        self.metrics.record_kv_transfer(int(num_bytes), seconds)

    def kv_read_failed(self, peer_id: str, num_blocks: int, error: BaseException) -> None:
        self.metrics.kv_transfer_failures.inc()
        logger.warning(
            "replica %s: reading %d KV blocks from peer %r failed (%s: %s)",
            self.metrics.replica_id, num_blocks, peer_id, type(error).__name__, error,
        )

    def finish_prefill(self, command: _Prefill, chunk: GenerateChunk) -> PrefillTicket | Exception:
        """A prefill finished: lease its blocks and answer its ticket, or free them and
        answer the error."""
        completion = next((c for c in chunk.completions if c.index == 0), None)
        reason = None if completion is None else completion.finish_reason
        blocks = self.engine.held_kv_blocks(command.engine_id)
        if reason in ("length", "stop") and blocks and completion.token_ids:
            self.leases.grant(command.engine_id, blocks, command.lease_s)
            kv = self.engine.runner.kv
            dp_rank = self.engine.held_kv_dp_rank(command.engine_id)
            peer_id, peer_metadata = "", []
            if kv.attached:
                # NOTE: the runner's handle keeps its ranks' metadata (fixed until it detaches);
                # a DP-attention group names the DP rank holding the blocks as its own peer.
                peer_id, peer_metadata = kv.dp_peer(dp_rank)
            return PrefillTicket(
                request_id=command.request.request_id,
                prefill_request_id=command.engine_id,
                prompt_token_ids=list(command.request.prompt_token_ids),
                first_token=completion.token_ids[0],
                block_ids=blocks,
                finish_reason=reason,
                replica_id=self.metrics.replica_id,
                peer_id=peer_id,
                peer_metadata=peer_metadata,
                lease_s=command.lease_s,
                chunk=chunk,
                dp_rank=dp_rank,
            )
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
