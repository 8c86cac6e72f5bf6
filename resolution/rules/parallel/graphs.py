"""The per-phase CUDA graph settings, as the parallel handlers use them.

``cuda_graph_config`` is the plain dict the normalise phase builds
(resolution/rules/normalise/cuda_graph.py owns its layout). The parallel
handlers only ask whether a phase is disabled, what a phase's settings are,
which settings the user pinned, and for a copy with one phase changed.
"""

from __future__ import annotations

from typing import Any

from flotilla.resolution.rules.normalise.cuda_graph import (
    DECODE,
    DISABLED,
    PREFILL,
    TC_PIECEWISE,
    is_locked,
    phase_backend,
    prefill_batch_sizes,
    with_phase,
)
from flotilla.resolution.rules.normalise.cuda_graph import decode_graph_disabled as decode_disabled
from flotilla.resolution.rules.normalise.cuda_graph import phase_settings as _config_phase
from flotilla.resolution.rules.normalise.cuda_graph import prefill_graph_disabled as prefill_disabled


def phase_settings(view: Any, phase: str) -> dict:
    """A plain copy of ``phase``'s settings (empty before the config is built)."""
    return _config_phase(getattr(view, "cuda_graph_config", None), phase)


__all__ = [
    "DECODE",
    "PREFILL",
    "DISABLED",
    "TC_PIECEWISE",
    "decode_disabled",
    "prefill_disabled",
    "phase_backend",
    "phase_settings",
    "is_locked",
    "with_phase",
    "prefill_batch_sizes",
]
