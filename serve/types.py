"""What crosses the serving boundaries: ingress -> engine replica -> ingress.

Plain picklable dataclasses and exceptions (Ray pickles them between actors); no
FastAPI, no pydantic here. The ingress turns an OpenAI request into a
:class:`GenerateRequest`, the engine replica streams :class:`GenerateChunk` s back,
and the ingress turns those into OpenAI responses or SSE frames.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, AsyncIterator, Mapping, Protocol

from flotilla.cluster.engine.outputs import StepLogprobs
from flotilla.cluster.engine.sampling_params import SamplingParams
from flotilla.cluster.placement import DEFAULT_PLACEMENT_STRATEGY, check_placement_strategy
from flotilla.resolution import ResolvedConfig
from flotilla.serve.ep_autoscale import AutoscalePolicyConfig

# The engine pools' routers by ``--router`` name: the import path Serve loads
# (:mod:`flotilla.serve.router`; here so that the CLI lists them without importing Ray Serve).
ROUTER_CLASSES = {
    "cache-aware": "flotilla.serve.router.CacheAwareRouter",
    "least-loaded": "flotilla.serve.router.LeastLoadedRouter",
    "prefix-affinity": "flotilla.serve.router.PrefixAffinityRouter",
    "round-robin": "flotilla.serve.router.RoundRobinRouter",
}


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
        priority: the request body's ``priority`` (None when it has none); the engine
            applies ``--enable-priority-scheduling`` and its defaults.
        group_id: the HTTP request's id when it has several prompts (a ``/v1/completions``
            list; each prompt is a GenerateRequest of its own), else None.
        group_size: how many prompts that HTTP request has. An engine replica counts a
            group against its queue bound as all its prompts: the first to arrive is
            admitted only when all fit, and room is held for the rest; otherwise every
            prompt of the group is refused.
        resumed_token_ids: a migrated request (``n == 1``): the tokens a replica that stopped
            had already streamed; the receiving replica computes them as the request's first
            outputs and streams what follows them (``LLMEngine.add_request``).
    """

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    prefix_key: int | None = None
    priority: int | None = None
    group_id: str | None = None
    group_size: int = 1
    resumed_token_ids: tuple[int, ...] = ()


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
        embedding: an embedding request's vector (``SamplingParams.pooling``), on its only chunk.
    """

    index: int
    token_ids: list[int]
    text: str
    logprobs: list[StepLogprobs] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    embedding: list[float] | None = None


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
        replica_id: the engine replica that computed the request (set on its first chunk;
            under PD the decode replica, or the prefill replica when the first token ends it).
        prefill_replica_id: under PD, the prefill replica that computed the prompt (set on
            the first chunk by the ingress's client; empty otherwise).
        replica_failed: with ``error``: the replica failed the request because its engine died
            or shut down, not because of the request; another replica may finish it.
    """

    request_id: str
    completions: list[CompletionChunk] = field(default_factory=list)
    finished: bool = False
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    queue_time_s: float | None = None
    error: str | None = None
    replica_id: str = ""
    prefill_replica_id: str = ""
    replica_failed: bool = False

    def absorb(self, later: GenerateChunk) -> None:
        """Fold ``later`` (the same request's next chunk) into this one, as if the engine
        had sent them as one: each completion's tokens, text and logprobs appended, the
        finish, usage and error of the later chunk kept (``queue_time_s`` is the first's)."""
        mine = {c.index: c for c in self.completions}
        for c in later.completions:
            own = mine.get(c.index)
            if own is None:
                own = mine[c.index] = CompletionChunk(c.index, [], "")
                self.completions.append(own)
            own.token_ids = own.token_ids + c.token_ids
            own.text += c.text
            if c.logprobs is not None:
                own.logprobs = (own.logprobs or []) + list(c.logprobs)
            if c.finish_reason is not None:
                own.finish_reason, own.stop_reason = c.finish_reason, c.stop_reason
        self.completions.sort(key=lambda c: c.index)
        self.finished = later.finished
        self.prompt_tokens, self.completion_tokens = later.prompt_tokens, later.completion_tokens
        self.cached_tokens, self.error = later.cached_tokens, later.error
        self.replica_failed = later.replica_failed
        if self.queue_time_s is None:
            self.queue_time_s = later.queue_time_s


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


