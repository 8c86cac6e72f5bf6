"""Model-override providers: EXAONE 4 and EXAONE-MoE.

not ported: the warning log line (logging only).
"""

from __future__ import annotations

from flotilla.resolution.rules.overrides.registry import provider

# The transformers config classes of both families default the pattern to 4.
_DEFAULT_SLIDING_WINDOW_PATTERN = 4


def _sliding_window_pattern(model):
    """``hf_config.sliding_window_pattern`` as the transformers config class
    leaves it: 0 when ``sliding_window`` is null, else the config's value
    (possibly null), else the class default."""
    if "sliding_window" in model.hf and model.hf["sliding_window"] is None:
        return 0
    return model.hf.get("sliding_window_pattern", _DEFAULT_SLIDING_WINDOW_PATTERN)


@provider("Exaone4ForCausalLM", "ExaoneMoEForCausalLM", overrides=("disable_hybrid_swa_memory",))
def _exaone_overrides(view, model, platform):
    """Hybrid SWA memory is disabled for EXAONE models with a sliding-window pattern (not yet supported)."""
    if _sliding_window_pattern(model) is not None:
        return {"disable_hybrid_swa_memory": True}
    return {}
