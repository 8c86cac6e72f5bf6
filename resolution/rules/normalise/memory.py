"""GPU-memory-derived defaults (SGLang's ``memory_hook``): chunked prefill size,
CUDA-graph capture sizes and ``mem_fraction_static``.

Device memory is ``platform.memory_mib`` (SGLang reads nvidia-smi / rocminfo,
which report the same figure). Later rules depend on these numbers: DP attention
divides ``chunked_prefill_size`` by ``dp_size``.

not ported: the post-capture KV sizing branch (needs
SGLANG_ENABLE_POST_CAPTURE_KV_SIZING, which no rule sets).
Deviation: on the CPU engine SGLang sizes by the host's NUMA memory; flotilla
uses ``platform.memory_mib`` (unknown on the ``cpu`` preset, so the
fallback defaults apply).
Deviation: ViT sizes missing from ``vision_config`` use SGLang's fallbacks
(24 layers, hidden 1024), not the vision config class's own defaults.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from flotilla.resolution.engine import ensure, rule
from flotilla.resolution.frozen import thaw
from flotilla.resolution.rules.normalise import model_traits as traits
from flotilla.resolution.rules.normalise.cuda_graph import (
    BREAKABLE,
    DECODE,
    DISABLED,
    PREFILL,
    cpu_batch_sizes,
    decode_batch_sizes,
    is_locked,
    prefill_batch_sizes,
)
from flotilla.resolution.rules.live import Live

_PP_PREFILL_GRAPH_MAX_TOKENS = 8192
_MEMORY_DEVICES = ("hpu", "npu", "cpu", "xpu", "musa")


def device_memory_mib(view: Any, platform: Any) -> float | None:
    """One device's memory in MiB as SGLang's ``get_device_memory_capacity`` sees it."""
    if platform.is_cuda or platform.is_hip or view.device in _MEMORY_DEVICES:
        return None if platform.memory_mib is None else float(platform.memory_mib)
    return None


def _memory_tier(memory: float | None, tp_size: int) -> tuple[int, int]:
    """(chunked_prefill_size, decode graph max_bs) for a device of ``memory`` MiB."""
    if memory is None:
        return 4096, 160
    small_tp = tp_size < 4
    if memory < 20 * 1024:  # T4, 4080
        return 2048, 8
    if memory < 35 * 1024:  # A10, 4090, 5090
        return 2048, 24 if small_tp else 80
    if memory < 60 * 1024:  # A100 40GB, L40
        return 4096, 32 if small_tp else 160
    if memory < 160 * 1024:  # H100, A100 80GB, H20, H200
        return 8192, 256 if small_tp else 512
    return 16384, 512  # B200, MI300


def _graph_reserve_mb(live: Live, model: Any, decode: dict, prefill: dict) -> float:
    mode = live.disaggregation_mode
    reserved = 0.0
    if mode != "prefill" and decode["backend"] != DISABLED:
        reserved += decode["max_bs"] * 2
    if live.enable_dp_attention and mode != "prefill":
        reserved += decode["max_bs"] * live.dp_size * 3
        if decode["max_bs"] > 300:
            reserved += decode["max_bs"] * live.dp_size * 1.5
    if mode != "decode" and prefill["backend"] != DISABLED:
        reserved += 1.5 * 1024 if model.is_mla else len(prefill["bs"]) * 8
        if prefill["backend"] == BREAKABLE and live.moe_a2a_backend == "deepep":
            reserved += 1024
    return reserved


def _deepep_reserve_mb(live: Live, decode: dict) -> float:
    if (
        live.disaggregation_mode != "prefill"
        and decode["backend"] != DISABLED
        and live.moe_a2a_backend == "deepep"
    ):
        return 2 * 1024
    return 0.0


def _mem_fraction_static(live: Live, model: Any, memory: float | None, decode, prefill) -> float:
    if live.disaggregation_mode == "decode":
        running = live.max_running_requests or decode["max_bs"] or 1
        draft_tokens = live.speculative_num_draft_tokens or 1
        activation_tokens = max(running * draft_tokens, 2048)
    elif live.chunked_prefill_size > 0:
        activation_tokens = max(live.chunked_prefill_size, 2048)
    else:
        activation_tokens = max(live.max_prefill_tokens, 2048)
    reserved = 512 + activation_tokens * 1.5
    reserved += live.tp_size * live.pp_size / 8 * 1024
    reserved += _graph_reserve_mb(live, model, decode, prefill)
    if memory is not None and memory > 60 * 1024:
        reserved = max(reserved, 10 * 1024)
    reserved += _deepep_reserve_mb(live, decode)
    if memory is None:
        return 0.88
    return round((memory - reserved) / memory, 3)


def _size_decode_graph(live: Live, decode: dict) -> None:
    if live.device != "cpu":
        if decode["bs"] is None:
            decode["bs"] = decode_batch_sizes(
                decode["max_bs"],
                no_padding=live.disable_cuda_graph_padding,
                speculative=live.speculative_algorithm is not None,
            )
        else:
            decode["max_bs"] = max(decode["bs"])
        return
    # NOTE: the CPU graph is torch.compile; its limit is torch_compile_max_bs.
    if decode["bs"] is not None:
        live.declare(torch_compile_max_bs=max(decode["bs"]))
    else:
        live.declare(torch_compile_max_bs=live.torch_compile_max_bs or decode["max_bs"])
        decode["bs"] = cpu_batch_sizes(
            live.torch_compile_max_bs, no_padding=live.disable_cuda_graph_padding
        )
    ensure(
        live.torch_compile_max_bs > 0,
        "cuda_graph_config[decode].bs should contain positive batch sizes",
    )
    decode["max_bs"] = live.torch_compile_max_bs


def _size_prefill_graph(live: Live, model: Any, prefill: dict) -> None:
    if prefill["max_bs"] is None:
        prefill["max_bs"] = 2048 if model.is_mla else live.chunked_prefill_size
        if (
            live.pp_size > 1
            and prefill["backend"] == BREAKABLE
            and not is_locked(live, PREFILL, "bs")
            and prefill["max_bs"] > _PP_PREFILL_GRAPH_MAX_TOKENS
        ):
            prefill["max_bs"] = _PP_PREFILL_GRAPH_MAX_TOKENS
        if live.max_total_tokens is not None:
            prefill["max_bs"] = min(prefill["max_bs"], live.max_total_tokens)
        if "llama-2" in (live.model_path or "").lower():
            prefill["max_bs"] = min(prefill["max_bs"], 4096)
    if prefill["bs"] is None:
        prefill["bs"] = prefill_batch_sizes(prefill["max_bs"])


@rule(
    "_handle_gpu_memory_settings",
    overrides=("cuda_graph_config", "torch_compile_max_bs"),
)
def handle_gpu_memory_settings(view, model, platform):
    """Device memory picks chunked_prefill_size and the decode graph max batch size
    (bigger GPUs, bigger values); the capture size lists follow, and
    mem_fraction_static leaves room for activations, graphs and A2A buffers."""
    live = Live(view)
    config = thaw(view.cuda_graph_config)
    decode, prefill = config[DECODE], config[PREFILL]
    memory = device_memory_mib(view, platform)
    chunk, max_bs = _memory_tier(memory, view.tp_size)
    if live.chunked_prefill_size is None:
        live.declare(chunked_prefill_size=chunk)
    if decode["max_bs"] is None:
        decode["max_bs"] = max_bs
    _size_decode_graph(live, decode)
    _size_prefill_graph(live, model, prefill)
    if config != thaw(view.cuda_graph_config):
        live.declare(cuda_graph_config=config)
    if live.mem_fraction_static is None:
        live.declare(mem_fraction_static=_mem_fraction_static(live, model, memory, decode, prefill))
    if live.enable_symm_mem and live.env("SGLANG_SYMM_MEM_PREALLOC_GB_SIZE") is None:
        live.set_env("SGLANG_SYMM_MEM_PREALLOC_GB_SIZE", "4")
    return live.out


@rule("adjust_mem_fraction_for_vlm")
def adjust_mem_fraction_for_vlm(view, model, platform):
    """Multimodal models (outside PD decode and language-only serving) keep more memory
    for the vision encoder: the defaulted fraction shrinks with the ViT's size.

    NOTE: applies only when ``_handle_gpu_memory_settings`` chose the fraction,
    i.e. the user did not set --mem-fraction-static.
    """
    if view.explicit("mem_fraction_static") or view.mem_fraction_static is None:
        return None
    if not traits.is_multimodal(view, model):
        return None
    if view.language_only or view.language_model_only or view.disaggregation_mode == "decode":
        return None
    vision = model.get("vision_config")
    if not isinstance(vision, Mapping):
        return None
    layers = vision.get("num_hidden_layers", 24)
    hidden = vision.get("hidden_size", 1024)
    complexity_ratio = (layers * hidden**2) / (24 * 1024**2)
    adjustment = max(0.8, min(1.05, 1.0 - 0.1 * (complexity_ratio - 1.0)))
    return {"mem_fraction_static": view.mem_fraction_static * (0.95 * adjustment)}


STEPS = (handle_gpu_memory_settings, adjust_mem_fraction_for_vlm)
