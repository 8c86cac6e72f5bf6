"""One rank's KV endpoint for prefill/decode disaggregation, held by the rank that owns the cache.

A runner holds one :class:`KVPort` as its ``kv`` handle (the in-process
:class:`~flotilla.cluster.engine.model_runner.ModelRunner`, and so each
:class:`~flotilla.cluster.worker.Worker` rank of a group). The port is bound to the rank's
cache, head span and token shard; :meth:`KVPort.attach` builds the rank's endpoint over them
from a factory passed in (``factory(rank, kv_caches, head_span, token_shard)``; ``cluster.kv.endpoint.KVEndpointFactory``
in production).

Reads never run on the caller's thread: :meth:`KVPort.start_read` hands the read to the port's
own thread (one per rank, started at attach) and returns a ``concurrent.futures.Future`` of the
bytes moved; a rank in a worker actor starts reads under an id its group polls
(:meth:`KVPort.submit_read`, :meth:`KVPort.poll_reads`), since a future does not cross Ray.
Connecting a peer, forgetting one and the test seams queue on the same thread, so they take
effect in order with the reads, and the caller never waits for a read in flight; every call
into the endpoint holds one lock.

Test seams: :meth:`KVPort.set_fail_next_reads` (the next reads fail without moving anything)
and :meth:`KVPort.set_delay_next_reads` (the next reads wait first, within their timeout: a
slow link).

NOTE: the endpoint is duck-typed here (``cluster/`` never imports ``serve/``). Its failures
(``KVTransferError`` and anything else but ``ValueError``) come out of reads and connects as
:class:`KVRankError`, which names the rank and crosses Ray intact.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Sequence

import torch

KVEndpointFactory = Callable[[int, Any, tuple[int, int, int], tuple[int, int]], Any]


class KVRankError(RuntimeError):
    """One rank's KV endpoint failed (a transfer error, an unknown peer, an injected failure).

    Picklable (plain message plus ``rank``), so it crosses actors intact; a worker group
    re-raises it without breaking (the rank is alive and its cache intact).

    Attributes:
        rank: the failed rank.
        reason: what happened.
    """

    def __init__(self, rank: int, reason: str):
        super().__init__(f"KV transfer on rank {rank} failed: {reason}")
        self.rank, self.reason = rank, reason

    def __reduce__(self):
        return (KVRankError, (self.rank, self.reason))


def check_kv_attachable(attn_cp_size: int = 1) -> None:
    """Refuse a KV endpoint for layouts the transfer does not cover: attention context
    parallelism (``attn_cp_size > 1``: ranks do not map to attention-TP ranks one to one),
    NotImplementedError. DP attention is covered (each DP rank's ranks move only its own
    pool's blocks: :meth:`KVPort.start_read`'s ``dp_rank``), and so is decode context
    parallelism on the reading side (each rank reads its token shard of every block).
    """
    if attn_cp_size > 1:
        raise NotImplementedError(
            f"prefill/decode disaggregation does not support attention context parallelism "
            f"(got attn_cp_size={attn_cp_size}); use attn_cp_size=1 on PD engines"
        )


class KVPort:
    """One rank's KV endpoint, bound to its cache (see the module docstring).

    Args:
        rank: the rank that owns the cache (named in every error; the factory names the
            endpoint's agent after it).
        kv_caches: the rank's cache tensors (registered with the endpoint at attach).
        head_span: returns ``(start, count, total)``, the global KV heads the cache holds
            (called at attach: a model that cannot say is refused then, not before).
        attn_cp_size: the rank's attention context-parallel width, checked at attach
            (:func:`check_kv_attachable`).
        dp_rank: the DP-attention rank whose scheduler and pool the cache serves (0 without
            DP attention): a read for another DP rank's blocks moves nothing here.
        token_shard: ``(dcp_rank, dcp_size)``: the tokens of each logical block the cache
            holds under decode context parallelism (``(0, 1)``: every token).
    """

    def __init__(
        self,
        rank: int,
        kv_caches: Any,
        head_span: Callable[[], tuple[int, int, int]],
        attn_cp_size: int = 1,
        dp_rank: int = 0,
        token_shard: tuple[int, int] = (0, 1),
    ):
        self.rank = rank
        self.dp_rank = int(dp_rank)
        self.token_shard = (int(token_shard[0]), int(token_shard[1]))
        self._kv_caches = kv_caches
        self._head_span = head_span
        self._attn_cp_size = int(attn_cp_size)
        self._endpoint: Any = None
        self._metadata: list[bytes] | None = None
        self.peer_id: str | None = None
        # NOTE: every call into the endpoint holds it (reads on the port's thread, metadata
        # and exports on callers' threads).
        self._lock = threading.Lock()
        self._thread: ThreadPoolExecutor | None = None
        # Reads started by id (submit_read), until poll_reads hands back their outcome.
        self._tracked: dict[int, Future] = {}
        # The seams' state, touched only on the port's thread.
        self._delays: list[float] = []

    @property
    def attached(self) -> bool:
        return self._endpoint is not None

    def attach(self, factory: KVEndpointFactory) -> None:
        """Build the endpoint over the rank's cache (registers it; once until :meth:`detach`).
        NotImplementedError under attention context parallelism."""
        check_kv_attachable(self._attn_cp_size)
        if self._endpoint is not None:
            raise RuntimeError(
                f"rank {self.rank}: a KV endpoint is already attached ({self._endpoint.name!r}); "
                "detach it (kv.detach()) before attaching another"
            )
        span = tuple(int(x) for x in self._head_span())
        self._endpoint = factory(self.rank, self._kv_caches, span, self.token_shard)
        self.peer_id = getattr(factory, "name", None)
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"flotilla-kv-rank{self.rank}")

    def _require(self) -> Any:
        if self._endpoint is None:
            raise RuntimeError(f"rank {self.rank}: no KV endpoint attached; call kv.attach(factory) first")
        return self._endpoint

    def metadata(self) -> list[bytes]:
        """This rank's endpoint descriptor for peers, as the runner's list of one entry per
        rank (one here); it travels through Ray. Fixed until :meth:`detach`."""
        endpoint = self._require()
        if self._metadata is None:
            with self._lock:
                self._metadata = [endpoint.metadata()]
        return list(self._metadata)

    def dp_peer(self, dp_rank: int = 0) -> tuple[str, list[bytes]]:
        """``(peer id, metadata)`` a ticket of this rank's blocks names (as a worker group's
        ``dp_peer``; one rank: its own DP rank only)."""
        if int(dp_rank) != self.dp_rank:
            raise ValueError(f"rank {self.rank} serves DP rank {self.dp_rank}, not dp_rank={dp_rank!r}")
        return self.peer_id or "", self.metadata()

    def connect(self, peer_id: str, peer_metadata: Sequence[bytes]) -> None:
        """Connect the peer engine ``peer_id`` (one metadata entry per peer rank, rank order;
        idempotent per peer). Waits for the reads queued before it."""
        endpoint = self._require()
        self._on_thread(self._call, endpoint.connect, peer_id, list(peer_metadata)).result()

    def start_read(
        self,
        peer_id: str,
        src: Sequence[int],
        dst: Sequence[int],
        timeout_s: float,
        connect_with: Sequence[bytes] | None = None,
        dp_rank: int | None = None,
    ) -> Future:
        """Start pulling this rank's KV heads of blocks ``src`` of ``peer_id`` into local
        blocks ``dst`` on the port's thread (first connecting the peer with ``connect_with``,
        its per-rank metadata, when it is not connected); returns at once. The future gives
        the bytes moved, or raises KVRankError (a transfer failure, the timeout) or
        ValueError (misuse). ``dp_rank``: the DP-attention rank whose pool ``dst`` names; a
        rank of another DP rank moves nothing (its future gives 0 at once)."""
        endpoint = self._require()
        if dp_rank is not None and int(dp_rank) != self.dp_rank:
            skipped: Future = Future()
            skipped.set_result(0)
            return skipped
        args = (peer_id, [int(b) for b in src], [int(b) for b in dst], float(timeout_s))
        metadata = None if connect_with is None else list(connect_with)
        return self._on_thread(self._read, endpoint, *args, metadata)

    def read(self, peer_id: str, src: Sequence[int], dst: Sequence[int], timeout_s: float) -> int:
        """:meth:`start_read` and wait for it: the bytes moved (KVRankError, ValueError)."""
        return self.start_read(peer_id, src, dst, timeout_s).result()

    def submit_read(
        self,
        read_id: int,
        peer_id: str,
        src: Sequence[int],
        dst: Sequence[int],
        timeout_s: float,
        connect_with: Sequence[bytes] | None = None,
        dp_rank: int | None = None,
    ) -> None:
        """:meth:`start_read` under ``read_id`` (a worker group's handle: the group polls it
        with :meth:`poll_reads`); returns at once."""
        self._tracked[int(read_id)] = self.start_read(peer_id, src, dst, timeout_s, connect_with, dp_rank)

    def poll_reads(self, read_ids: Sequence[int]) -> dict[int, Any]:
        """The outcome of each ended read of ``read_ids`` (the bytes moved, or the exception
        it raised), which is then forgotten; reads still in flight (and unknown ids) are left out."""
        out: dict[int, Any] = {}
        for read_id in read_ids:
            future = self._tracked.get(int(read_id))
            if future is None or not future.done():
                continue
            del self._tracked[int(read_id)]
            try:
                out[int(read_id)] = future.result()
            except BaseException as exc:  # noqa: BLE001 - the read's outcome, handed back as a value
                out[int(read_id)] = exc
        return out

    def drop_reads(self, read_ids: Sequence[int]) -> None:
        """Forget reads nobody will poll (the engine gave up on them); they run to their bound."""
        for read_id in read_ids:
            future = self._tracked.pop(int(read_id), None)
            if future is not None:
                future.cancel()

    def export(self, block_ids: Sequence[int], heads: tuple[int, int] | None = None, tokens: Sequence[int] = (0, 1)) -> Any:
        """Source side of the Ray fallback: the blocks' bytes (``tokens``: the reader's token
        shard; the reader wraps its errors)."""
        endpoint = self._require()
        with self._lock:
            return endpoint.export([int(b) for b in block_ids], heads, tuple(tokens))

    def forget(self, peer_id: str) -> None:
        """Drop a peer engine (after the reads queued before it); returns at once."""
        if self._endpoint is not None:
            self._on_thread(self._call, self._endpoint.forget, peer_id)

    def set_fail_next_reads(self, n: int) -> None:
        """Test seam: the next ``n`` reads of this rank fail without moving anything."""
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"n must be a non-negative int (got n={n!r})")
        endpoint = self._require()

        def arm() -> None:
            with self._lock:
                endpoint.fail_next_reads = n

        self._on_thread(arm)

    def set_delay_next_reads(self, seconds: float, n: int = 1) -> None:
        """Test seam: each of the next ``n`` reads of this rank waits ``seconds`` before it
        moves anything (on the port's thread, counted in its timeout: a slow link)."""
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"n must be a non-negative int (got n={n!r})")
        if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not seconds >= 0:
            raise ValueError(f"seconds must be a non-negative number (got seconds={seconds!r})")
        self._require()

        def arm() -> None:
            self._delays = [float(seconds)] * n

        self._on_thread(arm)

    def detach(self) -> None:
        """Close the endpoint (idempotent): reads not started are cancelled, the one in flight
        ends first (within its timeout). A later :meth:`attach` may build a new one."""
        endpoint, self._endpoint = self._endpoint, None
        thread, self._thread = self._thread, None
        self._metadata, self.peer_id = None, None
        self._tracked.clear()
        if thread is not None:
            thread.shutdown(wait=True, cancel_futures=True)
        if endpoint is not None:
            with self._lock:
                endpoint.close()

    # -- the port's thread --------------------------------------------------------------

    def _on_thread(self, fn: Callable[..., Any], *args: Any) -> Future:
        if self._thread is None:
            raise RuntimeError(f"rank {self.rank}: no KV endpoint attached; call kv.attach(factory) first")
        return self._thread.submit(fn, *args)

    def _read(
        self, endpoint: Any, peer_id: str, src: list[int], dst: list[int], timeout_s: float, connect_with: list | None
    ) -> int:
        deadline = time.monotonic() + timeout_s
        if connect_with is not None and not endpoint.is_connected(peer_id):
            self._call(endpoint.connect, peer_id, connect_with)
        if self._delays:
            time.sleep(min(self._delays.pop(0), max(0.0, deadline - time.monotonic())))
        left = deadline - time.monotonic()
        if left <= 0:
            raise KVRankError(self.rank, f"the KV read from {peer_id!r} did not finish within {timeout_s} s")
        # NOTE: the cache tensors are inference tensors; a CPU copy into them needs inference
        # mode, which is per thread.
        with torch.inference_mode():
            return int(self._call(endpoint.read, peer_id, src, dst, left))

    def _call(self, method: Callable[..., Any], *args: Any) -> Any:
        try:
            with self._lock:
                return method(*args)
        except ValueError as exc:
            raise ValueError(f"rank {self.rank}: {exc}") from exc
        except Exception as exc:  # noqa: BLE001 - every endpoint failure is this rank's KV error
            raise KVRankError(self.rank, f"{type(exc).__name__}: {exc}") from exc
