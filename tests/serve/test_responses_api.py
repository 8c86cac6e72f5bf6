"""``POST /v1/responses`` (OpenAI's Responses API, stateless), driven by the official
``openai`` client over httpx's ASGI transport against a real in-process engine (AsyncEngine
over SmolLM2-135M-Instruct): text with usage, instructions as the system message, the
streamed event sequence, ``max_output_tokens`` cutting the answer (incomplete), a forced
function call whole and streamed, a ``function_call_output`` turn, the 400s naming the
Responses parameter (each followed by a good request). A scripted engine covers the
reasoning item (``--reasoning-parser``) and a failure mid-stream (``response.failed``, never
``response.completed``).

The answers are checked against the installed SDK's types (``openai.types.responses``).
Generations are greedy and short (2-core CI)."""

import asyncio
import json
import re
from types import SimpleNamespace

import httpx
import jsonschema
import openai
import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from flotilla.cluster.engine.llm import LLM
from flotilla.resolution.config import ResolvedConfig, thaw
from flotilla.serve.async_engine import AsyncEngine
from flotilla.serve.ingress import create_app
from flotilla.serve.types import CompletionChunk, GenerateChunk, ServeOptions

MODEL = "smollm2"
FRANCE = "What is the capital of France?"
GREEDY = dict(model=MODEL, temperature=0)
WEATHER_PARAMETERS = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 12}},
    "required": ["city"],
    "additionalProperties": False,
}
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city.", "parameters": WEATHER_PARAMETERS}
FORCE_WEATHER = {"type": "function", "name": "get_weather"}
STREAM_EVENT = TypeAdapter(ResponseStreamEvent)


@pytest.fixture(scope="module")
def served():
    llm = LLM(max_total_tokens=4096)
    engine = AsyncEngine(llm.engine)
    app = create_app(engine, llm.tokenizer, ServeOptions(served_model_name=MODEL), llm.config)
    yield SimpleNamespace(llm=llm, app=app)
    engine.shutdown()


def run(make_coro):
    return asyncio.run(make_coro())


def clients(app):
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://flotilla.test")
    api = openai.AsyncOpenAI(api_key="unused", base_url="http://flotilla.test/v1", http_client=http, max_retries=0)
    return http, api


def check_sdk_shape(body: dict) -> Response:
    """``body`` validated strictly by the SDK's Response type.

    NOTE: usage aside: this SDK's InputTokensDetails requires ``cache_write_tokens``, which
    the engine does not count (the client's own parsing takes the usage as it is)."""
    return Response.model_validate({k: v for k, v in body.items() if k != "usage"})


async def sse_events(http: httpx.AsyncClient, body: dict) -> tuple[list[dict], list[str]]:
    """A streamed response's events (data parsed) and its raw ``event:`` names."""
    async with http.stream("POST", "/v1/responses", json={**body, "stream": True}) as response:
        assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
        text = (await response.aread()).decode()
    assert "[DONE]" not in text  # NOTE: Responses streams end after their last event
    frames = [f for f in text.split("\n\n") if f.strip()]
    names = [re.match(r"event: (\S+)\n", f).group(1) for f in frames]
    events = [json.loads(f.split("data: ", 1)[1]) for f in frames]
    return events, names


def test_create_answers_text_with_consistent_usage(served):
    async def main():
        _, api = clients(served.app)
        raw = await api.responses.with_raw_response.create(
            **GREEDY, input=FRANCE, max_output_tokens=12, metadata={"run": "t1"}, extra_headers={"X-Request-Id": "r-1"}
        )
        check_sdk_shape(json.loads(raw.content))
        reply = raw.parse()
        assert reply.id == "resp_r-1" and reply.object == "response" and reply.model == MODEL
        assert "Paris" in reply.output_text and reply.status == "completed" and reply.incomplete_details is None
        (message,) = reply.output
        assert message.type == "message" and message.role == "assistant" and message.id.startswith("msg_")
        assert message.content[0].text == reply.output_text and message.status == "completed"
        usage = reply.usage
        assert usage.total_tokens == usage.input_tokens + usage.output_tokens and 0 < usage.output_tokens <= 12
        assert usage.output_tokens_details.reasoning_tokens == 0
        assert reply.max_output_tokens == 12 and reply.temperature == 0 and reply.metadata == {"run": "t1"}
        assert reply.tools == [] and reply.tool_choice == "auto" and reply.parallel_tool_calls is True

    run(main)


