"""The agent-facing API over HTTP (SmolLM2-135M-Instruct behind the ingress, served by
uvicorn on loopback): structured outputs (``response_format`` json_schema strict and not,
json_object, the vLLM/SGLang extras), tool calls (``required``, a named function, ``auto``
through the hermes parser, streamed deltas, a tool-result turn), reasoning content, models
.retrieve, /tokenize and /detokenize, the bad-input 400s, and the openai client, langchain-openai
and litellm against all of it.

Sampled answers use temperature 0.7 with seeds, so they are reproducible but not greedy; what
is asserted is what the grammar guarantees (the answer parses and validates), never a text."""

import json
import re
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import jsonschema
import openai
import pytest
import uvicorn

from flotilla.cluster.engine.llm import LLM
from flotilla.resolution.config import ResolvedConfig, thaw
from flotilla.serve.async_engine import AsyncEngine
from flotilla.serve.ingress import create_app
from flotilla.serve.types import ServeOptions

MODEL = "smollm2"
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "age": {"type": "integer", "minimum": 18, "maximum": 90},
        "role": {"enum": ["engineer", "doctor", "teacher"]},
    },
    "required": ["name", "age", "role"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 20}, "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 12}}, "required": ["zone"]},
    },
}
ASK_WEATHER = [{"role": "user", "content": "What is the weather in Paris?"}]


def free_loopback_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Server:
    """uvicorn serving ``app`` on a loopback port in a thread."""

    def __init__(self, app):
        self.port = free_loopback_port()
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.05)
        self.url = f"http://127.0.0.1:{self.port}"

    def stop(self):
        self.server.should_exit = True
        self.thread.join(timeout=10)


@pytest.fixture(scope="module")
def served():
    """Two apps over one engine: ``plain`` has no parsers, ``agent`` has --tool-call-parser
    hermes and --reasoning-parser deepseek-r1."""
    llm = LLM(max_total_tokens=8192)
    engine = AsyncEngine(llm.engine, replica_id="agent-test")
    options = ServeOptions(served_model_name=MODEL)
    config = llm.config
    agent_config = ResolvedConfig.build({**thaw(config.config), "tool_call_parser": "hermes"}, config.env, ())
    r1_config = ResolvedConfig.build({**thaw(config.config), "reasoning_parser": "deepseek-r1"}, config.env, ())
    servers = {
        name: _Server(create_app(engine, llm.tokenizer, options, c, max_model_len=llm.engine.context_len))
        for name, c in (("plain", config), ("agent", agent_config), ("r1", r1_config))
    }
    yield {name: s.url for name, s in servers.items()} | {"tokenizer": llm.tokenizer}
    for s in servers.values():
        s.stop()
    engine.shutdown()


def together(*calls):
    """Run the calls at once (their requests share the engine's steps); their results in order."""
    with ThreadPoolExecutor(len(calls)) as pool:
        return [f.result() for f in [pool.submit(c) for c in calls]]


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(api_key="unused", base_url=f"{url}/v1", max_retries=0, timeout=120)


def assert_400(response: httpx.Response, param: str) -> str:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param, error
    return error["message"]


def still_serving(url: str) -> None:
    out = client(url).chat.completions.create(model=MODEL, messages=ASK_WEATHER, max_tokens=2, temperature=0)
    assert out.choices[0].finish_reason == "length"


# -- structured outputs --------------------------------------------------------------------------


def test_json_schema_strict_answers_parse_and_validate_at_temperature_0_7(served):
    api = client(served["plain"])
    prompts = ["Invent a person.", "Describe a doctor you know.", "Who teaches at your school?"]
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}

    def ask(i, prompt):
        messages = [{"role": "user", "content": prompt}]
        return lambda: api.chat.completions.create(model=MODEL, messages=messages, response_format=fmt, temperature=0.7, seed=i, max_tokens=60)

    for out in together(*(ask(i, p) for i, p in enumerate(prompts))):
        choice = out.choices[0]
        assert choice.finish_reason == "stop", choice
        jsonschema.validate(json.loads(choice.message.content), PERSON)


