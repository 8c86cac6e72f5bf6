"""Small read helpers shared by the model-phase rules and providers.

Everything here is a pure function of a view, the model facts or the platform
facts. Environment variables are read through ``view.env`` only: resolution
assumes a clean environment, so a variable no earlier rule declared reads as
its SGLang default.
"""

from __future__ import annotations

from flotilla.resolution.errors import Violation
from flotilla.resolution.model_quant import modelopt_method

from typing import Any, Mapping

from flotilla.resolution.rules.normalise.cuda_graph import (  # noqa: F401  (re-exported)
    decode_graph_disabled,
    is_locked,
    phase_settings,
    with_phase,
)

# The DeepSeek-family architectures the DSA / MLA passes answer for (the arch
# branch itself lists one name fewer: LongCat's NextN draft never reaches it).
DEEPSEEK_FAMILY_ARCHS = frozenset(
    {
        "DeepseekV3ForCausalLM",
        "DeepseekV32ForCausalLM",
        "KimiK25ForConditionalGeneration",
        "MistralLarge3ForCausalLM",
        "PixtralForConditionalGeneration",
        "GlmMoeDsaForCausalLM",
        "LongcatFlashForCausalLM",
        "LongcatFlashForCausalLMNextN",
        "Dots3NoteForCausalLM",
    }
)

# The architectures whose model-phase branch is the DeepSeek/MLA/DSA one.
DEEPSEEK_BRANCH_ARCHS = DEEPSEEK_FAMILY_ARCHS - {"LongcatFlashForCausalLMNextN"}

# Architectures SGLang's ``is_deepseek_dsa`` accepts (with an ``index_topk``).
_DSA_ARCHS = frozenset(
    {
        "DeepseekV3ForCausalLM",
        "DeepseekV32ForCausalLM",
        "DeepseekV3ForCausalLMNextN",
        "MistralLarge3ForCausalLM",
        "PixtralForConditionalGeneration",
        "GlmMoeDsaForCausalLM",
        "GlmMoeDsaForCausalLMNextN",
        "LongcatFlashForCausalLM",
        "LongcatFlashForCausalLMNextN",
        "Dots3NoteForCausalLM",
        "Dots3NoteForCausalLMNextN",
    }
)



def is_deepseek_dsa(model: Any) -> bool:
    """DeepSeek sparse attention (V3.2, GLM-5.x, ...): a DSA-capable architecture
    whose config carries an ``index_topk`` (SGLang's ``is_deepseek_dsa``)."""
    return model.architecture in _DSA_ARCHS and model.get("index_topk") is not None


def env_is_set(view: Any, name: str) -> bool:
    """``envs.NAME.is_set()``: an earlier rule declared the variable."""
    return view.env(name) is not None


def quantization_explicitly_unset(view: Any) -> bool:
    """The user opted out of checkpoint quantization (``--quantization unquant``).

    The normalise phase turns ``unquant`` into ``None``; an explicit flag whose
    value now reads ``None`` (or still reads ``unquant``) is that opt-out.
    """
    return view.explicit("quantization") and view.quantization in (None, "unquant")


def model_config_quantization(view: Any, model: Any, platform: Any) -> str | None:
    """SGLang's ``ModelConfig.quantization``: the method the checkpoint and the
    user's ``--quantization`` reconcile to (a quantized checkpoint keeps its own
    method unless the request is a compatible override).

    NOTE: the normalise phase already rejected irreconcilable combinations
    (``ModelConfig.__init__`` rule), so this never raises for a launch that got here.
    """
    from flotilla.resolution.model_quant import verify_quantization

    try:
        return verify_quantization(
            model.quant_config,
            view.quantization,
            device=platform.device,
            capability=platform.capability,
            gcn_arch=platform.gcn_arch,
        )
    except Violation:
        return view.quantization if view.quantization not in (None, "unquant") else model.quantization


# Config classes that hoist the text config's quantization_config to the top.
_HOISTS_TEXT_QUANT = frozenset({"KimiK25ForConditionalGeneration", "KimiK3ForConditionalGeneration"})


def hf_quant_config(model: Any) -> Mapping[str, Any]:
    """``hf_config.quantization_config`` as SGLang's config object exposes it
    (top level; Kimi's multimodal configs hoist the text config's), or ``{}``."""
    qc = model.get("quantization_config")
    if qc is None and model.architecture in _HOISTS_TEXT_QUANT:
        text_config = model.get("text_config")
        qc = text_config.get("quantization_config") if isinstance(text_config, Mapping) else None
    return qc if isinstance(qc, Mapping) else {}


def hf_quant_method(model: Any) -> str | None:
    """SGLang's ``get_quantization_config(hf_config)`` as the model phase sees it.

    By then ``ModelConfig`` has rewritten a ModelOpt ``quantization_config`` in
    place (``quant_method`` absent or ``modelopt`` becomes ``modelopt_fp4``,
    ``modelopt_fp8``, ``modelopt_mixed``, ``w4afp8`` or ``mxfp8`` by
    ``quant_algo``), so the rewritten method is what the rules read.
    """
    qc = hf_quant_config(model)
    if not qc:
        return None
    method = qc.get("quant_method")
    if method is None or method == "modelopt":
        return modelopt_method(qc) or method
    return method


def device_of(view: Any, platform: Any) -> str:
    """The resolved ``device`` (the platform's torch device before normalise sets it)."""
    return view.device or platform.torch_device
