"""The ingress's PD client (:class:`PDEngineClient`) over fake deployment handles: no Ray,
no model.

The fake handles keep what the real path depends on: a call is awaitable (or async-iterable
when streamed) and cancellable, and each call remembers the request it was made for, read
from a context variable at call time, as Ray remembers the task that submitted an actor
call. Cancelling a request cancels every call made in its context, as the proxy's recursive
``ray.cancel`` does when an HTTP client leaves. Every wait is bounded.
"""

from __future__ import annotations

import asyncio
import contextvars
import time

import pytest

import flotilla.serve.pd as pd_module
from flotilla.cluster.engine.sampling_params import SamplingParams
from flotilla.serve.pd import PDEngineClient
from flotilla.cluster.engine.kv_contract import PrefillTicket
from flotilla.serve.types import CompletionChunk, EngineUnavailableError, GenerateChunk, GenerateRequest

WAIT_S = 5.0
# The request a call is made for (None: made outside any request), as Ray's task context.
REQUEST: contextvars.ContextVar[str | None] = contextvars.ContextVar("request", default=None)


class Call:
    """One call: awaits (or iterates) ``body``; remembers the request it was made in. A
    result takes ``transit_s`` to come back once the replica has it; cancelling the call
    then loses the result, though the replica did the work (as Serve's
    ``DeploymentResponse.cancel``: "the request may actually have run to completion", and
    awaiting it raises)."""

    def __init__(self, calls: list, method: str, body, stream: bool, transit_s: float = 0.0):
        self.method, self.request, self.cancelled = method, REQUEST.get(), False
        self._work = asyncio.ensure_future(body) if not stream else None
        self._task = asyncio.ensure_future(self._deliver(transit_s)) if not stream else None
        self._gen = body if stream else None
        calls.append(self)

    async def _deliver(self, transit_s: float):
        result = await self._work
        await asyncio.sleep(transit_s)
        return result

    def __await__(self):
        return self._task.__await__()

    def __aiter__(self):
        return self._gen.__aiter__()

    def cancel(self):
        self.cancelled = True
        if self._work is not None and not self._work.done():
            self._work.cancel()
        if self._task is not None:
            self._task.cancel()


class Handle:
    """A deployment handle whose methods are the given async functions (async generators
    for streamed methods)."""

    def __init__(self, calls: list, transit_s: dict | None = None, **methods):
        self.calls, self.methods = calls, methods
        self.transit_s = {} if transit_s is None else transit_s

    def options(self, method_name: str, stream: bool = False):
        handle = self

        class Method:
            def remote(self, *args):
                body = handle.methods[method_name](*args)
                return Call(handle.calls, method_name, body, stream, handle.transit_s.get(method_name, 0.0))

        return Method()


def cancel_request(calls: list, request: str) -> None:
    """What the proxy's recursive ``ray.cancel`` does when the client of ``request`` leaves."""
    for c in calls:
        if c.request == request:
            c.cancel()


def request(request_id="r", max_tokens=4) -> GenerateRequest:
    return GenerateRequest(request_id, [1, 2, 3], SamplingParams(temperature=0, max_tokens=max_tokens), time.time())


def ticket(req: GenerateRequest) -> PrefillTicket:
    chunk = GenerateChunk(req.request_id, [CompletionChunk(0, [7], "x")])
    return PrefillTicket(
        request_id=req.request_id, prefill_request_id=f"{req.request_id}~0", prompt_token_ids=req.prompt_token_ids,
        first_token=7, block_ids=[0], finish_reason="length", replica_id="p0", peer_id="peer", peer_metadata=[],
        lease_s=30.0, chunk=chunk,
    )  # fmt: skip


def chunk(req: GenerateRequest, token: int, finished=False) -> GenerateChunk:
    completion = CompletionChunk(0, [token], "y", finish_reason="length" if finished else None)
    return GenerateChunk(req.request_id, [completion], finished=finished)


class Pools:
    """A prefill and a decode fake, with switches for the tests."""

    def __init__(self):
        self.calls: list[Call] = []
        self.released: list[str] = []
        self.transit_s: dict[str, float] = {}
        self.prefill_healthy = True  # False: its health call hangs (no replica to route to)
        self.prefill_hangs = False
        self.decode_whole: list[str] = []

        async def prefill(req):
            if self.prefill_hangs:
                await asyncio.sleep(3600)
            return ticket(req)

        async def release_kv(pin, prefill_request_id):
            await asyncio.sleep(0.05)
            self.released.append(prefill_request_id)
            return True

        async def prefill_health():
            if not self.prefill_healthy:
                await asyncio.sleep(3600)
            return {"healthy": True, "reason": None}

        async def decode_health():
            return {"healthy": True, "reason": None}

        async def generate_prefilled(req, t):
            yield chunk(req, t.first_token)
            await asyncio.sleep(0.05)
            yield chunk(req, 8, finished=True)

        async def generate(req):
            self.decode_whole.append(req.request_id)
            yield chunk(req, 9, finished=True)

        self.prefill = Handle(self.calls, self.transit_s, prefill=prefill, release_kv=release_kv, health=prefill_health)
        self.decode = Handle(
            self.calls, generate_prefilled=generate_prefilled, generate=generate, health=decode_health
        )

    def client(self, policy="recompute") -> PDEngineClient:
        return PDEngineClient(self.prefill, self.decode, policy)


