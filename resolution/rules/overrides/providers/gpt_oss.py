"""Model-override providers: GPT-OSS.

not ported: the warning log lines (logging only); the MLX runner exemption on
Apple silicon (``use_mlx()`` reads SGLANG_USE_MLX, unset in the clean
environment resolution assumes, so macOS falls through to triton as SGLang does).
"""

from __future__ import annotations

from flotilla.resolution.engine import reject
from flotilla.resolution.rules.common import attention_backend_not_set
from flotilla.resolution.rules.common import env_flag
from flotilla.resolution.rules.overrides.registry import provider

# NVIDIA drivers from this release make the triton_kernels MoE path segfault on Blackwell.
_TRITON_KERNELS_BAD_DRIVER = (595,)


def _gpt_oss_attention_backend(platform):
    """The attention backend GPT-OSS needs on this platform (sinks + sliding window)."""
    if platform.is_sm100:
        return "trtllm_mha"
    if platform.is_sm90:
        return "fa3"
    if platform.is_cpu and platform.amx:
        return "intel_amx"
    if platform.is_xpu:
        return "intel_xpu"
    if platform.is_hip:
        return "aiter"
    return "triton"


def _gpt_oss_moe_runner(view, platform, is_mxfp4):
    """The MoE runner GPT-OSS takes when the user left it on ``auto`` (None: no change)."""
    if platform.is_sm100 and is_mxfp4:
        return "flashinfer_mxfp4"
    if platform.is_sm120 and is_mxfp4:
        return "flashinfer_mxfp4"
    if platform.is_hip and platform.aiter_enabled and is_mxfp4:
        return "auto"  # the aiter MXFP4 fused MoE is what "auto" picks there
    if platform.is_hip and platform.aiter_enabled:
        return "triton"  # aiter's CK MoE lacks some GPT-OSS bf16 GEMM shapes
    if platform.is_musa and env_flag(view, "SGLANG_DEEPEP_BF16_DISPATCH"):
        return "deep_gemm"
    if (
        view.ep_size == 1
        and platform.triton_kernels
        and view.quantization is None
        and not (platform.is_cpu and platform.amx)
    ):
        if platform.is_blackwell and tuple(platform.driver_version) >= _TRITON_KERNELS_BAD_DRIVER:
            return "triton"
        return "triton_kernel"
    return None


@provider("GptOssForCausalLM", overrides=("dtype", "moe_runner_backend"))
def _gpt_oss_overrides(view, model, platform):
    """GPT-OSS needs a sink-capable attention backend, bf16 for MXFP4 weights, and a matching MoE runner.

    MoE runner on ``auto``: FlashInfer MXFP4 on SM100/SM120 for MXFP4 weights,
    triton on ROCm with aiter (bf16), triton_kernels where that package is
    installed (triton on Blackwell with driver >= 595, which segfaults it).
    """
    declared = {}
    if attention_backend_not_set(view):
        declared["attention_backend"] = _gpt_oss_attention_backend(platform)
    if platform.is_xpu and view.dtype not in ("auto", "bfloat16"):
        reject(
            f"GptOssForCausalLM on Intel XPU only supports bfloat16 dtype, "
            f"but got '{view.dtype}'. Please use --dtype bfloat16 or remove --dtype to use auto.",
            kind="NotImplementedError",
        )
    quantization_config = model.get("quantization_config")
    is_mxfp4 = (
        quantization_config is not None and quantization_config.get("quant_method") == "mxfp4"
    )
    if is_mxfp4:
        declared["dtype"] = "bfloat16"
    if view.moe_runner_backend == "auto":
        runner = _gpt_oss_moe_runner(view, platform, is_mxfp4)
        if runner is not None:
            declared["moe_runner_backend"] = runner
    return declared
