"""Model-override providers: Nemotron-H (and its Puzzle variant).

not ported: the info log lines (logging only).
"""

from __future__ import annotations

from flotilla.resolution.engine import ensure, reject
from flotilla.resolution.rules.common import attention_backend_not_set
from flotilla.resolution.rules.overrides.support import model_config_quantization
from flotilla.resolution.rules.overrides.registry import provider

_MODELOPT = ("modelopt", "modelopt_fp8", "modelopt_fp4", "modelopt_mixed")
# NemotronHConfig's default MLP activation.
_DEFAULT_MLP_HIDDEN_ACT = "relu2"


def _modelopt_quantization(model, checkpoint_quantization):
    """The concrete ModelOpt scheme of a ModelOpt checkpoint (``modelopt`` resolves by ``quant_algo``)."""
    if checkpoint_quantization != "modelopt":
        return checkpoint_quantization
    quant_algo = (model.get("quantization_config") or {}).get("quant_algo")
    if quant_algo == "MIXED_PRECISION":
        return "modelopt_mixed"
    return "modelopt_fp4" if quant_algo == "NVFP4" else "modelopt_fp8"


def _has_w4a16_moe_layers(model):
    """A mixed-precision checkpoint quantizes some expert layers as W4A16 NVFP4."""
    layers = (model.get("quantization_config") or {}).get("quantized_layers", {}) or {}
    return any(
        info.get("quant_algo") == "W4A16_NVFP4" and ".experts." in name
        for name, info in layers.items()
    )


def _moe_runner(view, platform, model_quant, quantization, is_modelopt):
    """The MoE runner Nemotron-H takes when the user left it on ``auto`` (None: no change)."""
    if not (is_modelopt or model_quant is None):
        return None
    if platform.is_sm100 and view.moe_a2a_backend == "none":
        return "flashinfer_trtllm"
    if (
        (model_quant in ("modelopt_fp4", "modelopt_mixed") or quantization == "modelopt_fp4")
        and platform.is_cuda
        and platform.capability is not None
        and (8, 0) <= tuple(platform.capability) < (10, 0)
    ):
        return "marlin"
    return "flashinfer_cutlass"


def _blackwell_attention(view, platform):
    """Attention defaults on Blackwell when no attention backend was chosen."""
    declared = {}
    if view.speculative_algorithm is None:
        if platform.is_sm100:
            declared["attention_backend"] = "trtllm_mha"
        return declared
    algorithm = view.speculative_algorithm.upper()
    if platform.is_sm100 and view.speculative_eagle_topk in (None, 1):
        declared["attention_backend"] = "trtllm_mha"
        if view.page_size is None:
            declared["page_size"] = 64
        if view.mamba_radix_cache_strategy == "auto":
            declared["mamba_radix_cache_strategy"] = "extra_buffer"
        if view.speculative_draft_attention_backend is None and algorithm in ("EAGLE", "NEXTN", "DSPARK"):
            declared["speculative_draft_attention_backend"] = "trtllm_mha"
    else:
        declared["attention_backend"] = "triton"
        if view.speculative_draft_attention_backend is None and algorithm in (
            "EAGLE",
            "NEXTN",
            "DFLASH",
            "DSPARK",
        ):
            declared["speculative_draft_attention_backend"] = "flashinfer"
    return declared


@provider(
    "NemotronHForCausalLM",
    "NemotronHPuzzleForCausalLM",
    overrides=("quantization", "moe_runner_backend", "mamba_radix_cache_strategy"),
)
def _nemotron_h_overrides(view, model, platform):
    """Nemotron-H resolves its ModelOpt quantization, MoE runner and Blackwell attention defaults.

    ModelOpt checkpoints pin the concrete scheme; W4A16 NVFP4 experts need
    marlin without all-to-all; otherwise SM100 takes flashinfer_trtllm, SM80-SM90
    FP4 takes marlin, the rest flashinfer_cutlass. On Blackwell with no attention
    backend chosen: trtllm_mha (SM100), or per speculative decoding settings.
    Deviation: SGLang's bare ``assert`` on the MLP activation has no message;
    flotilla says what it checks.
    """
    model_quant = model_config_quantization(view, model, platform)
    is_modelopt = model_quant in _MODELOPT
    quantization = view.quantization
    declared = {}
    if is_modelopt:
        ensure(
            model.get("mlp_hidden_act", _DEFAULT_MLP_HIDDEN_ACT) == "relu2",
            "Nemotron-H ModelOpt checkpoints require mlp_hidden_act 'relu2'",
        )
        quantization = _modelopt_quantization(model, model_quant)
        declared["quantization"] = quantization

    if is_modelopt and quantization == "modelopt_mixed" and _has_w4a16_moe_layers(model):
        if view.moe_a2a_backend != "none":
            reject("W4A16_NVFP4 MoE layers require --moe-a2a-backend=none.")
        if view.moe_runner_backend not in ("auto", "marlin"):
            reject("W4A16_NVFP4 MoE layers require --moe-runner-backend=marlin.")
        if view.moe_runner_backend == "auto":
            declared["moe_runner_backend"] = "marlin"
    elif view.moe_runner_backend == "auto":
        runner = _moe_runner(view, platform, model_quant, quantization, is_modelopt)
        if runner is not None:
            declared["moe_runner_backend"] = runner

    if platform.is_blackwell and attention_backend_not_set(view):
        declared.update(_blackwell_attention(view, platform))
    return declared
