"""Model-override providers: Gemma 2, Gemma 3 and Gemma 3n.

not ported: the warning log line (logging only).
"""

from __future__ import annotations

from flotilla.resolution.rules.overrides.registry import provider


@provider(
    "Gemma2ForCausalLM",
    "Gemma3ForCausalLM",
    "Gemma3ForConditionalGeneration",
    "Gemma3nForCausalLM",
    "Gemma3nForConditionalGeneration",
    overrides=("disable_hybrid_swa_memory",),
)
def _gemma2_gemma3_overrides(view, model, platform):
    """Hybrid SWA memory is always disabled for Gemma 2/3 (not yet supported for them)."""
    return {"disable_hybrid_swa_memory": True}
