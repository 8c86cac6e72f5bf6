"""Derived model facts: the pure functions behind :class:`ModelFacts` attributes.

Each derivation follows what SGLang 0.5.19's ``ModelConfig`` concludes from the
same config.json, so rules written against the seeds see the same facts.
"""

from __future__ import annotations

from typing import Any, Mapping

_MODELOPT_ALGOS = {"NVFP4": "modelopt_fp4", "FP8": "modelopt_fp8", "MIXED_PRECISION": "modelopt_mixed"}


def _text(cfg: Mapping[str, Any]) -> Mapping[str, Any]:
    tc = cfg.get("text_config")
    return tc if isinstance(tc, Mapping) else cfg


def quant_method(cfg: Mapping[str, Any]) -> str | None:
    qc = cfg.get("quantization_config")
    return qc.get("quant_method") if isinstance(qc, Mapping) else None


def quantization(cfg: Mapping[str, Any]) -> str | None:
    qc = cfg.get("quantization_config")
    if not isinstance(qc, Mapping):
        qc = _text(cfg).get("quantization_config")
    if not isinstance(qc, Mapping):
        return None
    method = qc.get("quant_method")
    if method == "modelopt":
        return _MODELOPT_ALGOS.get(str(qc.get("quant_algo", "")).upper(), "modelopt")
    return method


def is_dsa(cfg: Mapping[str, Any]) -> bool:
    text = _text(cfg)
    return bool(cfg.get("architectures")) and "index_topk" in text


def derive(cfg: Mapping[str, Any]) -> dict[str, Any]:
    text = _text(cfg)
    arches = tuple(cfg.get("architectures") or ())
    return dict(
        architectures=arches,
        model_type=cfg.get("model_type"),
        is_mla=bool(text.get("kv_lora_rank")),
        is_dsa=is_dsa(cfg),
        quant_method=quant_method(cfg),
        quantization=quantization(cfg),
        context_len=text.get("max_position_embeddings"),
        index_topk_pattern=text.get("index_topk_pattern"),
    )
