"""``--enable-hisparse`` validation (SGLang's ``_hisparse_validation`` pass).

NOTE: SGLang 0.5.19 runs this pass from ``check_server_args`` (the launch-time
check after resolution), not from the resolution pipeline, so the reference
resolution accepts launches it would reject. It is therefore in no ``STEPS``;
:data:`HISPARSE_VALIDATION` is exported for a launch-time check to run.

not ported: the ROCm DeepSeek-V4 unified-KV guard (it keys on
SGLANG_HACK_FLASHMLA_BACKEND, unset in a clean environment, so never fires).
"""

from __future__ import annotations

from flotilla.resolution.engine import ensure, reject, rule

_DSV4_ARCHES = frozenset(
    {"DeepseekV4ForCausalLM", "DeepseekV4ForCausalLMNextN", "DeepseekV4ForCausalLMDSpark"}
)
_CUDA_BACKENDS_BY_DTYPE = {
    "bfloat16": ("flashmla_sparse",),
    "fp8_e4m3": ("flashmla_kv", "flashinfer_sparse_mla"),
}
_CUDA_BACKENDS_OTHERWISE = ("flashmla_sparse", "flashmla_kv", "flashinfer_sparse_mla")
_ROCM_BACKENDS = ("tilelang", "aiter")
_KV_DTYPES = ("bfloat16", "fp8_e4m3")


def _allowed_backends(platform, kv_cache_dtype) -> list[str]:
    if platform.is_hip:
        return sorted(_ROCM_BACKENDS)
    return sorted(_CUDA_BACKENDS_BY_DTYPE.get(kv_cache_dtype, _CUDA_BACKENDS_OTHERWISE))


@rule("_hisparse_validation", whitelist=True)
def _hisparse_validation(view, model, platform):
    """Hierarchical sparse attention runs only on DSA / DeepSeek-V4 models,
    without the radix cache, with a bf16 or fp8_e4m3 KV cache and a DSA backend
    that has a HiSparse path on this platform."""
    if not view.enable_hisparse:
        return None
    is_v4 = model.architecture in _DSV4_ARCHES
    ensure(
        model.is_dsa or is_v4,
        "--enable-hisparse is only supported for DSA (DeepSeek Sparse Attention) "
        "models (e.g., DeepSeek V3.2, GLM-5) and DeepSeek V4 now. ",
    )
    ensure(
        view.disable_radix_cache,
        "Hierarchical sparse attention currently requires --disable-radix-cache.",
    )
    if platform.is_hip and is_v4:
        return None
    kv_dtype = view.kv_cache_dtype
    if kv_dtype not in ("bfloat16", "auto", "fp8_e4m3"):
        choices = " or ".join(f"--kv-cache-dtype={dtype}" for dtype in _KV_DTYPES)
        reject(
            f"HiSparse requires one of {_KV_DTYPES} KV cache dtypes, "
            f"but got --kv-cache-dtype={kv_dtype}. Please use {choices}."
        )
    allowed = _allowed_backends(platform, kv_dtype)
    for field, label in (("dsa_prefill_backend", "prefill"), ("dsa_decode_backend", "decode")):
        backend = getattr(view, field)
        if backend is not None and backend not in allowed:
            reject(
                f"HiSparse supports DSA {label} backend(s) {allowed} "
                f"on this platform with --kv-cache-dtype={kv_dtype}, "
                f"but got --dsa-{label}-backend={backend}. "
                f"Please use one of {allowed}, or omit the option "
                "to let SGLang pick a backend for this platform."
            )
    return None


HISPARSE_VALIDATION = _hisparse_validation
