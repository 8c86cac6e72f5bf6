"""Continuous batching with chunked prefill, prefix caching and preemption.

Each engine step is ``schedule()`` -> execute -> ``update()``. ``schedule`` hands
out a token budget (``max_num_batched_tokens``): first to the running requests
in arrival order (a decode needs one token; a partly prefilled prompt gets the
rest of its prompt, up to the budget), then to waiting requests, first come
first served, each taking its cached prefix from the block pool and a prefill
chunk of what remains. A request joins the batch the step it is admitted and
leaves it the step it finishes; nothing waits for a batch to drain.

When the pool cannot give a running request the block its next token needs, the
most recently arrived running request is preempted: its blocks are freed, its
computed count drops to zero, and it goes back to the FRONT of the waiting queue
with the tokens it has sampled so far, to be recomputed (prompt + outputs) when it
is admitted again, less what the prefix cache still holds then.

Waiting requests are admitted in the order of ``SchedulerConfig.policy``
(``--schedule-policy``: fcfs, lpm, random, dfs-weight, lof; see
:mod:`~flotilla.cluster.engine.schedule_policy`), at most ``max_new_requests`` a step
(``--prefill-max-requests``). With a priority policy (``--enable-priority-scheduling``)
running requests are ordered by (urgency, arrival), so the preemption victim is the least
urgent latest arrival, and a waiting request that does not fit may preempt running
requests less urgent than it by more than the policy's threshold.

Blocks held for a KV handoff (:meth:`Scheduler.hold_blocks`: a prefill engine keeps a
finished prompt's KV for a decode engine to read) belong to no running request. When they
fill the pool so that nothing runs and the head of the queue does not fit, ``schedule()``
schedules nothing and :attr:`Scheduler.waiting_for_held_blocks` says so: the queue waits for
:meth:`Scheduler.release_held_blocks` (the serving engine's leases end within their term).
Only a request that could not run even with the whole pool free is an error
(:class:`UnschedulableRequestError`, raised for that request alone).

Remote KV is a request state (a decode engine of a KV handoff): :meth:`Scheduler.admit_prefilled`
gives a waiting request its prompt's blocks and a running slot, and it waits in
``WAITING_FOR_REMOTE_KV`` (:attr:`Scheduler.loading`) while a read fills them elsewhere; it is
never scheduled nor preempted meanwhile. :meth:`Scheduler.remote_kv_loaded` then commits its
prompt blocks to the prefix cache and puts it in ``running`` with its first token (sampled by
the prefill engine); :meth:`Scheduler.remote_kv_failed` frees its blocks and queues it as an
ordinary request that computes its prompt here. A loading request that is finished (aborted)
leaves its blocks referenced ("draining": the read still writes into them) until
:meth:`Scheduler.release_draining`, once the read has ended.

With a host tier (``num_host_blocks``, ``--enable-hierarchical-cache``) a preempted
request's committed full blocks are copied to host memory first (``kv_offload``),
and admission continues the prefix match there after the GPU cache's: the blocks
found are loaded into fresh GPU blocks (``kv_load``) instead of being recomputed
(:mod:`~flotilla.cluster.engine.host_kv_tier`). A step never has both: nothing is
admitted in a step that preempts.

NOTE: fairness invariant (fcfs without priorities). ``running`` and ``waiting`` are both
in arrival order, and every running request arrived before every waiting one: admission
never skips the head of the queue, and preemption moves the latest running request to
the head. So an earlier request is never starved by later ones. Other policies trade this
for cache hits or urgency, as their names say.

Pure Python: no torch.
"""

from __future__ import annotations

import bisect
import random
from collections import deque
from dataclasses import dataclass, field
from typing import Mapping

from flotilla.cluster.engine.block_manager import KVBlockPool
from flotilla.cluster.engine.host_kv_tier import HostKVTier
from flotilla.cluster.engine.request import Request, RequestStatus
from flotilla.cluster.engine.schedule_policy import PriorityPolicy, check_policy, waiting_order


class UnschedulableRequestError(RuntimeError):
    """A waiting request cannot be scheduled even with the whole KV pool free (nothing runs,
    nothing is held): a broken invariant, not a full pool. The engine fails this request
    alone (``request_id``) and serves on."""

    def __init__(self, request_id: str, message: str):
        super().__init__(message)
        self.request_id = request_id