def test_json_schema_not_strict_and_json_object_and_streaming(served):
    api = client(served["plain"])
    loose = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON | {"additionalProperties": True}, "strict": False}}
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    texts, finishes = {0: "", 1: ""}, {}

    def streamed():
        stream = api.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Invent a person."}], response_format=fmt, temperature=0.7, seed=5, max_tokens=60, stream=True, n=2)
        for chunk in stream:
            for c in chunk.choices:
                texts[c.index] += c.delta.content or ""
                if c.finish_reason:
                    finishes[c.index] = c.finish_reason

    out, anything, _ = together(
        lambda: api.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "A person, please."}], response_format=loose, temperature=0.7, seed=3, max_tokens=60),
        lambda: api.chat.completions.create(model=MODEL, messages=ASK_WEATHER, response_format={"type": "json_object"}, temperature=0.7, seed=1, max_tokens=60),
        streamed,
    )
    jsonschema.validate(json.loads(out.choices[0].message.content), PERSON)
    assert isinstance(json.loads(anything.choices[0].message.content), dict)
    assert finishes == {0: "stop", 1: "stop"}
    for text in texts.values():
        jsonschema.validate(json.loads(text), PERSON)


def test_the_extras_regex_choice_and_ebnf_constrain_chat_and_completions(served):
    url = served["plain"]
    chat = {"model": MODEL, "messages": ASK_WEATHER, "temperature": 0.7, "seed": 2, "max_tokens": 12}
    regex = httpx.post(f"{url}/v1/chat/completions", json=chat | {"regex": "(sunny|rainy), [0-9]{1,2} degrees"}, timeout=120).json()
    assert re.fullmatch(r"(sunny|rainy), [0-9]{1,2} degrees", regex["choices"][0]["message"]["content"])
    choice = httpx.post(f"{url}/v1/chat/completions", json=chat | {"structured_outputs": {"choice": ["yes", "no"]}}, timeout=120).json()
    assert choice["choices"][0]["message"]["content"] in ("yes", "no")
    completion = {"model": MODEL, "prompt": "The answer to 6 * 7 is", "max_tokens": 8, "temperature": 0}
    ebnf = httpx.post(f"{url}/v1/completions", json=completion | {"ebnf": 'root ::= " " [0-9]+ "."'}, timeout=120).json()
    assert re.fullmatch(r" [0-9]+\.", ebnf["choices"][0]["text"]), ebnf


def test_a_json_answer_cut_by_max_tokens_says_length(served):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    out = client(served["plain"]).chat.completions.create(model=MODEL, messages=ASK_WEATHER, response_format=fmt, max_tokens=4, temperature=0)
    assert out.choices[0].finish_reason == "length"
    with pytest.raises(ValueError):
        json.loads(out.choices[0].message.content)


# -- tools ------------------------------------------------------------------------------------------


def call_args(call, tool) -> dict:
    assert call.type == "function" and call.function.name == tool["function"]["name"] and call.id.startswith("call_")
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, tool["function"]["parameters"])
    return arguments


def streamed_calls(stream) -> tuple[list[dict], str | None]:
    calls: dict[int, dict] = {}
    finish = None
    for chunk in stream:
        for c in chunk.choices:
            for d in c.delta.tool_calls or []:
                call = calls.setdefault(d.index, {"id": None, "name": None, "arguments": ""})
                if d.id:
                    call["id"] = d.id
                if d.function.name:
                    call["name"] = d.function.name
                call["arguments"] += d.function.arguments or ""
            finish = c.finish_reason or finish
    return [calls[i] for i in sorted(calls)], finish


def test_tool_choice_named_forces_valid_arguments_streamed_or_not(served):
    api = client(served["plain"])
    named = {"type": "function", "function": {"name": "get_weather"}}
    request = dict(model=MODEL, messages=ASK_WEATHER, tools=[WEATHER, TIME], tool_choice=named, temperature=0.7, seed=11, max_tokens=40)
    out, (calls, finish) = together(lambda: api.chat.completions.create(**request), lambda: streamed_calls(api.chat.completions.create(**request, stream=True)))
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and not choice.message.content
    (call,) = choice.message.tool_calls
    arguments = call_args(call, WEATHER)
    assert finish == "tool_calls" and len(calls) == 1
    assert calls[0]["name"] == "get_weather" and calls[0]["id"].startswith("call_")
    assert json.loads(calls[0]["arguments"]) == arguments  # NOTE: same seed, same tokens


