"""Validations and fallbacks of SGLang's ``handle_attention_backend_compatibility``
after the default is chosen: MLA kv-cache dtypes, the CuteDSL prefill fill,
TensorRT-LLM MHA platform limits, the FA3/fp8_e5m2 and Intel fallbacks, the
aiter memory reserve and dual-chunk attention.

not ported: SGLANG_AITER_HONOR_EXPLICIT_MEM_FRACTION is read from declarations
only (clean environment), so the aiter reserve applies unless a rule set it.
"""

from __future__ import annotations

from flotilla.resolution.engine import ensure, reject, rule
from flotilla.resolution.rules.common import attention_backends, env_flag


def _float_env(view, name: str) -> float:
    raw = view.env(name)
    try:
        return float(raw) if raw not in (None, "") else 0.0
    except ValueError:
        return 0.0


def _on_base_or_decode(view, backend: str) -> bool:
    return backend in (view.attention_backend, view.decode_attention_backend)


@rule("_mla_kv_cache_dtype_checks", whitelist=True)
def _mla_kv_cache_dtype_checks(view, model, platform):
    """TRT-LLM MLA and tokenspeed MLA run only on Blackwell, and only with the
    KV-cache dtypes their kernels implement."""
    if _on_base_or_decode(view, "trtllm_mla"):
        if not platform.is_blackwell:
            reject(
                "TRTLLM MLA backend is only supported on Blackwell GPUs (SM100/SM12x). "
                "Please use a different backend."
            )
        if view.kv_cache_dtype not in ("fp8_e4m3", "fp4_e2m1", "bf16", "auto"):
            reject(
                "TensorRT-LLM MLA backend only supports kv-cache-dtype of fp8_e4m3, "
                "fp4_e2m1, bf16, or auto."
            )
    if _on_base_or_decode(view, "tokenspeed_mla"):
        if not platform.is_blackwell:
            reject("tokenspeed_mla backend is only supported on Blackwell GPUs (SM100/SM12x).")
        if view.kv_cache_dtype != "fp8_e4m3":
            reject(
                "tokenspeed_mla backend requires kv-cache-dtype=fp8_e4m3, "
                f"got {view.kv_cache_dtype}."
            )
    return None


@rule("_cutedsl_prefill_backend_fill", whitelist=True)
def _cutedsl_prefill_backend_fill(view, model, platform):
    """CuteDSL MLA is a decode-only SM100 backend: check its limits and let
    TRT-LLM MLA do the prefill unless one was chosen."""
    backends = (
        view.attention_backend,
        view.decode_attention_backend,
        view.prefill_attention_backend,
    )
    if "cutedsl_mla" not in backends:
        return None
    ensure(
        view.prefill_attention_backend != "cutedsl_mla",
        "CuteDSL MLA only supports decoding for now",
    )
    if not platform.is_sm100:
        reject(
            "CuteDSL MLA backend is only supported on Blackwell GPUs (SM100). "
            "Please use a different backend."
        )
    if view.kv_cache_dtype not in ("fp8_e4m3", "bf16", "bfloat16", "auto"):
        reject("CuteDSL MLA backend only supports kv-cache-dtype of fp8_e4m3, bf16, or auto.")
    if view.prefill_attention_backend is None:
        return {"prefill_attention_backend": "trtllm_mla"}
    return None


@rule("_handle_attention_backend_compatibility")
def _trtllm_mha_platform_checks(view, model, platform):
    """TensorRT-LLM MHA needs SM90/SM100/SM120; its SM120 prefill (FMHAv2) has
    no fp8_e4m3 KV or skip-softmax, and prefill context parallelism needs the
    SM100 context kernel."""
    prefill, decode = attention_backends(view)
    if "trtllm_mha" not in (prefill, decode):
        return None
    supported_gpu = platform.is_sm90 or platform.is_sm100 or platform.is_sm120
    if prefill == "trtllm_mha" and not supported_gpu:
        reject(
            "TRTLLM MHA backend for prefill requires Hopper (SM90), Blackwell (SM100), or SM120 GPUs. "
            "Please use a different prefill backend."
        )
    if (
        prefill == "trtllm_mha"
        and platform.is_sm120
        and (
            view.kv_cache_dtype == "fp8_e4m3"
            or _float_env(view, "SGLANG_SKIP_SOFTMAX_PREFILL_THRESHOLD_SCALE_FACTOR") > 0
        )
    ):
        reject("TRTLLM FMHAv2 prefill on SM120 does not support fp8_e4m3 KV cache or skip-softmax.")
    if decode == "trtllm_mha" and not supported_gpu:
        reject(
            "TRTLLM MHA backend for decode is only supported on Hopper (SM90), Blackwell (SM100) "
            "and (SM120) GPUs. Please use a different decode backend."
        )
    if (
        prefill == "trtllm_mha"
        and not platform.is_sm100
        and (view.enable_prefill_context_parallel or view.attn_cp_size > 1)
    ):
        reject(
            "Prefill context parallelism with the TRTLLM MHA prefill backend "
            "requires SM100 (trtllm-gen context kernel): the SM90/SM120 "
            "fmha_v2 prefill path does not implement CP shard masking."
        )
    return None


