"""The serving plan: flags, the model and the platform turned into everything a deployment
runs with, once, in the driver. ``flotilla serve``, ``serve run ...:build`` and the benchmarks
call :func:`plan_serving`; ``LLM(...)`` resolves its one engine with the same
:func:`~flotilla.cluster.engine.configure.resolve_engine_config` each pool of a plan uses.

A :class:`ServePlan` holds each pool's resolved config (one colocated pool, or a prefill and
a decode pool, each resolved for its role), the elastic EP joiners' configs (inside
``options.elastic_plan``) and the serving options that are not server fields
(:class:`~flotilla.serve.types.ServeOptions`: replicas, router, limits, placement...). Nothing
is resolved after this: the builders (:mod:`flotilla.serve.app`) and every replica read the plan.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from flotilla.cluster.engine.configure import check_user_settings, resolve_engine_config
from flotilla.cluster.engine.dp_scheduler import can_grow_elastic_ep
from flotilla.cluster.engine.kv_contract import check_policy
from flotilla.cluster.platform import probe_for_workers
from flotilla.resolution import PlatformFacts, ResolutionError, ResolvedConfig
from flotilla.serve.types import ElasticEPPlan
from flotilla.serve.router import router_class_path
from flotilla.serve.types import AUTOSCALING_FLAGS, ElasticAutoscaleOptions, ServeOptions, pool_placement_strategies

DEFAULT_SERVED_MODEL_NAME = "smollm2"


@dataclass(frozen=True)
class ServePlan:
    """What one deployment runs with (see the module docstring).

    Attributes:
        config: the colocated pool's resolved config, or the prefill pool's in PD mode.
        decode_config: the decode pool's resolved config in PD mode, else None.
        options: the serving options (``options.elastic_plan``: the joiners of an elastic EP
            deployment, resolved with the same platform facts).
    """

    config: ResolvedConfig
    decode_config: ResolvedConfig | None
    options: ServeOptions

    @property
    def pd(self) -> bool:
        """Whether it serves with a prefill and a decode pool."""
        return self.decode_config is not None

    @property
    def serving_config(self) -> ResolvedConfig:
        """The config the ingress serves with: the decode pool's in PD mode (it streams the
        answers), else the one pool's."""
        return self.decode_config or self.config


def plan_serving(
    given: Mapping[str, Any],
    *,
    platform: PlatformFacts | None = None,
    pd: bool = False,
    prefill_tp: int | None = None,
    decode_tp: int | None = None,
    pool_sizes: Mapping[str, int | None] | None = None,
    **options: Any,
) -> ServePlan:
    """The plan for the server fields the user set (``given``; ``model_path`` is the
    ``--model`` value), resolved once for ``platform`` (None: probed once, on a worker node
    of the connected Ray cluster, else this machine).

    The user's fields are checked against the runtime-support table first (an
    :class:`~flotilla.resolution.runtime_support.UnsupportedSettingsError` naming each flag).
    PD mode (``pd=True``): each pool resolves from :func:`pd_server_fields` (``prefill_tp``,
    ``decode_tp``: ``--prefill-tp`` / ``--decode-tp``; ``pool_sizes``: its other keywords,
    ``prefill_dp``, ``decode_ep``, ...) and :func:`check_pd_options` holds;
    else one pool, and an elastic EP deployment's joiners (:func:`elastic_plan_for`).
    ``options``: :func:`serve_options`' keyword arguments (router, replicas, limits, ...)."""
    check_user_settings(given)
    facts = platform if platform is not None else probe_for_workers()
    model = given.get("model_path")
    if pd:
        sizes = {k: v for k, v in (pool_sizes or {}).items() if v is not None}
        prefill_fields, decode_fields = pd_server_fields(given, prefill_tp, decode_tp, **sizes)
        decode_config = resolve_pool(decode_fields, facts)[0]
        config = resolve_pool(prefill_page_fields(prefill_fields, decode_config), facts)[0]
        serve = serve_options(
            decode_config, model=model, served_model_name_given=given.get("served_model_name"),
            disaggregation_mode="pd", **options,
        )  # fmt: skip
        check_pd_options(config, decode_config, serve)
        return ServePlan(config, decode_config, serve)
    config = resolve_pool(given, facts)[0]
    serve = serve_options(
        config, model=model, served_model_name_given=given.get("served_model_name"),
        elastic_plan=elastic_plan_for(given, config, facts), **options,
    )  # fmt: skip
    return ServePlan(config, None, serve)


