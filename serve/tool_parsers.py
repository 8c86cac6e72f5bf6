"""Tool-call parsers (``--tool-call-parser``, SGLang's names): the tool calls in a model's
output, in the format its family writes them, as OpenAI tool calls, whole or streamed.

Formats:

- ``hermes``, ``qwen``, ``qwen25``: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``,
  one block per call, content around them.
- ``llama3``: the output is ``{"name": ..., "parameters": {...}}`` (or ``"arguments"``),
  optionally after ``<|python_tag|>``, several separated by ``;``; an output that does not
  start with ``{`` or the tag has no call.
- ``mistral``: ``[TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]``, or the newer
  ``[TOOL_CALLS]name[ARGS]{...}`` (repeated for several calls).
- ``deepseekv3``: ``<｜tool▁calls▁begin｜>`` then per call ``<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME``,
  a fenced JSON block and ``<｜tool▁call▁end｜>``, then ``<｜tool▁calls▁end｜>`` (V3.1's
  ``NAME<｜tool▁sep｜>{...}`` bodies too).
- ``glm``, ``glm45``, ``glm47``: ``<tool_call>NAME`` then ``<arg_key>k</arg_key><arg_value>v</arg_value>``
  pairs and ``</tool_call>``; a value is JSON where it parses and the parameter is not a
  string in the tool's schema, else the text.
- ``kimi_k2``: ``<|tool_calls_section_begin|>`` then per call ``<|tool_call_begin|>functions.NAME:IDX``,
  ``<|tool_call_argument_begin|>{...}<|tool_call_end|>``; the call id is ``functions.NAME:IDX``.
- ``pythonic``: ``[f(a=1, b="x"), g()]`` (literal arguments only).

Choices: a call that names a function not in the request's ``tools``, or whose arguments are
not a JSON object, stays in the content as the model wrote it (SGLang drops such calls;
keeping them loses nothing); with calls found, the content is the text around them with its
trailing whitespace removed (a model's newline before its first call is not an answer).
Streamed, content before the first call marker goes out as it comes (a piece that may start a
marker, and trailing whitespace, are held back); the calls go out when the output ends, each
as one delta with its id, name and whole arguments (a valid OpenAI stream; a call is only
actionable once whole). A call cut off by the end of the output is content, never a half call.
"""

from __future__ import annotations

import ast
import json
import re
import uuid
from dataclasses import dataclass
from typing import Any, Iterator

from flotilla.serve.reasoning_parsers import partial_suffix


@dataclass(frozen=True)
class ToolCall:
    """One call: the function's name, its arguments as JSON text (an object), its id."""

    name: str
    arguments: str
    id: str


@dataclass(frozen=True)
class ToolCallDelta:
    """One OpenAI streaming tool-call delta: ``id`` and ``name`` on a call's first delta;
    the ``arguments`` fragments of one call concatenate to its arguments."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _arguments_text(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


# One piece of markup the parser recognised: its span in the text and the call it makes
# (None: not a valid call; its text stays content).
_Span = tuple[int, int, "ToolCall | None"]


class ToolParser:
    """Finds tool calls in one format (subclasses); see the module docstring.

    Args:
        tools: the request's OpenAI tools (``[{"type": "function", "function": {...}}]``).
    """

    # Where a call's markup may begin: anywhere (markers) or only at the start of the output.
    markers: tuple[str, ...] = ()
    at_start_only = False

    def __init__(self, tools: list[dict[str, Any]]):
        self.functions = {
            t["function"]["name"]: t["function"] for t in tools if isinstance(t, dict) and isinstance(t.get("function"), dict)
        }

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        """A whole output as (the content around the calls, the calls in order)."""
        if not self.functions:
            return text, []
        spans = list(self._spans(text))
        calls = [call for _, _, call in spans if call is not None]
        if not calls:
            return text, []
        content, last = [], 0
        for start, end, call in spans:
            if call is not None:
                content.append(text[last:start])
                last = end
        content.append(text[last:])
        return "".join(content).rstrip(), calls

    def streamer(self) -> "ToolStream":
        return ToolStream(self)

    def _spans(self, text: str) -> Iterator[_Span]:
        raise NotImplementedError

    def _call(self, name: Any, arguments: Any, call_id: str | None = None) -> ToolCall | None:
        """A call when ``name`` is one of the tools and ``arguments`` an object (or its JSON text)."""
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except ValueError:
                return None
        if not isinstance(name, str) or name not in self.functions or not isinstance(arguments, dict):
            return None
        return ToolCall(name, _arguments_text(arguments), call_id or new_call_id())

    def first_marker(self, text: str) -> int | None:
        """Where the first call's markup begins in ``text`` (None: nowhere yet)."""
        if self.at_start_only:
            stripped = len(text) - len(text.lstrip())
            return stripped if any(text[stripped:].startswith(m) for m in self.markers) else None
        found = [i for i in (text.find(m) for m in self.markers) if i >= 0]
        return min(found) if found else None

    def held_back(self, text: str) -> int:
        """How many characters at the end of ``text`` may still begin a marker."""
        if self.at_start_only:
            if text.strip() and not any(m.startswith(text.lstrip()) for m in self.markers):
                return 0
            return len(text)
        return max((partial_suffix(text, m) for m in self.markers), default=0)


