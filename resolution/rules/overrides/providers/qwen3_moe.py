"""Model-override providers: the Qwen3 MoE family's quantization and MoE runner on SM100.

not ported: the info log line (logging only).
"""

from __future__ import annotations

from flotilla.resolution.rules.overrides.support import hf_quant_method, quantization_explicitly_unset
from flotilla.resolution.rules.overrides.registry import provider


@provider(
    "Qwen3MoeForCausalLM",
    "Qwen3VLMoeForConditionalGeneration",
    "Qwen3NextForCausalLM",
    "Qwen3_5MoeForConditionalGeneration",
    "InternS2PreviewForConditionalGeneration",
    "Qwen3_5ForConditionalGeneration",
    overrides=("moe_runner_backend",),
)
def _qwen3_moe_family_overrides(view, model, platform):
    """On SM100 the Qwen3 MoE family adopts the checkpoint quantization and runs its experts on flashinfer_trtllm.

    flashinfer_trtllm applies to bf16, fp8 and modelopt_fp4 experts without an
    all-to-all backend and with the MoE runner left on ``auto``.
    """
    if not platform.is_sm100:
        return {}
    declared = {}
    quantization = view.quantization
    if quantization is None and not quantization_explicitly_unset(view) and hf_quant_method(model) is not None:
        quantization = hf_quant_method(model)
        declared["quantization"] = quantization
    if (
        quantization in ("fp8", "modelopt_fp4", None)
        and view.moe_a2a_backend == "none"
        and view.moe_runner_backend == "auto"
    ):
        declared["moe_runner_backend"] = "flashinfer_trtllm"
    return declared
