"""Model-override providers: MiniCPM-V 4.6."""

from __future__ import annotations

from flotilla.resolution.rules.overrides.registry import provider


@provider("MiniCPMV4_6ForConditionalGeneration")
def _minicpm_v4_6_overrides(view, model, platform):
    """MiniCPM-V 4.6 defaults to triton attention on SM100."""
    if platform.is_sm100 and view.attention_backend is None:
        return {"attention_backend": "triton"}
    return {}
