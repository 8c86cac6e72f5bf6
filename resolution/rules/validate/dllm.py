"""Diffusion-LLM inference (SGLang's ``handle_dllm_inference`` and the
``_dllm_*`` post-process passes it runs at its slot).

not ported: reading ``block_size`` from the YAML file ``--dllm-algorithm-config``
names (only config.json is read; the architecture's default block size applies).
"""

from __future__ import annotations

from flotilla.resolution.engine import reject, rule
from flotilla.resolution.rules.normalise.cuda_graph import (
    DECODE,
    DISABLED,
    PREFILL,
    decode_graph_disabled,
    prefill_graph_disabled,
    with_phase,
)

# Block size of each diffusion LLM architecture (DllmConfig's defaults).
DLLM_BLOCK_SIZES = {
    "LLaDA2MoeModelLM": 32,
    "SDARForCausalLM": 4,
    "SDARMoeForCausalLM": 4,
}


def dllm_block_size(model) -> int:
    """The diffusion block size of ``model``; an unknown architecture is rejected."""
    arch = model.architecture
    if arch not in DLLM_BLOCK_SIZES:
        reject(f"Unknown diffusion LLM: {arch}", kind="RuntimeError")
    return DLLM_BLOCK_SIZES[arch]


@rule("_handle_dllm_inference", overrides=("cuda_graph_config",))
def dllm_rocm_graphs(view, model, platform):
    """Diffusion LLM inference on AMD GPUs runs without CUDA graphs."""
    if view.dllm_algorithm is None or not platform.is_hip:
        return None
    if decode_graph_disabled(view) and prefill_graph_disabled(view):
        return None
    graphs = with_phase(view.cuda_graph_config, DECODE, backend=DISABLED)
    return {"cuda_graph_config": with_phase(graphs, PREFILL, backend=DISABLED)}


@rule("_dllm_attention_backend", overrides=("attention_backend",), whitelist=True)
def dllm_attention_backend(view, model, platform):
    """Diffusion LLMs attend with flashinfer under decode CUDA graphs (triton/aiter on ROCm, ascend on NPU)."""
    if view.dllm_algorithm is None:
        return None
    backend = view.attention_backend
    if platform.is_hip:
        if backend not in ("triton", "aiter"):
            return {"attention_backend": "triton"}
    elif platform.is_npu:
        if backend != "ascend":
            return {"attention_backend": "ascend"}
    elif not decode_graph_disabled(view) and backend != "flashinfer":
        return {"attention_backend": "flashinfer"}
    return None


@rule("_dllm_overlap_disable", overrides=("disable_overlap_schedule",), whitelist=True)
def dllm_overlap_disable(view, model, platform):
    """Diffusion LLM inference does not overlap scheduling."""
    if view.dllm_algorithm is None or view.disable_overlap_schedule:
        return None
    return {"disable_overlap_schedule": True}


@rule("_dllm_page_size", overrides=("page_size",), whitelist=True)
def dllm_page_size(view, model, platform):
    """The KV page size aligns with (and never exceeds) the diffusion block size."""
    if view.dllm_algorithm is None:
        return None
    block = dllm_block_size(model)
    page_size = view.page_size
    if not view.disable_radix_cache and page_size % block != 0:
        return {"page_size": block}
    if page_size > block:
        return {"page_size": block}
    return None


@rule(
    "_handle_dllm_inference",
    overrides=(
        "enable_hierarchical_cache",
        "enable_lmcache",
        "enable_flexkv",
        "pp_size",
        "enable_lora",
        "disaggregation_mode",
        "enable_mixed_chunk",
    ),
)
def dllm_unsupported_features(view, model, platform):
    """Diffusion LLM inference turns off host KV tiers, PP, LoRA, disaggregation and mixed chunks."""
    if view.dllm_algorithm is None:
        return None
    declared: dict = {}
    if not view.disable_radix_cache:
        for name in ("enable_hierarchical_cache", "enable_lmcache", "enable_flexkv"):
            if getattr(view, name):
                declared[name] = False
    if view.pp_size > 1:
        declared["pp_size"] = 1
    if view.enable_lora:
        declared["enable_lora"] = False
    if view.disaggregation_mode != "null":
        declared["disaggregation_mode"] = "null"
    if view.enable_mixed_chunk:
        declared["enable_mixed_chunk"] = False
    return declared
