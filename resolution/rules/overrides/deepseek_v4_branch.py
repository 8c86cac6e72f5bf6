"""DeepSeek V4 in the model phase: the kv-cache dtype and request-count
defaults after the providers, then its branch's context-parallel layout,
MegaMoE token-budget check and per-platform kernel switches (environment).
"""

from __future__ import annotations

from flotilla.resolution.engine import Env, ensure, reject, rule
from flotilla.resolution.rules.overrides.support import device_of, env_is_set

DSV4 = "DeepseekV4ForCausalLM"
_MEGA_MOE_MAX_TOKENS_PER_RANK = 8192  # SGLANG_OPT_DEEPGEMM_MEGA_MOE_NUM_MAX_TOKENS_PER_RANK default


def _false(name: str) -> dict:
    return {Env(name): "False"}


@rule("_deepseek_v4_kv_cache_dtype", overrides=("kv_cache_dtype",), whitelist=True)
def deepseek_v4_kv_cache_dtype(view, model, platform):
    """DeepSeek V4 keeps an FP8 KV cache by default (bfloat16 on NPU); other dtypes are rejected."""
    if model.architecture != DSV4:
        return None
    kv_cache_dtype = view.kv_cache_dtype
    if kv_cache_dtype == "auto":
        kv_cache_dtype = "fp8_e4m3"
    if device_of(view, platform) == "npu":
        kv_cache_dtype = "bfloat16"
    ensure(kv_cache_dtype in ("fp8_e4m3", "bfloat16"), f"{kv_cache_dtype} is not supported for {DSV4}")
    return {"kv_cache_dtype": kv_cache_dtype} if kv_cache_dtype != view.kv_cache_dtype else None


@rule("apply_deepseek_v4_defaults")
def apply_deepseek_v4_defaults(view, model, platform):
    """DeepSeek V4 caps running requests at 256 by default, only speculates with EAGLE
    (top-k 1) or DSPARK, and keeps FlashMLA sparse prefill off on ROCm."""
    if model.architecture != DSV4:
        return None
    declared: dict = {}
    if platform.is_hip:
        # NOTE: the sparse prefill kernel returns wrong output on MI355X.
        declared.update(_false("SGLANG_OPT_FLASHMLA_SPARSE_PREFILL"))
    if view.max_running_requests is None:
        declared["max_running_requests"] = 256
    if view.speculative_algorithm is not None:
        ensure(
            view.speculative_algorithm in ("EAGLE", "DSPARK"),
            f"Only EAGLE and DSPARK speculative algorithms are supported for {DSV4}",
        )
        if view.speculative_algorithm == "EAGLE":
            ensure(
                view.speculative_eagle_topk == 1,
                f"Only EAGLE speculative algorithm with topk == 1 is supported for {DSV4}",
            )
    return declared


@rule(
    "validate_deepseek_v4_cp",
    overrides=(
        "enable_dsa_prefill_context_parallel",
        "enable_prefill_context_parallel",
        "dsa_prefill_cp_mode",
        "enable_dp_attention",
        "moe_dense_tp_size",
        "attn_cp_size",
    ),
)
def validate_deepseek_v4_cp(view, model, platform):
    """DeepSeek V4 prefill CP is interleaved round-robin split over one node, with DP
    attention on, dense MoE TP 1 and the whole TP group as the CP group."""
    if model.architecture != DSV4 or not view.enable_prefill_cp:
        return None
    if view.cp_strategy != "interleave":
        reject(f"DeepSeekV4 only supports interleave CP strategy, got {view.cp_strategy}")
    ensure(view.dp_size == 1, "For round-robin split mode, dp attention is not supported.")
    ensure(
        view.tp_size <= 8,
        "Context parallel only supports single machine (tp_size <= 8). Cross-machine CP has precision issues.",
    )
    supported = ("none", "deepep", "megamoe", "mori")
    if view.moe_a2a_backend not in supported:
        reject(f"DeepSeekV4 CP supports moe_a2a_backend in {supported}, got {view.moe_a2a_backend!r}.")
    return {
        "enable_dsa_prefill_context_parallel": True,
        "enable_prefill_context_parallel": False,
        "dsa_prefill_cp_mode": "round-robin-split",
        "enable_dp_attention": True,
        "moe_dense_tp_size": 1,
        "attn_cp_size": view.tp_size // view.dp_size,
        **_false("SGLANG_OPT_FLASHMLA_SPARSE_PREFILL"),
    }