@dataclass(frozen=True)
class ElasticEPPlan:
    """Everything a replica needs to grow its group, resolved once by the driver.

    Attributes:
        initial_size: the EP size the deployment starts at (``--elastic-ep-initial-size``,
            the primary's ``tp_size``).
        max_ep_size: the largest EP size it may grow to (``--max-ep-size``).
        scale_timeout_s: bound on one join, placement to commit (``--elastic-ep-scale-timeout``).
        joiner_configs: the joining group's resolved config per ``(current, new)`` size pair.
    """

    initial_size: int
    max_ep_size: int
    scale_timeout_s: float
    joiner_configs: dict[tuple[int, int], ResolvedConfig] = field(default_factory=dict)

    def joiner_config(self, current: int, new: int) -> ResolvedConfig:
        """The config of the group that grows the deployment from ``current`` to ``new``
        ranks; ValueError naming both when the plan has none (outside
        ``initial_size <= current < new <= max_ep_size``)."""
        config = self.joiner_configs.get((current, new))
        if config is None:
            raise ValueError(
                f"no joiner config to grow elastic EP from {current} to {new} ranks: the plan covers "
                f"{self.initial_size} <= current < new <= max_ep_size={self.max_ep_size}"
            )
        return config


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
        return (type(self), (str(self),))


class ReplicaLostError(EngineUnavailableError):
    """The engine replica that was to serve the request is gone or going (its actor died,
    its engine died, it shuts down), through no fault of the request: another replica may
    take it (:mod:`~flotilla.serve.migration`)."""


@dataclass(frozen=True)
class ReplicaPin:
    """Routes a call to one replica of a deployment: the engine routers send a call that
    has a ``ReplicaPin`` among its arguments to the replica whose Serve id (the replica
    tag, ``ReplicaID.unique_id``) is ``replica_id`` while it is among the candidates; when
    it is not (it died), the call is ranked as usual and the receiving replica sees that
    the pin is not its own."""

    replica_id: str


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


class ElasticEPClient(Protocol):
    """The admin side of an elastic EP deployment, as the ingress reaches it (the engine
    replica's methods through a Serve handle). Errors: the replica's
    :class:`~flotilla.serve.elastic_ep.ElasticScaleError` s (their ``status`` is the HTTP
    answer), :class:`EngineUnavailableError`."""

    async def scale_elastic_ep(self, new_ep_size: Any) -> dict[str, Any]:
        """Grow the group to ``new_ep_size`` ranks; the scale's message, sizes and timings."""
        ...

    async def is_scaling_elastic_ep(self) -> bool:
        """Whether a scale is running."""
        ...

    async def elastic_ep_state(self) -> dict[str, Any]:
        """``ep_size``, ``max_ep_size``, ``initial``, ``scaling``, ``last_error``."""
        ...


def _policy_default(name: str) -> Any:
    return next(f.default for f in fields(AutoscalePolicyConfig) if f.name == name)


@dataclass(frozen=True)
class ElasticAutoscaleOptions:
    """The elastic EP autoscaler of an engine replica (:mod:`flotilla.serve.ep_autoscale_driver`).

    Attributes:
        enabled: run it (``--elastic-ep-autoscale``); off by default.
        interval_s: seconds between load samples.
        waiting_per_rank_threshold, kv_usage_threshold, ttft_p90_threshold_s: the policy's
            thresholds (None turns a signal off); see
            :class:`~flotilla.serve.ep_autoscale.AutoscalePolicyConfig`, whose defaults these are.
        window_s: how long every sample must stay above before a join is requested.
        cooldown_s: no join within this long of the last scale request or outcome.
        step: ranks to add per join.
    """

    enabled: bool = False
    interval_s: float = 5.0
    waiting_per_rank_threshold: float | None = _policy_default("waiting_per_rank_threshold")
    kv_usage_threshold: float | None = _policy_default("kv_usage_threshold")
    ttft_p90_threshold_s: float | None = _policy_default("ttft_p90_threshold_s")
    window_s: float = _policy_default("window_s")
    cooldown_s: float = _policy_default("cooldown_s")
    step: int = _policy_default("step")

    def __post_init__(self) -> None:
        interval = self.interval_s
        if isinstance(interval, bool) or not isinstance(interval, (int, float)) or not interval > 0:
            raise ValueError(f"ElasticAutoscaleOptions.interval_s must be a number of seconds > 0 (got interval_s={interval!r})")
        self.policy(1)  # NOTE: the policy's own checks, naming the field and value

    def policy(self, max_ep_size: int) -> AutoscalePolicyConfig:
        """The policy for a deployment of ``max_ep_size``; a sample gap of three intervals
        (at least the policy's default) still counts as one run."""
        gap = max(_policy_default("max_sample_gap_s"), 3 * float(self.interval_s))
        return AutoscalePolicyConfig(
            max_ep_size=max_ep_size,
            waiting_per_rank_threshold=self.waiting_per_rank_threshold,
            kv_usage_threshold=self.kv_usage_threshold,
            ttft_p90_threshold_s=self.ttft_p90_threshold_s,
            window_s=self.window_s,
            cooldown_s=self.cooldown_s,
            step=self.step,
            max_sample_gap_s=gap,
        )


