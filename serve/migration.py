"""Request migration: a stream whose engine replica stopped goes on at a live replica.

The ingress streams every request through :func:`migrating` (``--migration-limit``, Dynamo's
name; default 1, 0: off). When the replica serving a request is lost mid-stream (its actor
died, its engine died, it shut down: a :class:`~flotilla.serve.types.ReplicaLostError`, or a
last chunk with ``replica_failed``), the request is sent again with
``resumed_token_ids``: the tokens the client has already been sent. The replica that takes
it computes them with the prompt as the request's first outputs
(:meth:`~flotilla.cluster.engine.llm_engine.LLMEngine.add_request`) and streams the tokens
that follow, so the client reads one stream: a greedy request continues exactly as it
would have. A seeded request's generator starts again from its seed at the cut, so its
continuation is seeded but not the undisturbed one's (documented in docs/serving.md).

What is not migrated (the error reaches the client as before): requests with ``n > 1``
(their completions diverged; one prompt cannot resume them all), a request whose replica
failed it for the request's own sake (bad input, a grammar), and a request out of
migrations. A migration waits up to :data:`MIGRATION_WAIT_S` for a live replica to take
the request (Serve replaces a dead replica in ~10-15 s with the embedded model on 2 cores):
a resubmission refused because no replica is live is retried with back-off until then.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from typing import AsyncIterator, Callable

from flotilla.serve.types import GenerateChunk, GenerateRequest, ReplicaLostError

logger = logging.getLogger(__name__)

# The longest a migration waits for a replica to take the request (all of its resubmissions
# together), and the back-off between resubmissions refused because no replica is live.
MIGRATION_WAIT_S = 60.0
RETRY_BACKOFF_S = (0.25, 0.5, 1.0, 2.0)


def can_migrate(request: GenerateRequest) -> bool:
    """Whether a cut stream of ``request`` can resume elsewhere: one completion that
    generates tokens (an embedding request is simply sent again)."""
    return request.params.n == 1


async def migrating(
    generate: Callable[[GenerateRequest], AsyncIterator[GenerateChunk]],
    request: GenerateRequest,
    limit: int,
    wait_s: float = MIGRATION_WAIT_S,
    clock: Callable[[], float] = time.monotonic,
    on_migrate: Callable[[], None] | None = None,
) -> AsyncIterator[GenerateChunk]:
    """The chunks of ``request`` as ``generate`` streams them, migrated up to ``limit`` times
    when the replica streaming it is lost (see the module docstring). The chunks the client
    gets add up to one stream: a cut stream's last chunk gives its tokens without its error.
    (The finished chunk's usage counts every completion token: the engine counts the resumed
    ones among the request's outputs.)
    ``on_migrate`` is called at each migration (the ingress counts them)."""
    if limit <= 0 or not can_migrate(request):
        async with contextlib.aclosing(generate(request)) as chunks:
            async for chunk in chunks:
                yield chunk
        return
    streamed: list[int] = []
    migrations = 0
    current = request
    deadline: float | None = None  # NOTE: set from a cut until a replica takes the request
    attempt = 0
    while True:
        started = False
        try:
            async with contextlib.aclosing(generate(current)) as chunks:
                while (chunk := await _next_within(chunks, None if deadline is None else deadline - clock())) is not None:
                    started, deadline = True, None
                    streamed.extend(t for c in chunk.completions if c.index == 0 for t in c.token_ids)
                    # NOTE: a completion the lost replica had finished itself is not cut.
                    cut_short = chunk.replica_failed and any(c.finish_reason == "error" for c in chunk.completions)
                    if not (cut_short and migrations < limit):
                        yield chunk
                        continue
                    cut = _without_end(chunk)
                    if cut is not None:
                        yield cut
                    raise ReplicaLostError(chunk.error or "the engine replica failed the request")
            return
        except ReplicaLostError as exc:
            if started or deadline is None:
                # NOTE: a running stream was cut (or the first submission met a lost replica).
                if migrations >= limit:
                    raise
                migrations, deadline, attempt = migrations + 1, clock() + wait_s, 0
                if on_migrate is not None:
                    on_migrate()
                logger.warning(
                    "request %s lost its engine replica after %d tokens (%s); migrating it (%d of %d)",
                    request.request_id, len(streamed), exc, migrations, limit,
                )  # fmt: skip
            elif isinstance(exc, _NoReplicaInTime) or clock() >= deadline:
                raise ReplicaLostError(
                    f"request {request.request_id} found no live engine replica within {wait_s:g} s of losing "
                    f"its own ({exc}); retry the request"
                ) from None
            else:
                await asyncio.sleep(RETRY_BACKOFF_S[min(attempt, len(RETRY_BACKOFF_S) - 1)])
                attempt += 1
            current = dataclasses.replace(request, resumed_token_ids=tuple(streamed), group_id=None, group_size=1)


class _NoReplicaInTime(ReplicaLostError):
    """A migrated request no replica took before its migration's deadline."""


async def _next_within(chunks: AsyncIterator[GenerateChunk], timeout_s: float | None) -> GenerateChunk | None:
    """The stream's next chunk (None at its end), within ``timeout_s`` when given: Serve holds a
    call while the deployment has no live replica (the only one died), so a migrated request's
    wait for its first chunk needs a bound of its own."""
    try:
        if timeout_s is None:
            return await anext(chunks)
        return await asyncio.wait_for(anext(chunks), max(timeout_s, 0.0))
    except StopAsyncIteration:
        return None
    except asyncio.TimeoutError:
        raise _NoReplicaInTime("no engine replica took it") from None


def _without_end(chunk: GenerateChunk) -> GenerateChunk | None:
    """A cut stream's last chunk as an ordinary one (its tokens, no finish, no error), or None
    when it carries no tokens."""
    completions = [dataclasses.replace(c, finish_reason=None, stop_reason=None) for c in chunk.completions if c.token_ids]
    if not completions:
        return None
    return dataclasses.replace(chunk, completions=completions, finished=False, error=None, replica_failed=False)
