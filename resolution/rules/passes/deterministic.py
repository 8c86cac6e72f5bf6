"""Deterministic inference (SGLang's ``handle_deterministic_inference`` and the
three passes it hosts), in handler order.

not ported: the ``instance://`` connector-path exemption from the DeepSeek probe
(model paths are not resolution inputs).
not ported: the ROCm 1-stage all-reduce note (logging only).
"""

from __future__ import annotations

from flotilla.resolution.engine import Env, reject, rule

DETERMINISTIC_ATTENTION_BACKENDS = ("ascend", "fa3", "fa4", "flashinfer", "intel_xpu", "triton")
RADIX_DETERMINISTIC_ATTENTION_BACKENDS = ("ascend", "fa3", "fa4", "triton")

# Absorbed-MLA architectures the deterministic handler treats as "DeepSeek".
_DEEPSEEK_LIKE = frozenset(
    {
        "DeepseekV2ForCausalLM",
        "DeepseekV3ForCausalLM",
        "DeepseekV32ForCausalLM",
        "MistralLarge3ForCausalLM",
        "PixtralForConditionalGeneration",
        "GlmMoeDsaForCausalLM",
        "Glm4MoeLiteForCausalLM",
    }
)

_DEFAULT_NCCL_CHANNELS = "8"  # SGLANG_DETERMINISTIC_NCCL_NCHANNELS default


def _listed(names: tuple[str, ...]) -> str:
    """Render a backend tuple the way SGLang's messages print its list."""
    return repr(list(names))


def deterministic_enabled(view) -> bool:
    """Deterministic inference is on, or an RL on-policy target turns it on."""
    return bool(view.enable_deterministic_inference) or view.rl_on_policy_target is not None


def is_deepseek_like(model) -> bool:
    """The first architecture is one of the absorbed-MLA families."""
    return model.architecture in _DEEPSEEK_LIKE


@rule("_handle_deterministic_inference", overrides=("enable_aiter_allreduce_fusion",))
def _deterministic_inference_enable(view, model, platform):
    """An RL on-policy target switches deterministic inference on, and
    deterministic inference switches the (non-deterministic) aiter all-reduce
    fusion off."""
    declared: dict = {}
    if view.rl_on_policy_target is not None:
        declared["enable_deterministic_inference"] = True
        declared[Env("SGLANG_VLM_CACHE_SIZE_MB")] = "0"
        declared[Env("SGLANG_ENABLE_DETERMINISTIC_INFERENCE")] = "True"
    if deterministic_enabled(view) and view.enable_aiter_allreduce_fusion:
        declared["enable_aiter_allreduce_fusion"] = False
    return declared


@rule(
    "_deterministic_allreduce_fusion_disable",
    overrides=("flashinfer_allreduce_fusion_backend",),
    whitelist=True,
)
def _deterministic_allreduce_fusion_disable(view, model, platform):
    """Deterministic inference turns FlashInfer all-reduce fusion off (its
    reduction order is not fixed)."""
    if view.enable_deterministic_inference and view.flashinfer_allreduce_fusion_backend is not None:
        return {"flashinfer_allreduce_fusion_backend": None}
    return None


@rule("_deterministic_sampling_backend", overrides=("sampling_backend",), whitelist=True)
def _deterministic_sampling_backend(view, model, platform):
    """Deterministic inference samples with PyTorch (Ascend keeps its own)."""
    if view.enable_deterministic_inference and view.sampling_backend != "ascend":
        return {"sampling_backend": "pytorch"}
    return None


@rule("_deterministic_attention_backend", whitelist=True)
def _deterministic_attention_backend(view, model, platform):
    """Deterministic inference needs a batch-invariant attention backend:
    unset picks one per GPU generation, an unsupported explicit one is refused.

    Blackwell (SM100/SM120) takes FlashInfer, or Triton for the absorbed-MLA
    families FlashInfer cannot run deterministically; everything else takes FA3.
    """
    if not view.enable_deterministic_inference:
        return None
    backend = view.attention_backend
    if backend is None:
        if platform.is_sm100 or platform.is_sm120:
            return {"attention_backend": "triton" if is_deepseek_like(model) else "flashinfer"}
        return {"attention_backend": "fa3"}
    if backend not in DETERMINISTIC_ATTENTION_BACKENDS:
        reject(
            f"Currently only {_listed(DETERMINISTIC_ATTENTION_BACKENDS)} attention backends are "
            f"supported for deterministic inference, but you explicitly specified '{backend}'."
        )
    return None


@rule(
    "_handle_deterministic_inference",
    overrides=("disable_radix_cache", "disable_custom_all_reduce", "enable_torch_symm_mem"),
)
def _deterministic_inference_checks(view, model, platform):
    """Deterministic inference: check the attention backend for absorbed-MLA
    models, keep radix cache only on backends that support it deterministically,
    and pin multi-GPU all-reduce to NCCL's tree algorithm with a fixed channel
    count (custom and symmetric-memory all-reduce off) on CUDA.
    """
    if not view.enable_deterministic_inference:
        return None
    backend = view.attention_backend
    if is_deepseek_like(model):
        if backend not in RADIX_DETERMINISTIC_ATTENTION_BACKENDS:
            reject(
                f"Currently only {_listed(RADIX_DETERMINISTIC_ATTENTION_BACKENDS)} attention "
                "backends are supported for deterministic inference with absorbed-MLA models. "
                f"But you're using {backend}."
            )
        if backend == "fa4" and not platform.is_sm100_or_sm110:
            reject(
                "Deterministic inference with absorbed-MLA models on the fa4 "
                "attention backend requires SM100/SM110: it runs "
                "absorbed MLA, whose qv argument flash_attn.cute only "
                "implements on those archs."
            )
    declared: dict = {}
    if backend not in RADIX_DETERMINISTIC_ATTENTION_BACKENDS:
        declared["disable_radix_cache"] = True
    if view.tp_size > 1 and not platform.is_hip:
        channels = view.env("SGLANG_DETERMINISTIC_NCCL_NCHANNELS") or _DEFAULT_NCCL_CHANNELS
        declared.update(
            {
                Env("NCCL_ALGO"): "allreduce:tree",
                "disable_custom_all_reduce": True,
                "enable_torch_symm_mem": False,
                Env("NCCL_MIN_NCHANNELS"): channels,
                Env("NCCL_MAX_NCHANNELS"): channels,
            }
        )
    return declared
