"""flotilla.resolution: the whole server configuration, resolved once, as a pure function
of the user's flags (``ServerArgs``), the model's config.json (``ModelFacts``) and the
platform's facts (``PlatformFacts``) -> a frozen ``ResolvedConfig`` with provenance.

Contract: no I/O beyond what the caller hands in, no environment reads, no device probes;
imports no other project package, no torch, no ray (a test enforces it). The rules are the
seeds' (SGLang's). ``runtime_support`` says what the runtime does with each resolved field
(honored, refused, noop) and checks a launch against it.
"""

from flotilla.resolution.args import ServerArgs
from flotilla.resolution.config import ResolvedConfig
from flotilla.resolution.errors import (
    ArgumentError,
    ModelConfigError,
    ResolutionError,
    RuleContractError,
    Violation,
)
from flotilla.resolution.model import ModelFacts
from flotilla.resolution.platform import PRESETS, PlatformFacts, preset
from flotilla.resolution.resolve import resolve

__all__ = [
    "ServerArgs",
    "ResolvedConfig",
    "ModelFacts",
    "PlatformFacts",
    "PRESETS",
    "preset",
    "resolve",
    "ArgumentError",
    "ModelConfigError",
    "ResolutionError",
    "RuleContractError",
    "Violation",
]
