"""Named kernel backends per op, looked up by name.

Every op has a ``torch`` backend that runs anywhere and is the oracle for tests;
CUDA backends (flashinfer, deep-gemm, Triton) register under their own names.
Resolution names the backend; :func:`get` fails with a clear message when the
named backend is not available on this machine.
"""

from __future__ import annotations

import importlib
from typing import Callable

_REGISTRY: dict[tuple[str, str], Callable] = {}

# Modules that register each backend, imported on first use (lazy: the torch
# reference costs nothing until an op is asked for, CUDA backends import their
# libraries only when selected).
_BACKEND_MODULES = {
    "torch": ("flotilla.kernels.torch_ops",),
    # NOTE: flashinfer_ops first: it sets flashinfer's environment before the library's first import.
    "flashinfer": (
        "flotilla.kernels.flashinfer_ops",
        "flotilla.kernels.flashinfer_attention",
        "flotilla.kernels.flashinfer_mla",
        "flotilla.kernels.flashinfer_planners",
    ),
    "triton": (
        "flotilla.kernels.triton_moe",
        "flotilla.kernels.triton_routing",
        "flotilla.kernels.triton_fp8",
        "flotilla.kernels.triton_gemv",
        "flotilla.kernels.triton_qkv",
    ),
    "deep_gemm": ("deep_gemm", "flotilla.kernels.fp8"),
}


def register(op: str, backend: str) -> Callable[[Callable], Callable]:
    """Register ``fn`` as ``backend``'s implementation of ``op``."""

    def wrap(fn: Callable) -> Callable:
        _REGISTRY[(op, backend)] = fn
        return fn

    return wrap


def get(op: str, backend: str = "torch") -> Callable:
    """The implementation of ``op`` for ``backend``; raises ValueError naming both
    when it is not available here."""
    key = (op, backend)
    if key not in _REGISTRY:
        for module in _BACKEND_MODULES.get(backend, ()):
            try:
                importlib.import_module(module)
            except ImportError as exc:
                raise ValueError(
                    f"kernel backend {backend!r} is not available on this machine ({exc}); "
                    f"choose another backend for op {op!r}"
                ) from None
    if key not in _REGISTRY:
        known = sorted(b for (o, b) in _REGISTRY if o == op)
        raise ValueError(f"no {backend!r} backend for kernel op {op!r} (available: {known or 'none'})")
    return _REGISTRY[key]


def backends(op: str) -> list[str]:
    """The backends registered so far for ``op``."""
    return sorted(b for (o, b) in _REGISTRY if o == op)
