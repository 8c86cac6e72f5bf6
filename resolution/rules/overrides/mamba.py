"""The hybrid-mamba radix cache: whether prefix caching goes through the mamba
radix cache, which buffering strategy it uses, and the checks each strategy
needs. SGLang runs the decision twice in the model phase (before the providers
for registry-spec hybrids, after the architecture branches for every hybrid);
the second run is a no-op plus validation for the first's models.

not ported: the warning about chunked_prefill_size below the mamba cache chunk
size under extra_buffer (logging only).
"""

from __future__ import annotations

from flotilla.resolution.engine import ensure, rule

# Hybrid linear-attention architectures routed through the mamba radix cache.
MAMBA_RADIX_CACHE_ARCHS = frozenset(
    {
        "KimiLinearForCausalLM",
        "KimiK3ForConditionalGeneration",
        "BailingMoeV2_5ForCausalLM",
        "BailingMoeV3ForCausalLM",
        "Qwen3NextForCausalLM",
        "Qwen3_5MoeForConditionalGeneration",
        "InternS2PreviewForConditionalGeneration",
        "InternS2MobiusForConditionalGeneration",
        "Qwen3_5ForConditionalGeneration",
        "Qwen3_5MoeForCausalLM",
        "Qwen3_5ForCausalLM",
        "MiniCPMV4_6ForConditionalGeneration",
        "NemotronHForCausalLM",
        "NemotronHPuzzleForCausalLM",
        "FalconH1ForCausalLM",
        "JetNemotronForCausalLM",
        "JetVLMForConditionalGeneration",
        "Lfm2ForCausalLM",
        "Lfm2MoeForCausalLM",
        "ZayaForCausalLM",
    }
)

# Architectures whose mamba state pool supports the extra_buffer strategy.
MAMBA_EXTRA_BUFFER_ARCHS = frozenset(
    {
        "KimiLinearForCausalLM",
        "Qwen3_5ForConditionalGeneration",
        "Qwen3_5MoeForConditionalGeneration",
        "Qwen3_5MoeForCausalLM",
        "Qwen3_5ForCausalLM",
        "Qwen3NextForCausalLM",
        "InternS2PreviewForConditionalGeneration",
        "MiniCPMV4_6ForConditionalGeneration",
        "BailingMoeV2_5ForCausalLM",
        "BailingMoeV3ForCausalLM",
        "FalconH1ForCausalLM",
        "GraniteMoeHybridForCausalLM",
        "NemotronHForCausalLM",
        "NemotronHPuzzleForCausalLM",
        "KimiK3ForConditionalGeneration",
    }
)

_IN_TREE_HYBRIDS = MAMBA_RADIX_CACHE_ARCHS | {"GraniteMoeHybridForCausalLM"}

_FLA_CHUNK_SIZE = 64
# mamba_chunk_size where the model's config class fixes or defaults it.
_FIXED_CHUNK_SIZE = {"Lfm2ForCausalLM": 1, "Lfm2MoeForCausalLM": 1, "ZayaForCausalLM": 1}
_DEFAULT_CHUNK_SIZE = {
    "NemotronHForCausalLM": 256,
    "NemotronHPuzzleForCausalLM": 256,
    "FalconH1ForCausalLM": 256,
    "GraniteMoeHybridForCausalLM": 256,
}


def supports_extra_buffer(view, arch: str) -> bool:
    """The architecture supports extra_buffer on the configured linear-attention backend."""
    return arch in MAMBA_EXTRA_BUFFER_ARCHS and view.linear_attn_backend == "triton"


def extra_buffer_enabled(view) -> bool:
    """The radix cache is on with an extra_buffer strategy."""
    return view.disable_radix_cache is False and view.mamba_radix_cache_strategy in (
        "extra_buffer",
        "extra_buffer_lazy",
    )


def mamba_chunk_size(model) -> int:
    """The SSM prefill chunk size the model's config reports (FLA's 64 by default)."""
    arch = model.architecture
    if arch in _FIXED_CHUNK_SIZE:
        return _FIXED_CHUNK_SIZE[arch]
    if arch.startswith("NemotronH"):
        return model.get("mamba_chunk_size") or model.get("chunk_size") or 256
    return model.get("mamba_chunk_size", _DEFAULT_CHUNK_SIZE.get(arch, _FLA_CHUNK_SIZE))


