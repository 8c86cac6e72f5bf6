"""Engine streams in, OpenAI responses out: the generation half of the ingress.

:class:`EngineStreams` reads the engine streams of one HTTP request (one per prompt) as
one; :func:`respond` gathers them into a ``chat.completion`` / ``text_completion``, and
:func:`chat_frames` / :func:`completion_frames` turn them into SSE frames. Choice ``j`` of
prompt ``i`` is choice ``i * n + j``, as at OpenAI. :func:`engine_error` says what the client
gets when the engine refuses or fails a request.
"""

from __future__ import annotations

import asyncio
import json
import logging
import sys
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable

from pydantic import BaseModel

from flotilla.cluster.engine.outputs import StepLogprobs
from flotilla.serve.assistant_output import AssistantOutput, Message, Piece, tool_call_dicts, tool_delta_dicts
from flotilla.serve.prompts import Prompt
from flotilla.serve.protocol import (
    APIError,
    AssistantMessage,
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatStreamChoice,
    CompletionChoice,
    CompletionLogprobs,
    CompletionResponse,
    DeltaMessage,
    TokenLogprob,
    TopLogprob,
    Usage,
    bad_request,
    param_of,
)
from flotilla.serve.types import CompletionChunk, EngineOverloadedError, EngineUnavailableError, GenerateChunk

logger = logging.getLogger(__name__)

SSE_DONE = "data: [DONE]\n\n"
# decode(step logprobs, token id) -> the token's text
Decode = Callable[[StepLogprobs, int], str]


def sse(payload: BaseModel | dict[str, Any]) -> str:
    """One server-sent event frame: ``data: {json}\\n\\n``."""
    data = payload.model_dump_json() if isinstance(payload, BaseModel) else json.dumps(payload)
    return f"data: {data}\n\n"


# -- errors ---------------------------------------------------------------------------------


# Retry-After on a 503 for a lost or stopping engine: Serve replaces a dead replica in ~10-15 s
# (the embedded model on 2 cores), and another replica may take the request at once.
UNAVAILABLE_RETRY_AFTER_S = 2


def unavailable(message: str, retry_after_s: int | None = None) -> APIError:
    """A 503 in OpenAI's envelope; with ``retry_after_s``, a ``Retry-After`` header."""
    headers = None if retry_after_s is None else {"Retry-After": str(int(retry_after_s))}
    return APIError(503, message, type="server_error", code="service_unavailable", headers=headers)


def engine_error(exc: BaseException, prompt_param: str) -> APIError:
    """What the client gets when the engine refused or failed a request: 400 for bad input
    (``prompt_token_ids`` errors are reported against ``prompt_param``), 429 with
    ``Retry-After`` for a full queue, 503 for a dead engine or any other failure."""
    cause = getattr(exc, "cause", None)  # NOTE: Ray's RayTaskError wraps the replica's exception
    if isinstance(cause, BaseException):
        exc = cause
    if isinstance(exc, APIError):
        return exc
    if _overloaded(exc):
        retry = str(int(getattr(exc, "retry_after_s", 1) or 1))
        message = f"the server is overloaded, retry later: {exc}"
        return APIError(429, message, None, "rate_limit_error", "rate_limit_exceeded", {"Retry-After": retry})
    if isinstance(exc, ValueError):
        message = str(exc)
        param = param_of(message)
        return bad_request(message, prompt_param if param in ("prompt_token_ids", None) else param)
    if isinstance(exc, EngineUnavailableError):
        return unavailable(f"the engine is unavailable: {exc}", UNAVAILABLE_RETRY_AFTER_S)
    return unavailable(f"the engine failed the request: {type(exc).__name__}: {exc}", UNAVAILABLE_RETRY_AFTER_S)


def _overloaded(exc: BaseException) -> bool:
    """The engine's queue is full, or Serve's (``max_queued_requests`` on a handle:
    ``BackPressureError``; only possible once Serve is imported, so it is not imported here)."""
    if isinstance(exc, EngineOverloadedError):
        return True
    serve_errors = sys.modules.get("ray.serve.exceptions")
    return serve_errors is not None and isinstance(exc, serve_errors.BackPressureError)


