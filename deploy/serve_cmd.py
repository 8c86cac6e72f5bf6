"""``flotilla serve``: the OpenAI-compatible endpoint on a Ray cluster.

    flotilla serve [--config FILE] [--model M] [server flags, SGLang spelling]...
                   [--router cache-aware|least-loaded|prefix-affinity|round-robin] [--num-replicas N]
                   [--num-ingress-replicas N] [--replica-num-cpus C] [--stream-batch-ms MS]
                   [--address ADDR] [--non-blocking]
                   [--max-prompts-per-request N] [--request-body-timeout-s S] [--max-header-bytes B]
                   [--http-keep-alive-timeout-s S] [--http-request-timeout-s S]
                   [--placement-strategy PACK|STRICT_PACK|SPREAD|STRICT_SPREAD]
                   [--disaggregation-mode pd --prefill-replicas N --decode-replicas M
                    [--prefill-tp A] [--decode-tp B] [--prefill-dp D] [--decode-dp D]
                    [--prefill-ep E] [--decode-ep E] [--decode-dcp C] [--kv-transport nixl|ray]
                    [--kv-load-failure-policy recompute|fail]
                    [--prefill-placement-strategy S] [--decode-placement-strategy S]]
                   [--elastic-ep-autoscale [--elastic-ep-autoscale-interval S] ...]

``--config FILE`` reads a Ray Serve config file (the one ``serve deploy`` takes, see
deploy/examples/): its flotilla application's ``args`` and ``http_options`` host/port
become these flags, and flags on the command line win (see :mod:`flotilla.deploy.config_file`).
The server flags are ``flotilla resolve``'s (``--tp-size``, ``--max-running-requests``,
...); ``--host`` (default 127.0.0.1), ``--port`` (30000), ``--api-key``,
``--max-queued-requests`` and ``--served-model-name`` act as in SGLang. The configuration
is resolved once, here, then:

- Ray: ``--address`` (or ``RAY_ADDRESS``; ``auto`` finds a ``ray start`` cluster on this
  machine) joins a running cluster, and the platform is probed on a worker node; without
  one a local cluster starts on loopback and ends with this command. Under
  ``ray job submit -- flotilla serve ...`` the job sets ``RAY_ADDRESS``.
- Serve's HTTP proxy listens on ``--host``:``--port``; the application
  (``--num-ingress-replicas`` ingress replicas, 2 by default, each with its router;
  ``--num-replicas`` engine replicas) is deployed as ``flotilla`` and this command prints
  the URL and a curl line once ``/health`` answers.
- ``--disaggregation-mode pd`` serves with two engine pools (see :mod:`flotilla.serve.pd`):
  ``--prefill-replicas`` replicas compute prompts, ``--decode-replicas`` replicas decode,
  with the KV cache moved by NIXL (``--kv-transport ray``: the Ray-object fallback). Each
  pool's configuration is resolved once, for its role (``--prefill-tp``/``--decode-tp``
  set its TP size, ``--prefill-dp``/``--decode-dp`` its DP-attention ranks,
  ``--prefill-ep``/``--decode-ep`` its EP size, and ``--decode-dcp`` the decode pool's decode
  context parallelism; the pools may differ in each).
  ``--kv-load-failure-policy`` (vLLM's name) says what
  a failed KV load does: ``recompute`` (default) or ``fail``.
- ``--placement-strategy`` says how every pool's worker groups lay their ranks over the
  nodes (``PACK``, the default: one node when a group fits one; ``STRICT_PACK``, ``SPREAD``,
  ``STRICT_SPREAD``; see :mod:`flotilla.cluster.placement`); in PD mode
  ``--prefill-placement-strategy`` / ``--decode-placement-strategy`` set one pool's.
- Elastic EP (``--elastic-ep-backend ray --max-ep-size M`` over the DP-attention layout
  ``--tp N --dp N --ep N --enable-dp-attention --enable-dp-lm-head``): one engine replica
  starts at N ranks and grows on ``POST /scale_elastic_ep``; every joining group is
  resolved here, once. ``--elastic-ep-autoscale`` lets the replica grow itself when its
  queue, KV usage or TTFT stay above thresholds for a window (the
  ``--elastic-ep-autoscale-*`` knobs; see :mod:`flotilla.serve.ep_autoscale`).
- It then blocks until Ctrl-C or SIGTERM, drains (:mod:`flotilla.serve.drain`: new
  requests get 503 with ``Retry-After``, requests in flight finish for up to
  ``--shutdown-timeout``; a second signal stops at once) and shuts the application down.
  ``--non-blocking`` (as in ``serve run``) returns once ready instead, leaving the
  application on the cluster (for jobs; needs a running cluster); remove it with
  ``serve shutdown`` or ``serve delete flotilla`` (no drain of the proxy's streams: see
  docs/configuration.md). ``ray job stop`` sends SIGTERM and kills the driver 3 s later
  (``RAY_JOB_STOP_WAIT_TIME_S``): inside a job the drain ends 2 s before that, and Serve
  still finishes shutting down on the cluster.

Exit status 2, with the reason on stderr, for a bad flag or a rejected configuration;
1 when the application fails to start (e.g. the model does not load), after cleaning up.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import os
import shlex
import signal
import ssl
import sys
import time
import urllib.error
import urllib.request
from typing import Any, Sequence

from flotilla.cluster.log_level import apply_log_level
from flotilla.cluster.engine.configure import check_user_settings
from flotilla.cluster.placement import PLACEMENT_STRATEGIES, check_placement_strategy
from flotilla.deploy.config_file import config_argv, load_serve_config, split_config_flag
from flotilla.resolution import ArgumentError, ResolutionError
from flotilla.resolution.args import _Parser, add_server_flags, reject_unknown, server_flag_names
from flotilla.resolution.fields import FIELDS
from flotilla.resolution.runtime_support import UnsupportedSettingsError, noop_notice
from flotilla.serve.ep_autoscale_driver import AUTOSCALE_ARGS, elastic_autoscale_options
from flotilla.serve.loopback import use_loopback_only
from flotilla.serve.types import (
    AUTOSCALING_FLAGS,
    MAX_STREAM_BATCH_MS,
    ROUTER_CLASSES,
    ElasticAutoscaleOptions,
    ServeOptions,
    parse_autoscaling,
    pool_placement_strategies,
)

# How long to wait for /health to answer 200 after the application reports running.
READY_TIMEOUT_S = 120.0
# The question the printed curl line asks.
SAMPLE_QUESTION = "What is the capital of France?"
# `ray job stop` SIGKILLs the driver this long after its SIGTERM unless RAY_JOB_STOP_WAIT_TIME_S
# says otherwise (Ray 2.60's job supervisor); the drain leaves JOB_STOP_MARGIN_S of it to
# shut Serve down.
DEFAULT_JOB_STOP_WAIT_S = 3.0
JOB_STOP_MARGIN_S = 2.0


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="flotilla serve",
        add_help=False,
        description="Serve a model through an OpenAI-compatible HTTP endpoint on Ray Serve.",
    )
    own = parser.add_argument_group("serve options")
    own.add_argument("--help", "-h", action="help", help="show this help and exit")
    own.add_argument(
        "--config",
        metavar="FILE",
        default=None,
        help="a Serve config YAML (deploy/examples/): its flotilla application's args and http_options "
        "host/port as flags; flags given here win",
    )
    own.add_argument(
        "--router",
        choices=tuple(ROUTER_CLASSES),
        default="cache-aware",
        help="how requests pick an engine replica (default cache-aware: where most of the prompt's "
        "KV blocks were sent before, unless that replica is overloaded)",
    )
    own.add_argument(
        "--num-replicas", type=int, default=None, help="engine replicas (default: the resolved dp_size, else 1)"
    )
    own.add_argument(
        "--num-ingress-replicas", type=int, default=None,
        help="replicas of the OpenAI ingress (tokenizing, templates, SSE; stateless; default 2)",
    )  # fmt: skip
    own.add_argument(
        "--replica-num-cpus", type=float, default=None, help="CPUs each engine replica reserves (default 0.5)"
    )
    own.add_argument(
        "--stream-batch-ms",
        type=float,
        default=None,
        help="a streamed request's chunks go out at most this often, its tokens gathered in between "
        "(default 50, as Ray Serve LLM; 0: a chunk every --stream-interval tokens)",
    )
    limits = ServeOptions()  # NOTE: the defaults shown in the help
    faults = parser.add_argument_group("faults and shutdown")
    faults.add_argument(
        "--migration-limit",
        type=int,
        default=None,
        help="how many times a request whose engine replica stopped is re-submitted to a live one with the "
        f"tokens already streamed, the client seeing one stream (default {limits.migration_limit}; 0: off)",
    )
    faults.add_argument(
        "--shutdown-timeout",
        type=float,
        default=None,
        help="a stopping engine replica refuses new requests and lets in-flight ones finish for up to this "
        f"many seconds (default {limits.shutdown_timeout_s:g})",
    )
    scaling = parser.add_argument_group("replica autoscaling (Serve's autoscaling_config, as JSON)")
    for flag, pool in (
        ("--autoscaling-config", "the colocated engine pool"),
        ("--prefill-autoscaling-config", "the prefill pool (with --disaggregation-mode pd)"),
        ("--decode-autoscaling-config", "the decode pool (with --disaggregation-mode pd)"),
    ):
        scaling.add_argument(
            flag, metavar="JSON", default=None,
            help=f"scale {pool} between min_replicas and max_replicas on its ongoing requests, e.g. "
            "'{\"min_replicas\": 1, \"max_replicas\": 4, \"target_ongoing_requests\": 8}' (default: a fixed count)",
        )  # fmt: skip
    clients = parser.add_argument_group("limits on clients")
    clients.add_argument(
        "--max-prompts-per-request",
        type=int,
        default=None,
        help=f"the most prompts one /v1/completions request may list (400 beyond; default {limits.max_prompts_per_request})",
    )
    clients.add_argument(
        "--request-body-timeout-s",
        type=float,
        default=None,
        help="a request body must arrive whole within this many seconds (408 and the connection closed beyond; "
        f"default {limits.request_body_timeout_s:g})",
    )
    clients.add_argument(
        "--max-header-bytes",
        type=int,
        default=None,
        help=f"the most bytes a request's headers may take (431 beyond; default {limits.max_header_bytes})",
    )
    clients.add_argument(
        "--http-keep-alive-timeout-s",
        type=int,
        default=None,
        help="seconds Serve's proxy keeps an idle keep-alive connection (Serve's http_options.keep_alive_timeout_s; "
        "default Serve's, 90)",
    )
    clients.add_argument(
        "--http-request-timeout-s",
        type=float,
        default=None,
        help="Serve's end-to-end bound on one HTTP request, 408 from the proxy beyond (Serve's "
        "http_options.request_timeout_s; default none: a long generation is a legitimate request)",
    )
    own.add_argument(
        "--placement-strategy",
        metavar="|".join(PLACEMENT_STRATEGIES),
        default=None,
        help="how each pool's worker groups lay their ranks over the nodes (default PACK: one node when a group "
        "fits one, tensor parallelism inside a node; SPREAD: over as many nodes as possible; STRICT_*: or no placement)",
    )
    own.add_argument(
        "--address",
        default=None,
        help="Ray cluster to join (default: RAY_ADDRESS; 'auto' finds one on this machine; none: start a local one)",
    )
    own.add_argument(
        "--non-blocking",
        action="store_true",
        help="return once the endpoint is ready, leaving it running on the cluster (for `ray job submit`)",
    )
    pd = parser.add_argument_group("prefill/decode disaggregation (with --disaggregation-mode pd)")
    pd.add_argument("--prefill-replicas", type=int, default=None, help="prefill engine replicas (default 1)")
    pd.add_argument("--decode-replicas", type=int, default=None, help="decode engine replicas (default 1)")
    pd.add_argument("--prefill-tp", type=int, default=None, help="TP size of each prefill replica (default: --tp-size)")
    pd.add_argument("--decode-tp", type=int, default=None, help="TP size of each decode replica (default: --tp-size)")
    for pool in ("prefill", "decode"):
        pd.add_argument(
            f"--{pool}-dp", type=int, default=None,
            help=f"DP-attention ranks inside each {pool} replica, dividing its TP size (default: --dp-size with "
            "--enable-dp-attention; 1 turns DP attention off for this pool)",
        )  # fmt: skip
        pd.add_argument(f"--{pool}-ep", type=int, default=None, help=f"EP size of each {pool} replica (default: --ep-size)")
    pd.add_argument(
        "--decode-dcp", type=int, default=None,
        help="decode context parallelism of each decode replica, dividing its attention TP (default: --dcp-size; "
        "the prefill pool always runs whole blocks)",
    )  # fmt: skip
    pd.add_argument(
        "--kv-transport",
        choices=("auto", "nixl", "ray"),
        default="auto",
        help="how KV blocks move: nixl, or the ray object-store fallback (default auto: nixl when installed)",
    )
    pd.add_argument(
        "--kv-load-failure-policy",
        choices=("recompute", "fail"),
        default="recompute",
        help="when a prompt's KV cannot be loaded: recompute it on the decode side (default) or fail the request",
    )
    for pool in ("prefill", "decode"):
        pd.add_argument(
            f"--{pool}-placement-strategy",
            metavar="S",
            default=None,
            help=f"--placement-strategy of the {pool} pool alone (default: --placement-strategy, else PACK)",
        )
    auto = parser.add_argument_group("elastic EP autoscaling (with --elastic-ep-backend ray --max-ep-size)")
    auto.add_argument(
        "--elastic-ep-autoscale",
        action="store_const",
        const="true",
        default=None,
        help="grow the EP group by itself when load stays above the thresholds below for a window (default off)",
    )
    knobs = ElasticAutoscaleOptions()  # NOTE: the defaults shown in the help
    for flag, metavar, default, text in (
        ("--elastic-ep-autoscale-interval", "S", knobs.interval_s, "seconds between load samples"),
        ("--elastic-ep-autoscale-waiting-per-rank", "N|off", knobs.waiting_per_rank_threshold,
         "queued requests per DP rank above which load counts as high"),
        ("--elastic-ep-autoscale-kv-usage", "F|off", knobs.kv_usage_threshold,
         "KV cache usage fraction above which load counts as high"),
        ("--elastic-ep-autoscale-ttft-p90", "S|off", knobs.ttft_p90_threshold_s,
         "TTFT p90 (seconds) above which load counts as high"),
        ("--elastic-ep-autoscale-window", "S", knobs.window_s, "seconds load must stay high before a join"),
        ("--elastic-ep-autoscale-cooldown", "S", knobs.cooldown_s, "seconds after a scale before the next join"),
        ("--elastic-ep-autoscale-step", "N", knobs.step, "ranks to add per join"),
    ):  # fmt: skip
        auto.add_argument(flag, metavar=metavar, default=None, help=f"{text} (default {default:g})")
    add_server_flags(parser, FIELDS.values())
    return parser


# The PD pools' parallelism beyond --prefill-tp / --decode-tp (plan_serving's pool_sizes).
POOL_SIZE_FLAGS = ("prefill_dp", "decode_dp", "prefill_ep", "decode_ep", "decode_dcp")
PD_ONLY_FLAGS = (
    "prefill_replicas", "decode_replicas", "prefill_tp", "decode_tp", *POOL_SIZE_FLAGS,
    "prefill_placement_strategy", "decode_placement_strategy",
)  # fmt: skip
# The flags that name a placement strategy: the pools they set (None: every pool of the mode).
STRATEGY_FLAGS = {
    "placement_strategy": None, "prefill_placement_strategy": "prefill", "decode_placement_strategy": "decode",
}  # fmt: skip


def split_pd_mode(argv: Sequence[str]) -> tuple[list[str], bool]:
    """Take ``--disaggregation-mode pd`` out of ``argv`` (the server field of that name
    knows only SGLang's single-server roles); returns (the rest, whether PD was asked).
    ``prefill`` or ``decode`` are refused: ``flotilla serve`` runs both pools itself."""
    rest, pd, args = [], False, list(argv)
    i = 0
    while i < len(args):
        arg = args[i]
        if arg == "--disaggregation-mode" or arg.startswith("--disaggregation-mode="):
            if "=" in arg:
                value = arg.split("=", 1)[1]
            elif i + 1 < len(args):
                value, i = args[i + 1], i + 1
            else:
                raise ArgumentError("--disaggregation-mode expects a value: pd or null")
            if value not in ("pd", "null"):
                raise ArgumentError(
                    f"--disaggregation-mode {value}: flotilla serve runs the prefill and decode pools itself; "
                    "pass --disaggregation-mode pd (or null for one colocated pool)"
                )
            pd = value == "pd"
        else:
            rest.append(arg)
        i += 1
    return rest, pd


def parse_serve_args(argv: Sequence[str]) -> tuple[argparse.Namespace, dict[str, Any]]:
    """(own options, the server fields given); :class:`ArgumentError` on bad input.
    ``opts.pd`` says whether ``--disaggregation-mode pd`` was given;
    ``opts.elastic_autoscale`` holds the ``--elastic-ep-autoscale*`` flags as
    :class:`~flotilla.serve.types.ElasticAutoscaleOptions`. With ``--config FILE`` the
    file's flags come first (the command line's win); ``opts.config_file`` is the
    :class:`~flotilla.deploy.config_file.ServeConfigFile` (else None), and
    ``opts.placement`` / ``opts.max_body_bytes`` carry its values that have no flag."""
    parser = build_parser()
    path, argv = split_config_flag(argv)
    config_file = load_serve_config(path) if path is not None else None
    if config_file is None:
        opts, given = _parse_flags(parser, argv)
    else:
        file_argv = config_argv(config_file, parser)  # NOTE: its errors name the file, key and value
        try:
            opts, given = _parse_flags(parser, file_argv + argv)
        except ArgumentError as exc:
            # NOTE: a check across flags (a PD flag without pd, a bound); each arg is the flag of its name.
            raise ArgumentError(f"{path} (its args as flags) with the command line: {exc}") from None
    opts.config, opts.config_file = path, config_file
    opts.placement = config_file.placement if config_file is not None else {}
    opts.placement_strategies = placement_strategies(opts, config_file)
    opts.max_body_bytes = config_file.max_body_bytes if config_file is not None else None
    return opts, given


def placement_strategies(opts: argparse.Namespace, config_file: Any = None) -> dict[str, str]:
    """Each pool's placement strategy: the config file's ``placement_strategy`` first, then
    ``--placement-strategy`` (every pool of the mode), then ``--prefill-placement-strategy`` /
    ``--decode-placement-strategy``; PACK where none is given. The strategies were checked
    with the flags; :class:`ArgumentError` naming the file when its pools are not the mode's."""
    chosen: dict[str, str] = {}
    if config_file is not None and config_file.placement_strategy is not None:
        value = config_file.placement_strategy
        try:
            chosen = pool_placement_strategies(value, pd=opts.pd)
        except ValueError as exc:
            raise ArgumentError(f"{config_file.path}: args.placement_strategy={value!r}: {exc}") from None
    for name, pool in STRATEGY_FLAGS.items():
        strategy = getattr(opts, name)
        if strategy is not None:
            every = pool_placement_strategies(strategy, pd=opts.pd)
            chosen.update(every if pool is None else {pool: every[pool]})
    return pool_placement_strategies(chosen, pd=opts.pd)


