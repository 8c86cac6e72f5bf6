"""The OpenAI API subset the ingress speaks: request and response models (pydantic v2),
the error envelope, and the conversion of a request into flotilla ``SamplingParams``.

Requests validate strictly (``"max_tokens": "10"`` is a type error, as at OpenAI) and ignore
fields they do not know (OpenAI clients send extras). Every problem becomes an
:class:`APIError` whose message names the parameter and the value seen; the ingress renders
it as ``{"error": {"message", "type", "param", "code"}}``. Besides OpenAI's fields, the
sampling knobs vLLM and SGLang accept in the body are honoured: ``top_k``, ``min_p``,
``repetition_penalty``, ``ignore_eos``, ``skip_special_tokens``, ``stop_token_ids``,
``include_stop_str_in_output``, vLLM's ``return_token_ids`` (each choice carries its
generated token ids and the ids of its prompt; by default only when the server has no tokenizer)
and ``priority`` (with ``--enable-priority-scheduling``; see ``LLMEngine.priority_of``).
"""

from __future__ import annotations

import re
import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_serializer

from flotilla.cluster.engine.sampling_params import SamplingParams

# Largest n and logprobs count accepted (vLLM's defaults for max n / max_logprobs).
MAX_N = 128
MAX_LOGPROBS = 20
_INT64_MIN, _INT64_MAX = -(1 << 63), (1 << 63) - 1
_INT32_MAX = (1 << 31) - 1
# Characters of an offending value quoted back in an error message.
_MAX_QUOTED = 120
# The most stop strings and stop token ids one request may give: the engine checks every one
# of them at every token of the request, on the thread every request shares.
MAX_STOP = 64
MAX_STOP_TOKEN_IDS = 256
# The roles a chat message may have (OpenAI's).
ROLES = ("system", "developer", "user", "assistant", "tool", "function")
# Arguments of the tokenizer's apply_chat_template that chat_template_kwargs must not set.
RESERVED_TEMPLATE_KWARGS = frozenset(
    {
        "conversation", "chat_template", "add_generation_prompt", "continue_final_message", "tokenize",
        "padding", "truncation", "max_length", "return_tensors", "return_dict", "return_assistant_tokens_mask",
        "tokenizer_kwargs", "tools", "documents",
    }
)  # fmt: skip


# -- errors ------------------------------------------------------------------------------


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(BaseModel):
    """OpenAI's error envelope: ``{"error": {"message", "type", "param", "code"}}``."""

    error: ErrorInfo


class APIError(Exception):
    """An error the client gets as an OpenAI error envelope with ``status``.

    Args:
        status: the HTTP status.
        message: what was wrong, the value seen, and what to do.
        param: the request parameter at fault (``None`` when none is).
        type: OpenAI's error type (``invalid_request_error``, ...).
        code: OpenAI's error code (``model_not_found``, ``invalid_api_key``, ...).
        headers: extra response headers (``Retry-After`` on 429).
    """

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        type: str = "invalid_request_error",
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.code = status, message, param, type, code
        self.headers = headers or {}

    def envelope(self) -> dict[str, Any]:
        info = ErrorInfo(message=self.message, type=self.type, param=self.param, code=self.code)
        return ErrorResponse(error=info).model_dump()


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param)


def model_not_found(name: str, served: str) -> APIError:
    return APIError(
        404, f"The model `{name}` does not exist; this server serves `{served}`.", "model", code="model_not_found"
    )


def quote(value: Any) -> str:
    """A short ``repr`` of a client value for an error message."""
    text = repr(value)
    return text if len(text) <= _MAX_QUOTED else text[: _MAX_QUOTED - 3] + "..."


# Union-member tags pydantic puts in error locations (``('stop', 'list[str]', 0)``).
_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none", "null"}


def validation_error(exc: ValidationError, body: dict[str, Any]) -> APIError:
    """The first pydantic error of a request as a 400 naming the parameter and its value."""
    err = exc.errors(include_url=False)[0]
    parts = [
        p for p in err["loc"] if isinstance(p, int) or (re.fullmatch(r"[a-z_][a-z0-9_]*", p) and p not in _TYPE_TAGS)
    ]
    param = ".".join(f"[{p}]" if isinstance(p, int) else p for p in parts).replace(".[", "[") or None
    if err["type"] == "missing":
        return bad_request(f"{param} is required", param)
    top = parts[0] if parts else None
    seen = f" (got {top}={quote(body[top])})" if isinstance(top, str) and top in body else ""
    return bad_request(f"{param}: {err['msg']}{seen}", param)


