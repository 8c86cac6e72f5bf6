"""The OpenAI HTTP ingress: ``create_app(engine, tokenizer, options, config)`` -> FastAPI app.

Routes: ``POST /v1/chat/completions`` (structured outputs, tool calls, reasoning content:
see docs/api.md), ``POST /v1/responses`` (OpenAI's Responses API, stateless, run as a chat
request: :mod:`flotilla.serve.openai_responses`), ``POST /v1/completions``, ``GET /v1/models`` and ``GET /v1/models/{id}``,
``POST /v1/embeddings`` (:mod:`flotilla.serve.embeddings`), ``POST /tokenize`` and
``POST /detokenize``, ``GET /health`` (503 when the engine is dead or the server drains;
no API key needed), ``GET /metrics`` (the ingress's HTTP metrics merged with the engine
side's exposition).

Draining (``flotilla serve`` got SIGTERM or Ctrl-C; :mod:`flotilla.serve.drain`): every new
request but ``/metrics`` gets 503 with ``Retry-After`` and ``code: server_shutting_down``
(``/health`` too, so load balancers stop sending); requests in flight run on until
``--shutdown-timeout`` passes, when a stream still running ends with an error frame and
``[DONE]`` and a request not yet answered gets 503.

Elastic EP admin (vLLM's and SGLang's shapes; 404 unless the deployment is elastic,
``options.elastic_plan``): ``POST /scale_elastic_ep`` with ``{"new_ep_size": N}`` (vLLM's
``new_data_parallel_size`` is an alias) grows the group and answers when it serves at
the new size (400 bad size, 409 a scale is running, 500 the join failed: the group keeps
its old size); ``GET`` or ``POST /is_scaling_elastic_ep`` answers
``{"is_scaling_elastic_ep": <bool>}``; ``GET /v1/models`` adds ``ep_size`` and
``max_ep_size`` to the model card.

Where the work happens:

- The ingress parses and validates the request (:mod:`flotilla.serve.protocol`), applies
  the chat template and tokenizes (:mod:`flotilla.serve.prompts`), sends token ids to the
  engine as :class:`GenerateRequest` s, and turns the engine's chunks into OpenAI responses
  or SSE frames (:mod:`flotilla.serve.responses`).
- Incremental detokenization happens in the ENGINE, not here: the engine already holds the
  tokenizer, and a stop string must end generation at the step that completes it (freeing
  the slot at once), which only the engine loop can do. Chunks therefore arrive with their
  text final (never a split multi-byte character, never the start of a stop string).
- Errors use OpenAI's envelope: 400 bad input (naming the parameter and value), 401 bad
  API key, 404 unknown model or route, 405 a method the route does not take, 408 a body
  not whole within ``options.request_body_timeout_s``, 413 body over
  ``options.max_body_bytes`` (counted while reading, whatever Content-Length says), 415 a
  Content-Type that is not JSON, 431 headers over ``options.max_header_bytes``, 429 +
  ``Retry-After`` when the engine's queue is full (a multi-prompt request counts as all its
  prompts), 503 when the engine is dead or fails the request. A streaming request that
  fails after its first chunk gets ``data: {"error": {...}}`` and ``data: [DONE]``. When one
  prompt of a multi-prompt request is refused, the others are aborted before the answer.
- Each request's id is the client's ``X-Request-Id`` (a uuid when absent), echoed in the
  response header; one JSON log line per request goes to the ``flotilla.serve.access``
  logger at INFO. A client that disconnects mid-stream closes the engine stream, which
  aborts the request and frees its KV blocks.

Under Ray Serve (``flotilla.serve.app``) the same app is wrapped late-bound: the deployment
builds the engine client and tokenizer in ``__init__``, calls ``create_app(...,
echo_request_id=False)`` (Serve's proxy already echoes ``X-Request-Id``) and returns the app
from ``__serve_build_asgi_app__``; the class is decorated with ``serve.ingress()`` (no
argument). A replica's logging is unconfigured: :func:`configure_access_log` routes the
access log to stderr, which Serve collects.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import json
import logging
import re
import time
import uuid
from typing import Any

import anyio
from fastapi import FastAPI, Request
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from starlette.datastructures import Headers, MutableHeaders
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.responses import JSONResponse, Response, StreamingResponse

from flotilla.serve.drain import DrainState, DrainWatch
from flotilla.serve.elastic_ep import NEW_EP_SIZE, NEW_EP_SIZE_ALIAS, ElasticScaleError, not_elastic_message
from flotilla.serve.metrics import merge_expositions
from flotilla.serve.migration import migrating
from flotilla.serve.openai_responses import ResponsesRequest, answer, chat_request_of, responses_params
from flotilla.cluster.engine.limits import block_size_for
from flotilla.cluster.engine.speculative import speculation_summary
from flotilla.cluster.models.tokenizer import load_chat_template
from flotilla.serve.prompts import Prompt, normalize_prompts, prefix_key, render_chat
from flotilla.serve.assistant_output import AssistantOutput
from flotilla.serve.reasoning_parsers import reasoning_parser_for
from flotilla.serve.structured_outputs import guided_decoding_of
from flotilla.serve.tool_parsers import tool_parser_for
from flotilla.serve.embeddings import EmbeddingRequest, embedding_inputs, embedding_response
from flotilla.serve.tokenization import DetokenizeRequest, TokenizeRequest, detokenize, tokenize
from flotilla.serve.tools import plan_tools
from flotilla.serve.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    ModelCard,
    ModelList,
    bad_request,
    model_not_found,
    parse_request,
    quote,
)
from flotilla.serve.request_log import RequestLogSettings, format_record, request_log, request_record
from flotilla.serve.responses import (
    SSE_DONE,
    EngineStreams,
    GenerationJob,
    chat_frames,
    completion_frames,
    engine_error,
    respond,
    sse,
    unavailable,
)
from flotilla.serve.types import EngineClient, EngineUnavailableError, GenerateRequest, ServeOptions

logger = logging.getLogger(__name__)
access_log = logging.getLogger("flotilla.serve.access")

# The status the access log and flotilla:http_requests_total give a request whose client closed
# the connection before any answer (nginx's 499; no response is sent).
CLIENT_CLOSED = 499
# Routes that change or inspect the deployment itself: with --admin-api-key they need that key
# (the user --api-key does not open them); without it they need --api-key like every route.
ADMIN_ROUTES = ("/scale_elastic_ep", "/is_scaling_elastic_ep")
_ROUTES = ("/v1/chat/completions", "/v1/responses", "/v1/completions", "/v1/embeddings", "/v1/models", "/tokenize", "/detokenize", "/health", "/metrics", *ADMIN_ROUTES)
# Route labels of paths with a parameter (one label each, so a client cannot mint series).
_ROUTE_PREFIXES = (("/v1/models/", "/v1/models/{id}"),)
# Routes a drain does not count as in flight (probes and scrapes); /metrics still answers then.
_UNCOUNTED_ROUTES = ("/health", "/metrics")
# Bound on the wait for a request's handler to unwind once a drain's deadline cut it.
CUT_UNWIND_S = 5.0
# Logged at DEBUG: probes, scrapes and scale polls are frequent.
_QUIET_ROUTES = ("/health", "/metrics", "/is_scaling_elastic_ep")


def create_app(
    engine: EngineClient,
    tokenizer: Any,
    options: ServeOptions,
    config: Any,
    *,
    echo_request_id: bool = True,
    max_model_len: int | None = None,
    ingress_id: str | None = None,
) -> FastAPI:
    """The OpenAI-compatible FastAPI app over ``engine``.

    Args:
        engine: where requests go (an in-process AsyncEngine, or Serve handles).
        tokenizer: an HF tokenizer for chat templates and text prompts (None: token-id prompts only).
        options: serving options (served model name, API key, body limit).
        config: the ResolvedConfig (chat template, page size, context length, api key).
        echo_request_id: add ``X-Request-Id`` to responses (off under Serve, whose proxy adds it).
        max_model_len: the longest sequence the engines take, for ``/v1/models`` (default: the
            config's ``context_length``).
        ingress_id: this ingress replica's id when there are several (Serve): its HTTP series
            carry it as the ``ingress`` label, so ``/metrics`` can merge every replica's
            (``app.state.metrics_exposition()`` is its own text, for the metrics hub).
    """
    ingress = _Ingress(engine, tokenizer, options, config, max_model_len, ingress_id)
    # NOTE: no redirects for a trailing slash: the Location would echo the client's Host header.
    app = FastAPI(title="flotilla", docs_url=None, redoc_url=None, openapi_url=None, redirect_slashes=False)
    app.add_middleware(_Observer, ingress=ingress, echo_request_id=echo_request_id)
    ingress.drain.start()  # NOTE: in a Serve replica, watch for a drain from the start
    app.state.metrics_exposition = ingress.own_metrics

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await ingress.handle(request, ingress.chat)

    @app.post("/v1/responses")
    async def responses(request: Request) -> Response:
        return await ingress.handle(request, ingress.responses)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await ingress.handle(request, ingress.completions)

    @app.get("/v1/models")
    async def models() -> Response:
        return JSONResponse(await ingress.models())

    @app.get("/v1/models/{model_id:path}")
    async def model(request: Request, model_id: str) -> Response:
        return await ingress.handle(request, lambda _: ingress.model(model_id))

    @app.post("/v1/embeddings")
    async def embeddings(request: Request) -> Response:
        return await ingress.handle(request, ingress.embeddings)

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        return await ingress.handle(request, ingress.tokenize)

    @app.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        return await ingress.handle(request, ingress.detokenize)

    @app.post("/scale_elastic_ep")
    async def scale_elastic_ep(request: Request) -> Response:
        return await ingress.handle(request, ingress.scale_elastic_ep)

    @app.api_route("/is_scaling_elastic_ep", methods=["GET", "POST"])
    async def is_scaling_elastic_ep(request: Request) -> Response:
        return await ingress.handle(request, ingress.is_scaling_elastic_ep)

    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health() -> Response:
        return await ingress.health()

    @app.get("/metrics")
    async def metrics() -> Response:
        return await ingress.metrics()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
        code = "not_found" if exc.status_code == 404 else None
        message = f"{exc.detail}: {request.method} {request.url.path}"
        return error_response(APIError(exc.status_code, message, code=code))

    app.state.ingress = ingress
    return app


def configure_access_log(handler: logging.Handler | None = None) -> logging.Logger:
    """Send the access log (one JSON line per request at INFO) to ``handler`` (default:
    stderr, the message alone) unless it has a handler already; for processes whose
    logging nobody configured, such as a Serve replica."""
    if not access_log.handlers:
        handler = handler or logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(message)s"))
        access_log.addHandler(handler)
        access_log.propagate = False
    access_log.setLevel(logging.INFO)
    return access_log


def error_response(err: APIError) -> JSONResponse:
    return JSONResponse(err.envelope(), status_code=err.status, headers=err.headers)


# The deepest nesting of arrays and objects a body may have (checked before parsing: a deep
# body would exhaust the parser's recursion); OpenAI bodies, JSON schemas included, stay far below.
MAX_JSON_DEPTH = 128
_JSON_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"')
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")


def json_depth(raw: bytes, stop_above: int = MAX_JSON_DEPTH) -> int:
    """The deepest nesting of arrays and objects in ``raw`` (brackets inside strings do not
    count), counted until it exceeds ``stop_above``.

    NOTE: each pass deletes every innermost ``[]``/``{}`` pair in C (a byte loop in Python
    takes most of a second on a 1 MB body); the passes needed are the depth. A run of openers
    longer than ``stop_above`` (how deep bodies mostly look) is caught in one search first."""
    brackets = _JSON_STRING.sub(b"", raw).translate(None, _NOT_BRACKETS)
    if re.search(rb"[\[{]{%d}" % (stop_above + 1), brackets):
        return stop_above + 1  # NOTE: that many openers in a row: deeper than allowed
    depth = 0
    while brackets and depth <= stop_above:
        inner = brackets.replace(b"[]", b"").replace(b"{}", b"")
        if len(inner) == len(brackets):
            break  # NOTE: unbalanced: the parser reports it
        brackets, depth = inner, depth + 1
    return depth


def unencodable_string(body: Any) -> str | None:
    """The path (``messages[0].content``) of the first string in ``body`` that is not valid
    Unicode (an unpaired UTF-16 surrogate such as ``"\\ud800"``, which JSON can spell but no
    tokenizer takes), or None."""
    try:
        json.dumps(body, ensure_ascii=False).encode("utf-8")
        return None
    except UnicodeEncodeError:
        pass
    stack: list[tuple[str, Any]] = [("", body)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                return path or "body"
        elif isinstance(value, dict):
            stack.extend((f"{path}.{k}" if path else str(k), v) for k, v in reversed(value.items()))
        elif isinstance(value, list):
            stack.extend((f"{path}[{i}]", v) for i, v in reversed(list(enumerate(value))))
    return "body"


def _json_media_type(content_type: str | None) -> bool:
    """Whether a Content-Type names JSON (``application/json``, ``application/*+json``;
    parameters such as ``charset=utf-8`` aside). No Content-Type counts as JSON."""
    if content_type is None:
        return True
    media = content_type.split(";", 1)[0].strip().lower()
    return media == "application/json" or (media.startswith("application/") and media.endswith("+json"))


def _not_a_json_number(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number (JSON has no NaN or Infinity); send a finite number")


async def read_json(request: Request, limit: int, timeout_s: float | None = None) -> Any:
    """The request body as JSON; 415 for a Content-Type that is not JSON; 413 beyond
    ``limit`` bytes, counted as they arrive; 408 (and the connection closed) when the body
    has not arrived whole within ``timeout_s`` seconds; 400 for a body that is not UTF-8, is
    nested deeper than :data:`MAX_JSON_DEPTH`, spells NaN or Infinity, or holds a string that
    is not valid Unicode (naming where)."""
    content_type = request.headers.get("content-type")
    if not _json_media_type(content_type):
        raise APIError(
            415,
            f"the request body must be JSON (got Content-Type {quote(content_type)}); "
            "send it with 'Content-Type: application/json'",
            code="unsupported_media_type",
        )
    too_large = APIError(
        413,
        f"the request body is larger than this server's limit of {limit} bytes; send a smaller request",
        code="request_too_large",
    )
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise too_large
    size, parts = 0, []
    try:
        async with asyncio.timeout(timeout_s):
            async for part in request.stream():
                size += len(part)
                if size > limit:
                    raise too_large
                parts.append(part)
    except TimeoutError:
        expected = f"of the {declared} declared " if declared is not None and declared.isdigit() else ""
        raise APIError(
            408,
            f"the request body did not arrive within {timeout_s:g} s ({size} bytes {expected}came); "
            "send the whole body at once (this server's --request-body-timeout-s)",
            code="request_timeout",
            headers={"Connection": "close"},
        ) from None
    if not size:
        raise bad_request("the request body is empty; send a JSON object")
    raw = b"".join(parts)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise bad_request(
            f"the request body is not valid UTF-8 (byte {exc.start} is {raw[exc.start:exc.start + 1]!r}); "
            "send JSON encoded as UTF-8"
        ) from None
    depth = json_depth(raw)
    if depth > MAX_JSON_DEPTH:
        raise bad_request(
            f"the request body nests arrays and objects more than {MAX_JSON_DEPTH} deep; send a flatter body"
        )
    try:
        body = json.loads(text, parse_constant=_not_a_json_number)
    except (ValueError, RecursionError) as exc:
        raise bad_request(f"the request body is not valid JSON: {exc}") from None
    where = unencodable_string(body)
    if where is not None:
        param = where.split(".")[0].split("[")[0]
        raise bad_request(f"{where} holds an unpaired UTF-16 surrogate (not valid Unicode); send valid UTF-8 text", param)
    return body


def admin_error(exc: BaseException) -> APIError:
    """The envelope of a failed elastic EP admin call: an
    :class:`~flotilla.serve.elastic_ep.ElasticScaleError` keeps its status (400, 404, 409,
    500, 503), a dead or unreachable engine is a 503."""
    cause = getattr(exc, "cause", None)  # NOTE: Ray's RayTaskError wraps the replica's exception
    if isinstance(cause, BaseException):
        exc = cause
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, ElasticScaleError):
        kind = "invalid_request_error" if exc.status < 500 else "server_error"
        return APIError(exc.status, str(exc), exc.param, type=kind, code=exc.code)
    if isinstance(exc, EngineUnavailableError):
        return unavailable(f"the engine is unavailable: {exc}")
    logger.error("elastic EP admin call failed: %s: %s", type(exc).__name__, exc)
    return unavailable(f"the elastic EP admin call failed: {type(exc).__name__}: {exc}")


class _Ingress:
    """The app's state and request handlers (what :func:`create_app` closes over)."""

    def __init__(
        self,
        engine: EngineClient,
        tokenizer: Any,
        options: ServeOptions,
        config: Any,
        max_model_len: int | None,
        ingress_id: str | None = None,
    ):
        self.engine, self.tokenizer, self.options, self.config = engine, tokenizer, options, config
        self.max_model_len = max_model_len if max_model_len is not None else getattr(config, "context_length", None)
        self.served_model = options.served_model_name
        self.api_key = options.api_key or getattr(config, "api_key", None)
        self.admin_api_key = getattr(config, "admin_api_key", None) or None
        self.chat_template = load_chat_template(getattr(config, "chat_template", None))
        self.template_kwargs = dict(getattr(config, "default_chat_template_kwargs", None) or {})
        self.request_log = RequestLogSettings.of(config)
        self.block_size = block_size_for(config)  # NOTE: a prefix key covers one KV block
        # --tool-call-parser and --reasoning-parser (an unknown name fails here, at start).
        self.tool_call_parser = getattr(config, "tool_call_parser", None) or None
        if self.tool_call_parser is not None:
            tool_parser_for(self.tool_call_parser, [])
        name = getattr(config, "reasoning_parser", None) or None
        self.reasoning_parser = reasoning_parser_for(name) if name is not None else None
        self.registry = CollectorRegistry(auto_describe=True)
        # NOTE: with several ingress replicas each one's series carry its id (merged in /metrics).
        self._ingress_label = {} if ingress_id is None else {"ingress": str(ingress_id)}
        self.http_requests = Counter(
            "flotilla:http_requests",
            "HTTP requests by route and status.",
            ["method", "path", "status", *self._ingress_label],
            registry=self.registry,
        )
        self.http_latency = Histogram(
            "flotilla:http_request_duration_seconds",
            "Seconds from a request's arrival to its last byte.",
            ["method", "path", *self._ingress_label],
            registry=self.registry,
        )
        migrations = Counter(
            "flotilla:requests_migrated",
            "Requests re-submitted to another engine replica after theirs was lost (--migration-limit).",
            [*self._ingress_label],
            registry=self.registry,
        )
        self._count_migration = (migrations.labels(**self._ingress_label) if self._ingress_label else migrations).inc
        # The drain of `flotilla serve` (SIGTERM): refuse new requests, count those in flight.
        self.drain = DrainWatch(str(ingress_id or "local"))

    # -- small routes ------------------------------------------------------------------------

    def model_list(self) -> ModelList:
        # NOTE: root is the --model value as given (the embedded model: its name), never a
        # resolved path of this machine's file system.
        root = self.options.model or self.served_model
        card = ModelCard(
            id=self.served_model, root=str(root), max_model_len=self.max_model_len,
            speculative_decoding=speculation_summary(self.config),
        )
        return ModelList(data=[card])

    async def model(self, model_id: str) -> Response:
        """``GET /v1/models/{id}``: the served model's card (the openai client's
        ``models.retrieve``); 404 for any other id."""
        self._check_model(model_id)
        return JSONResponse((await self.models())["data"][0])

    async def models(self) -> dict[str, Any]:
        """``GET /v1/models``: the model list; an elastic deployment's card also has
        ``ep_size`` (read from the replica; null when it does not answer) and ``max_ep_size``."""
        body = self.model_list().model_dump()
        plan = self.options.elastic_plan
        if plan is not None:
            ep_size = None
            try:
                ep_size = (await self.engine.elastic_ep_state())["ep_size"]
            except Exception as exc:  # noqa: BLE001 - the list itself is still worth serving
                logger.warning("elastic EP state unavailable for /v1/models: %s", exc)
            body["data"][0].update(ep_size=ep_size, max_ep_size=plan.max_ep_size)
        return body

    async def embeddings(self, request: Request) -> Response:
        """``POST /v1/embeddings`` (see :mod:`flotilla.serve.embeddings`)."""
        req = parse_request(EmbeddingRequest, await self._body(request))
        self._check_model(req.model)
        params = req.sampling_params()
        prompts = embedding_inputs(req, self.tokenizer, self.options.max_prompts_per_request)
        rid = request.state.request_id
        job = GenerationJob("embedding", f"embd-{rid}", self.served_model, 1, prompts, None, False, self._decode)
        request.state.job = job  # NOTE: the access log reads its usage
        streams = await self._start(request, job, params, "input")
        try:
            body = await embedding_response(req, job, streams)
        finally:
            await streams.close()
        return JSONResponse(body)

    async def tokenize(self, request: Request) -> Response:
        """``POST /tokenize`` (see :mod:`flotilla.serve.tokenization`)."""
        req = parse_request(TokenizeRequest, await self._body(request))
        self._check_model(req.model)
        return JSONResponse(tokenize(req, self.tokenizer, self.chat_template, self.template_kwargs, self.max_model_len))

    async def detokenize(self, request: Request) -> Response:
        """``POST /detokenize`` (see :mod:`flotilla.serve.tokenization`)."""
        req = parse_request(DetokenizeRequest, await self._body(request))
        self._check_model(req.model)
        return JSONResponse(detokenize(req, self.tokenizer))

    # -- elastic EP admin ------------------------------------------------------------------------

    def _elastic_client(self, route: str) -> Any:
        if self.options.elastic_plan is None or not hasattr(self.engine, "scale_elastic_ep"):
            raise APIError(404, not_elastic_message(route), code="not_found")
        return self.engine

    async def scale_elastic_ep(self, request: Request) -> Response:
        """``POST /scale_elastic_ep``: ``{"new_ep_size": N}`` (or ``new_data_parallel_size``)."""
        client = self._elastic_client("POST /scale_elastic_ep")
        body = await read_json(request, self.options.max_body_bytes, self.options.request_body_timeout_s)
        if not isinstance(body, dict):
            raise bad_request(f"the request body must be a JSON object like {{\"{NEW_EP_SIZE}\": 2}}", NEW_EP_SIZE)
        given = {k: body[k] for k in (NEW_EP_SIZE, NEW_EP_SIZE_ALIAS) if k in body}
        if not given:
            raise bad_request(
                f"the request body needs {NEW_EP_SIZE} (an integer; vLLM's {NEW_EP_SIZE_ALIAS} is accepted too)",
                NEW_EP_SIZE,
            )
        if len(given) == 2 and given[NEW_EP_SIZE] != given[NEW_EP_SIZE_ALIAS]:
            raise bad_request(
                f"{NEW_EP_SIZE}={given[NEW_EP_SIZE]!r} and {NEW_EP_SIZE_ALIAS}={given[NEW_EP_SIZE_ALIAS]!r} "
                "disagree; send one of them",
                NEW_EP_SIZE,
            )
        try:
            result = await client.scale_elastic_ep(next(iter(given.values())))
        except Exception as exc:  # noqa: BLE001 - every failure becomes an envelope
            raise admin_error(exc) from None
        return JSONResponse(result)

    async def is_scaling_elastic_ep(self, request: Request) -> Response:
        """``GET``/``POST /is_scaling_elastic_ep``: ``{"is_scaling_elastic_ep": <bool>}``."""
        client = self._elastic_client(f"{request.method} /is_scaling_elastic_ep")
        try:
            scaling = bool(await client.is_scaling_elastic_ep())
        except Exception as exc:  # noqa: BLE001 - every failure becomes an envelope
            raise admin_error(exc) from None
        return JSONResponse({"is_scaling_elastic_ep": scaling})

    async def health(self) -> Response:
        """``GET``/``HEAD /health``: 200 while the endpoint serves, 503 when it cannot. An
        engine client that reports pools (PD: :meth:`~flotilla.serve.pd.PDEngineClient.health`)
        gets its report as the body: ``{"status": "ok" | "degraded" | "down", "pools": ...}``,
        200 for ok or degraded (the decode pool serves every request whole), 503 for down."""
        report = getattr(self.engine, "health", None)
        try:
            if report is not None:
                body = await report()
                status = 503 if body.get("status") == "down" else 200
                return JSONResponse(body, status_code=status)
            healthy = await self.engine.is_healthy()
        except Exception as exc:  # noqa: BLE001 - an unreachable engine is an unhealthy one
            logger.warning("health check failed: %s", exc)
            healthy = False
        return Response(status_code=200) if healthy else error_response(unavailable("the engine is not healthy"))

    def own_metrics(self) -> str:
        """This ingress replica's own series (Prometheus text)."""
        return generate_latest(self.registry).decode()

    def observe_http(self, method: str, route: str, status: int, latency: float) -> None:
        """Count one answered request and its latency."""
        self.http_requests.labels(method, route, str(status), *self._ingress_label.values()).inc()
        self.http_latency.labels(method, route, *self._ingress_label.values()).observe(latency)

    async def metrics(self) -> Response:
        """``GET /metrics``: the engine replicas' and the other ingress replicas' series (from
        the metrics hub, pushed about once a second) merged with this replica's own, read now
        (they win over this replica's pushed copy)."""
        own = self.own_metrics()
        try:
            text = merge_expositions([await self.engine.metrics_text(), own])
        except Exception as exc:  # noqa: BLE001 - the ingress's own metrics are still worth serving
            logger.warning("engine metrics unavailable: %s", exc)
            text = own
        return Response(text, media_type=CONTENT_TYPE_LATEST)

    # -- generation ----------------------------------------------------------------------------

    async def handle(self, request: Request, handler) -> Response:
        try:
            return await handler(request)
        except APIError as err:
            return error_response(err)
        except ClientDisconnect:
            raise  # NOTE: nobody to answer; the observer counts it as 499
        except Exception:
            logger.exception("request %s failed", request.state.request_id)
            return error_response(APIError(500, "internal server error", type="server_error", code="internal_error"))

    def _check_model(self, name: str | None) -> None:
        if name is not None and name != self.served_model:
            raise model_not_found(name, self.served_model)

    async def _body(self, request: Request) -> Any:
        body = await read_json(request, self.options.max_body_bytes, self.options.request_body_timeout_s)
        if self.request_log.enabled:
            request.state.body = body  # NOTE: the request log quotes it when the response is done
        return body

    async def chat(self, request: Request) -> Response:
        req = parse_request(ChatCompletionRequest, await self._body(request))
        self._check_model(req.model)
        params, prompt, assistant = self.prepare_chat(req)
        job = self._job(request, req, "chat", f"chatcmpl-{request.state.request_id}", params, [prompt])
        job.assistant = assistant
        return await self._run(request, job, params, bool(req.stream), "messages", req.priority)

    async def responses(self, request: Request) -> Response:
        """``POST /v1/responses``: OpenAI's Responses API, stateless, run as a chat request
        (see :mod:`flotilla.serve.openai_responses`); errors name the Responses parameter."""
        req = parse_request(ResponsesRequest, await self._body(request))
        self._check_model(req.model)
        rid = request.state.request_id
        with responses_params():
            chat_req = chat_request_of(req)
            params, prompt, assistant = self.prepare_chat(chat_req)
            job = self._job(request, chat_req, "chat", f"resp_{rid}", params, [prompt])
            job.assistant = assistant
            streams = await self._start(request, job, params, "input")
        return await answer(req, job, streams, _SSEResponse)

    def prepare_chat(self, req: ChatCompletionRequest) -> tuple[Any, Prompt, Any]:
        """A chat request's sampling parameters (with its output constraint: a forced tool
        call, ``response_format`` or the extras), its rendered prompt (tools included), and
        the maker of each choice's :class:`AssistantOutput`; APIError(400) naming the parameter."""
        tools = plan_tools(req.tools, req.tool_choice, req.parallel_tool_calls, self.tool_call_parser)
        guided = guided_decoding_of(req, req.response_format)
        forced = tools.guided() if tools is not None else None
        if forced is not None and guided is not None:
            raise bad_request(
                f"tool_choice {tools.mode!r} forces a tool call and cannot be combined with {guided.param}; send one of them",
                "tool_choice",
            )
        guided = forced or guided
        params = req.to_sampling_params(guided)  # NOTE: first: it checks what the template gets too
        prompt = render_chat(
            self.tokenizer,
            req.messages,
            chat_template=self.chat_template,
            add_generation_prompt=req.add_generation_prompt is not False,
            template_kwargs={**self.template_kwargs, **(req.chat_template_kwargs or {})},
            tools=tools.template_tools if tools is not None else None,
        )
        parser = self.reasoning_parser
        in_reasoning = parser is not None and parser.starts_in_reasoning(prompt.text)
        if guided is not None and parser is not None:
            # NOTE: the constraint applies after the reasoning section, whether or not it is split off.
            encode = self.tokenizer.encode
            gated = dataclasses.replace(
                guided,
                reasoning_start=tuple(encode(parser.start, add_special_tokens=False)),
                reasoning_end=tuple(encode(parser.end, add_special_tokens=False)),
                starts_in_reasoning=in_reasoning,
            )
            params = dataclasses.replace(params, guided=gated)
        split = parser if req.separate_reasoning is not False else None
        if split is None and tools is None:
            return params, prompt, None
        return params, prompt, lambda: AssistantOutput(split, in_reasoning and split is not None, tools)

    async def completions(self, request: Request) -> Response:
        req = parse_request(CompletionRequest, await self._body(request))
        self._check_model(req.model)
        params = req.to_sampling_params(guided_decoding_of(req))
        prompts = normalize_prompts(req.prompt, self.tokenizer, self.options.max_prompts_per_request)
        job = self._job(request, req, "completion", f"cmpl-{request.state.request_id}", params, prompts)
        return await self._run(request, job, params, bool(req.stream), "prompt", req.priority)

    def _job(self, request: Request, req, kind: str, response_id: str, params, prompts) -> GenerationJob:
        # NOTE: without a tokenizer the text is empty, so the ids are all a client can see.
        ids = self.tokenizer is None if req.return_token_ids is None else req.return_token_ids
        n, logprobs, model = params.n, params.logprobs, self.served_model
        job = GenerationJob(
            kind, response_id, model, n, prompts, logprobs, req.include_usage, self._decode, return_token_ids=ids,
            keep_text=self.request_log.keeps_text,
        )  # fmt: skip
        request.state.job = job  # NOTE: the access log reads its usage when the response is done
        return job

    async def _run(
        self, request: Request, job: GenerationJob, params, stream: bool, prompt_param: str, priority: int | None = None
    ) -> Response:
        streams = await self._start(request, job, params, prompt_param, priority)
        if stream:
            frames = chat_frames(job, streams) if job.kind == "chat" else completion_frames(job, streams)
            return _SSEResponse(frames, headers={"Cache-Control": "no-cache"}, streams=streams)
        try:
            response = await respond(job, streams)
        finally:
            await streams.close()
        # NOTE: pydantic's JSON writes a non-finite logprob as null; json.dumps would refuse it.
        return Response(response.model_dump_json(), media_type="application/json")

    async def _start(
        self, request: Request, job: GenerationJob, params, prompt_param: str, priority: int | None = None
    ) -> EngineStreams:
        """Send the job's prompts to the engine and wait for their first chunks (refusals
        raise as the APIError the client gets, every stream closed)."""
        rid, arrival = request.state.request_id, request.state.arrival_time
        count = len(job.prompts)
        many = count > 1
        # NOTE: the prompts of one request are one group: an engine replica admits them all or none.
        requests = [
            GenerateRequest(
                f"{rid}-{i}" if many else rid, p.token_ids, params, arrival, self._prefix_key(p), priority,
                group_id=rid if many else None, group_size=count,
            )
            for i, p in enumerate(job.prompts)
        ]  # fmt: skip
        iterators = []
        try:
            for r in requests:
                iterators.append(
                    migrating(self.engine.generate, r, self.options.migration_limit, on_migrate=self._count_migration)
                )
        except Exception as exc:
            await EngineStreams(iterators, prompt_param).close()
            raise engine_error(exc, prompt_param) from None
        streams = EngineStreams(iterators, prompt_param)
        await streams.start()
        return streams

    def _prefix_key(self, prompt) -> int | None:
        return prefix_key(prompt.token_ids, self.block_size)

    def _decode(self, step, token_id: int) -> str:
        entry = step.get(token_id)
        if entry is not None and entry.decoded_token is not None:
            return entry.decoded_token
        if self.tokenizer is not None:
            return self.tokenizer.decode([token_id])
        return f"token_id:{token_id}"


class _SSEResponse(StreamingResponse):
    """Server-sent events that always watch for the client going away.

    NOTE: Starlette stops listening for ``http.disconnect`` under ASGI spec 2.4 and relies
    on ``send`` failing, which some servers never do; a stream must notice at once, since
    cancelling it closes the engine stream and frees the request's KV blocks.
    """

    media_type = "text/event-stream"

    def __init__(self, content, *, streams: EngineStreams, **kwargs):
        super().__init__(content, **kwargs)
        self.streams = streams

    async def __call__(self, scope, receive, send) -> None:
        try:
            async with anyio.create_task_group() as group:

                async def run_stream() -> None:
                    await self.stream_response(send)
                    group.cancel_scope.cancel()

                group.start_soon(run_stream)
                await self.listen_for_disconnect(receive)
                group.cancel_scope.cancel()
        finally:
            # NOTE: a client gone before the first frame leaves the frames' generator
            # unstarted (its own finally never runs): the engine streams close here.
            await self.streams.close()


class _Observer:
    """ASGI middleware: request ids, the API key, HTTP metrics and the access log."""

    def __init__(self, app, ingress: _Ingress, echo_request_id: bool = True):
        self.app, self.ingress, self.echo_request_id = app, ingress, echo_request_id

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        headers = Headers(scope=scope)
        request_id = headers.get("x-request-id") or uuid.uuid4().hex
        state = scope.setdefault("state", {})
        state.update(request_id=request_id, arrival_time=time.time())
        status = 500  # NOTE: what an exception before the response start amounts to
        started = False

        async def send_observed(message) -> None:
            nonlocal status, started
            if message["type"] == "http.response.start":
                status, started = message["status"], True
                if self.echo_request_id:
                    message.setdefault("headers", [])
                    MutableHeaders(scope=message).append("x-request-id", request_id)
            await send(message)

        path = scope.get("path", "")
        drain = self.ingress.drain
        drain.start()
        try:
            header_bytes = sum(len(name) + len(value) for name, value in scope.get("headers", ()))
            key, which = self._required_key(path)
            if header_bytes > self.ingress.options.max_header_bytes:
                await error_response(_headers_too_large(header_bytes, self.ingress.options.max_header_bytes))(
                    scope, receive, send_observed
                )
            elif key is not None and not _bearer_matches(headers, key):
                message = f"missing or incorrect {which}; send it as 'Authorization: Bearer <key>'"
                await error_response(APIError(401, message, code="invalid_api_key"))(scope, receive, send_observed)
            elif drain.state is not None and path != "/metrics":
                await error_response(draining_error(drain.state))(scope, receive, send_observed)
            elif path in _UNCOUNTED_ROUTES:
                await self.app(scope, receive, send_observed)
            else:
                await self._serve_in_flight(scope, receive, send_observed)
        except asyncio.CancelledError:
            if not started:
                status = CLIENT_CLOSED  # NOTE: the client left before any answer: not a server error
            raise
        except ClientDisconnect:
            # NOTE: the client left while its body was read: nobody to answer, not a server error.
            if not started:
                status = CLIENT_CLOSED
        finally:
            self._observe(scope, path, status, time.perf_counter() - start, state)

    async def _serve_in_flight(self, scope, receive, send) -> None:
        """Serve one request, counted in flight for a drain; when the drain's deadline passes
        first, cut it (:func:`_end_cut`)."""
        drain = self.ingress.drain
        sent = _SentState()

        async def send_tracked(message) -> None:
            sent.saw(message)
            await send(message)

        cut = drain.enter()
        app = asyncio.ensure_future(self.app(scope, receive, send_tracked))
        try:
            await asyncio.wait((app, cut), return_when=asyncio.FIRST_COMPLETED)
            if app.done():
                app.result()  # NOTE: re-raises what the app raised
                return
            app.cancel()
            await asyncio.wait((app,), timeout=CUT_UNWIND_S)
            await _end_cut(drain.state, sent, scope, receive, send)
        finally:
            if not app.done():
                # NOTE: this request was cancelled (its client left): so is its handler.
                app.cancel()
                await asyncio.wait((app,), timeout=CUT_UNWIND_S)
            drain.leave(cut)

    def _required_key(self, path: str) -> tuple[str | None, str]:
        """The key ``path`` needs (None: open) and how the 401 names it: ``/health`` is open;
        :data:`ADMIN_ROUTES` need ``--admin-api-key`` when it is set, else ``--api-key``;
        every other route needs ``--api-key`` when it is set."""
        if path == "/health":
            return None, ""
        if path in ADMIN_ROUTES and self.ingress.admin_api_key:
            return self.ingress.admin_api_key, "admin API key (--admin-api-key)"
        return self.ingress.api_key or None, "API key"

    def _observe(self, scope, path: str, status: int, latency: float, state: dict) -> None:
        route = path if path in _ROUTES else next((label for prefix, label in _ROUTE_PREFIXES if path.startswith(prefix)), "other")
        method = scope.get("method", "")
        self.ingress.observe_http(method, route, status, latency)
        record = {
            "request_id": state.get("request_id"),
            "method": method,
            "path": path,
            "status": status,
            "latency_s": round(latency, 4),
        }
        job = state.get("job")
        if job is not None and job.usage:
            record.update(zip(("prompt_tokens", "completion_tokens", "cached_tokens"), job.totals()))
        if job is not None:
            record.update(job.served_by())
        level = logging.DEBUG if path in _QUIET_ROUTES and status < 400 else logging.INFO
        access_log.log(level, json.dumps(record))
        settings = self.ingress.request_log
        if settings.enabled and job is not None:
            line = request_record(settings, record, state.get("body"), job.output_texts())
            request_log.info(format_record(settings, line))


class _SentState:
    """What a response has sent so far: started, an SSE stream, finished."""

    def __init__(self) -> None:
        self.started = self.sse = self.finished = False

    def saw(self, message) -> None:
        if message["type"] == "http.response.start":
            self.started = True
            content_type = Headers(raw=message.get("headers", [])).get("content-type", "")
            self.sse = content_type.startswith("text/event-stream")
        elif message["type"] == "http.response.body" and not message.get("more_body", False):
            self.finished = True


def draining_error(state: DrainState) -> APIError:
    """The 503 of a request that arrives while the server drains: why, and ``Retry-After``
    (when this server is gone); ``Connection: close`` so the client reconnects (through a
    load balancer, to another server)."""
    retry = state.retry_after_s()
    message = (
        f"the server is shutting down ({state.reason}) and takes no new requests; "
        f"retry in {retry} s, on another replica or once this server is back"
    )
    headers = {"Retry-After": str(retry), "Connection": "close"}
    return APIError(503, message, type="server_error", code="server_shutting_down", headers=headers)


def cut_error(state: DrainState | None) -> APIError:
    """What a request still running when the drain's deadline passed gets."""
    timeout = f" within --shutdown-timeout {state.timeout_s:g} s" if state is not None else ""
    reason = f" ({state.reason})" if state is not None else ""
    message = f"the server shut down{reason} before this request finished{timeout}; retry the request"
    return APIError(503, message, type="server_error", code="server_shutting_down")


async def _end_cut(state: DrainState | None, sent: _SentState, scope, receive, send) -> None:
    """End a response the drain's deadline cut: a 503 when nothing was sent, an error frame and
    ``[DONE]`` on an SSE stream, else just the end of the body."""
    err = cut_error(state)
    try:
        if not sent.started:
            await error_response(err)(scope, receive, send)
        elif not sent.finished:
            body = (sse(err.envelope()) + SSE_DONE).encode() if sent.sse else b""
            await send({"type": "http.response.body", "body": body, "more_body": False})
    except Exception:  # noqa: BLE001 - the client or the proxy went already
        logger.debug("the cut response could not be sent", exc_info=True)


def _headers_too_large(size: int, limit: int) -> APIError:
    message = (
        f"the request's headers take {size} bytes and this server's limit is {limit} "
        "(--max-header-bytes); send fewer or shorter headers"
    )
    return APIError(431, message, code="request_header_fields_too_large", headers={"Connection": "close"})


def _bearer_matches(headers: Headers, key: str) -> bool:
    scheme, _, given = headers.get("authorization", "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), key.encode())
