"""CUDA-graph rules of the normalise phase (SGLang's ``cuda_graph_hook``).

Model-arch prefill defaults first, then ``handle_cuda_graph_config``: build the
config dict from the flags, auto-disable an incompatible prefill graph, align
DeepEP buckets, apply the PD roles, validate the backends.

not ported: ``parse_connector_type(model_path) == INSTANCE`` guards (remote
instance URLs are not model directories).
not ported: out-of-tree platform piecewise support (no OOT platforms modelled).
not ported: ``check_gguf_file(model_path)`` (only config.json is read; the
``--load-format gguf`` / ``--quantization gguf`` checks are kept).
"""

from __future__ import annotations

from flotilla.resolution.engine import reject, rule
from flotilla.resolution.rules.common import attention_backends
from flotilla.resolution.rules.normalise import model_traits as traits
from flotilla.resolution.rules.normalise.cuda_graph import (
    ALLOWED_BACKENDS,
    BREAKABLE,
    DECODE,
    DISABLED,
    FULL,
    PHASES,
    PREFILL,
    TC_PIECEWISE,
    build_config,
    is_locked,
    json_input_error,
    phase_settings,
    prefill_batch_sizes,
    with_phase,
)

_INKLING_ARCHS = ("InklingForConditionalGeneration", "InklingForConditionalGenerationMTP")
_MUSE_GLIMMER_ARCHS = ("MuseGlimmerForCausalLM", "MuseGlimmerForConditionalGeneration")
_BREAKABLE_A2A_BACKENDS = ("none", "deepep", "megamoe", "flashinfer")


@rule("_apply_inkling_prefill_cuda_graph_default")
def apply_inkling_prefill_cuda_graph_default(view, model, platform):
    """Inkling captures whole-forward prefill graphs (backend full) unless the user
    chose a prefill graph backend or turned prefill graphs off."""
    if view.cuda_graph_backend_prefill is not None or view.disable_prefill_cuda_graph:
        return None
    if model.architecture in _INKLING_ARCHS:
        return {"cuda_graph_backend_prefill": FULL}
    return None


@rule("_apply_muse_glimmer_prefill_cuda_graph_max_bs_default")
def apply_muse_glimmer_prefill_cuda_graph_max_bs_default(view, model, platform):
    """MuseGlimmer caps prefill graph capture at 512 tokens unless the user set the cap."""
    if view.cuda_graph_max_bs_prefill is not None:
        return None
    if model.architecture in _MUSE_GLIMMER_ARCHS:
        return {"cuda_graph_max_bs_prefill": 512}
    return None


@rule("_parse_cuda_graph_config", overrides=("cuda_graph_config",))
def parse_cuda_graph_config(view, model, platform):
    """Merge --cuda-graph-config JSON, per-phase flags and --disable-cuda-graph into one
    per-phase config; every setting they name is locked against later defaults."""
    if view.explicit("cuda_graph_config"):
        problem = json_input_error(view.cuda_graph_config)
        if problem is not None:
            reject(problem)
    return {"cuda_graph_config": build_config(view, platform)}


def _disable_prefill(view) -> dict:
    return {"cuda_graph_config": with_phase(view.cuda_graph_config, PREFILL, backend=DISABLED)}


def _prefill_backend(view) -> str:
    return view.cuda_graph_config[PREFILL]["backend"]


@rule("_apply_cuda_graph_compatibility", overrides=("cuda_graph_config",))
def apply_cuda_graph_compatibility(view, model, platform):
    """An unpinned breakable prefill graph is turned off under pipeline parallelism, and
    moved to tc_piecewise for multimodal archs validated only there."""
    if is_locked(view, PREFILL, "backend"):
        return None
    backend = _prefill_backend(view)
    if view.pp_size > 1 and backend == BREAKABLE:
        return _disable_prefill(view)
    if (
        backend == BREAKABLE
        and traits.multimodal_piecewise_supported(view, model)
        and not traits.multimodal_breakable_supported(view, model)
        and attention_backends(view)[0] != "trtllm_mla"
    ):
        return {
            "cuda_graph_config": with_phase(view.cuda_graph_config, PREFILL, backend=TC_PIECEWISE)
        }
    return None


def _tc_piecewise_blockers(view, model, platform):
    yield traits.piecewise_disabled_model(view, model)
    yield view.enable_dp_attention
    yield view.enable_torch_compile
    yield view.pp_size > 1
    yield any((platform.is_hip, platform.is_npu, platform.is_cpu, platform.is_mps, platform.is_xpu))
    yield view.moe_a2a_backend != "none"
    yield bool(view.lora_paths) or bool(view.enable_lora)
    multimodal = traits.is_multimodal(view, model)
    yield multimodal and not traits.multimodal_piecewise_supported(view, model)
    yield view.load_format == "gguf" or view.quantization == "gguf"
    yield view.dllm_algorithm is not None
    yield view.cpu_offload_gb > 0 or view.enable_hierarchical_cache
    yield view.enable_deterministic_inference
    yield view.disaggregation_mode != "null"
    yield view.enable_symm_mem
    yield view.enable_eplb or view.expert_distribution_recorder_mode is not None
    yield view.attn_cp_size > 1
    yield view.debug_cuda_graph
    yield view.enable_dsa_prefill_context_parallel
    yield view.dcp_size > 1


