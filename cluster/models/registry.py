"""Which class implements each HF architecture name (``config.json``'s ``architectures[0]``).

Modules are imported on first use, so asking for a dense model never imports the
MoE or MLA code.
"""

from __future__ import annotations

import importlib

_DENSE = "flotilla.cluster.models.llama"
_MOE = "flotilla.cluster.models.moe_models"
_DEEPSEEK = "flotilla.cluster.models.deepseek"
_GLM4_MOE = "flotilla.cluster.models.glm4_moe"
_DSA = "flotilla.cluster.models.dsa"

# architecture -> (module, class name)
_ARCHITECTURES: dict[str, tuple[str, str]] = {
    "LlamaForCausalLM": (_DENSE, "LlamaForCausalLM"),
    "MistralForCausalLM": (_DENSE, "MistralForCausalLM"),
    "Qwen2ForCausalLM": (_DENSE, "Qwen2ForCausalLM"),
    "Qwen3ForCausalLM": (_DENSE, "Qwen3ForCausalLM"),
    "Qwen3MoeForCausalLM": (_MOE, "Qwen3MoeForCausalLM"),
    "MixtralForCausalLM": (_MOE, "MixtralForCausalLM"),
    "DeepseekV2ForCausalLM": (_DEEPSEEK, "DeepseekV2ForCausalLM"),
    "DeepseekV3ForCausalLM": (_DEEPSEEK, "DeepseekV3ForCausalLM"),
    "DeepseekV32ForCausalLM": (_DSA, "DeepseekV32ForCausalLM"),
    "Glm4MoeForCausalLM": (_GLM4_MOE, "Glm4MoeForCausalLM"),
    "GlmMoeDsaForCausalLM": (_DSA, "GlmMoeDsaForCausalLM"),
}


def supported_architectures() -> list[str]:
    """Every architecture name :func:`model_class` accepts, sorted."""
    return sorted(_ARCHITECTURES)


def model_class(architecture: str) -> type:
    """The model class for an HF architecture name; ValueError naming it (and the
    supported ones) when unknown."""
    try:
        module_name, class_name = _ARCHITECTURES[architecture]
    except KeyError:
        raise ValueError(
            f"unsupported model architecture {architecture!r}; supported: {', '.join(supported_architectures())}"
        ) from None
    return getattr(importlib.import_module(module_name), class_name)


def block_fp8_architectures() -> list[str]:
    """The architectures whose class loads block-FP8 checkpoints (``loads_block_fp8``), sorted;
    imports every model module."""
    return [name for name in supported_architectures() if getattr(model_class(name), "loads_block_fp8", False)]


def architecture_of(hf_config: dict) -> str:
    """``architectures[0]`` of an HF config dict; ValueError when the config names none."""
    names = hf_config.get("architectures") or []
    if not names:
        raise ValueError(
            "config.json has no 'architectures' entry; add e.g. \"architectures\": [\"LlamaForCausalLM\"] "
            f"(supported: {', '.join(supported_architectures())})"
        )
    return names[0]
