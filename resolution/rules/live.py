"""A rule-local overlay for handlers that read back what they declared.

SGLang's handlers read the configuration through a live view, so a value a
handler declared a few lines earlier is what its next read answers. Our rules
receive a frozen :class:`~flotilla.resolution.engine.View`; a handler ported as
one rule keeps its own declarations in a :class:`Live` overlay and returns
:attr:`Live.out` at the end.
"""

from __future__ import annotations

from typing import Any

from flotilla.resolution.engine import Env


class Live:
    """The view overlaid with this rule's declarations so far.

    Attribute reads answer the latest declaration of this rule, else the view.
    ``declare(field=value)`` records a declaration and ``set_env(name, value)``
    an environment variable; :attr:`out` is the mapping the rule returns.
    """

    __slots__ = ("_view", "_fields", "_env")

    def __init__(self, view: Any):
        object.__setattr__(self, "_view", view)
        object.__setattr__(self, "_fields", {})
        object.__setattr__(self, "_env", {})

    def __getattr__(self, name: str) -> Any:
        fields = object.__getattribute__(self, "_fields")
        if name in fields:
            return fields[name]
        return getattr(object.__getattribute__(self, "_view"), name)

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("Live is read-only; use Live.declare(field=value)")

    def declare(self, **fields: Any) -> None:
        """Record declarations; a later declaration of a field wins."""
        self._fields.update(fields)

    def env(self, name: str) -> str | None:
        """Environment variable ``name`` as declared by this rule or an earlier one."""
        if name in self._env:
            return self._env[name]
        return self._view.env(name)

    def set_env(self, name: str, value: str) -> None:
        """Declare environment variable ``name`` (the string SGLang writes)."""
        self._env[name] = value

    def explicit(self, name: str) -> bool:
        """Whether the user set field ``name``."""
        return self._view.explicit(name)

    def default(self, name: str) -> Any:
        """The field's default value."""
        return self._view.default(name)

    @property
    def out(self) -> dict:
        """Everything declared, in the engine's mapping form."""
        result: dict = dict(self._fields)
        for name, value in self._env.items():
            result[Env(name)] = value
        return result