@dataclass(frozen=True)
class ServeOptions:
    """What the serving side needs beside each pool's resolved config, set in one place
    (:func:`~flotilla.serve.plan.serve_options`, called by ``plan_serving``): options that are
    not server fields (PD mode and KV transport, pool sizes, the router, client limits,
    placement, the elastic plan), and three server fields the ingress and the deployments read
    before any engine exists, taken from the given flags and the resolved config there and
    never derived again: ``served_model_name``, ``max_queued_requests``, ``api_key``.

    Attributes:
        model: the ``--model`` value the engine replicas load (None: the embedded SmolLM2).
        served_model_name: the name ``/v1/models`` reports and requests must use (default:
            ``--served-model-name``, else the model path's name).
        num_replicas: engine replicas (default: the resolved ``dp_size`` without DP attention).
        num_ingress_replicas: replicas of the ``ingress`` deployment (``--num-ingress-replicas``;
            default 2, as Ray Serve LLM's). Each tokenizes, applies templates and streams SSE
            for the requests Serve's proxy hands it; they share no state but their soft routing
            hints (each cache-aware router learns from its own traffic), and ``/metrics`` on
            any of them merges every ingress replica's and engine replica's series.
        router: the engine pools' router (``--router``): ``"cache-aware"`` (default),
            ``"least-loaded"``, ``"prefix-affinity"`` or ``"round-robin"``
            (:data:`~flotilla.serve.router.ROUTER_CLASSES`); the prefill pool is always cache-aware.
        max_queued_requests: per-replica queue bound beyond which requests get 429.
        stream_batch_ms: a streamed request's chunks go out at most this often (its tokens
            gather in between; the first and the last go out at once): each chunk crosses Ray
            streaming hops and becomes an SSE frame, which on a GPU cost more than the step
            that made it. 50 ms, as Ray Serve LLM batches its streams; 0: a chunk every
            ``--stream-interval`` tokens.
        max_body_bytes: the largest request body accepted (413 beyond).
        max_prompts_per_request: the most prompts one ``/v1/completions`` request may list
            (400 naming ``prompt`` beyond; ``--max-prompts-per-request``).
        request_body_timeout_s: a request body must arrive whole within this many seconds of
            the request's headers (408 beyond, and the connection is closed;
            ``--request-body-timeout-s``): a client that declares a body and never sends it
            would hold its request, and the engine capacity Serve counts for it, forever.
        max_header_bytes: the most bytes a request's header names and values may take
            together (431 beyond; ``--max-header-bytes``). Serve's proxy itself takes headers
            of any size (see docs/configuration.md, limits on clients).
        http_keep_alive_timeout_s: seconds Serve's proxy keeps an idle keep-alive connection
            open (Serve's ``http_options.keep_alive_timeout_s``; None: Serve's default, 90 s;
            ``--http-keep-alive-timeout-s``).
        http_request_timeout_s: Serve's end-to-end bound on one HTTP request, 408 from the
            proxy beyond (Serve's ``http_options.request_timeout_s``; None: no bound, since a
            long generation is a legitimate request; ``--http-request-timeout-s``).
        api_key: Bearer key required on every endpoint but ``/health`` (None: open).
        replica_num_cpus: CPUs each engine replica actor reserves.
        disaggregation_mode: ``"null"`` (one colocated engine pool) or ``"pd"`` (a prefill
            pool and a decode pool; ``--disaggregation-mode pd``).
        prefill_replicas, decode_replicas: pool sizes in PD mode.
        kv_transport: how KV blocks move in PD mode: ``"nixl"`` (UCX; DRAM on CPU, VRAM on
            GPU) or ``"ray"`` (the Ray-object fallback for machines without NIXL).
        kv_load_failure_policy: what a decode replica does when the prompt's KV cannot be
            loaded: ``"recompute"`` (compute the prompt itself; the client sees no error)
            or ``"fail"`` (the request fails with a clear error). vLLM's name.
        kv_lease_s: how long a prefill replica holds a prompt's blocks for the decode
            replica to read them before freeing them itself.
        kv_transfer_timeout_s: bound on one KV read on the decode side.
        elastic_plan: the joiners of an elastic EP deployment, resolved by the driver
            (:func:`~flotilla.serve.elastic_ep.resolve_elastic_plan`); None: not elastic.
        elastic_autoscale: the elastic EP autoscaler (needs ``elastic_plan``; off by default).
        placement: where ranks run on a multi-node cluster: per group of ranks
            (:data:`PLACEMENT_GROUPS`: ``engine`` (colocated replicas), ``prefill``, ``decode``,
            ``joiners`` (elastic EP joining ranks)), Ray resources each of its engine replica
            actors and each of its rank bundles also requires, e.g. ``{"prefill":
            {"prefill_nodes": 0.001}}`` with ``ray start --resources '{"prefill_nodes": 1}'``
            on the prefill node group. Empty: anywhere the default resources fit.
        placement_strategy: how each pool's worker groups lay their ranks over the nodes: per
            pool (:data:`STRATEGY_POOLS`: ``engine``, ``prefill``, ``decode``), one of
            :data:`~flotilla.cluster.placement.PLACEMENT_STRATEGIES`; a pool it leaves out
            gets ``PACK`` (one node when the group fits one: tensor parallelism inside a
            node). Set by :func:`pool_placement_strategies` from ``--placement-strategy``,
            ``--prefill-placement-strategy``, ``--decode-placement-strategy`` or the
            ``placement_strategy`` config key. Elastic EP joiners always PACK.
        migration_limit: how many times the ingress re-submits a request whose engine replica
            stopped while it ran (``--migration-limit``, Dynamo's name; default 1, 0: off): the
            request goes to a live replica with its prompt and the tokens already streamed,
            which that replica recomputes as the request's own outputs, so the client sees one
            uninterrupted stream (:mod:`~flotilla.serve.migration`).
        shutdown_timeout_s: a stopping engine replica (SIGTERM, ``serve shutdown``, a redeploy)
            refuses new requests and lets its in-flight ones finish for up to this many seconds
            (``--shutdown-timeout``, vLLM's name; Serve's ``graceful_shutdown_timeout_s``);
            what is still running then is migrated or fails with a clear error.
        autoscaling: Serve's ``autoscaling_config`` per pool (:data:`STRATEGY_POOLS`:
            ``engine``, or PD's ``prefill`` and ``decode``): the pool's replica count follows
            its ongoing requests between ``min_replicas`` and ``max_replicas``
            (``--autoscaling-config``, ``--prefill-autoscaling-config``,
            ``--decode-autoscaling-config``; the Serve keys of the same names). A pool it
            leaves out keeps its fixed count. Checked by :func:`check_autoscaling`.
    """

    model: str | None = None
    served_model_name: str = "smollm2"
    num_replicas: int = 1
    router: str = "cache-aware"
    max_queued_requests: int = 256
    stream_batch_ms: float = 50.0
    max_body_bytes: int = 1 << 20
    max_prompts_per_request: int = 64
    request_body_timeout_s: float = 30.0
    max_header_bytes: int = 32 * 1024
    http_keep_alive_timeout_s: int | None = None
    http_request_timeout_s: float | None = None
    api_key: str | None = None
    replica_num_cpus: float = 0.5
    num_ingress_replicas: int = 2
    disaggregation_mode: str = "null"
    prefill_replicas: int = 1
    decode_replicas: int = 1
    kv_transport: str = "nixl"
    kv_load_failure_policy: str = "recompute"
    kv_lease_s: float = 30.0
    kv_transfer_timeout_s: float = 30.0
    elastic_plan: ElasticEPPlan | None = None
    elastic_autoscale: ElasticAutoscaleOptions = field(default_factory=ElasticAutoscaleOptions)
    placement: dict[str, dict[str, float]] = field(default_factory=dict)
    placement_strategy: dict[str, str] = field(default_factory=dict)
    migration_limit: int = 1
    shutdown_timeout_s: float = 10.0
    autoscaling: dict[str, dict[str, Any]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        check_placement(self.placement)
        if not isinstance(self.placement_strategy, dict):
            raise ValueError(
                f"placement_strategy must map pools of {STRATEGY_POOLS} to strategies "
                f"(got placement_strategy={self.placement_strategy!r})"
            )
        pool_placement_strategies(self.placement_strategy)
        count = self.num_ingress_replicas
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise ValueError(f"num_ingress_replicas must be an integer >= 1 (got num_ingress_replicas={count!r})")
        check_autoscaling(self.autoscaling)
        limit = self.migration_limit
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 0:
            raise ValueError(f"migration_limit must be an integer >= 0 (got migration_limit={limit!r})")
        if isinstance(self.shutdown_timeout_s, bool) or not isinstance(self.shutdown_timeout_s, (int, float)) or not 0 <= self.shutdown_timeout_s <= MAX_SHUTDOWN_TIMEOUT_S:
            raise ValueError(
                f"shutdown_timeout_s must be a number of seconds in [0, {MAX_SHUTDOWN_TIMEOUT_S:g}] "
                f"(got shutdown_timeout_s={self.shutdown_timeout_s!r})"
            )
        if not 0 <= self.stream_batch_ms <= MAX_STREAM_BATCH_MS:
            raise ValueError(f"stream_batch_ms must be in [0, {MAX_STREAM_BATCH_MS:g}] ms (got stream_batch_ms={self.stream_batch_ms!r})")

    def resources_for(self, group: str) -> dict[str, float]:
        """The extra Ray resources of ranks (and replica actors) of ``group`` (see ``placement``)."""
        return dict(self.placement.get(group, {}))

    def autoscaling_for(self, group: str) -> dict[str, Any] | None:
        """Serve's ``autoscaling_config`` of the pool ``group`` (see ``autoscaling``), or None;
        latency SLOs (``ttft_slo_s``, ``itl_slo_s``) become its ``policy``, the
        :class:`~flotilla.serve.slo_autoscaling.SLOPolicy`."""
        config = self.autoscaling.get(group)
        return None if config is None else serve_autoscaling_config(config)

    def max_replicas_of(self, group: str) -> int:
        """The most replicas pool ``group`` runs: its ``max_replicas`` when it autoscales, else
        its fixed count (what queue bounds and a local cluster's CPUs are sized for)."""
        config = self.autoscaling.get(group)
        if config is not None:
            return int(config["max_replicas"])
        return {"engine": self.num_replicas, "prefill": self.prefill_replicas, "decode": self.decode_replicas}[group]

    def placement_strategy_for(self, group: str) -> str:
        """The placement strategy of the worker groups of ``group``, one of
        :data:`STRATEGY_POOLS` (see ``placement_strategy``; PACK when it names none)."""
        return check_placement_strategy(self.placement_strategy.get(group, DEFAULT_PLACEMENT_STRATEGY))


# The flag (and Serve key) that sets each pool's ServeOptions.autoscaling.
AUTOSCALING_FLAGS = {"engine": "autoscaling_config", "prefill": "prefill_autoscaling_config", "decode": "decode_autoscaling_config"}


def parse_autoscaling(values: Mapping[str, Any], as_flags: bool = False) -> dict[str, dict[str, Any]]:
    """``ServeOptions.autoscaling`` from the values given under :data:`AUTOSCALING_FLAGS`'
    names (``autoscaling_config``, ...): mappings, or their JSON text. ValueError naming the
    flag (``as_flags``: ``--autoscaling-config``) or the Serve key and the value."""
    import json

    chosen: dict[str, dict[str, Any]] = {}
    for pool, key in AUTOSCALING_FLAGS.items():
        value = values.get(key)
        if value is None:
            continue
        name = "--" + key.replace("_", "-") if as_flags else key
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{name} must be a JSON object (or a mapping in YAML): {exc} (got {value!r})") from None
        if not isinstance(value, Mapping):
            raise ValueError(f"{name} must be a JSON object of Serve autoscaling_config fields (got {value!r})")
        chosen[pool] = dict(value)
    return chosen


# flotilla's own keys of a pool's autoscaling config: the latency SLOs SLOPolicy holds it to.
SLO_KEYS = ("ttft_slo_s", "itl_slo_s")
SLO_POLICY_PATH = "flotilla.serve.slo_autoscaling:SLOPolicy"


def serve_autoscaling_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """Serve's ``autoscaling_config`` for a pool's config: its :data:`SLO_KEYS`, when given,
    become the ``policy`` (:class:`~flotilla.serve.slo_autoscaling.SLOPolicy` with them)."""
    serve_config = {k: v for k, v in config.items() if k not in SLO_KEYS}
    slos = {k: float(config[k]) for k in SLO_KEYS if k in config}
    if slos:
        serve_config["policy"] = {"policy_function": SLO_POLICY_PATH, "policy_kwargs": slos}
    return serve_config


def check_autoscaling(autoscaling: Any) -> None:
    """ValueError naming the flag and the value unless ``autoscaling`` maps pools of
    :data:`STRATEGY_POOLS` to Serve ``autoscaling_config`` mappings that Serve accepts and
    that name ``max_replicas``."""
    if not isinstance(autoscaling, Mapping):
        raise ValueError(f"autoscaling must map pools of {STRATEGY_POOLS} to Serve autoscaling configs (got {autoscaling!r})")
    for pool, config in autoscaling.items():
        if pool not in AUTOSCALING_FLAGS:
            raise ValueError(f"autoscaling: {pool!r} is not a pool; choose from {', '.join(STRATEGY_POOLS)}")
        flag = "--" + AUTOSCALING_FLAGS[pool].replace("_", "-")
        if not isinstance(config, Mapping) or "max_replicas" not in config:
            raise ValueError(f"{flag} must be a Serve autoscaling_config mapping with max_replicas (got {config!r})")
        from ray.serve.config import AutoscalingConfig

        known = set(getattr(AutoscalingConfig, "model_fields", None) or AutoscalingConfig.__fields__) | set(SLO_KEYS)
        unknown = sorted(set(config) - known)
        if unknown:
            raise ValueError(f"{flag}: {', '.join(map(repr, unknown))} are not Serve autoscaling_config fields; choose from {', '.join(sorted(known))}")
        if int(config.get("min_replicas", 1)) < 1:
            raise ValueError(
                f"{flag}: min_replicas must be at least 1 (got {config.get('min_replicas')!r}): a pool scaled to zero "
                "has nothing to answer /health or the first request with"
            )
        slos = [key for key in SLO_KEYS if key in config]
        if slos and "policy" in config:
            raise ValueError(f"{flag}: {', '.join(slos)} set flotilla's SLO policy; drop policy, or the SLOs")
        for key in slos:
            value = config[key]
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"{flag}: {key} must be a number of seconds > 0 (got {key}={value!r})")
        try:
            AutoscalingConfig(**serve_autoscaling_config(config))
        except (TypeError, ValueError) as exc:
            detail = " ".join(str(exc).split())
            raise ValueError(f"{flag} is not a Serve autoscaling_config: {detail} (got {dict(config)!r})") from None


