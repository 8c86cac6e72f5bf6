"""The rule-local overlay for handlers that read back what they declared.

SGLang's parallelism handlers read a *live* view: a value declared a few lines
earlier is what the next read answers. The overlay (:class:`Live`) is the
normalise phase's; it is re-exported here so parallel rules share one
implementation.
"""

from __future__ import annotations

from flotilla.resolution.rules.normalise.live import Live


def env_flag(value: str | None) -> bool:
    """SGLang's ``EnvBool`` reading of a declared variable (unset is false)."""
    if value is None:
        return False
    return value.strip().lower() in ("1", "true", "yes", "y")


__all__ = ["Live", "env_flag"]