def _parse_flags(parser: argparse.ArgumentParser, argv: Sequence[str]) -> tuple[argparse.Namespace, dict[str, Any]]:
    argv, pd = split_pd_mode(argv)
    opts, unknown = parser.parse_known_args(argv)
    opts.pd = pd
    own_flags = [o for a in parser._actions for o in a.option_strings]
    reject_unknown(unknown, server_flag_names() + own_flags)
    if opts.num_replicas is not None and opts.num_replicas < 1:
        raise ArgumentError(f"--num-replicas must be at least 1, got {opts.num_replicas}")
    if opts.num_ingress_replicas is not None and opts.num_ingress_replicas < 1:
        raise ArgumentError(f"--num-ingress-replicas must be >= 1, got {opts.num_ingress_replicas}")
    if opts.replica_num_cpus is not None and opts.replica_num_cpus < 0:
        raise ArgumentError(f"--replica-num-cpus must not be negative, got {opts.replica_num_cpus}")
    if opts.stream_batch_ms is not None and not 0 <= opts.stream_batch_ms <= MAX_STREAM_BATCH_MS:
        raise ArgumentError(f"--stream-batch-ms must be in [0, {MAX_STREAM_BATCH_MS:g}] ms, got {opts.stream_batch_ms}")
    for name, least, inclusive in (
        ("max_prompts_per_request", 1, True), ("max_header_bytes", 1024, True), ("request_body_timeout_s", 0, False),
        ("http_keep_alive_timeout_s", 0, True), ("http_request_timeout_s", 0, False),
        ("migration_limit", 0, True), ("shutdown_timeout", 0, True),
    ):  # fmt: skip
        value = getattr(opts, name)
        if value is not None and not (value >= least if inclusive else value > least):
            bound = f"at least {least}" if inclusive else f"more than {least}"
            raise ArgumentError(f"--{name.replace('_', '-')} must be {bound}, got {value}")
    for name in PD_ONLY_FLAGS:
        value = getattr(opts, name)
        if value is not None and not pd:
            raise ArgumentError(f"--{name.replace('_', '-')} {value} needs --disaggregation-mode pd")
        if isinstance(value, int) and value < 1:
            raise ArgumentError(f"--{name.replace('_', '-')} must be at least 1, got {value}")
    for name in STRATEGY_FLAGS:
        if getattr(opts, name) is not None:
            try:
                setattr(opts, name, check_placement_strategy(getattr(opts, name), "--" + name.replace("_", "-")))
            except ValueError as exc:
                raise ArgumentError(str(exc)) from None
    if pd and opts.num_replicas is not None:
        raise ArgumentError("--num-replicas sizes the colocated pool; with --disaggregation-mode pd use --prefill-replicas and --decode-replicas")
    opts.elastic_autoscale = elastic_autoscale_options({name: getattr(opts, name) for name in AUTOSCALE_ARGS})
    opts.autoscaling = _autoscaling_flags(opts)
    given = {k: v for k, v in vars(opts).items() if k in FIELDS}
    return opts, given