def _check_positive_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1 (got {name}={value!r})")


@dataclass(frozen=True, kw_only=True)
class SchedulerConfig:
    """What the scheduler may hand out per step.

    Attributes:
        num_blocks: KV cache blocks (a runtime fact: what fits in memory).
        max_num_seqs: the most requests running at once.
        max_num_batched_tokens: the token budget of one step (prefill chunks plus
            decodes); at least ``max_num_seqs`` so every running request can
            decode every step.
        block_size: token slots per KV cache block.
        enable_prefix_caching: reuse cached blocks of shared prompt prefixes.
        enable_chunked_prefill: split a prompt over steps to fit the budget; when
            off, a prefill is scheduled whole or not at all.
        num_host_blocks: KV blocks the host tier holds (0: no host tier; preempted
            requests are recomputed); needs prefix caching.
        policy: the admission order of waiting requests (``fcfs``, ``lpm``, ``random``,
            ``dfs-weight``, ``lof``; :mod:`~flotilla.cluster.engine.schedule_policy`).
        priority: priority scheduling (None: every request is of one level).
        max_new_requests: the most waiting requests admitted in one step (None: no cap).
        seed: seeds the ``random`` policy's shuffles.
    """

    num_blocks: int
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    block_size: int = 16
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    num_host_blocks: int = 0
    policy: str = "fcfs"
    priority: PriorityPolicy | None = None
    max_new_requests: int | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("num_blocks", "max_num_seqs", "max_num_batched_tokens", "block_size"):
            _check_positive_int(name, getattr(self, name))
        check_policy(self.policy)
        if self.max_new_requests is not None:
            _check_positive_int("max_new_requests", self.max_new_requests)
        if isinstance(self.num_host_blocks, bool) or not isinstance(self.num_host_blocks, int) or self.num_host_blocks < 0:
            raise ValueError(f"num_host_blocks must be an integer >= 0 (got num_host_blocks={self.num_host_blocks!r})")
        if self.num_host_blocks and not self.enable_prefix_caching:
            raise ValueError(
                f"num_host_blocks={self.num_host_blocks} needs enable_prefix_caching=True: the host tier is "
                f"indexed by prefix-cache keys"
            )
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_num_seqs "
                f"({self.max_num_seqs}) so every running request can decode each step; raise "
                f"max_num_batched_tokens or lower max_num_seqs"
            )


@dataclass(frozen=True)
class ScheduledRequest:
    """One request's share of a step.

    Attributes:
        request: the request (its ``block_ids`` already cover the new tokens).
        num_new_tokens: tokens to compute this step.
        start_position: position of the first new token (``num_computed_tokens``
            when scheduled); the new tokens are ``all_token_ids[start:start+n]``.
        draft_token_ids: speculative decoding: drafted tokens computed after the request's
            last token (they count in ``num_new_tokens``; a decode step with ``k`` drafts
            computes ``1 + k`` positions, and the engine gets the logits of all of them).
        samples: whether this step completes the request's tokens, so the engine
            samples one for it (False for a partial prefill chunk).
    """

    request: Request
    num_new_tokens: int
    start_position: int
    draft_token_ids: tuple[int, ...] = ()
    samples: bool = field(init=False)

    def __post_init__(self) -> None:
        # NOTE: fixed at schedule time; update() appends the sampled token, after
        # which the request's length no longer tells.
        own = self.num_new_tokens - len(self.draft_token_ids)
        object.__setattr__(self, "samples", self.start_position + own == self.request.num_tokens)

    @property
    def token_ids(self) -> list[int]:
        """The new tokens' ids, drafts last (read before :meth:`Scheduler.update`, like everything here)."""
        own = self.num_new_tokens - len(self.draft_token_ids)
        return self.request.all_token_ids[self.start_position : self.start_position + own] + list(self.draft_token_ids)


