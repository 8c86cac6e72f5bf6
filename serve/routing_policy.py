"""The routing policy as plain functions over :class:`Candidate` values (what a router knows
of each replica): least-loaded, prefix-affine and cache-aware rankings, and the overload rule
that lets load win over a cache. :mod:`flotilla.serve.router`'s Serve routers translate Serve's
objects into candidates and call these; the shared prefix tree's actor
(:mod:`~flotilla.serve.shared_prefix_tree`) ranks with :func:`rank_cache_aware` too, which is
why this module imports nothing of Serve's (the actor starts fast).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Hashable, Mapping, Sequence

from flotilla.serve.types import ReplicaLoad

# How far the replica holding a prompt's prefix may be busier than the least-loaded
# replica before prefix affinity gives way to load: it may hold up to
# max(least + OVERLOAD_SLACK, least * OVERLOAD_FACTOR) requests. The absolute slack keeps
# affinity at light load (a few extra requests cost less than recomputing a long prefix);
# the factor keeps it proportional at heavy load.
OVERLOAD_SLACK = 4
OVERLOAD_FACTOR = 2.0
# A prompt counts as held by a replica when the replica was sent at least this share of the
# prompt's full KV blocks before (SGLang gateway's cache_threshold default). Below it the
# cache-aware router sends the prompt to the replica holding the fewest blocks, so distinct
# prefixes behind one shared preamble spread over the replicas instead of piling up.
CACHE_MATCH_THRESHOLD = 0.5

def load_from_stats(stats: Mapping[str, Any] | None) -> ReplicaLoad:
    """A replica's reported load from its routing stats dict; a replica that has not
    reported yet (``{}`` or None) counts as empty. Unknown keys are ignored."""
    if not stats:
        return ReplicaLoad()
    return ReplicaLoad(
        running=int(stats.get("running", 0) or 0),
        waiting=int(stats.get("waiting", 0) or 0),
        kv_usage=float(stats.get("kv_usage", 0.0) or 0.0),
        max_queued=int(stats.get("max_queued", 0) or 0),
        prefix_keys=tuple(stats.get("prefix_keys", ()) or ()),
    )


@dataclass(frozen=True)
class Candidate:
    """What the policy knows about one replica.

    Attributes:
        replica_id: the replica (any hashable id).
        load: its last reported load.
        in_flight: requests in flight to it as the router counts them now (Serve's
            queue-length cache and the router's own assignments), or None when the router
            has no fresh count.
    """

    replica_id: Hashable
    load: ReplicaLoad = ReplicaLoad()
    in_flight: int | None = None

    @property
    def effective_load(self) -> int:
        """Requests it holds: the fresh in-flight count when there is one, else the
        reported running + waiting.

        NOTE: the report lags by up to a stats period plus Serve's broadcast; it goes
        stale both ways (a burst the replica has not reported yet, requests that finished
        since), so a fresh count wins whenever the router has one.
        """
        return self.load.load if self.in_flight is None else self.in_flight


def _load_key(c: Candidate) -> tuple:
    return (c.effective_load, c.load.kv_usage, c.load.load)


def rank_least_loaded(candidates: Sequence[Candidate]) -> list[Hashable]:
    """Replica ids, least loaded first: fewest requests held (:attr:`Candidate.effective_load`),
    ties by reported KV usage, then by reported load. Full ties keep the input order."""
    return [c.replica_id for c in sorted(candidates, key=_load_key)]


def is_overloaded(
    holder: Candidate,
    least_load: int,
    slack: int = OVERLOAD_SLACK,
    factor: float = OVERLOAD_FACTOR,
) -> bool:
    """Whether ``holder`` is too busy to keep a prefix's requests: it holds more than
    ``max(least_load + slack, least_load * factor)`` requests."""
    return holder.effective_load > max(least_load + slack, least_load * factor)


def rank_prefix_affine(
    candidates: Sequence[Candidate],
    prefix_key: int | None,
    remembered: Hashable | None = None,
    slack: int = OVERLOAD_SLACK,
    factor: float = OVERLOAD_FACTOR,
) -> list[Hashable]:
    """Replica ids, best first, for a request whose prompt starts with ``prefix_key``.

    The replicas holding the prefix are those whose reported ``prefix_keys`` contain it,
    plus ``remembered`` (where the router last sent it). The least loaded of them goes
    first unless it :func:`is_overloaded` against the least-loaded replica overall; the
    rest follow in least-loaded order. Without a key or a holder: least-loaded order.
    """
    order = rank_least_loaded(candidates)
    if prefix_key is None or not candidates:
        return order
    holders = [c for c in candidates if c.replica_id == remembered or prefix_key in c.load.prefix_keys]
    if not holders:
        return order
    best = min(holders, key=_load_key)
    least = min(c.effective_load for c in candidates)
    if is_overloaded(best, least, slack, factor):
        return order
    return [best.replica_id] + [r for r in order if r != best.replica_id]


def rank_cache_aware(
    candidates: Sequence[Candidate],
    matched: Mapping[Hashable, int],
    total_blocks: int,
    tree_sizes: Mapping[Hashable, int],
    threshold: float = CACHE_MATCH_THRESHOLD,
    slack: int = OVERLOAD_SLACK,
    factor: float = OVERLOAD_FACTOR,
) -> list[Hashable]:
    """Replica ids, best first, for a prompt of ``total_blocks`` full KV blocks of which each
    replica holds its leading ``matched[replica_id]`` (see :meth:`PrefixTree.match`).

    When the best match covers at least ``threshold`` of the blocks, the replica with the
    longest match goes first (ties: least loaded); otherwise the replica holding the fewest
    blocks (``tree_sizes``; ties: least loaded). Either choice gives way to least-loaded order
    when it :func:`is_overloaded` against the least-loaded replica; the rest follow in
    least-loaded order. A prompt without a full block: least-loaded order.
    """
    order = rank_least_loaded(candidates)
    if total_blocks < 1 or not candidates:
        return order
    best = max(matched.get(c.replica_id, 0) for c in candidates)
    if best / total_blocks >= threshold:
        choice = min((c for c in candidates if matched.get(c.replica_id, 0) == best), key=_load_key)
    else:
        choice = min(candidates, key=lambda c: (tree_sizes.get(c.replica_id, 0), *_load_key(c)))
    if is_overloaded(choice, min(c.effective_load for c in candidates), slack, factor):
        return order
    return [choice.replica_id] + [r for r in order if r != choice.replica_id]