class ToolStream:
    """One streamed output's calls: :meth:`feed` each piece, :meth:`finish` at the end; each
    returns (content to show now, tool-call deltas)."""

    def __init__(self, parser: ToolParser):
        self.parser = parser
        self.text = ""  # everything fed
        self.shown = 0  # characters of content sent
        self.in_calls = False  # a call marker was seen: nothing more goes out before the end

    def feed(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        self.text += text
        if self.in_calls or not self.parser.functions:
            return (self._show(len(self.text)) if not self.parser.functions else ""), []
        marker = self.parser.first_marker(self.text)
        if marker is not None:
            self.in_calls = True
            return self._show(marker, hold_whitespace=True), []
        limit = len(self.text) - self.parser.held_back(self.text)
        return self._show(limit, hold_whitespace=True), []

    def _show(self, limit: int, hold_whitespace: bool = False) -> str:
        piece = self.text[self.shown : limit]
        if hold_whitespace:
            piece = piece.rstrip()
        self.shown += len(piece)
        return piece

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        content, calls = self.parser.parse(self.text)
        # NOTE: what went out is a prefix of the content (text before the first marker, its
        # trailing whitespace held): the rest follows now.
        rest = content[self.shown :]
        self.shown = len(content)
        return rest, [ToolCallDelta(i, c.id, c.name, c.arguments) for i, c in enumerate(calls)]


_DECODER = json.JSONDecoder()


class HermesParser(ToolParser):
    markers = ("<tool_call>",)
    _BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)

    def _spans(self, text: str) -> Iterator[_Span]:
        for match in self._BLOCK.finditer(text):
            try:
                body = json.loads(match.group(1))
            except ValueError:
                yield match.start(), match.end(), None
                continue
            call = self._call(body.get("name"), body.get("arguments", {})) if isinstance(body, dict) else None
            yield match.start(), match.end(), call


class Llama3Parser(ToolParser):
    markers = ("<|python_tag|>", "{")
    at_start_only = True
    TAG = "<|python_tag|>"

    def _spans(self, text: str) -> Iterator[_Span]:
        i = len(text) - len(text.lstrip())
        start = i
        if text.startswith(self.TAG, i):
            i += len(self.TAG)
        calls = []
        while True:
            i = _skip_space(text, i)
            try:
                body, i = _DECODER.raw_decode(text, i)
            except ValueError:
                return
            call = self._call(body.get("name"), body.get("parameters", body.get("arguments"))) if isinstance(body, dict) else None
            if call is None:
                return
            calls.append(call)
            i = _skip_space(text, i)
            if i == len(text):
                break
            if text[i] != ";":
                return
            i += 1
        # NOTE: all or nothing: the output is a list of calls, or it is an answer.
        yield start, len(text), calls[0]
        for call in calls[1:]:
            yield len(text), len(text), call


class MistralParser(ToolParser):
    markers = ("[TOOL_CALLS]",)
    _NAMED = re.compile(r"\s*([A-Za-z0-9_-]+)\[ARGS\]")

    def _spans(self, text: str) -> Iterator[_Span]:
        start = text.find(self.markers[0])
        if start < 0:
            return
        i = _skip_space(text, start + len(self.markers[0]))
        if text.startswith("[", i):
            try:
                body, end = _DECODER.raw_decode(text, i)
            except ValueError:
                return
            if not isinstance(body, list) or not body:
                return
            calls = [self._call(c.get("name"), c.get("arguments", {})) if isinstance(c, dict) else None for c in body]
            if any(c is None for c in calls):
                return
            yield start, end, calls[0]
            for call in calls[1:]:
                yield end, end, call
            return
        # NOTE: the newer form: NAME[ARGS]{...}, each call after its own [TOOL_CALLS].
        pos = start
        while pos >= 0:
            match = self._NAMED.match(text, pos + len(self.markers[0]))
            if match is None:
                return
            try:
                args, end = _DECODER.raw_decode(text, match.end())
            except ValueError:
                return
            call = self._call(match.group(1), args)
            if call is None:
                return
            yield pos, end, call
            nxt = text.find(self.markers[0], end)
            pos = nxt if nxt >= 0 and not text[end:nxt].strip() else -1


