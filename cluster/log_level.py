"""``--log-level``: the level of flotilla's loggers, applied where each process starts.

SGLang's ``--log-level`` sets the server's loggers; flotilla runs in several processes (the
driver, the ingress and engine replicas, the worker ranks), so each applies the resolved
level to the ``flotilla`` logger tree when it starts. Ray's and Serve's own loggers keep
their levels (``RAY_LOG_LEVEL`` / Serve's logging config set those).
"""

from __future__ import annotations

import logging
from typing import Any

from flotilla.resolution.runtime_support import LOG_LEVELS


def apply_log_level(config: Any) -> None:
    """Set the ``flotilla`` loggers to ``config.log_level`` (one of :data:`LOG_LEVELS`, any
    case); a ValueError names a level outside them."""
    level = str(getattr(config, "log_level", None) or "info").lower()
    if level not in LOG_LEVELS:
        raise ValueError(f"log_level must be one of {', '.join(LOG_LEVELS)} (got log_level={level!r})")
    logging.getLogger("flotilla").setLevel(level.upper())
