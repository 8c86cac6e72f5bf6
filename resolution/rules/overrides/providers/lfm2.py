"""Model-override providers: LFM2 and LFM2-MoE."""

from __future__ import annotations

from flotilla.resolution.rules.overrides.registry import provider


@provider("Lfm2ForCausalLM", "Lfm2MoeForCausalLM")
def _lfm2_overrides(view, model, platform):
    """LFM2 hybrids default to flashinfer attention on SM100."""
    if platform.is_sm100 and view.attention_backend is None:
        return {"attention_backend": "flashinfer"}
    return {}
