"""Per-device backend defaults (SGLang's ``platform_hook`` backends and the Ascend
``set_default_server_args``), keyed on the resolved ``device`` field.

not ported: ``is_host_cpu_arm64`` (no host-architecture fact; x86 assumed, so
the CPU attention default is intel_amx).
not ported: out-of-tree platform plugins' ``apply_server_args_defaults`` (no
in-tree platform writes anything there).
"""

from __future__ import annotations

from flotilla.resolution.engine import rule
from flotilla.resolution.rules.normalise.cuda_graph import (
    DECODE,
    DISABLED,
    FULL,
    PREFILL,
    is_locked,
    with_phase,
)


@rule("_handle_hpu_backends", overrides=("attention_backend", "sampling_backend"))
def handle_hpu_backends(view, model, platform):
    """Gaudi (device hpu) runs torch_native attention and PyTorch sampling."""
    if view.device == "hpu":
        return {"attention_backend": "torch_native", "sampling_backend": "pytorch"}
    return None


@rule("_handle_cpu_backends", overrides=("sampling_backend",))
def handle_cpu_backends(view, model, platform):
    """The CPU engine defaults attention to intel_amx (torch_native on Arm hosts) and
    always samples with PyTorch."""
    if view.device != "cpu":
        return None
    declared: dict = {}
    if view.attention_backend is None:
        declared["attention_backend"] = "intel_amx"
    declared["sampling_backend"] = "pytorch"
    return declared


def _npu_memory_tier(view, memory_mib):
    """(chunked_prefill_size, decode max_bs) of the Ascend memory tiers, or None."""
    if memory_mib is None:
        return None
    small_tp = view.tp_size < 4
    if memory_mib <= 32 * 1024:
        return 4 * 1024, 16 if small_tp else 64
    if memory_mib <= 64 * 1024:
        return 8 * 1024, 64 if small_tp else 256
    return None


@rule(
    "set_default_server_args",
    overrides=(
        "attention_backend",
        "prefill_attention_backend",
        "decode_attention_backend",
        "disable_custom_all_reduce",
        "hicache_io_backend",
        "hicache_mem_layout",
    ),
)
def npu_default_server_args(view, model, platform):
    """Ascend NPUs use the ascend attention backend everywhere, 128-token pages, no
    custom all-reduce, kernel_ascend HiCache IO, and memory-tiered chunk/graph sizes."""
    if view.device != "npu":
        return None
    declared: dict = {
        "attention_backend": "ascend",
        "prefill_attention_backend": "ascend",
        "decode_attention_backend": "ascend",
    }
    if view.page_size is None:
        declared["page_size"] = 128
    tier = _npu_memory_tier(view, platform.memory_mib)
    if tier is not None:
        chunk, max_bs = tier
        if view.chunked_prefill_size is None:
            declared["chunked_prefill_size"] = chunk
        if view.cuda_graph_config[DECODE]["max_bs"] is None:
            config = with_phase(view.cuda_graph_config, DECODE, max_bs=max_bs)
            declared["cuda_graph_config"] = config
    declared["disable_custom_all_reduce"] = True
    if view.enable_hierarchical_cache:
        declared["hicache_io_backend"] = "kernel_ascend"
        layout = "page_first_kv_split" if model.is_mla else "page_first_direct"
        declared["hicache_mem_layout"] = layout
    return declared


@rule("_handle_npu_backends", overrides=("cuda_graph_config",))
def handle_npu_backends(view, model, platform):
    """Ascend compiles prefill graphs eagerly only: another tc_compiler becomes eager."""
    if view.device != "npu":
        return None
    current = view.cuda_graph_config[PREFILL]["tc_compiler"]
    if current is not None and current != "eager":
        config = with_phase(view.cuda_graph_config, PREFILL, tc_compiler="eager")
        return {"cuda_graph_config": config}
    return None


@rule("_handle_mps_backends", overrides=("disable_overlap_schedule",))
def handle_mps_backends(view, model, platform):
    """Apple MPS (without the MLX backend) runs without the overlap scheduler."""
    if view.device == "mps":
        return {"disable_overlap_schedule": True}
    return None


@rule("_handle_xpu_backends", overrides=("cuda_graph_config",))
def handle_xpu_backends(view, model, platform):
    """Intel XPU decode graphs are opt-in: off unless the user pinned the decode
    backend, and only 'full' is supported when they did."""
    if view.device != "xpu":
        return None
    config = view.cuda_graph_config
    if not is_locked(view, DECODE, "backend"):
        return {"cuda_graph_config": with_phase(config, DECODE, backend=DISABLED)}
    if config[DECODE]["backend"] not in (DISABLED, FULL):
        return {"cuda_graph_config": with_phase(config, DECODE, backend=DISABLED)}
    return None


@rule("_handle_symm_mem_device_support", overrides=("enable_symm_mem",))
def handle_symm_mem_device_support(view, model, platform):
    """NCCL symmetric memory exists only on CUDA and ROCm; elsewhere it is switched off."""
    if view.enable_symm_mem and not (platform.is_cuda or platform.is_hip):
        return {"enable_symm_mem": False}
    return None


STEPS = (
    handle_hpu_backends,
    handle_cpu_backends,
    npu_default_server_args,
    handle_npu_backends,
    handle_mps_backends,
    handle_xpu_backends,
    handle_symm_mem_device_support,
)
