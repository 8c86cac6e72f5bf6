"""Model-override providers: Granite-MoE-Hybrid."""

from __future__ import annotations

from flotilla.resolution.rules.overrides.registry import provider

# Layer-type spellings the SGLang config class maps onto its own names.
_LAYER_TYPE_ALIASES = {"linear_attention": "mamba", "full_attention": "attention"}
_DEFAULT_NUM_HIDDEN_LAYERS = 40


def _layer_types(model):
    """``hf_config.layer_types`` as SGLang's GraniteMoeHybridConfig builds it:
    the config's list with aliases mapped, else one attention layer every six."""
    layer_types = model.get("layer_types")
    if layer_types is None:
        count = model.get("num_hidden_layers", _DEFAULT_NUM_HIDDEN_LAYERS) or 0
        return ["attention" if (i + 1) % 6 == 0 else "mamba" for i in range(count)]
    return [_LAYER_TYPE_ALIASES.get(t, t) for t in layer_types]


@provider("GraniteMoeHybridForCausalLM")
def _granite_moe_hybrid_overrides(view, model, platform):
    """Granite hybrids with Mamba layers default to flashinfer attention on SM100."""
    has_mamba = any(t == "mamba" for t in _layer_types(model))
    if has_mamba and platform.is_sm100 and view.attention_backend is None:
        return {"attention_backend": "flashinfer"}
    return {}
