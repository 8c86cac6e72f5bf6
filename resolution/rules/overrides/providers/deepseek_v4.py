"""Model-override provider for DeepSeek V4: the dsv4 attention backend, its page
size and SWA window share, and the MoE runner for MXFP4 / NVFP4 experts.

not ported: the routed-expert weight-dtype probe (only config.json is present,
so SGLang's default, MXFP4 experts, holds).
"""

from __future__ import annotations

from flotilla.resolution.rules.overrides.registry import provider
from flotilla.resolution.rules.common import env_flag
from flotilla.resolution.rules.overrides.support import device_of


def dsv4_fp4_experts(model) -> bool:
    """DeepSeek V4's routed experts are MXFP4-packed.

    A ``routed_experts_quant_method`` in ``quantization_config`` decides; without
    one SGLang's default (``SGLANG_DSV4_FP4_EXPERTS``, true) holds, since no
    weight header is there to probe.
    """
    qc = model.get("quantization_config")
    method = qc.get("routed_experts_quant_method") if hasattr(qc, "get") else None
    return method is None or method == "mxfp4"


def nvfp4_moe_meta(model) -> bool:
    """A hybrid FP8 + NVFP4 checkpoint (ModelOpt MIXED_PRECISION with NVFP4 MoE
    and a group size), SGLang's ``ModelConfig.nvfp4_moe_meta``."""
    if model.nvfp4_moe_meta:
        return True
    qc = model.get("quantization_config")
    if not hasattr(qc, "get"):
        return False
    return (
        str(qc.get("quant_algo", "")).upper() == "MIXED_PRECISION"
        and str(qc.get("moe_quant_algo", "")).upper() == "NVFP4"
        and qc.get("group_size") is not None
    )


@provider(
    "DeepseekV4ForCausalLM",
    overrides=(
        "attention_backend",
        "prefill_attention_backend",
        "decode_attention_backend",
        "page_size",
        "swa_full_tokens_ratio",
        "moe_runner_backend",
    ),
)
def _deepseek_v4_overrides(view, model, platform):
    """DeepSeek V4 runs the dsv4 attention backend (page 256, 128 on NPU), a 0.1
    SWA share and an FP4-aware MoE runner."""
    device = device_of(view, platform)
    declared: dict = {"attention_backend": "dsv4", "page_size": 256}
    if device == "npu":
        declared.update(page_size=128, prefill_attention_backend="dsv4", decode_attention_backend="dsv4")
    if view.swa_full_tokens_ratio == view.default("swa_full_tokens_ratio"):
        declared["swa_full_tokens_ratio"] = 0.1
    if view.moe_runner_backend == "auto":
        if nvfp4_moe_meta(model):
            declared["moe_runner_backend"] = "flashinfer_trtllm_routed"
        elif (
            device == "cuda"
            and not platform.is_hip
            and view.moe_a2a_backend == "none"
            and not env_flag(view, "SGLANG_DSV4_FP4_DEQUANT")
            and dsv4_fp4_experts(model)
            and (platform.is_sm90 or platform.is_sm100 or platform.is_sm120)
        ):
            declared["moe_runner_backend"] = "flashinfer_mxfp4"
    return declared