def resolve_pool(fields: Mapping[str, Any], platform: PlatformFacts | None = None) -> tuple[ResolvedConfig, str | None]:
    """One pool's config from its server fields (a PD pool's from :func:`pd_server_fields`;
    ``model_path`` is the ``--model`` value), and that ``--model`` value. No support check:
    :func:`plan_serving` checks what the user set once, before the pools resolve."""
    return resolve_engine_config(fields, platform)[0], fields.get("model_path")


# -- serving options ---------------------------------------------------------------------


def served_model_name(model: str | None, explicit: str | None = None) -> str:
    """The name ``/v1/models`` reports: ``--served-model-name`` when given; ``smollm2``
    for the embedded default; else the ``--model`` value, a local path by its last part
    (``/models/llama3`` -> ``llama3``, ``x/y.gguf`` -> ``y``)."""
    if explicit:
        return explicit
    if model is None or model.strip().lower() == DEFAULT_SERVED_MODEL_NAME:
        return DEFAULT_SERVED_MODEL_NAME
    path = Path(model).expanduser()
    if path.exists():
        return path.stem if path.suffix.lower() == ".gguf" else path.name
    return model


def serve_options(
    config: ResolvedConfig,
    *,
    model: str | None,
    served_model_name_given: str | None = None,
    router: str = "cache-aware",
    num_replicas: int | None = None,
    replica_num_cpus: float | None = None,
    num_ingress_replicas: int | None = None,
    max_body_bytes: int | None = None,
    stream_batch_ms: float | None = None,
    disaggregation_mode: str = "null",
    prefill_replicas: int | None = None,
    decode_replicas: int | None = None,
    kv_transport: str = "auto",
    kv_load_failure_policy: str = "recompute",
    elastic_plan: Any = None,
    elastic_autoscale: ElasticAutoscaleOptions | None = None,
    placement: Mapping[str, Mapping[str, float]] | None = None,
    placement_strategy: str | Mapping[str, str] | None = None,
    max_prompts_per_request: int | None = None,
    request_body_timeout_s: float | None = None,
    max_header_bytes: int | None = None,
    http_keep_alive_timeout_s: int | None = None,
    http_request_timeout_s: float | None = None,
    migration_limit: int | None = None,
    shutdown_timeout_s: float | None = None,
    autoscaling: Mapping[str, Mapping[str, Any]] | None = None,
) -> ServeOptions:
    """:class:`ServeOptions` for ``config``: ``max_queued_requests`` and ``api_key`` come
    from the config's fields; ``num_replicas`` defaults to the resolved ``dp_size`` (one
    replica when DP attention keeps the DP ranks inside one engine); ``num_ingress_replicas``
    to :class:`ServeOptions`' (2). The limits on hostile
    clients (``max_prompts_per_request``, ``request_body_timeout_s``, ``max_header_bytes``,
    Serve's ``http_keep_alive_timeout_s`` and ``http_request_timeout_s``) and the fault
    options (``migration_limit``, ``shutdown_timeout_s``) default to
    :class:`ServeOptions`' and are checked by :func:`check_client_limits`. PD mode
    (``disaggregation_mode="pd"``): one prefill and one decode replica by default;
    ``kv_transport="auto"`` is NIXL when it is installed, else the Ray-object fallback.
    Elastic EP: ``elastic_plan`` from :func:`elastic_plan_for`, ``elastic_autoscale``
    (default off); refused as :func:`check_elastic_options` says. ``placement``: the Ray
    resources pinning each group of ranks to nodes (see ``ServeOptions.placement``).
    ``placement_strategy``: how each pool's worker groups lie over the nodes, one strategy for
    every pool of the mode or a mapping per pool (PACK where unset; checked by
    :func:`~flotilla.serve.types.pool_placement_strategies`)."""
    from flotilla.cluster.kv.endpoint import default_kv_transport

    defaults = ServeOptions()
    num_replicas_given = num_replicas is not None
    if num_replicas is None:
        num_replicas = 1 if config.enable_dp_attention else int(config.dp_size or 1)
    router_class_path(router)
    if disaggregation_mode not in ("null", "pd"):
        raise ValueError(f"disaggregation_mode must be 'null' or 'pd' (got {disaggregation_mode!r})")
    options = ServeOptions(
        model=model,
        served_model_name=served_model_name(model, served_model_name_given),
        num_replicas=int(num_replicas),
        router=router,
        max_queued_requests=int(config.max_queued_requests or defaults.max_queued_requests),
        max_body_bytes=int(max_body_bytes or defaults.max_body_bytes),
        stream_batch_ms=float(defaults.stream_batch_ms if stream_batch_ms is None else stream_batch_ms),
        api_key=config.api_key or None,
        replica_num_cpus=float(replica_num_cpus if replica_num_cpus is not None else defaults.replica_num_cpus),
        num_ingress_replicas=defaults.num_ingress_replicas if num_ingress_replicas is None else num_ingress_replicas,
        disaggregation_mode=disaggregation_mode,
        prefill_replicas=int(prefill_replicas or defaults.prefill_replicas),
        decode_replicas=int(decode_replicas or defaults.decode_replicas),
        kv_transport=default_kv_transport() if kv_transport == "auto" else kv_transport,
        kv_load_failure_policy=kv_load_failure_policy,
        elastic_plan=elastic_plan,
        elastic_autoscale=elastic_autoscale or ElasticAutoscaleOptions(),
        placement={group: dict(resources) for group, resources in (placement or {}).items()},
        placement_strategy=pool_placement_strategies(
            dict(placement_strategy) if isinstance(placement_strategy, Mapping) else placement_strategy,
            pd=disaggregation_mode == "pd",
        ),
        max_prompts_per_request=int(defaults.max_prompts_per_request if max_prompts_per_request is None else max_prompts_per_request),
        request_body_timeout_s=float(defaults.request_body_timeout_s if request_body_timeout_s is None else request_body_timeout_s),
        max_header_bytes=int(defaults.max_header_bytes if max_header_bytes is None else max_header_bytes),
        http_keep_alive_timeout_s=http_keep_alive_timeout_s,
        http_request_timeout_s=http_request_timeout_s,
        migration_limit=defaults.migration_limit if migration_limit is None else migration_limit,
        shutdown_timeout_s=defaults.shutdown_timeout_s if shutdown_timeout_s is None else shutdown_timeout_s,
        autoscaling=_pool_autoscaling(autoscaling, disaggregation_mode == "pd", num_replicas_given),
    )  # fmt: skip
    check_elastic_options(options)
    check_client_limits(options)
    return options


