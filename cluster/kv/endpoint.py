"""One rank's side of KV transfer between two engines whose TP sizes may differ.

:class:`KVEndpoint` wraps a :class:`~flotilla.cluster.kv.transport.KVTransport` of one rank:
``connect(peer_id, metadata)`` takes a peer engine's per-rank transport metadata (it
travels through Ray), plans which peer rank serves which of this rank's KV heads
(:func:`plan_head_reads`: each head once, from the lowest-index peer rank holding it) and
connects those ranks as ``f"{peer_id}/{rank}"``; ``read`` pulls the planned heads of the
given blocks from each. :class:`KVEndpointFactory` is the picklable recipe the cluster
side receives (``runner.kv.attach(factory)``) to build one endpoint per rank; ``cluster/``
holds the endpoint duck-typed and never imports ``serve``.

Transport kinds (:data:`KV_TRANSPORTS`): ``"nixl"`` (NIXL READs over UCX) and ``"ray"`` (the
Ray-object fallback; the source rank must be an actor the reader can call).
"""

from __future__ import annotations

import importlib
import time
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from flotilla.cluster.kv.transport import (
    WHOLE_TOKENS,
    HeadSpan,
    KVCaches,
    KVTransferError,
    KVTransport,
    NixlTransport,
    RayObjectTransport,
    _load_metadata,
    check_compatible,
)

# Transport kinds a KVEndpointFactory builds.
KV_TRANSPORTS = ("nixl", "ray")


def plan_head_reads(local: HeadSpan, peers: Sequence[HeadSpan]) -> list[tuple[int, int, int]]:
    """Which peer rank to read each of ``local``'s heads from.

    Returns ``(peer_index, lo, hi)`` global head ranges, in head order, covering
    ``[local.start, local.stop)``; each head is read once, from the lowest-index peer
    holding it (replicated KV heads: the first replica).

    Raises:
        ValueError: no peers, a peer's ``total`` differs from ``local.total``, or a local
            head is held by no peer.
    """
    if not peers:
        raise ValueError("peers is empty: give the head span of every peer rank")
    totals = [p.total for p in peers]
    if any(t != local.total for t in totals):
        raise ValueError(
            f"peer head totals {totals} differ from the local total {local.total}: "
            "both sides must hold the same model's KV heads"
        )
    plan: list[tuple[int, int, int]] = []
    for head in range(local.start, local.stop):
        owner = next((i for i, p in enumerate(peers) if p.start <= head < p.stop), None)
        if owner is None:
            raise ValueError(
                f"KV head {head} (local {local}) is held by no peer rank (peer spans: {[str(p) for p in peers]})"
            )
        if plan and plan[-1][0] == owner and plan[-1][2] == head:
            plan[-1] = (owner, plan[-1][1], head + 1)
        else:
            plan.append((owner, head, head + 1))
    return plan


# ---------------------------------------------------------------------------------------
# One rank's endpoint across TP groups


