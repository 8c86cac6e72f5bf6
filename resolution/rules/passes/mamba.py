"""Mamba and linear-attention backends (SGLang's ``handle_mamba_backend``,
``handle_int8_mamba_checkpoint`` and ``handle_linear_attn_backend``).

not ported: the ``import flashinfer.mamba`` probe (FlashInfer being usable
stands for it).
"""

from __future__ import annotations

from flotilla.resolution.engine import reject, rule

_STATIC_RAGGED_VERIFY = "static"  # SGLANG_RAGGED_VERIFY_MODE default


@rule("_handle_mamba_backend")
def _handle_mamba_backend(view, model, platform):
    """Mamba cache knobs are in range, stochastic rounding has the dtype and
    GPU it needs, and the FlashInfer mamba backend has FlashInfer."""
    if view.mamba_cache_philox_rounds < 0:
        reject("--mamba-cache-philox-rounds must be non-negative.")
    states = view.mamba_max_states_per_path
    if states == 0 or states < -1:
        reject(
            "--mamba-max-states-per-path must be -1 (unlimited) or a positive "
            f"integer, got {states}."
        )
    rounding = view.enable_mamba_cache_stochastic_rounding
    if rounding:
        if view.mamba_ssm_dtype != "float16":
            reject(
                "Stochastic rounding for the Mamba SSM cache requires "
                f"--mamba-ssm-dtype float16, got {view.mamba_ssm_dtype!r}. "
                "Run with --mamba-ssm-dtype float16 or disable "
                "--enable-mamba-cache-stochastic-rounding."
            )
        if not platform.is_cuda:
            reject(
                "Stochastic rounding for the Mamba SSM cache is only "
                "supported on NVIDIA CUDA platforms. Disable "
                "--enable-mamba-cache-stochastic-rounding on this platform."
            )
        if view.mamba_backend == "triton" and not platform.is_sm100:
            reject(
                "Stochastic rounding for the Mamba SSM cache with "
                "--mamba-backend triton requires SM100 with CUDA >= 12.8 "
                "because it uses the cvt.rs.f16x2.f32 PTX instruction. On "
                "H100/SM90, run with --mamba-backend flashinfer "
                "--mamba-ssm-dtype float16, or disable "
                "--enable-mamba-cache-stochastic-rounding."
            )
    if view.mamba_backend == "flashinfer" and not platform.flashinfer_available:
        message = "FlashInfer mamba module not available, please check the FlashInfer installation."
        if rounding:
            message += (
                " Stochastic rounding with --mamba-backend flashinfer "
                "requires FlashInfer Mamba and --mamba-ssm-dtype float16."
            )
        reject(message)
    return None


@rule("_handle_int8_mamba_checkpoint")
def _handle_int8_mamba_checkpoint(view, model, platform):
    """The int8 mamba checkpoint pool works only with the built-in mamba radix
    cache, not with host offload or a custom radix-cache backend."""
    if not view.enable_int8_mamba_checkpoint:
        return None
    if view.enable_hierarchical_cache:
        reject(
            "--enable-int8-mamba-checkpoint is not supported together with "
            "--enable-hierarchical-cache: the host-offload path "
            "is not int8-aware. Disable one of them."
        )
    if view.radix_cache_backend is not None:
        reject(
            "--enable-int8-mamba-checkpoint only supports the built-in mamba "
            f"radix cache; --radix-cache-backend={view.radix_cache_backend!r} "
            "is not int8-aware. Omit --radix-cache-backend."
        )
    return None


def _mamba_extra_buffer(view) -> bool:
    return view.disable_radix_cache is False and view.mamba_radix_cache_strategy in (
        "extra_buffer",
        "extra_buffer_lazy",
    )


def _sm100_plus(platform) -> bool:
    return platform.is_cuda and platform.capability_major >= 10