# The longest ServeOptions.shutdown_timeout_s: an hour covers the longest generation a
# deployment would wait for; beyond, an upgrade would hang on one stuck stream.
MAX_SHUTDOWN_TIMEOUT_S = 3600.0

# The longest ServeOptions.stream_batch_ms: a longer gap between a stream's chunks would read
# as a stalled stream.
MAX_STREAM_BATCH_MS = 1000.0

# Groups of ranks ServeOptions.placement may pin to nodes.
PLACEMENT_GROUPS = ("engine", "prefill", "decode", "joiners")


# Pools ServeOptions.placement_strategy sets a strategy for (elastic EP joiners always PACK),
# and those of each mode: one colocated pool, or PD's two.
STRATEGY_POOLS = ("engine", "prefill", "decode")
COLOCATED_POOLS = ("engine",)
PD_POOLS = ("prefill", "decode")
# Why a pool of the other mode has no strategy to take, by the mode asked for.
_OTHER_MODE_POOL = {
    "pd": "with disaggregation_mode pd the pools are prefill and decode (engine is the colocated pool)",
    "colocated": "the prefill and decode pools exist only with disaggregation_mode pd (--disaggregation-mode pd)",
}


def placement_group_of(pool: str) -> str:
    """The :data:`PLACEMENT_GROUPS` entry of an engine pool (``colocated`` replicas are ``engine``)."""
    return "engine" if pool == "colocated" else pool


