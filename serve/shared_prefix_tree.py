"""One :class:`~flotilla.serve.prefix_tree.PrefixTree` per engine pool, shared by the routers of
every ingress replica (a small named Ray actor), so that the cache-aware routing of several
stateless ingress replicas agrees: each one sees where the others sent every prompt.

Without it each ingress replica's router would learn only from its own share of the traffic,
and a system prompt first seen by two ingress replicas could be computed (and cached) on two
engine replicas. Ray Serve LLM's prefix-aware router shares its tree the same way.

- :class:`PrefixTreeService`: the actor's body: the pool's tree. :meth:`PrefixTreeService.rank`
  ranks one prompt's candidates (:func:`~flotilla.serve.routing_policy.rank_cache_aware` over
  the router's view of their load) and records the choice in the same call, so two routers'
  decisions never interleave between a look and a record.
- :class:`SharedPrefixTree`: a router's client. It keeps a local tree too, fed with the same
  choices, and ranks from it whenever the actor does not answer within
  :data:`VIEW_TIMEOUT_S` (an actor that is gone is looked up again on the next request), so
  routing never waits long and never fails on the tree's account.

The actor is named after the pool and the pool's config digest (``router_kwargs``), in the
:data:`TREE_NAMESPACE` namespace; the first router creates it and owns it (it goes when that
ingress replica goes; the next router to miss it creates it again, empty).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from typing import Any, Hashable, Mapping, Sequence

from flotilla.serve.prefix_tree import DEFAULT_CAPACITY_BLOCKS, PrefixTree
from flotilla.serve.routing_policy import Candidate, rank_cache_aware

logger = logging.getLogger(__name__)

# Where the routers find their pool's tree actor.
TREE_NAMESPACE = "flotilla-routing"
# How long a routing decision waits for the shared tree before ranking from the local one.
VIEW_TIMEOUT_S = 0.25
# After a decision timed out on the shared tree, decisions rank from the local tree this long
# (the shared one still records them): a persistently slow actor would otherwise add
# VIEW_TIMEOUT_S to every request.
SLOW_BACKOFF_S = 5.0

Blocks = Sequence[tuple[int, ...]]
# The cache-aware policy's knobs: rank_cache_aware's threshold, slack and factor.
Policy = Mapping[str, float]


class PrefixTreeService:
    """The shared tree of one engine pool (the actor's body; plain Python, unit-testable).

    Args:
        block_size: tokens per KV block (the engines' page size).
        capacity_blocks: blocks remembered per replica (see :class:`PrefixTree`).
    """

    def __init__(self, block_size: int, capacity_blocks: int = DEFAULT_CAPACITY_BLOCKS):
        self.tree = PrefixTree(int(block_size), int(capacity_blocks))

    def rank(self, blocks: Blocks, candidates: Sequence[Candidate], policy: Policy) -> list[Hashable]:
        """The candidates' replica ids, best first, for a prompt of ``blocks``
        (:func:`rank_with_tree`), the first one recorded as holding them."""
        return rank_with_tree(self.tree, [tuple(b) for b in blocks], candidates, policy)

    def insert(self, blocks: Blocks, replica: Hashable) -> None:
        self.tree.insert([tuple(b) for b in blocks], replica)

    def forget(self, replica: Hashable) -> None:
        self.tree.forget(replica)


def rank_with_tree(tree: PrefixTree, blocks: Blocks, candidates: Sequence[Candidate], policy: Policy) -> list[Hashable]:
    """Rank ``candidates`` for a prompt of ``blocks`` by :func:`~flotilla.serve.routing_policy.
    rank_cache_aware` over ``tree`` (``policy``: its ``threshold``, ``slack`` and ``factor``),
    and record the best one there."""
    matched = tree.match(blocks)
    sizes = {c.replica_id: tree.size(c.replica_id) for c in candidates}
    order = rank_cache_aware(candidates, matched, len(blocks), sizes, **policy)
    if order:
        tree.insert(blocks, order[0])
    return order


class SharedPrefixTree:
    """A router's view of its pool's shared tree, with a local tree as the fallback (see the
    module docstring). Only the router's event loop calls it.

    Args:
        name: the actor's name (one per pool); None: local only (no Ray needed).
        block_size, capacity_blocks: as :class:`PrefixTreeService`.
    """

    def __init__(
        self, name: str | None, block_size: int, capacity_blocks: int = DEFAULT_CAPACITY_BLOCKS, clock=time.monotonic
    ):
        self.name = name
        self._clock = clock
        self._slow_until = 0.0  # NOTE: the clock's time until which decisions skip the shared tree
        self.local = PrefixTree(int(block_size), int(capacity_blocks))
        self._capacity = int(capacity_blocks)
        self._actor: Any = None
        self.shared_views = 0  # decisions taken by the shared tree (the rest: the local one)
        self._get_actor()  # NOTE: at the router's start: the actor's own start takes a while

    def blocks(self, token_ids: Sequence[int]) -> list[tuple[int, ...]]:
        return self.local.blocks(token_ids)

    async def rank(self, blocks: Blocks, candidates: Sequence[Candidate], policy: Policy) -> list[Hashable]:
        """:meth:`PrefixTreeService.rank` on the shared tree when it answers within
        :data:`VIEW_TIMEOUT_S`, else on the local one (and for :data:`SLOW_BACKOFF_S` after a
        timeout); the local tree records the choice either way."""
        actor = self._get_actor() if self._clock() >= self._slow_until else None
        if actor is not None:
            # NOTE: the actor keys replicas by their plain ids (unpickling Serve's ReplicaID
            # there would import Serve into it, seconds on the first call).
            by_key = {_key(c.replica_id): c.replica_id for c in candidates}
            plain = [dataclasses.replace(c, replica_id=_key(c.replica_id)) for c in candidates]
            try:
                ref = actor.rank.remote(list(blocks), plain, dict(policy))
                order = [by_key[k] for k in await asyncio.wait_for(asyncio.wrap_future(ref.future()), VIEW_TIMEOUT_S)]
                self.shared_views += 1
                if order:
                    self.local.insert(blocks, order[0])
                return order
            except asyncio.TimeoutError:
                # NOTE: slow (starting, or busy), not gone: if it ranks late it records its own
                # choice; this router's choice is recorded there too, below.
                self._slow_until = self._clock() + SLOW_BACKOFF_S
                logger.debug(
                    "shared prefix tree %s did not answer in %s s; ranking locally for %s s",
                    self.name, VIEW_TIMEOUT_S, SLOW_BACKOFF_S,
                )  # fmt: skip
            except Exception as exc:  # noqa: BLE001 - gone: routing goes on from the local tree
                logger.debug("shared prefix tree %s failed (%s); ranking from the local tree", self.name, exc)
                self._actor = None
        order = rank_with_tree(self.local, blocks, candidates, policy)
        if order:
            self._tell("insert", list(blocks), _key(order[0]))
        return order

    def insert(self, blocks: Blocks, replica: Hashable) -> None:
        """Record where a prompt went in both trees (the shared one without waiting)."""
        self.local.insert(blocks, replica)
        self._tell("insert", list(blocks), _key(replica))

    def forget(self, replica: Hashable) -> None:
        """A replica died: drop it from both trees."""
        self.local.forget(replica)
        self._tell("forget", _key(replica))

    def _tell(self, method: str, *args: Any) -> None:
        actor = self._get_actor()
        if actor is None:
            return
        try:
            getattr(actor, method).remote(*args)
        except Exception as exc:  # noqa: BLE001 - the local tree has it; the next call looks the actor up again
            logger.debug("shared prefix tree %s: %s failed (%s)", self.name, method, exc)
            self._actor = None

    def _get_actor(self) -> Any:
        if self.name is None:
            return None
        if self._actor is None:
            try:
                import ray

                options = dict(name=self.name, namespace=TREE_NAMESPACE, get_if_exists=True, num_cpus=0)
                self._actor = ray.remote(PrefixTreeService).options(**options).remote(self.local.block_size, self._capacity)
            except Exception as exc:  # noqa: BLE001 - no Ray here (a router used directly): local only
                logger.debug("shared prefix tree %s unavailable (%s); routing from the local tree", self.name, exc)
                self.name = None
        return self._actor


def _key(replica: Hashable) -> Hashable:
    """A replica's key in the shared tree: its plain id (a Serve ``ReplicaID``'s ``unique_id``)."""
    return getattr(replica, "unique_id", replica)