def test_tool_choice_required_calls_a_listed_tool_with_valid_arguments(served):
    api = client(served["plain"])
    request = dict(model=MODEL, messages=ASK_WEATHER, tools=[WEATHER, TIME], tool_choice="required", temperature=0.7, seed=4, max_tokens=80, parallel_tool_calls=False)
    out, (calls, finish) = together(lambda: api.chat.completions.create(**request), lambda: streamed_calls(api.chat.completions.create(**request, stream=True)))
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    tool = {"get_weather": WEATHER, "get_time": TIME}[call.function.name]
    arguments = call_args(call, tool)
    assert finish == "tool_calls" and [(c["name"], json.loads(c["arguments"])) for c in calls] == [(call.function.name, arguments)]


def test_a_tool_result_turn_is_accepted_and_answered(served):
    api = client(served["plain"])
    turn = ASK_WEATHER + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21}'},
    ]
    out = api.chat.completions.create(model=MODEL, messages=turn, tools=[WEATHER], tool_choice="none", max_tokens=8, temperature=0)
    assert out.choices[0].message.content and out.choices[0].finish_reason == "length"
    assert not out.choices[0].message.tool_calls


def test_auto_tool_choice_parses_hermes_calls_from_the_output(served):
    """With --tool-call-parser hermes, an output in hermes' format becomes a tool call, whole
    and streamed (the output is steered into that format by a regex constraint: SmolLM2 does
    not call tools on its own)."""
    api = client(served["agent"])
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>'
    request = dict(model=MODEL, messages=ASK_WEATHER, tools=[WEATHER], max_tokens=60, temperature=0, extra_body={"regex": re.escape(call)})
    out, (calls, finish), plain = together(
        lambda: api.chat.completions.create(**request),
        lambda: streamed_calls(api.chat.completions.create(**request, stream=True)),
        lambda: api.chat.completions.create(model=MODEL, messages=ASK_WEATHER, tools=[WEATHER], max_tokens=6, temperature=0),
    )
    choice, plain = out.choices[0], plain.choices[0]
    assert choice.finish_reason == "tool_calls" and not choice.message.content
    assert call_args(choice.message.tool_calls[0], WEATHER) == {"city": "Paris", "unit": "celsius"}
    assert finish == "tool_calls" and [(c["name"], json.loads(c["arguments"])) for c in calls] == [("get_weather", {"city": "Paris", "unit": "celsius"})]
    assert plain.message.content and not plain.message.tool_calls and plain.finish_reason == "length"


def test_the_reasoning_parser_splits_reasoning_content(served):
    """deepseek-r1: generation starts inside the reasoning section, which the output closes
    with </think> (steered here by a regex; the grammar applies after the section, so the
    regex holds the whole output only while no reasoning parser gates it: the r1 app's
    grammar waits for </think>, which SmolLM2 never writes on its own)."""
    api = client(served["r1"])
    out = api.chat.completions.create(model=MODEL, messages=ASK_WEATHER, max_tokens=6, temperature=0)
    message = out.choices[0].message
    assert message.reasoning_content and not message.content  # NOTE: no </think>: all reasoning
    text = client(served["plain"]).chat.completions.create(model=MODEL, messages=ASK_WEATHER, max_tokens=6, temperature=0).choices[0].message.content
    assert message.reasoning_content == text.strip()
    streamed = "".join(c.choices[0].delta.model_extra.get("reasoning_content") or "" for c in api.chat.completions.create(model=MODEL, messages=ASK_WEATHER, max_tokens=6, temperature=0, stream=True) if c.choices)
    assert streamed == message.reasoning_content
    kept = api.chat.completions.create(model=MODEL, messages=ASK_WEATHER, max_tokens=6, temperature=0, extra_body={"separate_reasoning": False})
    assert kept.choices[0].message.content == text


# -- the small routes ----------------------------------------------------------------------------------