def _pool_autoscaling(autoscaling: Mapping[str, Mapping[str, Any]] | None, pd: bool, num_replicas_given: bool) -> dict[str, dict[str, Any]]:
    """The pools' Serve autoscaling configs for the mode (ValueError naming the flag for a pool
    of the other mode, or with ``--num-replicas``, which fixes the count it would scale)."""
    chosen = {pool: dict(config) for pool, config in (autoscaling or {}).items()}
    for pool in chosen:
        flag = "--" + AUTOSCALING_FLAGS.get(pool, pool).replace("_", "-")
        if pd and pool == "engine":
            raise ValueError(f"{flag} scales the colocated pool; with --disaggregation-mode pd use --prefill-autoscaling-config and --decode-autoscaling-config")
        if not pd and pool in ("prefill", "decode"):
            raise ValueError(f"{flag} needs --disaggregation-mode pd")
    if "engine" in chosen and num_replicas_given:
        raise ValueError("--num-replicas fixes the count that --autoscaling-config scales; give one of them")
    return chosen


def check_client_limits(options: ServeOptions) -> None:
    """ValueError naming the option and value unless the limits on clients are usable:
    ``max_prompts_per_request`` and ``max_header_bytes`` (at least 1024) positive integers,
    ``request_body_timeout_s`` positive seconds, Serve's keep-alive a non-negative whole
    number of seconds and its request timeout positive seconds (both may be None)."""

    def whole(value: Any) -> bool:
        return isinstance(value, int) and not isinstance(value, bool)

    checks = (
        ("max_prompts_per_request", whole(options.max_prompts_per_request) and options.max_prompts_per_request >= 1, "an integer >= 1"),
        ("max_header_bytes", whole(options.max_header_bytes) and options.max_header_bytes >= 1024, "an integer >= 1024 (bytes)"),
        ("request_body_timeout_s", options.request_body_timeout_s > 0, "a number of seconds > 0"),
        ("http_keep_alive_timeout_s", options.http_keep_alive_timeout_s is None
         or (whole(options.http_keep_alive_timeout_s) and options.http_keep_alive_timeout_s >= 0), "a whole number of seconds >= 0"),
        ("http_request_timeout_s", options.http_request_timeout_s is None or options.http_request_timeout_s > 0,
         "a number of seconds > 0"),
    )  # fmt: skip
    for name, ok, requirement in checks:
        if not ok:
            raise ValueError(f"{name} must be {requirement} (got {name}={getattr(options, name)!r})")


