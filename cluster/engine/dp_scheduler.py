"""Data-parallel attention: one scheduler and one KV pool per DP rank, stepped together.

With DP attention on (``enable_dp_attention``, ``dp_size = D > 1``) the engine group's
``tp_size = W`` ranks form ``D`` DP ranks of ``W // D`` attention-TP ranks each
(:class:`~flotilla.cluster.topology.Topology`'s attention view). Each DP rank serves its
own requests from its own KV cache, so :class:`DPScheduler` holds ``D`` ordinary
:class:`~flotilla.cluster.engine.scheduler.Scheduler` s, every one sized from the same KV
layout (every DP rank allocates the same pool), and presents the single-scheduler
interface :class:`~flotilla.cluster.engine.llm_engine.LLMEngine` drives.

* **Routing.** A new request goes to the DP rank with the least load: fewest running +
  waiting requests, then fewest used KV blocks, ties to the lowest rank. The completions
  of one ``n > 1`` request stay together on one DP rank, so they share the prompt's
  cached blocks.
* **Lockstep.** :meth:`DPScheduler.schedule` schedules every DP rank each step and returns
  a :class:`DPSchedulerOutput`: ``parts[d]`` is DP rank ``d``'s batch (empty when it has
  nothing to do) and ``scheduled`` is the parts concatenated in DP order, so the engine's
  sampling rows are DP-major. The driver sends the whole output to every rank; each rank
  runs ``parts[its dp_rank]``. A rank with an empty part still runs the forward (zero
  tokens), because MoE layers exchange tokens across DP ranks and every rank must join
  every collective of the step. Each DP rank's leader (attention-TP rank 0) returns the
  logits of its part's sampling rows; the driver concatenates them in DP order.
* **Dense layers.** Attention, the dense MLPs, the vocab-parallel embedding and the LM
  head are all sharded over ATTENTION TP (``ParallelLayout.tp_size`` is the attention-TP
  width): each DP rank is its own replica of the dense part, and only MoE layers talk
  across DP ranks. (SGLang's equivalent is ``--moe-dense-tp-size`` equal to the
  attention-TP size.) The LM head's vocab all-gather runs inside one DP rank's attention
  TP; every rank of that group runs the same part, so all of them either call it (the
  part samples) or skip it (nothing samples).
* **Budgets.** The resolved ``chunked_prefill_size`` is already per DP rank (resolution
  divides it by ``dp_size``, as SGLang does); ``max_running_requests`` counts the whole
  group, so each DP rank may run ``max_running_requests // dp_size`` (see
  :func:`build_scheduler`).
* **KV handoff.** A prefill/decode pool may run DP attention: a prefilled prompt's blocks
  are held on the DP rank that computed it (:meth:`DPScheduler.held_rank`), and a prefilled
  request is admitted on the DP rank it was routed to; the block ids on either side are that
  DP rank's pool's, and only that DP rank's ranks move its KV.

Pure Python: no torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Callable, Mapping, Sequence

from flotilla.cluster.engine.request import Request, RequestStatus
from flotilla.cluster.engine.scheduler import ScheduledRequest, Scheduler, SchedulerConfig, SchedulerOutput

if TYPE_CHECKING:  # NOTE: type-only; the scheduler needs no resolution code at run time.
    from flotilla.resolution import ResolvedConfig


def attention_dp_size(config: "ResolvedConfig") -> int:
    """DP ranks of one engine group: ``dp_size`` with DP attention on, else 1 (with it off,
    ``dp_size`` counts independent replicas, each its own engine)."""
    return int(config.dp_size or 1) if config.enable_dp_attention else 1


def can_grow_elastic_ep(config: "ResolvedConfig") -> bool:
    """Whether the engine group may grow while serving: flotilla's ``ray`` elastic EP backend
    with ``max_ep_size`` above the launch size (the group then runs on Ray workers even at one
    rank, and its scheduler is a :class:`DPScheduler` even at one DP rank)."""
    max_ep, backend = getattr(config, "max_ep_size", None), getattr(config, "elastic_ep_backend", None)
    return backend == "ray" and max_ep is not None and int(max_ep) > int(getattr(config, "tp_size", 1) or 1)


def build_scheduler(config: "ResolvedConfig", scheduler_config: SchedulerConfig) -> "Scheduler | DPScheduler":
    """The engine's scheduler: a :class:`DPScheduler` over :func:`attention_dp_size` DP ranks
    when that is above 1 (or when the group may grow, :func:`can_grow_elastic_ep`), else a
    plain :class:`Scheduler` with ``scheduler_config``.

    ``scheduler_config`` is one DP rank's (its pool is one DP rank's KV cache); under DP
    attention an explicit ``max_running_requests`` is split evenly over the DP ranks at
    launch (DP ranks added by elastic EP get the same per-rank budgets).
    """
    dp_size = attention_dp_size(config)
    if dp_size == 1 and not can_grow_elastic_ep(config):
        return Scheduler(scheduler_config)
    if scheduler_config.num_host_blocks:
        raise NotImplementedError(
            "enable_hierarchical_cache=True is not supported with DP attention or an elastic EP group: "
            "the host tier's copies are not routed to one DP rank's cache; drop --enable-hierarchical-cache"
        )
    if config.max_running_requests:
        per_rank = max(1, int(config.max_running_requests) // dp_size)
        scheduler_config = replace(scheduler_config, max_num_seqs=min(per_rank, scheduler_config.max_num_seqs))
    return DPScheduler(scheduler_config, dp_size)


def parent_request_id(request_id: str) -> str:
    """The user request a completion belongs to: ``"abc"`` for ``"abc#2"``, else the id itself.

    NOTE: LLMEngine names the completions of an ``n > 1`` request ``f"{parent}#{index}"``.
    Reading an unrelated id such as ``"x#1"`` as a completion only co-locates it with ``"x"``
    (a load-balancing choice, never a correctness one).
    """
    head, sep, tail = request_id.rpartition("#")
    return head if sep and head and tail.isdigit() else request_id


@dataclass
class DPSchedulerOutput:
    """One lockstep step of every DP rank.

    Attributes:
        parts: one :class:`SchedulerOutput` per DP rank, in DP order (empty for an idle rank).

    ``scheduled``, ``preempted`` and ``num_batched_tokens`` read as a :class:`SchedulerOutput`'s,
    over the parts in DP order, so the engine handles either output alike.
    """

    parts: list[SchedulerOutput] = field(default_factory=list)

    @property
    def scheduled(self) -> list[ScheduledRequest]:
        """Every part's scheduled requests, DP rank 0's first (the sampling rows' order)."""
        return [item for part in self.parts for item in part.scheduled]

    @property
    def preempted(self) -> list[Request]:
        return [request for part in self.parts for request in part.preempted]

    @property
    def num_batched_tokens(self) -> int:
        return sum(part.num_batched_tokens for part in self.parts)

    @property
    def is_empty(self) -> bool:
        """True when no DP rank has work (the step is skipped)."""
        return all(part.is_empty for part in self.parts)

    @property
    def idle_ranks(self) -> list[int]:
        """DP ranks whose part is empty this step."""
        return [rank for rank, part in enumerate(self.parts) if part.is_empty]

    def sampling_rows(self, dp_rank: int) -> slice:
        """Where DP rank ``dp_rank``'s sampling requests sit among the step's sampling rows."""
        counts = [sum(item.samples for item in part.scheduled) for part in self.parts]
        start = sum(counts[:dp_rank])
        return slice(start, start + counts[dp_rank])


def part_for_rank(
    schedule: SchedulerOutput | DPSchedulerOutput, dp_rank: int, dp_size: int
) -> tuple[SchedulerOutput, slice]:
    """``(the batch DP rank dp_rank runs, where its rows sit among the step's sampling rows)``.

    A plain :class:`SchedulerOutput` is only valid without DP attention (``dp_size == 1``);
    a :class:`DPSchedulerOutput` must have exactly ``dp_size`` parts.
    """
    if isinstance(schedule, DPSchedulerOutput):
        if len(schedule.parts) != dp_size:
            raise ValueError(
                f"the step has {len(schedule.parts)} DP parts but this group has dp_size={dp_size} "
                f"DP-attention ranks; schedule with DPScheduler(dp_size={dp_size})"
            )
        return schedule.parts[dp_rank], schedule.sampling_rows(dp_rank)
    if dp_size != 1:
        raise ValueError(
            f"a DP-attention group (dp_size={dp_size}) needs a DPSchedulerOutput with one part per DP "
            f"rank, got a {type(schedule).__name__}; schedule with DPScheduler"
        )
    return schedule, slice(None)


class CombinedPools:
    """Read-only totals over every DP rank's KV block pool (what engine stats and benchmarks
    read from ``scheduler.pool``), plus :meth:`reset_prefix_cache` of all of them."""

    def __init__(self, schedulers: Sequence[Scheduler]):
        self._pools = [s.pool for s in schedulers]

    @property
    def block_size(self) -> int:
        return self._pools[0].block_size

    def blocks_for_tokens(self, num_tokens: int) -> int:
        """Blocks ``num_tokens`` tokens take on any DP rank's pool (every pool has one block size)."""
        return self._pools[0].blocks_for_tokens(num_tokens)

    @property
    def num_blocks(self) -> int:
        return sum(p.num_blocks for p in self._pools)

    @property
    def num_used_blocks(self) -> int:
        return sum(p.num_used_blocks for p in self._pools)

    @property
    def num_free_blocks(self) -> int:
        return sum(p.num_free_blocks for p in self._pools)

    @property
    def usage(self) -> float:
        """Fraction of all DP ranks' blocks referenced by live requests."""
        return self.num_used_blocks / self.num_blocks

    @property
    def prefix_query_tokens(self) -> int:
        return sum(p.prefix_query_tokens for p in self._pools)

    @property
    def prefix_hit_tokens(self) -> int:
        return sum(p.prefix_hit_tokens for p in self._pools)

    @property
    def hit_rate(self) -> float:
        """Prefix-cache hit tokens over queried prompt tokens, over every DP rank."""
        query = self.prefix_query_tokens
        return self.prefix_hit_tokens / query if query else 0.0

    def reset_prefix_cache(self) -> None:
        for pool in self._pools:
            pool.reset_prefix_cache()


class DPScheduler:
    """``dp_size`` schedulers stepped together, behind :class:`Scheduler`'s interface.

    Args:
        config: ONE DP rank's budgets and KV pool size (every DP rank gets the same).
        dp_size: DP-attention ranks (>= 1).
        group_key: maps a request id to its routing group; requests of one group that are
            live at once go to the same DP rank (default :func:`parent_request_id`: the
            completions of one ``n > 1`` request).

    Attributes:
        schedulers: DP rank ``d``'s scheduler at index ``d``.
        num_steps: non-empty steps scheduled.
        num_steps_with_idle_rank: of those, steps in which some DP rank had nothing to do
            (it ran an empty batch).
    """

    def __init__(
        self,
        config: SchedulerConfig,
        dp_size: int,
        group_key: Callable[[str], str] = parent_request_id,
    ) -> None:
        if isinstance(dp_size, bool) or not isinstance(dp_size, int) or dp_size < 1:
            raise ValueError(f"dp_size must be an integer >= 1 (got dp_size={dp_size!r})")
        self.config = config
        self.dp_size = dp_size
        self.schedulers = [Scheduler(config) for _ in range(dp_size)]
        self.pool = CombinedPools(self.schedulers)
        self._group_key = group_key
        self._rank_of: dict[str, int] = {}
        # group key -> (DP rank, live requests of the group)
        self._groups: dict[str, tuple[int, int]] = {}
        # KV handoff: the DP rank whose pool holds a finished request's held blocks
        # (hold_blocks), and a loading request's blocks finished while its read was in flight
        # (release_draining), by request id: both outlive the request's routing entry.
        self._held_rank: dict[str, int] = {}
        self._draining_rank: dict[str, int] = {}
        self.num_steps = 0
        self.num_steps_with_idle_rank = 0

    # ---- queries -------------------------------------------------------------

    @property
    def num_running(self) -> int:
        return sum(s.num_running for s in self.schedulers)

    @property
    def num_waiting(self) -> int:
        return sum(s.num_waiting for s in self.schedulers)

    @property
    def num_preemptions(self) -> int:
        return sum(s.num_preemptions for s in self.schedulers)

    @property
    def num_loading(self) -> int:
        """Requests waiting for their prompt's KV from elsewhere, over every DP rank."""
        return sum(s.num_loading for s in self.schedulers)

    def has_unfinished(self) -> bool:
        return any(s.has_unfinished() for s in self.schedulers)

    def get(self, request_id: str) -> Request | None:
        """The live request with this id, on whichever DP rank holds it."""
        rank = self._rank_of.get(request_id)
        return None if rank is None else self.schedulers[rank].get(request_id)

    def rank_of(self, request_id: str) -> int | None:
        """The DP rank serving a live request (None when no live request has this id)."""
        return self._rank_of.get(request_id)

    def max_tokens_per_request(self) -> int:
        """The most tokens one request may need: one DP rank's limit (a request lives on one)."""
        return self.schedulers[0].max_tokens_per_request()

    def load(self, dp_rank: int) -> tuple[int, int]:
        """``(running + waiting requests, used KV blocks)`` of a DP rank: the routing order."""
        scheduler = self.schedulers[dp_rank]
        return scheduler.num_running + scheduler.num_waiting, scheduler.pool.num_used_blocks

    def grow(self, new_dp_size: int) -> None:
        """Add DP ranks ``[dp_size, new_dp_size)``, each with a fresh scheduler and KV pool of
        the same per-rank budgets (elastic EP: the worker group grew by as many ranks). Live
        requests stay where they are; new ones are routed over every rank from now on."""
        if isinstance(new_dp_size, bool) or not isinstance(new_dp_size, int) or new_dp_size < self.dp_size:
            raise ValueError(f"new_dp_size must be an integer >= dp_size={self.dp_size} (got new_dp_size={new_dp_size!r})")
        self.schedulers += [Scheduler(self.config) for _ in range(new_dp_size - self.dp_size)]
        self.dp_size = new_dp_size
        self.pool = CombinedPools(self.schedulers)

    # ---- lifecycle -------------------------------------------------------------

    def pick_rank(self, request: Request) -> int:
        """The DP rank a new request goes to: its group's while the group is live, else the
        least loaded (:meth:`load`), ties to the lowest rank."""
        group = self._groups.get(self._group_key(request.request_id))
        if group is not None:
            return group[0]
        return min(range(self.dp_size), key=lambda rank: (self.load(rank), rank))

    def add(self, request: Request) -> int:
        """Queue a new request on the DP rank :meth:`pick_rank` chooses; returns that rank.

        Raises ValueError (as :meth:`Scheduler.add`) for a duplicate id or an oversized request.
        """
        if request.request_id in self._rank_of:
            raise ValueError(f"request_id {request.request_id!r} is already live; request ids must be unique")
        rank = self.pick_rank(request)
        self.schedulers[rank].add(request)
        self._rank_of[request.request_id] = rank
        key = self._group_key(request.request_id)
        _, live = self._groups.get(key, (rank, 0))
        self._groups[key] = (rank, live + 1)
        return rank

    def finish(self, request_id: str, status: RequestStatus) -> bool:
        """End a live request on its DP rank (blocks freed at once); False when no live
        request has this id."""
        rank = self._rank_of.get(request_id)
        if rank is None:
            if not status.is_finished:
                raise ValueError(f"status must be a finished status (got status={status.name})")
            return False
        if not self.schedulers[rank].finish(request_id, status):
            return False
        del self._rank_of[request_id]
        if self.schedulers[rank].is_draining(request_id):
            self._draining_rank[request_id] = rank
        key = self._group_key(request_id)
        _, live = self._groups[key]
        if live == 1:
            del self._groups[key]
        else:
            self._groups[key] = (rank, live - 1)
        return True

    def abort(self, request_id: str) -> bool:
        """Cancel a waiting or running request; its DP rank's blocks are free on return."""
        return self.finish(request_id, RequestStatus.FINISHED_ABORTED)

    # ---- KV handoff (prefill/decode disaggregation), each on the request's DP rank ------

    def _live_rank(self, request_id: str) -> int:
        rank = self._rank_of.get(request_id)
        if rank is None:
            raise ValueError(f"request_id {request_id!r} is not live on any DP rank")
        return rank

    def hold_blocks(self, request_id: str) -> list[int]:
        """:meth:`Scheduler.hold_blocks` on the request's DP rank: the block ids are that
        rank's (:meth:`held_rank` says which)."""
        rank = self._live_rank(request_id)
        blocks = self.schedulers[rank].hold_blocks(request_id)
        self._held_rank[request_id] = rank
        return blocks

    def held_blocks(self, request_id: str) -> list[int] | None:
        """The block ids held for ``request_id`` on its DP rank's pool, or None."""
        rank = self._held_rank.get(request_id)
        return None if rank is None else self.schedulers[rank].held_blocks(request_id)

    def held_rank(self, request_id: str) -> int | None:
        """The DP rank whose KV pool holds ``request_id``'s held blocks (None: none held)."""
        return self._held_rank.get(request_id)

    @property
    def num_held_blocks(self) -> int:
        return sum(s.num_held_blocks for s in self.schedulers)

    def release_held_blocks(self, request_id: str) -> list[int] | None:
        """:meth:`Scheduler.release_held_blocks` on the DP rank that holds them."""
        rank = self._held_rank.pop(request_id, None)
        return None if rank is None else self.schedulers[rank].release_held_blocks(request_id)

    @property
    def waiting_for_held_blocks(self) -> bool:
        """Whether no DP rank can make progress because held blocks fill its pool: some rank's
        last schedule was blocked on them and every rank with unfinished requests was."""
        pending = [s for s in self.schedulers if s.has_unfinished()]
        return bool(pending) and all(s.waiting_for_held_blocks for s in pending)

    def admit_prefilled(self, request_id: str) -> tuple[list[int], int] | None:
        """:meth:`Scheduler.admit_prefilled` on the DP rank the request was routed to
        (:meth:`rank_of`): the block ids are that rank's pool's."""
        return self.schedulers[self._live_rank(request_id)].admit_prefilled(request_id)

    def remote_kv_loaded(self, request_id: str, first_token: int) -> Request:
        return self.schedulers[self._live_rank(request_id)].remote_kv_loaded(request_id, first_token)

    def remote_kv_failed(self, request_id: str) -> Request:
        return self.schedulers[self._live_rank(request_id)].remote_kv_failed(request_id)

    def is_draining(self, request_id: str) -> bool:
        return request_id in self._draining_rank

    def release_draining(self, request_id: str) -> bool:
        """:meth:`Scheduler.release_draining` on the DP rank the finished request lived on."""
        rank = self._draining_rank.pop(request_id, None)
        return rank is not None and self.schedulers[rank].release_draining(request_id)

    # ---- the step ----------------------------------------------------------------

    def schedule(self) -> DPSchedulerOutput:
        """Schedule every DP rank for one lockstep step (an idle rank's part is empty)."""
        out = DPSchedulerOutput([scheduler.schedule() for scheduler in self.schedulers])
        if not out.is_empty:
            self.num_steps += 1
            self.num_steps_with_idle_rank += bool(out.idle_ranks)
        return out

    def update(self, output: DPSchedulerOutput, sampled: Mapping[str, int | None]) -> list[Request]:
        """Advance every DP rank's part (see :meth:`Scheduler.update`); ``sampled`` is keyed by
        request id over all parts. Returns the requests that received a token, DP-major."""
        if len(output.parts) != self.dp_size:
            raise ValueError(f"output has {len(output.parts)} parts for dp_size={self.dp_size}")
        advanced: list[Request] = []
        for scheduler, part in zip(self.schedulers, output.parts):
            advanced += scheduler.update(part, sampled)
        return advanced

    def check_invariants(self) -> None:
        """Every DP rank's :meth:`Scheduler.check_invariants`, and the routing map agrees
        with where the live requests are (for tests)."""
        live: dict[str, int] = {}
        for rank, scheduler in enumerate(self.schedulers):
            scheduler.check_invariants()
            for request in [*scheduler.running, *scheduler.waiting]:
                assert request.request_id not in live, f"{request} is live on two DP ranks"
                live[request.request_id] = rank
        assert live == self._rank_of, f"routing map {self._rank_of} disagrees with the queues {live}"
        counts: dict[str, int] = {}
        for request_id, rank in live.items():
            key = self._group_key(request_id)
            assert self._groups[key][0] == rank, f"group {key!r} is split over DP ranks"
            counts[key] = counts.get(key, 0) + 1
        assert counts == {key: n for key, (_, n) in self._groups.items()}, "group live counts are stale"