def check_placement(placement: Any) -> None:
    """ValueError naming the key and value unless ``placement`` maps groups of
    :data:`PLACEMENT_GROUPS` to ``{resource name: positive amount}``."""
    if not isinstance(placement, dict):
        raise ValueError(f"placement must be a mapping of {PLACEMENT_GROUPS} to resources (got placement={placement!r})")
    for group, resources in placement.items():
        if group not in PLACEMENT_GROUPS:
            raise ValueError(f"placement.{group}: unknown group {group!r}; use one of {PLACEMENT_GROUPS}")
        if not isinstance(resources, dict):
            raise ValueError(f"placement.{group} must map Ray resource names to amounts (got {resources!r})")
        for name, amount in resources.items():
            if not isinstance(name, str) or not name or name in ("CPU", "GPU", "memory"):
                raise ValueError(
                    f"placement.{group}: {name!r} is not a custom resource name (CPU and GPU are set by flotilla)"
                )
            if isinstance(amount, bool) or not isinstance(amount, (int, float)) or not amount > 0:
                raise ValueError(f"placement.{group}.{name} must be a positive number (got {amount!r})")


def pool_placement_strategies(value: Any, pd: bool | None = None, name: str = "placement_strategy") -> dict[str, str]:
    """Each pool's placement strategy from ``value`` (the ``placement_strategy`` config key,
    named ``name`` in errors): None (every pool PACK), one strategy for every pool, or a
    mapping of pools to strategies (a pool left out: PACK). The pools are the mode's:
    ``engine`` without PD (``pd=False``), ``prefill`` and ``decode`` with it (``pd=True``);
    ``pd=None``: any of :data:`STRATEGY_POOLS`, and only those given come back.

    Returns ``{pool: strategy}`` with the strategies spelled as Ray does; ValueError naming
    the key and value for an unknown strategy, an unknown pool or a pool of the other mode."""
    pools = STRATEGY_POOLS if pd is None else (PD_POOLS if pd else COLOCATED_POOLS)
    if value is None:
        chosen: dict[str, Any] = {}
    elif isinstance(value, str):
        chosen = dict.fromkeys(pools, check_placement_strategy(value, name))
    elif isinstance(value, dict):
        chosen = dict(value)
    else:
        raise ValueError(
            f"{name} must be a strategy for every pool or a mapping of pools {STRATEGY_POOLS} to strategies "
            f"(got {name}={value!r})"
        )
    for pool in chosen:
        if pool not in STRATEGY_POOLS:
            raise ValueError(
                f"{name}.{pool}: unknown pool {pool!r}; use one of {STRATEGY_POOLS} (elastic EP joiners always PACK)"
            )
        if pool not in pools:
            why = _OTHER_MODE_POOL["pd" if pd else "colocated"]
            raise ValueError(f"{name}.{pool}={chosen[pool]!r}: {why}")
    if pd is not None:
        chosen = {pool: chosen.get(pool, DEFAULT_PLACEMENT_STRATEGY) for pool in pools}
    return {pool: check_placement_strategy(strategy, f"{name}.{pool}") for pool, strategy in chosen.items()}
