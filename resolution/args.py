"""``ServerArgs``: what the user asked for, parsed from SGLang-spelled flags.

Every field in :mod:`flotilla.resolution.fields` has a flag (``foo_bar`` is
``--foo-bar``) plus SGLang's aliases and deprecated spellings, so an SGLang
launch command can be pasted. ``ServerArgs`` remembers which fields the user
set explicitly: resolution rules may not silently overwrite those.
"""

from __future__ import annotations

import argparse
import difflib
import json
import re
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Sequence

from flotilla.resolution.errors import ArgumentError
from flotilla.resolution.fields import DEFAULTS, FIELDS, FieldSpec

_SI = {"k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}
_IEC = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}


def parse_int(text: str) -> int:
    """An integer, optionally with an SI (``32k``) or IEC (``4Ki``) suffix."""
    text = text.strip()
    match = re.fullmatch(r"(\d+(?:\.\d+)?)(Ki|Mi|Gi|Ti|k|M|G|T)", text)
    if match:
        number, suffix = match.groups()
        if suffix in _IEC:
            if "." in number:
                raise argparse.ArgumentTypeError(f"decimals are not allowed with {suffix!r}")
            return int(number) * _IEC[suffix]
        return int(float(number) * _SI[suffix])
    return int(text)


def _parse_json(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not valid JSON ({exc.msg}): {text!r}") from None


def _parse_str(text: str) -> Any:
    return text


_CONVERTERS = {
    "str": _parse_str,
    "int": parse_int,
    "float": float,
    "json": _parse_json,
    "json_list": _parse_json,
    "list_str": _parse_str,
    "list_int": parse_int,
    "list_float": float,
}


class _Parser(argparse.ArgumentParser):
    """argparse that raises :class:`ArgumentError` instead of exiting, and names
    the closest valid flag for an unknown one."""

    def error(self, message: str):  # noqa: D401 - argparse hook
        raise ArgumentError(message)


def add_server_flags(parser: argparse.ArgumentParser, fields: Iterable[FieldSpec]) -> None:
    """Add one flag (plus aliases and deprecated spellings) per field.

    Every flag defaults to ``argparse.SUPPRESS`` so the parsed namespace holds
    exactly the fields the user gave.
    """
    groups: dict[str, argparse._ArgumentGroup] = {}
    for spec in fields:
        group = groups.get(spec.group)
        if group is None:
            group = groups[spec.group] = parser.add_argument_group(f"{spec.group} flags")
        common = dict(dest=spec.name, default=argparse.SUPPRESS, help=spec.help)
        if spec.cli:
            if spec.kind == "bool":
                group.add_argument(*spec.flags, action="store_true", **common)
            elif spec.kind == "tristate":
                group.add_argument(*spec.flags, action=argparse.BooleanOptionalAction, **common)
            elif spec.kind == "object":
                pass
            else:
                kwargs: dict[str, Any] = dict(type=_CONVERTERS[spec.kind], **common)
                if spec.choices is not None:
                    kwargs["choices"] = spec.choices
                if spec.nargs is not None:
                    kwargs["nargs"] = spec.nargs
                flags = tuple(f for f in spec.flags if not f.startswith("--no-"))
                group.add_argument(*flags, **kwargs)
        # NOTE: a field with no flag of its own (cli=False) is set only by its deprecated
        # spellings: their help says what the field does instead of naming a missing flag.
        dep_help = f"deprecated: use {spec.flag}" if spec.cli else f"{spec.help} (deprecated spelling)"
        for dep in spec.deprecated:
            if dep.takes_value:
                extra: dict[str, Any] = {"nargs": spec.nargs} if spec.nargs else {}
                if dep.check_choices and spec.choices is not None:
                    extra["choices"] = spec.choices
                group.add_argument(
                    dep.flag,
                    dest=spec.name,
                    default=argparse.SUPPRESS,
                    type=_CONVERTERS.get(spec.kind, _parse_str),
                    help=dep_help,
                    **extra,
                )
            else:
                group.add_argument(
                    dep.flag,
                    dest=spec.name,
                    default=argparse.SUPPRESS,
                    action="store_const",
                    const=dep.const,
                    help=dep_help,
                )


def server_flag_names() -> list[str]:
    names: list[str] = []
    for spec in FIELDS.values():
        if spec.cli:
            names.extend(spec.flags)
        names.extend(d.flag for d in spec.deprecated)
    return names


def closest_flag(flag: str, candidates: Sequence[str]) -> str | None:
    """The valid flag most like ``flag`` (``--tp-szie`` -> ``--tp-size``)."""
    head = flag.split("=", 1)[0]
    match = difflib.get_close_matches(head, candidates, n=1, cutoff=0.5)
    return match[0] if match else None


def reject_unknown(unknown: Sequence[str], candidates: Sequence[str]) -> None:
    """Raise an :class:`ArgumentError` naming the first unknown flag and the closest one."""
    flags = [u for u in unknown if u.startswith("-")]
    if not flags and unknown:
        raise ArgumentError(f"unexpected argument {unknown[0]!r}")
    if flags:
        flag = flags[0].split("=", 1)[0]
        near = closest_flag(flag, candidates)
        hint = f"; did you mean {near}?" if near else ""
        raise ArgumentError(f"unrecognized flag {flag}{hint}")


@dataclass(frozen=True)
class ServerArgs:
    """The user's input: a value for every server field, and which were explicit.

    Attribute access reads a field (``args.tp_size``). Build it with
    :meth:`from_cli` (SGLang-spelled flags) or :meth:`create` (keyword values).
    """

    values: Mapping[str, Any]
    explicit: frozenset[str]

    def __getattr__(self, name: str) -> Any:
        try:
            return self.values[name]
        except KeyError:
            raise AttributeError(f"no server field named {name!r}") from None

    @classmethod
    def create(cls, **given: Any) -> "ServerArgs":
        """Server args with ``given`` fields set explicitly and the rest at defaults."""
        unknown = sorted(set(given) - set(FIELDS))
        if unknown:
            near = difflib.get_close_matches(unknown[0], list(FIELDS), n=1)
            hint = f"; did you mean {near[0]}?" if near else ""
            raise ArgumentError(f"unknown server field {unknown[0]!r}{hint}")
        for name, value in given.items():
            choices = FIELDS[name].choices
            if choices is not None and value is not None and value not in choices:
                raise ArgumentError(
                    f"invalid value for {name}: {value!r} (choose from {', '.join(map(str, choices))})"
                )
        return cls({**DEFAULTS, **given}, frozenset(given))

    @classmethod
    def from_namespace(cls, namespace: argparse.Namespace) -> "ServerArgs":
        given = {k: v for k, v in vars(namespace).items() if k in FIELDS}
        return cls({**DEFAULTS, **given}, frozenset(given))

    @classmethod
    def from_cli(cls, argv: Sequence[str]) -> "ServerArgs":
        """Parse SGLang-spelled server flags; raise :class:`ArgumentError` on bad input."""
        parser = _Parser(prog="flotilla", add_help=False)
        add_server_flags(parser, FIELDS.values())
        namespace, unknown = parser.parse_known_args(list(argv))
        reject_unknown(unknown, server_flag_names())
        return cls.from_namespace(namespace)