def check_elastic_options(options: ServeOptions) -> None:
    """Refuse options an elastic EP deployment cannot serve with: more than one engine
    replica (the group grows inside one replica), PD mode, or the autoscaler without
    an elastic plan; ValueError naming the flag and value."""
    autoscale = options.elastic_autoscale.enabled
    if options.elastic_plan is None:
        if autoscale:
            raise ValueError(
                "--elastic-ep-autoscale needs an elastic EP deployment: --elastic-ep-backend ray with "
                "--max-ep-size above --tp-size (and --enable-dp-attention --enable-dp-lm-head)"
            )
        return
    if options.num_replicas != 1:
        raise ValueError(
            f"--num-replicas {options.num_replicas}: an elastic EP deployment runs one engine replica "
            "(its group grows inside that replica up to --max-ep-size); drop --num-replicas"
        )
    if options.disaggregation_mode != "null":
        raise ValueError("elastic EP (--max-ep-size) grows a colocated deployment; drop --disaggregation-mode pd")
    if options.autoscaling:
        raise ValueError(
            "--autoscaling-config: an elastic EP deployment is one engine replica whose group grows; scale it "
            "with --elastic-ep-autoscale instead"
        )


# -- elastic EP joiners --------------------------------------------------------------------


def joiner_fields(given: Mapping[str, Any], current: int, new: int, initial: int) -> dict[str, Any]:
    """The server fields of the group that grows ``current`` ranks to ``new``: the user's
    fields with SGLang's joiner flags on top (see the module docstring)."""
    k = new - current
    fields = dict(given)
    fields.update(
        tp_size=k, dp_size=k, ep_size=k, ep_join_mode="scale", node_rank=1,
        ep_join_rank_offset=current, elastic_ep_initial_size=initial,
    )  # fmt: skip
    if k == 1:
        fields["moe_dense_tp_size"] = 1
    return fields


def elastic_plan_for(given_fields: Mapping[str, Any], config: ResolvedConfig, platform: Any = None) -> ElasticEPPlan | None:
    """The joiners' plan of an elastic deployment, or None when ``config`` is not one
    (see :func:`~flotilla.cluster.engine.dp_scheduler.can_grow_elastic_ep`).

    Args:
        given_fields: the server fields the user set (as for
            :func:`plan_serving`: ``model_path`` is the ``--model`` value).
        config: the primary's resolved config (from those fields).
        platform: the PlatformFacts the primary was resolved for; None probes once (for
            the Ray cluster's workers when connected), and every joiner uses that one.

    Raises ValueError naming the flag: a joiner flag on the primary (``--ep-join-mode``,
    ``--elastic-ep-join-rank-offset``, ``--node-rank``: flotilla starts the primary and
    resolves its joiners itself), or a joining group that does not resolve (with the
    resolver's reasons).
    """
    if not can_grow_elastic_ep(config):
        return None
    for name, flag in (("ep_join_mode", "--ep-join-mode"), ("ep_join_rank_offset", "--elastic-ep-join-rank-offset"),
                       ("node_rank", "--node-rank")):  # fmt: skip
        if given_fields.get(name) not in (None, 0):
            raise ValueError(
                f"{flag} {given_fields[name]} describes a joining group; flotilla serve starts the primary "
                "and resolves its joiners itself: drop it"
            )
    initial = int(config.elastic_ep_initial_size or config.tp_size)
    max_ep = int(config.max_ep_size)
    if platform is None:
        platform = probe_for_workers()
    joiners: dict[tuple[int, int], ResolvedConfig] = {}
    for current in range(initial, max_ep):
        for new in range(current + 1, max_ep + 1):
            try:
                joiners[(current, new)] = resolve_engine_config(joiner_fields(given_fields, current, new, initial), platform)[0]
            except ResolutionError as exc:
                reasons = "; ".join(v.message for v in exc.violations)
                raise ValueError(
                    f"--max-ep-size {max_ep}: the group that grows elastic EP from {current} to {new} ranks "
                    f"does not resolve: {reasons}"
                ) from None
    timeout = float(config.elastic_ep_scale_timeout)
    return ElasticEPPlan(initial_size=initial, max_ep_size=max_ep, scale_timeout_s=timeout, joiner_configs=joiners)


