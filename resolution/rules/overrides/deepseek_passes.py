"""The post-process passes the DeepSeek branch runs at fixed slots: the DSA
kv-cache dtype and split prefill/decode backends, the Blackwell quantization /
MoE runner choice, and the ROCm draft-MoE backends for FP4 checkpoints.

not ported: the safetensors-header probe for native FP8 experts in a DeepSeek-V3
config without quantization_config (only config.json is present: none found).
not ported: the "set --kv-cache-dtype explicitly" warnings (logging only).
"""

from __future__ import annotations

from flotilla.resolution.engine import ensure, reject, rule
from flotilla.resolution.rules.common import env_flag
from flotilla.resolution.rules.overrides.cpu_dsa import reference_dsa_platform
from flotilla.resolution.rules.overrides.support import (
    DEEPSEEK_BRANCH_ARCHS,
    hf_quant_config,
    hf_quant_method,
    is_deepseek_dsa,
    quantization_explicitly_unset,
)

_TRTLLM_MOE_QUANTS = ("fp8", "modelopt_fp8", "modelopt_fp4", "modelopt_mixed", None)


def _dsa_on_gpu(model, platform) -> bool:
    # NOTE: flotilla's deviation: on the cpu platform DSA resolves to the torch reference
    # (rules/overrides/cpu_dsa.py) instead of reaching the CUDA probe below.
    return (
        model.architecture in DEEPSEEK_BRANCH_ARCHS
        and is_deepseek_dsa(model)
        and not platform.is_npu
        and not platform.is_xpu
        and not reference_dsa_platform(model, platform)
    )


@rule("_dsa_kv_cache_dtype_default", overrides=("kv_cache_dtype",), whitelist=True)
def dsa_kv_cache_dtype_default(view, model, platform):
    """DSA models keep an FP8 KV cache on Blackwell and bfloat16 before it; only
    bfloat16 (alias bf16) and fp8_e4m3 are accepted."""
    if not _dsa_on_gpu(model, platform):
        return None
    if not platform.has_torch_cuda:
        # NOTE: SGLang reads the device capability here, and torch raises without a
        # GPU: "Torch not compiled with CUDA enabled" on a CPU-only build, "Found no
        # NVIDIA driver" on a CUDA build without a device. The message names both.
        reject(
            f"{model.architecture} uses DeepSeek sparse attention (DSA), which needs an NVIDIA or AMD "
            f"GPU; platform {platform.name!r} has none (torch: Torch not compiled with CUDA enabled / "
            "Found no NVIDIA driver on your system). Resolve for a GPU platform, e.g. --platform h200.",
            kind="RuntimeError",
        )
    kv_cache_dtype = view.kv_cache_dtype
    if kv_cache_dtype == "auto":
        kv_cache_dtype = "fp8_e4m3" if platform.capability_major >= 10 else "bfloat16"
    if kv_cache_dtype == "bf16":
        kv_cache_dtype = "bfloat16"
    ensure(
        kv_cache_dtype in ("bfloat16", "fp8_e4m3"),
        "DeepSeek DSA only supports bf16/bfloat16 or fp8_e4m3 kv_cache_dtype",
    )
    return {"kv_cache_dtype": kv_cache_dtype} if kv_cache_dtype != view.kv_cache_dtype else None


def _hisparse_backend(kv_cache_dtype, platform) -> str:
    if platform.is_hip:
        return "tilelang"
    return "flashmla_kv" if kv_cache_dtype == "fp8_e4m3" else "flashmla_sparse"


def _fill_unset(view, prefill: str, decode: str) -> dict:
    declared = {}
    if view.dsa_prefill_backend is None:
        declared["dsa_prefill_backend"] = prefill
    if view.dsa_decode_backend is None:
        declared["dsa_decode_backend"] = decode
    return declared


