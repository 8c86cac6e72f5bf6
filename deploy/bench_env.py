"""What a ``flotilla bench`` result was measured on: the device, the library versions, the
resolved configuration's key fields, the kernel backends and the runner's start-up report."""

from __future__ import annotations

import dataclasses
import importlib
import os
import platform
from importlib.metadata import PackageNotFoundError, version
from typing import Any, Sequence

# Distribution names whose versions a result records (None when not installed).
_PACKAGES = {
    "torch": "torch",
    "transformers": "transformers",
    "flashinfer": "flashinfer-python",
    "triton": "triton",
    "deep_gemm": "sgl-deep-gemm",
}


def probe_device(requested: str | None) -> Any:
    """The torch device the engine will run on: ``--device`` when given, else CUDA when
    present, else the CPU (what resolution picks on a single machine)."""
    import torch

    if requested:
        return torch.device("cuda" if requested == "cuda" else requested)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _version(dist: str) -> str | None:
    try:
        return version(dist)
    except PackageNotFoundError:
        return None


def environment(device: Any) -> dict[str, Any]:
    """Device name and capability, library versions, CPU count and torch threads."""
    import torch

    env: dict[str, Any] = {name: _version(dist) for name, dist in _PACKAGES.items()}
    env.update(
        torch=torch.__version__,
        torch_cuda=torch.version.cuda,
        python=platform.python_version(),
        cpu_count=os.cpu_count(),
        torch_threads=torch.get_num_threads(),
        device=str(device),
    )
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env.update(
            device_name=props.name,
            device_capability=f"{props.major}.{props.minor}",
            device_memory_bytes=props.total_memory,
            device_count=torch.cuda.device_count(),
        )
    else:
        env["device_name"] = platform.processor() or platform.machine() or "cpu"
    return env


def _plain(value: Any) -> Any:
    """A JSON-friendly view of a report object (dataclass, mapping or anything printable)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {k: _plain(v) for k, v in dataclasses.asdict(value).items()}
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)


def kernel_backends(runner: Any, config: Any) -> Any:
    """The runner's resolved kernel backends (attention, elementwise, moe, sampling), from the
    runner when it keeps them, else from ``kernel_backends_for(config)``; None when neither exists."""
    for attr in ("kernel_backends", "backends"):
        value = getattr(runner, attr, None)
        if value is not None and not callable(value):
            return _plain(value)
    for module in ("flotilla.cluster.engine.kernel_backends", "flotilla.cluster.engine.model_runner"):
        try:
            chooser = getattr(importlib.import_module(module), "kernel_backends_for", None)
        except ImportError:
            continue
        if chooser is not None:
            try:
                return _plain(chooser(config))
            except Exception as exc:  # noqa: BLE001 - a report field, never a failure
                return {"error": f"{type(exc).__name__}: {exc}"}
    return None


def runner_startup_report(runner: Any) -> Any:
    """``runner.startup_report()`` (weights load, warm-up, graph capture times) when the runner
    has one, else None."""
    report = getattr(runner, "startup_report", None)
    if report is None:
        return None
    try:
        return _plain(report() if callable(report) else report)
    except Exception as exc:  # noqa: BLE001 - a report field, never a failure
        return {"error": f"{type(exc).__name__}: {exc}"}


def describe_engine(llm: Any, config_fields: Sequence[str]) -> dict[str, Any]:
    """The weights' dtype and element size (the first parameter's in this process; a worker group's
    from the resolved dtype or config.json), the resolved config's ``config_fields`` and digest,
    and the kernel backends."""
    import torch

    config = llm.config
    model = getattr(llm.engine.runner, "model", None)
    first = next(model.parameters(), None) if model is not None else None
    if first is not None:
        dtype = first.dtype
    else:
        name = config.dtype if config.dtype not in (None, "auto") else llm.source.config_dict.get("torch_dtype")
        dtype = getattr(torch, str(name or "float32"))
    return {
        "weight_dtype": str(dtype).removeprefix("torch."),
        "weight_element_size": torch.empty((), dtype=dtype).element_size(),
        "config": {**{name: _plain(getattr(config, name, None)) for name in config_fields}, "digest": config.digest},
        "kernel_backends": kernel_backends(llm.engine.runner, config),
    }
