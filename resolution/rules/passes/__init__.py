"""Rules of the passes phase, in the order they run (see STEPS).

The phase covers SGLang 0.5.19's pipeline from the sampling-backend default to
``handle_hicache``: kernel backends, deterministic inference, the attention
backend and everything it constrains, Mamba/linear attention, KV-cache dtypes,
the page-size default and the small handlers after it.

``hisparse`` holds ``_hisparse_validation``, which SGLang runs at launch
(``check_server_args``), not during resolution; it is deliberately not a step.

Handler bodies that declare and then read their own declaration are split into
consecutive rules carrying the handler's name, so each reads the state the
handler saw at that point.
"""

from flotilla.resolution.rules.passes import (
    attention_checks,
    attention_default,
    attention_pages,
    cuda_graph,
    deterministic,
    hicache,
    kv_cache,
    mamba,
    page_size,
    platform_tail,
    sampling,
)

STEPS: list = [
    sampling._sampling_backend_default,
    # handle_deterministic_inference
    deterministic._deterministic_inference_enable,
    deterministic._deterministic_allreduce_fusion_disable,
    deterministic._deterministic_sampling_backend,
    deterministic._deterministic_attention_backend,
    deterministic._deterministic_inference_checks,
    # handle_attention_backend_compatibility
    attention_default._attention_backend_default,
    attention_default._attention_graph_and_radix_adjustments,
    attention_pages._mla_backend_page_constraints,
    attention_checks._mla_kv_cache_dtype_checks,
    attention_checks._cutedsl_prefill_backend_fill,
    attention_checks._trtllm_mha_platform_checks,
    attention_checks._attention_backend_fa3_fp8_fallback,
    attention_pages._fa4_page_constraint,
    attention_checks._aiter_long_context_memory_reserve,
    attention_checks._attention_backend_platform_fallbacks,
    attention_checks._intel_xpu_mla_prefill_check,
    attention_pages._intel_xpu_page_constraint,
    attention_checks._attention_backend_dual_chunk,
    attention_checks._dual_chunk_disables_mixed_chunk_and_radix,
    # NOTE: must follow the attention handler: it reads the final prefill backend.
    cuda_graph._disable_prefill_cuda_graph_for_deepseek_trtllm_mla,
    mamba._handle_mamba_backend,
    mamba._handle_int8_mamba_checkpoint,
    mamba._handle_linear_attn_backend,
    kv_cache._handle_kv4_compatibility,
    kv_cache._handle_mxfp8_kv_cache_compatibility,
    # NOTE: after every backend page-size snap above, so it only fills the gap.
    page_size._page_size_default,
    platform_tail._handle_amd_specifics,
    platform_tail._handle_nccl_pre_warm,
    platform_tail._handle_grammar_backend,
    platform_tail._handle_multi_item_scoring,
    kv_cache._handle_prefill_only_disable_kv_cache,
    # handle_hicache
    hicache._validate_hicache_host_memory_mode,
    hicache._resolve_layout_io_compatibility,
    hicache._resolve_storage_layout_compatibility,
    hicache._resolve_hicache_dcp_compatibility,
]

__all__ = ["STEPS"]
