"""What a benchmark result was measured on. :func:`write_result` is how every benchmark writes
its JSON: with a ``provenance`` (:func:`provenance`: git commit, date, command line, machine,
library versions). ``flotilla bench`` adds the device, the resolved configuration's key fields,
the kernel backends and the runner's start-up report."""

from __future__ import annotations

import dataclasses
import functools
import importlib
import json
import os
import platform
import shlex
import subprocess
import sys
from datetime import datetime, timezone
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any, Sequence

# Distribution names whose versions a result records (None when not installed).
_PACKAGES = {
    "torch": "torch",
    "ray": "ray",
    "transformers": "transformers",
    "flashinfer": "flashinfer-python",
    "triton": "triton",
    "nixl": "nixl",
    "deep_gemm": "sgl-deep-gemm",
}
# The checkout: the package root is the repository root.
_CHECKOUT = Path(__file__).resolve().parents[1]
# Modified tracked files a dirty result lists, at most.
_DIRTY_PATHS_SHOWN = 20


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


def _run(cmd: Sequence[str]) -> str | None:
    """The stdout of ``cmd``, or None when it cannot run or fails."""
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=10, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None


@functools.cache
def git_state(root: Path = _CHECKOUT) -> dict[str, Any]:
    """The commit the code ran from and whether tracked files differ from it (``dirty``, with up
    to 20 of their paths); None values outside a git checkout of flotilla (an installed wheel).

    NOTE: taken once a process, so a benchmark that rewrites a tracked result file as it goes
    does not find its own output dirty.

    A copy of the checkout (the device machines get the working tree, with a ``.git`` that can
    be older than it: seen on 2026-12-03, three commits behind and every later change "dirty")
    reads the state from the JSON file that ``$FLOTILLA_GIT_STATE`` names instead, written in the
    checkout just before the copy was made (``python -m flotilla.deploy.bench_env FILE``); such
    a state says so under ``from_file``. The file wins over the copy's own git when it is set."""
    saved = _git_state_from_file()
    if saved is not None:
        return saved
    top = _run(["git", "-C", str(root), "rev-parse", "--show-toplevel", "HEAD"])
    if top is None or Path(top.split()[0]).resolve() != root:
        return {"commit": None, "dirty": None, "dirty_paths": []}
    status = _run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"]) or ""
    paths = [line[3:] for line in status.splitlines() if line.strip()]
    return {"commit": top.split()[1], "dirty": bool(paths), "dirty_paths": paths[:_DIRTY_PATHS_SHOWN]}


GIT_STATE_ENV = "FLOTILLA_GIT_STATE"


def _git_state_from_file() -> dict[str, Any] | None:
    """The state saved in the file ``$FLOTILLA_GIT_STATE`` names; None when unset, unreadable or
    not a state (a commit of 40 hex digits)."""
    path = os.environ.get(GIT_STATE_ENV)
    if not path:
        return None
    try:
        saved = json.loads(Path(path).read_text())
        commit = saved["commit"]
    except (OSError, ValueError, TypeError, KeyError):
        return None
    if not (isinstance(commit, str) and len(commit) == 40 and all(c in "0123456789abcdef" for c in commit)):
        return None
    paths = [str(p) for p in saved.get("dirty_paths") or []]
    dirty = saved.get("dirty")
    return {"commit": commit, "dirty": bool(paths) if dirty is None else bool(dirty),
            "dirty_paths": paths[:_DIRTY_PATHS_SHOWN], "from_file": str(path)}  # fmt: skip


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith(("model name", "Model")):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _memory_limit_bytes() -> int | None:
    """The cgroup (v2) memory limit of this process's container, None when unlimited or unknown."""
    try:
        text = Path("/sys/fs/cgroup/memory.max").read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def _gpus() -> dict[str, Any] | None:
    """Name, count and driver of the CUDA devices; None without torch or CUDA."""
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    count = torch.cuda.device_count()
    driver = _run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"])
    getter = getattr(torch._C, "_cuda_getDriverVersion", None)  # e.g. 13000 for CUDA 13.0
    api = getter() if getter is not None else None
    return {
        "name": torch.cuda.get_device_name(0),
        "names": sorted({torch.cuda.get_device_name(i) for i in range(count)}),
        "count": count,
        "driver": driver.splitlines()[0].strip() if driver else None,
        "cuda_driver_api": f"{api // 1000}.{api % 1000 // 10}" if api else None,
        "cuda_runtime": torch.version.cuda,
    }


def machine() -> dict[str, Any]:
    """CPU model and cores, memory, OS, and the CUDA devices (``gpu``, None without CUDA)."""
    try:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        memory = None
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {
        "cpu_model": _cpu_model(),
        "cpu_cores": os.cpu_count(),
        "cpu_cores_usable": usable,
        "memory_bytes": memory,
        "memory_limit_bytes": _memory_limit_bytes(),
        "platform": platform.platform(),
        "gpu": _gpus(),
    }


def versions() -> dict[str, str | None]:
    """Python's and the installed libraries' versions (None: not installed), torch's CUDA."""
    found: dict[str, str | None] = {"python": platform.python_version()}
    found.update({name: _version(dist) for name, dist in _PACKAGES.items()})
    try:
        import torch

        found["torch_cuda"] = torch.version.cuda
    except ImportError:
        found["torch_cuda"] = None
    return found


def provenance() -> dict[str, Any]:
    """What a benchmark result needs to be traced and repeated: the git commit and dirty flag,
    the date it was written (UTC, ISO 8601), the exact command line and working directory, the
    machine and the library versions."""
    return {
        "git": git_state(),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": shlex.join(getattr(sys, "orig_argv", [sys.executable, *sys.argv])),
        "cwd": os.getcwd(),
        "machine": machine(),
        "versions": versions(),
    }


def write_result(path: str | os.PathLike, results: Any, *, sort_keys: bool = False) -> Path:
    """Write one benchmark result to ``path`` as JSON (parent folders created), its
    ``provenance`` first; a result that is not a mapping goes under ``results``. Returns the path."""
    if isinstance(results, dict):
        if "provenance" in results:
            raise ValueError("a benchmark result must not carry its own 'provenance' key; write_result adds it")
        payload = {"provenance": provenance(), **results}
    else:
        payload = {"provenance": provenance(), "results": results}
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(payload, indent=2, sort_keys=sort_keys, default=str) + "\n")
    return out


if __name__ == "__main__":  # python -m flotilla.deploy.bench_env FILE: this checkout's git state, for a copy of it
    if len(sys.argv) != 2:
        sys.exit("usage: python -m flotilla.deploy.bench_env FILE")
    os.environ.pop(GIT_STATE_ENV, None)
    state = git_state()
    if state["commit"] is None:
        sys.exit("bench_env: not run from a git checkout of flotilla")
    Path(sys.argv[1]).write_text(json.dumps(state, indent=2) + "\n")
