"""How one server field is described: type, default, help, choices, CLI spelling."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# Value kinds a field can hold.
KINDS = (
    "str",  # a string
    "int",  # an integer; "16k"/"1M" suffixes accepted where SGLang accepts them
    "float",  # a float
    "bool",  # a store_true flag: present means True
    "tristate",  # --x / --no-x; None when neither is given
    "json",  # a JSON value given as a string on the command line
    "list_str",  # one or more strings (nargs)
    "list_int",
    "list_float",
    "json_list",  # a JSON list given as one string
    "object",  # not settable from the CLI (callables, internal objects)
)


@dataclass(frozen=True)
class Deprecated:
    """A deprecated flag that still sets ``field``.

    ``const`` is the value stored for a flag that takes no argument
    (``store_true``-like), or ``None`` when the flag takes a value.
    ``check_choices``: a value-taking flag accepts only the field's choices
    (false where SGLang's deprecated spelling declares none).
    """

    flag: str
    const: Any = None
    takes_value: bool = True
    check_choices: bool = True


@dataclass(frozen=True)
class FieldSpec:
    """One user-settable server field.

    Attributes:
        name: the field name (``tp_size``); its flag is ``--tp-size``.
        kind: one of :data:`KINDS`.
        default: SGLang's default (``None`` means "decided by resolution").
        help: one line for ``--help``.
        choices: allowed values, or ``None`` for any.
        aliases: more flag spellings (``--tp``, ``--tensor-parallel-size``).
        nargs: argparse nargs for list kinds (``+``, ``*``) or ``?``.
        resolvable: resolution rules in the whitelisted phases may declare it.
        cli: whether the field has a command-line flag at all.
        deprecated: deprecated flags that still set this field.
        group: the flag group (``parallel``, ``exec``...), for help and docs.
    """

    name: str
    kind: str
    default: Any
    help: str
    choices: tuple | None = None
    aliases: tuple[str, ...] = ()
    nargs: str | None = None
    resolvable: bool = False
    cli: bool = True
    deprecated: tuple[Deprecated, ...] = ()
    group: str = ""

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def flags(self) -> tuple[str, ...]:
        return (self.flag, *self.aliases)


def F(name: str, kind: str, default: Any, help: str, **kw: Any) -> FieldSpec:
    """Short constructor used by the field tables."""
    if kind not in KINDS:
        raise ValueError(f"field {name}: unknown kind {kind!r}")
    if "choices" in kw and kw["choices"] is not None:
        kw["choices"] = tuple(kw["choices"])
    return FieldSpec(name, kind, default, help, **kw)
