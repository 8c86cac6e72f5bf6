"""Model-override providers: Falcon-H1, Jet-Nemotron and Jet-VLM."""

from __future__ import annotations

from flotilla.resolution.rules.overrides.registry import provider


@provider("FalconH1ForCausalLM", "JetNemotronForCausalLM", "JetVLMForConditionalGeneration")
def _falcon_h1_jet_overrides(view, model, platform):
    """On SM100 these hybrid models default to the triton attention backend."""
    if platform.is_sm100 and view.attention_backend is None:
        return {"attention_backend": "triton"}
    return {}
