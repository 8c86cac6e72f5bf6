"""Model-override providers: MiniCPM and MiniCPM-SALA (sparse / lightning hybrids)."""

from __future__ import annotations

from flotilla.resolution.engine import reject
from flotilla.resolution.rules.common import attention_backend_not_set
from flotilla.resolution.rules.common import env_flag
from flotilla.resolution.rules.overrides.registry import provider

# Mixer-type spellings SGLang's MiniCPMHybridConfig accepts, mapped to its names.
_MIXER_ALIASES = {
    "minicpm4": "minicpm4",
    "minicpm": "minicpm4",
    "standard": "minicpm4",
    "attention": "minicpm4",
    "attn": "minicpm4",
    "lightning": "lightning-attn",
    "lightning_attn": "lightning-attn",
    "lightning-attn": "lightning-attn",
}
_SPARSE_BACKENDS = ("minicpm_flashattn", "minicpm_flashinfer")


def _hybrid_layout(model):
    """(has sparse attention, has lightning layers), as SGLang's config answers them.

    ``minicpm_sala`` configs derive both from ``mixer_types`` (repeated to the
    layer count) and ``sparse_config``; other MiniCPM configs only have them
    when config.json states them.
    """
    if model.model_type != "minicpm_sala":
        return (
            bool(model.get("has_minicpm_sparse_attention", False)),
            bool(model.get("has_lightning_layers", False)),
        )
    layers = model.get("num_hidden_layers", 32) or 0
    mixers = [_MIXER_ALIASES.get(m, m) for m in (model.get("mixer_types") or ["minicpm4"])]
    repeats = (layers + len(mixers) - 1) // len(mixers)
    mixers = (mixers * repeats)[:layers]
    has_sparse = model.get("sparse_config") is not None and "minicpm4" in mixers
    return has_sparse, "lightning-attn" in mixers


def _dense_backend(backend, platform):
    """The dense backend standing in for a MiniCPM sparse backend (None: keep it)."""
    if backend == "minicpm_flashattn":
        return "fa4" if platform.is_blackwell else "fa3"
    if backend == "minicpm_flashinfer":
        return "flashinfer"
    return None


@provider(
    "MiniCPMForCausalLM",
    "MiniCPMSALAForCausalLM",
    overrides=(
        "disable_radix_cache",
        "attention_backend",
        "prefill_attention_backend",
        "decode_attention_backend",
    ),
)
def _minicpm_sala_overrides(view, model, platform):
    """MiniCPM hybrids disable the radix cache and default to MiniCPM sparse attention.

    Under SGLANG_MINICPM_FORCE_DENSE a chosen sparse backend is swapped for its
    dense stand-in instead. DP attention, and HiCache/PD disaggregation with the
    hybrid or sparse layouts, are rejected.
    """
    if view.enable_dp_attention:
        reject("MiniCPM does not support DP attention")
    has_sparse, has_lightning = _hybrid_layout(model)
    declared = {}
    if has_sparse or has_lightning:
        if view.enable_hierarchical_cache:
            reject("MiniCPM SALA does not support hierarchical cache")
        declared["disable_radix_cache"] = True
    if env_flag(view, "SGLANG_MINICPM_FORCE_DENSE"):
        for field in ("attention_backend", "prefill_attention_backend", "decode_attention_backend"):
            dense = _dense_backend(getattr(view, field), platform)
            if dense is not None:
                declared[field] = dense
    elif has_sparse:
        uses_sparse_backend = attention_backend_not_set(view) or any(
            backend in _SPARSE_BACKENDS
            for backend in (
                view.attention_backend,
                view.prefill_attention_backend,
                view.decode_attention_backend,
            )
        )
        if uses_sparse_backend and view.disaggregation_mode != "null":
            reject("MiniCPM sparse attention does not support PD disaggregation")
        if attention_backend_not_set(view):
            declared["attention_backend"] = (
                "minicpm_flashinfer" if platform.is_blackwell else "minicpm_flashattn"
            )
    return declared