def check_chunk(chunk: GenerateChunk) -> None:
    """A chunk that reports an engine failure becomes a 503 (or an error frame when streaming)."""
    failed = [c for c in chunk.completions if c.finish_reason in ("error", "abort")]
    if chunk.error is not None or failed:
        reason = chunk.error or f"completion {failed[0].index} finished with {failed[0].finish_reason!r}"
        raise unavailable(f"the engine failed the request: {reason}")


# -- the engine streams of one request --------------------------------------------------------


class EngineStreams:
    """The engine streams of one HTTP request (one per prompt), read as one.

    :meth:`start` waits for every stream's first chunk, so that refusals (bad input, a full
    queue, a dead engine) become HTTP statuses before any response is sent; when one prompt
    is refused, every other prompt's stream is cancelled and closed before :meth:`start`
    raises, so the engine aborts them and frees their KV blocks. :meth:`close` closes every
    stream (the engine aborts what is unfinished) and completes even when the caller is
    cancelled mid-way.

    NOTE: an async generator whose ``__anext__`` runs in another task cannot be closed
    (``aclose()`` raises "asynchronous generator is already running"): every task that
    iterates a stream (the first-chunk waits, the pumps) is cancelled and awaited first,
    which ends the iteration inside the generator (its ``finally`` aborts the request).
    """

    _END = object()

    def __init__(self, iterators: list[AsyncIterator[GenerateChunk]], prompt_param: str):
        self._its = iterators
        self.prompt_param = prompt_param
        self._ready: list[tuple[int, GenerateChunk]] = []
        self._done = [False] * len(iterators)
        self._queue: asyncio.Queue | None = None
        self._live = 0
        self._pumps: list[asyncio.Task] = []
        self._firsts: list[asyncio.Task] = []
        self._closing: asyncio.Future | None = None

    async def start(self) -> None:
        """Wait for the first chunks; raises the APIError the client gets on refusal (of
        the lowest-numbered prompt refused), after closing every stream."""
        try:
            if len(self._its) == 1:
                firsts = [await self._first(0)]
            else:
                firsts = await self._all_firsts()
        except BaseException as exc:
            await self.close()
            if isinstance(exc, Exception):
                raise engine_error(exc, self.prompt_param) from None
            raise
        self._ready = [(i, chunk) for i, chunk in enumerate(firsts) if chunk is not None]
        if len(self._its) > 1:
            self._queue = asyncio.Queue()
            live = [i for i in range(len(self._its)) if not self._done[i]]
            self._pumps = [asyncio.ensure_future(self._pump(i)) for i in live]
            self._live = len(live)

    async def _all_firsts(self) -> list[GenerateChunk | None]:
        """Every stream's first chunk, waited for concurrently; the first refusal raises
        at once (the other waits are cancelled by :meth:`close`)."""
        self._firsts = [asyncio.ensure_future(self._first(i)) for i in range(len(self._its))]
        await asyncio.wait(self._firsts, return_when=asyncio.FIRST_EXCEPTION)
        failed = [t for t in self._firsts if t.done() and not t.cancelled() and t.exception() is not None]
        if failed:
            raise failed[0].exception()
        return [t.result() for t in self._firsts]

    async def _first(self, i: int) -> GenerateChunk | None:
        try:
            return await self._its[i].__anext__()
        except StopAsyncIteration:
            self._done[i] = True
            return None

    async def _pump(self, i: int) -> None:
        try:
            async for chunk in self._its[i]:
                self._queue.put_nowait((i, chunk))
            self._queue.put_nowait(self._END)
        except Exception as exc:  # noqa: BLE001 - handed to the reader
            self._queue.put_nowait(exc)

    async def next(self) -> tuple[int, GenerateChunk] | None:
        """The next chunk of any stream as ``(prompt index, chunk)``; None when all ended.
        An engine failure raises as the APIError the client gets."""
        if self._ready:
            return self._ready.pop(0)
        try:
            return await self._next()
        except APIError:
            raise
        except Exception as exc:
            raise engine_error(exc, self.prompt_param) from None

    async def _next(self) -> tuple[int, GenerateChunk] | None:
        if self._queue is None:
            if self._done[0]:
                return None
            try:
                return 0, await self._its[0].__anext__()
            except StopAsyncIteration:
                self._done[0] = True
                return None
        while self._live:
            item = await self._queue.get()
            if item is self._END:
                self._live -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                return item
        return None

    async def close(self) -> None:
        """Close every stream (idempotent)."""
        if self._closing is None:
            self._closing = asyncio.ensure_future(self._close_all())
        # NOTE: shielded: a cancelled caller (client gone) must still abort the requests.
        await asyncio.shield(self._closing)

    async def _close_all(self) -> None:
        # NOTE: the tasks iterating a stream end first (cancelled: a stream still waiting
        # for its first chunk is aborted), so that no aclose() below meets a running generator.
        iterating = [t for t in self._firsts + self._pumps if not t.done()]
        for task in iterating:
            task.cancel()
        await asyncio.gather(*iterating, return_exceptions=True)
        for it in self._its:
            closer = getattr(it, "aclose", None) or getattr(it, "cancel", None)
            if closer is None:
                continue
            try:
                result = closer()
                if asyncio.iscoroutine(result):
                    await result
            except Exception as exc:  # noqa: BLE001 - closing is best effort; the engine also times out
                logger.warning("closing an engine stream failed: %s", exc)


