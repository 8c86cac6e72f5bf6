"""What crosses the serving boundaries: ingress -> engine replica -> ingress.

Plain picklable dataclasses and exceptions (Ray pickles them between actors); no
FastAPI, no pydantic here. The ingress turns an OpenAI request into a
:class:`GenerateRequest`, the engine replica streams :class:`GenerateChunk` s back,
and the ingress turns those into OpenAI responses or SSE frames.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import AsyncIterator, Protocol

from flotilla.cluster.engine.outputs import StepLogprobs
from flotilla.cluster.engine.sampling_params import SamplingParams


@dataclass
class GenerateRequest:
    """One request as the engine replica receives it (already tokenized by the ingress).

    Attributes:
        request_id: unique id (the ``X-Request-Id`` header when the client sent one).
        prompt_token_ids: the tokenized prompt (chat template applied for chat requests).
        params: validated sampling parameters (``n``, ``max_tokens``, stops, logprobs, seed, ...).
        arrival_time: ``time.time()`` when the ingress received the HTTP request.
        prefix_key: a hash of the prompt's first block(s) for prefix-affinity routing
            (computed by the ingress; None when the prompt is shorter than a block).
    """

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    prefix_key: int | None = None


@dataclass
class CompletionChunk:
    """What one of the request's ``n`` completions gained since the last chunk.

    Attributes:
        index: which completion.
        token_ids: new token ids.
        text: new text (complete UTF-8 characters only; text that might still become a
            stop string is held back until it cannot).
        logprobs: per new token, the candidates, when logprobs were asked for.
        finish_reason: ``"stop"``, ``"length"``, ``"abort"``, ``"error"`` on the last chunk.
        stop_reason: the stop string or stop token id that ended it.
    """

    index: int
    token_ids: list[int]
    text: str
    logprobs: list[StepLogprobs] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class GenerateChunk:
    """One message of the engine replica's stream for a request.

    The first chunk of a request is sent as soon as any completion has a token; the last
    one has ``finished`` set and carries the usage.

    Attributes:
        request_id: the request.
        completions: what each completion gained (only completions that changed).
        finished: every completion has finished.
        prompt_tokens, completion_tokens, cached_tokens: usage (set on the last chunk;
            ``cached_tokens`` = prompt tokens served from the prefix cache).
        queue_time_s: seconds the request waited before its first scheduled step (first chunk).
        error: when the engine failed the request, why (completions finish with ``"error"``).
    """

    request_id: str
    completions: list[CompletionChunk] = field(default_factory=list)
    finished: bool = False
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    queue_time_s: float | None = None
    error: str | None = None


@dataclass(frozen=True)
class ReplicaLoad:
    """An engine replica's load, reported to the router (``record_routing_stats``) and metrics.

    Attributes:
        running: requests being generated.
        waiting: requests queued in the engine (not yet scheduled).
        kv_usage: fraction of KV blocks in use, in [0, 1].
        max_queued: the replica's queue bound (``--max-queued-requests``).
        prefix_keys: prefix keys of recently served prompts (for prefix affinity), newest last.
    """

    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0
    max_queued: int = 0
    prefix_keys: tuple[int, ...] = ()

    @property
    def load(self) -> int:
        """Requests the replica holds (running + waiting)."""
        return self.running + self.waiting


class EngineOverloadedError(RuntimeError):
    """The replica's queue is full; the ingress answers 429 with ``Retry-After``.

    Attributes:
        retry_after_s: a hint for the client.
    """

    def __init__(self, message: str, retry_after_s: int = 1):
        super().__init__(message)
        self.retry_after_s = retry_after_s

    def __reduce__(self):
        return (EngineOverloadedError, (str(self), self.retry_after_s))


class EngineUnavailableError(RuntimeError):
    """The replica's engine is dead (a worker died); the ingress answers 503.
    The replica fails its health check so Serve restarts it."""

    def __reduce__(self):
        return (EngineUnavailableError, (str(self),))


class EngineClient(Protocol):
    """How the ingress talks to the engine: through a Serve handle in the deployed app
    (:mod:`flotilla.serve.app`), or to an in-process :class:`~flotilla.serve.async_engine.AsyncEngine`
    in tests and benchmarks. Errors surface as :class:`EngineOverloadedError`,
    :class:`EngineUnavailableError` or ``ValueError`` (bad input, naming the parameter)."""

    def generate(self, request: GenerateRequest) -> AsyncIterator[GenerateChunk]:
        """Stream the request's chunks; closing the iterator early aborts the request
        (its KV blocks are freed)."""
        ...

    async def is_healthy(self) -> bool:
        """False when the engine is dead (``/health`` answers 503)."""
        ...

    async def metrics_text(self) -> str:
        """The engine side's Prometheus exposition (``flotilla:`` metrics)."""
        ...


@dataclass(frozen=True)
class ServeOptions:
    """Serving options that are not server fields of the resolved config.

    Attributes:
        model: the ``--model`` value the engine replicas load (None: the embedded SmolLM2).
        served_model_name: the name ``/v1/models`` reports and requests must use (default:
            ``--served-model-name``, else the model path's name).
        num_replicas: engine replicas (default: the resolved ``dp_size`` without DP attention).
        router: ``"least-loaded"`` (default) or ``"prefix-affinity"``.
        max_queued_requests: per-replica queue bound beyond which requests get 429.
        max_body_bytes: the largest request body accepted (413 beyond).
        api_key: Bearer key required on every endpoint but ``/health`` (None: open).
        replica_num_cpus: CPUs each engine replica actor reserves.
    """

    model: str | None = None
    served_model_name: str = "smollm2"
    num_replicas: int = 1
    router: str = "least-loaded"
    max_queued_requests: int = 256
    max_body_bytes: int = 1 << 20
    api_key: str | None = None
    replica_num_cpus: float = 0.5