# -- PD pools -----------------------------------------------------------------------------


# The per-pool parallelism flags: (keyword, server field, flag) for each pool's TP, DP and EP.
POOL_PARALLEL_FLAGS = {
    pool: tuple((f"{pool}_{kind}", field, f"--{pool}-{kind}") for kind, field in (("tp", "tp_size"), ("dp", "dp_size"), ("ep", "ep_size")))
    for pool in ("prefill", "decode")
}  # fmt: skip
POOL_PARALLEL_FLAGS["decode"] += (("decode_dcp", "dcp_size", "--decode-dcp"),)


def pd_server_fields(
    given: Mapping[str, Any],
    prefill_tp: int | None = None,
    decode_tp: int | None = None,
    *,
    prefill_dp: int | None = None,
    decode_dp: int | None = None,
    prefill_ep: int | None = None,
    decode_ep: int | None = None,
    decode_dcp: int | None = None,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The server fields each pool resolves from: the user's (``given``, from the
    flags) with ``disaggregation_mode`` set to the pool's role, and each pool's parallelism
    where its own flag is given (else the shared ``--tp-size``, ``--dp-size``, ``--ep-size``):
    ``--prefill-tp``/``--decode-tp`` set ``tp_size`` (the pool's ranks per replica),
    ``--prefill-ep``/``--decode-ep`` set ``ep_size``, and ``--prefill-dp``/``--decode-dp`` set
    ``dp_size`` with DP attention (``enable_dp_attention`` on above 1, off at 1: a PD pool's
    data parallelism is DP attention inside each replica; more replicas are
    ``--prefill-replicas``/``--decode-replicas``). The seeds' DP/EP rules then apply per pool.
    Decode context parallelism is the decode pool's alone: ``--decode-dcp`` (else the shared
    ``--dcp-size``) sets its ``dcp_size``, and the prefill pool runs ``dcp_size`` 1 (its ranks
    hold whole blocks, which DCP ranks read their token shards of; its page size then follows
    the decode pool's logical block, see :func:`plan_serving`).

    Choices made here (each overridable by giving the flag): the transfer backend reads
    ``nixl`` (what moves the KV; flotilla has no mooncake), and the decode pool keeps its
    prefix cache (``--disaggregation-decode-enable-radix-cache``; SGLang's decode servers
    default to no radix cache), so prompts sharing a prefix skip those blocks' transfer; not with
    decode context parallelism, which the seeds allow only with the chunk cache.

    Raises ValueError naming the flag for a transfer backend flotilla does not have, a size
    that is not an integer >= 1, or a pool DP size that does not divide its TP size.
    """
    base = {k: v for k, v in given.items() if k != "disaggregation_mode"}
    backend = base.get("disaggregation_transfer_backend")
    if backend not in (None, "nixl"):
        raise ValueError(
            f"--disaggregation-transfer-backend {backend}: flotilla moves KV blocks with NIXL "
            "(or its Ray fallback, --kv-transport ray); pass nixl or leave it out"
        )
    base["disaggregation_transfer_backend"] = "nixl"
    prefill = {**base, "disaggregation_mode": "prefill"}
    decode = {**base, "disaggregation_mode": "decode"}
    sizes = {
        "prefill_tp": prefill_tp, "decode_tp": decode_tp, "prefill_dp": prefill_dp, "decode_dp": decode_dp,
        "prefill_ep": prefill_ep, "decode_ep": decode_ep, "decode_dcp": decode_dcp,
    }  # fmt: skip
    prefill.pop("dcp_size", None)
    for pool, fields in (("prefill", prefill), ("decode", decode)):
        for keyword, field, flag in POOL_PARALLEL_FLAGS[pool]:
            size = sizes[keyword]
            if size is None:
                continue
            if isinstance(size, bool) or not isinstance(size, int) or size < 1:
                raise ValueError(f"{flag} must be an integer >= 1 (got {size!r})")
            fields[field] = size
            if field == "dp_size":
                fields["enable_dp_attention"] = size > 1
        if pool == "decode" and int(fields.get("dcp_size") or 1) == 1:
            # NOTE: SGLang's PD decode with DCP runs the chunk cache only (the seeds refuse the radix cache).
            fields.setdefault("disaggregation_decode_enable_radix_cache", True)
        dp, tp = int(fields.get("dp_size") or 1), int(fields.get("tp_size") or 1)
        if fields.get("enable_dp_attention") and tp % dp:
            raise ValueError(
                f"--{pool}-dp {dp} must divide the {pool} pool's TP size {tp} (--{pool}-tp, else --tp-size): "
                f"DP attention splits a replica's {tp} ranks into {dp} DP ranks"
            )
    return prefill, decode


def prefill_page_fields(prefill_fields: Mapping[str, Any], decode_config: Any) -> dict[str, Any]:
    """The prefill pool's fields with its page size set to the decode pool's LOGICAL block when
    the decode pool runs decode context parallelism: a DCP rank's blocks hold ``page_size``
    tokens of a ``dcp_size * page_size`` logical block, and the two pools' blocks must pair up
    one to one (a prefill block holds a whole logical block, of which each DCP rank reads its
    tokens). Without DCP the fields are returned as they are."""
    from flotilla.cluster.engine.limits import block_size_for

    fields = dict(prefill_fields)
    dcp = int(decode_config.dcp_size or 1)
    if dcp > 1:
        fields["page_size"] = block_size_for(decode_config) * dcp
    return fields


def ranks_in_replica(config: Any, options: ServeOptions, pool: str) -> bool:
    """Whether a replica of ``pool`` runs its one rank in its own process (else in worker
    actors): always at ``tp_size`` 1, except that a PD replica with the Ray-object KV
    fallback needs its rank in an actor the other side can call."""
    if int(config.tp_size or 1) > 1:
        return False
    return pool == "colocated" or options.kv_transport != "ray"


def check_pd_options(prefill_config: Any, decode_config: Any, options: ServeOptions) -> None:
    """Refuse a PD setup that cannot work, with a message naming the flag and value."""
    from flotilla.cluster.engine.limits import block_size_for
    from flotilla.cluster.kv.endpoint import KV_TRANSPORTS

    if options.disaggregation_mode != "pd":
        raise ValueError(f"disaggregation_mode={options.disaggregation_mode!r}: build_pd_app needs 'pd'")
    for flag, count in (("--prefill-replicas", options.prefill_replicas), ("--decode-replicas", options.decode_replicas)):
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise ValueError(f"{flag} must be an integer >= 1 (got {count!r})")
    if options.kv_transport not in KV_TRANSPORTS:
        raise ValueError(f"--kv-transport must be one of {', '.join(KV_TRANSPORTS)} (got {options.kv_transport!r})")
    check_policy(options.kv_load_failure_policy)
    for flag, value in (("kv_lease_s", options.kv_lease_s), ("kv_transfer_timeout_s", options.kv_transfer_timeout_s)):
        if not value > 0:
            raise ValueError(f"{flag} must be positive (got {value!r})")
    for role, config in (("prefill", prefill_config), ("decode", decode_config)):
        if config.disaggregation_mode != role:
            raise ValueError(f"the {role} pool's config has disaggregation_mode={config.disaggregation_mode!r}")
        if int(config.attn_cp_size or 1) > 1:
            raise ValueError(
                f"the {role} pool: attention context parallelism (attn_cp_size={config.attn_cp_size}) is not "
                "supported with --disaggregation-mode pd (its ranks do not map to attention-TP ranks); use TP, "
                "DP attention and EP (--prefill-dp/--decode-dp, --prefill-ep/--decode-ep)"
            )
    if int(prefill_config.dcp_size or 1) > 1:
        raise ValueError(
            f"the prefill pool: decode context parallelism (dcp_size={prefill_config.dcp_size}) is the decode "
            "pool's (--decode-dcp): prefill ranks hold whole KV blocks, of which the decode pool's DCP ranks "
            "read their token shards"
        )
    pairs = (
        ("model_path", prefill_config.model_path, decode_config.model_path),
        ("kv_cache_dtype", prefill_config.kv_cache_dtype, decode_config.kv_cache_dtype),
        ("dtype", prefill_config.dtype, decode_config.dtype),
        ("the logical KV block (page_size x dcp_size)", block_size_for(prefill_config) * int(prefill_config.dcp_size or 1),
         block_size_for(decode_config) * int(decode_config.dcp_size or 1)),
    )
    for what, a, b in pairs:
        if a != b:
            raise ValueError(f"prefill and decode pools must agree on {what}: prefill {a!r}, decode {b!r}")


# -- the ingress's client -----------------------------------------------------------------------
