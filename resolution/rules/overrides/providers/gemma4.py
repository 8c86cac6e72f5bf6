"""Model-override providers: Gemma 4.

not ported: the info log lines (logging only).
"""

from __future__ import annotations

from flotilla.resolution.rules.common import attention_backend_not_set
from flotilla.resolution.rules.overrides.support import model_config_quantization
from flotilla.resolution.rules.overrides.registry import provider


@provider(
    "Gemma4ForConditionalGeneration",
    "Gemma4ForCausalLM",
    "Gemma4UnifiedForConditionalGeneration",
    overrides=("moe_runner_backend", "quantization"),
)
def _gemma4_overrides(view, model, platform):
    """Gemma 4 pins a supported attention backend and, on SM100, runs ModelOpt FP4 MoE on flashinfer_trtllm.

    The base backend (trtllm_mha on SM100, else triton) is set when no backend
    was chosen or when only the prefill/decode split was.
    """
    declared = {}
    gemma4_backend = "trtllm_mha" if platform.is_sm100 else "triton"
    # NOTE: with only one split side set, the base backend still gets the
    # Gemma4 default so the generic default never picks an unsupported one.
    if attention_backend_not_set(view) or view.attention_backend is None:
        declared["attention_backend"] = gemma4_backend
    if (
        platform.is_sm100
        and view.moe_runner_backend == "auto"
        and model_config_quantization(view, model, platform) == "modelopt_fp4"
    ):
        declared["quantization"] = "modelopt_fp4"
        declared["moe_runner_backend"] = "flashinfer_trtllm"
    return declared
