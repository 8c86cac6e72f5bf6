"""Model-override provider for GLM-4.5/4.6 MoE: checkpoint quantization and the
trtllm MoE runner on SM10x, TF32 gate GEMMs everywhere."""

from __future__ import annotations

from flotilla.resolution.rules.overrides.registry import provider
from flotilla.resolution.rules.overrides.support import hf_quant_method, quantization_explicitly_unset


@provider("Glm4MoeForCausalLM", overrides=("moe_runner_backend",))
def _glm4_moe_overrides(view, model, platform):
    """GLM-4 MoE enables TF32 matmul; on SM10x it adopts the checkpoint's quant
    method and runs flashinfer_trtllm MoE for bf16 / modelopt_fp4."""
    declared: dict = {}
    if platform.is_sm100:
        quantization = view.quantization
        method = hf_quant_method(model)
        if quantization is None and not quantization_explicitly_unset(view) and method is not None:
            quantization = declared["quantization"] = method
        if (
            quantization in ("modelopt_fp4", None)
            and view.moe_a2a_backend == "none"
            and view.moe_runner_backend == "auto"
        ):
            declared["moe_runner_backend"] = "flashinfer_trtllm"
    declared["enable_tf32_matmul"] = True
    return declared
