"""OpenAI's Responses API (``POST /v1/responses``), stateless, over the chat path.

A :class:`ResponsesRequest` becomes a :class:`~flotilla.serve.protocol.ChatCompletionRequest`
(:func:`chat_request_of`: ``instructions`` as a system message first, ``input`` items as chat
messages, flat function tools as chat's nested ones, ``text.format`` as ``response_format``),
so every chat check and the chat template apply; the ingress then prepares and runs it as a
chat request, and :func:`answer` turns the engine streams into a ``response`` object or
Responses SSE events (``response.created`` ... ``response.completed``, no ``[DONE]``).

Stateless: nothing is stored. ``previous_response_id`` and ``conversation`` are refused (send
the whole conversation in ``input``); ``store`` is accepted and changes nothing (a stored
response could never be fetched here). ``reasoning.effort`` is accepted and ignored: what the
model reasons is its chat template's and ``--reasoning-parser``'s business. Errors that chat's
checks raise name the Responses parameter (:func:`responses_params`).
"""

from __future__ import annotations

import json
import logging
import re
import uuid
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Iterator

from pydantic import BaseModel, ConfigDict, Field
from starlette.responses import JSONResponse, Response

from flotilla.serve.assistant_output import Piece
from flotilla.serve.protocol import APIError, ChatCompletionRequest, bad_request, parse_request, quote
from flotilla.serve.responses import EngineStreams, GenerationJob, check_chunk, engine_error, respond

logger = logging.getLogger(__name__)

MESSAGE_ROLES = ("user", "system", "developer", "assistant")
TEXT_PART_TYPES = ("input_text", "output_text", "text")
TEXT_FORMATS = ("text", "json_object", "json_schema")
# Chat's parameter -> the Responses parameter an error names instead.
_PARAM_NAMES = {
    "messages": "input",
    "max_tokens": "max_output_tokens",
    "max_completion_tokens": "max_output_tokens",
    "response_format": "text",
}
# How chat's spellings inside an error message read in the Responses API.
_MESSAGE_SPELLINGS = (
    (re.compile(r"\bresponse_format\.json_schema\b"), "text.format"),
    (re.compile(r"\bresponse_format\b"), "text.format"),
    (re.compile(r"\bmax_(?:completion_)?tokens\b"), "max_output_tokens"),
    (re.compile(r"\btools\[(\d+)\]\.function\b"), r"tools[\1]"),
    (re.compile(r"^messages\b"), "input"),
)
_STATELESS = "this server is stateless and stores no responses or conversations; send the whole conversation in input"


class ResponsesRequest(BaseModel):
    """``POST /v1/responses`` (strict types; unknown fields are ignored, as at chat)."""

    model_config = ConfigDict(strict=True, extra="ignore")

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    stream: bool | None = False
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None  # NOTE: effort and summary are accepted and ignored
    metadata: dict[str, str] | None = None
    user: str | None = None
    store: bool | None = None  # NOTE: nothing is ever stored, whatever it says
    previous_response_id: str | None = None
    conversation: Any = None
    background: bool | None = None


# -- request -> chat request ----------------------------------------------------------------


@contextmanager
def responses_params() -> Iterator[None]:
    """Re-raise the APIErrors of chat's checks naming the Responses parameter
    (``max_tokens`` -> ``max_output_tokens``, ``response_format`` -> ``text``,
    ``messages`` -> ``input``), their message spelled the Responses way."""
    try:
        yield
    except APIError as err:
        err.param = _PARAM_NAMES.get(err.param, err.param)
        message = err.message
        for pattern, spelling in _MESSAGE_SPELLINGS:
            message = pattern.sub(spelling, message)
        err.message = message
        err.args = (message,)
        raise


def chat_request_of(req: ResponsesRequest) -> ChatCompletionRequest:
    """The chat request ``req`` amounts to; APIError(400) naming the Responses parameter."""
    if req.previous_response_id is not None:
        raise bad_request(f"previous_response_id is not supported: {_STATELESS}", "previous_response_id")
    if req.conversation is not None:
        raise bad_request(f"conversation is not supported: {_STATELESS}", "conversation")
    if req.background:
        raise bad_request("background=true is not supported (responses are never stored); send background=false", "background")
    messages = ([{"role": "system", "content": req.instructions}] if req.instructions is not None else []) + input_messages(req.input)
    body = {
        "model": req.model,
        "messages": messages,
        "max_tokens": req.max_output_tokens,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "stream": req.stream,
        "tools": chat_tools(req.tools) if req.tools is not None else None,
        "tool_choice": chat_tool_choice(req.tool_choice),
        "parallel_tool_calls": req.parallel_tool_calls,
        "response_format": response_format_of(req.text),
        "user": req.user,
    }
    with responses_params():
        return parse_request(ChatCompletionRequest, {k: v for k, v in body.items() if v is not None})


