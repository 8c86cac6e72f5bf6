"""The DeepSeek / MLA / DSA branch of the model phase (DeepSeek V3/R1/V3.2,
GLM-5.x, Kimi-K2.5, Mistral Large 3, LongCat, dots3), in SGLang's order:
DSA environment and top-k sharing guard, the DSA passes, prefill-CP graph and
cache-layer-split checks, then the quantization / MoE passes and the ROCm arm.
The passes themselves live in ``deepseek_passes``.

not ported: the informational logs (TP-mode DSA warning, piecewise graph note,
the ROCm aiter all-reduce fusion note, whose write is disabled upstream).
"""

from __future__ import annotations

from flotilla.resolution.engine import Env, ensure, reject, rule
from flotilla.resolution.rules.overrides.support import (
    DEEPSEEK_BRANCH_ARCHS,
    env_is_set,
    is_deepseek_dsa,
    with_phase,
)


def _in_branch(model) -> bool:
    return model.architecture in DEEPSEEK_BRANCH_ARCHS


def _dsa(model) -> bool:
    return _in_branch(model) and is_deepseek_dsa(model)


def shares_topk_indices(model) -> bool:
    """DSA layers reuse an earlier layer's top-k indices (``index_topk_freq`` > 1,
    or an ``S`` in the top-k sharing pattern)."""
    freq = model.get("index_topk_freq", 1) or 1
    pattern = model.index_topk_pattern
    return freq > 1 or (pattern is not None and "S" in pattern)


@rule("_handle_model_specific_adjustments")
def dsa_dense_attention_threshold(view, model, platform):
    """DSA prefill runs dense attention up to the model's index top-k (unless set),
    and two-batch overlap cannot carry shared top-k indices across layers."""
    if not _dsa(model):
        return None
    if view.enable_two_batch_overlap and shares_topk_indices(model):
        reject(
            "--enable-two-batch-overlap is not supported with DSA "
            "index-topk sharing (index_topk_freq > 1 or an "
            "index_topk_pattern containing shared layers): the TBO op "
            "path does not propagate topk indices across layers, so "
            "shared layers would run sparse attention without indices."
        )
    if env_is_set(view, "SGLANG_DSA_PREFILL_DENSE_ATTN_KV_LEN_THRESHOLD"):
        return None
    return {Env("SGLANG_DSA_PREFILL_DENSE_ATTN_KV_LEN_THRESHOLD"): str(model.get("index_topk"))}


@rule("_handle_model_specific_adjustments", overrides=("cuda_graph_config",))
def dsa_prefill_cp_graph(view, model, platform):
    """DSA prefill context parallelism runs prefill without CUDA graphs (on GPUs)."""
    if _dsa(model) and not platform.is_npu and not platform.is_xpu and view.enable_prefill_cp:
        return {"cuda_graph_config": with_phase(view.cuda_graph_config, "prefill", backend="disabled")}
    return None


@rule("_handle_model_specific_adjustments")
def dsa_context_parallel_checks(view, model, platform):
    """DSA prefill CP belongs to prefill workers, and the DSA cache layer split needs
    PD prefill workers, interleaved prefill CP, mooncake transfers and no PP."""
    if not _dsa(model):
        return None
    if view.enable_prefill_cp:
        ensure(
            view.disaggregation_mode != "decode",
            "CP is only supported for prefill when PD disaggregation, please remove --enable-prefill-cp.",
        )
    if not view.enable_dsa_cache_layer_split:
        return None
    if view.disaggregation_mode == "decode":
        reject(
            "--enable-dsa-cache-layer-split is not supported on "
            "decode workers. This flag is a prefill-CP "
            "optimization; decode receives full cache shards "
            "through PD transfer."
        )
    if view.disaggregation_mode != "prefill":
        reject(
            "--enable-dsa-cache-layer-split is only supported on PD "
            "prefill workers. Non-PD workers also run decode and "
            "require ordinary local decode cache semantics."
        )
    if not view.enable_prefill_cp or view.cp_strategy != "interleave":
        reject(
            "--enable-dsa-cache-layer-split requires "
            "--enable-prefill-cp and --cp-strategy interleave "
            "(or legacy --enable-nsa-prefill-context-parallel with "
            "--nsa-prefill-cp-mode round-robin-split)."
        )
    if view.disaggregation_transfer_backend != "mooncake":
        reject(
            "--enable-dsa-cache-layer-split currently only supports "
            "the mooncake transfer backend (mooncake / mooncake_tcp). "
            f"Got --disaggregation-transfer-backend "
            f"{view.disaggregation_transfer_backend!r}. mori/nixl "
            "support will be added later by the community."
        )
    if view.pp_size > 1:
        reject(
            "--enable-dsa-cache-layer-split is not supported with "
            "pipeline parallelism (pp_size > 1) yet. It requires "
            "prefill context parallelism, and CP + PP has not been "
            "validated for this feature."
        )
    return None


@rule("_handle_model_specific_adjustments", overrides=("cuda_graph_config",))
def mla_prefill_cp_graph(view, model, platform):
    """MLA prefill context parallelism (non-DSA DeepSeek) runs prefill without CUDA graphs."""
    if _in_branch(model) and not is_deepseek_dsa(model) and view.enable_prefill_cp and model.is_mla:
        return {"cuda_graph_config": with_phase(view.cuda_graph_config, "prefill", backend="disabled")}
    return None


@rule("_handle_model_specific_adjustments")
def dsa_rocm_topk(view, model, platform):
    """DSA on ROCm avoids the fused top-k v2 kernel (it needs CUDA thread-block clusters)."""
    if platform.is_hip and _dsa(model):
        return {Env("SGLANG_OPT_USE_TOPK_V2"): "False"}
    return None