@dataclass
class SchedulerOutput:
    """What one step computes.

    Attributes:
        scheduled: running requests first (arrival order), then newly admitted ones.
        preempted: requests that lost their blocks this step (now waiting again).
        num_batched_tokens: sum of ``num_new_tokens``.
        kv_offload: ``(block_id, host_slot)`` copies to queue before this step's
            forward (blocks of the preempted requests, before others reuse them).
        kv_load: ``(host_slot, block_id)`` copies to queue before this step's forward
            (prefix blocks found in the host tier, into the admitted requests' blocks).
    """

    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    num_batched_tokens: int = 0
    kv_offload: list[tuple[int, int]] = field(default_factory=list)
    kv_load: list[tuple[int, int]] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    """Decides, each step, which requests compute how many tokens.

    Args:
        config: the budgets and switches.
        pool: the KV block pool (built from ``config`` when None); its block size
            and caching switch must agree with ``config``.
    """

    def __init__(self, config: SchedulerConfig, pool: KVBlockPool | None = None) -> None:
        if pool is None:
            pool = KVBlockPool(config.num_blocks, config.block_size, config.enable_prefix_caching)
        if pool.block_size != config.block_size or pool.num_blocks != config.num_blocks:
            raise ValueError(
                f"pool (num_blocks={pool.num_blocks}, block_size={pool.block_size}) does not match config "
                f"(num_blocks={config.num_blocks}, block_size={config.block_size})"
            )
        if pool.enable_prefix_caching != config.enable_prefix_caching:
            raise ValueError(
                f"pool.enable_prefix_caching={pool.enable_prefix_caching} does not match "
                f"config.enable_prefix_caching={config.enable_prefix_caching}"
            )
        self.config = config
        self.pool = pool
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._requests: dict[str, Request] = {}
        self._next_arrival = 0
        self.num_preemptions = 0
        self.host_tier = HostKVTier(config.num_host_blocks) if config.num_host_blocks else None
        # Block references kept past their request's end (hold_blocks), by request id.
        self._held: dict[str, list[int]] = {}
        # Requests waiting for their prompt's KV from elsewhere (admit_prefilled), by id, in
        # admission order: they hold blocks and a running slot, and are never scheduled.
        self.loading: dict[str, Request] = {}
        # Blocks of loading requests finished while their read was in flight, by request id:
        # the read still writes into them (release_draining frees them).
        self._draining: dict[str, list[int]] = {}
        # The last schedule() admitted nothing because held blocks fill the pool (see
        # waiting_for_held_blocks); cleared by anything that can change that.
        self._blocked_on_held = False
        self._rng = random.Random(config.seed)

    # ---- queries -------------------------------------------------------------

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_loading(self) -> int:
        """Requests waiting for their prompt's KV from elsewhere (``WAITING_FOR_REMOTE_KV``)."""
        return len(self.loading)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.loading)

    def get(self, request_id: str) -> Request | None:
        """The live (waiting, loading or running) request with this id, if any."""
        return self._requests.get(request_id)

    def _slots_used(self) -> int:
        """Running slots taken: running requests and those loading their KV."""
        return len(self.running) + len(self.loading)

    @property
    def waiting_for_held_blocks(self) -> bool:
        """Whether the last :meth:`schedule` scheduled nothing because blocks held by
        :meth:`hold_blocks` fill the pool: nothing runs, and the head of the queue fits only
        once some are released. Stepping again changes nothing until
        :meth:`release_held_blocks`, :meth:`finish` or :meth:`add` (which clear it)."""
        return self._blocked_on_held

    def max_tokens_per_request(self) -> int:
        """The most tokens (prompt + max_tokens) one request may need.

        A request must fit the whole pool alone, so the oldest running request can
        always make progress by preempting the others; without chunked prefill its
        recompute must also fit one step's budget. The caller rejects (or caps
        ``max_tokens`` of) requests above it; :meth:`add` raises for them.

        NOTE: blocks held for a KV handoff count as free here: holds end (the serving
        engine's leases expire), so a request within this bound runs once they do; until
        then it waits (:attr:`waiting_for_held_blocks`).
        """
        limit = self.pool.num_blocks * self.pool.block_size
        if not self.config.enable_chunked_prefill:
            limit = min(limit, self.config.max_num_batched_tokens)
        return limit

    # ---- lifecycle -------------------------------------------------------------

    def add(self, request: Request) -> None:
        """Queue a new request (last in arrival order)."""
        if request.request_id in self._requests:
            raise ValueError(f"request_id {request.request_id!r} is already live; request ids must be unique")
        if request.request_id in self._draining:
            raise ValueError(
                f"request_id {request.request_id!r} was aborted while its KV read is in flight; use another id "
                "(or wait for the read to end)"
            )
        if request.status is not RequestStatus.WAITING or request.block_ids:
            raise ValueError(f"request {request.request_id!r} was already scheduled (status={request.status.name})")
        needed = request.num_prompt_tokens + request.max_tokens
        limit = self.max_tokens_per_request()
        if needed > limit:
            raise ValueError(
                f"prompt_token_ids + max_tokens: request {request.request_id!r} needs {needed} tokens "
                f"({request.num_prompt_tokens} prompt + max_tokens={request.max_tokens}), more than the "
                f"{limit} one request may use here; shorten the prompt or lower max_tokens"
            )
        request.arrival_order = self._next_arrival
        self._next_arrival += 1
        self._requests[request.request_id] = request
        self.waiting.append(request)
        self._blocked_on_held = False

    def finish(self, request_id: str, status: RequestStatus) -> bool:
        """End a live request with a finished ``status`` and free its blocks at once.

        Returns False if no live request has this id.
        """
        if not status.is_finished:
            raise ValueError(f"status must be a finished status (got status={status.name})")
        request = self._requests.pop(request_id, None)
        if request is None:
            return False
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        elif request.status is RequestStatus.WAITING_FOR_REMOTE_KV:
            del self.loading[request_id]
            # NOTE: its read still writes into its blocks: they stay referenced until it ends.
            self._draining[request_id], request.block_ids = request.block_ids, []
        else:
            self.waiting.remove(request)
        self._release_blocks(request)
        request.status = status
        self._blocked_on_held = False
        return True

    def abort(self, request_id: str) -> bool:
        """Cancel a live request; its blocks are free on return (a loading request's once its
        read ends: see :meth:`release_draining`)."""
        return self.finish(request_id, RequestStatus.FINISHED_ABORTED)

    # ---- KV handoff (prefill/decode disaggregation) ------------------------------

    def hold_blocks(self, request_id: str) -> list[int]:
        """Take over a live request's block references before it is finished, so
        :meth:`finish` leaves its KV in the cache (a prefill engine keeps a prompt's
        KV for a decode engine to copy). Returns the block ids, in position order.

        NOTE: the references stay counted (cached prefix blocks stay shared and
        cannot be evicted) until :meth:`release_held_blocks`.
        """
        request = self._requests.get(request_id)
        if request is None:
            raise ValueError(f"request_id {request_id!r} is not live; hold its blocks before finishing it")
        if request_id in self._held:
            raise ValueError(f"request_id {request_id!r} already holds blocks; release them first")
        self._held[request_id], request.block_ids = request.block_ids, []
        return list(self._held[request_id])

    def held_blocks(self, request_id: str) -> list[int] | None:
        """The block ids held for ``request_id`` by :meth:`hold_blocks`, or None."""
        held = self._held.get(request_id)
        return None if held is None else list(held)

    @property
    def num_held_blocks(self) -> int:
        """Block references held by :meth:`hold_blocks` and not released yet."""
        return sum(len(blocks) for blocks in self._held.values())

    def release_held_blocks(self, request_id: str) -> list[int] | None:
        """Drop the references :meth:`hold_blocks` took for ``request_id``; returns the
        block ids, or None when nothing is held under that id (already released)."""
        blocks = self._held.pop(request_id, None)
        if blocks is not None:
            self.pool.free(blocks)
            self._blocked_on_held = False
        return blocks

    def admit_prefilled(self, request_id: str) -> tuple[list[int], int] | None:
        """Admit the waiting request ``request_id`` with its prompt's KV coming from
        elsewhere (a prefill engine): allocate blocks for the prompt and a running slot; the
        request waits in ``WAITING_FOR_REMOTE_KV`` (not scheduled) until
        :meth:`remote_kv_loaded` or :meth:`remote_kv_failed`.

        Returns ``(block_ids, num_cached_blocks)``: the first ``num_cached_blocks`` came
        from the local prefix cache and already hold the right KV; the caller has the rest
        filled. Returns None, leaving the request waiting as an ordinary request that will
        compute its prompt itself, when it cannot be admitted now: it is not the only
        waiting request (NOTE: admitting it would jump the FCFS queue), every running slot
        is taken, or the pool is short of blocks.
        """
        request = self._requests.get(request_id)
        if request is None or request.status is not RequestStatus.WAITING or request.output_token_ids:
            raise ValueError(f"request_id {request_id!r} is not a fresh waiting request; add() it first")
        if list(self.waiting) != [request] or self._slots_used() >= self.config.max_num_seqs:
            return None
        cached_blocks, num_cached = self.pool.match_prefix(request.prompt_token_ids, request.block_hashes)
        needed = self.pool.blocks_for_tokens(request.num_prompt_tokens) - len(cached_blocks)
        if not self.pool.can_allocate(needed, cached_blocks):
            return None
        self.waiting.popleft()
        self.pool.touch(cached_blocks)
        request.block_ids = cached_blocks + self.pool.allocate(needed)
        request.num_committed_blocks = len(cached_blocks)
        request.num_cached_prompt_tokens = num_cached
        request.status, request.prefilled = RequestStatus.WAITING_FOR_REMOTE_KV, True
        self.loading[request_id] = request
        return list(request.block_ids), len(cached_blocks)

    def remote_kv_loaded(self, request_id: str, first_token: int) -> Request:
        """The KV of a loading request is in place: count its prompt as computed, offer its
        full prompt blocks to the prefix cache, append ``first_token`` (sampled by the
        prefill engine) as its first output and put it in ``running``: its next step decodes.
        Returns the request."""
        request = self._take_loading(request_id)
        request.num_computed_tokens = request.num_prompt_tokens
        self.pool.record_prefix_query(request.num_prompt_tokens, request.num_cached_prompt_tokens)
        self.pool.commit_full_blocks(request)
        request.append_output_token(int(first_token))
        request.status = RequestStatus.RUNNING
        self._run(request)
        return request

    def remote_kv_failed(self, request_id: str) -> Request:
        """The KV of a loading request could not be read (the read ended): free its blocks and
        queue it as an ordinary request that computes its prompt here, as the latest arrival
        (as if it came now: the requests admitted while it loaded keep their place).
        Returns the request."""
        request = self._take_loading(request_id)
        self._release_blocks(request)
        request.num_cached_prompt_tokens = 0
        request.status, request.prefilled = RequestStatus.WAITING, False
        request.arrival_order = self._next_arrival
        self._next_arrival += 1
        self.waiting.append(request)
        self._blocked_on_held = False
        return request

    def _take_loading(self, request_id: str) -> Request:
        request = self.loading.pop(request_id, None)
        if request is None:
            raise ValueError(f"request_id {request_id!r} is not waiting for remote KV")
        return request

    def is_draining(self, request_id: str) -> bool:
        """Whether ``request_id`` was finished while loading and its blocks wait for its read to end."""
        return request_id in self._draining

    def release_draining(self, request_id: str) -> bool:
        """The read of a request finished while loading has ended: free its blocks. False when
        none are draining under that id."""
        blocks = self._draining.pop(request_id, None)
        if blocks is None:
            return False
        self.pool.free(blocks)
        self._blocked_on_held = False
        return True

    @property
    def num_draining_blocks(self) -> int:
        """Block references of finished requests whose KV read is still in flight."""
        return sum(len(blocks) for blocks in self._draining.values())

    # ---- the step ----------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """Pick this step's requests and token counts, allocating their blocks."""
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        budget = self._schedule_running(out, budget)
        # NOTE: after a preemption the pool is short; admitting now would only
        # preempt again next step.
        if not out.preempted:
            self._schedule_waiting(out, budget)
        out.num_batched_tokens = sum(item.num_new_tokens for item in out.scheduled)
        self._blocked_on_held = False
        if out.is_empty and self.waiting and not self.running:
            if self.loading or self._draining:
                # NOTE: blocks (or slots) wait for KV reads in flight; each ends within its bound.
                return out
            if self._held:
                # NOTE: the pool is short only by held blocks (they belong to no running
                # request); add()'s bound lets the head fit once they are released.
                self._blocked_on_held = True
                return out
            # NOTE: unreachable while add()'s bound holds and the engine finishes requests
            # at max_tokens; the engine fails this request, not its loop.
            head = self.waiting[0]
            raise UnschedulableRequestError(
                head.request_id,
                f"request {head.request_id!r} needs {head.num_tokens} tokens of KV cache and cannot be scheduled "
                f"even with the whole pool free (limit {self.max_tokens_per_request()} tokens); shorten the "
                f"prompt or lower max_tokens",
            )
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            num_new = min(request.num_tokens_to_compute, budget)
            # NOTE: a decode's drafts ride along as far as the budget and the pool allow;
            # they are dropped before anyone is preempted for them.
            drafts = request.draft_token_ids[: budget - 1] if request.num_tokens_to_compute == 1 else []
            needed = self.pool.blocks_for_tokens(request.num_computed_tokens + num_new + len(drafts)) - len(request.block_ids)
            if drafts and not self.pool.can_allocate(needed):
                drafts = []
                needed = self.pool.blocks_for_tokens(request.num_computed_tokens + num_new) - len(request.block_ids)
            num_new += len(drafts)
            while not self.pool.can_allocate(needed):
                # NOTE: the victim is the latest arrival; requests before index are
                # already scheduled and are never victims (the loop stops at itself).
                victim = self.running.pop()
                self._offload(victim, out)
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is request:
                    return budget
            request.block_ids += self.pool.allocate(needed)
            out.scheduled.append(ScheduledRequest(request, num_new, request.num_computed_tokens, tuple(drafts)))
            budget -= num_new
            index += 1
        return budget

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        """Admit waiting requests in the policy's order until one does not fit."""
        config = self.config
        may_preempt = config.priority is not None and config.priority.preemption
        if not self.waiting or budget <= 0 or (self._slots_used() >= config.max_num_seqs and not may_preempt):
            return
        order = waiting_order(list(self.waiting), config.policy, self.pool, config.priority, self._rng)
        for admitted, request in enumerate(order):
            if budget <= 0 or (config.max_new_requests is not None and admitted >= config.max_new_requests):
                return
            taken = self._admit(request, out, budget)
            if taken is None:
                refund = self._preempt_for(request, out)
                if refund is None:
                    return
                budget += refund
                taken = self._admit(request, out, budget)
                if taken is None:
                    return
            budget -= taken

    def _admit(self, request: Request, out: SchedulerOutput, budget: int) -> int | None:
        """Admit ``request`` with a prefill chunk of at most ``budget`` tokens; returns the
        tokens scheduled, or None (nothing changed) when it does not fit now."""
        if self._slots_used() >= self.config.max_num_seqs:
            return None
        cached_blocks, num_cached = self.pool.match_prefix(request.all_token_ids, request.block_hashes)
        if request.skip_prefix_cache:
            cached_blocks, num_cached = [], 0  # NOTE: the match only extended block_hashes
        host_keys = self._host_hits(request, len(cached_blocks)) if not request.skip_prefix_cache else []
        num_cached += len(host_keys) * self.pool.block_size
        num_new = request.num_tokens - num_cached
        if num_new > budget:
            if not self.config.enable_chunked_prefill:
                return None
            num_new = budget
        needed = self.pool.blocks_for_tokens(num_cached + num_new) - len(cached_blocks)
        if not self.pool.can_allocate(needed, cached_blocks):
            return None
        self.waiting.remove(request)
        self.pool.touch(cached_blocks)
        fresh = self.pool.allocate(needed)
        request.block_ids = cached_blocks + fresh
        request.num_committed_blocks = len(cached_blocks)
        request.num_computed_tokens = num_cached
        if host_keys:
            out.kv_load += zip(self.host_tier.take(host_keys), fresh)
            # NOTE: the loads are queued before this step's forward, so the blocks may
            # serve other requests' prefix matches from now on.
            self.pool.commit_full_blocks(request)
        if request.num_preemptions == 0:
            request.num_cached_prompt_tokens = min(num_cached, request.num_prompt_tokens)
            self.pool.record_prefix_query(request.num_prompt_tokens, request.num_cached_prompt_tokens)
        request.status = RequestStatus.RUNNING
        self._run(request)
        out.scheduled.append(ScheduledRequest(request, num_new, num_cached))
        return num_new

    def _preempt_for(self, request: Request, out: SchedulerOutput) -> int | None:
        """Priority preemption: make room for the waiting ``request`` by preempting running
        requests it may preempt (:meth:`PriorityPolicy.may_preempt`), least urgent and latest
        first, as many as its blocks and a running slot need. Their share of this step is
        taken back; returns those tokens, or None when nothing was preempted."""
        priority = self.config.priority
        if priority is None or not priority.preemption:
            return None
        victims = []
        # NOTE: running is ordered by (urgency, arrival): the candidates are at its end.
        for running in reversed(self.running):
            if not priority.may_preempt(request, running):
                break
            victims.append(running)
        needed = self.pool.blocks_for_tokens(request.num_tokens)
        free, chosen = self.pool.num_free_blocks, []
        for victim in victims:
            if free >= needed and self._slots_used() - len(chosen) < self.config.max_num_seqs:
                break
            chosen.append(victim)
            free += sum(1 for block in victim.block_ids if self.pool.ref_count(block) == 1)
        if not chosen:
            return None
        refund = 0
        for victim in chosen:
            refund += sum(item.num_new_tokens for item in out.scheduled if item.request is victim)
            out.scheduled = [item for item in out.scheduled if item.request is not victim]
            self.running.remove(victim)
            self._offload(victim, out)
            self._preempt(victim)
            out.preempted.append(victim)
        return refund

    def _run(self, request: Request) -> None:
        """Put an admitted request into ``running`` at its place: (urgency, arrival) order."""
        priority = self.config.priority
        if priority is None:
            bisect.insort(self.running, request, key=lambda r: r.arrival_order)
        else:
            bisect.insort(self.running, request, key=lambda r: (priority.urgency(r), r.arrival_order))

    def update(self, output: SchedulerOutput, sampled: Mapping[str, int | None]) -> list[Request]:
        """Advance the requests of a finished step.

        Each scheduled request's computed count grows by its ``num_new_tokens``;
        those whose tokens are now all computed get their sampled token appended
        (``sampled[request_id]`` must be a token id for them; entries for partial
        prefill chunks are ignored). Newly full blocks join the prefix cache.
        Requests finished or aborted since :meth:`schedule` are skipped. The engine
        then checks stop conditions and calls :meth:`finish`.

        A request that verified drafts (speculative decoding) gets a list instead: its
        accepted drafts followed by the one token sampled after them. The accepted drafts'
        KV was computed this step; the rejected ones' slots are garbage, and the blocks
        past the request's tokens are freed at once.

        Returns the requests that received a token, in schedule order.
        """
        advanced = []
        for item in output.scheduled:
            request = item.request
            if request.status is not RequestStatus.RUNNING or request.num_computed_tokens != item.start_position:
                continue
            num_drafts = len(item.draft_token_ids)
            request.num_computed_tokens += item.num_new_tokens - num_drafts
            if request.num_computed_tokens == request.num_tokens:
                token = sampled.get(request.request_id)
                if token is None:
                    raise ValueError(
                        f"sampled: no token for request {request.request_id!r}, "
                        f"whose tokens were all computed this step"
                    )
                tokens = list(token) if isinstance(token, (list, tuple)) else [token]
                if not 1 <= len(tokens) <= num_drafts + 1:
                    raise ValueError(
                        f"sampled: {len(tokens)} tokens for request {request.request_id!r}, which verified "
                        f"{num_drafts} drafts (1 to {num_drafts + 1} expected)"
                    )
                for token_id in tokens:
                    request.append_output_token(token_id)
                request.num_computed_tokens += len(tokens) - 1
                # NOTE: blocks past the tokens: rejected drafts', or a drafter's that went unused.
                self._free_past_tokens(request)
                advanced.append(request)
            self.pool.commit_full_blocks(request)
        return advanced

    def _free_past_tokens(self, request: Request) -> None:
        """Free the blocks a request holds past its tokens (those its rejected drafts took, or
        a hidden-state drafter took for drafts the step then did not verify)."""
        keep = self.pool.blocks_for_tokens(request.num_tokens)
        if len(request.block_ids) > keep:
            self.pool.free(request.block_ids[keep:])
            del request.block_ids[keep:]

    # ---- helpers -------------------------------------------------------------------

    def _offload(self, request: Request, out: SchedulerOutput) -> None:
        """With a host tier, queue copies of ``request``'s committed full blocks there (those
        not stored yet), before its blocks are freed."""
        if self.host_tier is None:
            return
        for index in range(request.num_committed_blocks):
            slot = self.host_tier.store(request.block_hashes[index])
            if slot is not None:
                out.kv_offload.append((request.block_ids[index], slot))

    def _host_hits(self, request: Request, num_gpu_blocks: int) -> list:
        """The keys of ``request``'s blocks after its first ``num_gpu_blocks`` (matched in the
        GPU cache) that the host tier holds, in order up to the first miss; never the block
        of the last token (as :meth:`KVBlockPool.match_prefix`, something is left to compute).
        NOTE: ``match_prefix`` has already extended ``request.block_hashes`` that far."""
        if self.host_tier is None:
            return []
        matchable = (request.num_tokens - 1) // self.pool.block_size
        keys = []
        for key in request.block_hashes[num_gpu_blocks:matchable]:
            if key not in self.host_tier:
                break
            keys.append(key)
        return keys

    def _preempt(self, request: Request) -> None:
        self._release_blocks(request)
        request.status, request.prefilled = RequestStatus.PREEMPTED, False
        request.num_preemptions += 1
        self.num_preemptions += 1
        # NOTE: at its arrival place (the front under fcfs: it arrived before every waiting one).
        index = next((i for i, r in enumerate(self.waiting) if r.arrival_order > request.arrival_order), len(self.waiting))
        self.waiting.insert(index, request)

    def _release_blocks(self, request: Request) -> None:
        self.pool.free(request.block_ids)
        request.block_ids = []
        request.num_computed_tokens = 0
        request.num_committed_blocks = 0

    def check_invariants(self) -> None:
        """Raise AssertionError unless queues, statuses and block references agree
        (for tests: no leaked blocks, FCFS order kept)."""
        refs: dict[int, int] = {}
        for request in self.running:
            assert request.status is RequestStatus.RUNNING, f"{request} is in running"
            assert len(request.block_ids) >= self.pool.blocks_for_tokens(request.num_computed_tokens), f"{request}"
            for block in request.block_ids:
                refs[block] = refs.get(block, 0) + 1
        for request in self.waiting:
            assert request.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED), f"{request} is waiting"
            assert not request.block_ids and request.num_computed_tokens == 0, f"waiting {request} holds blocks"
        for request_id, request in self.loading.items():
            assert request.request_id == request_id and request.status is RequestStatus.WAITING_FOR_REMOTE_KV, f"{request}"
            assert request.num_computed_tokens == 0 and not request.output_token_ids, f"loading {request} computed"
            assert len(request.block_ids) >= self.pool.blocks_for_tokens(request.num_prompt_tokens), f"{request}"
            for block in request.block_ids:
                refs[block] = refs.get(block, 0) + 1
        waiting = [r.arrival_order for r in self.waiting]
        assert waiting == sorted(waiting), f"waiting queue out of arrival order: {waiting}"
        priority = self.config.priority
        key = (lambda r: r.arrival_order) if priority is None else (lambda r: (priority.urgency(r), r.arrival_order))
        running = [key(r) for r in self.running]
        assert running == sorted(running), f"running out of (urgency, arrival) order: {running}"
        if self.config.policy == "fcfs" and priority is None:
            # NOTE: a prefilled request held its slot from admission, while it loaded: a request
            # preempted meanwhile may wait behind it.
            order = [r.arrival_order for r in self.running if not r.prefilled] + waiting
            assert order == sorted(order), f"fcfs: queues out of arrival order: {order}"
        assert self._slots_used() <= self.config.max_num_seqs
        live = {r.request_id for r in self.running} | {r.request_id for r in self.waiting} | set(self.loading)
        assert set(self._requests) == live and len(live) == len(self.running) + len(self.waiting) + len(self.loading)
        assert not set(self._draining) & set(self._requests), "a live request id is draining"
        for blocks in [*self._held.values(), *self._draining.values()]:
            for block in blocks:
                refs[block] = refs.get(block, 0) + 1
        self.pool.check_invariants(refs)
        if self.host_tier is not None:
            self.host_tier.check_invariants()
