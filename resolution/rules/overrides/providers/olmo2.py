"""Model-override providers: OLMo 2.

not ported: the warning log line (logging only).
"""

from __future__ import annotations

from flotilla.resolution.rules.overrides.registry import provider


@provider("Olmo2ForCausalLM", overrides=("disable_hybrid_swa_memory",))
def _olmo2_overrides(view, model, platform):
    """OLMo 2 disables hybrid SWA memory (unsupported) and picks trtllm_mha (SM100), fa3 (CUDA SM80+) or triton."""
    declared = {"disable_hybrid_swa_memory": True}
    if view.attention_backend is None:
        if platform.is_cuda and platform.is_sm100:
            declared["attention_backend"] = "trtllm_mha"
        elif platform.is_cuda and platform.device_sm >= 80:
            declared["attention_backend"] = "fa3"
        else:
            declared["attention_backend"] = "triton"
    return declared
