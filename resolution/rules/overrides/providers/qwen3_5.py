"""Model-override providers: the Qwen3-Next / Qwen3.5 hybrid (gated delta net)
family's attention defaults on SM100 (Intern-S2 Preview and Mobius included)."""

from __future__ import annotations

from flotilla.resolution.rules.common import default_attention_backend
from flotilla.resolution.rules.overrides.registry import provider

# trtllm_mha needs pages larger than one token; triton on these models runs one-token pages.
_TRTLLM_MHA_PAGE_SIZE = 64


def _mamba_extra_buffer(view):
    """The mamba radix cache keeps extra state buffers (an extra_buffer strategy with radix cache on)."""
    return view.disable_radix_cache is False and view.mamba_radix_cache_strategy in (
        "extra_buffer",
        "extra_buffer_lazy",
    )


@provider(
    "Qwen3NextForCausalLM",
    "Qwen3_5MoeForConditionalGeneration",
    "InternS2PreviewForConditionalGeneration",
    "InternS2MobiusForConditionalGeneration",
    "Qwen3_5ForConditionalGeneration",
    overrides=("page_size",),
)
def _qwen3_5_hybrid_overrides(view, model, platform):
    """On SM100 these hybrids run triton with one-token pages, or trtllm_mha with 64-token pages.

    trtllm_mha is taken only when it is the platform default and one-token
    pages are not required (they are when the radix cache is on with neither
    the mamba extra buffer nor speculative decoding).
    """
    if not platform.is_sm100 or view.attention_backend is not None:
        return {}
    # NOTE: the mamba radix-cache pass runs after the providers, so the
    # strategy read here is still the user's (usually "auto").
    needs_one_token_pages = (
        not _mamba_extra_buffer(view)
        and not view.disable_radix_cache
        and view.speculative_algorithm is None
    )
    backend = "triton"
    if default_attention_backend(view, model, platform) == "trtllm_mha" and not needs_one_token_pages:
        backend = "trtllm_mha"
    return {
        "attention_backend": backend,
        "page_size": _TRTLLM_MHA_PAGE_SIZE if backend == "trtllm_mha" else 1,
    }
