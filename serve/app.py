"""The Serve application: an OpenAI ingress in front of a pool of engine replicas.

    client --HTTP--> Serve proxy --> "ingress" (FastAPI: OpenAI schema, tokenize)
        --handle, routed by flotilla.serve.router--> "engine" replicas (EngineReplica)

- :func:`build_application` turns a :class:`~flotilla.serve.plan.ServePlan` (resolved once by
  :func:`~flotilla.serve.plan.plan_serving`) into the application: :func:`build_app` for one
  engine pool, :func:`build_pd_app` for a prefill and a decode pool; ``flotilla serve`` does that.
- :func:`build` is the same for ``serve run flotilla.serve.app:build model_path=... tp_size=2``
  and Serve config files: arguments by their server field names (SGLang's), plus the
  :class:`ServeOptions` fields ``router``, ``num_replicas``, ``replica_num_cpus``,
  ``max_body_bytes``, ``max_prompts_per_request``, ``request_body_timeout_s``,
  ``max_header_bytes``, ``placement``, ``placement_strategy``; it plans once, probing the
  platform on a worker node.
- :class:`ServeEngineClient` is the ingress's :class:`EngineClient` over the engine
  deployment's handle (and its :class:`ElasticEPClient`: the elastic EP admin calls).
- Elastic EP (``--elastic-ep-backend ray --max-ep-size M``): the plan holds every joining
  group's config (``ServeOptions.elastic_plan``). The group grows inside its one engine
  replica, so an elastic deployment has exactly one.

NOTE: the config reaches every replica as one pickled object: Serve pickles a deployment's
bind arguments once, keeps them in the controller and unpickles the same bytes in each
replica (restarts included). A ``ray.put`` ObjectRef would not help: Serve hands bind-time
ObjectRefs to the replica unresolved, and the object would die with its owner, the driver
(a ``--non-blocking`` job driver exits after deploying).
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
from typing import Any, AsyncIterator, Mapping

from ray import serve
from ray.serve import Application, Deployment
from ray.serve.config import RequestRouterConfig

from flotilla.cluster.engine.configure import check_user_settings
from flotilla.cluster.engine.limits import max_num_seqs_for
from flotilla.cluster.group import CPU_BUNDLE_SHARE
from flotilla.cluster.log_level import apply_log_level
from flotilla.cluster.models.sources import context_len_of, served_model_source
from flotilla.cluster.models.tokenizer import load_tokenizer_or_none
from flotilla.resolution import ArgumentError, ResolvedConfig, ServerArgs
from flotilla.resolution.args import closest_flag
from flotilla.resolution.fields import FIELDS
from flotilla.serve.engine_replica import EngineReplica
from flotilla.serve.ep_autoscale_driver import AUTOSCALE_ARGS, elastic_autoscale_options
from flotilla.serve.handles import call, engine_error, stream_chunks
from flotilla.serve.ingress import configure_access_log, create_app
from flotilla.serve.loopback import use_loopback_only
from flotilla.serve.metrics import collect_metrics_text, push_metrics_forever
from flotilla.serve.pd import DECODE_DEPLOYMENT, PREFILL_DEPLOYMENT, PDEngineClient
from flotilla.serve.plan import ServePlan, check_elastic_options, check_pd_options, plan_serving, ranks_in_replica
from flotilla.serve.request_log import configure_request_log
from flotilla.serve.router import router_class_path, router_kwargs
from flotilla.serve.types import (
    EngineUnavailableError,
    GenerateChunk,
    GenerateRequest,
    ServeOptions,
    parse_autoscaling,
    placement_group_of,
)

logger = logging.getLogger(__name__)

APP_NAME = "flotilla"
ENGINE_DEPLOYMENT = "engine"
INGRESS_DEPLOYMENT = "ingress"
# How often Serve polls each engine replica's load for the router, and how long it waits.
ROUTING_STATS_PERIOD_S = 0.5
ROUTING_STATS_TIMEOUT_S = 5.0
# Serve's per-replica in-flight bound sits this far above what the engine itself accepts
# (running + queued), so the engine's queue bound is what rejects (a 429 with the
# engine's message), not Serve's router queue.
ONGOING_HEADROOM = 8
INGRESS_NUM_CPUS = 0.25
# Set to "0" in a replica's environment, Serve's replica pushes its own autoscaling metrics.
REPLICA_PUSHES_METRICS_ENV = "RAY_SERVE_COLLECT_AUTOSCALING_METRICS_ON_HANDLE"
# A stopping ingress replica outlives the engines' drain (--shutdown-timeout) by this much.
INGRESS_SHUTDOWN_MARGIN_S = 5.0
ENGINE_HEALTH_CHECK_PERIOD_S = 5.0
# An engine step on a large model can hold the replica busy; health checks wait this long.
ENGINE_HEALTH_CHECK_TIMEOUT_S = 30.0
# A replica whose constructor fails (bad model, out of memory) is retried this often
# before the deployment fails, so a bad start fails fast instead of looping.
MAX_CONSTRUCTOR_RETRIES = 3
# How long the ingress waits for a scale beyond --elastic-ep-scale-timeout: the commit's own
# bounds (a rendezvous of at most --dist-timeout, default 60 s, then the ranks' RPC bound,
# --watchdog-timeout, default 300 s) with room to spare.
SCALE_COMMIT_MARGIN_S = 600.0
# Bounds on the ingress's calls for /health and /metrics.
HEALTH_TIMEOUT_S = 5.0
METRICS_TIMEOUT_S = 5.0
# build() arguments that are serving options, not server fields.
OPTION_ARGS = (
    "router", "num_replicas", "num_ingress_replicas", "replica_num_cpus", "stream_batch_ms", "max_body_bytes", "placement",
    "placement_strategy", "max_prompts_per_request", "request_body_timeout_s", "max_header_bytes",
    "migration_limit", "shutdown_timeout", "autoscaling_config",
)  # fmt: skip
# build() arguments of PD mode (``disaggregation_mode: pd``); see flotilla.serve.pd.
# The PD pools' parallelism beyond prefill_tp / decode_tp (plan_serving's pool_sizes).
POOL_SIZE_ARGS = ("prefill_dp", "decode_dp", "prefill_ep", "decode_ep", "decode_dcp")
PD_OPTION_ARGS = (
    "prefill_replicas", "decode_replicas", "prefill_tp", "decode_tp", *POOL_SIZE_ARGS, "kv_transport",
    "kv_load_failure_policy", "prefill_autoscaling_config", "decode_autoscaling_config",
)  # fmt: skip


# -- the ingress's engine client ---------------------------------------------------------


class ServeEngineClient:
    """:class:`~flotilla.serve.types.EngineClient` over the engine deployment's handle.

    Args:
        handle: the ``DeploymentHandle`` of the engine deployment (Serve gives the ingress
            one for the bound engine application).
        metrics_timeout_s: bound on gathering the replicas' metrics.
        scale_timeout_s: bound on one elastic EP scale call (the replica bounds the join itself;
            this bounds the wait on the replica).
    """

    def __init__(self, handle: Any, metrics_timeout_s: float = METRICS_TIMEOUT_S, scale_timeout_s: float | None = None):
        self._handle = handle
        self._stream = handle.options(stream=True, method_name="generate")
        self._metrics_timeout_s = metrics_timeout_s
        self._scale_timeout_s = scale_timeout_s

    async def generate(self, request: GenerateRequest) -> AsyncIterator[GenerateChunk]:
        """Stream the request's chunks from the replica the router picks. Closing the
        iterator early (the client left) cancels the call, so the replica aborts the
        request and frees its KV blocks."""
        async for chunk in stream_chunks(call(self._stream, request)):
            yield chunk

    async def is_healthy(self) -> bool:
        """Whether an engine replica answers healthy within the health timeout."""
        try:
            return bool(await asyncio.wait_for(call(self._handle.is_healthy), HEALTH_TIMEOUT_S))
        except Exception as exc:  # noqa: BLE001 - unreachable or dead is unhealthy
            logger.warning("engine health check failed: %s", exc)
            return False

    async def metrics_text(self) -> str:
        """Every live engine replica's ``flotilla:`` metrics, merged (one ``replica``
        label per replica), from the namespace's metrics hub."""
        return await collect_metrics_text(self._metrics_timeout_s)

    async def scale_elastic_ep(self, new_ep_size: Any) -> dict[str, Any]:
        """Grow the elastic EP group (the replica's
        :meth:`~flotilla.serve.engine_replica.EngineReplica.scale_elastic_ep`); raises the
        replica's :class:`~flotilla.serve.elastic_ep.ElasticScaleError` or the contract's
        errors. The replica bounds the join (``--elastic-ep-scale-timeout`` for the joiners, the
        collective and RPC bounds for the commit); this call waits ``scale_timeout_s`` at most."""
        return await self._admin(self._handle.scale_elastic_ep, new_ep_size, timeout_s=self._scale_timeout_s)

    async def is_scaling_elastic_ep(self) -> bool:
        """Whether the elastic EP group is scaling (bounded by the health timeout)."""
        return bool(await self._admin(self._handle.is_scaling_elastic_ep, timeout_s=HEALTH_TIMEOUT_S))

    async def elastic_ep_state(self) -> dict[str, Any]:
        """The elastic EP group's ``ep_size``, ``max_ep_size``, ``initial``, ``scaling``,
        ``last_error`` (bounded by the health timeout)."""
        return dict(await self._admin(self._handle.elastic_ep_state, timeout_s=HEALTH_TIMEOUT_S))

    async def _admin(self, method: Any, *args: Any, timeout_s: float | None = None) -> Any:
        try:
            return await asyncio.wait_for(_awaited(call(method, *args)), timeout_s)
        except asyncio.TimeoutError:
            raise EngineUnavailableError(f"the engine replica did not answer within {timeout_s:g} s") from None
        except Exception as exc:
            error = engine_error(exc)
            if error is exc:
                raise
            raise error from None


