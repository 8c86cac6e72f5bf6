"""Expert placement for expert parallelism (EP): which logical expert lives in which physical slot.

Vocabulary (the same as SGLang's EPLB, written independently):

- A *logical* expert is one of the model's ``num_logical`` routed experts (the ids the router emits).
- A *physical slot* holds the weights of one logical expert on one EP rank. There are
  ``num_physical >= num_logical`` slots, ``num_physical // ep_size`` per rank, numbered rank-major:
  rank ``r`` owns slots ``[r * slots_per_rank, (r + 1) * slots_per_rank)``. Slots beyond
  ``num_logical`` hold *redundant* copies of heavily loaded experts.
- ``phy2log[slot]`` is the logical expert in that slot; ``log2phy[e]`` lists the slots holding
  expert ``e`` in increasing order (its replicas); ``len(log2phy[e])`` is SGLang's ``logcount``.

Routing with replicas: the router picks logical ids; :func:`choose_replica` turns each (token,
logical id) into a slot id, then :meth:`ExpertPlacement.local_expert_map` (indexed by *slot* id)
tells ``kernels/moe.py``'s ``fused_moe`` which local weight row to use, or ``-1``.

Everything here is pure Python (no torch, no ray) so it can be unit-tested and run on the driver.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class ExpertPlacement:
    """A complete, immutable map between logical experts and physical slots on EP ranks.

    Attributes:
        num_logical: number of routed experts in the model.
        num_physical: number of physical slots across all EP ranks (a multiple of ``ep_size``).
        ep_size: number of EP ranks.
        phy2log: ``phy2log[slot]`` is the logical expert stored in ``slot``.
        log2phy: ``log2phy[e]`` is the sorted tuple of slots that hold logical expert ``e``.

    Build one with :meth:`from_phy2log` (derives ``log2phy``) or the placement functions below;
    ``__post_init__`` runs :meth:`validate`, so every instance is consistent.
    """

    num_logical: int
    num_physical: int
    ep_size: int
    phy2log: tuple[int, ...]
    log2phy: tuple[tuple[int, ...], ...]

    def __post_init__(self) -> None:
        self.validate()

    @classmethod
    def from_phy2log(cls, phy2log: Sequence[int], num_logical: int, ep_size: int) -> ExpertPlacement:
        """Build a placement from its slot -> logical map; ``log2phy`` is derived from it."""
        phy2log = tuple(int(e) for e in phy2log)
        replicas: list[list[int]] = [[] for _ in range(num_logical)]
        for slot, expert in enumerate(phy2log):
            if not 0 <= expert < num_logical:
                raise ValueError(
                    f"phy2log[{slot}]={expert} is not a logical expert id in [0, {num_logical})"
                )
            replicas[expert].append(slot)
        return cls(
            num_logical=num_logical,
            num_physical=len(phy2log),
            ep_size=ep_size,
            phy2log=phy2log,
            log2phy=tuple(tuple(r) for r in replicas),
        )

    @property
    def slots_per_rank(self) -> int:
        """Number of physical slots each EP rank holds."""
        return self.num_physical // self.ep_size

    def slots_of_rank(self, rank: int) -> range:
        """The slot ids owned by ``rank`` (contiguous, rank-major)."""
        self._check_rank(rank)
        spr = self.slots_per_rank
        return range(rank * spr, (rank + 1) * spr)

    def rank_of_slot(self, slot: int) -> int:
        """The EP rank that owns ``slot``."""
        if not 0 <= slot < self.num_physical:
            raise ValueError(f"slot={slot} is outside [0, num_physical={self.num_physical})")
        return slot // self.slots_per_rank

    def local_expert_map(self, rank: int) -> list[int]:
        """``fused_moe``'s ``expert_map`` for ``rank``: indexed by global *slot* id (length
        ``num_physical``), giving the local weight row of that slot on this rank, or ``-1``.

        NOTE: ``fused_moe`` indexes ``expert_map`` with the ids in ``topk_ids``, so callers must
        first translate the router's logical ids to slot ids with :func:`choose_replica` (or
        :meth:`dispatch_slots`). Without redundancy and with :func:`trivial_placement` slot ids
        equal logical ids, so the translation is the identity. Local row ``i`` holds the weights
        of logical expert ``phy2log[slots_of_rank(rank)[i]]``.
        """
        expert_map = [-1] * self.num_physical
        for local, slot in enumerate(self.slots_of_rank(rank)):
            expert_map[slot] = local
        return expert_map

    def local_logical_experts(self, rank: int) -> list[int]:
        """Logical expert id of each local weight row on ``rank`` (which weights to load)."""
        return [self.phy2log[slot] for slot in self.slots_of_rank(rank)]

    def dispatch_slots(self, topk_ids: Sequence[Sequence[int]]) -> list[list[int]]:
        """Translate a ``[T, k]`` table of logical ids to slot ids with :func:`choose_replica`,
        using the row index as the token index (identical on every rank)."""
        return [[choose_replica(self.log2phy, e, row) for e in ids] for row, ids in enumerate(topk_ids)]

    def validate(self) -> None:
        """Raise ValueError unless sizes agree, every expert has a replica and maps are inverse."""
        if self.num_logical < 1:
            raise ValueError(f"num_logical must be >= 1, got num_logical={self.num_logical}")
        if self.ep_size < 1:
            raise ValueError(f"ep_size must be >= 1, got ep_size={self.ep_size}")
        _check_slot_counts(self.num_logical, self.num_physical, self.ep_size)
        if len(self.phy2log) != self.num_physical:
            raise ValueError(
                f"len(phy2log)={len(self.phy2log)} must equal num_physical={self.num_physical}"
            )
        if len(self.log2phy) != self.num_logical:
            raise ValueError(
                f"len(log2phy)={len(self.log2phy)} must equal num_logical={self.num_logical}"
            )
        for expert, slots in enumerate(self.log2phy):
            if not slots:
                raise ValueError(f"logical expert {expert} has no physical slot (log2phy[{expert}] is empty)")
            if list(slots) != sorted(set(slots)):
                raise ValueError(f"log2phy[{expert}]={slots} must be strictly increasing")
            for slot in slots:
                if not 0 <= slot < self.num_physical or self.phy2log[slot] != expert:
                    raise ValueError(f"log2phy[{expert}] lists slot {slot}, but phy2log does not map it back")
        if sum(len(s) for s in self.log2phy) != self.num_physical:
            raise ValueError("phy2log and log2phy disagree: some slot is missing from log2phy")

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.ep_size:
            raise ValueError(f"rank={rank} is outside [0, ep_size={self.ep_size})")


def choose_replica(log2phy: Sequence[Sequence[int]], logical_id: int, token_index: int) -> int:
    """Pick the slot that serves ``logical_id`` for the token in row ``token_index``.

    Deterministic and rank-invariant: it depends only on the shared ``log2phy`` and the row index,
    never on a random generator, so every EP rank agrees (required by the ``none`` all-to-all
    backend, where every rank computes its slots for all tokens and partial outputs are summed:
    a disagreement would count an expert twice or not at all). Consecutive rows cycle through the
    replicas, which splits load evenly, the assumption :func:`balanced_placement` makes.
    """
    replicas = log2phy[logical_id]
    return replicas[token_index % len(replicas)]


def rank_loads(placement: ExpertPlacement, load: Sequence[float]) -> list[float]:
    """Expected load on each EP rank when each expert's load splits evenly over its replicas."""
    _check_load(load, placement.num_logical)
    totals = [0.0] * placement.ep_size
    for slot, expert in enumerate(placement.phy2log):
        totals[placement.rank_of_slot(slot)] += load[expert] / len(placement.log2phy[expert])
    return totals