# -- responses --------------------------------------------------------------------------------


@dataclass
class GenerationJob:
    """One HTTP generation request: its prompts (each with ``n`` choices) and how to answer.

    Attributes:
        kind: ``"chat"`` or ``"completion"``.
        response_id: ``chatcmpl-<request id>`` / ``cmpl-<request id>``.
        top_logprobs: candidates per token in the answer (None: no logprobs).
        include_usage: streaming ends with a usage chunk.
        decode: a token's text, for logprobs.
        return_token_ids: choices carry their generated token ids, and the response (chat) or
            each completion choice its prompt's ids (the request's ``return_token_ids``,
            resolved by the ingress).
        usage: per prompt index, (prompt, completion, cached) tokens from its last chunk.
        keep_text: gather each choice's text (for the request log, ``--log-requests``).
        texts: with ``keep_text``, each choice's text pieces so far, by choice index.
        replicas: per prompt index, (engine replica, prefill replica or "") from its first
            chunk that names one (the access log's ``replica``).
        assistant: chat: makes the :class:`AssistantOutput` that splits a choice's text into
            reasoning, content and tool calls (None: the text is the content).
    """

    kind: str
    response_id: str
    model: str
    n: int
    prompts: list[Prompt]
    top_logprobs: int | None
    include_usage: bool
    decode: Decode
    return_token_ids: bool = False
    created: int = field(default_factory=lambda: int(time.time()))
    usage: dict[int, tuple[int, int, int]] = field(default_factory=dict)
    keep_text: bool = False
    texts: dict[int, list[str]] = field(default_factory=dict)
    replicas: dict[int, tuple[str, str]] = field(default_factory=dict)
    assistant: Callable[[], AssistantOutput] | None = None
    _outputs: dict[int, AssistantOutput] = field(default_factory=dict)

    def output_of(self, index: int) -> AssistantOutput | None:
        """Choice ``index``'s :class:`AssistantOutput` (None without ``assistant``)."""
        if self.assistant is None:
            return None
        if index not in self._outputs:
            self._outputs[index] = self.assistant()
        return self._outputs[index]

    def message(self, index: int, text: str, finish_reason: str | None) -> Message:
        """Choice ``index``'s whole message parts."""
        output = self.output_of(index)
        return Message(None, text, [], finish_reason) if output is None else output.whole(text, finish_reason)

    def piece(self, index: int, c: CompletionChunk) -> tuple[Piece, str | None]:
        """What a streamed chunk adds to choice ``index``'s message, and its finish reason."""
        output = self.output_of(index)
        if output is None:
            return Piece(content=c.text), c.finish_reason
        piece = output.feed(c.text)
        if c.finish_reason is None:
            return piece, None
        tail, finish = output.finish(c.finish_reason)
        return piece.add(tail), finish

    def record(self, i: int, chunk: GenerateChunk) -> None:
        """Take note of prompt ``i``'s chunk: the replicas that served it (its first chunk
        names them), its usage once finished, its text with ``keep_text``."""
        if chunk.replica_id and i not in self.replicas:
            self.replicas[i] = (chunk.replica_id, chunk.prefill_replica_id)
        if self.keep_text:
            for c in chunk.completions:
                self.texts.setdefault(i * self.n + c.index, []).append(c.text)
        if chunk.finished:
            prompt_tokens = chunk.prompt_tokens or len(self.prompts[i].token_ids)
            self.usage[i] = (prompt_tokens, chunk.completion_tokens, chunk.cached_tokens)

    def output_texts(self) -> list[str]:
        """Each choice's text so far, in choice order (empty without ``keep_text``)."""
        return ["".join(self.texts[index]) for index in sorted(self.texts)]

    def totals(self) -> tuple[int, int, int]:
        """(prompt, completion, cached) tokens over the prompts that finished."""
        prompt, completion, cached = (sum(u[k] for u in self.usage.values()) for k in range(3))
        return prompt, completion, cached

    def served_by(self) -> dict[str, Any]:
        """The access log's ``replica`` (and, under PD, ``prefill_replica``): the engine
        replica that served the request, or the list of them, in prompt order, when its
        prompts went to several."""
        out: dict[str, Any] = {}
        for key, column in (("replica", 0), ("prefill_replica", 1)):
            ids = list(dict.fromkeys(self.replicas[i][column] for i in sorted(self.replicas) if self.replicas[i][column]))
            if ids:
                out[key] = ids[0] if len(ids) == 1 else ids
        return out

    def total_usage(self) -> Usage:
        return Usage.of(*self.totals())

    def prompt_ids(self, index: int) -> list[int] | None:
        """The prompt token ids choice ``index`` reports (None unless asked for)."""
        return self.prompts[index // self.n].token_ids if self.return_token_ids else None

    def new_ids(self, c: CompletionChunk) -> list[int] | None:
        """The token ids a chunk's choice reports (None unless asked for)."""
        return list(c.token_ids) if self.return_token_ids else None

    def worth_a_frame(self, c: CompletionChunk, lp: Any) -> bool:
        """A streamed chunk gets a frame when it has text, token ids a client asked for,
        logprobs or a finish reason."""
        ids = self.return_token_ids and bool(c.token_ids)
        return bool(c.text) or ids or lp is not None or c.finish_reason is not None

    def chat_logprobs(self, token_ids: list[int], steps: list[StepLogprobs] | None) -> ChatLogprobs | None:
        if self.top_logprobs is None or not steps:
            return None
        return ChatLogprobs(content=chat_logprobs(token_ids, steps, self.top_logprobs, self.decode))


@dataclass
class _Choice:
    """One choice of a non-streaming response, gathered from its chunks."""

    parts: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    steps: list[StepLogprobs] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    @property
    def text(self) -> str:
        return "".join(self.parts)

    def add(self, c: CompletionChunk) -> None:
        self.parts.append(c.text)
        self.token_ids.extend(c.token_ids)
        self.steps.extend(c.logprobs or [])
        if c.finish_reason is not None:
            self.finish_reason, self.stop_reason = c.finish_reason, c.stop_reason


async def respond(job: GenerationJob, streams: EngineStreams) -> ChatCompletionResponse | CompletionResponse:
    """Read the streams to the end and build the non-streaming response."""
    choices = {i * job.n + j: _Choice() for i in range(len(job.prompts)) for j in range(job.n)}
    while (item := await streams.next()) is not None:
        i, chunk = item
        check_chunk(chunk)
        for c in chunk.completions:
            choices[i * job.n + c.index].add(c)
        job.record(i, chunk)
    head = dict(id=job.response_id, created=job.created, model=job.model, usage=job.total_usage())
    ordered = [(index, choices[index]) for index in sorted(choices)]
    ids = job.return_token_ids
    if job.kind == "chat":
        messages = {index: job.message(index, c.text, c.finish_reason) for index, c in ordered}
        return ChatCompletionResponse(
            **head,
            prompt_token_ids=job.prompt_ids(0),
            choices=[
                ChatChoice(
                    index=index,
                    message=AssistantMessage(
                        content=messages[index].content,
                        reasoning_content=messages[index].reasoning,
                        tool_calls=tool_call_dicts(messages[index].tool_calls) or None,
                    ),
                    logprobs=job.chat_logprobs(c.token_ids, c.steps) if job.top_logprobs is not None else None,
                    finish_reason=messages[index].finish_reason,
                    stop_reason=c.stop_reason,
                    token_ids=c.token_ids if ids else None,
                )
                for index, c in ordered
            ],
        )
    return CompletionResponse(
        **head,
        choices=[
            CompletionChoice(
                index=index,
                text=c.text,
                logprobs=None
                if job.top_logprobs is None
                else completion_logprobs(c.token_ids, c.steps, job.top_logprobs, job.decode, 0),
                finish_reason=c.finish_reason,
                stop_reason=c.stop_reason,
                token_ids=c.token_ids if ids else None,
                prompt_token_ids=job.prompt_ids(index),
            )
            for index, c in ordered
        ],
    )


async def chat_frames(job: GenerationJob, streams: EngineStreams) -> AsyncIterator[str]:
    """SSE frames of a chat stream: a role delta per choice (with ``prompt_token_ids`` when
    asked for), content deltas, the usage chunk (``include_usage``), ``[DONE]``; an error
    frame before ``[DONE]`` when the engine fails."""

    def frame(choices: list[ChatStreamChoice], usage: Usage | None = None, prompt_ids=None) -> str:
        head = dict(id=job.response_id, created=job.created, model=job.model)
        return sse(ChatCompletionChunk(**head, choices=choices, usage=usage, prompt_token_ids=prompt_ids))

    try:
        for j in range(job.n):
            role = ChatStreamChoice(index=j, delta=DeltaMessage(role="assistant", content=""))
            yield frame([role], prompt_ids=job.prompt_ids(0))
        while (item := await streams.next()) is not None:
            i, chunk = item
            check_chunk(chunk)
            for c in chunk.completions:
                index = i * job.n + c.index
                lp = job.chat_logprobs(c.token_ids, c.logprobs)
                piece, finish = job.piece(index, c)
                ids = job.return_token_ids and bool(c.token_ids)
                if piece or ids or lp is not None or finish is not None:
                    delta = DeltaMessage(
                        content=piece.content or None,
                        reasoning_content=piece.reasoning or None,
                        tool_calls=tool_delta_dicts(piece.tool_calls) or None,
                    )
                    choice = ChatStreamChoice(
                        index=index,
                        delta=delta,
                        logprobs=lp,
                        finish_reason=finish,
                        stop_reason=c.stop_reason,
                        token_ids=job.new_ids(c),
                    )
                    yield frame([choice])
            job.record(i, chunk)
        if job.include_usage:
            yield frame([], job.total_usage())
    except Exception as exc:  # noqa: BLE001 - after the 200 went out, errors travel as a frame
        yield sse(_stream_error(exc, streams.prompt_param, job.response_id))
    finally:
        await streams.close()
    yield SSE_DONE


async def completion_frames(job: GenerationJob, streams: EngineStreams) -> AsyncIterator[str]:
    """SSE frames of a completions stream: text deltas (a choice's first frame with its
    ``prompt_token_ids`` when asked for), the usage chunk, ``[DONE]``."""
    offsets: dict[int, int] = {}
    started: set[int] = set()  # choices that have sent a frame

    def frame(choices: list[CompletionChoice], usage: Usage | None = None) -> str:
        head = dict(id=job.response_id, created=job.created, model=job.model)
        return sse(CompletionResponse(**head, choices=choices, usage=usage))

    try:
        while (item := await streams.next()) is not None:
            i, chunk = item
            check_chunk(chunk)
            for c in chunk.completions:
                index = i * job.n + c.index
                lp = None
                if job.top_logprobs is not None and c.logprobs:
                    start = offsets.get(index, 0)
                    lp = completion_logprobs(c.token_ids, c.logprobs, job.top_logprobs, job.decode, start)
                    offsets[index] = start + sum(len(t) for t in lp.tokens)
                if job.worth_a_frame(c, lp):
                    choice = CompletionChoice(
                        index=index,
                        text=c.text,
                        logprobs=lp,
                        finish_reason=c.finish_reason,
                        stop_reason=c.stop_reason,
                        token_ids=job.new_ids(c),
                        prompt_token_ids=None if index in started else job.prompt_ids(index),
                    )
                    started.add(index)
                    yield frame([choice])
            job.record(i, chunk)
        if job.include_usage:
            yield frame([], job.total_usage())
    except Exception as exc:  # noqa: BLE001 - after the 200 went out, errors travel as a frame
        yield sse(_stream_error(exc, streams.prompt_param, job.response_id))
    finally:
        await streams.close()
    yield SSE_DONE


def _stream_error(exc: Exception, prompt_param: str, response_id: str) -> dict[str, Any]:
    """The error frame of a stream that failed after its first chunk: the envelope, its
    message ending with the response id (what the client quotes to the operator)."""
    err = engine_error(exc, prompt_param)
    logger.warning("stream %s failed after its first chunk: %s", response_id, err.message)
    envelope = err.envelope()
    envelope["error"]["message"] = f"{err.message} (response {response_id})"
    return envelope


# -- logprobs in OpenAI's shapes ----------------------------------------------------------------


def _ranked(step: StepLogprobs) -> list[tuple[int, float]]:
    return sorted(((t, lp.logprob) for t, lp in step.items()), key=lambda item: -item[1])


def chat_logprobs(token_ids: list[int], steps: list[StepLogprobs], top_n: int, decode: Decode) -> list[TokenLogprob]:
    """Chat's ``logprobs.content`` entries: per token its text, logprob, UTF-8 bytes and the
    ``top_n`` most likely candidates, best first."""
    out = []
    for token, step in zip(token_ids, steps):
        text = decode(step, token)
        top = []
        for candidate, logprob in _ranked(step)[:top_n]:
            candidate_text = decode(step, candidate)
            top.append(TopLogprob(token=candidate_text, logprob=logprob, bytes=list(candidate_text.encode())))
        logprob = step[token].logprob if token in step else float("nan")
        out.append(TokenLogprob(token=text, logprob=logprob, bytes=list(text.encode()), top_logprobs=top))
    return out


def completion_logprobs(
    token_ids: list[int], steps: list[StepLogprobs], top_n: int, decode: Decode, offset: int
) -> CompletionLogprobs:
    """Completions' ``logprobs``: ``tokens``, ``token_logprobs``, ``top_logprobs`` (the
    ``top_n`` best and the sampled token) and ``text_offset``, which counts the token strings
    from ``offset`` (the characters of this choice's text before these tokens)."""
    out = CompletionLogprobs()
    for token, step in zip(token_ids, steps):
        text = decode(step, token)
        out.tokens.append(text)
        out.token_logprobs.append(step[token].logprob if token in step else None)
        top = {decode(step, t): v for t, v in _ranked(step)[:top_n]}
        top.setdefault(text, out.token_logprobs[-1])
        out.top_logprobs.append(top)
        out.text_offset.append(offset)
        offset += len(text)
    return out
