"""Hierarchical KV cache (SGLang's ``handle_hicache``): host-memory mode checks,
layout/IO and storage/layout normalisation, and DCP limits.

Every rule here applies only when a host KV tier is in play: HiCache itself,
decode-side KV offload, or a decode server whose retraction backup is the host
pool.

not ported: the "no host pool size" raise of the host-memory-mode check; it is
unreachable once ``_handle_hicache_ratio_default`` (normalise phase) has run.
"""

from __future__ import annotations

from flotilla.resolution.engine import reject, rule


def hicache_active(view) -> bool:
    """A host KV tier is configured, so the HiCache knobs matter."""
    return bool(
        view.enable_hierarchical_cache
        or view.disaggregation_decode_enable_offload_kvcache
        or (
            view.disaggregation_mode == "decode"
            and view.disaggregation_decode_retraction_backup in (None, "host_pool")
        )
    )


@rule("_handle_hicache")
def _validate_hicache_host_memory_mode(view, model, platform):
    """The host memory mode is ``cache`` or ``buffer_only``; buffer-only needs
    a storage backend, no write-back, and a non-decode server."""
    if not hicache_active(view):
        return None
    mode = view.hicache_host_memory_mode
    if mode not in ("cache", "buffer_only"):
        reject(f"hicache_host_memory_mode must be 'cache' or 'buffer_only', got {mode!r}")
    if mode == "cache":
        return None
    if view.hicache_storage_backend is None:
        reject(
            "--hicache-host-memory-mode buffer_only requires a storage backend "
            "(--hicache-storage-backend): host memory is only a staging buffer "
            "and all cached data lives in storage."
        )
    if view.hicache_write_policy == "write_back":
        reject(
            "--hicache-host-memory-mode buffer_only does not support "
            "--hicache-write-policy write_back; use write_through or "
            "write_through_selective."
        )
    if view.disaggregation_mode == "decode":
        reject(
            "--hicache-host-memory-mode buffer_only is not supported on "
            "decode instances: the decode-side prefetch and offload paths "
            "bypass the buffer-mode pipeline, fetching without its prefix "
            "context and never consuming its staged holds. Prefill "
            "instances share the standard scheduler path and are supported."
        )
    return None


@rule(
    "_resolve_layout_io_compatibility",
    overrides=("hicache_io_backend", "hicache_mem_layout"),
)
def _resolve_layout_io_compatibility(view, model, platform):
    """The page-first-direct layout needs direct IO, and direct IO needs the
    page-first-direct layout (the kernel IO backend cannot drive it)."""
    if not hicache_active(view):
        return None
    layout, io = view.hicache_mem_layout, view.hicache_io_backend
    if layout == "page_first_direct" and io == "kernel":
        return {"hicache_io_backend": "direct"}
    if layout == "page_first" and io == "direct":
        return {"hicache_mem_layout": "page_first_direct"}
    return None


@rule("_resolve_storage_layout_compatibility", overrides=("hicache_mem_layout",))
def _resolve_storage_layout_compatibility(view, model, platform):
    """Mooncake storage cannot take the layer-first layout: it becomes the
    page-first layout matching the IO backend."""
    if not hicache_active(view):
        return None
    if view.hicache_storage_backend != "mooncake" or view.hicache_mem_layout != "layer_first":
        return None
    io = view.hicache_io_backend
    layout = {"direct": "page_first_direct", "kernel": "page_first"}.get(io, view.hicache_mem_layout)
    return {"hicache_mem_layout": layout}


@rule("_handle_hicache")
def _resolve_hicache_dcp_compatibility(view, model, platform):
    """HiCache with decode context parallelism is L1/L2 only, for MLA models,
    without LMCache, HiSparse or non-DSPARK speculative decoding."""
    if not hicache_active(view):
        return None
    if view.dcp_size <= 1 or not view.enable_hierarchical_cache:
        return None
    unsupported = "NotImplementedError"
    if view.hicache_storage_backend is not None:
        reject(
            "--hicache-storage-backend (L3) with --dcp-size > 1 is not "
            "supported yet: under DCP each rank holds a distinct "
            "interleaved MLA KV shard, so the rank-0-only replicated-MLA "
            "backup and the storage keys must become dcp_rank-aware "
            "first. Run HiCache+DCP with L1/L2 only.",
            kind=unsupported,
        )
    if view.speculative_algorithm not in (None, "DSPARK"):
        reject(
            "HiCache with --dcp-size > 1 only supports DSPARK speculative "
            "decoding; other draft-model host pools have no DCP index "
            "translation.",
            kind=unsupported,
        )
    if view.enable_lmcache:
        reject(
            "--enable-lmcache with --dcp-size > 1 is not supported: "
            "LMCache has no DCP-aware index translation.",
            kind=unsupported,
        )
    if view.enable_hisparse:
        reject(
            "--enable-hisparse with --dcp-size > 1 is not supported: the "
            "HiSparse host pool is constructed without DCP translation.",
            kind=unsupported,
        )
    if not model.is_mla:
        reject(
            "HiCache with --dcp-size > 1 is only supported for MLA models: "
            "the index translation lives in MLATokenToKVPoolHost, and the "
            "MHA host pool has none.",
            kind=unsupported,
        )
    return None
