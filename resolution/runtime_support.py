"""What flotilla's runtime does with each server field: the runtime-support table.

Resolution reproduces SGLang's rules for all of :data:`~flotilla.resolution.fields.FIELDS`;
this table says, per field, what the runtime then does with the result:

- ``honored``: the runtime acts on it. ``values``, when given, are the values it acts on;
  any other value a user sets is refused like a refused field.
- ``refused``: not built here. A user value other than the field's default (or than one of
  ``values``: settings that ask for what the runtime does anyway) stops ``flotilla serve``,
  ``serve run ...:build`` and ``LLM(...)`` before anything starts, with one line per flag
  naming it, the value and what to do instead.
- ``noop``: accepted and documented as without effect here, for the few flags whose refusal
  would only break pasted commands (each with its reason); ``flotilla serve`` prints one
  notice line listing those a user set.

Every field has exactly one entry, in :mod:`flotilla.resolution.runtime_support_table`;
``tests/resolution/test_runtime_support.py`` fails on an unclassified field, on an honored
field without a test that shows its effect, and on a refused field the runtime reads outside
:data:`GUARDED`. A change that builds a feature flips its fields to ``honored`` there, in the
same commit (see docs/resolution.md). This module checks launches against the table and
prints it.

Pure data and pure checks: no torch, no ray, no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from flotilla.resolution.errors import ArgumentError
from flotilla.resolution.fields import DEFAULTS, FIELDS
from flotilla.resolution.runtime_support_table import (
    GUARDED,
    HONORED,
    LOG_LEVELS,
    NOOP,
    REFUSED,
    STATUSES,
    SUPPORT,
    Support,
    normal_value,
)

__all__ = [
    "GUARDED", "HONORED", "LOG_LEVELS", "NOOP", "REFUSED", "STATUSES", "SUPPORT", "Support", "Refusal",
    "UnsupportedSettingsError", "flag_text", "refusals", "check_runtime_support", "noop_settings", "noop_notice",
    "support_json", "support_table", "counts",
]  # fmt: skip


# -- checking a launch ----------------------------------------------------------------------


@dataclass(frozen=True)
class Refusal:
    """One user setting the runtime cannot act on."""

    field: str
    value: Any
    reason: str

    @property
    def line(self) -> str:
        """``--flag value is not supported by flotilla's runtime: reason``."""
        return f"{flag_text(self.field, self.value)} is not supported by flotilla's runtime: {self.reason}"


class UnsupportedSettingsError(ArgumentError):
    """Settings the runtime would not act on; ``str()`` is one line per refused flag."""

    def __init__(self, refusals: tuple[Refusal, ...]):
        self.refusals = tuple(refusals)
        super().__init__("\n".join(r.line for r in self.refusals))

    def __reduce__(self):
        return (UnsupportedSettingsError, (self.refusals,))


def flag_text(name: str, value: Any) -> str:
    """How a user spelled ``name=value`` on the command line (``--tp-size 2``,
    ``--enable-torch-compile``, ``--no-dllm-fdfo``)."""
    spec = FIELDS[name]
    if not spec.cli and not spec.deprecated:
        return f"{name}={value!r}"  # NOTE: no flag sets it; LLM(...) and build() take it by name
    flag = spec.flag if spec.cli else spec.deprecated[0].flag
    if spec.kind == "bool" or (spec.kind == "tristate" and value is True):
        return flag if value else f"{flag} false"
    if spec.kind == "tristate" and value is False:
        return "--no-" + flag[2:]
    if isinstance(value, (list, tuple)):
        return " ".join([flag, *(str(v) for v in value)])
    return f"{flag} {value}"


def _is_default(name: str, value: Any) -> bool:
    return normal_value(value) == normal_value(DEFAULTS[name])


def refusals(given: Mapping[str, Any], model: Any = None) -> tuple[Refusal, ...]:
    """The settings in ``given`` (server fields the user set, by name) that the runtime
    would not act on, in field order. A value equal to the field's default is never refused.
    ``model``: the model's :class:`~flotilla.resolution.model.ModelFacts` when known."""
    found = []
    for name in FIELDS:
        if name not in given or _is_default(name, given[name]):
            continue
        reason = SUPPORT[name].reason_to_refuse(given[name], given, model)
        if reason is not None:
            found.append(Refusal(name, given[name], reason))
    return tuple(found)


def check_runtime_support(given: Mapping[str, Any], model: Any = None) -> None:
    """Raise :class:`UnsupportedSettingsError` (an :class:`ArgumentError`) listing every
    setting in ``given`` the runtime would not act on; see :func:`refusals`."""
    found = refusals(given, model)
    if found:
        raise UnsupportedSettingsError(found)


def noop_settings(given: Mapping[str, Any]) -> tuple[str, ...]:
    """The flags in ``given`` set to a non-default value that have no effect here."""
    return tuple(
        flag_text(name, given[name])
        for name in FIELDS
        if name in given and SUPPORT[name].status == NOOP and not _is_default(name, given[name])
    )


def noop_notice(given: Mapping[str, Any]) -> str | None:
    """The one notice line ``flotilla serve`` prints for no-op flags, or None."""
    flags = noop_settings(given)
    if not flags:
        return None
    return f"note: these flags have no effect in flotilla (see `flotilla resolve --runtime-support`): {', '.join(flags)}"


def support_json() -> dict[str, Any]:
    """``flotilla resolve --runtime-support --format json``."""
    fields = {}
    for name, support in SUPPORT.items():
        entry: dict[str, Any] = {"status": support.status, "note": support.note}
        if support.values is not None:
            entry["values"] = [v for v in support.values]
        fields[name] = entry
    return {"fields": fields}


def support_table() -> str:
    """The table as Markdown (``flotilla resolve --runtime-support``; docs/configuration.md
    holds the same text): one row per field, grouped as the flags are."""
    lines = []
    for group in dict.fromkeys(spec.group for spec in FIELDS.values()):
        lines += [f"### {group}", "", "| flag | status | what the runtime does |", "|---|---|---|"]
        for name, spec in FIELDS.items():
            if spec.group != group:
                continue
            support = SUPPORT[name]
            note = support.note
            if support.values is not None:
                shown = ", ".join("(unset)" if v is None else repr(v) if v == "" else str(v) for v in support.values)
                note += f" (values: {shown})" if support.status == HONORED else f" (accepted: {shown})"
            flag = spec.flag if spec.cli else f"{name} (no flag)"
            lines.append(f"| `{flag}` | {support.status} | {note.replace('|', '/')} |")
        lines.append("")
    return "\n".join(lines).rstrip() + "\n"


def counts() -> dict[str, int]:
    """How many fields have each status."""
    return {status: sum(1 for s in SUPPORT.values() if s.status == status) for status in STATUSES}
