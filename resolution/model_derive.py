"""Derived model facts: the pure functions behind :class:`ModelFacts` attributes.

Each derivation reaches the conclusion SGLang 0.5.19's ``ModelConfig`` reaches
from the same config.json (as transformers loads it), under default server
flags; where a fact also depends on a flag, the docstring says which, and the
rules combine the two.

transformers fills class defaults for keys a config omits. The few defaults
these derivations depend on are kept in ``model_tables.CLASS_DEFAULTS`` (per
``model_type``) and merged in first, so a minimal config dict behaves like the
loaded one.

not ported: dtype verification (a flag check outside resolution), draft-model
architecture remapping (the draft is not part of the facts), sub-configs stored
under ``thinker_config``/``llm_config`` beyond choosing the text config,
hf_quant_config.json / ModelSlim descriptions (only config.json is read).
"""

from __future__ import annotations

from typing import Any, Mapping

from flotilla.resolution.frozen import freeze
from flotilla.resolution.model_quant import checkpoint_quantization, nvfp4_moe_meta, parse_quant_config
from flotilla.resolution.model_tables import (
    CLASS_DEFAULTS,
    MLA_ARCHS,
    DEEPSEEK_V4_ARCHS,
    KIMI_LINEAR_ARCHS,
    DSA_ARCHS,
    MIMO_V2_ARCHS,
    SWA_SINK_ARCHS,
    HYBRID_SWA_ARCHS,
    MULTIMODAL_ARCHS,
    MULTIMODAL_OFF_BY_DEFAULT,
    NO_MM_CHUNKED_PREFILL,
    PIECEWISE_GRAPH_DISABLED,
    MM_PIECEWISE_GRAPH_OK,
    MM_BREAKABLE_GRAPH_OK,
    ENCODER_DECODER_ARCHS,
    NON_GENERATION_ARCHS,
    EMBEDDING_ARCHS,
    CLASSIFICATION_ARCHS,
    MAMBA_RADIX_CACHE_ARCHS,
)

_CONTEXT_KEYS = ("max_sequence_length", "seq_length", "max_seq_len", "model_max_length", "max_position_embeddings")
_INDEXER_TYPE_LETTERS = {"full": "F", "shared": "S"}