def _autoscaling_flags(opts: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """``ServeOptions.autoscaling`` from the ``--*autoscaling-config`` flags (JSON objects)."""
    try:
        return parse_autoscaling({name: getattr(opts, name, None) for name in AUTOSCALING_FLAGS.values()}, as_flags=True)
    except ValueError as exc:
        raise ArgumentError(str(exc)) from None


def plan_for(opts: argparse.Namespace, given: dict[str, Any], platform: Any = None) -> Any:
    """The :class:`~flotilla.serve.plan.ServePlan` of the parsed flags (one pool, or PD's two;
    an elastic EP deployment's joiners), resolved once. ``platform``: the PlatformFacts to
    resolve for (default: probed on a worker node; a preset such as ``PRESETS["h200"]`` plans
    for hardware this machine lacks)."""
    # NOTE: imported here: the plan imports Ray, which reads its loopback setting at import
    # (run_serve sets it first for a local cluster).
    from flotilla.serve.plan import plan_serving

    return plan_serving(
        given,
        platform=platform,
        pd=opts.pd,
        prefill_tp=opts.prefill_tp,
        decode_tp=opts.decode_tp,
        pool_sizes={name: getattr(opts, name, None) for name in POOL_SIZE_FLAGS},
        router=opts.router,
        num_replicas=opts.num_replicas,
        replica_num_cpus=opts.replica_num_cpus,
        num_ingress_replicas=opts.num_ingress_replicas,
        stream_batch_ms=opts.stream_batch_ms,
        prefill_replicas=opts.prefill_replicas,
        decode_replicas=opts.decode_replicas,
        kv_transport=opts.kv_transport,
        kv_load_failure_policy=opts.kv_load_failure_policy,
        elastic_autoscale=getattr(opts, "elastic_autoscale", None),
        max_body_bytes=getattr(opts, "max_body_bytes", None),
        placement=getattr(opts, "placement", None),
        placement_strategy=getattr(opts, "placement_strategies", None),
        max_prompts_per_request=getattr(opts, "max_prompts_per_request", None),
        request_body_timeout_s=getattr(opts, "request_body_timeout_s", None),
        max_header_bytes=getattr(opts, "max_header_bytes", None),
        http_keep_alive_timeout_s=getattr(opts, "http_keep_alive_timeout_s", None),
        http_request_timeout_s=getattr(opts, "http_request_timeout_s", None),
        migration_limit=getattr(opts, "migration_limit", None),
        shutdown_timeout_s=getattr(opts, "shutdown_timeout", None),
        autoscaling=getattr(opts, "autoscaling", None),
    )


def run_serve(argv: Sequence[str]) -> int:
    """Entry of ``flotilla serve``; returns the exit status."""
    try:
        opts, given = parse_serve_args(argv)
        joining = bool(opts.address or os.environ.get("RAY_ADDRESS"))
        if opts.non_blocking and not joining:
            raise ArgumentError(
                "--non-blocking leaves the endpoint on a running cluster, and none is named: "
                "pass --address (or set RAY_ADDRESS), or drop --non-blocking"
            )
        # NOTE: before Ray starts and any weight loads: flags the runtime would not act on stop here.
        check_user_settings(given)
    except UnsupportedSettingsError as exc:
        for refusal in exc.refusals:
            print(f"flotilla serve: error: {refusal.line}", file=sys.stderr)
        return 2
    except (ArgumentError, ValueError) as exc:
        _print_error(exc)
        return 2
    notice = noop_notice(given)
    if notice is not None:
        print(f"flotilla serve: {notice}", file=sys.stderr)
    for note in opts.config_file.notes if opts.config_file is not None else ():
        print(f"flotilla serve: note: {note}", file=sys.stderr)
    if not joining:
        # NOTE: Ray reads RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER when it is imported (below): a local
        # cluster's processes, NIXL's UCX listeners and gloo stay on loopback (LOOPBACK_ENV).
        use_loopback_only()
    from flotilla.serve.app import ensure_ray

    try:
        if joining:
            ensure_ray(opts.address)  # NOTE: before resolving, so the probe runs on a worker node
        plan = plan_for(opts, given)
    except (ArgumentError, ResolutionError, ValueError) as exc:
        _print_error(exc)
        return 2
    config, options = plan.config, plan.options
    apply_log_level(config)
    started_local = False if joining else _start_local(plan)
    serve_was_running = _serve_running()
    if serve_was_running and serves_tls(config):
        # NOTE: Serve keeps the HTTP options it started with; the proxy could speak plain HTTP.
        print(
            "flotilla serve: error: --ssl-certfile/--ssl-keyfile need Serve's proxy to start with them, and Serve "
            "is already running on this cluster; run `serve shutdown` first (or serve without TLS)",
            file=sys.stderr,
        )
        if started_local:
            _shutdown(started_local, False)
        return 2
    if serve_was_running:
        print(
            "flotilla serve: note: Serve is already running on this cluster; its HTTP options stay as they are",
            file=sys.stderr,
        )
    board = _start_drain_board() if not opts.non_blocking else None
    try:
        url = deploy(plan)
    except KeyboardInterrupt:
        print("flotilla serve: interrupted while starting; shutting down", file=sys.stderr)
        _shutdown(started_local, serve_was_running)
        return 130
    except Exception as exc:  # noqa: BLE001 - report any deploy failure as one line, then clean up
        print(f"flotilla serve: error: the application did not start: {exc}", file=sys.stderr)
        _shutdown(started_local, serve_was_running)
        return 1
    print(ready_message(url, options, config, blocking=not opts.non_blocking))
    sys.stdout.flush()
    if opts.non_blocking:
        return 0
    got = _wait_for_interrupt()
    _drain(board, options.shutdown_timeout_s, got)
    print("flotilla serve: shutting down", file=sys.stderr)
    _shutdown(started_local, serve_was_running)
    return 0


def _print_error(exc: Exception) -> None:
    if isinstance(exc, ResolutionError):
        for violation in exc.violations:
            print(violation.message, file=sys.stderr)
    else:
        print(f"flotilla serve: error: {exc}", file=sys.stderr)


def _start_local(plan: Any) -> bool:
    """Start a local Ray cluster with enough logical CPUs for the application."""
    from flotilla.serve.app import cpus_needed, ensure_ray

    return ensure_ray(None, num_cpus=max(4, os.cpu_count() or 1, math.ceil(cpus_needed(plan) + 1)))


def _serve_running() -> bool:
    import ray
    from ray.serve._private.constants import SERVE_CONTROLLER_NAME, SERVE_NAMESPACE

    try:
        ray.get_actor(SERVE_CONTROLLER_NAME, namespace=SERVE_NAMESPACE)
        return True
    except ValueError:
        return False


def serves_tls(config) -> bool:
    """Whether the endpoint speaks HTTPS (``--ssl-certfile`` and ``--ssl-keyfile``)."""
    return bool(config.ssl_certfile and config.ssl_keyfile)


def http_options(config, serving: Any = None) -> dict[str, Any]:
    """Serve's ``http_options`` for the endpoint: ``--host``/``--port``; with
    ``--ssl-certfile``/``--ssl-keyfile`` (plus ``--ssl-keyfile-password``), TLS, so the port
    answers HTTPS only; from ``serving`` (the ServeOptions), ``--http-keep-alive-timeout-s``
    and ``--http-request-timeout-s`` when set.

    NOTE: that is all of uvicorn Serve's proxy lets a deployment set (Ray 2.60 builds its
    ``uvicorn.Config`` from host, port, root path, keep-alive and TLS alone): header size
    and header-read time are not bounded there (see docs/configuration.md, limits on
    clients); the ingress bounds header bytes (431) and the body's arrival (408) itself."""
    options: dict[str, Any] = {"host": config.host, "port": int(config.port)}
    if serves_tls(config):
        for name in ("ssl_certfile", "ssl_keyfile", "ssl_keyfile_password"):
            if getattr(config, name):
                options[name] = str(getattr(config, name))
    keep_alive = getattr(serving, "http_keep_alive_timeout_s", None)
    if keep_alive is not None:
        options["keep_alive_timeout_s"] = int(keep_alive)
    request_timeout = getattr(serving, "http_request_timeout_s", None)
    if request_timeout is not None:
        options["request_timeout_s"] = float(request_timeout)
    return options


def deploy(plan: Any) -> str:
    """Start Serve's proxy on ``--host``:``--port`` (HTTPS with the ``--ssl-*`` flags), deploy
    the plan's application and wait until ``/health`` answers; returns the base URL
    (``http://host:port`` or ``https://host:port``)."""
    from ray import serve

    from flotilla.serve.app import APP_NAME, build_application

    config, options = plan.config, plan.options
    app = build_application(plan)
    # NOTE: HeadOnly: one proxy, on the node this URL names (the head, where jobs run).
    serve.start(http_options=http_options(config, options), proxy_location="HeadOnly")
    with _quiet_reconnect_note():
        serve.run(app, name=APP_NAME, route_prefix="/", blocking=False)
    scheme = "https" if serves_tls(config) else "http"
    url = f"{scheme}://{_client_host(config.host)}:{int(config.port)}"
    wait_until_healthy(url, READY_TIMEOUT_S)
    return url


class _ReconnectNote(logging.Filter):
    """Drops Serve's "Connecting to existing Serve app ... New http_options/controller_options
    will not be applied." line, which ``serve.run`` logs right after our own ``serve.start``
    applied them: it reads as if ``--port`` or TLS had been ignored."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "will not be applied" not in record.getMessage()


@contextlib.contextmanager
def _quiet_reconnect_note():
    serve_logger = logging.getLogger("ray.serve")
    note = _ReconnectNote()
    serve_logger.addFilter(note)
    try:
        yield
    finally:
        serve_logger.removeFilter(note)


def _client_host(host: str) -> str:
    """Where a client on this machine reaches a proxy bound to ``host``."""
    if host in ("0.0.0.0", "::", ""):
        return "127.0.0.1"
    return f"[{host}]" if ":" in host else host


def wait_until_healthy(url: str, timeout_s: float) -> None:
    """Poll ``url``/health until it answers 200; TimeoutError after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    last: Any = None
    # NOTE: our own endpoint: a self-signed certificate is fine for this probe.
    context = ssl._create_unverified_context() if url.startswith("https:") else None
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=5, context=context) as response:
                if response.status == 200:
                    return
                last = f"status {response.status}"
        except (urllib.error.URLError, OSError) as exc:
            last = exc
        time.sleep(0.5)
    raise TimeoutError(f"{url}/health did not answer 200 within {timeout_s:.0f}s (last: {last})")


