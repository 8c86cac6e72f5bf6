"""``PlatformFacts``: the only description of hardware that resolution rules see.

The facts come from ``flotilla.cluster.platform.probe()`` (run on a worker node)
or from a named preset, so a laptop can resolve for any target. The predicates
(``is_sm100``, ``is_hopper``...) mean exactly what the seeds' hardware probes
mean; each docstring says which probe it stands for.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from flotilla.resolution.errors import ArgumentError

DEVICE_KINDS = ("cuda", "hip", "npu", "xpu", "musa", "mps", "cpu")


@dataclass(frozen=True)
class PlatformFacts:
    """Facts about the accelerator the workers run on.

    Attributes:
        name: preset name, or a free label for probed/custom facts.
        device: one of ``cuda, hip, npu, xpu, musa, mps, cpu``.
        capability: compute capability ``(major, minor)``; ROCm reports its GCN
            version here (gfx942 is ``(9, 4)``), as torch does. ``None`` on CPU.
        device_name: the device's marketing name (``NVIDIA H100 80GB HBM3``).
        gcn_arch: the ROCm architecture name (``gfx942``), else ``None``.
        memory_mib: memory of one device in MiB.
        device_count: devices per node.
        cuda_version: CUDA runtime ``(major, minor)``, ``None`` off CUDA.
        driver_version: NVIDIA driver version, e.g. ``(580, 95, 5)``; ``(0,)`` unknown.
        mnnvl: the GPUs sit on a multi-node NVLink fabric (GB200/GB300 class).
        flashinfer: FlashInfer is installed and usable.
        triton_kernels: the ``triton_kernels`` package is installed.
        deep_gemm: DeepGEMM is installed.
        aiter: AMD's aiter library is installed.
        aiter_enabled: aiter kernels are switched on (SGLang's ``SGLANG_USE_AITER``).
        amx: the CPU has Intel AMX tiles and the AMX kernels are present.
        xmx: the Intel GPU has XMX engines.
    """

    name: str = "custom"
    device: str = "cpu"
    capability: tuple[int, int] | None = None
    device_name: str | None = None
    gcn_arch: str | None = None
    memory_mib: int | None = None
    device_count: int = 1
    cuda_version: tuple[int, int] | None = None
    driver_version: tuple[int, ...] = (0,)
    mnnvl: bool = False
    flashinfer: bool = False
    triton_kernels: bool = False
    deep_gemm: bool = False
    aiter: bool = False
    aiter_enabled: bool = False
    amx: bool = False
    xmx: bool = False

    def __post_init__(self) -> None:
        if self.device not in DEVICE_KINDS:
            raise ArgumentError(
                f"platform device {self.device!r} is not one of {', '.join(DEVICE_KINDS)}"
            )

    # -- predicates, named after the probes they replace ------------------------
    @property
    def is_cuda(self) -> bool:
        """NVIDIA CUDA device (``is_cuda()``)."""
        return self.device == "cuda"

    @property
    def is_hip(self) -> bool:
        """AMD ROCm device (``is_hip()``)."""
        return self.device == "hip"

    @property
    def is_cpu(self) -> bool:
        return self.device == "cpu"

    @property
    def is_npu(self) -> bool:
        return self.device == "npu"

    @property
    def is_xpu(self) -> bool:
        return self.device == "xpu"

    @property
    def is_musa(self) -> bool:
        return self.device == "musa"

    @property
    def is_mps(self) -> bool:
        return self.device == "mps"

    @property
    def has_torch_cuda(self) -> bool:
        """torch.cuda reports a device: CUDA and ROCm builds (and MUSA via torchada)."""
        return self.device in ("cuda", "hip", "musa")

    def _cuda_major_in(self, majors: tuple[int, ...], min_cuda: tuple[int, int]) -> bool:
        return (
            self.is_cuda
            and self.capability is not None
            and self.capability[0] in majors
            and (self.cuda_version or (0, 0)) >= min_cuda
        )

    @property
    def is_sm90(self) -> bool:
        """Hopper with CUDA >= 12.3 (``is_sm90_supported()``, ``is_hopper_with_cuda_12_3()``)."""
        return self._cuda_major_in((9,), (12, 3))

    @property
    def is_sm100(self) -> bool:
        """Datacenter Blackwell SM10x with CUDA >= 12.8 (``is_sm100_supported()``)."""
        return self._cuda_major_in((10,), (12, 8))

    @property
    def is_sm120(self) -> bool:
        """Workstation Blackwell SM12x with CUDA >= 12.8 (``is_sm120_supported()``)."""
        return self._cuda_major_in((12,), (12, 8))

    @property
    def is_blackwell(self) -> bool:
        """Any Blackwell SM10x/11x/12x with CUDA >= 12.8 (``is_blackwell_supported()``)."""
        return self._cuda_major_in((10, 11, 12), (12, 8))

    @property
    def is_sm100_or_sm110(self) -> bool:
        """SM100 or SM110 with CUDA >= 12.8 (``is_sm100_or_sm110_supported()``)."""
        return self._cuda_major_in((10, 11), (12, 8))

    @property
    def device_sm(self) -> int:
        """``major * 10 + minor`` where torch.cuda reports a device, else 0 (``get_device_sm()``)."""
        if self.has_torch_cuda and self.capability is not None:
            return self.capability[0] * 10 + self.capability[1]
        return 0

    @property
    def capability_major(self) -> int:
        """The major of ``torch.cuda.get_device_capability()`` (0 without a device)."""
        return self.capability[0] if self.has_torch_cuda and self.capability else 0

    @property
    def is_gfx95(self) -> bool:
        """AMD gfx95x, the MX-capable ROCm arch (``is_gfx95_supported()``)."""
        return self.is_hip and (self.gcn_arch or "").startswith("gfx95")

    @property
    def is_mnnvl_fabric(self) -> bool:
        """GPUs on a multi-node NVLink fabric (``is_mnnvl_fabric_device()``)."""
        return self.has_torch_cuda and self.mnnvl

    @property
    def flashinfer_available(self) -> bool:
        """FlashInfer importable on CUDA (``is_flashinfer_available()``)."""
        return self.flashinfer and self.is_cuda

    @property
    def torch_device(self) -> str:
        """The device string SGLang's ``get_device()`` returns for this platform."""
        return {"hip": "cuda", "musa": "musa"}.get(self.device, self.device)

    # -- serialisation ---------------------------------------------------------
    def to_json(self) -> dict[str, Any]:
        return {f.name: _jsonable(getattr(self, f.name)) for f in dataclasses.fields(self)}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> "PlatformFacts":
        known = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - set(known))
        if unknown:
            raise ArgumentError(
                f"unknown platform fact(s) {', '.join(unknown)}; known: {', '.join(known)}"
            )
        return cls(**{k: _coerce(k, v) for k, v in data.items()})

    def with_facts(self, **changes: Any) -> "PlatformFacts":
        return dataclasses.replace(self, **{k: _coerce(k, v) for k, v in changes.items()})


