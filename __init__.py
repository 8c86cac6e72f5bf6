"""flotilla: a Ray-native LLM serving cluster.

The subpackages are the repository's top-level folders:

- ``flotilla.resolution``: the pure configuration resolver (no torch, no ray).
- ``flotilla.kernels``: named kernel backends per op.
- ``flotilla.cluster``: what runs on the Ray actors.
- ``flotilla.serve``: the request side (Ray Serve, OpenAI API).
- ``flotilla.deploy``: the ``flotilla`` CLI and deployment recipes.

The offline API, ``from flotilla import LLM, SamplingParams``, is loaded on first
access (module ``__getattr__``): this root module stays free of heavy imports so
that ``flotilla resolve`` never imports torch and starts in well under a second.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# Public name -> module that defines it, imported on first access.
_LAZY_EXPORTS = {
    "LLM": "flotilla.cluster.engine.llm",
    "SamplingParams": "flotilla.cluster.engine.sampling_params",
    "RequestOutput": "flotilla.cluster.engine.outputs",
    "CompletionOutput": "flotilla.cluster.engine.outputs",
}

__all__ = ["__version__", *_LAZY_EXPORTS]

if TYPE_CHECKING:  # pragma: no cover - for type checkers and IDEs only
    from flotilla.cluster.engine.llm import LLM
    from flotilla.cluster.engine.outputs import CompletionOutput, RequestOutput
    from flotilla.cluster.engine.sampling_params import SamplingParams


def __getattr__(name: str) -> Any:
    module = _LAZY_EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'flotilla' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # NOTE: cache it, so __getattr__ runs once per name.
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY_EXPORTS))
