"""``return_token_ids`` (vLLM's request field) through the OpenAI ingress, over httpx's ASGI
transport against real in-process engines: SmolLM2-135M-Instruct with its tokenizer (the
ids must read back as the text, and count as the usage says), and a tiny random Llama
served with ``skip_tokenizer_init`` (no text at all: the ids are all a client sees, so they
come by default, frame by frame). The load generator's time to first token is measured on
the tokenizer-less stream.

Generations are greedy and short (2-core CI).
"""

import asyncio
import json
import time
from types import SimpleNamespace

import httpx
import pytest

from flotilla.cluster.engine.llm import LLM
from flotilla.deploy.loadgen import RequestResult, _read_sse
from flotilla.resolution import preset
from flotilla.serve.async_engine import AsyncEngine
from flotilla.serve.ingress import create_app
from flotilla.serve.types import ServeOptions
from helpers.tiny_models import save_tiny_llama

MODEL = "smollm2"
PROMPT = "The capital of France is"
FRANCE = [{"role": "user", "content": "What is the capital of France?"}]
GREEDY = dict(model=MODEL, max_tokens=6, temperature=0, ignore_eos=True)
NEW_KEYS = ("token_ids", "prompt_token_ids")


def serving(llm):
    engine = AsyncEngine(llm.engine)
    app = create_app(engine, llm.tokenizer, ServeOptions(served_model_name=MODEL), llm.config)
    return SimpleNamespace(llm=llm, engine=engine, app=app, tokenizer=llm.tokenizer)


@pytest.fixture(scope="module")
def served():
    """SmolLM2 with its tokenizer."""
    server = serving(LLM(max_total_tokens=4096))
    yield server
    server.engine.shutdown()


@pytest.fixture(scope="module")
def tokenless(tmp_path_factory):
    """A tiny random Llama served without a tokenizer (token-id prompts only)."""
    path = tmp_path_factory.mktemp("tiny-llama")
    save_tiny_llama(path)
    server = serving(LLM(str(path), platform=preset("cpu"), max_total_tokens=2048, skip_tokenizer_init=True))
    assert server.tokenizer is None
    yield server
    server.engine.shutdown()


def run(make_coro):
    return asyncio.run(make_coro())


def http(app) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://flotilla.test")


async def post(app, path: str, body: dict) -> dict:
    async with http(app) as client:
        response = await client.post(path, json=body)
    assert response.status_code == 200, response.text
    return response.json()


async def stream(app, path: str, body: dict) -> list[dict]:
    """The JSON frames of a streamed request (``[DONE]`` checked and dropped)."""
    async with http(app) as client:
        response = await client.post(path, json={**body, "stream": True, "stream_options": {"include_usage": True}})
    assert response.status_code == 200, response.text
    frames = [f[len("data: ") :] for f in response.text.split("\n\n") if f]
    assert frames[-1] == "[DONE]"
    return [json.loads(f) for f in frames[:-1]]


def streamed_choices(frames: list[dict]) -> dict[int, list[dict]]:
    """Each choice's frames, in order."""
    out: dict[int, list[dict]] = {}
    for frame in frames:
        for choice in frame["choices"]:
            out.setdefault(choice["index"], []).append(choice)
    return out


# -- a server with a tokenizer ----------------------------------------------------------------


