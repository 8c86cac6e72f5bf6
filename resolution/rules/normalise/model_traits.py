"""Model facts the normalise rules need that depend on server flags too.

SGLang's ``ModelConfig`` folds ``--enable-multimodal`` into ``is_multimodal``
and derives the CUDA-graph allow/deny lists from the architecture list; these
helpers do the same from :class:`~flotilla.resolution.model.ModelFacts`.
"""

from __future__ import annotations

from typing import Any

from flotilla.resolution import model_derive

PIECEWISE_DISABLED_ARCHS = (
    "DeepseekV4ForCausalLM",
    "DeepseekV4ForCausalLMNextN",
    "DeepseekV4ForCausalLMDSpark",
    "Qwen3NextForCausalLM",
    "BailingMoeV2_5ForCausalLM",
    "LLaDAModelLM",
)

MULTIMODAL_PIECEWISE_ARCHS = (
    "KimiK25ForConditionalGeneration",
    "MiniMaxM3SparseForCausalLM",
    "MiniMaxM3SparseForConditionalGeneration",
)

MULTIMODAL_BREAKABLE_ARCHS = (
    "Cohere2VisionForConditionalGeneration",
    "InternS2MobiusForConditionalGeneration",
    "PaddleOCRVLForConditionalGeneration",
    "Qwen3_5ForConditionalGeneration",
    "Qwen3_5MoeForConditionalGeneration",
    "MuseGlimmerForConditionalGeneration",
    "KimiK3ForConditionalGeneration",
    "KimiK25ForConditionalGeneration",
)

DEEPSEEK_V4_ARCHS = (
    "DeepseekV4ForCausalLM",
    "DeepseekV4ForCausalLMNextN",
    "DeepseekV4ForCausalLMDSpark",
)


def _any_arch(model: Any, names: tuple[str, ...]) -> bool:
    return any(arch in names for arch in model.architectures)


def multimodal_enabled(view: Any) -> bool | None:
    """``--enable-multimodal`` as given (``None``: the architecture's default)."""
    return view.enable_multimodal


def is_multimodal(view: Any, model: Any) -> bool:
    """SGLang's ``ModelConfig.is_multimodal`` under the current
    ``--enable-multimodal`` and ``--model-impl``."""
    return model_derive.is_multimodal(model, view.enable_multimodal, view.model_impl)


def _mm_allowed(view: Any) -> bool:
    """The ``enable_multimodal`` gate SGLang applies to the multimodal allow lists."""
    enabled = multimodal_enabled(view)
    if enabled is not None:
        return bool(enabled)
    # NOTE: the architectures SGLang turns multimodal off for by default are in
    # neither allow list, so the default reads as enabled here.
    return True


def multimodal_piecewise_supported(view: Any, model: Any) -> bool:
    """The architecture may keep a tc_piecewise prefill graph although multimodal."""
    return _mm_allowed(view) and _any_arch(model, MULTIMODAL_PIECEWISE_ARCHS)


def multimodal_breakable_supported(view: Any, model: Any) -> bool:
    """The architecture may keep a breakable prefill graph although multimodal."""
    return _mm_allowed(view) and _any_arch(model, MULTIMODAL_BREAKABLE_ARCHS)


def piecewise_disabled_model(view: Any, model: Any) -> bool:
    """The architecture cannot run tc_piecewise prefill graphs."""
    return _any_arch(model, PIECEWISE_DISABLED_ARCHS) or (
        is_multimodal(view, model) and not _any_arch(model, MULTIMODAL_PIECEWISE_ARCHS)
    )


def is_deepseek_v4(model: Any) -> bool:
    """DeepSeek-V4 family (keyed on the first architecture, as SGLang does)."""
    return model.architecture in DEEPSEEK_V4_ARCHS