def trivial_placement(num_logical: int, ep_size: int, num_redundant: int = 0) -> ExpertPlacement:
    """Slot ``s`` holds logical expert ``s % num_logical``: experts in order, then ``num_redundant``
    copies of experts ``0, 1, ...`` appended (what SGLang does before any load is measured).

    Raises ValueError unless ``num_logical + num_redundant`` is a multiple of ``ep_size``.
    """
    if num_redundant < 0:
        raise ValueError(f"num_redundant must be >= 0, got num_redundant={num_redundant}")
    num_physical = num_logical + num_redundant
    _check_slot_counts(num_logical, num_physical, ep_size)
    return ExpertPlacement.from_phy2log([s % num_logical for s in range(num_physical)], num_logical, ep_size)


def balanced_placement(load: Sequence[float], ep_size: int, num_physical: int) -> ExpertPlacement:
    """Place ``len(load)`` logical experts into ``num_physical`` slots so per-rank load is even.

    1. Replica counts: every expert gets one slot; each spare slot goes to the expert with the
       largest per-replica load ``load[e] / count[e]`` (ties: fewer copies, then lower id), at
       most ``ep_size`` copies per expert while any expert is below that.
    2. Packing: replicas, heaviest first, go to the least-loaded rank that still has a free slot,
       preferring a rank that does not already hold that expert (a second copy on the same rank
       adds no capacity).

    ``load`` is measured per logical expert (e.g. tokens routed in the recorder's ``stat`` window).
    The result is never worse than :func:`trivial_placement` with the same slot count, measured by
    the max of :func:`rank_loads`: greedy packing is a heuristic, so when it loses, the trivial
    layout is returned instead.
    """
    num_logical = len(load)
    _check_slot_counts(num_logical, num_physical, ep_size)
    _check_load(load, num_logical)
    counts = _replica_counts(load, [1] * num_logical, num_physical - num_logical, ep_size - 1)
    replicas = [(load[e] / counts[e], e) for e in range(num_logical) for _ in range(counts[e])]
    per_rank = _pack(replicas, [[] for _ in range(ep_size)], [0.0] * ep_size, num_physical // ep_size)
    greedy = ExpertPlacement.from_phy2log([e for rank in per_rank for e in sorted(rank)], num_logical, ep_size)
    trivial = trivial_placement(num_logical, ep_size, num_physical - num_logical)
    if max(rank_loads(greedy, load)) <= max(rank_loads(trivial, load)):
        return greedy
    return trivial


def grow_placement(old: ExpertPlacement, new_ep_size: int, load: Sequence[float]) -> ExpertPlacement:
    """Extend ``old`` to ``new_ep_size`` ranks for an elastic EP scale-up, moving nothing.

    Semantics (SGLang's ``elasticity_aware`` layout, with minimal movement):

    - Slots per rank stay fixed, so the slot count grows to ``slots_per_rank * new_ep_size``
      (as SGLang's elastic layout keeps ``num_local_physical_experts``).
    - Every slot of the old ranks keeps its id and its logical expert: running ranks load no new
      weights, and ``phy2log[:old.num_physical]`` is unchanged; only ``log2phy`` gains entries.
    - The joining ranks' slots all hold redundant copies, chosen from ``load`` the same way
      :func:`balanced_placement` chooses spare copies (starting from the old replica counts, at
      most one new copy per joining rank while any expert is below that), and packed over the
      joining ranks only to balance their load.

    Every logical expert stays covered because the old placement covers it. A full rebalance over
    all ranks (which would move old slots) is :func:`balanced_placement`'s job, at a later step.
    Raises ValueError if ``new_ep_size`` is smaller than ``old.ep_size`` or ``load`` has the wrong
    length.
    """
    if new_ep_size < old.ep_size:
        raise ValueError(
            f"new_ep_size={new_ep_size} is smaller than the current ep_size={old.ep_size}; "
            "grow_placement only scales up"
        )
    _check_load(load, old.num_logical)
    spr = old.slots_per_rank
    num_new_ranks = new_ep_size - old.ep_size
    num_new_slots = spr * num_new_ranks
    old_counts = [len(s) for s in old.log2phy]
    counts = _replica_counts(load, old_counts, num_new_slots, num_new_ranks)
    replicas = [
        (load[e] / counts[e], e) for e in range(old.num_logical) for _ in range(counts[e] - old_counts[e])
    ]
    per_rank = _pack(replicas, [[] for _ in range(num_new_ranks)], [0.0] * num_new_ranks, spr)
    new_slots = [e for rank in per_rank for e in sorted(rank)]
    return ExpertPlacement.from_phy2log(list(old.phy2log) + new_slots, old.num_logical, new_ep_size)


def _replica_counts(load: Sequence[float], start: Sequence[int], num_extra: int, max_extra: int) -> list[int]:
    """Give ``num_extra`` more copies, one at a time, to the expert with the most load per copy.

    No expert gets more than ``max_extra`` new copies while another expert can still take one:
    copies beyond one per rank would share a rank and add no capacity. The cap is lifted only
    when every expert has reached it (more slots per rank than experts).
    """
    counts = list(start)
    extra = [0] * len(counts)
    # NOTE: heap key (-load per copy, copies, id): ties (e.g. all-zero load) go to the expert with
    # the fewest copies, then the lowest id, so the result is deterministic and spreads copies.
    heap = [(-load[e] / counts[e], counts[e], e) for e in range(len(counts))]
    heapq.heapify(heap)
    capped: list[tuple[float, int, int]] = []
    for _ in range(num_extra):
        while heap and extra[heap[0][2]] >= max_extra:
            capped.append(heapq.heappop(heap))
        if not heap:
            heap, capped, max_extra = capped, [], num_extra
            heapq.heapify(heap)
        _, _, e = heapq.heappop(heap)
        counts[e] += 1
        extra[e] += 1
        heapq.heappush(heap, (-load[e] / counts[e], counts[e], e))
    return counts


def _pack(
    replicas: list[tuple[float, int]], ranks: list[list[int]], totals: list[float], capacity: int
) -> list[list[int]]:
    """Assign ``(load, expert)`` replicas, heaviest first, to the least-loaded rank with room."""
    for weight, expert in sorted(replicas, key=lambda r: (-r[0], r[1])):
        open_ranks = [r for r in range(len(ranks)) if len(ranks[r]) < capacity]
        fresh = [r for r in open_ranks if expert not in ranks[r]]
        best = min(fresh or open_ranks, key=lambda r: (totals[r], len(ranks[r]), r))
        ranks[best].append(expert)
        totals[best] += weight
    return ranks


def _check_slot_counts(num_logical: int, num_physical: int, ep_size: int) -> None:
    if ep_size < 1:
        raise ValueError(f"ep_size must be >= 1, got ep_size={ep_size}")
    if num_logical < 1:
        raise ValueError(f"the number of logical experts must be >= 1, got num_logical={num_logical}")
    if num_physical < num_logical:
        raise ValueError(
            f"num_physical={num_physical} must be >= num_logical={num_logical}: every expert needs a slot"
        )
    if num_physical % ep_size:
        raise ValueError(
            f"num_physical={num_physical} must be divisible by ep_size={ep_size} so every rank holds "
            f"the same number of slots; use a multiple of {ep_size} (e.g. add redundant experts)"
        )


def _check_load(load: Sequence[float], num_logical: int) -> None:
    if len(load) != num_logical:
        raise ValueError(f"load has {len(load)} entries; expected one per logical expert ({num_logical})")
    for e, value in enumerate(load):
        if not math.isfinite(value) or value < 0:
            raise ValueError(f"load[{e}]={value} must be a finite, non-negative number")
