"""Overlap scheduling: queue step N+1 on the device before step N's tokens reach the host.

Without overlap a step is: schedule, build inputs, plan attention, launch the forward,
wait for the sampled tokens, update. The device idles while the host does everything but
the wait (~0.4-0.6 ms a step on an H200 at batch 1, ~10% of a Llama-3.1-8B decode step).
With overlap (SGLang's default; ``--disable-overlap-schedule`` turns it off) the engine:

1. schedules step N+1 while step N still runs: each request that sampled in step N holds
   a placeholder token (:data:`PENDING_TOKEN`) where its new token goes, so positions,
   slots and block allocation are already right;
2. launches step N+1, its placeholder input ids filled ON THE DEVICE from step N's
   sampled ids (:class:`TokenFeed`);
3. only then waits for step N's tokens (:meth:`InflightStep.resolve`), writes them over
   the placeholders and runs the stop checks, which may finish requests step N+1 is
   computing: their row of step N+1 is wasted and dropped (the scheduler skips finished
   requests in ``update``; the KV blocks they free are rewritten only by later steps,
   queued after step N+1 on the same stream).

A step whose inputs cannot be fed that way runs after step N resolves (:func:`can_feed`):
a pending token inside a prefill chunk (a preempted request recomputed), penalties
(they read the token history on the host), or a request whose KV blocks outlive it. When
every request of step N reaches ``max_tokens`` with it (the end of a batch-1 stream), step
N resolves before anything is scheduled, so no whole step is computed for nothing.
When step N holds a constrained request (``SamplingParams.guided``), step N also resolves
before step N+1 is scheduled: the request's next token mask depends on its token in flight.

NOTE: placeholders never reach the prefix cache: a full block is committed when its
tokens are computed, which happens one step after the token is written, and step N+1's
``update`` runs after step N's tokens were written over the placeholders.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Collection, Sequence

import torch

from flotilla.cluster.engine.request import Request
from flotilla.cluster.engine.sampler import SampledBatch, SampledToken, SamplingRow

# The token id a request holds while its sampled token is still on the device.
PENDING_TOKEN = -1


@dataclass
class TokenFeed:
    """A launched step's sampled ids, still on the device, for the next step's inputs.

    Attributes:
        token_ids: ``[N]`` int64 on the device: row ``i`` is the token of the ``i``-th
            sampling request of the step.
        rows: request id -> its row in ``token_ids``.
    """

    token_ids: torch.Tensor
    rows: dict[str, int]

    def gather_plan(self, step: Any) -> tuple[list[int], list[int]]:
        """``(dst, src)``: the flat input rows of ``step`` that hold a pending token and the
        rows of :attr:`token_ids` that fill them. ValueError when a pending token is not
        a one-token decode (the caller should have resolved the previous step first)."""
        dst: list[int] = []
        src: list[int] = []
        offset = 0
        for item in step.scheduled:
            request, start, count = item.request, item.start_position, item.num_new_tokens
            if PENDING_TOKEN in request.all_token_ids[start : start + count]:
                row = self.rows.get(request.request_id)
                if count != 1 or row is None:
                    raise ValueError(
                        f"request {request.request_id!r} has a pending token in a {count}-token chunk at position "
                        f"{start}; resolve the previous step before preparing this one"
                    )
                dst.append(offset)
                src.append(row)
            offset += count
        return dst, src


@dataclass
class InflightStep:
    """A launched step whose sampled tokens have not reached the host yet.

    Attributes:
        batch: the step's :class:`SampledBatch` (None when no request sampled).
        feed: its ids for the next step's pending inputs.
        requests: the requests that got a placeholder, with the placeholder's index in
            ``all_token_ids`` and in ``output_token_ids``.
    """

    batch: SampledBatch | None
    feed: TokenFeed | None
    requests: list[tuple[Request, int, int]]

    @classmethod
    def launched(cls, batch: SampledBatch | None, sampling: Sequence[Request], advanced: Sequence[Request]) -> "InflightStep":
        """The step after ``scheduler.update`` gave each of ``advanced`` a :data:`PENDING_TOKEN`;
        ``sampling`` are the step's sampling requests in row order."""
        rows = {request.request_id: i for i, request in enumerate(sampling)}
        feed = TokenFeed(batch.token_ids, rows) if batch is not None else None
        pending = [(r, len(r.all_token_ids) - 1, len(r.output_token_ids) - 1) for r in advanced]
        return cls(batch, feed, pending)

    def all_reach_max_tokens(self) -> bool:
        """Whether every request that sampled in this step ends with its pending token (its
        ``max_tokens``): then nothing is worth launching before it resolves."""
        return bool(self.requests) and all(request.reached_max_tokens for request, _, _ in self.requests)

    def resolve(self) -> list[tuple[Request, SampledToken]]:
        """Wait for the tokens, write them over the placeholders and return each request
        that got one with its token (aborted requests included: the caller skips them)."""
        if self.batch is None:
            return []
        tokens = self.batch.resolve()
        out = []
        for request, token_index, output_index in self.requests:
            token = tokens[self.feed.rows[request.request_id]]
            request.all_token_ids[token_index] = token.token_id
            request.output_token_ids[output_index] = token.token_id
            out.append((request, token))
        return out


def can_feed(step: Any, inflight: InflightStep, rows: Sequence[SamplingRow], holds_kv: Collection[str]) -> bool:
    """Whether ``step`` may launch before ``inflight`` resolves (see the module docstring)."""
    if inflight.feed is None:
        return True
    if any(row.params.has_penalties for row in rows):
        return False
    # NOTE: a worker group's batch (GroupBatch) knows whether its ids can feed this step's rows.
    can_feed_rows = getattr(inflight.batch, "can_feed_rows", None)
    if can_feed_rows is not None and not can_feed_rows(rows):
        return False
    for item in step.scheduled:
        request = item.request
        if request.request_id in holds_kv:
            return False
        if item.num_new_tokens != 1 and PENDING_TOKEN in request.all_token_ids[item.start_position :]:
            return False
    return True
