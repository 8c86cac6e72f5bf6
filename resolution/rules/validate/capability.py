"""Model-capability adjustments, the last declarations of resolution (SGLang's
``handle_model_capability_adjustments``, with ``_hrm_text_attention_force``).

HRM-Text needs bidirectional prompt attention (Triton only, no prefix reuse, no
CUDA graphs); embedding-only architectures switch embedding mode on;
EmbeddingGemma runs as a single-prefill encoder; multimodal models whose
architecture cannot chunk multimodal prefill turn chunked prefill off.
"""

from __future__ import annotations

from flotilla.resolution.engine import rule
from flotilla.resolution.model_derive import is_multimodal, multimodal_chunked_prefill_supported
from flotilla.resolution.rules.normalise.cuda_graph import (
    BREAKABLE,
    DECODE,
    DISABLED,
    PREFILL,
    is_locked,
    phase_settings,
    prefill_batch_sizes,
    prefill_graph_disabled,
    with_phase,
)
from flotilla.resolution.rules.normalise.validations import check_prefill_only_embedding_and_fp4


def is_hrm_text(model) -> bool:
    """HRM-Text with prefix-LM attention (``prefix_lm`` defaults to true)."""
    hrm = model.model_type == "hrm_text" or "HrmTextForCausalLM" in model.architectures
    return hrm and bool(model.get("prefix_lm", True))


@rule("_hrm_text_attention_force", overrides=("attention_backend",), whitelist=True)
def hrm_text_attention_force(view, model, platform):
    """HRM-Text's bidirectional prefix attention only works on the Triton backend."""
    if not is_hrm_text(model):
        return None
    return {"attention_backend": "triton"}


@rule(
    "_handle_model_capability_adjustments",
    overrides=("chunked_prefill_size", "disable_radix_cache", "disable_cuda_graph", "cuda_graph_config"),
)
def hrm_text_adjustments(view, model, platform):
    """HRM-Text runs without chunked prefill, radix cache or CUDA graphs.

    Its prompt attention depends on later tokens."""
    if not is_hrm_text(model):
        return None
    graphs = with_phase(view.cuda_graph_config, DECODE, backend=DISABLED)
    return {
        "chunked_prefill_size": -1,
        "disable_radix_cache": True,
        "disable_cuda_graph": True,
        "cuda_graph_config": with_phase(graphs, PREFILL, backend=DISABLED),
    }


@rule("_handle_model_capability_adjustments", overrides=("is_embedding",))
def embedding_architecture(view, model, platform):
    """An embedding-only architecture is served in embedding mode."""
    if (model.auto_enable_embedding or model.is_embedding_gemma) and not view.is_embedding:
        return {"is_embedding": True}
    return None


@rule(
    "_handle_model_capability_adjustments",
    overrides=(
        "disable_radix_cache",
        "chunked_prefill_size",
        "enable_tokenizer_batch_encode",
        "prefill_only_disable_kv_cache",
    ),
)
def embedding_gemma_serving(view, model, platform):
    """EmbeddingGemma encodes each prompt in one prefill, without prefix reuse or chunking.

    Batches are encoded atomically, and on Hopper/Blackwell FA the prefill
    skips the paged KV cache."""
    if not model.is_embedding_gemma:
        return None
    declared = {"disable_radix_cache": True, "chunked_prefill_size": -1, "enable_tokenizer_batch_encode": True}
    requested = view.prefill_attention_backend or view.attention_backend
    if platform.is_cuda and (platform.is_sm90 or platform.is_sm100) and requested in (None, "fa3", "fa4"):
        declared["prefill_only_disable_kv_cache"] = True
        check_prefill_only_embedding_and_fp4(view)
    return declared


@rule("_handle_model_capability_adjustments", overrides=("cuda_graph_config",))
def embedding_gemma_graphs(view, model, platform):
    """EmbeddingGemma captures no decode graphs and a breakable prefill graph on CUDA.

    The prefill graph is sized for a full embedding batch; other platforms run
    prefill eagerly."""
    if not model.is_embedding_gemma:
        return None
    graphs = with_phase(view.cuda_graph_config, DECODE, backend=DISABLED)
    if platform.is_cuda and not prefill_graph_disabled(view):
        graphs = with_phase(graphs, PREFILL, backend=BREAKABLE)
        if not is_locked(view, PREFILL, "max_bs"):
            current = phase_settings(view.cuda_graph_config, PREFILL).get("max_bs") or 0
            context_len = view.context_length or model.context_len or 0
            sizing = {"max_bs": max(current, context_len, 16384)}
            if not is_locked(view, PREFILL, "bs"):
                sizing["bs"] = prefill_batch_sizes(sizing["max_bs"])
            graphs = with_phase(graphs, PREFILL, **sizing)
    elif not platform.is_cuda:
        graphs = with_phase(graphs, PREFILL, backend=DISABLED)
    return {"cuda_graph_config": graphs}


@rule("_handle_model_capability_adjustments", overrides=("chunked_prefill_size",))
def multimodal_chunked_prefill(view, model, platform):
    """Chunked prefill is off for multimodal models that cannot chunk multimodal inputs."""
    multimodal = is_multimodal(model, view.enable_multimodal, view.model_impl)
    if multimodal and not multimodal_chunked_prefill_supported(model, view.enable_multimodal, view.model_impl):
        return {"chunked_prefill_size": -1}
    return None
