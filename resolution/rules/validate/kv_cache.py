"""KV-cache compatibility checks and the unified memory pool's layout
requirements (SGLang's ``handle_cache_compatibility``,
``handle_page_major_kv_layout`` and ``handle_unified_memory_pool``).

not ported: the lazy-compaction check of unified memory under PD
disaggregation reads SGLANG_DISABLE_LAZY_COMPACTION, which no rule declares
(so it always passes).
"""

from __future__ import annotations

from flotilla.resolution.engine import ensure, reject, rule
from flotilla.resolution.rules.common import attention_backends
from flotilla.resolution.rules.normalise.cuda_graph import DISABLED, PREFILL, phase_backend, with_phase


@rule("_handle_cache_compatibility")
def handle_cache_compatibility(view, model, platform):
    """Decode retraction backups, hierarchical cache and KV offload must be compatible.

    The SWA full-token ratio must lie in (0, 1]."""
    host_pool = view.disaggregation_decode_retraction_backup == "host_pool"
    if host_pool and view.disaggregation_mode != "decode":
        reject("--disaggregation-decode-retraction-backup=host_pool is only supported on a PD decode server.")
    if host_pool and view.dcp_size > 1:
        reject("--disaggregation-decode-retraction-backup=host_pool does not support --dcp-size > 1.")
    if host_pool and view.enable_priority_scheduling and not view.disable_priority_preemption:
        reject(
            "--disaggregation-decode-retraction-backup=host_pool requires "
            "--disable-priority-preemption when priority scheduling is enabled."
        )
    if view.enable_hierarchical_cache and view.disable_radix_cache:
        reject(
            "The arguments enable-hierarchical-cache and disable-radix-cache are mutually exclusive "
            "and cannot be used at the same time. Please use only one of them."
        )
    if view.disaggregation_decode_enable_offload_kvcache:
        if view.disaggregation_mode != "decode":
            reject("The argument disaggregation-decode-enable-offload-kvcache is only supported for decode side.")
        if view.hicache_storage_backend is None:
            reject(
                "The argument disaggregation-decode-enable-offload-kvcache is only supported when "
                "hicache-storage-backend is provided."
            )
        if host_pool:
            reject(
                "The arguments disaggregation-decode-enable-offload-kvcache and "
                "disaggregation-decode-retraction-backup=host_pool are mutually exclusive: "
                "both build a decode host pool."
            )
    if not (0 < view.swa_full_tokens_ratio <= 1.0):
        reject("--swa-full-tokens-ratio should be in range (0, 1.0].")


_MLA_UNIFIED_BACKENDS = {"triton", "fa3", "trtllm_mla", "flashinfer", "cutedsl_mla", "tokenspeed_mla", "flashmla"}
_MHA_UNIFIED_BACKENDS = {"triton", "fa3", "fa4", "flashinfer", "trtllm_mha"}


@rule("_handle_page_major_kv_layout", overrides=("enable_page_major_kv_layout",))
def handle_page_major_kv_layout(view, model, platform):
    """The unified memory pool implies the page-major KV layout.

    That layout needs uniform K/V rows and kernels that read its strided views."""
    declared = {}
    page_major = view.enable_page_major_kv_layout
    if view.enable_unified_memory:
        page_major = declared["enable_page_major_kv_layout"] = True
    if not page_major:
        return declared
    ensure(
        view.enable_unified_memory,
        "--enable-page-major-kv-layout without --enable-unified-memory is "
        "temporarily unsupported: the strided MHA K/V views were removed "
        "and the static-pool page-major layout awaits its per-layer-view "
        "reimplementation. Run with --enable-unified-memory, or drop "
        "--enable-page-major-kv-layout.",
    )
    ensure(
        model.is_mla or not model.has_asymmetric_kv,
        "--enable-unified-memory requires uniform K/V rows "
        "(head_dim == v_head_dim); this model has "
        f"head_dim={model.head_dim}, "
        f"v_head_dim={model.v_head_dim}, "
        f"swa_head_dim={model.swa_head_dim}, "
        f"swa_v_head_dim={model.swa_v_head_dim}. The unified "
        "pool's per-layer views require a uniform row width; run "
        "this model without --enable-unified-memory.",
    )
    allowed = _MLA_UNIFIED_BACKENDS if model.is_mla else _MHA_UNIFIED_BACKENDS
    backends = set(attention_backends(view)) - {None}
    ensure(
        backends <= allowed,
        "--enable-page-major-kv-layout: the resolved attention backends "
        f"{sorted(backends)} are not in the allowed set "
        f"{sorted(allowed)} for this configuration (unified memory "
        "allows the per-layer-view families; plain page-major keeps the "
        "envelope-strided views only Triton reads). Pass a compatible "
        "--attention-backend.",
    )
    decode_allowed = {"triton", "flashinfer"}
    prefill_allowed = {"triton", "flashkda"}
    if model.is_mla:
        decode_allowed |= {"cutedsl", "helion"}
        prefill_allowed |= {"cutedsl", "helion"}
    linear_decode = view.linear_attn_decode_backend or view.linear_attn_backend
    linear_prefill = view.linear_attn_prefill_backend or view.linear_attn_backend
    ensure(
        linear_decode in decode_allowed | {None},
        "--enable-page-major-kv-layout: linear-attention DECODE backend must "
        f"be one of {sorted(decode_allowed)} for the strided conv/SSM state; "
        f"got {linear_decode!r}.",
    )
    ensure(
        linear_prefill in prefill_allowed | {None},
        "--enable-page-major-kv-layout: linear-attention PREFILL backend must "
        f"be one of {sorted(prefill_allowed)} for the strided conv/SSM state; "
        f"got {linear_prefill!r}.",
    )
    ensure(
        view.mamba_backend in (None, "triton"),
        "--enable-page-major-kv-layout requires the Triton Mamba kernels for "
        f"the strided conv/SSM state; got {view.mamba_backend!r}. Pass "
        "--mamba-backend triton.",
    )
    return declared


