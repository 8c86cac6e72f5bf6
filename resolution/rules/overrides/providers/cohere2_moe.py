"""Model-override provider for Cohere Command-A (Cohere2 MoE and its vision
variant): the trtllm-gen fused MoE runner on SM10x."""

from __future__ import annotations

from flotilla.resolution.rules.overrides.registry import provider
from flotilla.resolution.rules.overrides.support import model_config_quantization


def nvfp4_pack_quantized(model) -> bool:
    """The checkpoint is llm-compressor's nvfp4-pack-quantized format (top-level
    ``format`` or any config group's ``format`` names nvfp4)."""
    qc = model.get("quantization_config")
    if not hasattr(qc, "get"):
        return False
    groups = qc.get("config_groups") or {}
    formats = [qc.get("format", "")] + [
        group.get("format", "") for group in groups.values() if hasattr(group, "get")
    ]
    return any("nvfp4" in str(fmt) for fmt in formats)


@provider(
    "Cohere2VisionForConditionalGeneration",
    "Cohere2MoeForCausalLM",
    overrides=("moe_runner_backend",),
)
def _cohere2_moe_runner_overrides(view, model, platform):
    """Command-A MoE on SM10x runs the flashinfer_trtllm fused MoE (bf16 or nvfp4-pack)."""
    if view.moe_runner_backend != "auto" or not platform.is_sm100:
        return {}
    if model_config_quantization(view, model, platform) is not None and not nvfp4_pack_quantized(model):
        return {}
    return {"moe_runner_backend": "flashinfer_trtllm"}