@pytest.fixture(autouse=True)
def fast_probes(monkeypatch):
    monkeypatch.setattr(pd_module, "PROBE_INTERVAL_S", 0.05)
    monkeypatch.setattr(pd_module, "PROBE_TIMEOUT_S", 0.2)


async def until(predicate, what: str, timeout_s: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.01)


async def consume_in_request(client: PDEngineClient, req: GenerateRequest, first_only: bool) -> list[GenerateChunk]:
    """Run ``client.generate`` as the ingress does for one HTTP request (its own task, with
    the request's context); with ``first_only`` the client leaves after the first chunk."""
    REQUEST.set(req.request_id)
    stream = client.generate(req)
    chunks = []
    try:
        async for c in stream:
            chunks.append(c)
            if first_only:
                break
    finally:
        await stream.aclose()
    return chunks


def test_a_client_that_leaves_after_the_first_chunk_still_releases_the_prefill_blocks():
    pools = Pools()

    async def main():
        client = pools.client()
        req = request("leaves")
        task = asyncio.ensure_future(consume_in_request(client, req, first_only=True))
        chunks = await asyncio.wait_for(task, WAIT_S)
        # NOTE: the client is gone: the proxy cancels everything its request submitted.
        cancel_request(pools.calls, "leaves")
        await until(lambda: pools.released, "the release")
        return chunks

    chunks = asyncio.run(main())
    assert chunks[0].completions[0].token_ids == [7]
    assert chunks[0].prefill_replica_id == "p0"  # NOTE: the access log names the prefill replica
    assert pools.released == ["leaves~0"]
    release = next(c for c in pools.calls if c.method == "release_kv")
    assert release.request is None and not release.cancelled


def test_a_ticket_that_arrives_after_its_caller_left_is_released():
    pools = Pools()
    pools.transit_s["prefill"] = 0.3

    async def main():
        client = pools.client()
        task = asyncio.ensure_future(consume_in_request(client, request("gone"), first_only=False))
        await asyncio.sleep(0.1)  # NOTE: the prefill has finished; its ticket is on its way back
        # NOTE: the proxy's cancel must not reach the prefill call: cancelled now, its ticket
        # (and the blocks the replica holds for it) would be lost until the lease ends.
        cancel_request(pools.calls, "gone")
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await until(lambda: pools.released, "the late ticket's release")

    asyncio.run(main())
    assert pools.released == ["gone~0"]
    assert not next(c for c in pools.calls if c.method == "prefill").cancelled
    assert [c.method for c in pools.calls if c.method in ("generate", "generate_prefilled")] == []


def test_while_the_prefill_pool_is_down_requests_run_whole_on_decode():
    pools = Pools()

    async def main():
        client = pools.client()
        assert (await client.health())["status"] == "ok"
        pools.prefill_healthy = False
        await until(lambda: not client.pools["prefill"].healthy, "the prefill pool to be seen down")
        started = time.monotonic()
        report = await client.health()
        took = time.monotonic() - started
        chunks = await asyncio.wait_for(consume_in_request(client, request("whole"), first_only=False), WAIT_S)
        fail = pools.client("fail")
        await fail.health()
        await until(lambda: not fail.pools["prefill"].healthy, "the fail client's prefill pool to be seen down")
        with pytest.raises(EngineUnavailableError, match="prefill pool has no healthy replica.*kv_load_failure_policy='fail'"):
            await consume_in_request(fail, request("refused"), first_only=False)
        fail_report = await fail.health()
        pools.prefill_healthy = True
        await until(lambda: client.pools["prefill"].healthy, "the prefill pool to be back")
        again = await asyncio.wait_for(consume_in_request(client, request("pd-again"), first_only=False), WAIT_S)
        return report, took, chunks, fail_report, again

    report, took, chunks, fail_report, again = asyncio.run(main())
    assert report["status"] == "degraded" and took < 1.0
    assert report["pools"]["prefill"]["healthy"] is False and "no replica answered" in report["pools"]["prefill"]["reason"]
    assert report["pools"]["decode"]["healthy"] is True
    assert pools.decode_whole == ["whole"] and chunks[-1].completions[0].token_ids == [9]
    assert fail_report["status"] == "down"
    assert [c.completions[0].token_ids for c in again] == [[7], [8]]


def test_a_prefill_waiting_when_its_pool_goes_down_is_sent_whole_to_decode():
    pools = Pools()
    pools.prefill_hangs = True  # NOTE: as a call waiting for a replica that is gone

    async def main():
        client = pools.client()
        await client.health()
        task = asyncio.ensure_future(consume_in_request(client, request("stuck"), first_only=False))
        await asyncio.sleep(0.2)
        assert not task.done()
        pools.prefill_healthy = False
        return await asyncio.wait_for(task, WAIT_S)

    chunks = asyncio.run(main())
    assert pools.decode_whole == ["stuck"] and chunks[-1].finished
    prefill = next(c for c in pools.calls if c.method == "prefill")
    assert prefill.cancelled


def test_an_embedding_request_runs_whole_on_decode_without_a_prefill():
    """An embedding ends where its prompt does: nothing to hand off, no prefill call."""
    pools = Pools()
    embed = GenerateRequest("embed", [1, 2, 3], SamplingParams(max_tokens=1, pooling="last"), time.time())

    async def main():
        return await asyncio.wait_for(consume_in_request(pools.client(), embed, first_only=False), WAIT_S)

    chunks = asyncio.run(main())
    assert pools.decode_whole == ["embed"] and chunks[-1].finished
    assert not [c for c in pools.calls if c.method == "prefill"]
