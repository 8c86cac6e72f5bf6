"""Model-override providers: Muse Glimmer.

not ported: the info log line (logging only).
"""

from __future__ import annotations

from flotilla.resolution.rules.overrides.registry import provider


@provider(
    "MuseGlimmerForConditionalGeneration",
    "MuseGlimmerForCausalLM",
    overrides=("fp4_gemm_runner_backend",),
)
def _muse_glimmer_fp4_gemm_runner_overrides(view, model, platform):
    """Muse Glimmer runs FP4 GEMMs on marlin on SM120."""
    if platform.is_sm120 and view.fp4_gemm_runner_backend == "auto":
        return {"fp4_gemm_runner_backend": "marlin"}
    return {}
