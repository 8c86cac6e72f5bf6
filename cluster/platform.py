"""The one hardware probe: what this machine offers, as :class:`PlatformFacts`.

Resolution rules never probe hardware; they read the facts this module returns
(run on a node of the kind that will host the workers) or a named preset. Every
probe here is cheap, side-effect free and tolerant: a missing tool or library
means "not available", never an exception.
"""

from __future__ import annotations

import importlib.util
import re
import shutil
import subprocess

from flotilla.resolution.platform import PlatformFacts

# Seconds to wait for ``nvidia-smi`` before treating the driver version as unknown.
NVIDIA_SMI_TIMEOUT_S = 5.0


def probe() -> PlatformFacts:
    """Facts about the accelerator of this machine (CPU facts when there is none)."""
    import torch

    libraries = dict(
        flashinfer=_installed("flashinfer"),
        triton_kernels=_installed("triton_kernels"),
        deep_gemm=_installed("deep_gemm"),
    )
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        is_hip = getattr(torch.version, "hip", None) is not None
        gcn_arch = getattr(props, "gcnArchName", None) if is_hip else None
        return PlatformFacts(
            name="probed",
            device="hip" if is_hip else "cuda",
            capability=tuple(torch.cuda.get_device_capability(0)),
            device_name=torch.cuda.get_device_name(0),
            gcn_arch=gcn_arch.split(":")[0] if gcn_arch else None,
            memory_mib=int(props.total_memory // (1 << 20)),
            device_count=torch.cuda.device_count(),
            cuda_version=_version_pair(torch.version.cuda),
            driver_version=(0,) if is_hip else nvidia_driver_version(),
            aiter=is_hip and _installed("aiter"),
            **libraries,
        )
    return PlatformFacts(name="probed", device="cpu", amx=_cpu_has_amx(torch), **libraries)


def nvidia_driver_version() -> tuple[int, ...]:
    """The NVIDIA driver version from ``nvidia-smi`` (``(0,)`` when it cannot be read)."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return (0,)
    try:
        out = subprocess.run(
            [exe, "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=NVIDIA_SMI_TIMEOUT_S,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return (0,)
    match = re.match(r"\s*(\d+(?:\.\d+)*)", out)
    return tuple(int(p) for p in match.group(1).split(".")) if match else (0,)


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def _version_pair(text: str | None) -> tuple[int, int] | None:
    if not text:
        return None
    parts = [int(p) for p in re.findall(r"\d+", text)[:2]]
    return (parts[0], parts[1] if len(parts) > 1 else 0) if parts else None


def _cpu_has_amx(torch) -> bool:
    check = getattr(getattr(torch, "cpu", None), "_is_amx_tile_supported", None)
    if check is None:
        return False
    try:
        return bool(check())
    except Exception:  # NOTE: a private torch probe; any failure means "no AMX".
        return False


def probe_on_workers(on_gpu: bool | None = None, timeout_s: float = 60.0) -> PlatformFacts:
    """:func:`probe` run as a Ray task on a node of the kind the workers will use.

    The driver (a head node, a laptop submitting a job) may have no accelerator; the
    configuration must be resolved for the workers' hardware. The task asks for one GPU
    when ``on_gpu`` (default: whenever the connected cluster has GPUs), so it lands on a
    GPU node; otherwise on any node. Needs a connected Ray cluster (``ray.init``).

    Raises ValueError when ``on_gpu`` is asked for on a cluster without GPUs, and
    ``GetTimeoutError`` when no node runs the task within ``timeout_s``.
    """
    import ray

    if not ray.is_initialized():
        raise ValueError("probe_on_workers needs a connected Ray cluster: call ray.init(...) first, or use probe()")
    gpus = ray.cluster_resources().get("GPU", 0)
    if on_gpu is None:
        on_gpu = gpus > 0
    if on_gpu and gpus == 0:
        raise ValueError("on_gpu=True, but the connected Ray cluster has no GPUs; probe a CPU node with on_gpu=False")
    task = ray.remote(num_gpus=1 if on_gpu else 0, num_cpus=0 if on_gpu else 0.1, max_retries=0)(probe)
    return ray.get(task.remote(), timeout=timeout_s)


def probe_for_workers() -> PlatformFacts:
    """The platform to resolve for: :func:`probe_on_workers` when this process is connected
    to a Ray cluster, else :func:`probe` here (a local cluster started later runs on this machine)."""
    import sys

    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        return probe_on_workers()
    return probe()
