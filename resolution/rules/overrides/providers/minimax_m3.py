"""Model-override provider for MiniMax-M3 sparse: checkpoint quantization,
per-platform attention backend and page size, MoE runner, and the ROCm
all-reduce / RoPE settings.

not ported: the fp8 attention-GEMM status logging (no field changes).
"""

from __future__ import annotations

from flotilla.resolution.engine import Env
from flotilla.resolution.rules.common import attention_backend_not_set, env_flag
from flotilla.resolution.rules.overrides.registry import provider
from flotilla.resolution.rules.overrides.support import (
    hf_quant_method,
    env_is_set,
    quantization_explicitly_unset,
)


def _rocm(view, quantization, declared: dict) -> None:
    if attention_backend_not_set(view):
        declared["attention_backend"] = "triton"
    if view.moe_runner_backend == "auto" and quantization == "mxfp8":
        declared["moe_runner_backend"] = "triton"
    if not env_is_set(view, "USE_ROCM_AITER_ROPE_BACKEND"):
        declared[Env("USE_ROCM_AITER_ROPE_BACKEND")] = "0"
    aiter_fusion = view.enable_aiter_allreduce_fusion
    if view.ep_size > 1 and view.moe_a2a_backend == "none" and aiter_fusion:
        # The deferred fused all-reduce corrupts sparse-MoE partial outputs under plain EP.
        declared["enable_aiter_allreduce_fusion"] = aiter_fusion = False
    if not aiter_fusion and not env_flag(view, "SGLANG_M3_ALLOW_CUSTOM_AR"):
        declared["disable_custom_all_reduce"] = True


def _sm100(view, quantization, declared: dict) -> None:
    if attention_backend_not_set(view):
        fp8_attention = view.kv_cache_dtype == "fp8_e4m3" and not env_flag(
            view, "SGLANG_DISABLE_M3_FP8_ATTN_GEMM"
        )
        declared["attention_backend"] = "trtllm_mha" if fp8_attention else "fa4"
    backend = declared.get("attention_backend", view.attention_backend)
    if view.page_size is None and backend in ("fa4", "trtllm_mha"):
        declared["page_size"] = 128  # the sparse block size MSA needs
    if view.moe_runner_backend == "auto" and quantization == "mxfp8":
        declared["moe_runner_backend"] = "deep_gemm"
    elif view.moe_runner_backend == "auto" and quantization == "modelopt_mixed":
        declared["moe_runner_backend"] = "flashinfer_trtllm_routed"


def _sm90(view, declared: dict) -> None:
    if attention_backend_not_set(view):
        declared["attention_backend"] = "fa3"
    if view.page_size is None and declared.get("attention_backend", view.attention_backend) == "fa3":
        declared["page_size"] = 128


@provider(
    "MiniMaxM3SparseForCausalLM",
    "MiniMaxM3SparseForConditionalGeneration",
    overrides=("moe_runner_backend", "enable_aiter_allreduce_fusion"),
)
def _minimax_m3_overrides(view, model, platform):
    """MiniMax-M3 defaults: quantization from the checkpoint, triton/fa4/trtllm_mha/fa3
    attention with page 128 for MSA, and a MoE runner that fits the weights."""
    declared: dict = {}
    quantization = view.quantization
    method = hf_quant_method(model)
    if quantization is None and not quantization_explicitly_unset(view) and method is not None:
        quantization = declared["quantization"] = method
    if platform.is_hip:
        _rocm(view, quantization, declared)
    elif platform.is_sm100:
        _sm100(view, quantization, declared)
    elif platform.is_sm90:
        _sm90(view, declared)
    runner = declared.get("moe_runner_backend", view.moe_runner_backend)
    if quantization is None and runner in ("auto", "deep_gemm"):
        # deep_gemm corrupts bf16 full-weight output; triton is the safe runner.
        declared["moe_runner_backend"] = "triton"
    return declared
