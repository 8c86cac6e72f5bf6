"""MoE all-to-all (A2A) dispatch backends: the backend and EP-size overrides,
shared-experts fusion adjustments, and the per-backend requirements (SGLang's
``handle_a2a_moe``), plus the CuteDSL dispatch-budget check that runs once
speculative decoding is settled.

not ported: the per-backend log lines (logging only).
"""

from __future__ import annotations

from flotilla.resolution.engine import ensure, reject, rule
from flotilla.resolution.rules.parallel import graphs
from flotilla.resolution.rules.parallel.context_parallel import is_instance_connector
from flotilla.resolution.rules.common import env_flag
from flotilla.resolution.rules.live import Live

# Backends whose expert parallelism spans the whole TP group.
EP_SPANNING_BACKENDS = frozenset(
    {"megamoe", "deepep", "deepep_v2", "mooncake", "nixl", "ascend_fuseep", "flashinfer", "mori", "pplx"}
)
DEEPEP_V2_ARCHITECTURES = ("DeepseekV3ForCausalLM", "DeepseekV4ForCausalLM", "Qwen3MoeForCausalLM")
FLASHINFER_A2A_RUNNERS = (
    "flashinfer_cutlass",
    "flashinfer_cutedsl",
    "flashinfer_trtllm",
    "flashinfer_trtllm_routed",
    "deep_gemm",
)
NVFP4_DISPATCH_ENV = "SGLANG_MOE_NVFP4_DISPATCH"
# Per-rank dispatch capacities and their defaults when the variable is unset.
MORI_CAPACITY = ("SGLANG_MORI_NUM_MAX_DISPATCH_TOKENS_PER_RANK", 4096)
PPLX_CAPACITY = ("SGLANG_PPLX_NUM_MAX_DISPATCH_TOKENS_PER_RANK", 128)
FLASHINFER_CAPACITY = ("SGLANG_FLASHINFER_NUM_MAX_DISPATCH_TOKENS_PER_RANK", None)


def _env_int(view, spec):
    name, default = spec
    value = view.env(name)
    return int(value) if value is not None else default


@rule("_a2a_backend_overrides", overrides=("moe_a2a_backend",), whitelist=True)
def a2a_backend_overrides(view, model, platform):
    """Waterfill needs the DeepEP (or MegaMoE) A2A backend; any other choice becomes DeepEP."""
    if view.enable_waterfill and view.moe_a2a_backend not in ("deepep", "megamoe"):
        return {"moe_a2a_backend": "deepep"}
    return None


@rule("_a2a_ep_size", overrides=("ep_size",), whitelist=True)
def a2a_ep_size(view, model, platform):
    """An A2A dispatch backend spreads experts over the whole TP group, so ep_size becomes tp_size."""
    if view.moe_a2a_backend in EP_SPANNING_BACKENDS:
        return {"ep_size": view.tp_size}
    return None


@rule("_a2a_fusion_adjustments", overrides=("disable_shared_experts_fusion",), whitelist=True)
def a2a_fusion_adjustments(view, model, platform):
    """Waterfill requires shared-experts fusion on; FlashInfer and DeepEP v2 A2A require it off."""
    backend = view.moe_a2a_backend
    if backend in ("deepep", "megamoe") and view.enable_waterfill:
        if view.disable_shared_experts_fusion:
            return {"disable_shared_experts_fusion": False}
        return None
    if backend in ("flashinfer", "deepep_v2"):
        return {"disable_shared_experts_fusion": True}
    return None


def _deepep(live: Live) -> None:
    """DeepEP: CuteDSL FP4 needs low-latency dispatch; normal mode cannot use CUDA graphs."""
    if live.moe_runner_backend == "flashinfer_cutedsl":
        if live.deepep_mode == "auto":
            live.declare(deepep_mode="low_latency")
        elif live.deepep_mode == "normal":
            reject(
                "flashinfer_cutedsl FP4 MoE only supports DeepEP "
                "low_latency dispatch (masked layout). DeepEP normal "
                "(prefill) dispatch has no CuteDSL FP4 handler. Pass "
                "--deepep-mode low_latency or auto."
            )
    if live.deepep_mode == "normal":
        for phase in (graphs.DECODE, graphs.PREFILL):
            live.declare(cuda_graph_config=graphs.with_phase(live.cuda_graph_config, phase, backend=graphs.DISABLED))


def _deepep_v2_architecture(live: Live, model) -> None:
    if is_instance_connector(live.model_path):
        reject(
            "DeepEP v2 MoE cannot validate a model loaded through an instance "
            "connector. Load it from a model path or use "
            "--moe-a2a-backend deepep."
        )
    arch = model.architectures[0] if model.architectures else None
    if arch not in DEEPEP_V2_ARCHITECTURES:
        reject(
            f"DeepEP v2 MoE is not validated for {arch!r}; supported "
            f"architectures are {sorted(DEEPEP_V2_ARCHITECTURES)}. "
            "Other model workflows may require an all-reduce after A2A "
            "combine. Use --moe-a2a-backend deepep."
        )


