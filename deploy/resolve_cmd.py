"""``flotilla resolve``: print the resolved configuration for a model and platform.

    flotilla resolve --model PATH [--platform NAME | --platform-file FILE]
                     [--platform-set KEY=VALUE]... [server flags]...
                     [--format json|table] [--explain]
    flotilla resolve --runtime-support [--format table|json]

Exit status 2, with one line per problem on stderr, for a rejected combination,
an unknown flag, a bad choice or an unreadable config.json.

``--runtime-support`` alone prints what the runtime does with every server field
(:mod:`flotilla.resolution.runtime_support`): ``honored``, ``refused`` or ``noop``. With
``--model``, the table format marks the flags given that ``flotilla serve`` would refuse
(``!``) or that have no effect (``~``); resolution itself still runs (it is the seeds' rules).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, Mapping, Sequence

from flotilla.resolution import (
    ArgumentError,
    ModelFacts,
    ResolutionError,
    ResolvedConfig,
    ServerArgs,
    preset,
    resolve,
)
from flotilla.resolution.architectures import KNOWN_ARCHITECTURES
from flotilla.resolution.args import (
    _Parser,
    add_server_flags,
    reject_unknown,
    server_flag_names,
)
from flotilla.resolution.fields import FIELDS
from flotilla.resolution.platform import apply_flips, load_platform_file
from flotilla.resolution.runtime_support import noop_settings, refusals, support_json, support_table

# Fields the table format always shows, grouped by topic.
SUMMARY = {
    "parallelism": ("tp_size", "dp_size", "ep_size", "pp_size", "attn_cp_size", "dcp_size", "enable_dp_attention"),
    "attention": ("attention_backend", "prefill_attention_backend", "decode_attention_backend", "dsa_prefill_backend", "dsa_decode_backend"),
    "kv cache": ("page_size", "kv_cache_dtype"),
    "quantization and moe": ("quantization", "moe_runner_backend", "moe_a2a_backend", "disable_shared_experts_fusion"),
    "other": ("sampling_backend", "disable_overlap_schedule"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="flotilla resolve",
        add_help=False,
        description="Resolve the server configuration once, as a pure function of flags, config.json and platform facts.",
    )
    own = parser.add_argument_group("resolve options")
    own.add_argument("--help", "-h", action="help", help="show this help and exit")
    own.add_argument("--platform", default=None, help="named platform preset (default: cpu)")
    own.add_argument("--platform-file", default=None, help="JSON file of platform facts")
    own.add_argument(
        "--platform-set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="flip one platform fact (flashinfer, triton_kernels, mnnvl, driver_version, ...)",
    )
    own.add_argument("--format", choices=("json", "table"), default="table", help="output format")
    own.add_argument("--explain", action="store_true", help="show, per changed field, the chain of rules")
    own.add_argument(
        "--runtime-support",
        action="store_true",
        help="print what flotilla's runtime does with each server field (honored, refused or noop) and exit",
    )
    add_server_flags(parser, FIELDS.values())
    return parser


def _platform(args: argparse.Namespace):
    if args.platform and args.platform_file:
        raise ArgumentError("give --platform or --platform-file, not both")
    facts = load_platform_file(args.platform_file) if args.platform_file else preset(args.platform or "cpu")
    flips = {}
    for item in args.platform_set:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ArgumentError(f"--platform-set expects KEY=VALUE, got {item!r}")
        flips[key.strip()] = value.strip()
    return apply_flips(facts, flips) if flips else facts


def run_resolve(argv: Sequence[str]) -> int:
    parser = build_parser()
    try:
        namespace, unknown = parser.parse_known_args(list(argv))
        own_flags = [o for a in parser._actions for o in a.option_strings]
        reject_unknown(unknown, server_flag_names() + own_flags)
        if namespace.runtime_support and getattr(namespace, "model_path", None) is None:
            if namespace.format == "json":
                print(json.dumps(support_json(), sort_keys=True, default=repr))
            else:
                print(support_table(), end="")
            return 0
        if getattr(namespace, "model_path", None) is None:
            raise ArgumentError("--model PATH is required (a directory holding config.json, or the file)")
        platform = _platform(namespace)
        model = ModelFacts.from_path(namespace.model_path)
        server_args = ServerArgs.from_namespace(namespace)
    except ArgumentError as exc:
        print(f"flotilla resolve: error: {exc}", file=sys.stderr)
        return 2
    if model.architecture not in KNOWN_ARCHITECTURES:
        name = model.architecture or "(none)"
        print(
            f"note: architecture {name} is not a known model; resolved with the generic rules only",
            file=sys.stderr,
        )
    try:
        resolved = resolve(server_args, model, platform)
    except ResolutionError as exc:
        for violation in exc.violations:
            print(violation.message, file=sys.stderr)
        return 2
    if namespace.format == "json":
        print(json.dumps(resolved.to_dict(), sort_keys=True, default=repr))
    else:
        given = {name: server_args.values[name] for name in server_args.explicit}
        print(format_table(resolved, platform.name, given, model))
    if namespace.explain:
        print(format_explain(resolved))
    return 0


def format_table(
    resolved: ResolvedConfig, platform_name: str, given: Mapping[str, Any] | None = None, model: Any = None
) -> str:
    """The ``--format table`` text; ``given`` (the flags set, by field) adds what the runtime
    would refuse or ignore of them."""
    changed = {c.field for c in resolved.provenance}
    lines = [f"platform: {platform_name}    config hash: {resolved.digest[:16]}"]
    for title, names in SUMMARY.items():
        lines.append(f"\n[{title}]")
        for name in names:
            mark = "*" if name in changed else " "
            lines.append(f" {mark} {name:<34} {getattr(resolved, name)!r}")
    others = sorted(changed - {n for names in SUMMARY.values() for n in names})
    if others:
        lines.append("\n[other fields resolution changed]")
        for name in others:
            lines.append(f" * {name:<34} {getattr(resolved, name)!r}")
    if resolved.env:
        lines.append("\n[environment for workers]")
        for key, value in sorted(resolved.env.items()):
            lines.append(f"   {key}={value}")
    lines.append("\n(* = set by a resolution rule; run with --explain for the rules)")
    refused_lines = [r.line for r in refusals(given or {}, model)]
    ignored = noop_settings(given or {})
    if refused_lines or ignored:
        lines.append("\n[runtime support of the flags given: flotilla resolve --runtime-support]")
        lines += [f" ! {line}" for line in refused_lines]
        lines += [f" ~ {flag} has no effect in flotilla's runtime" for flag in ignored]
        if refused_lines:
            lines.append("(! = flotilla serve and LLM(...) refuse this flag; ~ = accepted, no effect)")
    return "\n".join(lines)


def format_explain(resolved: ResolvedConfig) -> str:
    chains: dict[str, list] = {}
    for change in resolved.provenance:
        chains.setdefault(change.field, []).append(change)
    lines = ["", "explanation (field: old -> new, by rule: reason)"]
    for name, changes in chains.items():
        lines.append(f"{name}:")
        for c in changes:
            flag = "  [overrides your flag]" if c.overrode_user else ""
            lines.append(f"    {c.old!r} -> {c.new!r}  by {c.rule}: {c.reason}{flag}")
    return "\n".join(lines)