@rule("_dsa_split_backend_resolution", whitelist=True)
def dsa_split_backend_resolution(view, model, platform):
    """Fill the DSA prefill/decode backends the user left unset: flashinfer_sparse_mla
    for GLM FP8 on SM120 (PR 29580), tilelang on ROCm, trtllm / flashmla_kv for FP8,
    flashmla_sparse + trtllm / fa3 for bfloat16."""
    if not _dsa_on_gpu(model, platform):
        return None
    major = platform.capability_major
    kv_cache_dtype = view.kv_cache_dtype
    if (
        model.architecture == "GlmMoeDsaForCausalLM"
        and major == 12
        and kv_cache_dtype == "fp8_e4m3"
        and not platform.is_hip
    ):
        # NOTE: FlashInfer's TRTLLM-gen MLA and DeepGEMM's paged-MQA metadata do not run on SM120.
        return _fill_unset(view, "flashinfer_sparse_mla", "flashinfer_sparse_mla")
    if view.enable_hisparse:
        backend = _hisparse_backend(kv_cache_dtype, platform)
        return _fill_unset(view, backend, backend)
    user_set = view.dsa_prefill_backend is not None or view.dsa_decode_backend is not None
    if not user_set and platform.is_hip:
        declared = _fill_unset(view, "tilelang", "tilelang")
    elif kv_cache_dtype == "fp8_e4m3":
        default = "trtllm" if major >= 10 else "flashmla_kv"
        declared = _fill_unset(view, default, default)
    else:
        declared = _fill_unset(view, "flashmla_sparse", "trtllm" if major >= 10 else "fa3")
    prefill = declared.get("dsa_prefill_backend", view.dsa_prefill_backend)
    decode = declared.get("dsa_decode_backend", view.dsa_decode_backend)
    if not platform.is_hip and kv_cache_dtype == "fp8_e4m3" and "tilelang" in (prefill, decode):
        reject(
            "The tilelang DSA prefill/decode kernels only support an fp8_e4m3 KV "
            "cache on ROCm/HIP; on CUDA they require a bfloat16 KV cache. Use "
            "--kv-cache-dtype bfloat16 with the tilelang backend, or keep "
            "--kv-cache-dtype fp8_e4m3 and pick an fp8-capable DSA backend "
            "(flashmla_kv on Hopper, trtllm on Blackwell)."
        )
    return declared


def kimi_thinking_int4(model, quant_method) -> bool:
    """Kimi K2 / K2.5 thinking's compressed-tensors int4 group-32 recipe."""
    weights = (hf_quant_config(model).get("config_groups") or {}).get("group_0", {}).get("weights", {})
    return (
        quant_method == "compressed-tensors"
        and weights.get("num_bits") == 4
        and weights.get("group_size") == 32
        and weights.get("strategy") == "group"
        and weights.get("type") == "int"
    )


@rule(
    "_deepseek_moe_quant_resolution",
    overrides=("moe_runner_backend", "fp8_gemm_runner_backend"),
    whitelist=True,
)
def deepseek_moe_quant_resolution(view, model, platform):
    """On SM100 the DeepSeek family adopts the checkpoint's quant method and runs
    flashinfer_trtllm MoE (and FP8 GEMM for LongCat's non-ue8m0 FP8)."""
    arch = model.architecture
    if arch not in DEEPSEEK_BRANCH_ARCHS or not platform.is_sm100:
        return None
    quant_cfg = hf_quant_config(model)
    quant_method = hf_quant_method(model)
    int4_thinking = kimi_thinking_int4(model, quant_method)
    declared: dict = {}
    quantization = view.quantization
    if quantization is None and not quantization_explicitly_unset(view):
        # NOTE: a DeepSeek-V3 config without quant_method would need the weight
        # headers to detect native FP8 experts; with only config.json it stays bf16.
        if quant_method is not None:
            quantization = declared["quantization"] = quant_method
    if (
        view.moe_a2a_backend == "none"
        and view.moe_runner_backend == "auto"
        and not arch.startswith("LongcatFlash")
        and (quantization in _TRTLLM_MOE_QUANTS or int4_thinking)
    ):
        declared["moe_runner_backend"] = "flashinfer_trtllm"
    if (
        arch in ("LongcatFlashForCausalLM", "LongcatFlashForCausalLMNextN")
        and view.fp8_gemm_runner_backend == "auto"
        and quantization in ("fp8", "modelopt_fp8")
        and quant_cfg.get("scale_fmt") != "ue8m0"
    ):
        declared["fp8_gemm_runner_backend"] = "flashinfer_trtllm"
    return declared


@rule(
    "_deepseek_spec_moe_resolution",
    overrides=("speculative_moe_runner_backend", "speculative_moe_a2a_backend"),
    whitelist=True,
)
def deepseek_spec_moe_resolution(view, model, platform):
    """On ROCm the bf16 NextN draft of a DeepSeek FP4 checkpoint runs triton MoE
    without all-to-all (deep_gemm + deepep when its FP8 variant is requested)."""
    if model.architecture not in DEEPSEEK_BRANCH_ARCHS or not platform.is_hip:
        return None
    if not (
        view.quantization == "modelopt_fp4"
        and view.speculative_algorithm == "EAGLE"
        and (view.speculative_moe_runner_backend is None or view.speculative_moe_a2a_backend is None)
    ):
        return None
    if env_flag(view, "SGLANG_NVFP4_CKPT_FP8_NEXTN_MOE"):
        if view.ep_size == 1:
            reject(
                "Invalid configuration: 'deep_gemm' speculative MoE runner backend with "
                "'deepep' a2a backend requires expert parallelism (ep_size > 1). "
                f"Current ep_size is {view.ep_size}. "
                "Please set --ep-size > 1 (e.g., --ep-size 8) to use this configuration, "
                "or change --speculative-moe-a2a-backend to 'none' if expert parallelism is not available."
            )
        return {"speculative_moe_runner_backend": "deep_gemm", "speculative_moe_a2a_backend": "deepep"}
    return {"speculative_moe_runner_backend": "triton", "speculative_moe_a2a_backend": "none"}
