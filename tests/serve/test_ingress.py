"""The OpenAI ingress, driven by the official ``openai`` client over httpx's ASGI transport,
against a real in-process engine (AsyncEngine over SmolLM2-135M-Instruct): chat,
completions (string, list of strings, token ids), streaming with usage, n=2, logprobs,
stop strings, seeds, cached tokens, the bad-input list of issue 5 (each followed by a good
request), the API key, and a client that disconnects mid-stream. A stub engine covers the
engine's refusals and failures (429, 503, an error frame mid-stream).

Generations are greedy and short (2-core CI: SmolLM2 decodes ~20 tokens/s at batch 1).
"""

import asyncio
import json
import logging
import time
from types import SimpleNamespace

import httpx
import openai
import pytest

from flotilla.cluster.engine.llm import LLM
from flotilla.serve.async_engine import AsyncEngine
from flotilla.serve.ingress import create_app
from flotilla.serve.metrics import merge_expositions
from flotilla.serve.types import (
    CompletionChunk,
    EngineOverloadedError,
    EngineUnavailableError,
    GenerateChunk,
    ServeOptions,
)
from helpers.resolution_configs import default_cpu_config

MODEL = "smollm2"
BODY_LIMIT = 64 * 1024
FRANCE = [{"role": "user", "content": "What is the capital of France?"}]
GOOD = dict(model=MODEL, prompt="Hello", max_tokens=1, temperature=0)
# The engine replica id of the served fixture (the access log names it).
ENGINE_REPLICA = "engine-test-1"


@pytest.fixture(scope="module")
def served():
    llm = LLM(max_total_tokens=4096)
    engine = AsyncEngine(llm.engine, replica_id=ENGINE_REPLICA)
    options = ServeOptions(served_model_name=MODEL, max_body_bytes=BODY_LIMIT)
    app = create_app(engine, llm.tokenizer, options, llm.config)
    yield SimpleNamespace(llm=llm, engine=engine, app=app, tokenizer=llm.tokenizer)
    engine.shutdown()


def run(make_coro):
    return asyncio.run(make_coro())


def clients(app, api_key: str = "unused"):
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://flotilla.test")
    api = openai.AsyncOpenAI(api_key=api_key, base_url="http://flotilla.test/v1", http_client=http, max_retries=0)
    return http, api


def assert_envelope(response: httpx.Response, status: int, param=None):
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["message"]
    if param is not None:
        assert body["error"]["param"] == param, body
    return body["error"]


async def good_request(api):
    out = await api.completions.create(**GOOD)
    assert out.choices[0].finish_reason == "length" and out.usage.completion_tokens == 1


# -- the real model -------------------------------------------------------------------------