class KVEndpoint:
    """One rank's side of KV transfer between two engines whose TP sizes may differ.

    Registers ``kv_caches`` (holding ``head_span``) with ``transport``; ``connect`` takes a
    peer engine's per-rank metadata, plans which of its ranks serve which of our heads
    (:func:`plan_head_reads`) and connects those ranks as ``f"{peer_id}/{rank}"``;
    ``read`` pulls the planned heads from each. This is the object the cluster side holds
    (duck-typed there: ``cluster/`` never imports ``serve``).

    Attributes:
        head_span: the heads this rank's cache holds.
    """

    def __init__(
        self,
        transport: KVTransport,
        kv_caches: KVCaches,
        head_span: HeadSpan | Sequence[int],
        token_shard: Sequence[int] = WHOLE_TOKENS,
    ) -> None:
        self.head_span = HeadSpan.of(head_span)
        self._transport = transport
        transport.register(kv_caches, self.head_span, token_shard)
        self._plans: dict[str, list[tuple[int, int, int]]] = {}  # peer id -> [(rank, lo, hi)]

    @property
    def name(self) -> str:
        """The transport's agent name."""
        return self._transport.name

    @property
    def fail_next_reads(self) -> int:
        """Test seam, forwarded to the transport: while positive, ``read`` decrements it and
        raises :class:`KVTransferError` without moving anything."""
        return self._transport.fail_next_reads

    @fail_next_reads.setter
    def fail_next_reads(self, n: int) -> None:
        self._transport.fail_next_reads = int(n)

    def metadata(self) -> bytes:
        """This rank's transport metadata (send it to peers through Ray)."""
        return self._transport.metadata()

    def connect(self, peer_id: str, peer_metadata: Sequence[bytes]) -> None:
        """Connect the peer engine ``peer_id`` given its ranks' ``metadata()`` in rank order.

        Idempotent per ``peer_id`` (a known peer is left as it is). Every peer rank is
        checked for a compatible layout; only the ranks holding heads of ours are connected.

        Raises:
            ValueError: empty ``peer_metadata``, bytes that are not transport metadata, an
                incompatible layout, or heads of ours that no peer rank holds.
            KVTransferError: the transport could not connect a peer rank.
        """
        if peer_id in self._plans:
            return
        if not peer_metadata:
            raise ValueError(f"peer_metadata for {peer_id!r} is empty: give every peer rank's metadata, in rank order")
        spans = []
        for rank, data in enumerate(peer_metadata):
            info = _load_metadata(f"{peer_id}/{rank}", data)
            spans.append(HeadSpan.of(info["head_span"]))
            check_compatible(
                f"{peer_id}/{rank}", self._transport.layouts, self.head_span, info["layouts"], spans[-1],
                self._transport.token_shard, info["token_shard"],
            )  # fmt: skip
        plan = plan_head_reads(self.head_span, spans)
        connected: list[str] = []
        try:
            for rank in sorted({rank for rank, _, _ in plan}):
                self._transport.connect(f"{peer_id}/{rank}", peer_metadata[rank])
                connected.append(f"{peer_id}/{rank}")
        except Exception as e:
            for name in connected:
                self._transport.forget(name)
            if isinstance(e, (ValueError, KVTransferError)):
                raise
            raise KVTransferError(f"could not connect KV peer {peer_id!r}: {type(e).__name__}: {e}") from None
        self._plans[peer_id] = plan

    def is_connected(self, peer_id: str) -> bool:
        """Whether ``connect(peer_id, ...)`` succeeded (and no ``forget`` since)."""
        return peer_id in self._plans

    def read(self, peer_id: str, src: Sequence[int], dst: Sequence[int], timeout_s: float) -> int:
        """Pull this rank's heads of peer blocks ``src`` into our blocks ``dst`` (pairwise)
        from the planned peer ranks, all within ``timeout_s`` seconds; returns the bytes
        moved (all peer ranks summed).

        Raises:
            KVTransferError: any failed transfer, an unknown peer included (a rank read
                before the failure may have written its heads already).
            ValueError: misuse (mismatched lengths, a destination block outside our cache,
                a non-positive timeout).
        """
        plan = self._plans.get(peer_id)
        if plan is None:
            raise KVTransferError(f"unknown KV peer {peer_id!r}: call connect() first (known: {sorted(self._plans)})")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive (got {timeout_s})")
        deadline = time.monotonic() + timeout_s
        total = 0
        for rank, lo, hi in plan:
            left = deadline - time.monotonic()
            if left <= 0:
                raise KVTransferError(f"KV read from {peer_id!r} did not finish within {timeout_s} s (rank {rank} unread)")
            try:
                total += self._transport.read(f"{peer_id}/{rank}", src, dst, left, heads=(lo, hi))
            except (KVTransferError, ValueError):
                raise
            except Exception as e:
                raise KVTransferError(
                    f"KV read of heads [{lo}, {hi}) from {peer_id}/{rank} failed: {type(e).__name__}: {e}"
                ) from None
        return total

    def export(
        self, block_ids: Sequence[int], heads: Sequence[int] | None = None, tokens: Sequence[int] = WHOLE_TOKENS
    ) -> list[np.ndarray]:
        """Source side of the Ray fallback (see :meth:`RayObjectTransport.export`)."""
        if not isinstance(self._transport, RayObjectTransport):
            raise ValueError(
                f"export() serves the Ray fallback; endpoint {self.name!r} uses {type(self._transport).__name__}"
            )
        return self._transport.export(block_ids, heads, tokens)

    def forget(self, peer_id: str) -> None:
        """Drop a peer engine and its rank connections (no-op when unknown)."""
        for rank in sorted({rank for rank, _, _ in self._plans.pop(peer_id, [])}):
            self._transport.forget(f"{peer_id}/{rank}")

    def close(self) -> None:
        """Forget every peer and close the transport."""
        self._plans.clear()
        self._transport.close()


def default_kv_transport() -> str:
    """``"nixl"`` when the nixl package imports, else ``"ray"``."""
    try:
        importlib.import_module("nixl._api")
    except Exception:  # NOTE: a broken native install fails with more than ImportError
        return "ray"
    return "nixl"


@dataclass(frozen=True)
class KVEndpointFactory:
    """How to build one worker rank's :class:`KVEndpoint` (picklable: the cluster side
    receives it and calls it in each worker).

    Attributes:
        kind: the transport, one of :data:`KV_TRANSPORTS`.
        name: unique per engine incarnation (e.g. ``f"{replica_id}-{uuid8}"``); rank
            ``r``'s transport is named ``f"{name}-rank{r}"``.
        backend_params: NIXL UCX backend parameters as ``(key, value)`` pairs.
        export_method: ``"ray"``: the worker actor's dispatching method that serves
            ``endpoint.export(block_ids, heads)`` when called as ``method("export", block_ids,
            heads)`` (a worker's ``kv``).
    """

    kind: str
    name: str
    backend_params: tuple[tuple[str, str], ...] = ()
    export_method: str = "kv"

    def __post_init__(self) -> None:
        if self.kind not in KV_TRANSPORTS:
            raise ValueError(f"kind must be one of {KV_TRANSPORTS} (got kind={self.kind!r})")
        if not self.name:
            raise ValueError(f"name must be a non-empty string unique per engine (got name={self.name!r})")

    def __call__(
        self,
        rank: int,
        kv_caches: KVCaches,
        head_span: HeadSpan | Sequence[int],
        token_shard: Sequence[int] = WHOLE_TOKENS,
    ) -> KVEndpoint:
        """Rank ``rank``'s endpoint over ``kv_caches`` (holding ``head_span``, and of each
        logical block the tokens of ``token_shard``: decode context parallelism)."""
        name = f"{self.name}-rank{rank}"
        if self.kind == "nixl":
            return KVEndpoint(NixlTransport(name, dict(self.backend_params)), kv_caches, head_span, token_shard)
        import ray

        try:
            actor = ray.get_runtime_context().current_actor
        except Exception as e:
            raise ValueError(
                f"kind='ray' builds endpoints inside a Ray actor that serves {self.export_method!r}; "
                f"rank {rank} is not in one ({type(e).__name__}: {e})"
            ) from None
        return KVEndpoint(RayObjectTransport(actor, self.export_method, name=name), kv_caches, head_span, token_shard)
