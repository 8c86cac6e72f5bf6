"""The opening of the model phase: the resets it always declares and the
architecture checks that run before any provider.

not ported: the instance-connector early return (``instance://`` model paths
carry no config.json, so resolution has nothing to key the model phase on).
"""

from __future__ import annotations

from flotilla.resolution.engine import ensure, reject, rule
from flotilla.resolution.rules.overrides.support import is_deepseek_dsa

# Architectures whose attention linears are replicated across CP ranks, the
# only ones --enable-cp-decode-attn-tp can serve.
CP_DECODE_ATTN_TP_ARCHS = (
    "DeepseekV4ForCausalLM",
    "DeepseekV4ForCausalLMNextN",
    "DeepseekV4ForCausalLMDSpark",
    "GlmMoeDsaForCausalLM",
    "GlmMoeDsaForCausalLMNextN",
)


@rule(
    "_handle_model_specific_adjustments",
    overrides=("enforce_disable_flashinfer_allreduce_fusion", "uses_mamba_radix_cache"),
)
def model_phase_resets(view, model, platform):
    """Deterministic inference forbids FlashInfer all-reduce fusion; the mamba radix
    cache starts off until a hybrid-model pass turns it on."""
    declared: dict = {}
    if view.enable_deterministic_inference:
        declared["enforce_disable_flashinfer_allreduce_fusion"] = True
    declared["uses_mamba_radix_cache"] = False
    return declared


@rule("_handle_model_specific_adjustments")
def architecture_flag_checks(view, model, platform):
    """Reject flags the architecture cannot serve: PP/EP on Intern-S2-Mobius, DSA
    cache layer split off DSA models, CP decode attention TP off supported archs."""
    arch = model.architecture
    if arch == "InternS2MobiusForConditionalGeneration":
        unsupported = []
        if view.pp_size != 1:
            unsupported.append("pipeline parallelism (--pp-size must be 1)")
        if view.ep_size != 1:
            unsupported.append("expert parallelism (--ep-size must be 1)")
        if unsupported:
            reject("Intern-S2-Mobius does not support: " + "; ".join(unsupported) + ".")
    ensure(
        not view.enable_dsa_cache_layer_split or is_deepseek_dsa(model),
        "--enable-dsa-cache-layer-split is only supported for DSA "
        "(DeepSeek Sparse Attention) models.",
        kind="ValueError",
    )
    if view.enable_cp_decode_attn_tp and arch not in CP_DECODE_ATTN_TP_ARCHS:
        reject(
            "--enable-cp-decode-attn-tp is only supported for models "
            "whose attention linears are replicated across CP ranks "
            f"(attn_tp_size=1). Got {arch}; supported: "
            f"{sorted(CP_DECODE_ATTN_TP_ARCHS)}."
        )
    return None
