"""Checkpoint quantization as SGLang 0.5.19's ``ModelConfig`` settles it.

Two steps, both pure:

* :func:`parse_quant_config` reads ``quantization_config`` (or
  ``compression_config``) from config.json and, for ModelOpt checkpoints, folds
  in the concrete method the ``quant_algo`` names. SGLang writes that result
  back into the config object its rules later read, so ``quant_method`` as the
  rules see it is ``modelopt_fp4`` rather than ``modelopt``.
* :func:`verify_quantization` combines that with ``--quantization`` and the
  platform: per-method checkpoint overrides (AWQ/GPTQ to their Marlin kernels,
  ``modelopt`` auto-detection, ...), the compatibility table, and the
  "unknown method" / ROCm checks, raising SGLang's messages.

Only config.json is consulted: resolution assumes the model directory holds
nothing else, so there is no ``hf_quant_config.json`` and no ModelSlim
description to find.
"""

from __future__ import annotations

from typing import Any, Mapping

from flotilla.resolution.errors import Violation

# ModelOpt algorithm names and the SGLang method each selects when the user asks
# for the generic "modelopt" (an exact allowlist: MXFP8 is not FP8).
MODELOPT_ALGO_METHODS = {
    "FP8": "modelopt_fp8",
    "MXFP8": "mxfp8",
    "FP4": "modelopt_fp4",
    "NVFP4": "modelopt_fp4",
    "NVFP4_AWQ": "modelopt_fp4",
    "W4A16_NVFP4": "modelopt_fp4",
}

# Methods that requantize an already-quantized checkpoint online.
REQUANTIZATION_METHODS = ("quark_mxfp4",)

# The registry of quantization methods, in registration order (the order the
# checkpoint-override probes run in and the order error messages list them).
_BASE_METHODS = (
    "fp8", "mxfp8", "blockwise_int8", "modelopt", "modelopt_fp8", "modelopt_fp4",
    "nvfp4_online", "modelopt_mixed", "w8a8_int8", "w8a8_fp8", "awq", "awq_marlin",
    "bitsandbytes", "gguf", "gptq", "gptq_marlin", "moe_wna16", "compressed-tensors",
    "w4afp8", "petit_nvfp4", "quark", "quark_mxfp4", "auto-round", "auto-round-int8",
    "modelslim", "quark_int4fp8_moe", "humming", "mxfp_w4a8",
)

ROCM_METHODS = frozenset({
    "awq", "gptq", "fp8", "compressed_tensors", "compressed-tensors", "w8a8_fp8",
    "petit_nvfp4", "quark", "mxfp4", "mxfp8", "auto-round", "auto-round-int8",
    "quark_int4fp8_moe", "quark_mxfp4",
})

# --quantization value -> checkpoint methods it may serve without a mismatch error.
_COMPATIBLE = {
    "modelopt_fp8": ("modelopt",),
    "modelopt_fp4": ("modelopt", "fp8"),
    "modelopt_mixed": ("modelopt",),
    "nvfp4_online": ("fp8", "modelopt_fp8"),
    "petit_nvfp4": ("modelopt",),
    "w8a8_int8": ("compressed-tensors", "compressed_tensors"),
    "w8a8_fp8": ("compressed-tensors", "compressed_tensors"),
    "auto-round-int8": ("compressed-tensors", "compressed_tensors"),
}

_MARLIN_GROUP_SIZES = (-1, 32, 64, 128)


def modelopt_method(section: Mapping[str, Any]) -> str | None:
    """The ``quant_method`` SGLang rewrites a ModelOpt quantization section to
    (from its ``quant_algo``), or ``None``."""
    algo = section.get("quant_algo")
    if algo == "MIXED_PRECISION":
        layers = section.get("quantized_layers") or {}
        nvfp4_layers = any(
            str(info.get("quant_algo", "")).upper() in ("NVFP4", "W4A16_NVFP4")
            for info in layers.values()
            if isinstance(info, Mapping)
        )
        return "modelopt_mixed" if nvfp4_layers else "w4afp8"
    if algo and ("FP4" in algo or "NVFP4" in algo):
        return "modelopt_fp4"
    if algo == "FP8":
        return "modelopt_fp8"
    if algo == "MXFP8":
        return "mxfp8"
    return None


