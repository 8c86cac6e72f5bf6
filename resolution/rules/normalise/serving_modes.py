"""Serving modes settled before the CUDA-graph config: the expert-pack load format
and prefill/decode (PD) disaggregation.

not ported: raw-GGUF expert-pack preparation (the model path is a directory
holding config.json, never a .gguf shard).
not ported: existence checks of the expert-pack, manifest and source GGUF files
(paths on the worker; flotilla resolves without them).
not ported: SGLANG_RUST_SERVER bootstrap-port aliasing and the
SGLANG_DISAGG_STAGING_BUFFER check (variables a clean environment never sets).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from flotilla.resolution.engine import Env, ensure, reject, rule
from flotilla.resolution.rules.normalise.cuda_graph import DISABLED
from flotilla.resolution.rules.live import Live

_DEEPSEEK_V4_MODEL_TYPE = "deepseek_v4"
_KIMI_K3_MODEL_TYPE = "kimi_linear"
_KIMI_K3_REQUIRED_CONFIG = {
    "num_hidden_layers": 93,
    "num_experts": 896,
    "num_experts_per_token": 16,
    "first_k_dense_replace": 1,
    "routed_expert_hidden_size": 3584,
    "moe_intermediate_size": 3072,
    "num_shared_experts": 2,
    "hidden_act": "situ",
    "activation_situ_beta": 4.0,
    "activation_situ_linear_beta": 25.0,
}


def _expert_pack_model_errors(model: Any) -> tuple[str | None, list[str]]:
    model_type = model.model_type
    if model_type == _DEEPSEEK_V4_MODEL_TYPE:
        return model_type, []
    if model_type != _KIMI_K3_MODEL_TYPE:
        return None, [
            "model_type must be 'deepseek_v4' or the text-only Kimi-K3 "
            f"'kimi_linear' config, got {model_type!r}"
        ]
    errors = []
    for key, expected in _KIMI_K3_REQUIRED_CONFIG.items():
        actual = model.get(key)
        if actual != expected:
            errors.append(f"Kimi-K3 {key} must be {expected!r}, got {actual!r}")
    return model_type, errors


def _expert_pack_flag_errors(view: Any) -> list[str]:
    errors = []
    for label, option, size in (
        ("tensor", "--tp-size", view.tp_size),
        ("data", "--dp-size", view.dp_size),
        ("expert", "--ep-size", view.ep_size),
    ):
        if size != 1:
            errors.append(f"{label} parallelism ({option}) must be 1, got {size}")
    if view.enforce_shared_experts_fusion:
        errors.append("--enforce-shared-experts-fusion is incompatible with expert_pack")
    if view.enable_waterfill:
        errors.append("--enable-waterfill is incompatible with expert_pack")
    raw = view.cuda_graph_config if isinstance(view.cuda_graph_config, Mapping) else {}
    selected = {
        "decode": view.cuda_graph_backend_decode,
        "prefill": view.cuda_graph_backend_prefill,
    }
    for phase, flag_backend in selected.items():
        phase_config = raw.get(phase) if isinstance(raw.get(phase), Mapping) else {}
        backend = phase_config.get("backend", flag_backend)
        if backend not in (None, DISABLED):
            errors.append(
                f"expert_pack requires the {phase} CUDA graph backend to be "
                f"disabled, got {backend!r}"
            )
    return errors


def _loader_config(view: Any, errors: list[str]) -> Mapping:
    config = view.model_loader_extra_config or {}
    if isinstance(config, str):
        try:
            config = json.loads(config)
        except json.JSONDecodeError as exc:
            errors.append(f"--model-loader-extra-config must be valid JSON: {exc}")
            config = {}
    if not isinstance(config, Mapping):
        errors.append("--model-loader-extra-config must be a JSON object")
        config = {}
    return config


@rule(
    "handle_expert_pack",
    overrides=("disable_cuda_graph", "disable_shared_experts_fusion"),
)
def handle_expert_pack(view, model, platform):
    """--load-format expert_pack runs one rank with CUDA graphs and shared-experts
    fusion off, on a DeepSeek-V4 or Kimi-K3 config with a pack_path; every problem
    is reported in one error.

    Deviation: the pack/manifest/source files are not checked for existence.
    """
    if view.load_format != "expert_pack":
        return None
    errors = _expert_pack_flag_errors(view)
    loader_config = _loader_config(view, errors)
    if not loader_config.get("pack_path"):
        errors.append(
            "pack_path is required in --model-loader-extra-config or SGLANG_EXPERT_PACK_PATH"
        )
    model_kind, model_errors = _expert_pack_model_errors(model)
    errors.extend(model_errors)
    if model_kind == _KIMI_K3_MODEL_TYPE and not loader_config.get("manifest_path"):
        errors.append("Kimi-K3 requires manifest_path in loader config")
    if model_kind == _DEEPSEEK_V4_MODEL_TYPE:
        for name in ("source_path", "source_sha256", "model_identity_sha256", "config_sha256"):
            if not loader_config.get(name):
                errors.append(f"deepseek-v4-flash loader config requires {name}")
    if errors:
        details = "\n".join(f"- {error}" for error in errors)
        reject(f"Invalid expert_pack configuration:\n{details}")
    declared: dict = {"disable_cuda_graph": True, "disable_shared_experts_fusion": True}
    if model_kind == _DEEPSEEK_V4_MODEL_TYPE:
        declared[Env("SGLANG_OPT_FP8_WO_A_GEMM")] = "False"
    return declared


@rule(
    "handle_pd_disaggregation",
    overrides=(
        "disaggregation_transfer_backend",
        "disaggregation_ib_device",
        "disable_radix_cache",
    ),
)
def handle_pd_disaggregation(view, model, platform):
    """PD checks: mooncake_tcp is mooncake over TCP; a decode server runs a chunk cache
    (unless its experimental radix cache is on) with extra transfer slots for small
    batches, and decode DCP needs mooncake/nixl/fake; prefill cannot use 'fake'."""
    live = Live(view)
    if live.disaggregation_transfer_backend == "mooncake_tcp":
        live.set_env("MC_FORCE_TCP", "1")
        live.declare(disaggregation_transfer_backend="mooncake", disaggregation_ib_device=None)
    mode = live.disaggregation_mode
    if mode == "decode" and live.dcp_size > 1:
        if live.disaggregation_transfer_backend not in ("mooncake", "nixl", "fake"):
            reject(
                "PD decode DCP requires --disaggregation-transfer-backend "
                "mooncake, nixl, or fake for synthetic benchmarking, got "
                f"{live.disaggregation_transfer_backend!r}."
            )
        if live.disaggregation_decode_enable_radix_cache:
            reject(
                "PD decode DCP currently requires chunk cache; "
                "--disaggregation-decode-enable-radix-cache is not supported."
            )
        if live.enable_hierarchical_cache:
            reject(
                "PD decode DCP currently requires chunk cache; "
                "--enable-hierarchical-cache is not supported."
            )
    if mode == "decode":
        _decode_server(live)
    elif mode == "prefill":
        ensure(
            live.disaggregation_transfer_backend != "fake",
            "Prefill server does not support 'fake' as the transfer backend",
        )
    return live.out


def _decode_server(live: Live) -> None:
    if live.disaggregation_decode_enable_radix_cache:
        if live.enable_hisparse:
            reject(
                "--disaggregation-decode-enable-radix-cache is incompatible "
                "with --enable-hisparse"
            )
        if live.disaggregation_transfer_backend == "fake":
            reject(
                "--disaggregation-decode-enable-radix-cache is incompatible "
                "with --disaggregation-transfer-backend fake"
            )
        if live.speculative_algorithm is not None:
            reject(
                "--disaggregation-decode-enable-radix-cache is incompatible "
                "with speculative decoding "
                f"(--speculative-algorithm {live.speculative_algorithm})"
            )
        live.declare(disable_radix_cache=False)
    else:
        live.declare(disable_radix_cache=True)
    if live.disaggregation_decode_extra_slots is None:
        extra_slots = 0
        if live.max_running_requests is not None:
            per_worker = live.max_running_requests // max(1, live.dp_size)
            if per_worker <= 32:
                extra_slots = per_worker * 2
        live.declare(disaggregation_decode_extra_slots=extra_slots)


STEPS = (handle_expert_pack, handle_pd_disaggregation)