def test_instructions_are_the_system_message(served):
    """The same greedy text and prompt size as the chat request with that system message."""
    instructions = "You are a pirate. Answer like a pirate."

    async def main():
        _, api = clients(served.app)
        reply = await api.responses.create(**GREEDY, instructions=instructions, input=FRANCE, max_output_tokens=10)
        chat = await api.chat.completions.create(
            **GREEDY,
            messages=[{"role": "system", "content": instructions}, {"role": "user", "content": FRANCE}],
            max_tokens=10,
        )
        assert reply.output_text == chat.choices[0].message.content and reply.output_text
        assert reply.usage.input_tokens == chat.usage.prompt_tokens and reply.instructions == instructions
        bare = await api.responses.create(**GREEDY, input=FRANCE, max_output_tokens=1)
        assert bare.usage.input_tokens != reply.usage.input_tokens  # NOTE: the instructions are in the prompt

    run(main)


def test_streamed_events_arrive_in_order_and_add_up(served):
    body = dict(**GREEDY, input=FRANCE, max_output_tokens=12)

    async def main():
        http, api = clients(served.app)
        whole = await api.responses.create(**body)
        events, names = await sse_events(http, body)
        for event in events:
            if "response" in event:
                check_sdk_shape(event["response"])
            else:
                STREAM_EVENT.validate_python(event)
        types = [e["type"] for e in events]
        assert names == types and [e["sequence_number"] for e in events] == list(range(len(events)))
        head = ["response.created", "response.in_progress", "response.output_item.added", "response.content_part.added"]
        tail = ["response.output_text.done", "response.content_part.done", "response.output_item.done", "response.completed"]
        assert types[:4] == head and types[-4:] == tail
        assert set(types[4:-4]) == {"response.output_text.delta"}
        item_id = events[2]["item"]["id"]
        deltas = events[4:-4]
        assert all(e["item_id"] == item_id and e["output_index"] == 0 for e in deltas)
        text = "".join(e["delta"] for e in deltas)
        assert text == whole.output_text and events[-4]["text"] == text
        final = events[-1]["response"]
        check_sdk_shape(final)
        assert final["status"] == "completed" and final["output"][0]["content"][0]["text"] == text
        assert final["usage"]["output_tokens"] == whole.usage.output_tokens
        assert events[0]["response"]["status"] == "in_progress" and events[0]["response"]["output"] == []

    run(main)


def test_max_output_tokens_makes_it_incomplete(served):
    async def main():
        http, api = clients(served.app)
        reply = await api.responses.create(**GREEDY, input=FRANCE, max_output_tokens=2)
        assert reply.status == "incomplete" and reply.incomplete_details.reason == "max_output_tokens"
        assert reply.usage.output_tokens == 2 and reply.output[0].status == "incomplete" and reply.output_text
        events, _ = await sse_events(http, dict(**GREEDY, input=FRANCE, max_output_tokens=2))
        assert events[-1]["type"] == "response.incomplete" and events[-1]["response"]["status"] == "incomplete"
        assert "response.completed" not in [e["type"] for e in events]

    run(main)


def test_forced_function_call_whole_and_streamed(served):
    body = dict(**GREEDY, input="What is the weather in Paris?", max_output_tokens=16, tools=[WEATHER], tool_choice=FORCE_WEATHER)

    async def main():
        http, api = clients(served.app)
        raw = await api.responses.with_raw_response.create(**body)
        check_sdk_shape(json.loads(raw.content))
        reply = raw.parse()
        (call,) = reply.output
        assert call.type == "function_call" and call.name == "get_weather" and call.status == "completed"
        assert call.call_id.startswith("call_") and call.id.startswith("fc_") and reply.status == "completed"
        jsonschema.validate(json.loads(call.arguments), WEATHER_PARAMETERS)
        assert reply.tools[0].name == "get_weather" and reply.output_text == ""

        stream = await api.responses.create(**body, stream=True)
        events = [e async for e in stream]
        types = [e.type for e in events]
        assert types[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
        assert types[-3:] == ["response.function_call_arguments.done", "response.output_item.done", "response.completed"]
        assert set(types[3:-3]) == {"response.function_call_arguments.delta"}
        assert events[2].item.type == "function_call" and events[2].item.name == "get_weather"
        arguments = "".join(e.delta for e in events[3:-3])
        assert arguments == events[-3].arguments == events[-1].response.output[0].arguments
        assert json.loads(arguments) == json.loads(call.arguments)

    run(main)


def test_a_function_call_output_turn_is_accepted(served):
    turn = [
        {"role": "user", "content": "What is the weather in Paris?"},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "Sunny, 24 C"},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "So, is it warm?"}]},
    ]

    async def main():
        _, api = clients(served.app)
        reply = await api.responses.create(**GREEDY, input=turn, tools=[WEATHER], tool_choice="none", max_output_tokens=4)
        assert reply.output[0].type == "message" and reply.output_text and reply.usage.output_tokens <= 4

    run(main)