async def _awaited(response: Any) -> Any:
    return await response


@serve.deployment(name=INGRESS_DEPLOYMENT)
@serve.ingress()
class OpenAIIngress:
    """The ingress deployment: the FastAPI app of :func:`flotilla.serve.ingress.create_app`
    over a :class:`ServeEngineClient` (PD mode: a :class:`~flotilla.serve.pd.PDEngineClient`
    over the prefill and decode pools), built late (in the replica, after ``__init__``)."""

    def __init__(self, engine: Any, config: ResolvedConfig, options: ServeOptions, decode_engine: Any = None):
        if decode_engine is None:
            plan = options.elastic_plan
            scale_timeout = None if plan is None else plan.scale_timeout_s + SCALE_COMMIT_MARGIN_S
            self._client = ServeEngineClient(engine, scale_timeout_s=scale_timeout)
        else:
            # NOTE: PD mode: ``engine`` is the prefill pool's handle.
            self._client = PDEngineClient(engine, decode_engine, options.kv_load_failure_policy)
        self._config, self._options = config, options
        # NOTE: a Serve replica's logging is unconfigured: route flotilla's lines to its stdout/stderr.
        apply_log_level(config)
        configure_access_log()
        if config.log_requests:
            configure_request_log()
        source = served_model_source(options.model, config)
        self._max_model_len = context_len_of(config, source)
        self._tokenizer = None if config.skip_tokenizer_init else load_tokenizer_or_none(source, config.tokenizer_path)[0]

    def __serve_build_asgi_app__(self):
        # NOTE: Serve's proxy echoes X-Request-Id itself.
        ingress_id = _ingress_replica_id()
        app = create_app(
            self._client, self._tokenizer, self._options, self._config, echo_request_id=False,
            max_model_len=self._max_model_len, ingress_id=ingress_id,
        )  # fmt: skip
        # NOTE: every ingress replica's own series reach the others' /metrics through the hub.
        self._push_task = _start_pushing(f"ingress-{ingress_id}", app.state.metrics_exposition)
        return app

    def __del__(self) -> None:
        task = getattr(self, "_push_task", None)
        if task is not None:
            task.cancel()