def test_chat_answers_paris_streamed_or_not(served):
    """Greedy chat, non-streaming then streaming with usage: same text, "Paris" in it, the
    request id echoed, and the second request's prompt served from the prefix cache."""

    async def main():
        http, api = clients(served.app)
        raw = await api.chat.completions.with_raw_response.create(
            model=MODEL, messages=FRANCE, max_tokens=12, temperature=0, extra_headers={"X-Request-Id": "req-42"}
        )
        assert raw.headers["x-request-id"] == "req-42"
        reply = raw.parse()
        assert reply.id == "chatcmpl-req-42" and reply.object == "chat.completion" and reply.model == MODEL
        (choice,) = reply.choices
        assert "Paris" in choice.message.content and choice.message.role == "assistant"
        assert choice.finish_reason in ("stop", "length")
        usage = reply.usage
        assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens and 0 < usage.completion_tokens <= 12

        stream = await api.chat.completions.create(
            model=MODEL,
            messages=FRANCE,
            max_tokens=12,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = [c async for c in stream]
        assert chunks[0].choices[0].delta.role == "assistant"
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == choice.message.content
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == choice.finish_reason
        last = chunks[-1]
        assert last.choices == [] and last.usage.completion_tokens == usage.completion_tokens
        assert last.usage.prompt_tokens == usage.prompt_tokens
        # The chat prompt (~37 tokens) repeats: its full 16-token blocks come from the cache.
        assert last.usage.prompt_tokens_details.cached_tokens >= 16
        assert len({c.id for c in chunks}) == 1

        models = await api.models.list()
        assert [m.id for m in models.data] == [MODEL]
        assert (await http.get("/health")).status_code == 200

    run(main)


def test_completions_prompt_forms(served):
    """A string and its token ids give the same greedy text; a list of prompts with n=2 gives
    choices indexed prompt * n + completion, streamed or not."""
    text_prompt = "The capital of France is"
    ids = served.tokenizer.encode(text_prompt)

    async def main():
        http, api = clients(served.app)
        base = dict(model=MODEL, max_tokens=4, temperature=0)
        by_text = await api.completions.create(prompt=text_prompt, **base)
        by_ids = await api.completions.create(prompt=ids, **base)
        assert by_text.object == "text_completion" and by_text.id.startswith("cmpl-")
        assert by_text.choices[0].text == by_ids.choices[0].text != ""
        assert by_text.usage.prompt_tokens == len(ids)

        several = await api.completions.create(prompt=[text_prompt, "1, 2, 3,"], n=2, **base)
        assert [c.index for c in several.choices] == [0, 1, 2, 3]
        texts = [c.text for c in several.choices]
        assert texts[0] == texts[1] == by_text.choices[0].text and texts[2] == texts[3] != texts[0]
        assert several.usage.completion_tokens == 4 * 4

        id_lists = await api.completions.create(prompt=[ids, ids[:3]], **base)
        assert id_lists.choices[0].text == by_text.choices[0].text and len(id_lists.choices) == 2

        stream = await api.completions.create(prompt=[text_prompt, "1, 2, 3,"], stream=True, **base)
        streamed = {}
        async for chunk in stream:
            for c in chunk.choices:
                streamed[c.index] = streamed.get(c.index, "") + c.text
        assert streamed == {0: texts[0], 1: texts[2]}

    run(main)


def test_n2_and_seed_reproducibility(served):
    """Sampling with a seed repeats exactly; n=2 gives two choices (different per-choice seeds).
    Four 8-token samples at temperature 1 of an open prompt all coinciding is vanishingly unlikely."""

    async def main():
        http, api = clients(served.app)

        async def sample(seed):
            out = await api.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": "Tell me a story."}],
                max_tokens=8,
                temperature=1.0,
                n=2,
                seed=seed,
                extra_body={"ignore_eos": True},
            )
            assert [c.index for c in out.choices] == [0, 1] and out.usage.completion_tokens == 16
            return [c.message.content for c in out.choices]

        first, again, other = await sample(7), await sample(7), await sample(8)
        assert first == again
        assert len(set(first + other)) > 1

    run(main)


def test_logprobs(served):
    """Chat logprobs (content entries with top_logprobs) and completions logprobs (tokens,
    token_logprobs, top_logprobs, text_offset); greedy picks the most likely token."""

    async def main():
        http, api = clients(served.app)
        chat = await api.chat.completions.create(
            model=MODEL,
            messages=FRANCE,
            max_tokens=3,
            temperature=0,
            logprobs=True,
            top_logprobs=2,
            extra_body={"ignore_eos": True},
        )
        content = chat.choices[0].logprobs.content
        assert len(content) == chat.usage.completion_tokens == 3
        assert "".join(c.token for c in content) == chat.choices[0].message.content
        for entry in content:
            assert len(entry.top_logprobs) == 2 and entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
            assert entry.top_logprobs[0].token == entry.token and entry.logprob <= 0
            assert entry.bytes == list(entry.token.encode())

        prompt = "The capital of France is"
        legacy = await api.completions.create(model=MODEL, prompt=prompt, max_tokens=3, temperature=0, logprobs=2)
        lp = legacy.choices[0].logprobs
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 3
        assert "".join(lp.tokens) == legacy.choices[0].text
        assert lp.text_offset == [0, len(lp.tokens[0]), len(lp.tokens[0]) + len(lp.tokens[1])]
        assert all(max(top.values()) == t for top, t in zip(lp.top_logprobs, lp.token_logprobs))

    run(main)