BAD = [
    ({"previous_response_id": "resp_1"}, "previous_response_id", "stateless"),
    ({"tools": [{"type": "web_search"}]}, "tools", "web_search"),
    ({"text": {"format": {"type": "xml"}}}, "text", "text.format.type"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "objekt"}}}}, "text", "text.format.schema"),
    ({"max_output_tokens": 0}, "max_output_tokens", "max_output_tokens"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input", "item_reference"),
    ({"tool_choice": {"type": "file_search"}, "tools": [WEATHER]}, "tool_choice", "file_search"),
]


def test_bad_input_is_a_400_naming_the_parameter(served):
    async def main():
        http, api = clients(served.app)
        for extra, param, said in BAD:
            response = await http.post("/v1/responses", json={**GREEDY, "input": "Hi", "max_output_tokens": 1, **extra})
            assert response.status_code == 400, (extra, response.text)
            error = response.json()["error"]
            assert error["param"] == param and said in error["message"], (extra, error)
        with pytest.raises(openai.BadRequestError):
            await api.responses.create(**GREEDY, input="Hi", previous_response_id="resp_1")
        good = await api.responses.create(**GREEDY, input="Hi", max_output_tokens=1)
        assert good.usage.output_tokens == 1

    run(main)


class ScriptedEngine:
    """An EngineClient whose stream gives ``texts`` one chunk each, then ends: ``stop``, an
    error chunk (``error``) or raising (``raise``); counts the streams closed."""

    def __init__(self, texts: list[str], end: str):
        self.texts, self.end, self.closed = texts, end, 0

    async def generate(self, request):
        rid = request.request_id
        try:
            for i, text in enumerate(self.texts[:-1]):
                yield GenerateChunk(rid, [CompletionChunk(0, [5 + i], text)])
            if self.end == "raise":
                raise RuntimeError("the replica went away")
            if self.end == "error":
                yield GenerateChunk(rid, [CompletionChunk(0, [], "", finish_reason="error")], True, error="worker died")
                return
            last = CompletionChunk(0, [9], self.texts[-1], finish_reason="stop")
            yield GenerateChunk(rid, [last], True, 3, len(self.texts))
        finally:
            self.closed += 1


def scripted_app(served, engine: ScriptedEngine, **config_changes):
    config = served.llm.config
    if config_changes:
        config = ResolvedConfig.build({**thaw(config.config), **config_changes}, config.env, ())
    return create_app(engine, served.llm.tokenizer, ServeOptions(served_model_name=MODEL), config)


def test_reasoning_is_its_own_item_whole_and_streamed(served):
    """With --reasoning-parser the reasoning section is a reasoning item before the message."""
    texts = ["<think>", "The capital", " is Paris.", "</think>", "Paris", "."]

    async def main():
        app = scripted_app(served, ScriptedEngine(texts, "stop"), reasoning_parser="deepseek-r1")
        http, api = clients(app)
        raw = await api.responses.with_raw_response.create(model=MODEL, input=FRANCE)
        check_sdk_shape(json.loads(raw.content))
        reasoning, message = raw.parse().output
        assert reasoning.type == "reasoning" and reasoning.summary == [] and reasoning.id.startswith("rs_")
        assert reasoning.content[0].type == "reasoning_text" and "The capital is Paris." in reasoning.content[0].text
        assert message.type == "message" and message.content[0].text.strip() == "Paris."

        events, _ = await sse_events(http, dict(model=MODEL, input=FRANCE))
        types = [e["type"] for e in events]
        thinking = [e for e in events if e["type"] == "response.reasoning_text.delta"]
        said = [e for e in events if e["type"] == "response.output_text.delta"]
        assert {e["output_index"] for e in thinking} == {0} and {e["output_index"] for e in said} == {1}
        assert types.index("response.reasoning_text.done") < types.index("response.output_text.delta")
        assert "".join(e["delta"] for e in thinking) == reasoning.content[0].text
        assert "".join(e["delta"] for e in said) == message.content[0].text
        final = events[-1]["response"]
        assert events[-1]["type"] == "response.completed" and [i["type"] for i in final["output"]] == ["reasoning", "message"]

    run(main)


@pytest.mark.parametrize("end, reason", [("error", "worker died"), ("raise", "the replica went away")])
def test_an_engine_failure_mid_stream_is_response_failed(served, end, reason):
    async def main():
        engine = ScriptedEngine(["a", ""], end)
        http, _ = clients(scripted_app(served, engine))
        events, _ = await sse_events(http, dict(model=MODEL, input="Hi"))
        types = [e["type"] for e in events]
        assert types[-1] == "response.failed" and "response.completed" not in types
        failed = events[-1]["response"]
        assert failed["status"] == "failed" and reason in failed["error"]["message"]
        assert failed["id"] in failed["error"]["message"] and failed["output"][0]["content"][0]["text"] == "a"
        assert engine.closed == 1

    run(main)
