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
from flotilla.resolution.frozen import FrozenDict


@dataclass(frozen=True)
class ModelFacts:
    """Facts about one model, as SGLang 0.5.19's ``ModelConfig`` sees them under
    default server flags (see :mod:`flotilla.resolution.model_derive`).

    Facts that SGLang also ties to a flag are given for the flag's default; the
    rules that read them combine the flag themselves (noted per attribute).

    Attributes:
        hf: the config as SGLang's rules read it: config.json, plus the
            transformers class defaults derivations depend on for keys it omits,
            with ``quantization_config`` as SGLang rewrites it (a ModelOpt
            ``quant_method`` replaced by the concrete method its ``quant_algo``
            names), frozen.
        architectures: ``architectures`` from the config (possibly empty).
        model_type: ``model_type`` from the config.
        is_mla: attention is multi-head latent attention (DeepSeek V2/V3 family);
            SGLang's ``use_mla_backend()``.
        has_asymmetric_kv: K and V rows differ in width (``head_dim !=
            v_head_dim`` or the SWA pair differs); true for DeepSeek MLA too.
        head_dim, v_head_dim, swa_head_dim, swa_v_head_dim: the K/V head widths
            ``ModelConfig`` derives (MLA architectures report 256 for head_dim).
        total_num_kv_heads: KV heads over all ranks (``get_total_num_kv_heads``;
            MLA models report their config's KV heads, not 1).
        num_hidden_layers: the language model's layer count.
        is_dsa: DeepSeek sparse attention (V3.2, GLM-5): a DSA-capable
            architecture with ``index_topk`` set (``is_deepseek_dsa``).
        index_topk: ``index_topk`` of a DSA model (``get_dsa_index_topk``), else ``None``.
        index_topk_pattern: the DSA top-k sharing pattern (``F``/``S`` per layer):
            the config's ``index_topk_pattern``, else derived from
            ``indexer_types`` (``full`` -> ``F``, ``shared`` -> ``S``), else ``None``.
        index_topk_freq: ``index_topk_freq`` (``1`` when unset or null).
        quant_method: ``quantization_config.quant_method`` as SGLang's rules read
            it (``get_quantization_config``; ``modelopt_fp4`` for a ModelOpt NVFP4
            checkpoint), ``None`` when the config has no ``quantization_config``.
        quant_config: the parsed checkpoint quantization config
            (``quantization_config``, else ``compression_config``), or ``None``.
            Feed it to :func:`flotilla.resolution.model_quant.verify_quantization`
            with ``--quantization`` and the platform.
        quantization: ``ModelConfig.quantization`` with no ``--quantization`` on a
            CUDA SM90 GPU (``modelopt`` resolves by ``quant_algo`` to
            ``modelopt_fp4``/``modelopt_fp8``/``modelopt_mixed``); ``None`` when
            unquantized or when SGLang rejects the method.
        nvfp4_moe_meta: the NVFP4 MoE side-config of a hybrid FP8+NVFP4 checkpoint
            (``{"group_size", "exclude_modules"}``), else ``None``.
        is_fp4_experts: routed experts are MXFP4 (the checkpoint says so, or a
            DeepSeek V4 checkpoint that does not say otherwise).
        has_attention_sinks: attention uses learned sink logits (GPT-OSS).
        is_hybrid_swa: sliding-window and full-attention layers are mixed
            (rules AND it with ``not disable_hybrid_swa_memory``).
        multimodal_default_enabled: what ``--enable-multimodal`` defaults to
            (false for Gemma3/Llama4/Step3-VL/Inkling and text-only MiMoV2).
        multimodal_capable: the model is multimodal when multimodal serving is on.
        is_multimodal: ``ModelConfig.is_multimodal`` under default flags
            (``multimodal_default_enabled and multimodal_capable``).
        multimodal_chunked_prefill_arch: no architecture forbids chunked prefill
            of multimodal inputs.
        multimodal_chunked_prefill: ``is_multimodal_chunked_prefill_supported``
            under default flags (also false while multimodal serving is off).
        multimodal_piecewise_graph_arch: a multimodal architecture cleared for
            prefill piecewise CUDA graphs.
        multimodal_breakable_graph_arch: a multimodal architecture cleared for
            prefill breakable CUDA graphs.
        piecewise_graph_disabled_arch: the architecture cannot use piecewise
            CUDA graphs.
        is_encoder_decoder: Whisper / Mllama / MossVL.
        is_generation: a generative architecture (before ``--is-embedding``).
        is_embedding_gemma: EmbeddingGemma (bidirectional Gemma3 text model).
        auto_enable_embedding: the architecture turns embedding mode on by itself.
        context_len: the model's derived maximum context length
            (``get_context_length``; ``--context-length`` overrides it).
        uses_mamba_radix_cache: a hybrid linear-attention model whose prefix
            caching runs through the mamba radix cache.
        hf_raw_dict: config.json exactly as given (frozen), the base that
            :meth:`with_overrides` re-derives from; ``None`` for facts built
            directly rather than by :meth:`from_hf_config`.
    """

    hf: FrozenDict
    architectures: tuple[str, ...] = ()
    model_type: str | None = None
    is_mla: bool = False
    has_asymmetric_kv: bool = False
    head_dim: int | None = None
    v_head_dim: int | None = None
    swa_head_dim: int | None = None
    swa_v_head_dim: int | None = None
    total_num_kv_heads: int = 1
    num_hidden_layers: int | None = None
    is_dsa: bool = False
    index_topk: int | None = None
    index_topk_pattern: str | None = None
    index_topk_freq: int = 1
    quant_method: str | None = None
    quant_config: FrozenDict | None = None
    quantization: str | None = None
    nvfp4_moe_meta: FrozenDict | None = None
    is_fp4_experts: bool = False
    has_attention_sinks: bool = False
    is_hybrid_swa: bool = False
    multimodal_default_enabled: bool = True
    multimodal_capable: bool = False
    is_multimodal: bool = False
    multimodal_chunked_prefill_arch: bool = True
    multimodal_chunked_prefill: bool = True
    multimodal_piecewise_graph_arch: bool = False
    multimodal_breakable_graph_arch: bool = False
    piecewise_graph_disabled_arch: bool = False
    is_encoder_decoder: bool = False
    is_generation: bool = True
    is_embedding_gemma: bool = False
    auto_enable_embedding: bool = False
    context_len: int | None = None
    uses_mamba_radix_cache: bool = False
    hf_raw_dict: FrozenDict | None = None

    @property
    def architecture(self) -> str:
        """The first architecture name, or ``""`` when the config names none."""
        return self.architectures[0] if self.architectures else ""

    def get(self, key: str, default: Any = None) -> Any:
        """A top-level config key (``getattr(hf_config, key, default)``)."""
        value = self.hf.get(key, default)
        return default if value is None and key not in self.hf else value

    def text(self, key: str, default: Any = None) -> Any:
        """A key of the language model's config (``text_config`` when nested;
        SGLang's ``get_hf_text_config`` choice), falling back to the top level."""
        from flotilla.resolution.model_derive import text_config

        sub = text_config(self.hf)
        if key in sub:
            return sub[key]
        return self.hf.get(key, default)

    @property
    def quantization_config(self) -> FrozenDict | None:
        """``quantization_config`` as SGLang's rules read it (top level), or ``None``."""
        qc = self.hf.get("quantization_config")
        return qc if isinstance(qc, Mapping) else None

    def num_kv_heads(self, tp_size: int, dcp_size: int = 1) -> int:
        """KV heads held by one rank (``get_num_kv_heads``): heads shard over
        ``tp_size // dcp_size`` groups, at least one per rank."""
        return max(1, self.total_num_kv_heads // max(1, tp_size // dcp_size))

    @classmethod
    def from_hf_config(cls, hf_config: Mapping[str, Any]) -> "ModelFacts":
        """Parse a config.json dict; raise :class:`ModelConfigError` when it is not one."""
        if not isinstance(hf_config, Mapping):
            raise ModelConfigError(f"config.json must hold a JSON object, got {type(hf_config).__name__}")
        from flotilla.resolution.model_derive import derive

        return cls(**derive(hf_config))

    def with_overrides(self, overrides: Mapping[str, Any]) -> "ModelFacts":
        """These facts re-derived with ``--json-model-override-args`` applied.

        SGLang applies the overrides to the config right after loading it, so
        every derived fact sees them (see :func:`~flotilla.resolution.model_derive.apply_overrides`).
        Returns ``self`` when there is nothing to apply or no raw config to apply it to.
        """
        if not overrides or self.hf_raw_dict is None:
            return self
        from flotilla.resolution.frozen import thaw
        from flotilla.resolution.model_derive import apply_overrides

        return type(self).from_hf_config(apply_overrides(thaw(self.hf_raw_dict), overrides))

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