def _deepep_v2(live: Live, model) -> None:
    """DeepEP v2: validated architectures only, DeepGEMM runner, no TBO/SBO, no prefill graph."""
    _deepep_v2_architecture(live, model)
    if live.enable_deterministic_inference:
        reject(
            "DeepEP v2 does not forward deterministic=True to "
            "ElasticBuffer, so deterministic sorting remains disabled. "
            "Disable --enable-deterministic-inference or use "
            "--moe-a2a-backend deepep."
        )
    # ElasticBuffer needs CUMEM (SGLang sets it only when unset).
    if live.env("NCCL_CUMEM_ENABLE") is None:
        live.set_env("NCCL_CUMEM_ENABLE", "1")
    runner = live.moe_runner_backend
    if runner == "auto":
        live.declare(moe_runner_backend="deep_gemm")
    elif runner != "deep_gemm":
        reject(
            "DeepEP v2 MoE currently supports only "
            f"--moe-runner-backend deep_gemm. Got {runner!r}. "
            "Add a runner adapter before enabling DeepEP v2 with other "
            "MoE runners."
        )
    if live.enable_two_batch_overlap or live.enable_single_batch_overlap:
        reject(
            "DeepEP v2 MoE has not implemented the TBO/SBO overlap hooks yet. "
            "Disable --enable-two-batch-overlap and "
            "--enable-single-batch-overlap when using --moe-a2a-backend deepep_v2."
        )
    if live.enforce_shared_experts_fusion:
        reject(
            "DeepEP v2 MoE has not validated fused shared experts yet. "
            "Remove --enforce-shared-experts-fusion when using "
            "--moe-a2a-backend deepep_v2."
        )
    live.declare(cuda_graph_config=graphs.with_phase(live.cuda_graph_config, graphs.PREFILL, backend=graphs.DISABLED))


def _flashinfer(live: Live, model) -> None:
    """FlashInfer A2A: DP attention over the whole TP group, a FlashInfer/DeepGEMM runner, NVFP4 dispatch for FP4."""
    ensure(
        live.enable_dp_attention and live.dp_size == live.tp_size,
        "Flashinfer MoE A2A is only supported with dp_size == tp_size and --enable-dp-attention",
    )
    w4a16 = live.moe_runner_backend == "flashinfer_cutedsl" and env_flag(live, "SGLANG_FLASHINFER_CUTEDSL_NVFP4_W4A16")
    if w4a16:
        if env_flag(live, NVFP4_DISPATCH_ENV):
            reject(
                "CuTe DSL NVFP4 W4A16 requires BF16 FlashInfer MoE "
                "dispatch; unset SGLANG_MOE_NVFP4_DISPATCH."
            )
    elif live.env(NVFP4_DISPATCH_ENV) is None and (
        live.quantization == "modelopt_fp4" or model.nvfp4_moe_meta
    ):
        live.set_env(NVFP4_DISPATCH_ENV, "True")
    ensure(
        live.moe_runner_backend in FLASHINFER_A2A_RUNNERS,
        "FlashInfer MoE A2A is supported with flashinfer_cutlass, "
        "flashinfer_cutedsl, flashinfer_trtllm, "
        "flashinfer_trtllm_routed, or deep_gemm.",
    )


def _checks_prefill_dispatch(live: Live) -> bool:
    chunk = live.chunked_prefill_size
    return chunk is not None and chunk > 0 and live.disaggregation_mode != "decode"


def _mori(live: Live) -> None:
    """MoRI: normal dispatch by default; a prefill chunk must fit the per-rank dispatch buffer."""
    if live.deepep_mode == "auto":
        live.declare(deepep_mode="normal")
    if _checks_prefill_dispatch(live):
        ensure(
            live.chunked_prefill_size <= _env_int(live, MORI_CAPACITY),
            "SGLANG_MORI_NUM_MAX_DISPATCH_TOKENS_PER_RANK (default 4096) "
            "must be >= the per-rank MoRI dispatch tokens "
            "(chunked_prefill_size by default)",
        )


