"""Model-override providers: Llama 4.

not ported: the log lines (logging only).
"""

from __future__ import annotations

from flotilla.resolution.rules.overrides.registry import provider


def _llama4_attention_backend(view, platform):
    """Llama 4's attention backend on this platform."""
    if platform.is_sm100:
        return "trtllm_mha"
    if platform.is_sm90:
        return "fa3"
    if platform.is_hip:
        return "aiter"
    if view.device == "xpu":
        return "intel_xpu"
    return "triton"


@provider("Llama4ForConditionalGeneration", "Llama4ForCausalLM", overrides=("moe_runner_backend",))
def _llama4_overrides(view, model, platform):
    """Llama 4 (off CPU) picks its attention backend per platform and runs FP8 MoE on flashinfer_trtllm on SM100."""
    # NOTE: ``device`` is declared by the normalise phase before providers run.
    if view.device == "cpu":
        return {}
    declared = {}
    if view.attention_backend is None:
        declared["attention_backend"] = _llama4_attention_backend(view, platform)
    if (
        platform.is_sm100
        and view.moe_runner_backend == "auto"
        and view.quantization in ("fp8", "modelopt_fp8")
    ):
        declared["moe_runner_backend"] = "flashinfer_trtllm"
    return declared
