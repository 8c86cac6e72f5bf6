"""Flag-combination validations of the normalise phase (multimodal, SSL, ASR,
prefill-only KV cache). They declare nothing.

not ported: SSL key/certificate/CA file existence checks (paths on the worker,
not visible to resolution).
not ported: the ``granian`` import check of --enable-http2 (a package of the
serving host, not a platform fact).
"""

from __future__ import annotations

from collections.abc import Mapping

from flotilla.resolution.engine import reject, rule


def _type_name(value) -> str:
    if isinstance(value, Mapping):
        return "dict"
    if isinstance(value, tuple):
        return "list"
    return type(value).__name__


@rule("_handle_multimodal")
def handle_multimodal(view, model, platform):
    """The multimodal preprocess cache size cannot be negative and
    --mm-process-config must be an object of per-modality objects."""
    size = view.mm_preprocess_cache_size_mb
    if size is not None and size < 0:
        reject("mm_preprocess_cache_size_mb must be non-negative")
    config = view.mm_process_config
    if config is None:
        return None
    if not isinstance(config, Mapping):
        reject(
            f"mm_process_config must be a dict, but got <class '{_type_name(config)}'>",
            kind="TypeError",
        )
    for key in ("image", "video", "audio"):
        if key in config and not isinstance(config[key], Mapping):
            reject(
                f"mm_process_config['{key}'] must be a dict, "
                f"but got <class '{_type_name(config[key])}'>",
                kind="TypeError",
            )
    return None


@rule("_handle_ssl_validation")
def handle_ssl_validation(view, model, platform):
    """SSL key and certificate come as a pair; CA certs, key password and refresh need
    both; HTTP/2 bounds its stream and window settings and cannot refresh certificates."""
    keyfile, certfile = view.ssl_keyfile, view.ssl_certfile
    if keyfile and not certfile:
        reject("--ssl-keyfile requires --ssl-certfile to be specified as well.")
    if certfile and not keyfile:
        reject("--ssl-certfile requires --ssl-keyfile to be specified as well.")
    if not certfile and not keyfile:
        if view.ssl_ca_certs:
            reject("--ssl-ca-certs has no effect without --ssl-certfile and --ssl-keyfile.")
        if view.ssl_keyfile_password:
            reject(
                "--ssl-keyfile-password has no effect without --ssl-certfile and --ssl-keyfile."
            )
    if view.enable_ssl_refresh and not (certfile and keyfile):
        reject(
            "--enable-ssl-refresh requires --ssl-certfile and --ssl-keyfile "
            "to be specified."
        )
    if view.enable_http2:
        if not 0 < view.http2_max_concurrent_streams < 2**32:
            reject("--http2-max-concurrent-streams must be between 1 and 4294967295.")
        if not 1024 <= view.http2_initial_connection_window_size < 2**31:
            reject(
                "--http2-initial-connection-window-size must be between "
                "1024 and 2147483647."
            )
        if view.enable_ssl_refresh:
            reject(
                "--enable-ssl-refresh is not supported with --enable-http2. "
                "Granian does not support SSL certificate hot-reloading. "
                "Use Uvicorn (the default) or handle certificate rotation externally."
            )
    return None


@rule("_handle_asr_validation")
def handle_asr_validation(view, model, platform):
    """The ASR streaming buffer and session limits must be positive."""
    if view.asr_max_buffer_seconds <= 0:
        reject(
            f"--asr-max-buffer-seconds must be positive (got {view.asr_max_buffer_seconds})."
        )
    if view.asr_max_concurrent_sessions <= 0:
        reject(
            "--asr-max-concurrent-sessions must be positive "
            f"(got {view.asr_max_concurrent_sessions})."
        )
    return None


def check_prefill_only_embedding_and_fp4(view) -> None:
    """The first checks on --prefill-only-disable-kv-cache: it needs an embedding
    server and no FP4 KV pool (also run when EmbeddingGemma turns the flag on)."""
    if not view.is_embedding:
        reject(
            "--prefill-only-disable-kv-cache currently requires --is-embedding. "
            "Other prefill-only workloads may be supported in a future change once "
            "their attention paths stop reading or writing the paged KV cache."
        )
    if view.kv_cache_dtype in ("nvfp4", "fp4_mx_block16"):
        reject(
            "--prefill-only-disable-kv-cache does not currently support "
            "--kv-cache-dtype=nvfp4 or --kv-cache-dtype=fp4_mx_block16 because "
            "the FP4 pool uses a separate allocation path."
        )


@rule("validate_prefill_only_disable_kv_cache_args")
def validate_prefill_only_disable_kv_cache_args(view, model, platform):
    """--prefill-only-disable-kv-cache is for embedding servers with one-shot prefill
    (chunked prefill off), no radix cache, no FP4/MXFP8 KV pools, no CP and no HiSparse."""
    if not view.prefill_only_disable_kv_cache:
        return None
    check_prefill_only_embedding_and_fp4(view)
    if view.kv_cache_dtype == "mxfp8":
        reject(
            "--prefill-only-disable-kv-cache does not currently support "
            "--kv-cache-dtype=mxfp8 because the MXFP8 pool stores separate "
            "scale-factor buffers."
        )
    if view.chunked_prefill_size != -1:
        reject(
            "--prefill-only-disable-kv-cache requires --chunked-prefill-size=-1 so the FA "
            "backend takes the fa_skip_kv_cache path; otherwise the pool would be touched "
            "between prefill chunks."
        )
    if not view.disable_radix_cache:
        reject(
            "--prefill-only-disable-kv-cache requires --disable-radix-cache because the "
            "radix cache indexes KV pool slots that no longer hold real data."
        )
    if view.attn_cp_size > 1:
        reject(
            "--prefill-only-disable-kv-cache is incompatible with --attn-cp-size > 1: "
            "the context-parallel attention path writes K/V to the pool via set_kv_buffer, "
            "which the no-op pool intentionally rejects."
        )
    if view.enable_prefill_cp:
        reject(
            "--prefill-only-disable-kv-cache is incompatible with "
            "--enable-prefill-cp: the prefill-CP path stages K/V through "
            "the paged cache, which the no-op pool does not support."
        )
    if view.enable_hisparse:
        reject(
            "--prefill-only-disable-kv-cache is incompatible with --enable-hisparse: "
            "HiSparse uses a dedicated pool family that is not the no-op MHA pool."
        )
    return None