def _ingress_replica_id() -> str:
    """This ingress replica's Serve id (its ``ingress`` metrics label)."""
    try:
        return str(serve.get_replica_context().replica_id.unique_id)
    except Exception:  # noqa: BLE001 - outside a Serve replica (tests building the class directly)
        return "local"


def _start_pushing(hub_key: str, exposition) -> asyncio.Task | None:
    """Push ``exposition()`` to the metrics hub under ``hub_key`` from this replica's event
    loop (None, and a warning, when there is no running loop)."""
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        logger.warning("%s: no running event loop; its metrics reach only its own /metrics", hub_key)
        return None
    return loop.create_task(push_metrics_forever(hub_key, exposition))


# -- the application -----------------------------------------------------------------------


def engine_capacity(config: ResolvedConfig, options: ServeOptions) -> int:
    """Requests one engine replica accepts before its queue bound rejects: its running
    cap plus ``options.max_queued_requests``. An elastic EP replica's running cap is the
    one of its largest group (DP ranks that join get the launch's per-rank budget)."""
    running = max_num_seqs_for(config)
    plan = options.elastic_plan
    if plan is not None:
        running = running * plan.max_ep_size // plan.initial_size
    return running + int(options.max_queued_requests)


def engine_deployment_options(
    config: ResolvedConfig,
    options: ServeOptions,
    pool: str = "colocated",
) -> dict[str, Any]:
    """``Deployment.options`` of an engine pool (see the constants for the choices).

    ``pool``: ``"colocated"`` (the ``engine`` deployment, ``options.num_replicas``
    replicas, ``options.router``), ``"prefill"`` (``options.prefill_replicas``, always
    cache-aware: the replica holding a prompt's prefix computes it fastest) or
    ``"decode"`` (``options.decode_replicas``, ``options.router``)."""
    name, replicas, router = {
        "colocated": (ENGINE_DEPLOYMENT, options.num_replicas, options.router),
        "prefill": (PREFILL_DEPLOYMENT, options.prefill_replicas, "cache-aware"),
        "decode": (DECODE_DEPLOYMENT, options.decode_replicas, options.router),
    }[pool]
    autoscaling = options.autoscaling_for(placement_group_of(pool))
    most = options.max_replicas_of(placement_group_of(pool))
    on_gpu = (config.device or "cpu") == "cuda"
    actor: dict[str, Any] = {"num_cpus": options.replica_num_cpus}
    # NOTE: the replica actor goes where its ranks must go (placement), so the in-process rank
    # of a one-rank engine lands there too.
    resources = options.resources_for(placement_group_of(pool))
    if resources:
        actor["resources"] = resources
    if on_gpu and ranks_in_replica(config, options, pool):
        # NOTE: one rank runs inside the replica; a worker group reserves its own GPUs
        # in a placement group.
        actor["num_gpus"] = 1
    if not on_gpu and "OMP_NUM_THREADS" not in os.environ:
        # NOTE: Ray gives an actor with fewer than 2 CPUs OMP_NUM_THREADS=1, which would
        # run a CPU engine on one core; share this machine's cores among the replicas.
        threads = max(1, (os.cpu_count() or 1) // total_engine_replicas(options))
        actor["runtime_env"] = {"env_vars": {"OMP_NUM_THREADS": str(threads)}}
    if autoscaling is not None and "policy" in autoscaling:
        # NOTE: Serve (2.60) takes a replica's record_autoscaling_stats, which a custom policy
        # such as SLOPolicy reads, only from replicas that push their own metrics; by default
        # the handles report the load and the replicas push nothing.
        env = actor.setdefault("runtime_env", {}).setdefault("env_vars", {})
        env[REPLICA_PUSHES_METRICS_ENV] = "0"
    # NOTE: an autoscaling pool's count is Serve's to set (Serve refuses both).
    count: dict[str, Any] = {"num_replicas": replicas} if autoscaling is None else {"autoscaling_config": autoscaling}
    return dict(
        name=name,
        **count,
        max_ongoing_requests=engine_capacity(config, options) + ONGOING_HEADROOM,
        # NOTE: reached when no replica can take a request (all at the bound above, or
        # restarting), or by a burst of calls waiting for their replica at once; Serve then
        # raises BackPressureError, which becomes a 429. The prompts of one request arrive
        # as such a burst: room for --max-prompts-per-request of them, so that the engine
        # replicas decide on the request whole.
        max_queued_requests=int(options.max_queued_requests) * most + int(options.max_prompts_per_request),
        ray_actor_options=actor,
        request_router_config=RequestRouterConfig(
            request_router_class=router_class_path(router),
            request_router_kwargs=router_kwargs(router, config, pool),
            request_routing_stats_period_s=ROUTING_STATS_PERIOD_S,
            request_routing_stats_timeout_s=ROUTING_STATS_TIMEOUT_S,
        ),
        health_check_period_s=ENGINE_HEALTH_CHECK_PERIOD_S,
        health_check_timeout_s=ENGINE_HEALTH_CHECK_TIMEOUT_S,
        graceful_shutdown_wait_loop_s=1.0,
        graceful_shutdown_timeout_s=options.shutdown_timeout_s,
        max_constructor_retry_count=MAX_CONSTRUCTOR_RETRIES,
    )


def cpus_needed(plan: ServePlan) -> float:
    """The logical CPUs the plan's application reserves on a Ray cluster: every engine
    replica's ``replica_num_cpus``, a CPU bundle per rank of a replica whose ranks run in worker
    actors (and of an elastic EP deployment's joiners at its largest size), the ingress's; an
    autoscaling pool at its ``max_replicas``."""
    options = plan.options

    def pool(config: ResolvedConfig, name: str, replicas: int) -> float:
        ranks = 0 if ranks_in_replica(config, options, name) else int(config.tp_size or 1)
        return replicas * (options.replica_num_cpus + ranks * CPU_BUNDLE_SHARE)

    if plan.pd:
        engines = pool(plan.config, "prefill", options.max_replicas_of("prefill")) + pool(
            plan.decode_config, "decode", options.max_replicas_of("decode")
        )
    else:
        engines = pool(plan.config, "colocated", options.max_replicas_of("engine"))
        if options.elastic_plan is not None:
            engines += (options.elastic_plan.max_ep_size - options.elastic_plan.initial_size) * CPU_BUNDLE_SHARE
    return engines + INGRESS_NUM_CPUS * options.num_ingress_replicas


def total_engine_replicas(options: ServeOptions) -> int:
    """Engine replicas of the application (both pools in PD mode; an autoscaling pool at its most)."""
    if options.disaggregation_mode == "pd":
        return options.max_replicas_of("prefill") + options.max_replicas_of("decode")
    return options.max_replicas_of("engine")


def ingress_deployment_options(config: ResolvedConfig, options: ServeOptions) -> dict[str, Any]:
    """``Deployment.options`` of the ingress: ``options.num_ingress_replicas`` replicas, each
    with room for every request the engine pool accepts (the engines' own bounds answer 429
    first); beyond that the proxy answers 429 itself."""
    serving = options.max_replicas_of("decode" if options.disaggregation_mode == "pd" else "engine")
    pool = engine_capacity(config, options) * serving + ONGOING_HEADROOM
    return dict(
        name=INGRESS_DEPLOYMENT,
        num_replicas=options.num_ingress_replicas,
        max_ongoing_requests=pool,
        max_queued_requests=pool,
        backpressure_config={"status_code": 429, "retry_after_s": 1},
        ray_actor_options={"num_cpus": INGRESS_NUM_CPUS},
        # NOTE: the ingress carries the engines' streams (and their migration) while they drain.
        graceful_shutdown_timeout_s=options.shutdown_timeout_s + INGRESS_SHUTDOWN_MARGIN_S,
        graceful_shutdown_wait_loop_s=1.0,
    )


def _engine_class() -> Deployment:
    return EngineReplica if isinstance(EngineReplica, Deployment) else serve.deployment(EngineReplica)


def build_app(config: ResolvedConfig, options: ServeOptions) -> Application:
    """The Serve application for one resolved configuration: the ``ingress`` deployment
    bound to the ``engine`` deployment's handle, both bound to ``(config, options)``."""
    router_class_path(options.router)  # NOTE: fail here, not in a replica, on a bad name
    if options.num_replicas < 1:
        raise ValueError(f"num_replicas={options.num_replicas} must be at least 1")
    check_elastic_options(options)
    engine = _engine_class().options(**engine_deployment_options(config, options)).bind(config, options)
    return OpenAIIngress.options(**ingress_deployment_options(config, options)).bind(engine, config, options)


def build_pd_app(prefill_config: ResolvedConfig, decode_config: ResolvedConfig, options: ServeOptions) -> Application:
    """The PD application: the ``ingress`` over a ``prefill`` pool (bound to
    ``prefill_config``) and a ``decode`` pool (bound to ``decode_config``); each config was
    resolved once, for its role (:func:`~flotilla.serve.plan.plan_serving`)."""
    router_class_path(options.router)
    if options.elastic_plan is not None:
        raise ValueError("elastic EP (--max-ep-size) grows a colocated deployment; drop --disaggregation-mode pd")
    check_pd_options(prefill_config, decode_config, options)
    engine = _engine_class()
    prefill = engine.options(**engine_deployment_options(prefill_config, options, "prefill")).bind(
        prefill_config, options, pool="prefill"
    )
    decode = engine.options(**engine_deployment_options(decode_config, options, "decode")).bind(
        decode_config, options, pool="decode"
    )
    ingress = OpenAIIngress.options(**ingress_deployment_options(decode_config, options))
    return ingress.bind(prefill, decode_config, options, decode_engine=decode)


def build_application(plan: ServePlan) -> Application:
    """The Serve application of a :class:`~flotilla.serve.plan.ServePlan`: the PD
    application for a plan with a decode pool (:func:`build_pd_app`), else one engine pool
    behind the ingress (:func:`build_app`)."""
    if plan.pd:
        return build_pd_app(plan.config, plan.decode_config, plan.options)
    return build_app(plan.config, plan.options)


# -- resolution for serving ----------------------------------------------------------------


def ensure_ray(address: str | None = None, num_cpus: int | None = None) -> bool:
    """Connect this process to Ray: to ``address`` (or ``RAY_ADDRESS``; ``"auto"`` finds a
    cluster started on this machine with ``ray start``) when one is named, else start a
    local cluster on loopback. Returns whether a local cluster was started here (it ends
    with this process). Inside a Ray job ``RAY_ADDRESS`` is set, so the job's driver
    attaches to its cluster."""
    import ray

    if ray.is_initialized():
        return False
    address = address or os.environ.get("RAY_ADDRESS") or None
    if address:
        ray.init(address=address)
        return False
    # NOTE: Ray reads RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER when it is imported, so callers that
    # want loopback set it before that (flotilla serve does; for `serve run`, export it);
    # setting it here covers the processes Ray starts.
    use_loopback_only()
    # NOTE: address="local": a new cluster even when `ray start` runs one on this machine
    # (plain ray.init() would attach to it and then refuse num_cpus); join one with address.
    ray.init(address="local", num_cpus=num_cpus or max(4, os.cpu_count() or 1), include_dashboard=False)
    return True


def _flag_argv(name: str, value: Any) -> list[str]:
    """``name=value`` (a server field, value from a CLI string or typed YAML) as flags."""
    spec = FIELDS.get(name)
    if spec is not None and not spec.cli:
        # NOTE: a field set only through a deprecated flag (e.g. disable_cuda_graph, whose flag
        # --disable-cuda-graph the CLI still takes): the args take it under its field name too.
        switch = next((d for d in spec.deprecated if not d.takes_value), None)
        if switch is not None:
            text = str(value).strip().lower()
            if text not in ("true", "false", "1", "0", "yes", "no"):
                raise ArgumentError(f"{name} expects true or false, got {value!r}")
            return [switch.flag] if (text in ("true", "1", "yes")) == bool(switch.const) else []
    if spec is None or not spec.cli:
        near = closest_flag(name, [n for n, s in FIELDS.items() if s.cli] + list(OPTION_ARGS))
        hint = f"; did you mean {near}?" if near else ""
        raise ArgumentError(f"unknown argument {name!r} (server fields use SGLang's names, e.g. tp_size){hint}")
    if spec.kind in ("bool", "tristate"):
        text = str(value).strip().lower()
        if text not in ("true", "false", "1", "0", "yes", "no"):
            raise ArgumentError(f"{name} expects true or false, got {value!r}")
        on = text in ("true", "1", "yes")
        if on:
            return [spec.flag]
        return ["--no-" + spec.flag[2:]] if spec.kind == "tristate" else []
    if spec.nargs is not None:
        items = value if isinstance(value, (list, tuple)) else re.split(r"[,\s]+", str(value).strip())
        return [spec.flag, *(str(v) for v in items if str(v) != "")]
    if spec.kind in ("json", "json_list") and not isinstance(value, str):
        import json

        return [spec.flag, json.dumps(value)]
    return [spec.flag, str(value)]


def parse_build_args(args: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Split ``serve run`` / Serve-config arguments into (the server fields given, parsed
    as the CLI parses their flags; the ServeOptions arguments). ``model`` is an alias of
    ``model_path``. Raises :class:`ArgumentError` naming an unknown argument or bad value."""
    argv: list[str] = []
    option_args: dict[str, Any] = {}
    for name, value in args.items():
        name = str(name).replace("-", "_")
        if value is None:
            continue
        if (
            name in OPTION_ARGS
            or name in PD_OPTION_ARGS
            or name in AUTOSCALE_ARGS
            or (name == "disaggregation_mode" and str(value) == "pd")
        ):
            option_args[name] = value
            continue
        argv += _flag_argv("model_path" if name == "model" else name, value)
    parsed = ServerArgs.from_cli(argv)
    return {name: parsed.values[name] for name in parsed.explicit}, option_args


def _autoscaling_arg(option_args: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """``ServeOptions.autoscaling`` from the ``autoscaling_config``, ``prefill_autoscaling_config``
    and ``decode_autoscaling_config`` arguments: mappings, or their JSON text."""
    try:
        return parse_autoscaling(option_args)
    except ValueError as exc:
        raise ArgumentError(str(exc)) from None


def _placement_arg(value: Any) -> dict[str, dict[str, float]]:
    """The ``placement`` argument: a mapping, or its JSON text (``serve run ... placement='{...}'``)."""
    if value is None:
        return {}
    if isinstance(value, str):
        import json

        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ArgumentError(f"placement must be a mapping (YAML) or JSON text: {exc} (got placement={value!r})") from None
    if not isinstance(value, Mapping):
        raise ArgumentError(f"placement must be a mapping of groups to Ray resources (got placement={value!r})")
    return {str(group): dict(resources) if isinstance(resources, Mapping) else resources for group, resources in value.items()}


def _placement_strategy_arg(value: Any) -> str | dict[str, str] | None:
    """The ``placement_strategy`` argument: one strategy for every pool, a mapping of pools to
    strategies, or that mapping's JSON text (``serve run ... placement_strategy='{...}'``);
    :func:`~flotilla.serve.types.pool_placement_strategies` checks it against the mode."""
    if isinstance(value, str) and value.lstrip().startswith("{"):
        import json

        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ArgumentError(
                f"placement_strategy must be a strategy, a mapping (YAML) or JSON text: {exc} (got placement_strategy={value!r})"
            ) from None
    if value is None or isinstance(value, str):
        return value
    if not isinstance(value, Mapping):
        raise ArgumentError(
            f"placement_strategy must be a strategy for every pool or a mapping of pools to strategies "
            f"(got placement_strategy={value!r})"
        )
    return {str(pool): strategy for pool, strategy in value.items()}


def build(args: dict[str, Any]) -> Application:
    """The application for ``serve run flotilla.serve.app:build KEY=VALUE ...`` and Serve
    config files (``import_path: flotilla.serve.app:build`` with ``args:``).

    Keys are server field names as SGLang spells them (``model_path`` or ``model``,
    ``tp_size``, ``max_running_requests``, ``api_key``, ``max_queued_requests``,
    ``served_model_name``, ...; values as strings or typed YAML) plus ``router``
    (``least-loaded``|``prefix-affinity``), ``num_replicas``, ``replica_num_cpus``,
    ``stream_batch_ms``, ``max_body_bytes``, ``max_prompts_per_request``, ``request_body_timeout_s``,
    ``max_header_bytes``; PD mode: ``disaggregation_mode: pd`` with ``prefill_replicas``,
    ``decode_replicas``, ``prefill_tp``, ``decode_tp``, ``prefill_dp``, ``decode_dp``,
    ``prefill_ep``, ``decode_ep``, ``decode_dcp`` (as the flags of the same names), ``kv_transport``,
    ``kv_load_failure_policy``; elastic EP (``elastic_ep_backend: ray``, ``max_ep_size``):
    ``elastic_ep_autoscale: true`` and its knobs (:data:`AUTOSCALE_ARGS`, as the
    ``flotilla serve`` flags of the same names); ``placement`` (a mapping of ``engine``,
    ``prefill``, ``decode``, ``joiners`` to the Ray resources their replicas and ranks need,
    see ``ServeOptions.placement``); ``placement_strategy`` (``PACK``, ``STRICT_PACK``,
    ``SPREAD`` or ``STRICT_SPREAD`` for every pool, or a mapping of ``engine`` or PD's
    ``prefill`` and ``decode`` to one; default PACK, see ``ServeOptions.placement_strategy``).
    The configuration (an elastic deployment's joiners included) is resolved once, here, for
    the platform of the cluster's worker nodes (this connects to Ray first when ``serve run``
    has not yet).
    NOTE: host and port are Serve's ``http_options`` (``serve run`` / the config file),
    not these arguments.
    """
    given, option_args = parse_build_args(args)
    check_user_settings(given)  # NOTE: before Ray: a flag the runtime would not act on stops here
    pd = option_args.get("disaggregation_mode") == "pd"
    stray = [name for name in PD_OPTION_ARGS if name in option_args and not pd]
    if stray:
        raise ArgumentError(f"{', '.join(stray)} need disaggregation_mode: pd")
    ensure_ray()

    def opt(name: str, kind):
        return kind(option_args[name]) if name in option_args else None

    plan = plan_serving(
        given,
        pd=pd,
        prefill_tp=opt("prefill_tp", int),
        decode_tp=opt("decode_tp", int),
        pool_sizes={name: opt(name, int) for name in POOL_SIZE_ARGS},
        router=str(option_args.get("router", "cache-aware")),
        num_replicas=opt("num_replicas", int),
        num_ingress_replicas=opt("num_ingress_replicas", int),
        replica_num_cpus=opt("replica_num_cpus", float),
        stream_batch_ms=opt("stream_batch_ms", float),
        max_body_bytes=opt("max_body_bytes", int),
        prefill_replicas=opt("prefill_replicas", int),
        decode_replicas=opt("decode_replicas", int),
        kv_transport=str(option_args.get("kv_transport", "auto")),
        kv_load_failure_policy=str(option_args.get("kv_load_failure_policy", "recompute")),
        elastic_autoscale=elastic_autoscale_options(option_args),
        placement=_placement_arg(option_args.get("placement")),
        placement_strategy=_placement_strategy_arg(option_args.get("placement_strategy")),
        max_prompts_per_request=opt("max_prompts_per_request", int),
        request_body_timeout_s=opt("request_body_timeout_s", float),
        max_header_bytes=opt("max_header_bytes", int),
        migration_limit=opt("migration_limit", int),
        shutdown_timeout_s=opt("shutdown_timeout", float),
        autoscaling=_autoscaling_arg(option_args),
    )
    logger.info("serving %s (config %s)", plan.options.served_model_name, plan.config.digest[:16])
    return build_application(plan)
