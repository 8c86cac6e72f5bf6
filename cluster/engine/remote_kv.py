"""The decode engine's KV reads in flight: the engine-side half of a prefill/decode handoff.

:class:`RemoteKVReads` starts each prefilled request's read through a
:class:`~flotilla.cluster.engine.kv_contract.KVReader` (the runner's ``kv`` handle: the read
runs on the ranks' own threads), connecting each peer engine once (the least recently used
beyond :data:`MAX_KV_PEERS` is forgotten), and hands the engine the reads that ended, without
ever waiting for one: :meth:`RemoteKVReads.ended` checks their handles (``done()``), and
:meth:`RemoteKVReads.wait` sleeps a short bound while the engine has nothing else to run.
A read that outlives its timeout plus :data:`READ_GRACE_S` counts as failed.

Whoever listens (:class:`~flotilla.cluster.engine.kv_contract.KVReadListener`, the serving
side's metrics) hears each read's outcome when the engine observes it.

Pure Python: no torch.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from concurrent.futures import FIRST_COMPLETED, Future
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass
from typing import Sequence

from flotilla.cluster.engine.kv_contract import KVRead, KVReader, KVReadListener, PrefillTicket

# KV peers (prefill engine incarnations) a decode engine stays connected to; the least
# recently used one is forgotten beyond this (a restarted prefill replica is a new peer).
MAX_KV_PEERS = 64
# A read still not ended this long past its own timeout counts as failed (the transport
# bounds it by the timeout; this covers a handle that never reports).
READ_GRACE_S = 5.0
# How long a step with nothing to run but reads in flight waits for one to end (a read of
# this process wakes it at once); a serving loop's commands wait at most this long meanwhile.
IDLE_WAIT_S = 0.005


@dataclass(eq=False)
class RemoteRead:
    """One prefilled request's KV read in flight.

    Attributes:
        request_id: the decode engine's id of the request.
        ticket: what the prefill engine computed (its first token, its peer).
        num_blocks: blocks the read fills.
        handle: the read.
        started: ``time.monotonic()`` when it started.
        deadline: ``time.monotonic()`` past which it counts as failed.
        policy: ``kv_load_failure_policy`` of the request.
    """

    request_id: str
    ticket: PrefillTicket
    num_blocks: int
    handle: KVRead
    started: float
    deadline: float
    policy: str


class RemoteKVReads:
    """The reads of prefilled requests' KV a decode engine has in flight (see the module
    docstring). Only the engine's thread calls it.

    Attributes:
        listener: told of each read's outcome (None: nobody listens).
    """

    def __init__(self, listener: KVReadListener | None = None):
        self.listener = listener
        self._reads: dict[str, RemoteRead] = {}
        # (peer id, reading DP rank or None) -> the reader it was connected on
        self._peers: OrderedDict[tuple[str, int | None], KVReader] = OrderedDict()

    def __len__(self) -> int:
        return len(self._reads)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._reads

    def start(
        self,
        reader: KVReader,
        request_id: str,
        ticket: PrefillTicket,
        src: Sequence[int],
        dst: Sequence[int],
        timeout_s: float,
        policy: str,
        dp_rank: int | None = None,
    ) -> None:
        """Start reading ``ticket``'s blocks ``src`` into ``dst`` through ``reader``
        (connecting its peer the first time it is seen by the reading ranks, when the ticket
        carries its metadata); ``dp_rank``: the DP-attention rank whose ranks read (None:
        every rank). Raises what starting the read raised (the listener heard it)."""
        peer_id = ticket.peer_id
        connect_with = None
        # NOTE: each DP rank's ranks connect a peer on their own, so "connected" is per DP rank.
        key = (peer_id, dp_rank)
        if ticket.peer_metadata and self._peers.get(key) is not reader:
            connect_with = list(ticket.peer_metadata)
        try:
            handle = reader.start_read(peer_id, list(src), list(dst), timeout_s, connect_with, dp_rank=dp_rank)
        except Exception as exc:
            self._heard_failure(peer_id, len(dst), exc)
            raise
        if ticket.peer_metadata:
            self._remember_peer(key, reader)
        started = time.monotonic()
        self._reads[request_id] = RemoteRead(
            request_id, ticket, len(dst), handle, started, started + timeout_s + READ_GRACE_S, policy
        )

    def ended(self) -> list[tuple[RemoteRead, int | BaseException]]:
        """The reads that ended since the last call, each with the bytes it moved or its
        error (a read past its deadline: a TimeoutError, and it is given up); never waits."""
        now = time.monotonic()
        out: list[tuple[RemoteRead, int | BaseException]] = []
        for request_id, read in list(self._reads.items()):
            if read.handle.done():
                try:
                    outcome: int | BaseException = int(read.handle.result())
                except BaseException as exc:  # noqa: BLE001 - a failed read is an outcome
                    outcome = exc
            elif now > read.deadline:
                read.handle.cancel()
                outcome = TimeoutError(
                    f"the KV read of {read.num_blocks} blocks from {read.ticket.peer_id!r} did not end within "
                    f"{read.deadline - read.started:.1f} s"
                )
            else:
                continue
            del self._reads[request_id]
            if isinstance(outcome, BaseException):
                self._heard_failure(read.ticket.peer_id, read.num_blocks, outcome)
            elif self.listener is not None:
                self.listener.kv_read_done(read.ticket.peer_id, read.num_blocks, outcome, now - read.started)
            out.append((read, outcome))
        return out

    def wait(self, timeout_s: float) -> None:
        """Sleep until a read ends or ``timeout_s`` passes (reads of this process wake it at
        once; others are looked at again after the bound)."""
        if not self._reads:
            return
        futures = [r.handle for r in self._reads.values() if isinstance(r.handle, Future)]
        if len(futures) == len(self._reads):
            wait_futures(futures, timeout=timeout_s, return_when=FIRST_COMPLETED)
        else:
            time.sleep(timeout_s)

    def forget_peers(self) -> None:
        """Forget every peer (the runner they were connected on is gone)."""
        self._peers.clear()

    def _remember_peer(self, key: tuple[str, int | None], reader: KVReader) -> None:
        self._peers[key] = reader
        self._peers.move_to_end(key)
        while len(self._peers) > MAX_KV_PEERS:
            (old, _), old_reader = self._peers.popitem(last=False)
            # NOTE: forgetting drops the peer on every rank: its other DP ranks' entries go too.
            for other in [k for k in self._peers if k[0] == old]:
                del self._peers[other]
            try:
                old_reader.forget(old)
            except Exception:  # noqa: BLE001 - a peer that cannot be forgotten costs memory only
                pass

    def _heard_failure(self, peer_id: str, num_blocks: int, error: BaseException) -> None:
        # NOTE: a failed read may have failed connecting: the next ticket of the peer connects again.
        for key in [k for k in self._peers if k[0] == peer_id]:
            del self._peers[key]
        if self.listener is not None:
            self.listener.kv_read_failed(peer_id, num_blocks, error)
