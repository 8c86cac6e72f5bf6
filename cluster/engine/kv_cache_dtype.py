"""The KV cache's storage dtype, from the resolved ``kv_cache_dtype`` (SGLang's names), checked
once at start, before any weight loads.

=================  ==========================================================
kv_cache_dtype     what the cache stores
=================  ==========================================================
``auto``           the model's dtype (as before this setting was honoured)
``bfloat16``       bfloat16 (alias ``bf16``), whatever the model's dtype
``fp8_e4m3``       ``torch.float8_e4m3fn``: 3 mantissa bits, saturating at 448
``fp8_e5m2``       ``torch.float8_e5m2``: 2 mantissa bits, saturating at 57344
=================  ==========================================================

A float8 cache halves the bytes per token of a bf16 one, so the same memory holds twice the
tokens. K and V are stored with a per-tensor scale of 1.0 (as SGLang and vLLM do without
calibrated scales; see :mod:`flotilla.kernels.kv_dtype`): flotilla never reads KV scales.

Refused with a ``ValueError`` naming the parameter and its value (never a silent fallback):

- ``mxfp8``, ``nvfp4``, ``fp4_mx_block16``, ``fp4_e2m1`` (block-scaled formats flotilla has no
  kernels for) and any value not in the table;
- float8 for an MLA model (DeepSeek-V2/V3): its latent cache stays in the model's dtype;
- float8 with KV scales to load: ``quantization_param_path`` set, or a checkpoint whose
  ``quantization_config`` declares KV-cache quantization (``kv_cache_scheme``,
  ``kv_cache_quant_algo``, ``kv_cache_config``, ``kv_cache_group``): its scales would be
  silently replaced by 1.0.

Pure: reads the resolved config and the HF config dict it is handed, nothing else.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

# Resolved kv_cache_dtype -> the cache's torch dtype (None: the model's own).
_CACHE_DTYPES: dict[str, torch.dtype | None] = {
    "auto": None,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}
# quantization_config keys through which a checkpoint declares quantized KV caches (and so
# KV scales): compressed-tensors, ModelOpt, Quark and older FP8 exports.
_KV_SCALE_KEYS = ("kv_cache_scheme", "kv_cache_quant_algo", "kv_cache_config", "kv_cache_group")


def kv_cache_dtype_for(config: Any, model_dtype: torch.dtype, hf_config: Mapping[str, Any]) -> torch.dtype:
    """The dtype the KV cache is allocated in (see the module docstring).

    Args:
        config: the resolved configuration (``kv_cache_dtype``, ``quantization_param_path``;
            anything with those attributes).
        model_dtype: the model's activation dtype as loaded (``resolve_dtype``).
        hf_config: the model's config.json dict (MLA is ``kv_lora_rank > 0``; KV scales in
            ``quantization_config``).

    Raises ValueError naming ``kv_cache_dtype`` and its value for an unsupported value or
    model, and naming the scale source for KV scales flotilla would ignore.
    """
    name = str(getattr(config, "kv_cache_dtype", None) or "auto")
    if name not in _CACHE_DTYPES:
        raise ValueError(
            f"kv_cache_dtype={name!r} is not supported by flotilla's runtime: it stores the KV cache as "
            f"{', '.join(sorted(_CACHE_DTYPES))}; use --kv-cache-dtype auto (the model's dtype) or fp8_e4m3"
        )
    dtype = _CACHE_DTYPES[name] or model_dtype
    mla = int(hf_config.get("kv_lora_rank") or 0) > 0
    if mla and dtype != model_dtype:
        raise ValueError(
            f"kv_cache_dtype={name!r} is not supported for an MLA model ({_architecture(hf_config)}): flotilla keeps "
            f"the latent KV cache in the model's dtype ({_name(model_dtype)}); use --kv-cache-dtype auto"
        )
    if dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        _refuse_kv_scales(name, config, hf_config)
    return dtype


def _refuse_kv_scales(name: str, config: Any, hf_config: Mapping[str, Any]) -> None:
    """ValueError when KV scales are offered: flotilla's float8 cache uses a scale of 1.0."""
    path = getattr(config, "quantization_param_path", None)
    if path:
        raise ValueError(
            f"kv_cache_dtype={name!r} with quantization_param_path={path!r}: flotilla's FP8 KV cache stores K and V "
            "with a per-tensor scale of 1.0 and does not load KV scales; drop --quantization-param-path "
            "(accepting scale 1.0) or use --kv-cache-dtype auto"
        )
    for where, section in _quantization_sections(hf_config):
        found = [key for key in _KV_SCALE_KEYS if section.get(key)]
        if found:
            raise ValueError(
                f"kv_cache_dtype={name!r}: the checkpoint's config.json declares a quantized KV cache "
                f"({where}.{found[0]}={section[found[0]]!r}) whose scales flotilla would ignore (its FP8 KV cache uses a "
                "per-tensor scale of 1.0 and loads no checkpoint KV scales); use --kv-cache-dtype auto"
            )


def _quantization_sections(hf_config: Mapping[str, Any]) -> list[tuple[str, Mapping[str, Any]]]:
    """``quantization_config`` and its nested ``quantization`` block (ModelOpt's layout), as
    ``(path, dict)`` pairs."""
    top = hf_config.get("quantization_config")
    if not isinstance(top, Mapping):
        return []
    sections = [("quantization_config", top)]
    nested = top.get("quantization")
    if isinstance(nested, Mapping):
        sections.append(("quantization_config.quantization", nested))
    return sections


def _architecture(hf_config: Mapping[str, Any]) -> str:
    names = hf_config.get("architectures") or ["an MLA architecture"]
    return str(names[0])


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