def parse_request(model: type[BaseModel], body: Any) -> Any:
    """Validate a decoded JSON body as ``model``; APIError(400) naming the parameter."""
    if not isinstance(body, dict):
        raise bad_request(f"the request body must be a JSON object, got {type(body).__name__}")
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        raise validation_error(exc, body) from None


# -- requests ------------------------------------------------------------------------------


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Strict):
    include_usage: bool | None = False


class ContentPart(_Strict):
    model_config = ConfigDict(strict=True, extra="allow")
    type: str
    text: str | None = None


class ChatMessage(_Strict):
    """One message; ``content`` may be a list of text parts (joined with newlines)."""

    model_config = ConfigDict(strict=True, extra="allow")
    role: Literal[ROLES]
    content: str | list[ContentPart] | None = None
    name: str | None = None

    def template_dict(self) -> dict[str, Any]:
        """The message as a chat template expects it (content as one string)."""
        out = self.model_dump(exclude_none=True)
        content = self.content
        if isinstance(content, list):
            kinds = [p.type for p in content if p.type != "text"]
            if kinds:
                raise bad_request(
                    f"messages: only text content parts are supported, got a part of type {kinds[0]!r}", "messages"
                )
            content = "\n".join(p.text or "" for p in content)
        out["content"] = content or ""
        return out


class _SamplingRequest(_Strict):
    """Fields chat and completion requests share (OpenAI's, then the extra knobs)."""

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    n: int | None = Field(1, ge=1, le=MAX_N)
    stop: str | list[str] | None = Field(None, max_length=MAX_STOP)
    seed: int | None = Field(None, ge=_INT64_MIN, le=_INT64_MAX)  # NOTE: torch generators take 64 bits
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # Extra knobs (vLLM / SGLang spelling).
    top_k: int | None = Field(None, ge=-1, le=_INT32_MAX)  # NOTE: the engine clamps to the vocabulary
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(None, gt=0.0, le=2.0)  # NOTE: SGLang's bound
    ignore_eos: bool | None = False
    skip_special_tokens: bool | None = True
    stop_token_ids: list[int] | None = Field(None, max_length=MAX_STOP_TOKEN_IDS)
    include_stop_str_in_output: bool | None = False
    # vLLM's spelling: each choice carries its generated ``token_ids`` (streamed: each frame's
    # new ids) and the response its ``prompt_token_ids`` (a completion choice: its prompt's).
    # None: true when the server has no tokenizer (skip_tokenizer_init: the text is empty).
    return_token_ids: bool | None = None
    # vLLM's and SGLang's scheduling priority (--enable-priority-scheduling decides what it means).
    priority: int | None = Field(None, ge=-_INT32_MAX, le=_INT32_MAX)
    # Output constraints besides response_format (see flotilla.serve.structured_outputs):
    # vLLM's structured_outputs object and older guided_* fields, SGLang's regex and ebnf.
    structured_outputs: Any = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    regex: Any = None
    ebnf: Any = None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    def _check_common(self) -> None:
        if self.logit_bias:
            message = f"logit_bias is not supported by this server (got logit_bias={quote(self.logit_bias)})"
            raise bad_request(message, "logit_bias")
        if self.stream_options is not None and not self.stream:
            raise bad_request("stream_options is only allowed when stream is true", "stream_options")

    def _sampling_params(self, max_tokens: int | None, logprobs: int | None, guided: Any = None) -> SamplingParams:
        self._check_common()
        # NOTE: top_k 0 means "disabled" to many clients; the engine spells that -1.
        top_k = -1 if self.top_k in (None, 0) else self.top_k
        fields = dict(
            n=self.n or 1,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=top_k,
            min_p=self.min_p or 0.0,
            seed=self.seed,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            max_tokens=max_tokens,
            ignore_eos=bool(self.ignore_eos),
            logprobs=logprobs,
            include_stop_str_in_output=bool(self.include_stop_str_in_output),
            skip_special_tokens=self.skip_special_tokens is not False,
            guided=guided,
        )
        try:
            return SamplingParams(**fields)
        except ValueError as exc:
            raise bad_request(str(exc), param_of(str(exc))) from None


def param_of(message: str) -> str | None:
    """The parameter an engine or SamplingParams error message starts with (``"top_k must ..."``)."""
    match = re.match(r"([a-z_][a-z0-9_]*)\b", message)
    return match.group(1) if match else None


