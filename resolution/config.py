"""``ResolvedConfig``: the frozen result of resolution, handed to every actor."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any, Mapping

from flotilla.resolution.engine import Change
from flotilla.resolution.frozen import FrozenDict, freeze, thaw


@dataclass(frozen=True)
class ResolvedConfig:
    """The whole server configuration, resolved once by the driver.

    Attributes:
        config: every server field's final value (lists frozen as tuples,
            dicts as :class:`FrozenDict`).
        env: environment variables workers set at start.
        provenance: every change a rule made, in order.

    Field values read as attributes (``cfg.tp_size``). It is hashable, compares
    by value, and round-trips exactly through :meth:`to_json`/:meth:`from_json`.
    Nobody mutates it after resolution; facts learned at run time live in
    separate runtime objects.
    """

    config: FrozenDict
    env: FrozenDict
    provenance: tuple[Change, ...] = ()

    def __getattr__(self, name: str) -> Any:
        config = object.__getattribute__(self, "config")
        try:
            return config[name]
        except KeyError:
            raise AttributeError(f"no server field named {name!r}") from None

    @classmethod
    def build(cls, values: Mapping[str, Any], env: Mapping[str, str], provenance) -> "ResolvedConfig":
        changes = tuple(
            Change(c.field, freeze(c.old), freeze(c.new), c.rule, c.reason, c.overrode_user) for c in provenance
        )
        return cls(freeze(dict(values)), FrozenDict(dict(env)), changes)

    def to_dict(self) -> dict[str, Any]:
        """The ``flotilla resolve --format json`` object: config, env, provenance."""
        return {
            "config": thaw(self.config),
            "env": dict(self.env),
            "provenance": [thaw(c.to_json()) for c in self.provenance],
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "ResolvedConfig":
        data = json.loads(text)
        changes = tuple(
            Change(c["field"], freeze(c["old"]), freeze(c["new"]), c["rule"], c["reason"], c.get("overrode_user", False))
            for c in data["provenance"]
        )
        return cls(freeze(data["config"]), FrozenDict(data["env"]), changes)

    @property
    def digest(self) -> str:
        """A stable content hash (sha256 of the canonical JSON of config and env)."""
        canonical = json.dumps({"config": thaw(self.config), "env": dict(self.env)}, sort_keys=True)
        return hashlib.sha256(canonical.encode()).hexdigest()

    def __hash__(self) -> int:
        return hash((self.config, self.env))

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, ResolvedConfig)
            and self.config == other.config
            and self.env == other.env
            and self.provenance == other.provenance
        )