def input_messages(items: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``input`` as chat messages: a string is one user message; messages keep their role,
    ``function_call`` items become an assistant turn's ``tool_calls`` (consecutive calls one
    turn), ``function_call_output`` items ``tool`` messages; ``reasoning`` items (a previous
    response's output sent back whole) are dropped."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if not items:
        raise bad_request("input is an empty list; send a string or at least one message", "input")
    out: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        where, kind = f"input[{i}]", item.get("type")
        if kind == "function_call":
            call = {
                "id": _string(item, "call_id", where),
                "type": "function",
                "function": {"name": _string(item, "name", where), "arguments": _string(item, "arguments", where)},
            }
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant" and "tool_call_id" not in last:
                last.setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            content = output if isinstance(output, str) else _text_of(output, f"{where}.output")
            out.append({"role": "tool", "tool_call_id": _string(item, "call_id", where), "content": content})
        elif kind == "reasoning":
            continue
        elif kind in (None, "message"):
            role = item.get("role")
            if role not in MESSAGE_ROLES:
                raise bad_request(f"{where}.role must be one of {', '.join(MESSAGE_ROLES)} (got {quote(role)})", "input")
            content = item.get("content")
            out.append({"role": role, "content": content if isinstance(content, str) else _text_of(content, f"{where}.content")})
        else:
            raise bad_request(
                f"{where}.type {kind!r} is not supported here; send messages, function_call and function_call_output items"
                + (f" ({_STATELESS})" if kind == "item_reference" else ""),
                "input",
            )
    return out


def _string(item: dict[str, Any], key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise bad_request(f"{where}.{key} must be a string (got {quote(value)})", "input")
    return value


def _text_of(parts: Any, where: str) -> str:
    """Text content parts (``input_text``, ``output_text``) joined with newlines, as chat joins them."""
    if not isinstance(parts, list):
        raise bad_request(f"{where} must be a string or a list of input_text parts (got {quote(parts)})", "input")
    texts = []
    for j, part in enumerate(parts):
        if not isinstance(part, dict) or part.get("type") not in TEXT_PART_TYPES or not isinstance(part.get("text"), str):
            kind = part.get("type") if isinstance(part, dict) else part
            raise bad_request(f"{where}[{j}]: only input_text and output_text parts are supported (got {quote(kind)})", "input")
        texts.append(part["text"])
    return "\n".join(texts)


def chat_tools(tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Responses' flat function tools in chat's nested shape; 400 naming ``tools`` for any
    other tool type (the built-in web_search, file_search, ... are not served here)."""
    out = []
    for i, tool in enumerate(tools):
        kind = tool.get("type")
        if kind != "function":
            raise bad_request(
                f"tools[{i}] has type {quote(kind)}; this server runs only function tools "
                "({'type': 'function', 'name': ..., 'parameters': ...}), no built-in ones such as web_search or file_search",
                "tools",
            )
        if not isinstance(tool.get("name"), str):
            raise bad_request(
                f"tools[{i}].name is required (the Responses API spells tools flat: "
                f"{{'type': 'function', 'name': ..., 'parameters': ...}}; got {quote(tool)})",
                "tools",
            )
        function = {k: tool[k] for k in ("name", "description", "parameters", "strict") if tool.get(k) is not None}
        out.append({"type": "function", "function": function})
    return out


def chat_tool_choice(choice: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
    """``tool_choice`` in chat's shape: ``auto``/``none``/``required`` as they are,
    ``{"type": "function", "name": ...}`` nested; 400 naming ``tool_choice`` otherwise."""
    if choice is None or choice in ("auto", "none", "required"):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise bad_request(
        f"tool_choice must be 'auto', 'none', 'required' or {{'type': 'function', 'name': ...}} (got {quote(choice)})",
        "tool_choice",
    )


def response_format_of(text: dict[str, Any] | None) -> dict[str, Any] | None:
    """``text.format`` as chat's ``response_format`` (None: free text); 400 naming ``text``."""
    if text is None or text.get("format") is None:
        return None
    spec = text["format"]
    kind = spec.get("type") if isinstance(spec, dict) else None
    if kind not in TEXT_FORMATS:
        raise bad_request(
            f"text.format.type must be 'text', 'json_object' or 'json_schema' (got text.format={quote(spec)})", "text"
        )
    if kind != "json_schema":
        return {"type": kind}
    schema = {k: spec[k] for k in ("name", "description", "schema", "strict") if k in spec}
    return {"type": "json_schema", "json_schema": schema}


# -- the response object --------------------------------------------------------------------


def _item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def reasoning_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    return {"type": "reasoning", "id": item_id, "summary": [], "content": [{"type": "reasoning_text", "text": text}], "status": status}


def message_item(item_id: str, text: str | None, status: str = "completed") -> dict[str, Any]:
    content = [] if text is None else [{"type": "output_text", "text": text, "annotations": []}]
    return {"type": "message", "id": item_id, "status": status, "role": "assistant", "content": content}


def function_call_item(item_id: str, call_id: str, name: str, arguments: str, status: str = "completed") -> dict[str, Any]:
    return {"type": "function_call", "id": item_id, "call_id": call_id, "name": name, "arguments": arguments, "status": status}


def status_of(finish_reason: str | None) -> str:
    return "incomplete" if finish_reason == "length" else "completed"


def response_object(
    req: ResponsesRequest,
    job: GenerationJob,
    status: str,
    output: list[dict[str, Any]],
    usage: tuple[int, int, int] | None = None,
    error: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """OpenAI's ``response`` object; ``usage`` is (input, output, cached) tokens."""
    return {
        "id": job.response_id,
        "object": "response",
        "created_at": job.created,
        "status": status,
        "error": error,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": req.instructions,
        "max_output_tokens": req.max_output_tokens,
        "model": job.model,
        "output": output,
        "parallel_tool_calls": req.parallel_tool_calls is not False,
        "previous_response_id": None,
        "reasoning": {"effort": (req.reasoning or {}).get("effort"), "summary": None},
        "temperature": 1.0 if req.temperature is None else req.temperature,
        "text": req.text or {"format": {"type": "text"}},
        "tool_choice": req.tool_choice or "auto",
        "tools": req.tools or [],
        "top_p": 1.0 if req.top_p is None else req.top_p,
        "truncation": "disabled",
        "metadata": req.metadata or {},
        "user": req.user,
        "usage": None if usage is None else usage_of(*usage),
    }


def usage_of(input_tokens: int, output_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {
        "input_tokens": input_tokens,
        "input_tokens_details": {"cached_tokens": cached_tokens},
        "output_tokens": output_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": input_tokens + output_tokens,
    }


async def answer(req: ResponsesRequest, job: GenerationJob, streams: EngineStreams, sse_response: type) -> Response:
    """The HTTP answer over started engine ``streams``: the ``response`` object, or (``stream``)
    ``sse_response(events, headers=..., streams=streams)`` (the ingress's disconnect-safe SSE
    response, passed in: this module must not import the ingress)."""
    if req.stream:
        return sse_response(response_events(req, job, streams), headers={"Cache-Control": "no-cache"}, streams=streams)
    try:
        chat = await respond(job, streams)
    finally:
        await streams.close()
    message = chat.choices[0].message
    status = status_of(chat.choices[0].finish_reason)
    output = []
    if message.reasoning_content:
        output.append(reasoning_item(_item_id("rs"), message.reasoning_content))
    if message.content is not None:
        output.append(message_item(_item_id("msg"), message.content, status))
    for call in message.tool_calls or []:
        function = call["function"]
        output.append(function_call_item(_item_id("fc"), call["id"], function["name"], function["arguments"]))
    usage = chat.usage
    cached = usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details else 0
    return JSONResponse(response_object(req, job, status, output, (usage.prompt_tokens, usage.completion_tokens, cached)))


# -- streaming ------------------------------------------------------------------------------


@dataclass
class _OpenItem:
    """The output item being streamed: its kind, place, id and text so far."""

    kind: str  # "reasoning", "message" or "function_call"
    output_index: int
    item_id: str
    text: str = ""
    call_index: int | None = None  # function_call: the tool-call delta index
    call_id: str = ""
    name: str = ""


@dataclass
class _EventWriter:
    """Responses SSE events of one stream, numbered, and the output items they built."""

    req: ResponsesRequest
    job: GenerationJob
    sequence: int = 0
    done: list[dict[str, Any]] = field(default_factory=list)
    open: _OpenItem | None = None

    def event(self, kind: str, **fields: Any) -> str:
        payload = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(payload, ensure_ascii=False)}\n\n"

    def response(self, status: str, usage=None, error=None) -> dict[str, Any]:
        output = self.done + ([self._item(self.open, "in_progress")] if self.open is not None else [])
        return response_object(self.req, self.job, status, output, usage, error)

    def _item(self, item: _OpenItem, status: str) -> dict[str, Any]:
        if item.kind == "reasoning":
            return reasoning_item(item.item_id, item.text, status)
        if item.kind == "message":
            return message_item(item.item_id, item.text, status)
        return function_call_item(item.item_id, item.call_id, item.name, item.text, status)

    def _where(self) -> dict[str, Any]:
        return {"item_id": self.open.item_id, "output_index": self.open.output_index}

    def start(self, kind: str, **call: Any) -> Iterator[str]:
        """Close the open item and open a new one of ``kind``."""
        yield from self.close()
        prefix = {"reasoning": "rs", "message": "msg", "function_call": "fc"}[kind]
        self.open = item = _OpenItem(kind, len(self.done), _item_id(prefix), **call)
        added = self._item(item, "in_progress")
        if kind != "function_call":
            added = {**added, "content": []}
        yield self.event("response.output_item.added", output_index=item.output_index, item=added)
        if kind != "function_call":
            yield self.event("response.content_part.added", **self._where(), content_index=0, part=self._part(""))

    def _part(self, text: str) -> dict[str, Any]:
        if self.open.kind == "reasoning":
            return {"type": "reasoning_text", "text": text}
        return {"type": "output_text", "text": text, "annotations": []}

    def add(self, piece: Piece) -> Iterator[str]:
        """The events of one streamed piece (reasoning, content, then tool-call deltas)."""
        for kind, text in (("reasoning", piece.reasoning), ("message", piece.content)):
            if not text:
                continue
            if self.open is None or self.open.kind != kind:
                yield from self.start(kind)
            self.open.text += text
            delta = "response.reasoning_text.delta" if kind == "reasoning" else "response.output_text.delta"
            extra = {"logprobs": []} if kind == "message" else {}
            yield self.event(delta, **self._where(), content_index=0, delta=text, **extra)
        for d in piece.tool_calls:
            if self.open is None or self.open.kind != "function_call" or self.open.call_index != d.index:
                yield from self.start("function_call", call_index=d.index, call_id=d.id or "", name=d.name or "")
            if d.arguments:
                self.open.text += d.arguments
                yield self.event("response.function_call_arguments.delta", **self._where(), delta=d.arguments)

    def close(self, status: str = "completed") -> Iterator[str]:
        """The done events of the open item, if any."""
        item = self.open
        if item is None:
            return
        if item.kind == "function_call":
            yield self.event("response.function_call_arguments.done", **self._where(), arguments=item.text)
        else:
            text_done = "response.reasoning_text.done" if item.kind == "reasoning" else "response.output_text.done"
            extra = {"logprobs": []} if item.kind == "message" else {}
            yield self.event(text_done, **self._where(), content_index=0, text=item.text, **extra)
            yield self.event("response.content_part.done", **self._where(), content_index=0, part=self._part(item.text))
        final = self._item(item, status)
        yield self.event("response.output_item.done", output_index=item.output_index, item=final)
        self.done.append(final)
        self.open = None

    def finish(self, status: str) -> Iterator[str]:
        """Close the last item; an answer with neither text nor calls still gets its (empty) message."""
        yield from self.close(status)
        if not any(item["type"] in ("message", "function_call") for item in self.done):
            yield from self.start("message")
            yield from self.close(status)


async def response_events(req: ResponsesRequest, job: GenerationJob, streams: EngineStreams) -> AsyncIterator[str]:
    """The SSE events of a streamed response: ``response.created``, ``response.in_progress``,
    each output item's events, then ``response.completed`` (``response.incomplete`` when cut
    by ``max_output_tokens``), or ``response.failed`` when the engine fails mid-way. The
    stream ends after the last event (no ``[DONE]``, as at OpenAI)."""
    out = _EventWriter(req, job)
    finish: str | None = None
    try:
        yield out.event("response.created", response=out.response("in_progress"))
        yield out.event("response.in_progress", response=out.response("in_progress"))
        while (item := await streams.next()) is not None:
            i, chunk = item
            check_chunk(chunk)
            for c in chunk.completions:
                piece, reason = job.piece(i * job.n + c.index, c)
                for frame in out.add(piece):
                    yield frame
                finish = reason or finish
            job.record(i, chunk)
        status = status_of(finish)
        for frame in out.finish(status):
            yield frame
        kind = "response.incomplete" if status == "incomplete" else "response.completed"
        yield out.event(kind, response=out.response(status, job.totals()))
    except Exception as exc:  # noqa: BLE001 - after the 200 went out, a failure travels as an event
        err = engine_error(exc, streams.prompt_param)
        code = "rate_limit_exceeded" if err.status == 429 else "server_error"
        logger.warning("stream %s failed after its first event: %s", job.response_id, err.message)
        error = {"code": code, "message": f"{err.message} (response {job.response_id})"}
        yield out.event("response.failed", response=out.response("failed", job.totals(), error))
    finally:
        await streams.close()