class ChatCompletionRequest(_SamplingRequest):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: bool | None = True
    chat_template_kwargs: dict[str, Any] | None = None
    tools: Any = None
    tool_choice: Any = None
    parallel_tool_calls: Any = None
    functions: Any = None
    function_call: Any = None
    response_format: dict[str, Any] | None = None
    # SGLang's: with --reasoning-parser, return the reasoning as reasoning_content (false:
    # leave it in content).
    separate_reasoning: bool | None = True

    def to_sampling_params(self, guided: Any = None) -> SamplingParams:
        """The engine's parameters (``guided``: the output constraint, from
        :func:`~flotilla.serve.structured_outputs.guided_decoding_of` or the tool plan);
        APIError(400) naming the parameter for bad values."""
        for legacy in ("functions", "function_call"):
            if getattr(self, legacy) is not None:
                raise bad_request(f"{legacy} (function calling) is not supported by this server; send the request without it", legacy)
        reserved = sorted(RESERVED_TEMPLATE_KWARGS & set(self.chat_template_kwargs or {}))
        if reserved:
            raise bad_request(
                f"chat_template_kwargs must not set {', '.join(reserved)} (the server sets those); send template variables only",
                "chat_template_kwargs",
            )
        if self.top_logprobs and not self.logprobs:
            raise bad_request(
                f"top_logprobs needs logprobs=true (got top_logprobs={self.top_logprobs}, logprobs={self.logprobs})",
                "top_logprobs",
            )
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return self._sampling_params(max_tokens, logprobs, guided)


class CompletionRequest(_SamplingRequest):
    """``POST /v1/completions``: ``prompt`` is a string, a list of strings, a list of token
    ids or a list of token-id lists (several prompts give ``len(prompts) * n`` choices)."""

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool | None = False
    suffix: str | None = None
    best_of: int | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt_shape(cls, value: Any) -> Any:
        def ints(v: Any) -> bool:
            return isinstance(v, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in v)

        strings = isinstance(value, list) and all(isinstance(p, str) for p in value)
        token_lists = isinstance(value, list) and all(ints(p) for p in value)
        if not (isinstance(value, str) or strings or ints(value) or token_lists):
            raise ValueError(
                "prompt must be a string, a list of strings, a list of token ids or a list of token-id lists"
            )
        return value

    def to_sampling_params(self, guided: Any = None) -> SamplingParams:
        """The engine's parameters (``guided``: the output constraint); APIError(400) naming
        the parameter for what is unsupported."""
        if self.echo:
            raise bad_request("echo=true is not supported by this server; send echo=false", "echo")
        if self.suffix:
            raise bad_request(f"suffix is not supported by this server (got suffix={quote(self.suffix)})", "suffix")
        if self.best_of is not None and self.best_of != (self.n or 1):
            raise bad_request(f"best_of must equal n here (got best_of={self.best_of}, n={self.n})", "best_of")
        return self._sampling_params(self.max_tokens, self.logprobs, guided)


# -- responses ------------------------------------------------------------------------------


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> "Usage":
        return cls(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens),
        )


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob] | None = None


class AssistantMessage(BaseModel):
    """The answer's message: ``reasoning_content`` with ``--reasoning-parser``,
    ``tool_calls`` when the model called tools (then ``content`` may be null)."""

    role: Literal["assistant"] = "assistant"
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[dict[str, Any]] | None = None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None  # with return_token_ids


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage
    system_fingerprint: str | None = None
    prompt_token_ids: list[int] | None = None  # with return_token_ids


class DeltaMessage(BaseModel):
    role: str | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # OpenAI's tool-call deltas (index, id, function)

    @model_serializer(mode="wrap")
    def _drop_none(self, handler):  # a delta carries only what changed
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None  # with return_token_ids: this frame's new ids


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: Usage | None = None
    prompt_token_ids: list[int] | None = None  # with return_token_ids: on the role frames


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    """One choice; with ``return_token_ids`` it carries its generated ``token_ids`` (streamed:
    each frame's new ids) and its prompt's ``prompt_token_ids`` (streamed: on its first frame)."""

    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None
    prompt_token_ids: list[int] | None = None


class CompletionResponse(BaseModel):
    """A ``text_completion``; streamed chunks have the same shape (with ``usage`` null
    except on the last chunk when ``stream_options.include_usage`` is set)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "flotilla"
    root: str | None = None
    max_model_len: int | None = None
    # Speculative decoding, when on: {"algorithm", "num_draft_tokens"[, "draft_model"]}.
    speculative_decoding: dict[str, Any] | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
