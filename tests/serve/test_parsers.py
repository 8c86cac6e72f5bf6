"""The tool-call and reasoning parsers on their own (pure text): each format whole, streamed
in every split (one character at a time and seeded random pieces: the streamed content and
calls equal the whole parse), cut-off calls, unknown functions, and the support table's lists
against the registries."""

import json
import random

import pytest

from flotilla.cluster.engine.grammar import GRAMMAR_BACKENDS
from flotilla.resolution import runtime_support_table as table
from flotilla.serve.reasoning_parsers import REASONING_PARSERS, reasoning_parser_for
from flotilla.serve.tool_parsers import TOOL_PARSERS, tool_parser_for

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}},
]
WEATHER = ("get_weather", {"city": "Paris"})
TIME = ("get_time", {})

# parser -> (output, expected content, expected calls)
OUTPUTS = {
    "hermes": [
        ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>', "Let me check.", [WEATHER, TIME]),
        ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>', "", [WEATHER]),
        ('<tool_call>\n{"name": "get_stock", "arguments": {}}\n</tool_call>', '<tool_call>\n{"name": "get_stock", "arguments": {}}\n</tool_call>', []),
        ('Sure.\n<tool_call>\n{"name": "get_weather", "argu', 'Sure.\n<tool_call>\n{"name": "get_weather", "argu', []),
        ("Just an answer, no <tool call here.", "Just an answer, no <tool call here.", []),
    ],
    "llama3": [
        ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "get_time", "parameters": {}}', "", [WEATHER, TIME]),
        ('{"name": "get_weather", "arguments": {"city": "Paris"}}', "", [WEATHER]),
        ('{"name": "get_weather", "parameters": {"city": "Par', '{"name": "get_weather", "parameters": {"city": "Par', []),
        ("The weather is {unknown}.", "The weather is {unknown}.", []),
    ],
    "mistral": [
        ('Sure [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "get_time", "arguments": {}}]', "Sure", [WEATHER, TIME]),
        ('[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{}', "", [WEATHER, TIME]),
        ('[TOOL_CALLS] [{"name": "get_weather", "arguments": {"ci', '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"ci', []),
    ],
    "deepseekv3": [
        ("ok<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n{\"city\": \"Paris\"}\n```<｜tool▁call▁end｜>"
         "<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_time\n```json\n{}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>", "ok", [WEATHER, TIME]),
        ('<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>', "", [WEATHER]),
        ("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n{\"ci", "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n{\"ci", []),
    ],
    "glm45": [
        ("hm <tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n</tool_call><tool_call>get_time\n</tool_call>", "hm", [("get_weather", {"city": "Paris", "days": 3}), TIME]),
        ("<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>123</arg_value>\n</tool_call>", "", [("get_weather", {"city": "123"})]),
        ("<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_va", "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_va", []),
    ],
    "kimi_k2": [
        ('x<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>{"city": "Paris"}<|tool_call_end|>'
         "<|tool_call_begin|>functions.get_time:1<|tool_call_argument_begin|>{}<|tool_call_end|><|tool_calls_section_end|>", "x", [WEATHER, TIME]),
    ],
    "pythonic": [
        ('[get_weather(city="Paris"), get_time()]', "", [WEATHER, TIME]),
        ("[1, 2, 3] are numbers", "[1, 2, 3] are numbers", []),
        ('[get_weather(city="Par', '[get_weather(city="Par', []),
    ],
}
CASES = [(name, *case) for name, cases in OUTPUTS.items() for case in cases]


def pieces(text: str, seed: int) -> list[str]:
    """``text`` in pieces: one character each (seed 0), else random 1-6 character pieces."""
    if seed == 0:
        return list(text)
    rnd, out, i = random.Random(seed), [], 0
    while i < len(text):
        j = i + rnd.randint(1, 6)
        out.append(text[i:j])
        i = j
    return out