_DSPARK_UNIFIED_BACKENDS = {"triton", "trtllm_mla", "cutedsl_mla", "tokenspeed_mla"}


def _check_unified_memory_disaggregation(view) -> None:
    ensure(
        view.disaggregation_transfer_backend == "mooncake",
        "--enable-unified-memory with PD disaggregation supports only "
        "the mooncake transfer backend; got "
        f"{view.disaggregation_transfer_backend!r}.",
    )
    ensure(
        view.pp_size == 1,
        "--enable-unified-memory with PD disaggregation does not support "
        "pipeline parallelism (whole-envelope transfer has no per-layer "
        "entries to subset).",
    )
    ensure(
        not view.enable_hisparse,
        "--enable-unified-memory with PD disaggregation is not compatible "
        "with --enable-hisparse: the decode-side HiSparse prealloc path "
        "ships host/C4 rows straight from the allocator, bypassing the "
        "virtual->physical translation the unified pool needs.",
    )


@rule("_handle_unified_memory_pool", overrides=("cuda_graph_config",))
def handle_unified_memory_pool(view, model, platform):
    """The unified memory pool captures decode CUDA graphs only (prefill graphs off).

    It also needs DSPARK-only speculation, no host KV tiers and no decode
    context parallelism."""
    if not view.enable_unified_memory:
        return None
    if view.disaggregation_mode != "null":
        _check_unified_memory_disaggregation(view)
    algorithm = view.speculative_algorithm
    ensure(
        algorithm in (None, "DSPARK"),
        "--enable-unified-memory only supports --speculative-algorithm "
        "DSPARK (chain draft); other speculative algorithms are not yet "
        "audited for the unified pool's virtual/kernel-facing loc translation. Got "
        f"--speculative-algorithm={algorithm!r}.",
    )
    if algorithm == "DSPARK":
        ensure(
            view.speculative_eagle_topk in (None, 1),
            "--enable-unified-memory + DSPARK supports a linear draft "
            "chain only (--speculative-eagle-topk in {None, 1}); tree "
            "verify is not audited for the unified pool. Got "
            f"--speculative-eagle-topk={view.speculative_eagle_topk!r}.",
        )
        backends = set(attention_backends(view)) - {None}
        ensure(
            backends <= _DSPARK_UNIFIED_BACKENDS,
            "--enable-unified-memory + DSPARK requires spec-verify-audited "
            f"attention backends {sorted(_DSPARK_UNIFIED_BACKENDS)} for both prefill "
            f"and decode; got {sorted(backends)}. flashinfer / fa3 do "
            "not translate speculative verify indices to the unified "
            "pool's kernel-facing space yet.",
        )
    ensure(
        not (view.enable_hierarchical_cache or view.enable_lmcache),
        "--enable-unified-memory is not yet compatible with hierarchical / "
        "host-tiered KV cache (--enable-hierarchical-cache / --enable-lmcache): "
        "the unified-memory-pool init wires up no host pools, and its device mamba / "
        "full-attention slots are VIRTUAL — the host-offload path does not "
        "translate them to physical.",
    )
    ensure(
        view.dcp_size == 1,
        "--enable-unified-memory is not yet compatible with decode context "
        "parallelism (--dcp-size > 1): the pool has no DCP-aware masked write "
        "path (UnifiedMHATokenToKVPool.set_kv_buffer asserts dcp_kv_mask is None), "
        "so a DCP run would boot and then fail on the first KV write.",
    )
    if view.cuda_graph_config is None or phase_backend(view, PREFILL) == DISABLED:
        return None
    if view.cuda_graph_backend_prefill is not None:
        reject(
            "--enable-unified-memory supports decode cuda-graph "
            "capture only; prefill capture is not wired (the prefill "
            "graph runner bypasses the unified virtual->physical loc "
            "rebind). Got --cuda-graph-backend-prefill="
            f"{view.cuda_graph_backend_prefill!r}; pass "
            "--cuda-graph-backend-prefill=disabled."
        )
    return {"cuda_graph_config": with_phase(view.cuda_graph_config, PREFILL, backend=DISABLED)}
