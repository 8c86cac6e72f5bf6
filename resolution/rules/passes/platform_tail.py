"""The small handlers between the page-size default and HiCache: AMD Triton
splits, NCCL pre-warm, the grammar backend and multi-item scoring.
"""

from __future__ import annotations

from flotilla.resolution.engine import ensure, rule
from flotilla.resolution.rules.common import attention_backends
from flotilla.resolution.rules.passes.cuda_graph import DECODE, PREFILL, with_phases_disabled


@rule("_handle_amd_specifics", overrides=("triton_attention_num_kv_splits",))
def _handle_amd_specifics(view, model, platform):
    """ROCm runs Triton decode attention with 16 KV splits."""
    if platform.is_hip:
        return {"triton_attention_num_kv_splits": 16}
    return None


@rule("_handle_nccl_pre_warm", overrides=("pre_warm_nccl",))
def _handle_nccl_pre_warm(view, model, platform):
    """NCCL pre-warming only exists on CUDA, ROCm and Ascend; elsewhere it is off."""
    if view.pre_warm_nccl and not (platform.is_cuda or platform.is_hip or platform.is_npu):
        return {"pre_warm_nccl": False}
    return None


@rule("_handle_grammar_backend")
def _handle_grammar_backend(view, model, platform):
    """Constrained decoding defaults to XGrammar."""
    if view.grammar_backend is None:
        return {"grammar_backend": "xgrammar"}
    return None


@rule(
    "_handle_multi_item_scoring",
    overrides=("cuda_graph_config", "disable_radix_cache", "chunked_prefill_size"),
)
def _handle_multi_item_scoring(view, model, platform):
    """Multi-item scoring needs eager execution, no radix cache, no chunked
    prefill, and FlashInfer attention (for its custom attention masks)."""
    if not view.enable_mis:
        return None
    declared: dict = {
        "cuda_graph_config": with_phases_disabled(view.cuda_graph_config, DECODE, PREFILL)
    }
    if not view.disable_radix_cache:
        declared["disable_radix_cache"] = True
    if view.chunked_prefill_size != -1:
        declared["chunked_prefill_size"] = -1
    prefill, decode = attention_backends(view)
    ensure(
        prefill == "flashinfer" and decode == "flashinfer",
        "Multi-item scoring requires flashinfer attention backend for custom attention mask support. "
        "Please set --attention-backend flashinfer when using --enable-mis. "
        f"Current backends: prefill={prefill}, decode={decode}",
    )
    return declared
