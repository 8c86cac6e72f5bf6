"""Kimi hybrid (KDA linear attention) defaults applied right after the providers:
the decode fallback kernel and the speculative-decoding backends."""

from __future__ import annotations

from flotilla.resolution.engine import rule

KIMI_HYBRID_ARCHS = ("KimiLinearForCausalLM", "KimiK3ForConditionalGeneration")


@rule("apply_kimi_k3_linear_attn_defaults")
def apply_kimi_k3_linear_attn_defaults(view, model, platform):
    """Kimi hybrids with a bf16 SSM state decode KDA with the triton kernel on SM100
    (faster than recurrent_kda, and ReplaySSM requires it)."""
    if model.architecture not in KIMI_HYBRID_ARCHS:
        return None
    if view.linear_attn_decode_backend is None and view.mamba_ssm_dtype == "bfloat16" and platform.is_sm100:
        return {"linear_attn_decode_backend": "triton"}
    return None


@rule("apply_kimi_k3_spec_backend_defaults")
def apply_kimi_k3_spec_backend_defaults(view, model, platform):
    """Speculative Kimi hybrids verify KDA with the fused nv_cutedsl kernel; DSPARK's
    dense-MQA draft uses trtllm_mha on SM100 (no blocking host plan)."""
    if model.architecture not in KIMI_HYBRID_ARCHS or view.speculative_algorithm is None:
        return None
    declared: dict = {}
    if view.linear_attn_verify_backend is None:
        declared["linear_attn_verify_backend"] = "nv_cutedsl"
    if (
        view.speculative_algorithm == "DSPARK"
        and view.speculative_draft_attention_backend is None
        and platform.is_sm100
    ):
        declared["speculative_draft_attention_backend"] = "trtllm_mha"
    return declared