def test_stop_strings(served):
    """A stop string ends the completion (finish_reason "stop", the string not in the text),
    streamed or not."""

    async def main():
        http, api = clients(served.app)
        args = dict(model=MODEL, prompt="The capital of France is", max_tokens=12, temperature=0, stop=[" Paris"])
        out = await api.completions.create(**args)
        assert out.choices[0].finish_reason == "stop" and "Paris" not in out.choices[0].text
        assert out.choices[0].model_extra["stop_reason"] == " Paris"
        chunks = [c async for c in await api.completions.create(stream=True, **args)]
        assert "".join(c.choices[0].text for c in chunks) == out.choices[0].text
        assert chunks[-1].choices[0].finish_reason == "stop"

    run(main)


def test_bad_input_gets_openai_errors_and_the_server_keeps_serving(served):
    """Each bad request of the issue's list gets a 4xx in OpenAI's envelope; a good request
    succeeds after each."""
    context_len = served.llm.engine.context_len

    async def main():
        http, api = clients(served.app)
        chat = dict(model=MODEL, messages=FRANCE, max_tokens=2)

        async def post(path, body, **kwargs):
            content = body if isinstance(body, bytes) else json.dumps(body).encode()
            return await http.post(path, content=content, headers={"content-type": "application/json"}, **kwargs)

        cases = [
            ("/v1/chat/completions", b'{"model": "smollm2", "messages": [', 400, None, "not valid JSON"),
            ("/v1/chat/completions", {**chat, "model": "gpt-4"}, 404, "model", "gpt-4"),
            ("/v1/chat/completions", {"model": MODEL}, 400, "messages", "required"),
            ("/v1/chat/completions", {**chat, "max_tokens": -5}, 400, "max_tokens", "-5"),
            ("/v1/chat/completions", {**chat, "temperature": 3.5}, 400, "temperature", "3.5"),
            ("/v1/completions", {**GOOD, "prompt": [1] * (context_len + 10)}, 400, "prompt", str(context_len + 10)),
            ("/v1/completions", {**GOOD, "max_tokens": 1_000_000}, 400, "max_tokens", "max_tokens"),
            ("/v1/chat/completions", {**chat, "max_tokens": "ten"}, 400, "max_tokens", "'ten'"),
            ("/v1/chat/completions", {**chat, "messages": "hi"}, 400, "messages", "'hi'"),
            ("/v1/completions", {**GOOD, "prompt": [1, "a"]}, 400, "prompt", "token-id lists"),
            ("/v1/completions", {**GOOD, "prompt": [10**9]}, 400, "prompt", "vocabulary"),
            ("/v1/completions", {**GOOD, "echo": True}, 400, "echo", "echo"),
            ("/v1/completions", {**GOOD, "prompt": "x" * BODY_LIMIT}, 413, None, str(BODY_LIMIT)),
            ("/v1/nothing-here", {}, 404, None, "Not Found"),
        ]
        for path, body, status, param, shown in cases:
            error = assert_envelope(await post(path, body), status, param)
            assert shown in error["message"], (path, error)
            await good_request(api)

        # Through the official client: the statuses become its exception classes.
        with pytest.raises(openai.NotFoundError) as info:
            await api.chat.completions.create(**{**chat, "model": "gpt-4"})
        assert info.value.code == "model_not_found" and info.value.param == "model"
        with pytest.raises(openai.BadRequestError) as info:
            await api.chat.completions.create(**{**chat, "temperature": 3.5})
        assert info.value.param == "temperature"
        await good_request(api)

        # An oversized body without Content-Length (chunked) is counted while it is read.
        async def chunks():
            for _ in range(3):
                yield b" " * (BODY_LIMIT // 2)

        assert_envelope(await http.post("/v1/completions", content=chunks()), 413)
        await good_request(api)

    run(main)


async def call_asgi(app, path: str, headers: list, body_parts: list[bytes], disconnect_after_first_frame=False):
    """Drive the ASGI app directly (a client that lies about Content-Length, or goes away)."""
    parts = list(body_parts)
    first_frame = asyncio.Event()
    sent = []

    async def receive():
        if parts:
            part = parts.pop(0)
            return {"type": "http.request", "body": part, "more_body": bool(parts)}
        if disconnect_after_first_frame:
            await first_frame.wait()
        else:
            await asyncio.Event().wait()
        return {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)
        if message["type"] == "http.response.body" and b'"text"' in message.get("body", b""):
            first_frame.set()

    scope = {
        "type": "http",
        # NOTE: spec 2.4, where Starlette itself stops watching for http.disconnect.
        "asgi": {"version": "3.0", "spec_version": "2.4"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "root_path": "",
        "query_string": b"",
        "headers": [(b"content-type", b"application/json")] + headers,
        "client": ("127.0.0.1", 5000),
        "server": ("127.0.0.1", 8000),
    }
    await asyncio.wait_for(app(scope, receive, send), 30)
    return sent


def test_lying_content_length_gets_413(served):
    async def main():
        part = b" " * (BODY_LIMIT // 2)
        sent = await call_asgi(served.app, "/v1/completions", [(b"content-length", b"10")], [part, part, part])
        assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 413
        http, api = clients(served.app)
        await good_request(api)

    run(main)


def test_client_disconnect_mid_stream_aborts_the_request(served):
    """The client leaves after the first frame of a 400-token stream: the request is aborted
    at once (the engine holds nothing afterwards; finishing it would take ~20 s here)."""

    def aborted() -> float:
        text = served.engine.metrics.exposition()
        lines = [line for line in text.splitlines() if line.startswith("flotilla:request_success_total{")]
        return sum(float(line.split()[-1]) for line in lines if 'finished_reason="abort"' in line)

    async def main():
        body = json.dumps({**GOOD, "max_tokens": 400, "stream": True, "ignore_eos": True}).encode()
        before = aborted()
        started = time.monotonic()
        sent = await call_asgi(served.app, "/v1/completions", [], [body], disconnect_after_first_frame=True)
        assert sent[0]["status"] == 200
        frames = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
        assert frames.count(b'"text"') < 400
        deadline = time.monotonic() + 5
        while (load := served.engine.load()).load or load.kv_usage or aborted() != before + 1:
            assert time.monotonic() < deadline, (load, aborted() - before)
            await asyncio.sleep(0.05)
        assert time.monotonic() - started < 10
        http, api = clients(served.app)
        await good_request(api)

    run(main)


def test_api_key_health_and_metrics(served):
    """With an API key every endpoint but /health needs it (401 otherwise); /metrics merges
    the ingress's HTTP metrics with the engine's, one HELP/TYPE per family."""
    options = ServeOptions(served_model_name=MODEL, api_key="sekret")
    app = create_app(served.engine, served.tokenizer, options, served.llm.config)

    async def main():
        http, api = clients(app, api_key="wrong")
        with pytest.raises(openai.AuthenticationError) as info:
            await api.completions.create(**GOOD)
        assert info.value.code == "invalid_api_key"
        for path in ("/v1/models", "/metrics"):
            assert_envelope(await http.get(path), 401)
            assert_envelope(await http.get(path, headers={"Authorization": "Bearer wrong"}), 401)
        assert (await http.get("/health")).status_code == 200
        _, good_api = clients(app, api_key="sekret")
        await good_request(good_api)
        assert [m.id for m in (await good_api.models.list()).data] == [MODEL]

        text = (await http.get("/metrics", headers={"Authorization": "Bearer sekret"})).text
        assert 'flotilla:http_requests_total{method="POST",path="/v1/completions",status="401"} 1.0' in text
        assert 'flotilla:http_requests_total{method="POST",path="/v1/completions",status="200"} 1.0' in text
        assert "flotilla:num_requests_running" in text and "flotilla:http_request_duration_seconds_bucket" in text
        types = [line.split()[2] for line in text.splitlines() if line.startswith("# TYPE")]
        assert len(types) == len(set(types))

    run(main)


# -- a stub engine: refusals and failures ---------------------------------------------------


class StubEngine:
    """An EngineClient whose ``generate`` follows ``mode``; records closed streams."""

    def __init__(self, mode: str):
        self.mode, self.healthy, self.closed = mode, True, 0

    async def generate(self, request):
        try:
            if self.mode == "overloaded":
                raise EngineOverloadedError("the queue is full (max_queued_requests=1)", retry_after_s=2)
            if self.mode == "dead":
                raise EngineUnavailableError("a worker died")
            yield GenerateChunk(request.request_id, [CompletionChunk(0, [5], "a")])
            if self.mode == "raise_mid":
                raise RuntimeError("the replica went away")
            if self.mode == "ok":
                done = CompletionChunk(0, [6], "b", finish_reason="length")
                yield GenerateChunk(request.request_id, [done], True, 3, 2, cached_tokens=1)
                return
            failed = CompletionChunk(0, [], "", finish_reason="error")
            yield GenerateChunk(request.request_id, [failed], True, error="worker died")
        finally:
            self.closed += 1

    async def is_healthy(self):
        return self.healthy

    async def metrics_text(self):
        raise TimeoutError("metrics hub did not answer")


def stub_app(mode):
    engine = StubEngine(mode)
    return engine, create_app(engine, None, ServeOptions(served_model_name=MODEL), default_cpu_config())


def test_the_model_card_says_which_proposer_runs():
    from flotilla.resolution.config import ResolvedConfig, thaw

    plain = default_cpu_config()
    spec = ResolvedConfig.build(
        {**thaw(plain.config), "speculative_algorithm": "NGRAM", "speculative_num_draft_tokens": 6}, dict(plain.env), ()
    )

    async def card(config):
        app = create_app(StubEngine("ok"), None, ServeOptions(served_model_name=MODEL), config)
        http, api = clients(app)
        listed = (await http.get("/v1/models")).json()["data"][0]
        assert (await api.models.retrieve(MODEL)).model_dump()["speculative_decoding"] == listed["speculative_decoding"]
        return listed["speculative_decoding"]

    assert run(lambda: card(plain)) is None
    assert run(lambda: card(spec)) == {"algorithm": "NGRAM", "num_draft_tokens": 5}


def test_engine_refusals_and_failures():
    body = {"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 4}

    async def main():
        engine, app = stub_app("overloaded")
        http, _ = clients(app)
        response = await http.post("/v1/completions", json=body)
        assert_envelope(response, 429)
        assert response.headers["retry-after"] == "2"
        assert engine.closed == 1

        engine, app = stub_app("dead")
        http, _ = clients(app)
        assert "a worker died" in assert_envelope(await http.post("/v1/completions", json=body), 503)["message"]
        engine.healthy = False
        assert_envelope(await http.get("/health"), 503)
        metrics = await http.get("/metrics")  # the engine side failing leaves the ingress's own
        assert metrics.status_code == 200 and "flotilla:http_requests_total" in metrics.text

        for mode, reason in (("error_mid", "worker died"), ("raise_mid", "the replica went away")):
            engine, app = stub_app(mode)
            http, _ = clients(app)
            assert reason in assert_envelope(await http.post("/v1/completions", json=body), 503)["message"]
            streamed = await http.post("/v1/completions", json={**body, "stream": True})
            assert streamed.status_code == 200
            frames = [f for f in streamed.text.split("\n\n") if f]
            assert json.loads(frames[0][len("data: ") :])["choices"][0]["text"] == "a"
            error = json.loads(frames[1][len("data: ") :])["error"]
            assert reason in error["message"] and frames[2] == "data: [DONE]"
            assert engine.closed == 2

    run(main)


def test_request_ids_and_access_log(caplog):
    """The client's X-Request-Id names the request (response id, header, log line); without
    one, each request gets a fresh id. One JSON access-log line per request with its usage."""
    caplog.set_level(logging.INFO, logger="flotilla.serve.access")

    async def main():
        _, app = stub_app("ok")
        http, _ = clients(app)
        body = {"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 2}
        response = await http.post("/v1/completions", json=body, headers={"X-Request-Id": "client-7"})
        assert response.headers["x-request-id"] == "client-7" and response.json()["id"] == "cmpl-client-7"
        assert response.json()["usage"] == {
            "prompt_tokens": 3,
            "completion_tokens": 2,
            "total_tokens": 5,
            "prompt_tokens_details": {"cached_tokens": 1},
        }
        first, second = await http.get("/v1/models"), await http.get("/v1/models")
        assert first.headers["x-request-id"] and first.headers["x-request-id"] != second.headers["x-request-id"]

    run(main)
    lines = [json.loads(r.getMessage()) for r in caplog.records if r.name == "flotilla.serve.access"]
    assert len(lines) == 3
    assert lines[0]["request_id"] == "client-7" and lines[0]["status"] == 200 and lines[0]["latency_s"] >= 0
    assert (lines[0]["prompt_tokens"], lines[0]["completion_tokens"], lines[0]["cached_tokens"]) == (3, 2, 1)
    assert lines[1]["path"] == "/v1/models" and "prompt_tokens" not in lines[1]


def test_the_access_log_names_the_engine_replica_that_served(served, caplog):
    """The access-log line of a generation names the engine replica whose engine computed it
    (stamped on the request's first chunk by that replica's AsyncEngine), streamed or not;
    a route that reaches no engine names none."""
    caplog.set_level(logging.INFO, logger="flotilla.serve.access")

    async def main():
        http, _ = clients(served.app)
        for stream in (False, True):
            response = await http.post("/v1/completions", json={**GOOD, "stream": stream, "prompt": [1, 2, 3, 4]})
            assert response.status_code == 200, response.text
        assert (await http.get("/v1/models")).status_code == 200

    run(main)
    lines = [json.loads(r.getMessage()) for r in caplog.records if r.name == "flotilla.serve.access"]
    assert [line.get("replica") for line in lines] == [ENGINE_REPLICA, ENGINE_REPLICA, None], lines
    assert all("prefill_replica" not in line for line in lines)


def test_served_by_names_each_replica_once_in_prompt_order():
    """A request whose prompts went to several replicas (or through PD) names all of them."""
    from flotilla.serve.responses import GenerationJob

    job = GenerationJob("completion", "cmpl-x", MODEL, 1, [], None, False, None)
    assert job.served_by() == {}
    for i, (decode, prefill) in enumerate([("d1", "p1"), ("d2", "p1"), ("d1", "")]):
        job.record(i, GenerateChunk(f"r-{i}", replica_id=decode, prefill_replica_id=prefill))
    job.record(0, GenerateChunk("r-0", replica_id="later"))  # NOTE: the first chunk's replica counts
    assert job.served_by() == {"replica": ["d1", "d2"], "prefill_replica": "p1"}


# -- the prompts of one request: refused together, aborted together ----------------------------


class SiblingEngine:
    """An EngineClient for multi-prompt requests: prompt ``refuse`` is refused with
    ``refusal`` at once; the others wait in the queue (``first_chunk=False``: they never
    get a first chunk) or stream one chunk and then wait. Records which prompts' streams
    were closed (their ``finally`` ran: the real engine aborts there) and the groups seen."""

    def __init__(self, refuse: int | None, refusal: Exception | None = None, first_chunk: bool = False):
        self.refuse, self.refusal, self.first_chunk = refuse, refusal, first_chunk
        self.closed: set[int] = set()
        self.groups: set[tuple] = set()

    async def generate(self, request):
        index = int(request.request_id.rsplit("-", 1)[1])
        self.groups.add((getattr(request, "group_id", None), getattr(request, "group_size", None)))
        try:
            if index == self.refuse:
                raise self.refusal
            if self.first_chunk:
                yield GenerateChunk(request.request_id, [CompletionChunk(0, [5], "a")])
            await asyncio.Event().wait()
            yield GenerateChunk(request.request_id)  # NOTE: never reached
        finally:
            self.closed.add(index)

    async def is_healthy(self):
        return True

    async def metrics_text(self):
        return ""


@pytest.mark.parametrize(
    "refusal, status",
    [(EngineOverloadedError("the queue is full", retry_after_s=1), 429), (ValueError("prompt_token_ids: bad id"), 400)],
)
def test_a_refused_prompt_aborts_every_other_prompt_of_its_request(refusal, status, caplog):
    """Prompt 2 of 4 is refused while the others still wait in the engine's queue: the answer
    is the refusal, and by the time it is sent every other prompt's stream has been closed
    (the engine aborts them), with no "aclose(): asynchronous generator is already running"
    (the close of a stream whose first-chunk wait still ran in another task failed so, and
    the prompts ran on for the refused client)."""
    caplog.set_level(logging.WARNING, logger="flotilla.serve.responses")
    engine = SiblingEngine(refuse=2, refusal=refusal)
    app = create_app(engine, None, ServeOptions(served_model_name=MODEL), default_cpu_config())
    body = {"model": MODEL, "prompt": [[1], [2], [3], [4]], "max_tokens": 4}

    async def main():
        http, _ = clients(app)
        response = await http.post("/v1/completions", json=body, headers={"X-Request-Id": "sib"})
        assert_envelope(response, status)
        assert engine.closed == {0, 1, 2, 3}

    run(main)
    assert engine.groups == {("sib", 4)}  # one group: the engine admits all four or none
    assert not [r for r in caplog.records if "already running" in r.getMessage()]


def test_a_stream_whose_client_leaves_before_its_first_frame_closes_every_prompt():
    """A streamed multi-prompt request whose client is gone before the first frame: the frames'
    generator never starts (so its own ``finally`` never runs), yet every prompt's stream is
    closed when the response ends (their pumps would otherwise read on)."""
    engine = SiblingEngine(refuse=None, first_chunk=True)
    app = create_app(engine, None, ServeOptions(served_model_name=MODEL), default_cpu_config())
    body = json.dumps({"model": MODEL, "prompt": [[1], [2], [3]], "max_tokens": 4, "stream": True}).encode()

    async def main():
        sent = []
        parts = [body]

        async def receive():
            if parts:
                return {"type": "http.request", "body": parts.pop(), "more_body": False}
            return {"type": "http.disconnect"}  # NOTE: gone as soon as the body is read

        async def send(message):
            await asyncio.sleep(0)  # NOTE: a server's send may yield; the disconnect wins meanwhile
            sent.append(message)

        scope = {
            "type": "http", "asgi": {"version": "3.0", "spec_version": "2.4"}, "http_version": "1.1",
            "method": "POST", "scheme": "http", "path": "/v1/completions", "raw_path": b"/v1/completions",
            "root_path": "", "query_string": b"", "headers": [(b"content-type", b"application/json")],
            "client": ("127.0.0.1", 5000), "server": ("127.0.0.1", 8000),
        }  # fmt: skip
        await asyncio.wait_for(app(scope, receive, send), 10)
        assert engine.closed == {0, 1, 2}

    run(main)


def test_prompts_beyond_max_prompts_per_request_get_400_naming_prompt_before_any_reaches_the_engine():
    engine = SiblingEngine(refuse=None)
    app = create_app(engine, None, ServeOptions(served_model_name=MODEL, max_prompts_per_request=3), default_cpu_config())

    async def main():
        http, _ = clients(app)
        response = await http.post("/v1/completions", json={"model": MODEL, "prompt": [[1]] * 4, "max_tokens": 2})
        error = assert_envelope(response, 400, "prompt")
        assert "4 prompts" in error["message"] and "--max-prompts-per-request" in error["message"]
        assert engine.groups == set()

    run(main)


def test_metrics_of_several_ingress_replicas_merge_with_each_ones_own_read_fresh():
    """Two ingress replicas (ids ``i1``, ``i2``): what the hub holds for them (their texts as
    last pushed) merges with the serving replica's own series, read at the call (they win over
    its stale pushed copy), each series told apart by its ``ingress`` label."""
    hub: dict[str, str] = {}
    TOKEN_IDS = dict(GOOD, prompt=[1, 2, 3])  # NOTE: no tokenizer here

    class HubEngine(StubEngine):
        async def metrics_text(self):
            return merge_expositions(hub.values())

    options = ServeOptions(served_model_name=MODEL)
    apps = {name: create_app(HubEngine("ok"), None, options, default_cpu_config(), ingress_id=name) for name in ("i1", "i2")}

    def served(text: str, ingress: str) -> float:
        want = f'flotilla:http_requests_total{{ingress="{ingress}",method="POST",path="/v1/completions",status="200"}}'
        return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(want))

    async def main():
        for name, count in (("i1", 1), ("i2", 2)):
            _, api = clients(apps[name])
            for _ in range(count):
                await api.completions.create(**TOKEN_IDS)
            hub[name] = apps[name].state.metrics_exposition()  # the push
        _, api = clients(apps["i1"])
        await api.completions.create(**TOKEN_IDS)  # after i1's push: only its own fresh series has it
        http, _ = clients(apps["i1"])
        text = (await http.get("/metrics")).text
        assert (served(text, "i1"), served(text, "i2")) == (2.0, 2.0)
        types = [line.split()[2] for line in text.splitlines() if line.startswith("# TYPE")]
        assert len(types) == len(set(types))

    run(main)
