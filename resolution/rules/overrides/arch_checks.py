"""Per-architecture checks that run after the providers (SGLang's arch branches):
each rejects an attention backend, parallel layout or MoE runner the
architecture cannot serve. They declare nothing.

not ported: the ROCm aiter all-reduce fusion note for GPT-OSS (logging only;
the write is disabled upstream).
"""

from __future__ import annotations

from flotilla.resolution.engine import ensure, reject, rule
from flotilla.resolution.rules.common import attention_backends
from flotilla.resolution.rules.common import env_flag
from flotilla.resolution.rules.overrides.support import device_of

_GPT_OSS_BACKENDS = ["triton", "trtllm_mha", "fa3", "fa4", "ascend", "intel_amx", "intel_xpu", "aiter"]
_LLAMA4_ARCHS = ("Llama4ForConditionalGeneration", "Llama4ForCausalLM")
_LLAMA4_BACKENDS = {"fa3", "aiter", "triton", "ascend", "trtllm_mha", "intel_xpu"}
_GEMMA4_ARCHS = ("Gemma4ForConditionalGeneration", "Gemma4ForCausalLM", "Gemma4UnifiedForConditionalGeneration")
_GEMMA4_BACKENDS = ("trtllm_mha", "triton", "ascend", "intel_xpu", "intel_amx")
_EXAONE_ARCHS = ("Exaone4ForCausalLM", "ExaoneMoEForCausalLM")
_EXAONE_BACKENDS = ["fa3", "triton", "trtllm_mha"]
_LFM2_ARCHS = ("Lfm2ForCausalLM", "Lfm2MoeForCausalLM")


def mimo_v2_fused_qkv_tp_size(model) -> int | None:
    """The attention TP size MiMo-V2's fused qkv_proj weights are interleaved for
    (its KV head count), or ``None`` when the checkpoint keeps q/k/v separate."""
    layout = model.get("attention_projection_layout")
    if layout is None:
        return None
    if layout != "fused_qkv":
        reject(
            "MiMoV2 hf_config has unsupported "
            f"attention_projection_layout={layout!r}; expected 'fused_qkv' "
            "or unset."
        )
    kv_heads = model.get("num_key_value_heads")
    if kv_heads is None:
        text_config = model.get("text_config")
        kv_heads = text_config.get("num_key_value_heads") if hasattr(text_config, "get") else None
    if kv_heads is None:
        reject(
            "MiMoV2 hf_config has attention_projection_layout='fused_qkv' "
            "but num_key_value_heads is missing; this value is required to "
            "derive the fused qkv_proj TP size."
        )
    return kv_heads


def exaone_sliding_window_pattern(model):
    """Exaone's effective ``sliding_window_pattern`` (its config class defaults it
    to 4, and to 0 when ``sliding_window`` is null)."""
    if model.get("sliding_window", 4096) is None:
        return 0
    return model.get("sliding_window_pattern", 4)


def _gpt_oss(view, model, platform) -> None:
    if not (platform.is_mps and env_flag(view, "SGLANG_USE_MLX")):
        prefill, decode = attention_backends(view)
        ensure(
            prefill in _GPT_OSS_BACKENDS and decode in _GPT_OSS_BACKENDS,
            f"GptOssForCausalLM requires one of {_GPT_OSS_BACKENDS} attention backend, "
            "but got the following backends\n"
            f"- Prefill: {prefill}\n"
            f"- Decode: {decode}\n",
        )
    if view.moe_runner_backend == "triton_kernel":
        ensure(view.ep_size == 1, "Triton kernel MoE is only supported when ep_size == 1")


def _mimo_v2(view, model, platform) -> None:
    if model.architecture != "MiMoV2ForCausalLM" or view.encoder_only:
        return
    expected = mimo_v2_fused_qkv_tp_size(model)
    attn_dp_size = view.dp_size if view.enable_dp_attention else 1
    effective = view.tp_size // attn_dp_size // view.attn_cp_size
    if expected is not None and expected % effective != 0:
        reject(
            "MiMoV2ForCausalLM requires effective attention TP "
            f"size {expected} because its fused "
            "qkv_proj weights are "
            f"TP={expected}-interleaved; got "
            f"{effective} "
            f"(tp_size={view.tp_size}, dp_size={view.dp_size}, "
            f"enable_dp_attention={view.enable_dp_attention}, "
            f"attn_cp_size={view.attn_cp_size}). "
            "Set --tp, --dp, --enable-dp-attention, and "
            "--attention-context-parallel-size so the effective "
            f"attention TP size is {expected}."
        )


def _llama4(view, model, platform) -> None:
    if device_of(view, platform) == "cpu":
        return
    backend = view.attention_backend
    ensure(
        backend in _LLAMA4_BACKENDS,
        f"fa3, aiter, triton, ascend, trtllm_mha or intel_xpu is required for Llama4 model but got {backend}",
    )


def _gemma4(view, model, platform) -> None:
    prefill, decode = attention_backends(view)
    ensure(
        prefill in _GEMMA4_BACKENDS and decode in _GEMMA4_BACKENDS,
        "Gemma4 only supports trtllm_mha, triton, ascend, intel_xpu, or intel_amx "
        f"attention backend, got prefill={prefill}, decode={decode}",
    )


def _exaone(view, model, platform) -> None:
    if exaone_sliding_window_pattern(model) is None:
        return
    ensure(
        view.attention_backend in _EXAONE_BACKENDS,
        f"One of the attention backends in {_EXAONE_BACKENDS} is required for "
        f"{model.architecture}, but got {view.attention_backend}",
    )


def _olmo2(view, model, platform) -> None:
    ensure(
        view.attention_backend != "flashinfer",
        "FlashInfer backend can significantly degrade the performance of Olmo3 models.",
    )


def _lfm2(view, model, platform) -> None:
    ensure(
        view.attention_backend != "triton",
        f"{model.architecture} does not support triton attention backend, "
        "as the first layer might not be an attention layer",
    )


_CHECKS = {
    "GptOssForCausalLM": _gpt_oss,
    "MiMoV2ForCausalLM": _mimo_v2,
    "MiMoV2FlashForCausalLM": _mimo_v2,
    **dict.fromkeys(_LLAMA4_ARCHS, _llama4),
    **dict.fromkeys(_GEMMA4_ARCHS, _gemma4),
    **dict.fromkeys(_EXAONE_ARCHS, _exaone),
    "Olmo2ForCausalLM": _olmo2,
    **dict.fromkeys(_LFM2_ARCHS, _lfm2),
}


@rule("_handle_model_specific_adjustments")
def architecture_backend_checks(view, model, platform):
    """Reject attention backends / layouts the architecture cannot serve (GPT-OSS, MiMo-V2,
    Llama 4, Gemma 4, EXAONE with sliding windows, OLMo 2, LFM2)."""
    check = _CHECKS.get(model.architecture)
    if check is not None:
        check(view, model, platform)
    return None