def ready_message(url: str, options, config, blocking: bool = True) -> str:
    """What ``flotilla serve`` prints once ready: the URL and a ready-to-paste curl line."""
    from flotilla.cluster.engine.speculative import speculation_summary
    from flotilla.serve.app import APP_NAME

    body = {
        "model": options.served_model_name,
        "messages": [{"role": "user", "content": SAMPLE_QUESTION}],
        "max_tokens": 32,
        "temperature": 0,  # NOTE: greedy: a newcomer's first answer reads well even from a tiny model
    }
    curl = "curl"
    if url.startswith("https:"):
        curl += f" --cacert {shlex.quote(str(config.ssl_certfile))}"  # NOTE: a self-signed cert is its own CA
    curl += f" {url}/v1/chat/completions -H 'Content-Type: application/json'"
    if options.api_key:
        curl += ' -H "Authorization: Bearer $FLOTILLA_API_KEY"'
    curl += f" -d {shlex.quote(json.dumps(body))}"
    def count(group: str, fixed: int) -> str:
        scaling = options.autoscaling_for(group)
        if scaling is None:
            return str(fixed)
        return f"{scaling.get('min_replicas', 1)}-{scaling['max_replicas']} (autoscaled)"

    if options.disaggregation_mode == "pd":
        replicas = (
            f"PD: {count('prefill', options.prefill_replicas)} prefill + {count('decode', options.decode_replicas)} "
            f"decode replicas, KV by {options.kv_transport}"
        )
    else:
        engines = count("engine", options.num_replicas)
        replicas = f"{engines} engine replica{'' if engines == '1' else 's'}"
        plan = options.elastic_plan
        if plan is not None:
            auto = ", autoscaled" if options.elastic_autoscale.enabled else ""
            replicas += f", elastic EP {plan.initial_size} to {plan.max_ep_size} ranks{auto}"
    spec = speculation_summary(config)
    if spec is not None:
        draft = f" from {spec['draft_model']}" if "draft_model" in spec else ""
        replicas += f", speculative decoding {spec['algorithm']}{draft} ({spec['num_draft_tokens']} drafts per step)"
    lines = [
        f"flotilla serve: {options.served_model_name} is ready at {url}/v1 "
        f"({replicas}, router {options.router}, config {config.digest[:12]})",
        "try:",
        f"  {curl}",
    ]
    if options.api_key:
        lines.append("  (with FLOTILLA_API_KEY set to the --api-key value)")
    stop = "Ctrl-C" if blocking else f"serve delete {APP_NAME} (or serve shutdown)"
    lines.append(f"metrics: {url}/metrics    health: {url}/health    stop: {stop}")
    return "\n".join(lines)


