"""The graceful drain without Ray (flotilla.serve.drain and the ingress's side of it): a
draining ingress answers new requests 503 with ``Retry-After``, lets a stream in flight finish,
ends one still running at the deadline with an error frame and ``[DONE]``; the board counts
the ingress replicas' in-flight requests and forgets a silent one. The live drain of a
``flotilla serve`` process is tests/serve/test_graceful_drain_live.py."""

import asyncio
import json
import time

import httpx
import pytest

from flotilla.serve.drain import STALE_REPORT_S, DrainBoard, DrainState
from flotilla.serve.ingress import create_app
from flotilla.serve.types import CompletionChunk, GenerateChunk, ServeOptions
from helpers.resolution_configs import default_cpu_config

MODEL = "smollm2"
BODY = {"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 4}
REASON = "flotilla serve got SIGTERM"
# Bound on every wait below (they take milliseconds).
WAIT_S = 10


class GatedEngine:
    """An EngineClient that streams one chunk, then waits for ``gate`` before the last."""

    def __init__(self):
        self.gate, self.started, self.closed = asyncio.Event(), asyncio.Event(), 0

    async def generate(self, request):
        try:
            yield GenerateChunk(request.request_id, [CompletionChunk(0, [5], "a")])
            self.started.set()
            await self.gate.wait()
            yield GenerateChunk(request.request_id, [CompletionChunk(0, [6], "b", finish_reason="length")], True, 3, 2)
        finally:
            self.closed += 1

    async def is_healthy(self):
        return True

    async def metrics_text(self):
        return ""


def app_over(engine):
    app = create_app(engine, None, ServeOptions(served_model_name=MODEL), default_cpu_config())
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://flotilla.test")
    return app.state.ingress.drain, http


def frames(text):
    return [f[len("data: ") :] for f in text.split("\n\n") if f]


def drain_state(timeout_s):
    return DrainState(reason=REASON, deadline=time.time() + timeout_s, timeout_s=timeout_s)


def test_a_draining_ingress_refuses_new_requests_with_503_and_retry_after():
    async def main():
        engine = GatedEngine()
        watch, http = app_over(engine)
        assert (await http.get("/health")).status_code == 200
        watch.begin(drain_state(30))
        for refused in (await http.post("/v1/completions", json=BODY), await http.get("/health")):
            assert refused.status_code == 503, refused.text
            # NOTE: 30 s drain, read a moment later: 29 or 30 (rounded up).
            assert refused.headers["retry-after"] in ("29", "30") and refused.headers["connection"] == "close"
            error = refused.json()["error"]
            assert error["code"] == "server_shutting_down" and REASON in error["message"], error
        assert (await http.get("/metrics")).status_code == 200  # scrapes go on while draining
        assert engine.closed == 0  # nothing reached the engine
        assert watch.in_flight == 0

    asyncio.run(main())


def test_a_stream_in_flight_finishes_during_the_drain():
    async def main():
        engine = GatedEngine()
        watch, http = app_over(engine)
        request = asyncio.create_task(http.post("/v1/completions", json={**BODY, "stream": True}))
        await asyncio.wait_for(engine.started.wait(), WAIT_S)
        assert watch.in_flight == 1
        watch.begin(drain_state(30))
        engine.gate.set()
        response = await asyncio.wait_for(request, WAIT_S)
        assert response.status_code == 200
        sent = frames(response.text)
        texts = [c["text"] for f in sent[:-1] for c in json.loads(f)["choices"]]
        assert "".join(texts) == "ab" and json.loads(sent[-2])["choices"][0]["finish_reason"] == "length"
        assert sent[-1] == "[DONE]" and watch.in_flight == 0

    asyncio.run(main())


@pytest.mark.parametrize("stream", [True, False])
def test_the_deadline_ends_what_still_runs_with_an_error(stream):
    async def main():
        engine = GatedEngine()  # NOTE: its gate never opens: the request runs until cut
        watch, http = app_over(engine)
        request = asyncio.create_task(http.post("/v1/completions", json={**BODY, "stream": stream}))
        await asyncio.wait_for(engine.started.wait(), WAIT_S)
        watch.begin(drain_state(0.2))
        response = await asyncio.wait_for(request, WAIT_S)
        if stream:  # the first chunk went out: an error frame, then [DONE]
            assert response.status_code == 200
            sent = frames(response.text)
            assert json.loads(sent[0])["choices"][0]["text"] == "a"
            error = json.loads(sent[1])["error"]
            assert sent[2:] == ["[DONE]"]
        else:  # nothing sent yet: a 503
            assert response.status_code == 503
            error = response.json()["error"]
        assert error["code"] == "server_shutting_down" and "--shutdown-timeout 0.2 s" in error["message"], error
        assert engine.closed == 1 and watch.in_flight == 0  # the engine stream was closed (aborted)

    asyncio.run(main())


def test_the_board_counts_in_flight_requests_and_forgets_a_silent_watch():
    now = [1000.0]

    async def main():
        board = DrainBoard(clock=lambda: now[0])
        assert await board.wait_for_drain("a", timeout_s=0.01) is None  # no drain yet
        waiting = asyncio.create_task(board.wait_for_drain("b", timeout_s=WAIT_S))
        await asyncio.sleep(0)
        state = board.begin(REASON, 30)
        assert await asyncio.wait_for(waiting, WAIT_S) == state
        assert board.begin("again", 5) == state  # one drain
        assert board.in_flight() == {"a": None, "b": None}  # not reported since it began
        board.report("a", 3)
        board.report("b", 0)
        assert board.in_flight() == {"a": 3, "b": 0}
        now[0] += STALE_REPORT_S / 2
        board.report("b", 0)
        now[0] += STALE_REPORT_S * 0.75
        assert board.in_flight() == {"b": 0}  # a went silent: its replica is gone

    asyncio.run(main())


def test_retry_after_is_the_time_left_and_at_least_one_second():
    state = DrainState(reason=REASON, deadline=100.0, timeout_s=30.0)
    assert state.retry_after_s(now=70.0) == 30
    assert state.retry_after_s(now=99.5) == 1 and state.retry_after_s(now=120.0) == 1