def with_class_defaults(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """``cfg`` with the transformers class defaults of its ``model_type`` filled
    in for keys it omits (only the keys in :data:`CLASS_DEFAULTS`, plus the
    layer count NemotronH derives from its block-type list)."""
    merged = dict(CLASS_DEFAULTS.get(str(cfg.get("model_type")), {}))
    merged.update(cfg)
    if merged.get("model_type") in _ROPE_HEAD_DIM_TYPES and merged.get("qk_rope_head_dim") is not None:
        # These config classes always point head_dim at the RoPE slice.
        merged["head_dim"] = merged["qk_rope_head_dim"]
    if "num_hidden_layers" not in merged:
        for key in ("layers_block_type", "hybrid_override_pattern"):
            if isinstance(merged.get(key), (list, str)):
                merged["num_hidden_layers"] = len(merged[key])
                break
    return merged


_ROPE_HEAD_DIM_TYPES = ("deepseek_v2", "deepseek_v3", "deepseek_v32", "kimi_k2", "glm_moe_dsa")
_GEMMA4_TYPES = ("gemma4", "gemma4_assistant", "gemma4_unified", "gemma4_unified_assistant")


def loaded_config(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """The config as SGLang's loader hands it to ``ModelConfig``.

    Class defaults are filled in, the text config's keys are mirrored onto the
    top level where it lacks them (so ``getattr(hf_config, key)`` finds them),
    and Gemma4's ``global_*`` attention attributes become the full-attention
    widths with the base ones moved to the ``swa_*`` keys.
    """
    loaded = with_class_defaults(cfg)
    for key in ("thinker_config", "llm_config", "language_config", "text_config"):
        if isinstance(loaded.get(key), Mapping):
            loaded[key] = with_class_defaults(loaded[key])
    text = text_config(loaded)
    if text is not loaded:
        for key, value in text.items():
            if key not in loaded and value is not None:
                loaded[key] = value
    if loaded.get("model_type") in _GEMMA4_TYPES and isinstance(loaded.get("text_config"), Mapping):
        sub = dict(loaded["text_config"])
        sub["swa_head_dim"] = sub["swa_v_head_dim"] = sub.get("head_dim")
        sub["swa_num_key_value_heads"] = sub.get("num_key_value_heads")
        if sub.get("global_head_dim") is not None:
            sub["head_dim"] = sub["global_head_dim"]
        if sub.get("num_global_key_value_heads") is not None:
            sub["num_key_value_heads"] = sub["num_global_key_value_heads"]
        sub.setdefault("v_head_dim", sub.get("head_dim"))
        loaded["text_config"] = sub
    return loaded


def text_config(cfg: Mapping[str, Any]) -> Mapping[str, Any]:
    """The language model's config (SGLang's ``get_hf_text_config``).

    A nested ``thinker_config`` (its ``text_config`` if any), ``llm_config``,
    ``language_config`` or ``text_config``, in that priority; the config itself
    for text-only models and the non-HF ``Llava*ForCausalLM`` layouts.
    """
    arches = cfg.get("architectures") or []
    if arches and str(arches[0]).startswith("Llava") and str(arches[0]).endswith("ForCausalLM"):
        return cfg
    thinker = cfg.get("thinker_config")
    if isinstance(thinker, Mapping):
        inner = thinker.get("text_config")
        return inner if isinstance(inner, Mapping) else thinker
    for key in ("llm_config", "language_config", "text_config"):
        sub = cfg.get(key)
        if isinstance(sub, Mapping):
            return sub
    return cfg


def context_length(text: Mapping[str, Any]) -> int:
    """The derived maximum context (SGLang's ``get_context_length``).

    The first context key present, scaled by the RoPE ``factor`` unless the
    RoPE parameters carry ``original_max_position_embeddings``. transformers
    gives every ``llama3``/``yarn``/``longrope`` parameter set that key, so
    those never scale; per-layer-type parameter sets have no top-level factor.
    """
    rope = text.get("rope_scaling") or text.get("rope_parameters")
    factor: Any = 1
    if isinstance(rope, Mapping) and rope:
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if "original_max_position_embeddings" not in rope and rope_type not in ("llama3", "yarn", "longrope"):
            factor = rope.get("factor", 1)
    for key in _CONTEXT_KEYS:
        value = text.get(key)
        if value is not None:
            return int(factor * value)
    return 2048


def attention_shapes(cfg: Mapping[str, Any], text: Mapping[str, Any]) -> dict[str, Any]:
    """``is_mla`` and the K/V head widths (SGLang's ``_derive_model_shapes``)."""
    arches = set(cfg.get("architectures") or ())
    heads = text.get("num_attention_heads") or 1
    head_dim = text.get("head_dim")
    if head_dim is None:
        head_dim = (text.get("hidden_size") or 0) // heads
    v_head_dim = text.get("v_head_dim") or head_dim
    swa_head_dim = text.get("swa_head_dim")
    swa_head_dim = head_dim if swa_head_dim is None else swa_head_dim
    swa_v_head_dim = text.get("swa_v_head_dim")
    swa_v_head_dim = swa_head_dim if swa_v_head_dim is None else swa_v_head_dim
    is_mla = False
    if arches & MLA_ARCHS or (
        "PixtralForConditionalGeneration" in arches and text.get("kv_lora_rank") is not None
    ):
        is_mla, head_dim = True, 256
    elif arches & set(DEEPSEEK_V4_ARCHS):
        head_dim = v_head_dim = cfg.get("head_dim")
    elif "Glm4MoeForCausalLMNextN" in arches:
        v_head_dim, swa_v_head_dim = head_dim, swa_head_dim
    elif "MiniCPM3ForCausalLM" in arches:
        is_mla, head_dim = True, 128
    elif "DeepseekVL2ForCausalLM" in arches and text.get("use_mla", True):
        is_mla, head_dim = True, 256
    elif "KimiVLForConditionalGeneration" in arches:
        is_mla, head_dim = True, 256
    elif arches & set(KIMI_LINEAR_ARCHS):
        is_mla, head_dim = True, 72
    elif arches & {"BailingMoeV2_5ForCausalLM", "BailingMoeForCausalLMNextN"}:
        is_mla, v_head_dim = True, cfg.get("v_head_dim")
    elif "BailingMoeV3ForCausalLM" in arches:
        is_mla, head_dim, v_head_dim = True, 128, cfg.get("v_head_dim")
    elif "SarvamMLAForCausalLM" in arches:
        is_mla = True
        head_dim = (cfg.get("qk_nope_head_dim") or 0) + (cfg.get("qk_rope_head_dim") or 0)
        v_head_dim = cfg.get("v_head_dim")
    return dict(
        is_mla=is_mla,
        has_asymmetric_kv=head_dim != v_head_dim or swa_head_dim != swa_v_head_dim,
        head_dim=head_dim,
        v_head_dim=v_head_dim,
        swa_head_dim=swa_head_dim,
        swa_v_head_dim=swa_v_head_dim,
    )


def total_num_kv_heads(cfg: Mapping[str, Any], text: Mapping[str, Any]) -> int:
    """KV heads across all ranks (SGLang's ``get_total_num_kv_heads``)."""
    model_type = cfg.get("model_type")
    new_falcon = model_type in ("falcon", "RefinedWeb", "RefinedWebModel") and cfg.get("new_decoder_architecture", False)
    if not new_falcon and text.get("multi_query", False):
        return 1
    attn_config = cfg.get("attn_config")
    if model_type in ("mpt", "dbrx"):
        if isinstance(attn_config, Mapping) and "kv_n_heads" in attn_config:
            return attn_config["kv_n_heads"]
        return cfg.get("num_attention_heads")
    if model_type == "nemotron-nas":
        heads = cfg.get("num_attention_heads")
        groups = {
            heads // block["attention"]["n_heads_in_group"]
            for block in cfg.get("block_configs") or ()
            if not block["attention"].get("no_op")
        }
        if len(groups) == 1:
            return groups.pop()
    for key in ("n_head_kv", "num_kv_heads", "num_key_value_heads", "multi_query_group_num", "num_attention_groups"):
        if text.get(key) is not None:
            return text[key]
    return text.get("num_attention_heads") or 1


def is_hybrid_swa(cfg: Mapping[str, Any], text: Mapping[str, Any]) -> bool:
    """Sliding-window and full-attention layers are mixed (``is_hybrid_swa_model``)."""
    arches = set(cfg.get("architectures") or ())
    if arches & HYBRID_SWA_ARCHS:
        return not ("LagunaForCausalLM" in arches and not text.get("sliding_window", 0))
    return bool(text.get("is_hybrid_swa", False))


def has_attention_sinks(cfg: Mapping[str, Any], text: Mapping[str, Any]) -> bool:
    """Attention uses learned sink logits (GPT-OSS, Granite SWA, flagged MiMoV2)."""
    arches = set(cfg.get("architectures") or ())
    if arches & SWA_SINK_ARCHS:
        return True
    if arches & {*MIMO_V2_ARCHS, "MiMoV2MTP"}:
        return bool(text.get("add_swa_attention_sink_bias", False) or text.get("add_full_attention_sink_bias", False))
    return False


def is_deepseek_dsa(cfg: Mapping[str, Any]) -> bool:
    """DeepSeek sparse attention: a DSA-capable architecture with ``index_topk`` set."""
    arches = cfg.get("architectures") or []
    return bool(arches) and arches[0] in DSA_ARCHS and cfg.get("index_topk") is not None


def index_topk_pattern(cfg: Mapping[str, Any]) -> str | None:
    """The DSA top-k sharing pattern, one ``F`` (fresh top-k) or ``S`` (shared) per layer.

    An explicit ``index_topk_pattern`` wins. When it is absent or null, the
    pattern is derived from ``indexer_types`` (``full`` -> ``F``, ``shared`` ->
    ``S``; the GLM-5.2 layout). ``None`` when neither gives one (an unknown
    indexer type included): sharing then follows ``index_topk_freq``.
    """
    explicit = cfg.get("index_topk_pattern")
    if explicit is not None:
        return str(explicit)
    types = cfg.get("indexer_types")
    if not isinstance(types, (list, tuple)) or not types:
        return None
    if any(t not in _INDEXER_TYPE_LETTERS for t in types):
        return None
    return "".join(_INDEXER_TYPE_LETTERS[t] for t in types)


def dsa_indexer_types(cfg: Mapping[str, Any], num_layers: int) -> tuple[str, ...]:
    """Each DSA layer's indexer mode, ``full`` (runs the indexer) or ``shared`` (reuses the
    previous full layer's top-k; GLM-5's IndexShare): the top-k sharing pattern
    (:func:`index_topk_pattern`: ``index_topk_pattern``, else ``indexer_types``), else the
    ``index_topk_freq`` / ``index_skip_topk_offset`` schedule as transformers derives GLM-5's
    ``indexer_types`` (layer ``i`` is full when ``max(i - offset + 1, 0) % freq == 0``; offset 2 by
    default; every layer full at freq 1). ValueError for a pattern of the wrong length or with
    letters other than ``F`` / ``S``, or one whose first layer is shared."""
    pattern = index_topk_pattern(cfg)
    if pattern is not None:
        letters = {letter: kind for kind, letter in _INDEXER_TYPE_LETTERS.items()}
        if len(pattern) != num_layers or set(pattern) - set(letters):
            raise ValueError(
                f"the DSA top-k sharing pattern {pattern!r} must have one F (full) or S (shared) per layer "
                f"({num_layers} layers)"
            )
        types = tuple(letters[c] for c in pattern)
    else:
        freq = max(int(cfg.get("index_topk_freq") or 1), 1)
        offset = int(cfg.get("index_skip_topk_offset", 2) if cfg.get("index_skip_topk_offset") is not None else 2)
        types = tuple("full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(num_layers))
    if types and types[0] != "full":
        raise ValueError(f"the DSA top-k sharing pattern starts with a shared layer, which has no top-k to reuse: {pattern!r}")
    return types


def uses_mamba_radix_cache(cfg: Mapping[str, Any]) -> bool:
    """Whether the model's prefix caching routes through the mamba radix cache."""
    arches = cfg.get("architectures") or []
    arch = arches[0] if arches else ""
    if arch == "GraniteMoeHybridForCausalLM":
        return any(t == "mamba" for t in cfg.get("layer_types") or ())
    return arch in MAMBA_RADIX_CACHE_ARCHS


def multimodal_facts(cfg: Mapping[str, Any], text: Mapping[str, Any]) -> dict[str, bool]:
    """Multimodal facts under default flags (``--enable-multimodal`` unset)."""
    arches = list(cfg.get("architectures") or ())
    arch = arches[0] if arches else ""
    default_enabled = not (
        arch in MULTIMODAL_OFF_BY_DEFAULT
        or (arch in ("MiMoV2ForCausalLM",) and not ("vision_config" in cfg and "audio_config" in cfg))
    )
    lm_only = bool(cfg.get("language_model_only", False))
    capable = not lm_only and (bool(set(arches) & MULTIMODAL_ARCHS) or text is not cfg)
    chunked_arch = not (set(arches) & NO_MM_CHUNKED_PREFILL)
    return dict(
        multimodal_default_enabled=default_enabled,
        multimodal_capable=capable,
        is_multimodal=default_enabled and capable,
        multimodal_chunked_prefill_arch=chunked_arch,
        multimodal_chunked_prefill=default_enabled and chunked_arch,
        multimodal_piecewise_graph_arch=bool(set(arches) & MM_PIECEWISE_GRAPH_OK),
        multimodal_breakable_graph_arch=bool(set(arches) & MM_BREAKABLE_GRAPH_OK),
        piecewise_graph_disabled_arch=bool(set(arches) & PIECEWISE_GRAPH_DISABLED),
    )


def embedding_facts(cfg: Mapping[str, Any], text: Mapping[str, Any]) -> dict[str, bool]:
    """Embedding/generation facts (``is_generation_model``, the embedding spec)."""
    arches = set(cfg.get("architectures") or ())
    gemma = text.get("model_type") == "gemma3_text" and bool(text.get("use_bidirectional_attention", False))
    auto_embedding = gemma or (not arches & CLASSIFICATION_ARCHS and bool(arches & EMBEDDING_ARCHS))
    return dict(
        is_embedding_gemma=gemma,
        auto_enable_embedding=auto_embedding,
        is_generation=not gemma and not arches & NON_GENERATION_ARCHS,
    )


def derive(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """Every :class:`ModelFacts` field for the config.json dict ``cfg``."""
    loaded = loaded_config(cfg)
    quant = parse_quant_config(loaded)
    if quant is not None and isinstance(loaded.get("quantization_config"), Mapping):
        # NOTE: SGLang writes the parsed ModelOpt method back into the config its
        # rules read; the facts' view of the config does the same.
        loaded["quantization_config"] = quant
    text = text_config(loaded)
    arches = tuple(loaded.get("architectures") or ())
    is_dsa = is_deepseek_dsa(loaded)
    meta = nvfp4_moe_meta(cfg)
    routed = (quant or {}).get("routed_experts_quant_method")
    fp4_experts = routed == "mxfp4" or (bool(arches) and arches[0] in DEEPSEEK_V4_ARCHS and routed is None)
    return dict(
        hf=freeze(loaded),
        architectures=arches,
        model_type=loaded.get("model_type"),
        is_dsa=is_dsa,
        quant_method=quant.get("quant_method") if isinstance(loaded.get("quantization_config"), Mapping) else None,
        quant_config=freeze(quant) if quant is not None else None,
        quantization=checkpoint_quantization(quant),
        has_attention_sinks=has_attention_sinks(loaded, text),
        is_hybrid_swa=is_hybrid_swa(loaded, text),
        context_len=context_length(text),
        nvfp4_moe_meta=freeze(meta) if meta is not None else None,
        is_fp4_experts=fp4_experts,
        uses_mamba_radix_cache=uses_mamba_radix_cache(loaded),
        index_topk=loaded.get("index_topk") if is_dsa else None,
        index_topk_pattern=index_topk_pattern(loaded),
        index_topk_freq=loaded.get("index_topk_freq") or 1,
        total_num_kv_heads=total_num_kv_heads(loaded, text),
        num_hidden_layers=text.get("num_hidden_layers"),
        is_encoder_decoder=bool(set(arches) & ENCODER_DECODER_ARCHS),
        **attention_shapes(loaded, text),
        **multimodal_facts(loaded, text),
        **embedding_facts(loaded, text),
        hf_raw_dict=freeze(dict(cfg)),
    )


# Dict-valued config keys transformers keeps as plain dicts (an override
# replaces them); any other ``*_config`` dict is a sub-config object.
_PLAIN_DICT_CONFIGS = frozenset({"quantization_config", "compression_config"})


def apply_overrides(cfg: Mapping[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    """``cfg`` with ``--json-model-override-args`` applied as SGLang's loader does.

    Each key replaces the config's value, except that a dict given for a
    sub-config (``text_config``, ``vision_config``, ...) updates that
    sub-config's keys instead of replacing it.
    """
    merged = dict(cfg)
    for key, value in overrides.items():
        current = merged.get(key)
        if (
            isinstance(value, Mapping)
            and isinstance(current, Mapping)
            and key.endswith("_config")
            and key not in _PLAIN_DICT_CONFIGS
        ):
            merged[key] = {**current, **value}
        else:
            merged[key] = value
    return merged


def check_context_length(derived: int | None, requested: int | None, *, allow_longer: bool = False) -> None:
    """Reject a ``--context-length`` above the model's derived context, as
    ``ModelConfig`` does unless ``SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN`` is set."""
    from flotilla.resolution.errors import Violation

    if requested is None or derived is None or requested <= derived or allow_longer:
        return
    raise Violation(
        f"Warning: User-specified context_length ({requested}) is greater than the derived "
        f"context_length ({derived}). This may lead to incorrect model outputs or CUDA errors. "
        "Note that the derived context_length may differ from max_position_embeddings in the "
        "model's config. To allow overriding this maximum, set the env var "
        "SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN=1",
        kind="ValueError",
    )


def multimodal_enabled(model: Any, enable_multimodal: bool | None, model_impl: str | None = "auto") -> bool:
    """Whether multimodal serving is on (``ModelConfig``'s ``enable_multimodal``).

    ``--enable-multimodal`` when given; else the model's default, except that
    the Transformers implementation also serves Gemma3/Llama4/Step3-VL/Inkling
    multimodally.
    """
    if enable_multimodal is not None:
        return bool(enable_multimodal)
    if model_impl == "transformers" and model.architecture in MULTIMODAL_OFF_BY_DEFAULT:
        return True
    return model.multimodal_default_enabled


def is_multimodal(model: Any, enable_multimodal: bool | None, model_impl: str | None = "auto") -> bool:
    """``ModelConfig.is_multimodal`` for the given ``--enable-multimodal`` / ``--model-impl``.

    The Transformers implementation also counts a top-level ``vision_config`` or
    ``audio_config`` as multimodal.
    """
    if not multimodal_enabled(model, enable_multimodal, model_impl):
        return False
    if model.multimodal_capable:
        return True
    has_towers = "vision_config" in model.hf or "audio_config" in model.hf
    return model_impl == "transformers" and has_towers and not model.get("language_model_only", False)


def multimodal_chunked_prefill_supported(model: Any, enable_multimodal: bool | None, model_impl: str | None = "auto") -> bool:
    """``ModelConfig.is_multimodal_chunked_prefill_supported`` for the given flags."""
    return multimodal_enabled(model, enable_multimodal, model_impl) and model.multimodal_chunked_prefill_arch
