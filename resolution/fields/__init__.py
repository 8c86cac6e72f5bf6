"""The table of every server field, grouped by topic (one module per group).

``FIELDS`` maps a field name to its :class:`FieldSpec`; ``DEFAULTS`` maps it to
its default; ``RESOLVABLE`` is the declaration whitelist of the model-override
and post-process phases.
"""

from __future__ import annotations

from types import MappingProxyType

from flotilla.resolution.fields import (
    disaggregation,
    graphs,
    kernels,
    mamba,
    model,
    moe,
    multimodal,
    observability,
    parallel,
    schedule,
    serving,
    speculative,
)
from flotilla.resolution.fields.spec import Deprecated, FieldSpec

_GROUPS = {
    "model": model,
    "parallel": parallel,
    "moe": moe,
    "kernels": kernels,
    "schedule": schedule,
    "graphs": graphs,
    "mamba": mamba,
    "speculative": speculative,
    "disaggregation": disaggregation,
    "multimodal": multimodal,
    "serving": serving,
    "observability": observability,
}


def _collect() -> dict[str, FieldSpec]:
    table: dict[str, FieldSpec] = {}
    for group, module in _GROUPS.items():
        for spec in module.FIELDS:
            if spec.name in table:
                raise RuntimeError(f"server field {spec.name} is defined twice")
            table[spec.name] = FieldSpec(**{**spec.__dict__, "group": group})
    return table


FIELDS: MappingProxyType[str, FieldSpec] = MappingProxyType(_collect())
DEFAULTS: MappingProxyType = MappingProxyType({n: s.default for n, s in FIELDS.items()})
RESOLVABLE: frozenset[str] = frozenset(n for n, s in FIELDS.items() if s.resolvable)
GROUPS: tuple[str, ...] = tuple(_GROUPS)

__all__ = ["FIELDS", "DEFAULTS", "RESOLVABLE", "GROUPS", "FieldSpec", "Deprecated"]