def test_completion_token_ids_read_back_as_the_text(served):
    """return_token_ids=true: each choice's ids decode to its text, count as the usage says,
    and its prompt_token_ids are its prompt's tokens (two prompts, n=2: choice i*n+j has
    prompt i's). Streamed: every frame carries its new ids, a choice's first frame its
    prompt's ids, and the streamed ids are the non-streamed ones."""
    prompts = [PROMPT, "1, 2, 3,"]
    body = dict(prompt=prompts, n=2, return_token_ids=True, **GREEDY)

    async def main():
        whole = await post(served.app, "/v1/completions", body)
        frames = await stream(served.app, "/v1/completions", body)
        return whole, frames

    whole, frames = run(main)
    choices = whole["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2, 3]
    for c in choices:
        assert served.tokenizer.decode(c["token_ids"], skip_special_tokens=True) == c["text"] != ""
        assert len(c["token_ids"]) == GREEDY["max_tokens"]
        assert c["prompt_token_ids"] == served.tokenizer.encode(prompts[c["index"] // 2])
    assert sum(len(c["token_ids"]) for c in choices) == whole["usage"]["completion_tokens"]

    by_choice = streamed_choices(frames)
    assert sorted(by_choice) == [0, 1, 2, 3]
    for index, parts in by_choice.items():
        assert parts[0]["prompt_token_ids"] == choices[index]["prompt_token_ids"]
        assert all(p["prompt_token_ids"] is None for p in parts[1:])
        assert all(isinstance(p["token_ids"], list) for p in parts)
        ids = [t for p in parts for t in p["token_ids"]]
        assert ids == choices[index]["token_ids"]
        assert "".join(p["text"] for p in parts) == choices[index]["text"]
    assert frames[-1]["usage"]["completion_tokens"] == whole["usage"]["completion_tokens"]


def test_without_the_field_the_keys_are_null(served):
    """A server with a tokenizer sends no ids unless asked (the keys are null), streamed or
    not; return_token_ids=false says the same explicitly."""
    body = dict(prompt=PROMPT, **GREEDY)

    async def main():
        return [
            await post(served.app, "/v1/completions", body),
            await post(served.app, "/v1/completions", {**body, "return_token_ids": False}),
            *(await stream(served.app, "/v1/completions", body)),
            await post(served.app, "/v1/chat/completions", dict(GREEDY, messages=FRANCE)),
            *(await stream(served.app, "/v1/chat/completions", dict(GREEDY, messages=FRANCE))),
        ]

    responses = run(main)
    assert responses[0]["choices"][0]["text"]
    for response in responses:
        assert response.get("prompt_token_ids") is None
        for choice in response["choices"]:
            for key in NEW_KEYS:
                assert choice.get(key, None) is None, (key, response)
    chat = [r for r in responses if r["object"] == "chat.completion"][0]
    assert "prompt_token_ids" in chat and "token_ids" in chat["choices"][0]


def test_chat_token_ids(served):
    """Chat with return_token_ids: the choice's ids decode to its content, the response's
    prompt_token_ids are the rendered template's tokens; streamed, the role frame carries
    the prompt's ids and the content frames the same ids as the whole answer."""
    body = dict(messages=FRANCE, return_token_ids=True, **GREEDY)
    template = served.tokenizer.apply_chat_template(FRANCE, tokenize=False, add_generation_prompt=True)
    prompt_ids = served.tokenizer.encode(template, add_special_tokens=False)

    async def main():
        whole = await post(served.app, "/v1/chat/completions", body)
        return whole, await stream(served.app, "/v1/chat/completions", body)

    whole, frames = run(main)
    (choice,) = whole["choices"]
    assert served.tokenizer.decode(choice["token_ids"], skip_special_tokens=True) == choice["message"]["content"] != ""
    assert len(choice["token_ids"]) == whole["usage"]["completion_tokens"] == GREEDY["max_tokens"]
    assert whole["prompt_token_ids"] == prompt_ids and whole["usage"]["prompt_tokens"] == len(prompt_ids)

    role, rest = frames[0], frames[1:]
    assert role["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert role["prompt_token_ids"] == prompt_ids
    assert all(f["prompt_token_ids"] is None for f in rest)
    parts = [c for f in rest for c in f["choices"]]
    assert [t for c in parts for t in c["token_ids"]] == choice["token_ids"]
    assert "".join(c["delta"].get("content", "") for c in parts) == choice["message"]["content"]


# -- a server without a tokenizer ---------------------------------------------------------------


def test_tokenless_server_sends_token_ids_by_default(tokenless):
    """skip_tokenizer_init: the text is empty, so the ids come without asking; streamed,
    every frame carries its ids (how many frames depends on how far the stream's reader
    lags the engine: queued chunks go out as one), and they add up to the non-streamed ids.
    return_token_ids=false opts out."""
    prompt = [5, 17, 42, 9]
    body = dict(prompt=prompt, **{**GREEDY, "max_tokens": 8})

    async def main():
        whole = await post(tokenless.app, "/v1/completions", body)
        frames = await stream(tokenless.app, "/v1/completions", body)
        plain = await post(tokenless.app, "/v1/completions", {**body, "return_token_ids": False})
        return whole, frames, plain

    whole, frames, plain = run(main)
    (choice,) = whole["choices"]
    assert choice["text"] == "" and choice["prompt_token_ids"] == prompt
    assert len(choice["token_ids"]) == whole["usage"]["completion_tokens"] == 8

    parts = streamed_choices(frames)[0]
    assert parts[-1]["finish_reason"] == "length"
    assert parts[0]["token_ids"] and all(p["token_ids"] for p in parts if p["finish_reason"] is None)
    assert parts[0]["prompt_token_ids"] == prompt
    assert [t for p in parts for t in p["token_ids"]] == choice["token_ids"]

    assert all(plain["choices"][0][key] is None for key in NEW_KEYS)
    assert plain["usage"]["completion_tokens"] == 8


def test_loadgen_measures_ttft_on_a_tokenless_stream(tokenless):
    """The load generator's SSE reader takes the first token's time from the first frame
    with token ids when a tokenizer-less server sends no text."""
    body = {"model": MODEL, "prompt": [5, 17, 42], "max_tokens": 4, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip

    async def main():
        result = RequestResult(status=200)
        start = time.perf_counter()
        async with http(tokenless.app) as client:
            async with client.stream("POST", "/v1/completions", json=body) as response:
                assert response.status_code == 200
                await _read_sse(response, result, start)
        return result, time.perf_counter() - start

    result, elapsed = run(main)
    assert result.error is None and result.output_tokens == 4
    assert result.ttft_s is not None and 0 < result.ttft_s <= elapsed