@pytest.mark.parametrize("name, text, content, calls", CASES)
def test_tool_parsers_whole_and_in_every_split(name, text, content, calls):
    parser = tool_parser_for(name, TOOLS)
    got_content, got_calls = parser.parse(text)
    assert got_content == content
    assert [(c.name, json.loads(c.arguments)) for c in got_calls] == calls
    assert all(c.id.startswith("call_") or c.id.startswith("functions.") for c in got_calls)
    for seed in range(8):
        stream, shown, deltas = parser.streamer(), "", []
        for piece in pieces(text, seed):
            text_out, new = stream.feed(piece)
            shown, deltas = shown + text_out, deltas + new
        text_out, new = stream.finish()
        shown, deltas = shown + text_out, deltas + new
        assert shown == content, (seed, shown)
        assert [(d.index, d.name, json.loads(d.arguments)) for d in deltas] == [(i, n, a) for i, (n, a) in enumerate(calls)]
        assert all(d.id for d in deltas)


def test_content_before_a_call_streams_as_it_comes_and_nothing_of_the_markup_leaks():
    stream = tool_parser_for("hermes", TOOLS).streamer()
    assert stream.feed("Checking the ") == ("Checking the", [])
    assert stream.feed("weather <tool") == (" weather", [])  # NOTE: "<tool" may start a marker
    assert stream.feed('_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>') == ("", [])
    content, deltas = stream.finish()
    assert content == "" and [(d.name, d.arguments) for d in deltas] == [("get_weather", '{"city": "Paris"}')]


def test_without_tools_the_text_is_content():
    parser = tool_parser_for("hermes", [])
    text = '<tool_call>{"name": "get_weather", "arguments": {}}</tool_call>'
    assert parser.parse(text) == (text, [])


def test_unknown_parser_names_the_flag():
    with pytest.raises(ValueError, match="tool_call_parser='nope'"):
        tool_parser_for("nope", TOOLS)
    with pytest.raises(ValueError, match="reasoning_parser='nope'"):
        reasoning_parser_for("nope")


REASONING = [
    # (text, generation starts inside, reasoning, content)
    ("<think>\nLet me see.\n</think>\n\nThe answer is 4.", False, "Let me see.", "The answer is 4."),
    ("Let me see. </think> Four.", True, "Let me see.", "Four."),
    ("<think>Let me see.</think>Four.", True, "Let me see.", "Four."),
    ("Just the answer.", False, None, "Just the answer."),
    ("  still thinking <thi", True, "still thinking <thi", ""),
    ("<think> never closes  ", False, "never closes", ""),
    ("<thinking is a word", False, None, "<thinking is a word"),
]


@pytest.mark.parametrize("name", ["deepseek-r1", "qwen3", "glm45"])
@pytest.mark.parametrize("text, inside, reasoning, content", REASONING)
def test_reasoning_split_whole_and_in_every_split(name, text, inside, reasoning, content):
    parser = reasoning_parser_for(name)
    assert parser.split(text, inside) == (reasoning, content)
    for seed in range(8):
        stream, got_reasoning, got_content = parser.streamer(inside), "", ""
        for piece in pieces(text, seed):
            r, c = stream.feed(piece)
            got_reasoning, got_content = got_reasoning + r, got_content + c
        r, c = stream.finish()
        assert (got_reasoning + r, got_content + c) == (reasoning or "", content), seed


def test_where_generation_starts():
    assert reasoning_parser_for("deepseek-r1").starts_in_reasoning("anything")
    qwen = reasoning_parser_for("qwen3")
    assert qwen.starts_in_reasoning("<|im_start|>assistant\n<think>\n")
    assert not qwen.starts_in_reasoning("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    kimi = reasoning_parser_for("kimi")
    assert kimi.split("◁think▷hmm◁/think▷yes", False) == ("hmm", "yes")


def test_the_support_table_lists_what_the_registries_hold():
    assert set(table.TOOL_CALL_PARSERS) == set(TOOL_PARSERS)
    assert set(table.REASONING_PARSERS) == set(REASONING_PARSERS)
    assert set(table.GRAMMAR_BACKENDS) == set(GRAMMAR_BACKENDS)
