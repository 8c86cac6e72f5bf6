"""Model-override providers: Step-3.5 and Step-3.7 (matched by substring of the
architecture name, as SGLang does).

not ported: the log lines (logging only).
"""

from __future__ import annotations

from flotilla.resolution.rules.common import attention_backend_not_set
from flotilla.resolution.rules.overrides.registry import provider_when


def _is_step3p(architecture: str) -> bool:
    """Step-3.5 text or Step-3.7 multimodal architecture names (substring match)."""
    return "Step3p5ForCausalLM" in architecture or "Step3p7ForConditionalGeneration" in architecture


@provider_when(
    _is_step3p,
    overrides=("enable_multi_layer_eagle", "swa_full_tokens_ratio", "disable_hybrid_swa_memory"),
)
def _step3p_overrides(view, model, platform):
    """Step-3.5/3.7 take fa4 (Blackwell) or fa3 (Hopper), multi-layer EAGLE, and full SWA memory under HiCache."""
    declared = {}
    if attention_backend_not_set(view):
        if platform.is_blackwell:
            declared["attention_backend"] = "fa4"
        elif platform.is_sm90:
            declared["attention_backend"] = "fa3"
    if view.speculative_algorithm == "EAGLE":
        declared["enable_multi_layer_eagle"] = True
    if view.enable_hierarchical_cache:
        declared["swa_full_tokens_ratio"] = 1.0
        declared["disable_hybrid_swa_memory"] = True
    return declared