class DeepSeekV3Parser(ToolParser):
    markers = ("<｜tool▁calls▁begin｜>", "<｜tool▁call▁begin｜>")
    _CALL = re.compile(
        r"<｜tool▁call▁begin｜>(?:function<｜tool▁sep｜>([^\n<]+)\n```(?:json)?\n(.*?)\n```"
        r"|([^<]+?)<｜tool▁sep｜>(.*?))<｜tool▁call▁end｜>",
        re.DOTALL,
    )
    _BEGIN, _END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"

    def _spans(self, text: str) -> Iterator[_Span]:
        spans = []
        for match in self._CALL.finditer(text):
            name = (match.group(1) or match.group(3) or "").strip()
            spans.append([match.start(), match.end(), self._call(name, match.group(2) if match.group(1) else match.group(4))])
        if spans and any(s[2] is not None for s in spans):
            # NOTE: the section's own markers go with its first and last calls.
            begin = text.rfind(self._BEGIN, 0, spans[0][0])
            if begin >= 0 and not text[begin + len(self._BEGIN) : spans[0][0]].strip() and spans[0][2] is not None:
                spans[0][0] = begin
            end = text.find(self._END, spans[-1][1])
            if end >= 0 and not text[spans[-1][1] : end].strip() and spans[-1][2] is not None:
                spans[-1][1] = end + len(self._END)
        for start, end, call in spans:
            yield start, end, call


class GLM45Parser(ToolParser):
    markers = ("<tool_call>",)
    _BLOCK = re.compile(r"<tool_call>([^\n<]*)\s*((?:<arg_key>.*?</arg_key>\s*<arg_value>.*?</arg_value>\s*)*)</tool_call>", re.DOTALL)
    _PAIR = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.DOTALL)

    def _spans(self, text: str) -> Iterator[_Span]:
        for match in self._BLOCK.finditer(text):
            name = match.group(1).strip()
            function = self.functions.get(name)
            if function is None:
                yield match.start(), match.end(), None
                continue
            properties = (function.get("parameters") or {}).get("properties") or {}
            args = {}
            for key, value in self._PAIR.findall(match.group(2)):
                key = key.strip()
                if (properties.get(key) or {}).get("type") == "string":
                    args[key] = value
                    continue
                try:
                    args[key] = json.loads(value)
                except ValueError:
                    args[key] = value
            yield match.start(), match.end(), self._call(name, args)


class KimiK2Parser(ToolParser):
    markers = ("<|tool_calls_section_begin|>", "<|tool_call_begin|>")
    _CALL = re.compile(r"<\|tool_call_begin\|>\s*([^<]+?)\s*<\|tool_call_argument_begin\|>(.*?)<\|tool_call_end\|>", re.DOTALL)
    _BEGIN, _END = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"

    def _spans(self, text: str) -> Iterator[_Span]:
        spans = []
        for match in self._CALL.finditer(text):
            call_id = match.group(1)
            name = call_id.split(".", 1)[-1].rsplit(":", 1)[0]
            spans.append([match.start(), match.end(), self._call(name, match.group(2), call_id)])
        if spans and spans[0][2] is not None:
            begin = text.rfind(self._BEGIN, 0, spans[0][0])
            if begin >= 0 and not text[begin + len(self._BEGIN) : spans[0][0]].strip():
                spans[0][0] = begin
        if spans and spans[-1][2] is not None:
            end = text.find(self._END, spans[-1][1])
            if end >= 0 and not text[spans[-1][1] : end].strip():
                spans[-1][1] = end + len(self._END)
        for start, end, call in spans:
            yield start, end, call


class PythonicParser(ToolParser):
    markers = ("[",)
    at_start_only = True

    def _spans(self, text: str) -> Iterator[_Span]:
        stripped = text.strip()
        if not (stripped.startswith("[") and stripped.endswith("]")):
            return
        try:
            tree = ast.parse(stripped, mode="eval").body
        except SyntaxError:
            return
        if not isinstance(tree, ast.List) or not tree.elts:
            return
        calls = []
        for node in tree.elts:
            if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
                return
            try:
                args = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords if kw.arg is not None}
            except ValueError:
                return
            call = self._call(node.func.id, args)
            if call is None:
                return
            calls.append(call)
        start = len(text) - len(text.lstrip())
        yield start, len(text), calls[0]
        for call in calls[1:]:
            yield len(text), len(text), call


def _skip_space(text: str, i: int) -> int:
    while i < len(text) and text[i].isspace():
        i += 1
    return i


TOOL_PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesParser,
    "qwen": HermesParser,
    "qwen25": HermesParser,
    "llama3": Llama3Parser,
    "mistral": MistralParser,
    "deepseekv3": DeepSeekV3Parser,
    "glm": GLM45Parser,
    "glm45": GLM45Parser,
    "glm47": GLM45Parser,
    "kimi_k2": KimiK2Parser,
    "pythonic": PythonicParser,
}


def tool_parser_for(name: str, tools: list[dict[str, Any]]) -> ToolParser:
    """The parser ``--tool-call-parser`` names, for a request's ``tools``; ValueError naming
    the flag for another name."""
    if name not in TOOL_PARSERS:
        raise ValueError(f"tool_call_parser={name!r} is not built; use one of {sorted(TOOL_PARSERS)}")
    return TOOL_PARSERS[name](tools)
