"""In which order waiting requests are admitted: ``--schedule-policy`` and priorities.

The scheduler admits waiting requests in the order :func:`waiting_order` gives and stops at
the first one that does not fit (so a policy's head is never skipped). SGLang's policies:

- ``fcfs``: arrival order (a preempted request keeps its place: it arrived before every
  request still waiting);
- ``lpm``: the longest prefix already in the KV cache first (more cache hits, fewer tokens to
  compute), arrival order among equals; above :data:`LPM_MAX_QUEUE` waiting requests it falls
  back to ``fcfs``, as SGLang does (matching every prompt each step costs more than it saves);
- ``random``: a seeded shuffle each step;
- ``dfs-weight``: depth first over the tree of cached prefixes the waiting requests share,
  the branch holding the most waiting requests first, so requests that share a prefix run
  together while it is cached;
- ``lof``: the longest remaining output budget (``max_tokens``) first.

With :class:`PriorityPolicy` (``--enable-priority-scheduling``) the priority level comes
before the policy: every request of a more urgent level is admitted before any of a less
urgent one, the policy ordering each level. Larger values are more urgent unless
``--schedule-low-priority-values-first`` (vLLM's convention), as in SGLang.

Pure Python: no torch.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Sequence

from flotilla.cluster.engine.block_manager import KVBlockPool
from flotilla.cluster.engine.request import Request

POLICIES = ("fcfs", "lpm", "random", "dfs-weight", "lof")
# Above this many waiting requests lpm and dfs-weight order by arrival (SGLang's bound).
LPM_MAX_QUEUE = 128


@dataclass(frozen=True)
class PriorityPolicy:
    """Priority scheduling: requests carry an integer priority.

    Attributes:
        low_values_first: smaller values are more urgent (default: larger ones, SGLang's).
        preemption: a waiting request may preempt running ones of a less urgent level
            (off with ``--disable-priority-preemption``).
        preemption_threshold: the gap in priority a waiting request needs over a running one
            to preempt it (``--priority-scheduling-preemption-threshold``).
    """

    low_values_first: bool = False
    preemption: bool = True
    preemption_threshold: int = 10

    def urgency(self, request: Request) -> int:
        """Smaller is admitted first."""
        return request.priority if self.low_values_first else -request.priority

    def may_preempt(self, waiting: Request, running: Request) -> bool:
        """Whether ``waiting`` is more urgent than ``running`` by more than the threshold
        (and by at least one level, whatever the threshold)."""
        gap = self.urgency(running) - self.urgency(waiting)
        return self.preemption and gap > max(self.preemption_threshold, 0)


def check_policy(policy: str) -> None:
    if policy not in POLICIES:
        raise ValueError(f"schedule_policy must be one of {', '.join(POLICIES)} (got schedule_policy={policy!r})")


def waiting_order(
    waiting: Sequence[Request],
    policy: str,
    pool: KVBlockPool,
    priority: PriorityPolicy | None = None,
    rng: random.Random | None = None,
) -> list[Request]:
    """The waiting requests in admission order (see the module docstring). ``waiting`` is
    in arrival order; ``pool`` answers prefix matches (no references are taken)."""
    if policy != "fcfs" and len(waiting) > LPM_MAX_QUEUE and policy in ("lpm", "dfs-weight"):
        policy = "fcfs"
    if policy == "fcfs":
        order = sorted(waiting, key=lambda r: r.arrival_order)
    elif policy == "lpm":
        cached = {id(r): pool.match_prefix(r.all_token_ids, r.block_hashes)[1] for r in waiting}
        order = sorted(waiting, key=lambda r: (-cached[id(r)], r.arrival_order))
    elif policy == "random":
        order = sorted(waiting, key=lambda r: r.arrival_order)
        (rng or random.Random(0)).shuffle(order)
    elif policy == "lof":
        order = sorted(waiting, key=lambda r: (-(r.max_tokens - r.num_output_tokens), r.arrival_order))
    elif policy == "dfs-weight":
        order = _dfs_weight_order(sorted(waiting, key=lambda r: r.arrival_order), pool)
    else:
        check_policy(policy)
        raise AssertionError(policy)
    if priority is not None:
        order.sort(key=priority.urgency)  # NOTE: stable: the policy orders each level
    return order


def _dfs_weight_order(waiting: list[Request], pool: KVBlockPool) -> list[Request]:
    """Depth first over the trie of the waiting requests' cached prefix blocks: at each node
    the children holding more waiting requests first, a node's children before the requests
    whose cached prefix ends at the node (SGLang's order)."""
    root: dict = {"children": {}, "requests": [], "weight": 0}
    for request in waiting:
        blocks, _ = pool.match_prefix(request.all_token_ids, request.block_hashes)
        node = root
        node["weight"] += 1
        for key in request.block_hashes[: len(blocks)]:
            node = node["children"].setdefault(key, {"children": {}, "requests": [], "weight": 0})
            node["weight"] += 1
        node["requests"].append(request)
    order: list[Request] = []
    stack = [root]
    while stack:
        node = stack.pop()
        if isinstance(node, Request):
            order.append(node)
            continue
        # NOTE: pushed in reverse: the heaviest child pops first, then the node's own requests.
        stack.extend(reversed(node["requests"]))
        # NOTE: ascending, so the heaviest is on top; among equals the earliest-made child is.
        children = sorted(enumerate(node["children"].values()), key=lambda item: (item[1]["weight"], -item[0]))
        stack.extend(child for _, child in children)
    return order
