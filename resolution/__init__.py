"""flotilla.resolution: resolve the whole server configuration once, as a pure
function of the user's flags, the model's config.json and the platform's facts.

This package imports no other project package, no torch and no ray.
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
