"""Model-override provider for MiMo-V2: multi-layer EAGLE and the trtllm MoE
runner for FP8 checkpoints on SM10x."""

from __future__ import annotations

from flotilla.resolution.rules.overrides.registry import provider
from flotilla.resolution.rules.overrides.support import hf_quant_method


@provider("MiMoV2ForCausalLM", "MiMoV2FlashForCausalLM", overrides=("moe_runner_backend",))
def _mimo_v2_overrides(view, model, platform):
    """MiMo-V2 uses multi-layer EAGLE; FP8 checkpoints on SM10x run flashinfer_trtllm MoE."""
    declared: dict = {}
    if view.speculative_algorithm == "EAGLE":
        declared["enable_multi_layer_eagle"] = True
    if platform.is_sm100 and view.moe_runner_backend == "auto" and hf_quant_method(model) == "fp8":
        declared["moe_runner_backend"] = "flashinfer_trtllm"
    return declared
