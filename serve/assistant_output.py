"""An assistant's raw output text as the parts of a chat message: ``reasoning_content``
(``--reasoning-parser``), ``content`` and ``tool_calls`` (a forced call, or what
``--tool-call-parser`` finds), whole (:meth:`AssistantOutput.whole`) or streamed
(:meth:`AssistantOutput.feed` / :meth:`AssistantOutput.finish`).

The reasoning section is split off first; tool calls are looked for in what follows it.
A choice that made calls ends with ``finish_reason: tool_calls`` (when it ended with
``stop``; ``length`` stays, and a forced call cut mid-way stays content).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from flotilla.serve.reasoning_parsers import ReasoningParser
from flotilla.serve.tool_parsers import ToolCall, ToolCallDelta, new_call_id, tool_parser_for
from flotilla.serve.tools import ToolPlan


@dataclass
class Piece:
    """What one streamed piece of output adds to each part of the message."""

    reasoning: str = ""
    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content or self.tool_calls)

    def add(self, other: "Piece") -> "Piece":
        return Piece(self.reasoning + other.reasoning, self.content + other.content, self.tool_calls + other.tool_calls)


@dataclass
class Message:
    """A whole assistant message's parts."""

    reasoning: str | None
    content: str | None
    tool_calls: list[ToolCall]
    finish_reason: str | None


class AssistantOutput:
    """One choice's output, split into message parts.

    Args:
        reasoning: the ``--reasoning-parser`` (None: no reasoning section).
        in_reasoning: generation starts inside the reasoning section (the prompt opened it).
        tools: the request's tool plan (None: no tools).
    """

    def __init__(self, reasoning: ReasoningParser | None, in_reasoning: bool, tools: ToolPlan | None):
        self.reasoning = reasoning
        self.in_reasoning = in_reasoning
        self.tools = tools if tools is not None and tools.mode != "none" else None
        self._reasoning_stream = reasoning.streamer(in_reasoning) if reasoning is not None else None
        self._parser = tool_parser_for(self.tools.parser, list(self.tools.tools)) if self.tools and self.tools.mode == "auto" else None
        self._tool_stream = self._parser.streamer() if self._parser is not None else None
        self._forced = ""  # a forced call's text so far
        self._named_id: str | None = None
        self._made_calls = False

    # -- whole ------------------------------------------------------------------------

    def whole(self, text: str, finish_reason: str | None) -> Message:
        """The message parts of a whole output."""
        reasoning, content = (None, text)
        if self.reasoning is not None:
            reasoning, content = self.reasoning.split(text, self.in_reasoning)
        calls: list[ToolCall] = []
        if self.tools is not None:
            if self._parser is not None:
                content, calls = self._parser.parse(content)
            else:
                calls = self._forced_calls(content, finish_reason)
                if calls:
                    content = ""
        if calls and finish_reason == "stop":
            finish_reason = "tool_calls"
        return Message(reasoning, content if content or not calls else None, calls, finish_reason)

    def _forced_calls(self, text: str, finish_reason: str | None) -> list[ToolCall]:
        """The calls of a forced output (``named``: the arguments; ``required``: the array);
        [] when it is not whole (cut by max_tokens): the text stays content."""
        if finish_reason != "stop":
            return []
        try:
            value = json.loads(text)
        except ValueError:
            return []
        if self.tools.mode == "named":
            return [ToolCall(self.tools.named, text.strip(), self._named_id or new_call_id())] if isinstance(value, dict) else []
        if not isinstance(value, list):
            return []
        calls = []
        for item in value:
            if not isinstance(item, dict) or not isinstance(item.get("name"), str):
                return []
            arguments = json.dumps(item.get("parameters", {}), ensure_ascii=False)
            calls.append(ToolCall(item["name"], arguments, new_call_id()))
        return calls

    # -- streamed ----------------------------------------------------------------------

    def feed(self, text: str) -> Piece:
        """A new piece of output: what each part gains (text that may still turn out to be
        a tag or a call is held back)."""
        if not text:
            return Piece()
        reasoning, content = ("", text)
        if self._reasoning_stream is not None:
            reasoning, content = self._reasoning_stream.feed(text)
        return Piece(reasoning).add(self._content_piece(content))

    def finish(self, finish_reason: str | None) -> tuple[Piece, str | None]:
        """The end of the output: what was held back, and the finish reason to report."""
        piece = Piece()
        if self._reasoning_stream is not None:
            reasoning, content = self._reasoning_stream.finish()
            piece = Piece(reasoning).add(self._content_piece(content))
        if self.tools is not None:
            if self._tool_stream is not None:
                content, deltas = self._tool_stream.finish()
                self._made_calls |= bool(deltas)
                piece = piece.add(Piece(content=content, tool_calls=deltas))
            elif self.tools.mode == "required":
                calls = self._forced_calls(self._forced, finish_reason)
                if calls:
                    self._made_calls = True
                    deltas = [ToolCallDelta(i, c.id, c.name, c.arguments) for i, c in enumerate(calls)]
                    piece = piece.add(Piece(tool_calls=deltas))
                else:
                    piece = piece.add(Piece(content=self._forced))
        if self._made_calls and finish_reason == "stop":
            finish_reason = "tool_calls"
        return piece, finish_reason

    def _content_piece(self, content: str) -> Piece:
        if not content or self.tools is None:
            return Piece(content=content)
        if self._tool_stream is not None:
            shown, deltas = self._tool_stream.feed(content)
            self._made_calls |= bool(deltas)
            return Piece(content=shown, tool_calls=deltas)
        if self.tools.mode == "named":
            # NOTE: a named call streams its arguments as they come (the grammar keeps them valid).
            first = self._named_id is None and not self._forced.strip()
            self._forced += content
            fragment = content.lstrip() if first else content
            if not fragment:
                return Piece()
            if self._named_id is None:
                self._named_id, self._made_calls = new_call_id(), True
                return Piece(tool_calls=[ToolCallDelta(0, self._named_id, self.tools.named, fragment)])
            return Piece(tool_calls=[ToolCallDelta(0, None, None, fragment)])
        self._forced += content  # NOTE: required: the array is parsed whole at the end
        return Piece()


def tool_call_dicts(calls: list[ToolCall]) -> list[dict[str, Any]]:
    """Calls in a chat message's ``tool_calls`` shape."""
    return [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}} for c in calls]


def tool_delta_dicts(deltas: list[ToolCallDelta]) -> list[dict[str, Any]]:
    """Deltas in a chat chunk's ``delta.tool_calls`` shape (id, type and name on a call's first delta)."""
    out = []
    for d in deltas:
        item: dict[str, Any] = {"index": d.index}
        function: dict[str, Any] = {"arguments": d.arguments}
        if d.id is not None:
            item.update(id=d.id, type="function")
        if d.name is not None:
            function["name"] = d.name
        item["function"] = function
        out.append(item)
    return out
