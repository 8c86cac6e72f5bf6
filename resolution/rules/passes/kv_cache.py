"""KV-cache dtype compatibility with the attention backends (SGLang's
``handle_kv4_compatibility``, ``handle_mxfp8_kv_cache_compatibility`` and
``handle_prefill_only_disable_kv_cache``).

not ported: the KV4 "mixed prefill/decode backends" warning (logging only).
"""

from __future__ import annotations

from flotilla.resolution.engine import ensure, reject, rule
from flotilla.resolution.rules.common import attention_backends

_KV4_MLA_BACKENDS = ["cutlass_mla", "flashinfer", "trtllm_mla"]
_KV4_FA4_MHA_DECODE_BACKENDS = ["triton", "torch_native", "flex_attention"]
_KV4_MHA_BACKENDS = ["triton", "torch_native", "flex_attention", "trtllm_mha"]


@rule("_handle_kv4_compatibility")
def _handle_kv4_compatibility(view, model, platform):
    """FP4 KV caches (nvfp4, fp4_mx_block16) are CUDA-only, nvfp4 needs
    SM100/SM120, and the attention backends must be ones with an FP4-KV path
    (FA4 prefill pairs with its own decode list)."""
    kv_dtype = view.kv_cache_dtype
    if kv_dtype not in ("nvfp4", "fp4_mx_block16"):
        return None
    if not platform.is_cuda:
        reject("KV4 is not tested on non-CUDA platforms.", kind="RuntimeError")
    if kv_dtype == "nvfp4" and not (platform.is_sm100 or platform.is_sm120):
        reject(
            "--kv-cache-dtype=nvfp4 requires Blackwell SM100 or SM120. "
            "Use --kv-cache-dtype=fp4_mx_block16 for the block-size-16 FP4 recipe.",
            kind="RuntimeError",
        )
    prefill, decode = attention_backends(view)
    if prefill != decode and prefill != "fa4":
        return None  # mixed backends: SGLang only warns
    if prefill == "fa4":
        if model.is_mla:
            ensure(
                decode in _KV4_MLA_BACKENDS,
                f"KV4 FA4 MLA expects decode_attention_backend to be one of "
                f"{_KV4_MLA_BACKENDS}, but got {decode}",
            )
        else:
            ensure(
                decode in _KV4_FA4_MHA_DECODE_BACKENDS,
                f"KV4 FA4 MHA expects decode_attention_backend to be one of "
                f"{_KV4_FA4_MHA_DECODE_BACKENDS}, but got {decode}",
            )
        return None
    backend = view.attention_backend
    if model.is_mla:
        ensure(
            backend in _KV4_MLA_BACKENDS,
            f"KV4 MLA expects attention_backend to be one of "
            f"{_KV4_MLA_BACKENDS}, but got {backend}",
        )
    else:
        ensure(
            backend in _KV4_MHA_BACKENDS,
            f"KV4 MHA expects attention_backend to be one of "
            f"{_KV4_MHA_BACKENDS}, but got {backend}",
        )
    return None


@rule("_handle_mxfp8_kv_cache_compatibility")
def _handle_mxfp8_kv_cache_compatibility(view, model, platform):
    """An MXFP8 KV cache needs Blackwell's block-scaled operands (FA4 path)."""
    if view.kv_cache_dtype == "mxfp8" and not platform.is_blackwell:
        reject(
            "--kv-cache-dtype mxfp8 requires an SM100+ (Blackwell) GPU for the "
            "block-scaled operands used by the FA4 MXFP8 attention path."
        )
    return None


@rule("_handle_prefill_only_disable_kv_cache")
def _handle_prefill_only_disable_kv_cache(view, model, platform):
    """Prefill-only serving without a KV cache needs an FA prefill backend
    (fa3/fa4); it runs once the attention backends are final."""
    if not view.prefill_only_disable_kv_cache:
        return None
    ensure(
        view.attention_backend is not None,
        "_handle_prefill_only_disable_kv_cache must run after "
        "_handle_attention_backend_compatibility() so the prefill backend is resolved.",
    )
    prefill, _ = attention_backends(view)
    if prefill not in ("fa3", "fa4"):
        reject(
            "--prefill-only-disable-kv-cache currently requires the FA prefill backend "
            f"(fa3/fa4), but got prefill backend {prefill!r}. Other prefill-only "
            "workloads and backends may be supported in a future change."
        )
    return None