def _wait_for_interrupt() -> str:
    """Block until Ctrl-C or SIGTERM (``ray job stop`` sends SIGTERM); returns which
    (``"SIGINT"`` or ``"SIGTERM"``)."""
    got = "SIGINT"

    def on_term(signum, frame):
        nonlocal got
        got = "SIGTERM"
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, on_term)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        signal.signal(signal.SIGTERM, previous)
    return got


def _start_drain_board() -> Any:
    """The drain board of this deployment (:mod:`flotilla.serve.drain`); None, with a note,
    when it cannot be made (the application then stops without a drain)."""
    from flotilla.serve.drain import start_drain_board

    try:
        return start_drain_board()
    except Exception as exc:  # noqa: BLE001 - serving matters more than the drain
        print(f"flotilla serve: note: no graceful drain on shutdown: {exc}", file=sys.stderr)
        return None


def drain_budget_s(shutdown_timeout_s: float, environ: Any = os.environ) -> float:
    """How long the drain may take: ``--shutdown-timeout``, but inside a Ray job no longer
    than ``ray job stop`` waits before its SIGKILL (``RAY_JOB_STOP_WAIT_TIME_S``, default 3,
    less :data:`JOB_STOP_MARGIN_S` to shut Serve down after), so Serve is never left running."""
    if "RAY_JOB_CONFIG_JSON_ENV_VAR" not in environ:  # NOTE: Ray sets it in a job's driver
        return shutdown_timeout_s
    try:
        wait = float(environ.get("RAY_JOB_STOP_WAIT_TIME_S", DEFAULT_JOB_STOP_WAIT_S))
    except ValueError:
        wait = DEFAULT_JOB_STOP_WAIT_S
    return max(0.0, min(shutdown_timeout_s, wait - JOB_STOP_MARGIN_S))