def _parse_modelopt(section: Mapping[str, Any]) -> dict[str, Any] | None:
    """The concrete method a ModelOpt quantization section names, or ``None``."""
    method = modelopt_method(section)
    if method is None:
        return None
    parsed: dict[str, Any] = {"quant_method": method, "quant_algo": section.get("quant_algo")}
    if method == "mxfp8":
        parsed.update(
            activation_scheme="dynamic",
            weight_block_size=[1, section.get("group_size", 32)],
            scale_fmt="ue8m0",
        )
        ignored = section.get("exclude_modules", section.get("ignore"))
        if ignored is not None:
            parsed["modules_to_not_convert"] = ignored
        kv_algo = section.get("kv_cache_quant_algo")
        scheme = section.get("kv_cache_scheme")
        if kv_algo is None and isinstance(scheme, Mapping) and scheme.get("type") == "float" and scheme.get("num_bits") == 8:
            kv_algo = "FP8"
        if kv_algo is not None:
            parsed["kv_cache_quant_algo"] = kv_algo
    return parsed


def parse_quant_config(cfg: Mapping[str, Any]) -> dict[str, Any] | None:
    """The checkpoint's quantization config as SGLang holds it after loading.

    ``quantization_config`` with no ``quant_method`` (or ``modelopt``) gets the
    method its ``quant_algo`` implies merged in; without one, the
    compressed-tensors ``compression_config`` is used. ``None`` when the
    checkpoint is not quantized.
    """
    qc = cfg.get("quantization_config")
    if isinstance(qc, Mapping):
        parsed = dict(qc)
        if "quant_method" not in parsed or parsed["quant_method"] == "modelopt":
            parsed.update(_parse_modelopt(parsed) or {})
        return parsed
    if qc is not None:
        return None
    cc = cfg.get("compression_config")
    return dict(cc) if isinstance(cc, Mapping) else None


def registered_methods(device: str = "cuda", gcn_arch: str | None = None) -> list[str]:
    """Quantization methods SGLang registers on ``device`` (registration order)."""
    methods = list(_BASE_METHODS)
    if device in ("cpu", "cuda") or (device == "hip" and (gcn_arch or "").startswith("gfx95")):
        methods.append("mxfp4")
    if device == "mps":
        methods += ["mlx_q4", "mlx_q8"]
    return methods


def _capability_number(capability: tuple[int, int] | None) -> int:
    if not capability:
        return -1
    return capability[0] * 10 + capability[1]


def _awq_marlin_ok(qc: Mapping[str, Any], device: str, capability: int) -> bool:
    bits, group, zero_point = qc.get("bits"), qc.get("group_size"), qc.get("zero_point")
    if device != "cuda" or str(qc.get("quant_method", "")).lower() != "awq":
        return False
    if bits is None or group is None or zero_point is None or bits not in (4, 8):
        return False
    # Marlin with runtime zero points serves uint4 only; without, no AWQ type.
    return capability >= 80 and bool(zero_point) and bits == 4 and group in _MARLIN_GROUP_SIZES


def _gptq_marlin_ok(qc: Mapping[str, Any], capability: int) -> bool:
    bits, group, sym, desc_act = (qc.get(k) for k in ("bits", "group_size", "sym", "desc_act"))
    if str(qc.get("quant_method", "")).lower() != "gptq":
        return False
    if bits is None or group is None or sym is None or desc_act is None:
        return False
    if (bits, sym) not in ((4, True), (8, True)):
        return False
    return capability >= 80 and group in _MARLIN_GROUP_SIZES


def _moe_wna16_ok(qc: Mapping[str, Any], capability: int) -> bool:
    method = str(qc.get("quant_method", "")).lower()
    bits = qc.get("bits")
    if method == "gptq":
        return not qc.get("desc_act") and bits in (4, 8)
    return method == "awq" and bits == 4 and capability >= 75


def _modelopt_override(qc: Mapping[str, Any], requested: str | None) -> str | None:
    if requested == "nvfp4_online" or requested in REQUANTIZATION_METHODS:
        return None
    if requested == "modelopt":
        found = MODELOPT_ALGO_METHODS.get(str(qc.get("quant_algo") or "").upper())
        if found is not None:
            return found
    if qc.get("quant_method", "") in ("modelopt_fp8", "modelopt_fp4"):
        return qc["quant_method"]
    return None