@rule("_disable_tc_piecewise_cudagraph_if_incompatible", overrides=("cuda_graph_config",))
def disable_tc_piecewise_cudagraph_if_incompatible(view, model, platform):
    """An unpinned tc_piecewise prefill graph is turned off where torch.compile
    piecewise capture cannot work (non-CUDA hardware, DP attention, A2A MoE, LoRA,
    PD disaggregation, CP/DCP, multimodal models, ...)."""
    if is_locked(view, PREFILL, "backend") or _prefill_backend(view) != TC_PIECEWISE:
        return None
    if any(_tc_piecewise_blockers(view, model, platform)):
        return _disable_prefill(view)
    return None


def _supports_prefill_cp_breakable(view) -> bool:
    return (
        view.enable_prefill_cp
        and view.pp_size == 1
        and view.attn_cp_size == view.tp_size
        and view.cp_strategy == "zigzag"
        and attention_backends(view)[0] == "trtllm_mha"
    )


def _breakable_blockers(view, model):
    yield traits.is_deepseek_v4(model)
    yield view.attn_cp_size > 1 and not _supports_prefill_cp_breakable(view)
    yield view.dcp_size > 1
    yield view.enable_two_batch_overlap
    yield view.moe_a2a_backend not in _BREAKABLE_A2A_BACKENDS
    multimodal = traits.is_multimodal(view, model)
    yield multimodal and not traits.multimodal_breakable_supported(view, model)


@rule("_disable_breakable_cudagraph_if_incompatible", overrides=("cuda_graph_config",))
def disable_breakable_cudagraph_if_incompatible(view, model, platform):
    """An unpinned breakable prefill graph is turned off for DeepSeek-V4, CP without
    zigzag trtllm_mha, DCP, two-batch overlap, unvalidated A2A backends and
    multimodal archs not validated under it."""
    if is_locked(view, PREFILL, "backend") or _prefill_backend(view) != BREAKABLE:
        return None
    if any(_breakable_blockers(view, model)):
        return _disable_prefill(view)
    return None


@rule("_apply_deepep_adjustments", overrides=("cuda_graph_config",))
def apply_deepep_adjustments(view, model, platform):
    """DeepEP with breakable prefill graphs needs token buckets divisible by 8: the
    bucket list (default ladder up to 2048 when unset) is rounded up."""
    if view.moe_a2a_backend != "deepep":
        return None
    prefill = phase_settings(view.cuda_graph_config, PREFILL)
    if prefill["backend"] != BREAKABLE:
        return None
    sizes = prefill["bs"]
    if sizes is None:
        sizes = prefill_batch_sizes(prefill["max_bs"] or 2048)
    aligned = sorted({((size + 7) // 8) * 8 for size in sizes})
    if aligned == sorted(sizes):
        return None
    return {
        "cuda_graph_config": with_phase(
            view.cuda_graph_config, PREFILL, bs=aligned, max_bs=aligned[-1]
        )
    }


@rule("_apply_cuda_graph_disaggregation_roles", overrides=("cuda_graph_config",))
def apply_cuda_graph_disaggregation_roles(view, model, platform):
    """A PD prefill server captures no decode graph and a PD decode server no prefill
    graph, unless the user pinned that phase's backend."""
    mode = view.disaggregation_mode
    idle = {"prefill": DECODE, "decode": PREFILL}.get(mode)
    if idle is None or is_locked(view, idle, "backend"):
        return None
    return {"cuda_graph_config": with_phase(view.cuda_graph_config, idle, backend=DISABLED)}


@rule("validate_cuda_graph_config")
def validate_cuda_graph_config(view, model, platform):
    """Each phase's graph backend must be one the phase supports."""
    config = view.cuda_graph_config
    if config is None:
        return None
    for phase in PHASES:
        backend = config[phase]["backend"]
        if backend not in ALLOWED_BACKENDS[phase]:
            reject(
                f"--cuda-graph-config[{phase}].backend={backend!r} not allowed; "
                f"allowed: {ALLOWED_BACKENDS[phase]}"
            )
    return None


STEPS_BEFORE_DWDP = (
    apply_inkling_prefill_cuda_graph_default,
    apply_muse_glimmer_prefill_cuda_graph_max_bs_default,
)
"""Model-arch prefill defaults; they run before ``_handle_dwdp``."""

STEPS = (
    parse_cuda_graph_config,
    apply_cuda_graph_compatibility,
    disable_tc_piecewise_cudagraph_if_incompatible,
    disable_breakable_cudagraph_if_incompatible,
    apply_deepep_adjustments,
    apply_cuda_graph_disaggregation_roles,
    validate_cuda_graph_config,
)
"""SGLang's ``handle_cuda_graph_config``, in order."""