@rule("_attention_backend_fa3_fp8_fallback", overrides=("attention_backend",), whitelist=True)
def _attention_backend_fa3_fp8_fallback(view, model, platform):
    """FA3's FP8 KV path is e4m3 only: an fp8_e5m2 cache moves FA3 to Triton."""
    if view.attention_backend == "fa3" and view.kv_cache_dtype == "fp8_e5m2":
        return {"attention_backend": "triton"}
    return None


@rule("_handle_attention_backend_compatibility", overrides=("mem_fraction_static",))
def _aiter_long_context_memory_reserve(view, model, platform):
    """aiter attention on contexts over 8192 tokens needs workspace outside the
    static pool: mem_fraction_static shrinks by 15%, unless the user set it and
    SGLANG_AITER_HONOR_EXPLICIT_MEM_FRACTION asks to keep it."""
    if view.attention_backend != "aiter":
        return None
    context_len = view.context_length or model.context_len
    if context_len is None or context_len <= 8192:
        return None
    honour = env_flag(view, "SGLANG_AITER_HONOR_EXPLICIT_MEM_FRACTION")
    if view.explicit("mem_fraction_static") and honour:
        return None
    # NOTE: the memory-settings handler (normalise phase) fills the fraction
    # first; without it there is nothing to scale.
    if view.mem_fraction_static is None:
        return None
    return {"mem_fraction_static": view.mem_fraction_static * 0.85}


@rule("_attention_backend_platform_fallbacks", overrides=("attention_backend",), whitelist=True)
def _attention_backend_platform_fallbacks(view, model, platform):
    """Intel AMX attention without AMX tiles falls back to torch_native; Intel
    XPU attention without XMX engines falls back to Triton."""
    device = view.device or platform.torch_device
    if view.attention_backend == "intel_amx" and device == "cpu" and not platform.amx:
        return {"attention_backend": "torch_native"}
    if view.attention_backend == "intel_xpu" and device == "xpu" and not platform.xmx:
        return {"attention_backend": "triton"}
    return None


@rule("_handle_attention_backend_compatibility")
def _intel_xpu_mla_prefill_check(view, model, platform):
    """Intel XPU attention serves MLA models on decode only."""
    prefill, _ = attention_backends(view)
    if model.is_mla and prefill == "intel_xpu":
        reject(
            "intel_xpu backend is only supported on decode for MLA models, please set "
            "--decode-attention-backend to intel_xpu and do not set --attention-backend or "
            "--prefill-attention-backend to intel_xpu for prefill instead use triton."
        )
    return None


@rule("_attention_backend_dual_chunk", whitelist=True)
def _attention_backend_dual_chunk(view, model, platform):
    """Models with a dual-chunk attention config run on the dual-chunk
    FlashAttention backend (default when unset; any other choice is refused)."""
    if model.get("dual_chunk_attention_config") is None:
        return None
    if view.attention_backend is None:
        return {"attention_backend": "dual_chunk_flash_attn"}
    if view.attention_backend != "dual_chunk_flash_attn":
        reject(
            "Dual chunk attention is enabled, but attention backend is set to "
            f"{view.attention_backend}. Please set it to 'dual_chunk_flash_attn'."
        )
    return None


@rule(
    "_handle_attention_backend_compatibility",
    overrides=("enable_mixed_chunk", "disable_radix_cache"),
)
def _dual_chunk_disables_mixed_chunk_and_radix(view, model, platform):
    """Dual-chunk FlashAttention supports neither mixed chunks nor the radix cache."""
    if view.attention_backend == "dual_chunk_flash_attn":
        return {"enable_mixed_chunk": False, "disable_radix_cache": True}
    return None
