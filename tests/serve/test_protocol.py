"""The OpenAI protocol models, prompt handling and error mapping, without an engine:
validation errors name the parameter and the value, requests convert to SamplingParams,
responses and stream chunks have OpenAI's shapes."""

import json

import pytest

from flotilla.cluster.engine.limits import block_size_for

from flotilla.cluster.engine.outputs import Logprob
from flotilla.serve.prompts import normalize_prompts, prefix_key, render_chat
from flotilla.serve.protocol import (
    APIError,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatStreamChoice,
    CompletionRequest,
    DeltaMessage,
    Usage,
    parse_request,
)
from flotilla.serve.responses import SSE_DONE, chat_logprobs, completion_logprobs, engine_error, sse
from flotilla.serve.types import EngineOverloadedError, EngineUnavailableError

MESSAGES = [{"role": "user", "content": "hi"}]


def chat(**body) -> ChatCompletionRequest:
    return parse_request(ChatCompletionRequest, {"messages": MESSAGES, **body})


def rejected(model, body) -> APIError:
    with pytest.raises(APIError) as info:
        request = parse_request(model, body)
        request.to_sampling_params()
    assert info.value.status == 400
    return info.value


@pytest.mark.parametrize(
    "body, param, shown",
    [
        ({"max_tokens": -5}, "max_tokens", "-5"),
        ({"temperature": 3.5}, "temperature", "3.5"),
        ({"temperature": -0.1}, "temperature", "-0.1"),
        ({"top_p": 0}, "top_p", "0"),
        ({"n": 0}, "n", "0"),
        ({"max_tokens": "10"}, "max_tokens", "'10'"),  # strict: no string-to-int coercion
        ({"n": True}, "n", "True"),
        ({"seed": 2**64}, "seed", str(2**64)),
        ({"presence_penalty": 2.5}, "presence_penalty", "2.5"),
        ({"top_logprobs": 21, "logprobs": True}, "top_logprobs", "21"),
        ({"stop": 7}, "stop", "7"),
        ({"stream_options": {"include_usage": "yes"}}, "stream_options.include_usage", "'yes'"),
        ({"top_k": -5}, "top_k", "-5"),  # checked by SamplingParams
        ({"stop": [""]}, "stop", "['']"),  # checked by SamplingParams
        ({"top_logprobs": 2}, "top_logprobs", "logprobs=False"),
        ({"logit_bias": {"5": 1.0}}, "logit_bias", "'5'"),
        ({"stream_options": {"include_usage": True}}, "stream_options", "stream"),
        ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role", "'wizard'"),
        ({"functions": [{"name": "f"}]}, "functions", "function calling"),
        ({"chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs", "tokenize"),
        ({"stop": ["s"] * 65}, "stop", "at most 64"),
        ({"stop_token_ids": list(range(257))}, "stop_token_ids", "at most 256"),
    ],
)
def test_chat_validation_names_parameter_and_value(body, param, shown):
    err = rejected(ChatCompletionRequest, {"messages": MESSAGES, **body})
    assert err.param == param
    assert param.split(".")[0] in err.message and shown in err.message


def test_message_errors_point_into_the_list():
    assert rejected(ChatCompletionRequest, {}).message == "messages is required"
    err = rejected(ChatCompletionRequest, {"messages": [{"content": "hi"}]})
    assert err.param == "messages[0].role" and "required" in err.message
    err = rejected(ChatCompletionRequest, {"messages": "hi"})
    assert err.param == "messages" and "'hi'" in err.message
    err = rejected(ChatCompletionRequest, {"messages": []})
    assert err.param == "messages"
    with pytest.raises(APIError, match="JSON object") as info:
        parse_request(ChatCompletionRequest, [1, 2])
    assert info.value.status == 400


def test_chat_converts_to_sampling_params():
    params = chat(
        model="m",
        max_tokens=5,
        max_completion_tokens=7,
        temperature=0,
        top_p=0.5,
        n=2,
        stop="END",
        seed=3,
        logprobs=True,
        top_logprobs=4,
        presence_penalty=0.5,
        frequency_penalty=-0.5,
        top_k=0,
        min_p=0.1,
        repetition_penalty=1.2,
        ignore_eos=True,
        skip_special_tokens=False,
        stop_token_ids=[2],
        include_stop_str_in_output=True,
        some_new_openai_field={"ignored": True},
    ).to_sampling_params()
    assert params.max_tokens == 7  # max_completion_tokens wins over the deprecated max_tokens
    assert (params.temperature, params.top_p, params.n, params.seed) == (0, 0.5, 2, 3)
    assert params.stop == ["END"] and params.stop_token_ids == [2]
    assert params.logprobs == 4 and params.top_k == -1 and params.min_p == 0.1
    assert (params.presence_penalty, params.frequency_penalty, params.repetition_penalty) == (0.5, -0.5, 1.2)
    assert params.ignore_eos and not params.skip_special_tokens and params.include_stop_str_in_output


def test_chat_defaults():
    request = chat(stream=True, stream_options={"include_usage": True}, temperature=None)
    params = request.to_sampling_params()
    assert params.max_tokens is None  # up to the context, as at OpenAI
    assert params.temperature == 1.0 and params.logprobs is None and params.n == 1
    assert request.include_usage
    assert chat(logprobs=True).to_sampling_params().logprobs == 0
    assert not chat(stream=False).include_usage


def test_completion_prompt_forms_and_conversion():
    for prompt in ("hi", ["a", "b"], [1, 2, 3], [[1, 2], [3]]):
        assert parse_request(CompletionRequest, {"prompt": prompt}).prompt == prompt
    params = parse_request(CompletionRequest, {"prompt": "x", "logprobs": 2}).to_sampling_params()
    assert params.max_tokens == 16 and params.logprobs == 2  # OpenAI's completions default
    err = rejected(CompletionRequest, {"prompt": [1, "a"]})
    assert err.param == "prompt" and "token-id lists" in err.message and "[1, 'a']" in err.message
    assert rejected(CompletionRequest, {"prompt": [True, 2]}).param == "prompt"
    assert rejected(CompletionRequest, {}).message == "prompt is required"
    err = rejected(CompletionRequest, {"prompt": "x", "echo": True})
    assert err.param == "echo" and "echo=false" in err.message
    assert rejected(CompletionRequest, {"prompt": "x", "best_of": 3}).param == "best_of"
    assert rejected(CompletionRequest, {"prompt": "x", "logprobs": -1}).param == "logprobs"


class CharTokenizer:
    """One token per character (its code point); a chat template that tags roles."""

    chat_template = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"

    def encode(self, text, add_special_tokens=True):
        return [ord(c) for c in text]

    def apply_chat_template(self, conversation, tokenize, add_generation_prompt, chat_template=None, **kwargs):
        if conversation[-1]["content"] == "boom":
            raise RuntimeError("Conversation roles must alternate")
        text = "".join(f"<{m['role']}>{m['content']}" for m in conversation)
        return text + ("<assistant>" if add_generation_prompt else "")


def test_normalize_prompts():
    tok = CharTokenizer()
    assert [p.token_ids for p in normalize_prompts("ab", tok)] == [[97, 98]]
    assert [p.text for p in normalize_prompts(["a", "b"], tok)] == ["a", "b"]
    assert [p.token_ids for p in normalize_prompts([5, 6], tok)] == [[5, 6]]
    assert [p.token_ids for p in normalize_prompts([[5], [6, 7]], None)] == [[5], [6, 7]]
    for bad, where in (([], "prompt"), ("", "prompt"), ([[1], []], "prompt[1]"), ([-1, 2], "negative")):
        with pytest.raises(APIError, match=where.replace("[", r"\[")) as info:
            normalize_prompts(bad, tok)
        assert info.value.status == 400 and info.value.param == "prompt"
    with pytest.raises(APIError, match="no tokenizer"):
        normalize_prompts("text", None)


def test_render_chat():
    tok = CharTokenizer()
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    messages = chat(messages=[{"role": "user", "content": parts}]).messages
    prompt = render_chat(tok, messages)
    assert prompt.text == "<user>a\nb<assistant>" and prompt.token_ids == [ord(c) for c in prompt.text]
    assert render_chat(tok, messages, add_generation_prompt=False).text == "<user>a\nb"
    bad = (("boom", "rejected the conversation: Conversation roles"), ([{"type": "image_url"}], "image_url"))
    for content, match in bad:
        with pytest.raises(APIError, match=match) as info:
            render_chat(tok, chat(messages=[{"role": "user", "content": content}]).messages)
        assert info.value.param == "messages"
    with pytest.raises(APIError, match="no tokenizer"):
        render_chat(None, messages)


def test_prefix_key():
    block = list(range(100, 116))
    assert prefix_key(block[:15]) is None
    key = prefix_key(block + [1, 2])
    assert key == prefix_key(block + [9]) == prefix_key(block)
    assert key != prefix_key([7] + block[1:])
    assert 0 <= key < 2**63
    assert prefix_key(list(range(32)), 32) is not None and prefix_key(list(range(31)), 32) is None

    class Config:
        page_size = None

    assert block_size_for(Config()) == 16
    Config.page_size = 32
    assert block_size_for(Config()) == 32


def test_response_shapes():
    chunk = ChatCompletionChunk(
        id="c",
        created=1,
        model="m",
        choices=[ChatStreamChoice(index=0, delta=DeltaMessage(role="assistant", content=""))],
    )
    frame = sse(chunk)
    assert frame.startswith("data: ") and frame.endswith("\n\n") and SSE_DONE == "data: [DONE]\n\n"
    data = json.loads(frame[len("data: ") :])
    assert data["object"] == "chat.completion.chunk"
    assert data["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert ChatStreamChoice(index=0, delta=DeltaMessage(content="x")).model_dump()["delta"] == {"content": "x"}
    usage = Usage.of(10, 3, 8).model_dump()
    assert usage == {
        "prompt_tokens": 10,
        "completion_tokens": 3,
        "total_tokens": 13,
        "prompt_tokens_details": {"cached_tokens": 8},
    }
    envelope = APIError(404, "nope", "model", code="model_not_found").envelope()
    error = {"message": "nope", "type": "invalid_request_error", "param": "model", "code": "model_not_found"}
    assert envelope == {"error": error}


def test_logprobs_shapes():
    steps = [
        {5: Logprob(-0.1, 1, "He"), 6: Logprob(-2.0, 2, "Sh"), 9: Logprob(-5.0, 40, "é")},
        {7: Logprob(-0.5, 1, "llo")},
    ]
    decode = lambda step, t: step[t].decoded_token  # noqa: E731
    content = chat_logprobs([9, 7], steps, 2, decode)
    assert [c.token for c in content] == ["é", "llo"]
    assert content[0].bytes == [0xC3, 0xA9] and content[0].logprob == -5.0
    # top_logprobs: the 2 most likely, best first (the sampled token need not be among them).
    assert [(t.token, t.logprob) for t in content[0].top_logprobs] == [("He", -0.1), ("Sh", -2.0)]
    legacy = completion_logprobs([9, 7], steps, 1, decode, offset=4)
    assert legacy.tokens == ["é", "llo"] and legacy.token_logprobs == [-5.0, -0.5]
    assert legacy.top_logprobs == [{"He": -0.1, "é": -5.0}, {"llo": -0.5}]
    assert legacy.text_offset == [4, 5]


def test_engine_errors_map_to_statuses():
    too_long = ValueError("prompt_token_ids: the prompt has 9000 tokens, but the context length is 8192")
    err = engine_error(too_long, "messages")
    assert (err.status, err.param) == (400, "messages") and "9000" in err.message
    assert engine_error(ValueError("max_tokens: the request needs 99 tokens"), "prompt").param == "max_tokens"
    err = engine_error(EngineOverloadedError("queue full", retry_after_s=3), "prompt")
    assert (err.status, err.headers, err.code) == (429, {"Retry-After": "3"}, "rate_limit_exceeded")
    assert engine_error(EngineUnavailableError("dead"), "prompt").status == 503

    class Wrapped(RuntimeError):  # how Ray hands back a replica's exception
        cause = ValueError("top_k must be -1 (disabled) or at least 1, got top_k=0")

    assert engine_error(Wrapped("traceback..."), "prompt").param == "top_k"
    assert engine_error(RuntimeError("worker died"), "prompt").status == 503