def _checkpoint_override(
    qc: Mapping[str, Any], requested: str | None, device: str, capability: int, marlin: bool
) -> str | None:
    """The first registered method that claims this checkpoint (registry order)."""
    found = _modelopt_override(qc, requested)
    if found:
        return found
    if qc.get("quant_method", "") == "modelopt_mixed":
        return "modelopt_mixed"
    if marlin and requested in (None, "marlin", "awq_marlin") and _awq_marlin_ok(qc, device, capability):
        return "awq_marlin"
    marlin_format = qc.get("checkpoint_format") == "marlin" or qc.get("is_marlin_format", False)
    if marlin and not marlin_format and requested in (None, "marlin", "gptq_marlin") and _gptq_marlin_ok(qc, capability):
        return "gptq_marlin"
    if requested == "moe_wna16" and _moe_wna16_ok(qc, capability):
        return "moe_wna16"
    if device == "hip" and str(qc.get("quant_method", "")).lower() == "modelopt":
        return "petit_nvfp4"
    if requested == "humming" and qc.get("quant_method") != "mxfp4":
        return "humming"
    if device == "mps" and requested is None and "quant_method" not in qc:
        bits, group = qc.get("bits"), qc.get("group_size")
        if isinstance(bits, int) and isinstance(group, int) and bits in (4, 8):
            return f"mlx_q{bits}"
    return None


def verify_quantization(
    quant_config: Mapping[str, Any] | None,
    requested: str | None,
    *,
    device: str = "cuda",
    capability: tuple[int, int] | None = (9, 0),
    gcn_arch: str | None = None,
    is_draft: bool = False,
    marlin_kernels: bool = False,
) -> str | None:
    """The quantization SGLang's ``ModelConfig`` ends with (``ModelConfig.quantization``).

    ``quant_config`` is :func:`parse_quant_config`'s result, ``requested`` the
    ``--quantization`` value. Raises :class:`Violation` (``ValueError``) with
    SGLang's message for a mismatch with the checkpoint, an unknown method, or a
    method ROCm does not support.
    """
    quantization = requested.lower() if requested is not None else None
    cap = _capability_number(capability) if device in ("cuda", "hip") else -1
    if quant_config is not None:
        method = str(quant_config.get("quant_method", quantization or "")).lower()
        keep_online_draft = (
            is_draft and quantization == "nvfp4_online" and method in ("modelopt_fp4", "modelopt_mixed")
        )
        if quantization not in REQUANTIZATION_METHODS and not keep_online_draft:
            found = _checkpoint_override(quant_config, quantization, device, cap, marlin_kernels)
            if found:
                method = quantization = found
        if quantization is None:
            quantization = method
        elif quantization != method:
            compatible = keep_online_draft or method in _COMPATIBLE.get(quantization, ())
            if compatible or quantization in REQUANTIZATION_METHODS:
                pass
            elif is_draft:
                quantization = method
            else:
                raise Violation(
                    "Quantization method specified in the model config "
                    f"({method}) does not match the quantization "
                    f"method specified in the `quantization` argument "
                    f"({quantization}).",
                    kind="ValueError",
                )
    if quantization is not None:
        supported = registered_methods(device, gcn_arch)
        if quantization not in supported:
            raise Violation(
                f"Unknown quantization method: {quantization}. Must be one of {supported}.",
                kind="ValueError",
            )
        if device == "hip" and quantization not in ROCM_METHODS:
            raise Violation(f"{quantization} quantization is currently not supported in ROCm.", kind="ValueError")
    return quantization


def checkpoint_quantization(quant_config: Mapping[str, Any] | None) -> str | None:
    """``ModelConfig.quantization`` with no ``--quantization`` on a CUDA SM90 GPU,
    or ``None`` when SGLang would reject the checkpoint's method outright."""
    try:
        return verify_quantization(quant_config, None)
    except Violation:
        return None


def nvfp4_moe_meta(cfg: Mapping[str, Any]) -> dict[str, Any] | None:
    """The NVFP4 MoE side-config of a hybrid FP8+NVFP4 checkpoint, or ``None``."""
    qc = cfg.get("quantization_config")
    if not isinstance(qc, Mapping):
        return None
    if (
        str(qc.get("quant_algo", "")).upper() == "MIXED_PRECISION"
        and str(qc.get("moe_quant_algo", "")).upper() == "NVFP4"
        and qc.get("group_size") is not None
    ):
        return {"group_size": int(qc["group_size"]), "exclude_modules": list(qc.get("ignore") or [])}
    return None
