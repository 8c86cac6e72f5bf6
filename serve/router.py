"""Request routing for the engine pools: cache-aware (default), least-loaded, prefix-affinity
(the prompt's first block only) and round-robin.

Serve asks a deployment's request router, per request, for a ranking of replicas
(``RequestRouter.choose_replicas`` returns a list of replica lists, best first); it then
sends the request to the first replica in that ranking with room under
``max_ongoing_requests``. The policies here decide the ranking from two signals:

- the load each engine replica reports (``record_routing_stats`` returns the fields of
  :class:`~flotilla.serve.types.ReplicaLoad` as a dict; Serve polls it every
  ``request_routing_stats_period_s`` and hands it to the router as
  ``RunningReplica.routing_stats``), and
- the requests in flight at each replica as the router itself counts them: Serve's
  queue-length cache (the replica's own count at each accept, plus this router's sends
  and completions since) and the router's own assignments (:class:`InFlight`), which
  count a request from the moment it is ranked. NOTE: in a burst Serve ranks many
  requests before the first is sent; without counting its own assignments the router
  would send the whole burst to one replica.

The fresh count decides the load when the router has one; the reported load (which lags
by a stats period) stands in when it has none, and the report's KV usage breaks ties.

A call with a :class:`~flotilla.serve.types.ReplicaPin` among its arguments (the release
of a prefill replica's KV blocks, which only that replica holds) goes to the pinned
replica alone while it is a candidate; when it is not (it died), the call is ranked as
usual and the receiving replica sees that the pin is not its own.

The cache-aware policy (:func:`~flotilla.serve.routing_policy.rank_cache_aware`, SGLang
gateway's ``cache_aware`` and Ray Serve LLM's prefix-aware router do the same) also reads a
:class:`~flotilla.serve.prefix_tree.PrefixTree` of the prompts the pool's routers sent to each
replica, one per pool shared by every ingress replica's router
(:mod:`~flotilla.serve.shared_prefix_tree`): a prompt goes where most of its
leading KV blocks were sent before, so requests behind a shared system prompt follow it even
when their first block is the same as other prompts'; a prompt no replica holds enough of goes
to the replica holding the least, so distinct prefixes spread over the replicas; load
overrides both (:func:`is_overloaded`).

The policy itself is plain functions over ``Candidate`` values
(:mod:`~flotilla.serve.routing_policy`), unit-tested without Ray; the ``RequestRouter``
subclasses here only translate Serve's objects into candidates.
Deployments name a router by import path (``ROUTER_CLASSES``).
"""

from __future__ import annotations

import time
from collections import Counter, OrderedDict
from typing import Any, Hashable, Sequence

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from flotilla.serve.prefix_tree import DEFAULT_CAPACITY_BLOCKS
from flotilla.serve.shared_prefix_tree import SharedPrefixTree
from flotilla.cluster.engine.limits import DEFAULT_BLOCK_SIZE as DEFAULT_PREFIX_BLOCK
from flotilla.cluster.engine.limits import block_size_for
from flotilla.serve.routing_policy import (
    CACHE_MATCH_THRESHOLD,
    OVERLOAD_FACTOR,
    OVERLOAD_SLACK,
    Candidate,
    load_from_stats,
    rank_least_loaded,
    rank_prefix_affine,
)
from flotilla.serve.types import ROUTER_CLASSES, GenerateRequest, ReplicaPin

# Prefix keys the prefix-affinity router remembers (where it sent each), newest kept.
PREFIX_MEMORY_SIZE = 8192
# An assignment Serve never confirmed (the request was cancelled before it was sent)
# stops counting as load after this long.
UNCONFIRMED_TTL_S = 5.0
# Requests whose prompt blocks the cache-aware router keeps between ranking and recording.
BLOCKS_CACHE_SIZE = 1024



def router_class_path(name: str) -> str:
    """The import path Serve loads for router ``name`` (``--router``)."""
    try:
        return ROUTER_CLASSES[name]
    except KeyError:
        raise ValueError(f"router={name!r} is not a router; choose from {', '.join(ROUTER_CLASSES)}") from None