@rule(
    "_handle_linear_attn_backend",
    overrides=("linear_attn_decode_backend", "mamba_ssm_dtype"),
)
def _handle_linear_attn_backend(view, model, platform):
    """Linear-attention kernels: SM100 decodes with FlashInfer GDN when the SSM
    state is bf16; FlashKDA is prefill-only (decode falls back to Triton);
    FlashInfer on SM100+ needs bf16 state and CUDA 13 for prefill; ReplaySSM
    (buffered decode and spec verify) has its own backend, cache and
    disaggregation limits, and spec verify defaults the SSM state to fp32.
    """
    declared: dict = {}
    ssm_dtype = view.mamba_ssm_dtype
    decode_choice = view.linear_attn_decode_backend
    if (
        decode_choice is None
        and view.linear_attn_backend != "helion"
        and platform.is_sm100
        and ssm_dtype == "bfloat16"
    ):
        decode_choice = declared["linear_attn_decode_backend"] = "flashinfer"

    decode = decode_choice or view.linear_attn_backend
    if decode == "flashkda":
        if decode_choice == "flashkda":
            reject(
                "--linear-attn-decode-backend flashkda is not supported: "
                "FlashKDA is prefill-only. Use "
                "--linear-attn-prefill-backend flashkda (decode stays on triton)."
            )
        decode = declared["linear_attn_decode_backend"] = "triton"

    if decode == "flashinfer" and ssm_dtype != "bfloat16" and _sm100_plus(platform):
        reject(
            "--linear-attn-decode-backend flashinfer on SM100+ requires "
            f"--mamba-ssm-dtype bfloat16, got {ssm_dtype!r}"
        )
    verify = view.linear_attn_verify_backend
    if verify is None and decode == "flashinfer":
        verify = "flashinfer"
    if verify == "flashinfer" and ssm_dtype != "bfloat16" and _sm100_plus(platform):
        reject(
            "--linear-attn-verify-backend flashinfer on SM100+ requires "
            f"--mamba-ssm-dtype bfloat16, got {ssm_dtype!r}"
        )

    prefill = view.linear_attn_prefill_backend or view.linear_attn_backend
    cuda = platform.cuda_version
    if prefill == "flashinfer" and _sm100_plus(platform) and (cuda[0] if cuda else 0) < 13:
        shown = ".".join(str(part) for part in cuda) if cuda else "unknown"
        reject(
            "--linear-attn-prefill-backend flashinfer on SM100+ requires CUDA 13+, "
            f"got CUDA {shown}"
        )

    if view.enable_linear_replayssm:
        _check_replayssm(view, decode)
    if view.enable_linear_replayssm_spec:
        _check_replayssm_spec(view, decode)
        if ssm_dtype is None:
            declared["mamba_ssm_dtype"] = "float32"
    return declared


def _check_replayssm(view, decode) -> None:
    if decode not in ("triton", "helion"):
        reject(
            "--enable-linear-replayssm requires Triton, or Helion for "
            "KDA, as the linear-attn decode backend; got "
            f"--linear-attn-decode-backend={decode!r}."
        )
    if _mamba_extra_buffer(view):
        reject(
            "--enable-linear-replayssm requires --mamba-radix-cache-strategy "
            "no_buffer (the default); the extra_buffer ping-pong "
            "donation path is not yet supported (follow-up). Got "
            f"--mamba-radix-cache-strategy={view.mamba_radix_cache_strategy!r}."
        )
    if view.disaggregation_mode != "null":
        reject(
            "--enable-linear-replayssm is not supported under PD "
            "disaggregation yet (follow-up). Got "
            f"--disaggregation-mode={view.disaggregation_mode!r}."
        )
    if view.linear_replayssm_cache_len < 1:
        reject(
            "--linear-replayssm-cache-len must be >= 1, got "
            f"{view.linear_replayssm_cache_len}."
        )


def _check_replayssm_spec(view, decode) -> None:
    topk = view.speculative_eagle_topk
    if topk not in (None, 1):
        reject(
            "--enable-linear-replayssm-spec requires a linear draft chain "
            "(--speculative-eagle-topk in {None, 1}); the chunked verify "
            "kernel uses a strictly-lower causal mask and is invalid for "
            "EAGLE tree verify. Got "
            f"--speculative-eagle-topk={topk!r}."
        )
    if decode not in ("triton", "flashinfer"):
        reject(
            "--enable-linear-replayssm-spec requires the triton or "
            "flashinfer linear-attn decode backend, got "
            f"--linear-attn-decode-backend={decode!r}."
        )
    ragged_mode = (view.env("SGLANG_RAGGED_VERIFY_MODE") or _STATIC_RAGGED_VERIFY).lower()
    if ragged_mode != _STATIC_RAGGED_VERIFY:
        algorithm = (view.speculative_algorithm or "").upper()
        verify = view.linear_attn_verify_backend
        if algorithm not in ("DSPARK", "DFLASH") or verify not in ("triton", "nv_cutedsl"):
            reject(
                "--enable-linear-replayssm-spec with "
                f"SGLANG_RAGGED_VERIFY_MODE={ragged_mode} requires the "
                "KDA fold-every-commit family (DSPARK/DFLASH) and a "
                "ring-writing verify kernel (--linear-attn-verify-backend "
                "triton or nv_cutedsl); got "
                f"algorithm={view.speculative_algorithm!r}, "
                f"verify={verify!r}. Use SGLANG_RAGGED_VERIFY_MODE=static."
            )
    if view.disaggregation_mode == "prefill":
        reject(
            "--enable-linear-replayssm-spec is not supported on a PD "
            "prefill server: the ring is spec-verify-only scratch and "
            "the prefill server never runs spec verify."
        )
    if view.enable_linear_replayssm:
        reject(
            "--enable-linear-replayssm-spec and --enable-linear-replayssm are "
            "mutually exclusive: they share the ring storage but drive it "
            "with incompatible cursor protocols (per-decode-forward vs "
            "per-verify-commit advance)."
        )