def _pplx(live: Live) -> None:
    """pplx: low-latency dispatch, DP attention with >= 2 DP groups, the DeepGEMM runner, a small dispatch budget."""
    if live.deepep_mode == "normal":
        reject(
            "moe_a2a_backend='pplx' only supports low-latency mode; "
            "set --deepep-mode to 'low_latency' or 'auto'."
        )
    if live.deepep_mode == "auto":
        live.declare(deepep_mode="low_latency")
    ensure(
        live.enable_dp_attention and live.dp_size >= 2,
        "moe_a2a_backend='pplx' requires --enable-dp-attention with at "
        "least 2 DP groups (--dp-size >= 2).",
    )
    ensure(
        live.moe_runner_backend in ("deep_gemm", "auto"),
        "moe_a2a_backend='pplx' is only supported with --moe-runner-backend "
        "deep_gemm (or auto).",
    )
    if live.moe_runner_backend == "auto":
        live.declare(moe_runner_backend="deep_gemm")
    if _checks_prefill_dispatch(live):
        required = live.chunked_prefill_size
        if live.cuda_graph_max_bs_decode is not None:
            required = max(required, live.cuda_graph_max_bs_decode)
        ensure(
            required <= _env_int(live, PPLX_CAPACITY),
            "SGLANG_PPLX_NUM_MAX_DISPATCH_TOKENS_PER_RANK (default 128) "
            "must be >= the per-rank pplx dispatch tokens "
            "(chunked_prefill_size, or the decode cuda-graph batch size)",
        )


@rule(
    "_handle_a2a_moe",
    overrides=(
        "enforce_shared_experts_fusion",
        "deepep_mode",
        "cuda_graph_config",
        "moe_runner_backend",
        "moe_a2a_backend",
    ),
)
def handle_a2a_moe(view, model, platform):
    """Each A2A backend fixes its dispatch mode, MoE runner and CUDA-graph phases, and checks its requirements.

    Declares ``NCCL_CUMEM_ENABLE=1`` for DeepEP v2 and
    ``SGLANG_MOE_NVFP4_DISPATCH=True`` for FlashInfer A2A with NVFP4 experts.
    """
    live = Live(view)
    backend = view.moe_a2a_backend
    if view.enable_waterfill:
        live.declare(enforce_shared_experts_fusion=True)
    if backend == "deepep":
        _deepep(live)
    if backend == "deepep_v2":
        _deepep_v2(live, model)
    current = live.moe_a2a_backend
    if (current == "none" and platform.is_npu) or current == "ascend_tp":
        live.declare(moe_a2a_backend="none")
    if live.moe_a2a_backend == "flashinfer":
        _flashinfer(live, model)
    if backend == "mori":
        _mori(live)
    if backend == "pplx":
        _pplx(live)
    return live.out


def cutedsl_max_tokens(view) -> int:
    """The largest token count one CuteDSL MoE forward routes on one rank
    (prefill, piecewise prefill capture, or decode/verify)."""
    per_request = (view.speculative_num_draft_tokens or 1) if view.speculative_algorithm else 1
    prefill_tokens = view.max_prefill_tokens
    prefill = graphs.phase_settings(view, graphs.PREFILL)
    if graphs.phase_backend(view, graphs.PREFILL) == graphs.TC_PIECEWISE:
        prefill_tokens = max(prefill_tokens, prefill.get("max_bs") or 0)
    decode_max_bs = graphs.phase_settings(view, graphs.DECODE).get("max_bs") or 0
    return max(prefill_tokens, decode_max_bs * per_request)


@rule("validate_cutedsl_a2a_token_budget")
def validate_cutedsl_a2a_token_budget(view, model, platform):
    """FlashInfer A2A with the CuteDSL runner needs a dispatch workspace covering its largest MoE forward.

    NOTE: runs after speculative decoding so the tokens per request are final.
    """
    if not (
        view.moe_a2a_backend == "flashinfer"
        and view.moe_runner_backend == "flashinfer_cutedsl"
        and view.max_prefill_tokens > 0
        and view.disaggregation_mode != "decode"
    ):
        return None
    required = cutedsl_max_tokens(view)
    per_rank = _env_int(view, FLASHINFER_CAPACITY) or 1024
    capacity = per_rank * view.ep_size
    if capacity < required:
        needed_per_rank = (required + view.ep_size - 1) // view.ep_size
        reject(
            "FlashInfer MoE A2A with flashinfer_cutedsl requires "
            "SGLANG_FLASHINFER_NUM_MAX_DISPATCH_TOKENS_PER_RANK * "
            "ep_size to cover the largest CuteDSL MoE forward "
            f"({required} tokens). Otherwise the FlashInfer "
            "dispatcher can crash at runtime with "
            "`ValueError: num_tokens (...) exceeds max_num_tokens (...)`. "
            "Current values: "
            f"SGLANG_FLASHINFER_NUM_MAX_DISPATCH_TOKENS_PER_RANK="
            f"{per_rank}, ep_size={view.ep_size}, "
            f"capacity={capacity}, required={required}. "
            f"Set `export "
            f"SGLANG_FLASHINFER_NUM_MAX_DISPATCH_TOKENS_PER_RANK="
            f"{needed_per_rank}` or lower the relevant limit "
            f"(e.g. --max-prefill-tokens) to <= {capacity}."
        )
    return None


STEPS = [
    a2a_backend_overrides,
    a2a_ep_size,
    a2a_fusion_adjustments,
    handle_a2a_moe,
]