def router_kwargs(name: str, config: Any, pool: str | None = None) -> dict[str, Any]:
    """The ``request_router_kwargs`` of router ``name`` for a pool resolved as ``config``: the
    cache-aware router's tree cuts prompts into the engines' KV blocks and, when
    ``--max-total-tokens`` bounds the KV pool, remembers at most that many blocks per replica;
    with ``pool`` named, the routers of every ingress replica share the pool's tree (a named
    actor, :mod:`~flotilla.serve.shared_prefix_tree`)."""
    if name != "cache-aware":
        return {}
    block = block_size_for(config)
    kwargs: dict[str, Any] = {"block_size": block}
    if pool is not None:
        # NOTE: one tree per pool and config, shared by every ingress replica's router.
        kwargs["tree_name"] = f"flotilla-prefix-tree-{pool}-{config.digest[:16]}"
    if getattr(config, "max_total_tokens", None):
        kwargs["capacity_blocks"] = max(1, int(config.max_total_tokens) // block)
    return kwargs


class PrefixMemory:
    """Where the router sent each prefix key: a bounded map, oldest entry dropped first."""

    def __init__(self, capacity: int = PREFIX_MEMORY_SIZE):
        if capacity < 1:
            raise ValueError(f"capacity={capacity} must be at least 1")
        self.capacity = capacity
        self._where: OrderedDict[int, Hashable] = OrderedDict()

    def get(self, key: int | None) -> Hashable | None:
        return None if key is None else self._where.get(key)

    def remember(self, key: int | None, replica_id: Hashable) -> None:
        if key is None:
            return
        self._where[key] = replica_id
        self._where.move_to_end(key)
        while len(self._where) > self.capacity:
            self._where.popitem(last=False)

    def forget(self, replica_id: Hashable) -> None:
        """Drop every key sent to ``replica_id`` (it died; its cache is gone)."""
        for key in [k for k, r in self._where.items() if r == replica_id]:
            del self._where[key]

    def __len__(self) -> int:
        return len(self._where)


class InFlight:
    """Requests this router has assigned to each replica and not yet seen complete.

    A request counts from the moment it is ranked (:meth:`assign`), is confirmed when
    Serve reports it accepted, and stops counting when Serve reports it complete. An
    assignment never confirmed within ``ttl_s`` (cancelled while queued) is dropped.
    """

    def __init__(self, ttl_s: float = UNCONFIRMED_TTL_S, clock=time.monotonic):
        self.ttl_s = ttl_s
        self._clock = clock
        self._where: dict[str, tuple[Hashable, bool, float]] = {}
        self._counts: Counter = Counter()

    def assign(self, request_id: str, replica_id: Hashable, confirmed: bool = False) -> None:
        self.complete(request_id)
        self._where[request_id] = (replica_id, confirmed, self._clock())
        self._counts[replica_id] += 1

    def complete(self, request_id: str) -> None:
        entry = self._where.pop(request_id, None)
        if entry is not None:
            self._counts[entry[0]] -= 1
            if self._counts[entry[0]] <= 0:
                del self._counts[entry[0]]

    def expire(self) -> None:
        now = self._clock()
        for request_id, (_, confirmed, since) in list(self._where.items()):
            if not confirmed and now - since > self.ttl_s:
                self.complete(request_id)

    def forget_replica(self, replica_id: Hashable) -> None:
        for request_id in [r for r, entry in self._where.items() if entry[0] == replica_id]:
            self.complete(request_id)

    def count(self, replica_id: Hashable) -> int:
        return self._counts.get(replica_id, 0)


def generate_request_of(pending: PendingRequest | None) -> GenerateRequest | None:
    """The :class:`GenerateRequest` among a pending Serve request's arguments, if any."""
    if pending is None:
        return None
    for value in list(pending.args) + list(pending.kwargs.values()):
        if isinstance(value, GenerateRequest):
            return value
    return None


def replica_pin_of(pending: PendingRequest | None) -> ReplicaPin | None:
    """The :class:`ReplicaPin` among a pending Serve request's arguments, if any."""
    if pending is None:
        return None
    for value in list(pending.args) + list(pending.kwargs.values()):
        if isinstance(value, ReplicaPin):
            return value
    return None


def pinned_replica(replica_ids: Sequence[Hashable], pin: ReplicaPin | None) -> Hashable | None:
    """The id among ``replica_ids`` that ``pin`` names, or None (no pin, or the pinned
    replica is not a candidate). Serve's ``ReplicaID`` matches by its ``unique_id``
    (the replica tag); a plain id by equality."""
    if pin is None:
        return None
    for replica_id in replica_ids:
        if getattr(replica_id, "unique_id", replica_id) == pin.replica_id:
            return replica_id
    return None


# -- the Serve routers (thin shells) -----------------------------------------------------


class LeastLoadedRouter(RequestRouter):
    """Send each request to the replica holding the fewest requests (see
    :func:`rank_least_loaded`). The default router of the engine deployment."""

    def _ensure_state(self) -> None:
        # NOTE: Serve calls initialize_state right after __init__; this covers direct use.
        if not hasattr(self, "in_flight"):
            self.initialize_state()

    def initialize_state(self, **kwargs: Any) -> None:
        if kwargs:
            raise ValueError(f"{type(self).__name__}: unknown request_router_kwargs {sorted(kwargs)}")
        self.in_flight = InFlight()

    def _candidate(self, replica: RunningReplica) -> Candidate:
        cached = self.replica_queue_len_cache.get(replica.replica_id)  # None: stale or never seen
        mine = self.in_flight.count(replica.replica_id)
        fresh = None if cached is None and mine == 0 else max(cached or 0, mine)
        return Candidate(replica.replica_id, load_from_stats(replica.routing_stats), fresh)

    def _rank(self, candidates: list[Candidate], request: GenerateRequest | None) -> list[Hashable]:
        return rank_least_loaded(candidates)

    async def _order(self, candidates: list[Candidate], request: GenerateRequest | None) -> list[Hashable]:
        """The ranking of one request (a policy that must ask elsewhere first awaits here)."""
        return self._rank(candidates, request)

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        self._ensure_state()
        self.in_flight.expire()
        by_id = {r.replica_id: r for r in candidate_replicas}
        pinned = pinned_replica(list(by_id), replica_pin_of(pending_request))
        if pinned is not None:
            # NOTE: only the pinned replica holds what the call is about; when it is busy,
            # Serve waits for it rather than sending the call elsewhere.
            order = [pinned]
        else:
            order = await self._order([self._candidate(r) for r in candidate_replicas], generate_request_of(pending_request))
        if pending_request is not None and order:
            self._assigned(pending_request, order[0], confirmed=False)
            # NOTE: every candidate is ranked already, so when all are at
            # max_ongoing_requests the next round is the same: let Serve back off.
            pending_request.routing_context.should_backoff = True
        return [[by_id[i]] for i in order]

    def _assigned(self, pending: PendingRequest, replica_id: Hashable, confirmed: bool) -> None:
        self.in_flight.assign(pending.metadata.internal_request_id, replica_id, confirmed)

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        self._ensure_state()
        self._assigned(pending_request, replica_id, confirmed=True)

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        super().on_request_completed(replica_id, internal_request_id)
        self._ensure_state()
        self.in_flight.complete(internal_request_id)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self._ensure_state()
        self.in_flight.forget_replica(replica_id)


class PrefixAffinityRouter(LeastLoadedRouter):
    """Send a request whose prompt prefix a replica already holds to that replica, unless
    it is overloaded (see :func:`rank_prefix_affine`); otherwise least-loaded.

    ``request_router_kwargs``: ``slack`` (default ``OVERLOAD_SLACK``), ``factor``
    (``OVERLOAD_FACTOR``), ``memory_size`` (``PREFIX_MEMORY_SIZE``).
    """

    def initialize_state(
        self,
        slack: int = OVERLOAD_SLACK,
        factor: float = OVERLOAD_FACTOR,
        memory_size: int = PREFIX_MEMORY_SIZE,
        **kwargs: Any,
    ) -> None:
        super().initialize_state(**kwargs)
        self.slack = int(slack)
        self.factor = float(factor)
        self.memory = PrefixMemory(int(memory_size))

    def _rank(self, candidates: list[Candidate], request: GenerateRequest | None) -> list[Hashable]:
        key = None if request is None else request.prefix_key
        return rank_prefix_affine(candidates, key, self.memory.get(key), self.slack, self.factor)

    def _assigned(self, pending: PendingRequest, replica_id: Hashable, confirmed: bool) -> None:
        super()._assigned(pending, replica_id, confirmed)
        request = generate_request_of(pending)
        if request is not None:
            self.memory.remember(request.prefix_key, replica_id)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self.memory.forget(replica_id)


class CacheAwareRouter(LeastLoadedRouter):
    """Send a prompt to the replica that was sent most of its leading KV blocks, or, when no
    replica holds enough of it, to the replica holding the fewest; load overrides both (see
    :func:`rank_cache_aware`). The default router of every engine pool.

    The tree is the pool's shared one (:mod:`~flotilla.serve.shared_prefix_tree`: every
    ingress replica's router reads and feeds the same), with this router's own as the fallback.

    ``request_router_kwargs``: ``block_size`` (the engines' KV page size; default
    ``DEFAULT_PREFIX_BLOCK``), ``capacity_blocks`` (blocks remembered per replica, least
    recently routed dropped first; ``DEFAULT_CAPACITY_BLOCKS``), ``threshold``
    (``CACHE_MATCH_THRESHOLD``), ``slack`` (``OVERLOAD_SLACK``), ``factor``
    (``OVERLOAD_FACTOR``), ``tree_name`` (the shared tree actor's name; None: this router's
    tree alone).
    """

    def initialize_state(
        self,
        block_size: int = DEFAULT_PREFIX_BLOCK,
        capacity_blocks: int = DEFAULT_CAPACITY_BLOCKS,
        threshold: float = CACHE_MATCH_THRESHOLD,
        slack: int = OVERLOAD_SLACK,
        factor: float = OVERLOAD_FACTOR,
        tree_name: str | None = None,
        **kwargs: Any,
    ) -> None:
        super().initialize_state(**kwargs)
        if not 0.0 < float(threshold) <= 1.0:
            raise ValueError(f"{type(self).__name__}: threshold={threshold!r} must be in (0, 1]")
        self.tree = SharedPrefixTree(tree_name, int(block_size), int(capacity_blocks))
        self.threshold = float(threshold)
        self.slack = int(slack)
        self.factor = float(factor)
        # NOTE: a prompt's blocks are cut once per request (ranking and recording reuse them).
        self._blocks: OrderedDict[str, tuple[int, list[tuple[int, ...]]]] = OrderedDict()

    def _blocks_of(self, request: GenerateRequest) -> list[tuple[int, ...]]:
        cached = self._blocks.get(request.request_id)
        if cached is not None and cached[0] == len(request.prompt_token_ids):
            return cached[1]
        blocks = self.tree.blocks(request.prompt_token_ids)
        self._blocks[request.request_id] = (len(request.prompt_token_ids), blocks)
        while len(self._blocks) > BLOCKS_CACHE_SIZE:
            self._blocks.popitem(last=False)
        return blocks

    async def _order(self, candidates: list[Candidate], request: GenerateRequest | None) -> list[Hashable]:
        if request is None:
            return rank_least_loaded(candidates)
        # NOTE: the tree records the choice as it ranks (not only once Serve confirms where the
        # request went): a burst is ranked before its first request is sent, and its later
        # requests must see the earlier, whichever ingress replica routes them.
        policy = {"threshold": self.threshold, "slack": self.slack, "factor": self.factor}
        return await self.tree.rank(self._blocks_of(request), candidates, policy)

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        super().on_request_routed(pending_request, replica_id, result)
        request = generate_request_of(pending_request)
        if request is not None:
            # NOTE: where it went (the ranked first choice, unless that replica had no room).
            self.tree.insert(self._blocks_of(request), replica_id)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self.tree.forget(replica_id)


class RoundRobinRouter(LeastLoadedRouter):
    """Send each request to the next replica in turn (replicas ordered by id), whatever their
    load or cache; the baseline the other policies are measured against."""

    def initialize_state(self, **kwargs: Any) -> None:
        super().initialize_state(**kwargs)
        self.turn = 0

    def _rank(self, candidates: list[Candidate], request: GenerateRequest | None) -> list[Hashable]:
        ids = sorted((c.replica_id for c in candidates), key=str)
        if not ids:
            return ids
        first = self.turn % len(ids)
        self.turn += 1
        return ids[first:] + ids[:first]
