"""Model-override provider for MiniMax-M2: TF32 gate GEMMs and the routed
trtllm MoE runner for ModelOpt FP4 checkpoints on SM10x."""

from __future__ import annotations

from flotilla.resolution.rules.overrides.registry import provider
from flotilla.resolution.rules.overrides.support import model_config_quantization


@provider("MiniMaxM2ForCausalLM", overrides=("moe_runner_backend",))
def _minimax_m2_overrides(view, model, platform):
    """MiniMax-M2 enables TF32 matmul; modelopt_fp4 on SM10x runs flashinfer_trtllm_routed."""
    declared: dict = {"enable_tf32_matmul": True}
    if (
        platform.is_sm100
        and view.moe_runner_backend == "auto"
        and model_config_quantization(view, model, platform) == "modelopt_fp4"
    ):
        declared["moe_runner_backend"] = "flashinfer_trtllm_routed"
    return declared