def _routes_through_mamba_cache(model) -> bool:
    arch = model.architecture
    if arch == "GraniteMoeHybridForCausalLM":
        return any(kind == "mamba" for kind in model.get("layer_types") or ())
    return arch in MAMBA_RADIX_CACHE_ARCHS or has_registry_spec(model)


def has_registry_spec(model) -> bool:
    """A linear-attention registry spec routes this model through the mamba radix
    cache. SGLang 0.5.19 registers no spec for its in-tree architectures, so only
    a model outside the hybrid lists (Granite included) can qualify."""
    return model.uses_mamba_radix_cache and model.architecture not in _IN_TREE_HYBRIDS


def _resolve(view, model) -> dict:
    if not _routes_through_mamba_cache(model) or view.disable_radix_cache:
        return {}
    declared: dict = {"uses_mamba_radix_cache": True}
    if view.mamba_radix_cache_strategy == "auto":
        wants_overlap = not view.disable_overlap_schedule
        wants_paging = view.page_size is not None and view.page_size > 1
        if (wants_overlap or wants_paging) and supports_extra_buffer(view, model.architecture):
            declared["mamba_radix_cache_strategy"] = "extra_buffer"
        else:
            declared["mamba_radix_cache_strategy"] = "no_buffer"
            declared["disable_overlap_schedule"] = True
    return declared


def _validate(view, model, platform) -> None:
    if not view.uses_mamba_radix_cache:
        return
    arch = model.architecture
    if not extra_buffer_enabled(view):
        ensure(view.page_size in (1, None), "no_buffer only supports page_size=1.")
        ensure(
            view.disable_overlap_schedule,
            "no_buffer do not support overlap schedule. Try to set disable_overlap_schedule=True.",
        )
        ensure(view.attention_backend != "trtllm_mha", "no_buffer do not support trtllm_mha attention backend.")
        return
    ensure(supports_extra_buffer(view, arch), f"extra_buffer is not supported for {arch}; use no_buffer.")
    ensure(platform.device in ("cuda", "hip", "musa", "npu", "xpu"), "extra_buffer needs CUDA/MUSA/NPU/ROCm/XPU (FLA).")
    if view.mamba_radix_cache_strategy == "extra_buffer_lazy":
        ensure(
            view.disaggregation_mode == "null",
            "extra_buffer_lazy unsupported under PD disaggregation; use "
            "--mamba-radix-cache-strategy extra_buffer.",
        )
    if view.speculative_num_draft_tokens is not None:
        ensure(
            view.mamba_track_interval >= view.speculative_num_draft_tokens,
            f"mamba_track_interval ({view.mamba_track_interval}) must be at least "
            f"speculative_num_draft_tokens ({view.speculative_num_draft_tokens}).",
        )
    if view.page_size is not None:
        page_size = view.page_size
        ensure(
            view.mamba_track_interval % page_size == 0,
            f"mamba_track_interval ({view.mamba_track_interval}) must be a multiple of page_size ({page_size}).",
        )
        chunk_size = mamba_chunk_size(model)
        ensure(
            max(chunk_size, page_size) % min(chunk_size, page_size) == 0,
            "For SSM models, either chunk_size or page_size must be divisible by the other, "
            f"got chunk_size={chunk_size!r}, page_size={page_size!r}",
        )


@rule("_mamba_radix_cache_resolution", overrides=("mamba_radix_cache_strategy",), whitelist=True)
def mamba_radix_cache_pre_dispatch(view, model, platform):
    """Registry-spec hybrid models pick their mamba radix cache strategy before the providers run."""
    if not has_registry_spec(model):
        return {}
    return _resolve(view, model)


@rule("handle_mamba_radix_cache")
def mamba_radix_cache_pre_dispatch_checks(view, model, platform):
    """Check the strategy a registry-spec hybrid model chose can serve this launch."""
    if has_registry_spec(model):
        _validate(view, model, platform)


@rule("_mamba_radix_cache_resolution", overrides=("mamba_radix_cache_strategy",), whitelist=True)
def mamba_radix_cache(view, model, platform):
    """Hybrid mamba models cache prefixes in the mamba radix cache: extra_buffer when
    overlap or paging needs it and the model supports it, else no_buffer without overlap."""
    return _resolve(view, model)


@rule("handle_mamba_radix_cache")
def mamba_radix_cache_checks(view, model, platform):
    """Check the mamba radix cache strategy can serve this launch (page size, overlap,
    backend, speculative draft width)."""
    _validate(view, model, platform)