def _drain(board: Any, shutdown_timeout_s: float, got: str) -> None:
    """Drain the application before it is removed: new requests get 503, those in flight
    finish for up to ``shutdown_timeout_s`` (:func:`flotilla.serve.drain.drain`). Nothing
    with no board or a budget of 0; a second Ctrl-C or SIGTERM ends the drain early."""
    from flotilla.serve.drain import drain

    budget = drain_budget_s(shutdown_timeout_s)
    if board is None or budget <= 0:
        return
    capped = "" if budget == shutdown_timeout_s else f" (capped by RAY_JOB_STOP_WAIT_TIME_S from {shutdown_timeout_s:g} s)"
    print(
        f"flotilla serve: {got}: draining: new requests get 503; requests in flight have {budget:g} s to finish "
        f"(--shutdown-timeout){capped}; {got} again stops at once",
        file=sys.stderr,
    )
    sys.stderr.flush()

    def on_term(signum, frame):
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, on_term)
    try:
        outcome = drain(board, budget, f"flotilla serve got {got}")
    except KeyboardInterrupt:
        print("flotilla serve: drain interrupted; stopping now", file=sys.stderr)
    except Exception as exc:  # noqa: BLE001 - the drain is best effort; the shutdown must happen
        print(f"flotilla serve: note: the drain failed ({exc}); stopping now", file=sys.stderr)
    else:
        if outcome.timed_out:
            still = f"; {outcome.left} still had not ended" if outcome.left else ""
            print(
                f"flotilla serve: requests still ran after {budget:g} s (--shutdown-timeout): they ended with "
                f"an error{still}",
                file=sys.stderr,
            )
        else:
            print(f"flotilla serve: drained in {outcome.waited_s:.1f} s", file=sys.stderr)
    finally:
        signal.signal(signal.SIGTERM, previous)


def _shutdown(started_local: bool, serve_was_running: bool) -> None:
    """Remove what this command deployed: all of Serve when it started Serve, else only
    the ``flotilla`` application; the metrics hub; and the local cluster it started."""
    import ray
    from ray import serve

    from flotilla.serve.app import APP_NAME
    from flotilla.serve.metrics import shutdown_metrics_hub

    if not ray.is_initialized():
        return
    # NOTE: the hub first: it is quick, and `ray job stop` kills the driver 3 s
    # (RAY_JOB_STOP_WAIT_TIME_S) after its SIGTERM.
    try:
        shutdown_metrics_hub()
    except Exception:  # noqa: BLE001 - gone already
        pass
    try:
        if serve_was_running:
            serve.delete(APP_NAME)
        else:
            serve.shutdown()
    except Exception as exc:  # noqa: BLE001 - best effort: say so and go on
        print(f"flotilla serve: note: shutting Serve down failed: {exc}", file=sys.stderr)
    if started_local:
        ray.shutdown()
