"""The tail of the model phase: the sparse-head overlap switch and FlashInfer
all-reduce fusion (auto-enabled for supported models, forced off on request).

not ported: the informational logs of both switches.
"""

from __future__ import annotations

from flotilla.resolution.engine import rule
from flotilla.resolution.rules.common import env_flag
from flotilla.resolution.rules.overrides.support import env_is_set

# Architectures whose model code implements FlashInfer all-reduce fusion.
ALLREDUCE_FUSION_ARCHS = frozenset(
    {
        "DeepseekV3ForCausalLM",
        "DeepseekV32ForCausalLM",
        "DeepseekV4ForCausalLM",
        "GptOssForCausalLM",
        "GlmMoeDsaForCausalLM",
        "Glm4MoeForCausalLM",
        "Glm4MoeLiteForCausalLM",
        "MistralLarge3ForCausalLM",
        "Qwen3MoeForCausalLM",
        "Qwen3VLMoeForConditionalGeneration",
        "Qwen3NextForCausalLM",
        "KimiK25ForConditionalGeneration",
        "Qwen3_5MoeForConditionalGeneration",
        "InternS2PreviewForConditionalGeneration",
        "Qwen3_5ForConditionalGeneration",
        "NemotronHForCausalLM",
        "NemotronHPuzzleForCausalLM",
    }
)
# Qwen3.5 MoE owns one CuTeDSL MNNVL workspace for both of its fusion patterns.
_CUTEDSL_AR_FUSION_ARCHS = frozenset({"Qwen3_5MoeForCausalLM", "Qwen3_5MoeForConditionalGeneration"})


@rule("_sparse_head_overlap_disable", whitelist=True)
def sparse_head_overlap_disable(view, model, platform):
    """Embedding models with a sparse head run without the overlap scheduler."""
    if env_is_set(view, "SGLANG_EMBEDDINGS_SPARSE_HEAD"):
        return {"disable_overlap_schedule": True}
    return None


@rule(
    "_flashinfer_allreduce_fusion_auto_enable",
    overrides=("flashinfer_allreduce_fusion_backend",),
    whitelist=True,
)
def flashinfer_allreduce_fusion_auto_enable(view, model, platform):
    """Models with FlashInfer all-reduce fusion turn it on (auto) for single-group TP on
    SM90 (one node) and SM10x, unless DP attention or an all-to-all MoE backend is used."""
    arch = model.architecture
    if env_flag(view, "SGLANG_FLASHINFER_MNNVL_CUTEDSL_AR_FUSION") and arch in _CUTEDSL_AR_FUSION_ARCHS:
        return {"flashinfer_allreduce_fusion_backend": None}
    if (
        view.flashinfer_allreduce_fusion_backend is None
        and arch in ALLREDUCE_FUSION_ARCHS
        and (platform.is_sm90 or platform.is_sm100)
        and view.tp_size > 1
        and not view.enable_dp_attention
        and (view.nnodes == 1 or platform.is_sm100)
        and view.moe_a2a_backend == "none"
    ):
        return {"flashinfer_allreduce_fusion_backend": "auto"}
    return None


@rule(
    "_enforce_disable_allreduce_fusion",
    overrides=("flashinfer_allreduce_fusion_backend",),
    whitelist=True,
)
def enforce_disable_allreduce_fusion(view, model, platform):
    """--enforce-disable-flashinfer-allreduce-fusion wins over every model adjustment."""
    if view.enforce_disable_flashinfer_allreduce_fusion:
        return {"flashinfer_allreduce_fusion_backend": None}
    return None
