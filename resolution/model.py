"""``ModelFacts``: what resolution needs to know about a model, parsed from its
HF ``config.json`` dict (a pure function: no file reads beyond the caller's, no
network, no transformers).

Rules read the raw config through :meth:`ModelFacts.get` / :meth:`ModelFacts.text`
and the derived facts (attention architecture, quantization, DSA layout...)
through attributes computed once in :meth:`ModelFacts.from_hf_config`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from flotilla.resolution.errors import ModelConfigError
from flotilla.resolution.frozen import FrozenDict, freeze


@dataclass(frozen=True)
class ModelFacts:
    """Facts about one model.

    Attributes:
        hf: the whole config.json, frozen.
        architectures: ``architectures`` from the config (possibly empty).
        model_type: ``model_type`` from the config.
        is_mla: attention is multi-head latent attention (DeepSeek V2/V3 family);
            SGLang's ``use_mla_backend()``.
        is_dsa: DeepSeek sparse attention (V3.2, GLM-5): an indexer config exists.
        quant_method: ``quantization_config.quant_method`` or ``None``
            (SGLang's ``get_quantization_config``).
        quantization: the quantization the checkpoint implies, normalised the way
            SGLang's ``ModelConfig.quantization`` is (``modelopt`` resolves by
            ``quant_algo`` to ``modelopt_fp4``/``modelopt_fp8``/``modelopt_mixed``).
        has_attention_sinks: attention uses learned sink logits (GPT-OSS).
        has_asymmetric_kv: K and V head dims differ (non-MLA models).
        is_hybrid_swa: sliding-window and full-attention layers are mixed.
        is_multimodal: the architecture takes image/audio/video inputs.
        multimodal_chunked_prefill: chunked prefill is supported for this
            multimodal model (always true for text-only models).
        context_len: the model's maximum context length.
        nvfp4_moe_meta: an NVFP4 MoE side-config is present (DeepSeek V4 NVFP4).
        uses_mamba_radix_cache: a hybrid linear-attention model whose registry
            spec routes prefix caching through the mamba radix cache.
        index_topk_pattern: the DSA top-k sharing pattern (``F``/``S`` per layer),
            derived from ``indexer_types`` when the config leaves it null.
    """

    hf: FrozenDict
    architectures: tuple[str, ...] = ()
    model_type: str | None = None
    is_mla: bool = False
    is_dsa: bool = False
    quant_method: str | None = None
    quantization: str | None = None
    has_attention_sinks: bool = False
    has_asymmetric_kv: bool = False
    is_hybrid_swa: bool = False
    is_multimodal: bool = False
    multimodal_chunked_prefill: bool = True
    context_len: int | None = None
    nvfp4_moe_meta: bool = False
    uses_mamba_radix_cache: bool = False
    index_topk_pattern: str | None = None

    @property
    def architecture(self) -> str:
        """The first architecture name, or ``""`` when the config names none."""
        return self.architectures[0] if self.architectures else ""

    def get(self, key: str, default: Any = None) -> Any:
        """A top-level config key (``getattr(hf_config, key, default)``)."""
        value = self.hf.get(key, default)
        return default if value is None and key not in self.hf else value

    def text(self, key: str, default: Any = None) -> Any:
        """A key of the language model's config (``text_config`` when nested)."""
        text_config = self.hf.get("text_config")
        if isinstance(text_config, Mapping) and key in text_config:
            return text_config[key]
        return self.hf.get(key, default)

    @property
    def quantization_config(self) -> FrozenDict | None:
        """``quantization_config`` (top level, else the text config's), or ``None``."""
        qc = self.hf.get("quantization_config")
        if qc is None:
            text_config = self.hf.get("text_config")
            if isinstance(text_config, Mapping):
                qc = text_config.get("quantization_config")
        return qc if isinstance(qc, Mapping) else None

    def num_kv_heads(self, tp_size: int) -> int:
        """KV heads held by one rank at tensor-parallel size ``tp_size``."""
        if self.is_mla:
            return 1
        total = self.text("num_key_value_heads") or self.text("num_attention_heads") or 1
        return max(1, total // tp_size)

    @classmethod
    def from_hf_config(cls, hf_config: Mapping[str, Any]) -> "ModelFacts":
        """Parse a config.json dict; raise :class:`ModelConfigError` when it is not one."""
        if not isinstance(hf_config, Mapping):
            raise ModelConfigError(f"config.json must hold a JSON object, got {type(hf_config).__name__}")
        from flotilla.resolution.model_derive import derive

        return cls(hf=freeze(hf_config), **derive(hf_config))

    @classmethod
    def from_path(cls, path: str | Path) -> "ModelFacts":
        """Read ``PATH/config.json`` (or the file ``PATH`` itself) and parse it."""
        path = Path(path)
        file = path / "config.json" if path.is_dir() else path
        try:
            text = file.read_text()
        except FileNotFoundError:
            raise ModelConfigError(f"{file}: no such file (expected a model directory holding config.json, or a config.json file)") from None
        except OSError as exc:
            raise ModelConfigError(f"{file}: cannot read ({exc.strerror})") from None
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ModelConfigError(f"{file}: not valid JSON ({exc.msg} at line {exc.lineno})") from None
        if not isinstance(data, dict):
            raise ModelConfigError(f"{file}: must hold a JSON object, got {type(data).__name__}")
        return cls.from_hf_config(data)