def test_models_retrieve_and_tokenize_round_trip(served):
    url = served["plain"]
    card = client(url).models.retrieve(MODEL)
    assert card.id == MODEL and card.object == "model"
    tokens = httpx.post(f"{url}/tokenize", json={"prompt": "Hello, world!"}).json()
    assert tokens["count"] == len(tokens["tokens"]) > 0 and tokens["max_model_len"] > 0
    assert httpx.post(f"{url}/detokenize", json={"tokens": tokens["tokens"]}).json() == {"prompt": "Hello, world!"}
    chat = httpx.post(f"{url}/tokenize", json={"messages": ASK_WEATHER, "return_token_strs": True}).json()
    assert len(chat["token_strs"]) == chat["count"]
    assert httpx.post(f"{url}/detokenize", json={"tokens": chat["tokens"]}).json()["prompt"].endswith("assistant\n")
    assert_400(httpx.post(f"{url}/detokenize", json={"tokens": [10**9]}), "tokens")


# -- bad input --------------------------------------------------------------------------------------------


def test_bad_agent_requests_get_400s_naming_the_parameter_and_the_server_keeps_serving(served):
    url = f"{served['plain']}/v1/chat/completions"
    base = {"model": MODEL, "messages": ASK_WEATHER, "max_tokens": 4}
    bad_type = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "properties": {"a": {"type": "strin"}}}}}
    message = assert_400(httpx.post(url, json=base | {"response_format": bad_type}), "response_format")
    assert "response_format.json_schema.schema.properties.a.type" in message
    uncompilable = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "string", "pattern": "(unclosed"}}}
    assert_400(httpx.post(url, json=base | {"response_format": uncompilable}), "response_format")
    assert_400(httpx.post(url, json=base | {"regex": "(unclosed"}), "regex")
    unknown = {"type": "function", "function": {"name": "get_stock"}}
    assert "get_stock" in assert_400(httpx.post(url, json=base | {"tools": [WEATHER], "tool_choice": unknown}), "tool_choice")
    assert "--tool-call-parser" in assert_400(httpx.post(url, json=base | {"tools": [WEATHER]}), "tool_choice")
    assert_400(httpx.post(url, json=base | {"tools": [WEATHER], "tool_choice": "auto"}), "tool_choice")
    assert_400(httpx.post(url, json=base | {"tool_choice": "required"}), "tool_choice")
    assert_400(httpx.post(url, json=base | {"tools": [{"type": "function", "function": {"name": "bad name!"}}], "tool_choice": "required"}), "tools")
    assert_400(httpx.post(url, json=base | {"response_format": {"type": "xml"}}), "response_format")
    assert_400(httpx.post(url, json=base | {"regex": "a", "ebnf": 'root ::= "a"'}), "ebnf")
    assert_400(httpx.post(url, json=base | {"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}), "tool_choice")
    still_serving(served["plain"])


# -- other clients ----------------------------------------------------------------------------------------


def test_langchain_openai_structured_output_bound_tools_and_embeddings(served):
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI, OpenAIEmbeddings
    from pydantic import BaseModel, Field

    class Person(BaseModel):
        name: str = Field(max_length=16)
        age: int = Field(ge=18, le=90)

    @tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        return "sunny"

    chat = ChatOpenAI(model=MODEL, base_url=f"{served['plain']}/v1", api_key="unused", temperature=0.7, seed=1, max_tokens=60, max_retries=0)
    person = chat.with_structured_output(Person, method="json_schema").invoke("Invent a person.")
    assert isinstance(person, Person)
    message = chat.bind_tools([get_weather], tool_choice="get_weather").invoke("What is the weather in Paris?")
    (call,) = message.tool_calls
    assert call["name"] == "get_weather" and isinstance(call["args"]["city"], str)
    # NOTE: check_embedding_ctx_length would count tokens with tiktoken's OpenAI vocabulary.
    embedder = OpenAIEmbeddings(model=MODEL, base_url=f"{served['plain']}/v1", api_key="unused", check_embedding_ctx_length=False, max_retries=0)
    first, second = embedder.embed_documents(["a cat", "a dog"])
    assert len(first) == 576 and first != second


def test_litellm_completion_with_a_schema_a_forced_tool_and_embeddings(served):
    import litellm

    common = dict(model=f"openai/{MODEL}", api_base=f"{served['plain']}/v1", api_key="unused", max_tokens=60, temperature=0.7, seed=2)
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    out = litellm.completion(messages=[{"role": "user", "content": "Invent a person."}], response_format=fmt, **common)
    jsonschema.validate(json.loads(out.choices[0].message.content), PERSON)
    out = litellm.completion(messages=ASK_WEATHER, tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_weather"}}, **common)
    (call,) = out.choices[0].message.tool_calls
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    vectors = litellm.embedding(model=f"openai/{MODEL}", api_base=f"{served['plain']}/v1", api_key="unused", input=["a cat", "a dog"])
    assert [len(d["embedding"]) for d in vectors.data] == [576, 576]


# -- embeddings ------------------------------------------------------------------------------------------


def test_embeddings_are_deterministic_distinct_and_agree_across_encodings(served):
    """SmolLM2's normalised final hidden states through the engine (the vectors themselves are
    checked against HF in tests/cluster/engine/test_pooling.py). Batched and one by one: the
    same float32 computation except for the batch's summation order (SmolLM2's logits agree
    with HF to 3e-5 at magnitude ~30, i.e. ~1e-6 relative; a unit vector's 576 components are
    ~0.04 each), so 1e-4 leaves ample room while another input's vector differs by > 1e-2."""
    import base64

    import numpy as np

    api = client(served["plain"])
    texts = ["The cat sat on the mat.", "Quantum chromodynamics describes quarks.", "The cat sat on the mat."]
    batch, one, base64_batch, mean = together(
        lambda: api.embeddings.create(model=MODEL, input=texts),
        lambda: api.embeddings.create(model=MODEL, input=texts[1]),
        lambda: httpx.post(f"{served['plain']}/v1/embeddings", json={"model": MODEL, "input": texts, "encoding_format": "base64"}, timeout=60).json(),
        lambda: httpx.post(f"{served['plain']}/v1/embeddings", json={"model": MODEL, "input": texts[0], "pooling": "mean"}, timeout=60).json(),
    )
    vectors = [np.array(d.embedding) for d in sorted(batch.data, key=lambda d: d.index)]
    assert [d.index for d in batch.data] == [0, 1, 2] and all(len(v) == 576 for v in vectors)
    assert batch.usage.prompt_tokens == batch.usage.total_tokens > 0
    assert np.array_equal(vectors[0], vectors[2])  # NOTE: the same input, the same computation
    assert all(abs(np.linalg.norm(v) - 1) < 1e-5 for v in vectors)
    assert float(vectors[0] @ vectors[1]) < 0.999
    np.testing.assert_allclose(np.array(one.data[0].embedding), vectors[1], atol=1e-4)
    decoded = [np.frombuffer(base64.b64decode(d["embedding"]), dtype="<f4") for d in base64_batch["data"]]
    np.testing.assert_array_equal(decoded[0], vectors[0].astype(np.float32))
    mean_vector = np.array(mean["data"][0]["embedding"])
    assert float(mean_vector @ vectors[0]) < 0.999
    tokens = httpx.post(f"{served['plain']}/tokenize", json={"prompt": texts[0]}).json()["tokens"]
    by_ids = api.embeddings.create(model=MODEL, input=[tokens])
    np.testing.assert_allclose(np.array(by_ids.data[0].embedding), vectors[0], atol=1e-4)


def test_bad_embedding_requests_get_400s_and_the_server_keeps_serving(served):
    url = f"{served['plain']}/v1/embeddings"
    assert_400(httpx.post(url, json={"model": MODEL, "input": []}), "input")
    assert_400(httpx.post(url, json={"model": MODEL, "input": ""}), "input")
    assert_400(httpx.post(url, json={"model": MODEL, "input": [[10**9]]}), "input")
    assert_400(httpx.post(url, json={"model": MODEL, "input": "a " * 9000}), "input")
    assert_400(httpx.post(url, json={"model": MODEL, "input": "hi", "encoding_format": "int8"}), "encoding_format")
    assert_400(httpx.post(url, json={"model": MODEL, "input": "hi", "pooling": "max"}), "pooling")
    assert_400(httpx.post(url, json={"model": MODEL, "input": "hi", "dimensions": 64}), "dimensions")
    assert httpx.post(url, json={"model": "other", "input": "hi"}).status_code == 404
    assert len(client(served["plain"]).embeddings.create(model=MODEL, input="still here").data[0].embedding) == 576