def _jsonable(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value


_TUPLE_FACTS = {"capability", "cuda_version", "driver_version"}
_BOOL_FACTS = {f.name for f in dataclasses.fields(PlatformFacts) if f.type == "bool"}


def _coerce(name: str, value: Any) -> Any:
    if name in _TUPLE_FACTS and value is not None:
        if isinstance(value, str):
            value = [int(p) for p in value.split(".") if p != ""]
        return tuple(int(v) for v in value)
    if name in _BOOL_FACTS and isinstance(value, str):
        return parse_bool(name, value)
    if name in ("memory_mib", "device_count") and isinstance(value, str):
        return int(value)
    return value


def parse_bool(name: str, text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise ArgumentError(f"platform fact {name} must be true or false, got {text!r}")


_CUDA = dict(
    device="cuda",
    device_count=8,
    cuda_version=(13, 0),
    driver_version=(580, 95, 5),
    flashinfer=True,
    deep_gemm=True,
)
_ROCM = dict(device="hip", device_count=8, aiter=True)

PRESETS: dict[str, PlatformFacts] = {
    "cpu": PlatformFacts(name="cpu", device="cpu"),
    "a100": PlatformFacts(
        name="a100", capability=(8, 0), device_name="NVIDIA A100-SXM4-80GB", memory_mib=81920, **_CUDA
    ),
    "h100": PlatformFacts(
        name="h100", capability=(9, 0), device_name="NVIDIA H100 80GB HBM3", memory_mib=81559, **_CUDA
    ),
    "h200": PlatformFacts(
        name="h200", capability=(9, 0), device_name="NVIDIA H200", memory_mib=143771, **_CUDA
    ),
    "b200": PlatformFacts(
        name="b200", capability=(10, 0), device_name="NVIDIA B200", memory_mib=183359, **_CUDA
    ),
    "b300": PlatformFacts(
        name="b300",
        capability=(10, 3),
        device_name="NVIDIA B300 SXM6 AC",
        memory_mib=275040,
        **_CUDA,
    ),
    "gb200": PlatformFacts(
        name="gb200",
        capability=(10, 0),
        device_name="NVIDIA GB200",
        memory_mib=189471,
        mnnvl=True,
        **{**_CUDA, "device_count": 4},
    ),
    "rtx-pro-6000": PlatformFacts(
        name="rtx-pro-6000",
        capability=(12, 0),
        device_name="NVIDIA RTX PRO 6000 Blackwell Server Edition",
        memory_mib=97887,
        **_CUDA,
    ),
    "mi300x": PlatformFacts(
        name="mi300x",
        capability=(9, 4),
        device_name="AMD Instinct MI300X",
        gcn_arch="gfx942",
        memory_mib=196592,
        **_ROCM,
    ),
    "mi355x": PlatformFacts(
        name="mi355x",
        capability=(9, 5),
        device_name="AMD Instinct MI355X",
        gcn_arch="gfx950",
        memory_mib=294896,
        **_ROCM,
    ),
}

# Short flip names accepted by --platform-set, mapped to fact names.
_FLIP_ALIASES = {"driver": "driver_version"}


def preset(name: str) -> PlatformFacts:
    """The named preset; the error lists the known names."""
    try:
        return PRESETS[name]
    except KeyError:
        raise ArgumentError(
            f"unknown platform {name!r}; choose from {', '.join(PRESETS)}"
        ) from None


def apply_flips(facts: PlatformFacts, flips: Mapping[str, str]) -> PlatformFacts:
    """Apply ``--platform-set KEY=VALUE`` flips (``flashinfer=false``, ``driver_version=595.0``)."""
    known = {f.name for f in dataclasses.fields(PlatformFacts)}
    changes: dict[str, Any] = {}
    for key, value in flips.items():
        name = _FLIP_ALIASES.get(key, key)
        if name not in known or name == "name":
            raise ArgumentError(
                f"unknown platform fact {key!r} in --platform-set; known: {', '.join(sorted(known - {'name'}))}"
            )
        changes[name] = value
    return facts.with_facts(**changes)


def load_platform_file(path: str | Path) -> PlatformFacts:
    """Facts from a JSON file: either every fact, or ``{"preset": NAME, ...flips}``."""
    try:
        data = json.loads(Path(path).read_text())
    except OSError as exc:
        raise ArgumentError(f"cannot read platform file {path}: {exc.strerror}") from None
    except json.JSONDecodeError as exc:
        raise ArgumentError(f"platform file {path} is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ArgumentError(f"platform file {path} must hold a JSON object")
    base = data.pop("preset", None)
    if base is not None:
        return apply_flips(preset(base), {k: v for k, v in data.items()})
    return PlatformFacts.from_json(data)
