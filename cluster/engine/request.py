"""One generation request as the scheduler and the KV block pool see it.

A request is "tokens computed so far": there are no prefill and decode phases.
Its tokens are the prompt followed by the tokens sampled so far
(:attr:`Request.all_token_ids`); ``num_computed_tokens`` of them have their K/V in
the cache. Each step the scheduler hands it a number of new tokens to compute;
when the computed count reaches :attr:`Request.num_tokens`, the step samples one
more token, and the request needs exactly one new token per step from then on
(a decode), until it finishes or is preempted.

Pure Python: no torch.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any


class RequestStatus(enum.Enum):
    """Where a request is in its life."""

    WAITING = "waiting"  # queued, holds no blocks
    # admitted with its prompt's KV computed elsewhere: holds its blocks and a running slot
    # while a read fills them, is not scheduled; joins running once the read completes
    WAITING_FOR_REMOTE_KV = "waiting_for_remote_kv"
    RUNNING = "running"  # admitted, holds blocks, scheduled every step
    PREEMPTED = "preempted"  # evicted for blocks; queued again, holds no blocks, keeps its outputs
    FINISHED_STOPPED = "finished_stopped"  # stop token / stop string
    FINISHED_LENGTH = "finished_length"  # max_tokens (or the context) reached
    FINISHED_ABORTED = "finished_aborted"  # cancelled by the client or the engine

    @property
    def is_finished(self) -> bool:
        return self in _FINISH_REASONS


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}


@dataclass(eq=False)
class Request:
    """A request's tokens and its cache bookkeeping.

    Compared by identity. Build it with the prompt and the output budget; the
    scheduler owns every other field.

    Attributes:
        request_id: unique among the scheduler's live requests.
        prompt_token_ids: the prompt, at least one token.
        max_tokens: the most tokens to sample (at least 1). The scheduler never
            stops a request by itself; the engine checks this (see
            :attr:`reached_max_tokens`) together with its stop conditions and
            calls ``Scheduler.finish``.
        sampling_params: opaque to the scheduler; the engine keeps its
            ``SamplingParams`` (or anything else) here.
        arrival_time: ``time.monotonic()`` at creation, for latency metrics.
        arrival_order: FCFS rank, assigned by ``Scheduler.add`` (-1 before).
        priority: the request's priority (``--enable-priority-scheduling``; larger is more
            urgent unless the scheduler's priority policy says otherwise); 0 by default.
        output_token_ids: tokens sampled so far.
        all_token_ids: prompt followed by outputs (kept as one list, appended in place).
        num_computed_tokens: leading tokens of ``all_token_ids`` whose K/V is in the cache.
        block_ids: cache blocks holding this request's tokens, in position order
            (block ``i`` holds tokens ``i*block_size .. (i+1)*block_size-1``).
        block_hashes: prefix-cache keys of this request's full blocks, computed
            lazily by the block pool; content keys, so they survive preemption.
        num_committed_blocks: leading entries of ``block_ids`` already offered to
            the prefix cache.
        num_cached_prompt_tokens: prompt tokens found in the prefix cache at first
            admission (OpenAI usage ``cached_tokens``).
        num_preemptions: how often the request lost its blocks.
        prefilled: its prompt's KV came from another engine (``Scheduler.admit_prefilled``;
            reset when that failed or it was preempted: it computes its tokens here).
        status: see :class:`RequestStatus`.
        draft_token_ids: speculative decoding: the tokens proposed to follow ``all_token_ids``
            for the next step (set by the engine before it schedules; the scheduler verifies
            as many as the step has room for, see :class:`~flotilla.cluster.engine.scheduler.ScheduledRequest`).
    """

    request_id: str
    prompt_token_ids: list[int]
    max_tokens: int
    sampling_params: Any = None
    arrival_time: float = field(default_factory=time.monotonic)
    arrival_order: int = -1
    priority: int = 0
    # Computes every prompt token (no prefix-cache hit): a mean-pooled embedding needs each
    # position's hidden state, which a cached block does not hold.
    skip_prefix_cache: bool = False
    output_token_ids: list[int] = field(default_factory=list, init=False)
    all_token_ids: list[int] = field(default_factory=list, init=False)
    num_computed_tokens: int = field(default=0, init=False)
    block_ids: list[int] = field(default_factory=list, init=False)
    block_hashes: list[Any] = field(default_factory=list, init=False)
    num_committed_blocks: int = field(default=0, init=False)
    num_cached_prompt_tokens: int = field(default=0, init=False)
    num_preemptions: int = field(default=0, init=False)
    prefilled: bool = field(default=False, init=False)
    status: RequestStatus = field(default=RequestStatus.WAITING, init=False)
    draft_token_ids: list[int] = field(default_factory=list, init=False)

    def __post_init__(self) -> None:
        self.prompt_token_ids = list(self.prompt_token_ids)
        if not self.prompt_token_ids:
            raise ValueError(
                f"prompt_token_ids: request {self.request_id!r} has an empty prompt; give at least one token"
            )
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1 (got max_tokens={self.max_tokens!r})")
        self.all_token_ids = list(self.prompt_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        """Prompt plus outputs: the length the cache must reach before the next sample."""
        return len(self.all_token_ids)

    @property
    def num_tokens_to_compute(self) -> int:
        """Tokens not yet in the cache (1 for a decode)."""
        return len(self.all_token_ids) - self.num_computed_tokens

    @property
    def reached_max_tokens(self) -> bool:
        return len(self.output_token_ids) >= self.max_tokens

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def finish_reason(self) -> str | None:
        """OpenAI's spelling: ``"stop"``, ``"length"``, ``"abort"``, or None while live."""
        return _FINISH_REASONS.get(self.status)

    def append_output_token(self, token_id: int) -> None:
        """Record a sampled token (its K/V is computed by the next step)."""
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.name}, prompt={self.num_prompt_tokens}, "
            f"outputs={self.num_output_tokens}, computed={self.num_computed_tokens}, blocks={len(self.block_ids)})"
        )