def _mega_moe_partition(view) -> tuple[int, str, int, int]:
    """(partition size, partition name, token alignment, local chunk) of one prefill chunk."""
    chunk = view.chunked_prefill_size
    if view.enable_prefill_cp:
        size = view.attn_cp_size
        return size, "attn_cp_size", 1, (chunk + size - 1) // size
    if view.enable_dp_attention:
        alignment = max(view.tp_size // view.dp_size // view.attn_cp_size, 1)
        return view.dp_size, "dp_size", alignment, chunk // view.dp_size
    return 1, "none", max(view.tp_size // view.attn_cp_size, 1), chunk


@rule("validate_deepseek_v4_mega_moe_token_budget")
def validate_deepseek_v4_mega_moe_token_budget(view, model, platform):
    """DeepSeek V4 with MegaMoE needs a bounded per-rank prefill token budget that
    fits MegaMoE's per-rank buffer (decode workers and dynamic-chunking PP are exempt)."""
    if model.architecture != DSV4 or view.moe_a2a_backend != "megamoe":
        return None
    if view.disaggregation_mode == "decode" or (view.pp_size > 1 and view.enable_dynamic_chunking):
        return None
    chunk = view.chunked_prefill_size
    if chunk is None or chunk <= 0:
        reject(
            "DeepSeekV4 with MegaMoE requires chunked prefill to be enabled. "
            "Set --chunked-prefill-size to a positive value; "
            "--chunked-prefill-size=-1 is unsafe because MegaMoE's per-rank "
            "token requirement would not have a strict prefill-forward bound."
        )
    size, name, alignment, local = _mega_moe_partition(view)
    if local <= 0:
        reject(
            "DeepSeekV4 with MegaMoE requires a positive effective per-rank "
            "chunked prefill size. "
            f"Current values: chunked_prefill_size={chunk}, "
            f"token_partition={name}, token_partition_size={size}."
        )
    required = (local + alignment - 1) // alignment * alignment
    limit = int(view.env("SGLANG_OPT_DEEPGEMM_MEGA_MOE_NUM_MAX_TOKENS_PER_RANK") or _MEGA_MOE_MAX_TOKENS_PER_RANK)
    if limit < required:
        reject(
            "DeepSeekV4 with MegaMoE requires "
            "SGLANG_OPT_DEEPGEMM_MEGA_MOE_NUM_MAX_TOKENS_PER_RANK to "
            "cover each rank's effective prefill token budget. "
            f"Current values: chunked_prefill_size={chunk}, "
            f"token_partition={name}, token_partition_size={size}, "
            f"token_alignment={alignment}, required_per_rank={required}, "
            f"SGLANG_OPT_DEEPGEMM_MEGA_MOE_NUM_MAX_TOKENS_PER_RANK={limit}. Set "
            "SGLANG_OPT_DEEPGEMM_MEGA_MOE_NUM_MAX_TOKENS_PER_RANK to at "
            f"least {required}, or lower "
            "--chunked-prefill-size until the effective per-rank budget fits. "
            "Otherwise MegaMoE falls back to the fused MoE path at runtime."
        )
    return None


@rule("_handle_model_specific_adjustments")
def deepseek_v4_platform_kernels(view, model, platform):
    """DeepSeek V4 kernel switches: SM120 lacks tcgen05/TMEM and big SMEM (no DeepGEMM
    prenorm, no top-k v2, TileLang indexer); ROCm uses the aiter indexer paths."""
    if model.architecture != DSV4:
        return None
    if platform.is_sm120:
        declared = {
            **_false("SGLANG_OPT_FP8_WO_A_GEMM"),
            **_false("SGLANG_OPT_USE_TOPK_V2"),
            **_false("SGLANG_OPT_USE_TILELANG_MHC_PRE"),
        }
        if not env_is_set(view, "SGLANG_OPT_FUSE_MHC_POST_PRE"):
            declared[Env("SGLANG_OPT_FUSE_MHC_POST_PRE")] = "True"
        declared.update(_false("SGLANG_OPT_DEEPGEMM_HC_PRENORM"))
        declared[Env("SGLANG_FP8_PAGED_MQA_LOGITS_TORCH")] = "True"
        declared[Env("SGLANG_OPT_USE_TILELANG_INDEXER")] = "True"
        return declared
    if platform.is_hip:
        return {
            **_false("SGLANG_OPT_DEEPGEMM_HC_PRENORM"),
            **_false("SGLANG_OPT_FP8_WO_A_GEMM"),
            **_false("SGLANG_OPT_USE_JIT_INDEXER_METADATA"),
            Env("SGLANG_OPT_USE_TOPK_V2"): "True",
            Env("SGLANG_OPT_USE_AITER_INDEXER"): "True",
            **_false("SGLANG_OPT_USE_TILELANG_MHC_PRE"),
            **_false("SGLANG_OPT_USE_TILELANG_MHC_POST"),
            Env("SGLANG_FP8_PAGED_MQA_LOGITS_TORCH"): "True",
            **_false("SGLANG_OPT_USE_MULTI_STREAM_OVERLAP"),
            Env("SGLANG_EAGER_INPUT_NO_COPY"): "True",
        }
    return None
