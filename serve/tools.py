"""Tool calling for chat requests: the request's ``tools`` and ``tool_choice`` checked and
turned into a :class:`ToolPlan` (what the chat template receives, the grammar that forces
a call, the parser that finds calls in free output).

``tool_choice`` (OpenAI's; default ``auto`` when ``tools`` are given):

- ``none``: no call; the template gets no tools (vLLM's default), the output is content.
- ``auto``: the template gets the tools and the model decides; ``--tool-call-parser`` finds
  the calls in its output (a request needs the flag: without it, a 400 naming
  ``tool_choice``).
- ``required``: the output is forced by the grammar to be a JSON array of one call or more
  (one when ``parallel_tool_calls`` is false), each ``{"name": <a tool's name>,
  "parameters": <arguments valid for that tool's schema>}``; no parser is needed.
- a named function (``{"type": "function", "function": {"name": ...}}``): the output is
  forced to be that function's arguments (valid for its ``parameters`` schema).

Forced calls hold arguments that always satisfy the tool's schema (a schema with no
``additionalProperties`` is followed strictly: no properties it does not name), whatever
the model; a forced call cut by ``max_tokens`` is returned as content with
``finish_reason: length``. A choice that made calls ends with ``finish_reason: tool_calls``.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from flotilla.cluster.engine.sampling_params import GuidedDecoding
from flotilla.serve.protocol import bad_request, quote
from flotilla.serve.structured_outputs import check_schema

TOOL_CHOICES = ("none", "auto", "required")
# OpenAI's rule for function names.
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")


@dataclass(frozen=True)
class ToolPlan:
    """How one chat request uses its tools.

    Attributes:
        mode: ``none``, ``auto``, ``required`` or ``named``.
        tools: the request's tools (OpenAI's shape, checked).
        named: the forced function's name (mode ``named``).
        parser: the ``--tool-call-parser`` name (mode ``auto``).
        parallel: ``parallel_tool_calls`` (``required``: more than one call allowed).
    """

    mode: str
    tools: tuple[dict[str, Any], ...]
    named: str | None = None
    parser: str | None = None
    parallel: bool = True

    @property
    def template_tools(self) -> list[dict[str, Any]] | None:
        """The tools the chat template renders (None with ``tool_choice: none``)."""
        return None if self.mode == "none" else list(self.tools)

    def schema_of(self, name: str) -> dict[str, Any]:
        for tool in self.tools:
            if tool["function"]["name"] == name:
                return tool["function"].get("parameters") or {"type": "object"}
        raise KeyError(name)

    def guided(self) -> GuidedDecoding | None:
        """The grammar that forces the call (``required``, ``named``), else None."""
        if self.mode == "named":
            schema = self.schema_of(self.named)
        elif self.mode == "required":
            calls = [
                {
                    "type": "object",
                    "properties": {"name": {"const": t["function"]["name"]}, "parameters": self.schema_of(t["function"]["name"])},
                    "required": ["name", "parameters"],
                    "additionalProperties": False,
                }
                for t in self.tools
            ]
            schema = {"type": "array", "minItems": 1, "items": calls[0] if len(calls) == 1 else {"anyOf": calls}}
            if not self.parallel:
                schema["maxItems"] = 1
        else:
            return None
        return GuidedDecoding("json_schema", json.dumps(schema, sort_keys=True, ensure_ascii=False), param="tool_choice")


def plan_tools(tools: Any, tool_choice: Any, parallel_tool_calls: Any, parser: str | None) -> ToolPlan | None:
    """The request's :class:`ToolPlan` (None without tools and without a tool choice);
    APIError(400) naming ``tools`` or ``tool_choice`` for what is wrong."""
    if parallel_tool_calls is not None and not isinstance(parallel_tool_calls, bool):
        raise bad_request(f"parallel_tool_calls must be a boolean (got {quote(parallel_tool_calls)})", "parallel_tool_calls")
    checked = check_tools(tools) if tools else ()
    if not checked:
        if tool_choice not in (None, "none"):
            raise bad_request(f"tool_choice needs tools; send tools with it (got tool_choice={quote(tool_choice)})", "tool_choice")
        return None
    choice = "auto" if tool_choice is None else tool_choice
    parallel = parallel_tool_calls is not False
    names = [t["function"]["name"] for t in checked]
    if isinstance(choice, dict):
        name = _named_choice(choice)
        if name not in names:
            raise bad_request(f"tool_choice names the function {name!r}, which is not among the tools ({', '.join(names)})", "tool_choice")
        return ToolPlan("named", checked, named=name, parallel=parallel)
    if choice not in TOOL_CHOICES:
        raise bad_request(
            f"tool_choice must be 'none', 'auto', 'required' or {{'type': 'function', 'function': {{'name': ...}}}} "
            f"(got {quote(choice)})",
            "tool_choice",
        )
    if choice == "auto" and parser is None:
        raise bad_request(
            "tool_choice 'auto' (the default with tools) needs a tool-call parser, and this server has none: start it "
            "with --tool-call-parser, or send tool_choice 'required', 'none' or a named function",
            "tool_choice",
        )
    return ToolPlan(choice, checked, parser=parser if choice == "auto" else None, parallel=parallel)


def _named_choice(choice: dict[str, Any]) -> str:
    function = choice.get("function")
    # NOTE: the Responses API spells it {"type": "function", "name": ...}.
    name = function.get("name") if isinstance(function, dict) else choice.get("name")
    if choice.get("type") != "function" or not isinstance(name, str):
        raise bad_request(
            f"tool_choice must be 'none', 'auto', 'required' or {{'type': 'function', 'function': {{'name': ...}}}} "
            f"(got {quote(choice)})",
            "tool_choice",
        )
    return name


def check_tools(tools: Any) -> tuple[dict[str, Any], ...]:
    """The request's ``tools`` as OpenAI function tools; APIError(400) naming ``tools``."""
    if not isinstance(tools, list):
        raise bad_request(f"tools must be a list of function tools (got {quote(tools)})", "tools")
    out, seen = [], set()
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
            raise bad_request(f"{where} must be {{'type': 'function', 'function': {{'name': ..., 'parameters': ...}}}} (got {quote(tool)})", "tools")
        function = tool["function"]
        name = function.get("name")
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise bad_request(f"{where}.function.name must be 1-64 letters, digits, '_' or '-' (got {quote(name)})", "tools")
        if name in seen:
            raise bad_request(f"{where}.function.name {name!r} is given twice; tool names must be unique", "tools")
        seen.add(name)
        parameters = function.get("parameters")
        if parameters is not None:
            if not isinstance(parameters, dict):
                raise bad_request(f"{where}.function.parameters must be a JSON schema object (got {quote(parameters)})", "tools")
            check_schema(parameters, f"{where}.function.parameters", "tools")
        description = function.get("description")
        if description is not None and not isinstance(description, str):
            raise bad_request(f"{where}.function.description must be a string (got {quote(description)})", "tools")
        out.append({"type": "function", "function": {k: v for k, v in function.items() if v is not None}})
    return tuple(out)


def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Chat messages as chat templates expect them: an assistant message's tool-call
    arguments as objects (templates render them with ``tojson``), not JSON text."""
    out = []
    for message in messages:
        calls = message.get("tool_calls")
        if message.get("role") == "assistant" and isinstance(calls, list):
            fixed = []
            for call in calls:
                function = call.get("function") if isinstance(call, dict) else None
                if isinstance(function, dict) and isinstance(function.get("arguments"), str):
                    try:
                        arguments = json.loads(function["arguments"])
                    except ValueError:
                        arguments = function["arguments"]
                    call = {**call, "function": {**function, "arguments": arguments}}
                fixed.append(call)
            message = {**message, "tool_calls": fixed}
        out.append(message)
    return out
