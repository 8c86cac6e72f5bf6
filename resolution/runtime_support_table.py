"""The runtime-support table itself: one :class:`Support` entry per server field (what
flotilla's runtime does with it), grouped as the flag tables of
:mod:`flotilla.resolution.fields` are. :mod:`flotilla.resolution.runtime_support` checks
launches against it and prints it.

A change that builds a feature flips its fields to ``honored`` here, in the same commit
(``tests/resolution/test_runtime_support.py`` fails on an honored field without a test of its
effect, and on a refused field the runtime reads outside :data:`GUARDED`).
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Callable, Mapping

from flotilla.resolution.fields import FIELDS

HONORED, REFUSED, NOOP = "honored", "refused", "noop"
STATUSES = (HONORED, REFUSED, NOOP)


@dataclass(frozen=True)
class Support:
    """One field's runtime status.

    Attributes:
        status: ``honored``, ``refused`` or ``noop``.
        note: honored: what acts on it; refused: why, and what to use instead (it ends the
            refusal line); noop: why it has no effect here.
        values: honored: the values the runtime acts on (None: every value); refused: values
            accepted because they ask for what the runtime does anyway (``--grammar-backend
            none``). A user value outside them is refused.
        refusal: for an honored field with ``values``, what the refusal line says of a value
            outside them (default: the values it takes).
        accepts: a check for settings ``values`` cannot express: ``accepts(value, given,
            model)`` returns None when the setting is acted on, else the reason to refuse.
            ``given`` holds every server field the user set; ``model`` is the
            :class:`~flotilla.resolution.model.ModelFacts` when known (None before the
            model's config is read: a model-dependent check then accepts).
    """

    status: str
    note: str
    values: tuple | None = None
    refusal: str | None = None
    accepts: Callable[[Any, Mapping[str, Any], Any], str | None] | None = None

    def reason_to_refuse(self, value: Any, given: Mapping[str, Any], model: Any) -> str | None:
        """Why ``value`` (set by the user) cannot run, or None when the runtime takes it."""
        if self.status == NOOP:
            return None
        if self.accepts is not None:
            return self.accepts(value, given, model)
        if self.values is not None:
            if normal_value(value) in {normal_value(v) for v in self.values}:
                return None
            if self.status == HONORED:
                return self.refusal or f"it takes {_choices(self.values)}"
            return self.note
        return self.note if self.status == REFUSED else None


def normal_value(value: Any) -> Any:
    """A value as the table compares it (lists as tuples)."""
    return tuple(value) if isinstance(value, list) else value


def _choices(values: tuple) -> str:
    shown = [str(v) for v in values]
    return shown[0] if len(shown) == 1 else ", ".join(shown[:-1]) + " or " + shown[-1]


def _table(*groups: Mapping[str, Support]) -> dict[str, Support]:
    table: dict[str, Support] = {}
    for group in groups:
        for name, support in group.items():
            if name in table:
                raise RuntimeError(f"runtime support: field {name} is classified twice")
            table[name] = support
    return table


def honored(note: str, *names: str, values: tuple | None = None, refusal: str | None = None, accepts=None) -> dict:
    return {n: Support(HONORED, note, values, refusal, accepts) for n in names}


def refused(note: str, *names: str, values: tuple | None = None, accepts=None) -> dict:
    return {n: Support(REFUSED, note, values, None, accepts) for n in names}


def noop(note: str, *names: str) -> dict:
    return {n: Support(NOOP, note) for n in names}


# -- checks for settings a list of values cannot express -----------------------------------


def _quantization(value: Any, given: Mapping[str, Any], model: Any) -> str | None:
    if value is None or str(value).lower() == "unquant":
        return None
    method = getattr(model, "quant_method", None) if model is not None else None
    if str(value).lower() == "fp8" and (model is None or method == "fp8"):
        return None
    return (
        "flotilla does not quantize at load time: it runs a checkpoint's own quantization_config "
        "(block FP8, quant_method fp8, 128x128 scales); drop the flag, or serve an FP8 checkpoint"
    )


def _moe_dense_tp(value: Any, given: Mapping[str, Any], model: Any) -> str | None:
    tp, dp = int(given.get("tp_size") or 1), int(given.get("dp_size") or 1)
    attn_tp = tp // dp if given.get("enable_dp_attention") and dp > 0 else tp
    if value is None or int(value) == attn_tp:
        return None
    return (
        f"dense MLPs shard over the attention TP group ({attn_tp} ranks here); other dense TP sizes "
        "are not built: drop --moe-dense-tp-size"
    )


# Levels ``--log-level`` takes (any case), as Python's logging names them.
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")


def _log_level(value: Any, given: Mapping[str, Any], model: Any) -> str | None:
    if str(value).lower() in LOG_LEVELS:
        return None
    return f"--log-level takes {_choices(LOG_LEVELS)}"


def _log_requests_target(value: Any, given: Mapping[str, Any], model: Any) -> str | None:
    if value is None or all(str(v) == "stdout" for v in value):
        return None
    return (
        "request logs go to the replicas' stdout (which Ray collects per node); files in a "
        "directory are not built: use --log-requests-target stdout or leave it out"
    )


# -- the table ------------------------------------------------------------------------------

_NOT_BUILT = "is not built in flotilla's runtime; drop the flag"
# The values the serving side acts on (tests/serve/test_tool_parsers.py checks these lists
# against flotilla.serve's parser registries and flotilla.cluster.engine.grammar's backends).
GRAMMAR_BACKENDS = ("xgrammar", "llguidance", "none")
TOOL_CALL_PARSERS = ("deepseekv3", "glm", "glm45", "glm47", "hermes", "kimi_k2", "llama3", "mistral", "pythonic", "qwen", "qwen25")
REASONING_PARSERS = ("deepseek-r1", "deepseek-v3", "glm45", "kimi", "qwen3", "qwen3-thinking", "step3")

_MODEL = _table(
    honored("the model the engines load (a local HF directory, a .gguf file, a hub id in the local HF cache, or smollm2)", "model_path"),
    honored(
        "how weights load: auto/safetensors/pt read the checkpoint, gguf a .gguf file, dummy makes random weights",
        "load_format",
        values=("auto", "safetensors", "pt", "gguf", "dummy"),
    ),
    honored("the per-request token limit (prompt + max_tokens) and the engine's position range", "context_length"),
    honored("the weights' and activations' dtype", "dtype"),
    honored(
        "the KV cache's storage dtype (the model's dtype, or float8 with scale 1.0)",
        "kv_cache_dtype",
        values=("auto", "bf16", "bfloat16", "fp8_e4m3", "fp8_e5m2"),
        refusal="flotilla's KV cache stores the model dtype, bfloat16 or float8 (fp8_e4m3, fp8_e5m2) only",
    ),
    refused(
        "the runtime loads a checkpoint's own quantization_config (block FP8) and quantizes nothing itself; "
        "--quantization fp8 is accepted for an FP8 checkpoint, as it only names what loads anyway",
        "quantization",
        accepts=_quantization,
    ),
    honored(
        "which snapshot of a hub id in the local HF cache loads (flotilla never downloads); refused for a local path",
        "revision",
    ),
    noop("flotilla runs only its own model code and never executes code shipped with a checkpoint", "trust_remote_code"),
    refused("flotilla's loaders take no extra options; drop the flag", "model_loader_extra_config"),
    refused("embedding models are not served yet; drop the flag", "is_embedding"),
    refused("flotilla runs its own model implementations only; drop the flag", "model_impl", values=("auto",)),
    refused("flotilla reads config.json with its own parser only; drop the flag", "model_config_parser", values=("auto",)),
    refused(
        "model config overrides are not applied by the runtime; edit the checkpoint's config.json instead",
        "json_model_override_args",
        values=("{}", ""),
    ),
    refused(
        "flotilla's FP8 KV cache stores K and V with scale 1.0 and loads no scales; drop the flag",
        "quantization_param_path",
    ),
    refused(
        "ModelOpt quantization at load time is not built; serve a checkpoint that is already quantized",
        "modelopt_quant",
        "modelopt_checkpoint_restore_path",
        "modelopt_checkpoint_save_path",
        "modelopt_export_path",
        "quantize_and_serve",
    ),
    refused("FlashRL quantization profiles are not built; drop the flag", "rl_quant_profile"),
    refused("weights always load before warm-up here; drop the flag", "startup_weight_load_mode", values=("serial",)),
    refused(
        "custom weight loaders, remote weight loading, weight caches and checkpoint engines are not built; "
        "load weights from a local checkpoint",
        "custom_weight_loader",
        "remote_instance_weight_loader_seed_instance_ip",
        "remote_instance_weight_loader_seed_instance_service_port",
        "remote_instance_weight_loader_send_weights_group_ports",
        "remote_instance_weight_loader_backend",
        "remote_instance_weight_loader_start_seed_via_transfer_engine",
        "engine_info_bootstrap_port",
        "modelexpress_config",
        "checkpoint_engine_wait_weights_before_ready",
        "weight_cache_mode",
        "weight_cache_socket",
        "weight_cache_timeout",
    ),
    refused(
        "flotilla's loader has no such option (it memory-maps safetensors and reads each shard once); drop the flag",
        "weight_loader_disable_mmap",
        "weight_loader_prefetch_checkpoints",
        "weight_loader_prefetch_num_threads",
        "weight_loader_drop_cache_after_load",
    ),
    refused("flotilla never downloads a model; fetch it first and pass its directory", "download_dir"),
    refused(
        "checkpoint checksums, deletion after loading and encrypted configs are not built; drop the flag",
        "model_checksum",
        "delete_ckpt_after_loading",
        "decrypted_config_file",
        "decrypted_draft_config_file",
    ),
)

_PARALLEL = _table(
    honored("the tensor-parallel size of each engine's worker group", "tp_size"),
    honored("the data-parallel size (engine replicas, or DP-attention ranks in one group)", "dp_size"),
    honored("the expert-parallel size of MoE layers", "ep_size"),
    honored("decode context parallelism of MLA models (a slice of attention TP)", "dcp_size"),
    honored("how DCP partial attention is merged", "dcp_comm_backend", values=("ag_rs", "a2a")),
    honored("attention runs data-parallel (one scheduler and KV pool per DP rank), MoE over the whole group", "enable_dp_attention"),
    honored(
        "the bound on each collective of a worker group (seconds; a one-rank in-process engine has none)",
        "dist_timeout",
    ),
    honored("the largest EP size an elastic EP group grows to", "max_ep_size"),
    noop(
        "the LM head always shards its vocabulary over the attention-TP group under DP attention, as the flag asks",
        "enable_dp_lm_head",
    ),
    noop(
        "dense MLPs always shard over the attention-TP group under DP attention, as the flag asks",
        "enable_dense_mlp_attn_tp",
    ),
    noop("NCCL and gloo check peer access themselves; there is nothing more to check", "enable_p2p_check"),
    refused(
        "dense MLPs shard over the attention TP group; other dense TP sizes are not built",
        "moe_dense_tp_size",
        accepts=_moe_dense_tp,
    ),
    refused(
        "flotilla's ranks find each other through Ray (placement groups and Ray-assigned ports); start or join a "
        "Ray cluster (--address) instead",
        "nccl_port",
        "dist_init_addr",
        "gated_launch_port",
        "nnodes",
    ),
    refused(
        "flotilla places ranks through Ray and sets the node rank of elastic EP joiners itself; drop the flag",
        "node_rank",
    ),
    refused(
        "flotilla starts the primary elastic EP group and resolves its joiners itself "
        "(--elastic-ep-backend ray --max-ep-size M); drop the flag",
        "ep_join_rank_offset",
        "elastic_ep_initial_size",
    ),
    refused("pipeline parallelism is not built; use --tp-size (and --ep-size for MoE) instead", "pp_size", values=(1,)),
    refused(
        "pipeline parallelism is not built; drop the flag",
        "pp_max_micro_batch_size",
        "pp_async_batch_depth",
        values=(0,),
    ),
    refused(
        "DP ranks get new requests by least load (fewest running + waiting requests); other balancing methods are "
        "not built: drop the flag or pass total_requests",
        "load_balance_method",
        values=("auto", "total_requests"),
    ),
    refused(
        "attention context parallelism beyond DCP is not built; use --dcp-size for MLA models",
        "attn_cp_size",
        values=(1,),
    ),
    refused("MoE data parallelism is not built; choose ep_size * moe_tp covering the group", "moe_dp_size", values=(1,)),
    refused("distributed weight data parallelism " + _NOT_BUILT, "dwdp_size", values=(1,)),
    refused(
        "prefill context parallelism and DSA cache splitting are not built; drop the flag",
        "dcp_replicate_q_proj",
        "enable_prefill_cp",
        "cp_strategy",
        "enable_dsa_cache_layer_split",
        "enable_dsa_prefill_context_parallel",
        "dsa_prefill_cp_mode",
        "enable_prefill_context_parallel",
        "prefill_cp_mode",
        "enable_cp_decode_attn_tp",
    ),
    refused(
        "this layout option " + _NOT_BUILT,
        "enable_dp_attention_local_control_broadcast",
        "enable_tp_lm_head_all_to_all",
        "enable_attn_tp_input_scattered",
        "enable_shared_experts_attn_tp",
        "enable_layernorm_sp",
        "disable_attn_tp_gather",
    ),
)

_MOE = _table(
    honored(
        "none: every EP rank computes its experts for all tokens, then an all-reduce; any other name: flotilla's "
        "all-to-all dispatch/combine over torch.distributed (not the vendor library of that name)",
        "moe_a2a_backend",
    ),
    refused(
        "flotilla's fused MoE runs Triton on CUDA and the torch reference on CPU and in float32, whatever the name; "
        "other MoE kernels are not built: drop the flag or pass auto or triton",
        "moe_runner_backend",
        values=("auto", "triton"),
    ),
    honored("redundant expert slots of the expert placement", "ep_num_redundant_experts"),
    honored(
        "records routed tokens per expert (elastic EP places experts by it)",
        "expert_distribution_recorder_mode",
        values=(None, "stat"),
        refusal="flotilla records per-expert counts only: use --expert-distribution-recorder-mode stat",
    ),
    honored("the expert-load recorder's window (forward passes)", "expert_distribution_recorder_buffer_size"),
    honored(
        "ray: an MoE group grows while serving (flotilla's elastic EP on Ray)",
        "elastic_ep_backend",
        values=(None, "none", "ray"),
        refusal="flotilla's elastic EP runs on Ray: use --elastic-ep-backend ray (mooncake and nixl are not built)",
    ),
    honored("how long an elastic EP scale may wait for its joiners (seconds)", "elastic_ep_scale_timeout"),
    noop("shared experts always run as their own MLP here, unfused, as the flag asks", "disable_shared_experts_fusion"),
    refused(
        "flotilla starts the primary elastic EP group and resolves its joiners itself; drop the flag",
        "ep_join_mode",
        "elastic_ep_rejoin",
    ),
    refused(
        "expert-parallel load balancing (EPLB) at run time is not built; elastic EP places experts by measured "
        "load when a group grows; drop the flag",
        "enable_eplb",
        "eplb_algorithm",
        "eplb_rebalance_num_iterations",
        "eplb_rebalance_layers_per_chunk",
        "eplb_min_rebalancing_utilization_threshold",
        "ep_dispatch_algorithm",
        "init_expert_location",
        "expert_balancedness_report_mode",
        "enable_waterfill",
    ),
    refused(
        "vendor all-to-all libraries (DeepEP, Mooncake, FuseEP, MegaMoE) and their options are not built; "
        "drop the flag (--moe-a2a-backend picks flotilla's own all-to-all)",
        "enable_w4a4_mxfp4_megamoe",
        "deepep_v2_mode",
        "deepep_mode",
        "fuseep_mode",
        "deepep_dispatcher_output_dtype",
        "deepep_config",
        "mooncake_ib_device",
        "enable_elastic_expert_backup",
        "enable_fused_moe_sum_all_reduce",
    ),
    refused(
        "FP4 MoE kernels are not built; drop the flag",
        "flashinfer_mxfp4_moe_precision",
        "disable_flashinfer_cutlass_moe_fp4_allgather",
    ),
    refused("fused shared experts are not built; drop the flag", "enforce_shared_experts_fusion"),
    refused(
        "ktransformers CPU experts are not built; drop the flag",
        "kt_weight_path",
        "kt_method",
        "kt_cpuinfer",
        "kt_threadpool_count",
        "kt_num_gpu_experts",
        "kt_max_deferred_experts_per_token",
    ),
)

# SGLang attention names flotilla maps (see cluster/engine/kernel_backends.py): torch_native and
# flex_attention run the torch reference, the CUDA kernel names run flashinfer.
ATTENTION_BACKENDS = (
    "torch_native", "flex_attention", "intel_amx", "fa3", "fa4", "flashinfer", "triton", "trtllm_mha", "trtllm_mla",
    "flashmla", "cutlass_mla", "cutedsl_mla", "tokenspeed_mla", "dual_chunk_flash_attn", "minicpm_flashattn",
    "minicpm_flashinfer", "hpc_ops",
)  # fmt: skip

_KERNELS = _table(
    honored(
        "the attention kernel family: torch_native/flex_attention run the torch reference, every CUDA kernel name "
        "runs flashinfer (FA3 prefill on SM90); float32 and CPU run the reference",
        "attention_backend",
        "decode_attention_backend",
        "prefill_attention_backend",
        values=ATTENTION_BACKENDS,
        refusal="flotilla maps the dense attention names only (a DSA model picks its sparse kernels by its own fields): use one of "
        + ", ".join(ATTENTION_BACKENDS),
    ),
    honored(
        "flashinfer's sampling kernels, or pytorch for the torch sampler",
        "sampling_backend",
        values=("flashinfer", "pytorch"),
    ),
    noop("flotilla never runs flashinfer's autotuner, so there is nothing to turn off or skip", "disable_flashinfer_autotune", "flashinfer_autotune_skip_ops"),
    noop("flotilla has no custom all-reduce kernel: all-reduce is always NCCL (GPU) or gloo (CPU)", "disable_custom_all_reduce"),
    noop("flotilla never fuses all-reduce with RMSNorm, so it is always off", "enforce_disable_flashinfer_allreduce_fusion"),
    honored(
        "the grammar backend of structured outputs and forced tool calls (none: such requests get a 400)",
        "grammar_backend",
        values=GRAMMAR_BACKENDS,
    ),
    refused(
        "flotilla picks its GEMM kernels itself (F.linear, Triton GEMV, Triton block-FP8); drop the flag",
        "fp8_gemm_runner_backend",
        "fp4_gemm_runner_backend",
        "bf16_gemm_backend",
        values=("auto",),
    ),
    honored(
        "DeepSeek sparse attention (DeepSeek-V3.2, GLM-5): resolution picks the kernel (the cpu platform: "
        "flotilla's torch reference, torch); the runtime runs the torch reference wherever attention runs the "
        "reference and stops at start on any other resolved kernel, naming it",
        "dsa_prefill_backend",
        "dsa_decode_backend",
        values=(None,),
        refusal="flotilla runs DSA on its torch reference only (the CUDA sparse-MLA kernels are not built yet): "
        "leave it unset",
    ),
    honored(
        "the DSA indexer's top-k: torch.topk in the torch reference (the sgl-kernel default stands for it where "
        "attention runs the reference)",
        "dsa_topk_backend",
        values=("sgl-kernel", "torch"),
    ),
    refused(
        "the DSA indexer's paged-MQA logits run in the torch reference; its CUDA kernels are not built yet: drop the "
        "flag",
        "dsa_paged_mqa_logits_backend",
        values=("auto",),
    ),
    refused(
        "DeepSeek-V4 is not built yet; drop the flag",
        "dsv4_prefill_backend",
        "enable_deepseek_v4_fp4_indexer",
    ),
    refused(
        "this kernel option " + _NOT_BUILT,
        "enable_lean_attention",
        "enable_layerwise_nvtx_marker",
        "triton_attention_reduce_in_fp32",
        "triton_attention_num_kv_splits",
        "triton_attention_split_tile_size",
        "flashinfer_mla_disable_ragged",
        "enable_fused_qk_norm_rope",
        "enable_precise_embedding_interpolation",
        "enable_scattered_sconv",
    ),
    refused(
        "collective variants (NVLS, symmetric memory, mscclpp, quantized or fused all-reduce, pre-warming) are not "
        "built: collectives are plain NCCL or gloo; drop the flag",
        "enable_nccl_nvls",
        "enable_symm_mem",
        "enable_mscclpp",
        "enable_torch_symm_mem",
        "pre_warm_nccl",
        "enable_quant_communications",
        "enable_flashinfer_allreduce_fusion",
        "flashinfer_allreduce_fusion_backend",
        "enable_aiter_allreduce_fusion",
    ),
    refused(
        "two-batch and single-batch overlap are not built (overlap scheduling is: it is on by default); drop the flag",
        "enable_two_batch_overlap",
        "enable_single_batch_overlap",
        "tbo_token_distribution_threshold",
    ),
    refused("diffusion language models are not served; drop the flag", "dllm_algorithm", "dllm_algorithm_config", "dllm_fdfo"),
    refused(
        "batch-invariant (deterministic) kernels and RL on-policy numerics are not built; drop the flag "
        "(greedy decoding with a fixed batch is already repeatable)",
        "enable_deterministic_inference",
        "rl_on_policy_target",
    ),
)

_SCHEDULE = _table(
    honored(
        "the fraction of GPU memory for weights plus the KV cache pool (on CPU the pool is --max-total-tokens)",
        "mem_fraction_static",
    ),
    honored("the most requests running at once per engine (per DP rank)", "max_running_requests"),
    honored("the most requests an engine replica queues before answering 429", "max_queued_requests"),
    honored("the KV pool's token capacity", "max_total_tokens"),
    honored("the largest prefill chunk per step (-1: prefills are not chunked)", "chunked_prefill_size"),
    honored("the token budget of one step", "max_prefill_tokens"),
    honored("the most new requests admitted in one step", "prefill_max_requests"),
    honored(
        "the order waiting requests are admitted in: fcfs, lpm (longest cached prefix first), random, dfs-weight "
        "(depth-first over shared prefixes, busiest branch first) or lof (longest max_tokens first)",
        "schedule_policy",
        values=("fcfs", "lpm", "random", "dfs-weight", "lof"),
        refusal="flotilla schedules by fcfs, lpm, random, dfs-weight or lof; priorities come with "
        "--enable-priority-scheduling, and routing keys are not built",
    ),
    honored(
        "requests carry a priority: higher levels are admitted first and may preempt lower ones; FCFS within a level",
        "enable_priority_scheduling",
    ),
    honored("a higher-priority arrival never preempts running requests", "disable_priority_preemption"),
    honored("the priority of requests that do not give one", "default_priority_value"),
    honored("a request with a priority is refused (400) when priority scheduling is off", "abort_on_priority_when_disabled"),
    honored("smaller priority values are more urgent (vLLM's convention) instead of larger", "schedule_low_priority_values_first"),
    honored("the priority gap a waiting request needs over a running one to preempt it", "priority_scheduling_preemption_threshold"),
    honored("tokens per KV cache block", "page_size"),
    honored("prefix caching of KV blocks off", "disable_radix_cache"),
    honored("overlap scheduling (the next step's inputs prepared while the current one runs) off", "disable_overlap_schedule"),
    honored("a host tier of the prefix cache: preempted requests' blocks go to host memory", "enable_hierarchical_cache"),
    honored("the host tier's size as a multiple of the device pool", "hicache_ratio"),
    honored("the host tier's size in GB (overrides --hicache-ratio)", "hicache_size"),
    refused(
        "flotilla's host tier is a cache ('cache' mode) only; drop the flag",
        "hicache_host_memory_mode",
        values=("cache",),
    ),
    noop("prefill chunks and decodes always share one step here, as the flag asks", "enable_mixed_chunk"),
    noop("there is no hybrid sliding-window memory pool here, so it is always off", "disable_hybrid_swa_memory"),
    noop("there is no chunked prefix cache for DeepSeek here, so it is always off", "disable_chunked_prefix_cache"),
    refused(
        "preemption picks the latest arrival (the lowest priority first under --enable-priority-scheduling); "
        "drop the flag",
        "retraction_policy",
        values=("length",),
    ),
    refused(
        "this scheduling option " + _NOT_BUILT,
        "prefill_decode_interval",
        "enable_dynamic_chunking",
        "schedule_conservativeness",
        "num_continuous_decode_steps",
        "scheduler_recv_interval",
        "min_free_slots_delay",
    ),
    refused(
        "the prefix cache evicts least recently used blocks only; drop the flag",
        "radix_eviction_policy",
        values=("lru",),
    ),
    refused(
        "this KV memory layout " + _NOT_BUILT,
        "c128_page_size",
        "swa_full_tokens_ratio",
        "prefill_only_disable_kv_cache",
        "enable_page_major_kv_layout",
        "enable_unified_memory",
        "enable_session_radix_cache",
        "radix_cache_backend",
    ),
    refused("Mamba models are not served; drop the flag", "max_mamba_cache_size", "mamba_full_memory_ratio"),
    refused(
        "the host tier copies blocks when a request is preempted; other hierarchical-cache modes and storage tiers "
        "are not built; drop the flag",
        "hicache_write_policy",
        "hicache_io_backend",
        "hicache_mem_layout",
        "hicache_storage_backend",
        "hicache_storage_prefetch_policy",
        "hicache_storage_backend_extra_config",
        "hicache_storage_prefetch_retry_poll_interval",
        "hicache_storage_prefetch_retry_max_attempts",
    ),
    refused(
        "external KV caches (HiSparse, LMCache, FlexKV) are not built; drop the flag",
        "enable_hisparse",
        "hisparse_config",
        "enable_lmcache",
        "lmcache_config_file",
        "enable_flexkv",
        "flexkv_config_file",
    ),
    refused(
        "the prefill delayer is not built; drop the flag",
        "enable_prefill_delayer",
        "prefill_delayer_max_delay_passes",
        "prefill_delayer_token_usage_low_watermark",
        "prefill_delayer_forward_passes_buckets",
        "prefill_delayer_wait_seconds_buckets",
        "prefill_delayer_queue_min_ratio",
        "prefill_delayer_max_delay_ms",
    ),
)

_GRAPHS = _table(
    honored("the decode batch sizes captured as CUDA graphs (derived from the fields below)", "cuda_graph_config"),
    honored("the largest decode batch captured as a CUDA graph", "cuda_graph_max_bs_decode"),
    honored("the decode batch sizes captured as CUDA graphs", "cuda_graph_bs_decode"),
    honored("decode CUDA graphs off", "disable_decode_cuda_graph"),
    honored("CUDA graphs off", "disable_cuda_graph"),
    noop("prefill steps never run as CUDA graphs here, so they are always off", "disable_prefill_cuda_graph"),
    noop("there is no outlines cache here", "disable_outlines_disk_cache"),
    refused(
        "prefill CUDA graphs and graph variants are not built (decode graphs are: --cuda-graph-max-bs-decode, "
        "--disable-cuda-graph); drop the flag",
        "cuda_graph_backend_decode",
        "cuda_graph_backend_prefill",
        "cuda_graph_max_bs_prefill",
        "cuda_graph_bs_prefill",
        "cuda_graph_tc_compiler",
        "disable_cuda_graph_padding",
        "enable_profile_cuda_graph",
        "enable_cudagraph_gc",
        "debug_cuda_graph",
    ),
    refused(
        "torch.compile of the model is not built (decode steps run as CUDA graphs on GPUs); drop the flag",
        "enable_torch_compile",
        "enable_torch_compile_debug_mode",
        "torch_compile_max_bs",
    ),
    refused(
        "this precision option " + _NOT_BUILT,
        "enable_fp32_lm_head",
        "enable_tf32_matmul",
    ),
    refused(
        "weight offloading and memory release are not built; drop the flag",
        "cpu_offload_gb",
        "offload_group_size",
        "offload_num_in_group",
        "offload_prefetch_step",
        "offload_mode",
        "enable_memory_saver",
        "enable_weights_cpu_backup",
        "enable_draft_weights_cpu_backup",
    ),
    refused(
        "custom logit processors, hidden states, routed experts, indexer top-k and multi-item scoring in "
        "responses are not built; drop the flag",
        "enable_custom_logit_processor",
        "enable_return_hidden_states",
        "return_hidden_states_mode",
        "enable_return_routed_experts",
        "enable_return_indexer_topk",
        "enable_mis",
    ),
)

_MAMBA = refused(
    "Mamba and linear-attention models are not served; drop the flag",
    "mamba_backend",
    "mamba_ssm_dtype",
    "mamba_max_states_per_path",
    "enable_mamba_cache_stochastic_rounding",
    "mamba_cache_philox_rounds",
    "mamba_radix_cache_strategy",
    "uses_mamba_radix_cache",
    "mamba_track_interval",
    "enable_int8_mamba_checkpoint",
    "int8_mamba_ckpt_size",
    "linear_attn_backend",
    "linear_attn_decode_backend",
    "linear_attn_prefill_backend",
    "linear_attn_verify_backend",
    "enable_linear_replayssm",
    "linear_replayssm_cache_len",
    "enable_linear_replayssm_spec",
)

# Algorithms the engine runs (cluster/engine/speculative.py); EAGLE with an EAGLE-1 head, or
# without a draft path as NEXTN (the checkpoint's MTP layers: resolution spells NEXTN as EAGLE).
SPECULATIVE_ALGORITHMS = ("NGRAM", "STANDALONE", "NEXTN", "EAGLE")


def _speculative_algorithm(value: Any, given: Mapping[str, Any], model: Any) -> str | None:
    if value is None or str(value).upper() == "NONE":
        return None
    algorithm = str(value).upper()
    if algorithm not in SPECULATIVE_ALGORITHMS:
        return (
            f"{value} drafting is not built yet (EAGLE3, FROZEN_KV_MTP, DFLASH and DSPARK); use --speculative-algorithm "
            "NGRAM, NEXTN (a checkpoint's MTP layers), EAGLE (an EAGLE-1 head), or STANDALONE with a draft model"
        )
    draft = given.get("speculative_draft_model_path")
    if algorithm == "NEXTN" and draft is not None and draft != given.get("model_path"):
        return (
            "NEXTN drafts with the target checkpoint's own MTP layers: leave --speculative-draft-model-path out, or "
            "use EAGLE for an EAGLE head, STANDALONE for a separate draft model"
        )
    if algorithm in ("NEXTN", "EAGLE") and (draft is None or draft == given.get("model_path")):
        layers = _mtp_layers(model)
        if layers == 0:
            return (
                f"{value} without a draft path drafts with the checkpoint's MTP (next-n) layers, and this model's "
                "config.json has none (num_nextn_predict_layers is 0 or missing); pass an EAGLE head with "
                "--speculative-draft-model-path, or use NGRAM, or STANDALONE with a draft model"
            )
    elif algorithm == "STANDALONE" and draft is None:
        return "STANDALONE drafts with a second model: pass --speculative-draft-model-path (e.g. a smaller model of the target's family)"
    if algorithm != "NGRAM":
        sizes = {name: int(given.get(name) or 1) for name in ("tp_size", "ep_size", "dp_size")}
        if max(sizes.values()) > 1:
            shown = ", ".join(f"{name}={size}" for name, size in sizes.items() if size > 1)
            return (
                f"{algorithm}'s drafter runs beside an in-process model runner, not on a worker group's ranks ({shown}); "
                "serve it on one rank, or use NGRAM (which speculates on worker groups)"
            )
    return None


def _mtp_layers(model: Any) -> int | None:
    """The model's MTP layers (config.json's ``num_nextn_predict_layers``); None when unknown."""
    raw = getattr(model, "hf_raw_dict", None) if model is not None else None
    if raw is None:
        return None
    return int(raw.get("num_nextn_predict_layers") or 0)


def _speculative_num_steps(value: Any, given: Mapping[str, Any], model: Any) -> str | None:
    if value is None or str(given.get("speculative_algorithm") or "").upper() != "NGRAM":
        return None
    return "NGRAM drafts --speculative-num-draft-tokens minus one tokens per step; drop --speculative-num-steps"


_SPECULATIVE_HONORED = _table(
    honored(
        "the engine drafts with this proposer (NGRAM, STANDALONE, NEXTN: a checkpoint's MTP layers, EAGLE: an EAGLE-1 "
        "head) and verifies "
        "the drafts in one forward (cluster/engine/speculative.py)",
        "speculative_algorithm",
        accepts=_speculative_algorithm,
    ),
    honored(
        "NGRAM: drafts per step are this minus one (SGLang counts the verified token)",
        "speculative_num_draft_tokens",
    ),
    honored(
        "STANDALONE and NEXTN: drafts per step (the drafter runs this many steps)",
        "speculative_num_steps",
        accepts=_speculative_num_steps,
    ),
    honored(
        "STANDALONE's draft model, loaded in the engine's process with a KV pool of its own",
        "speculative_draft_model_path",
    ),
    honored("the draft model's snapshot in the local HF cache", "speculative_draft_model_revision"),
    honored("the draft model's weight format", "speculative_draft_load_format"),
    honored("the draft model's KV cache dtype", "speculative_draft_kv_cache_dtype"),
    honored("NGRAM: the longest token window its trie holds", "speculative_ngram_max_trie_depth"),
    honored("NGRAM: the most trie nodes; a full trie is cleared and refills", "speculative_ngram_capacity"),
    refused(
        "tree drafting is not built: flotilla drafts one chain (the most likely continuation); drop the flag or pass 1",
        "speculative_eagle_topk",
        "speculative_ngram_min_bfs_breadth",
        values=(1,),
    ),
    refused(
        "tree drafting is not built: flotilla drafts one chain (breadth 1; SGLang's default 10 is taken as no "
        "request for a tree); drop the flag or pass 1",
        "speculative_ngram_max_bfs_breadth",
        values=(1, 10),
    ),
    refused(
        "NGRAM follows the most frequent continuation in its trie (BFS order over one chain); PROB-ranked "
        "trees are not built: drop the flag or pass BFS",
        "speculative_ngram_match_type",
        values=("BFS",),
    ),
    refused(
        "relaxed acceptance is not built: verification keeps the target's distribution (thresholds 1.0); drop the flag",
        "speculative_accept_threshold_single",
        "speculative_accept_threshold_acc",
        values=(1.0,),
    ),
    refused(
        "verification samples each position from the target and accepts a draft when the sample equals it, which is "
        "exact for flotilla's deterministic drafts; draft-probability rejection sampling (EAGLE) is not built: drop the flag",
        "speculative_use_rejection_sampling",
        values=(False,),
    ),
    refused(
        "flotilla verifies drafts in its prefill-style forward over the paged cache; drop the flag or pass prefill",
        "speculative_attention_mode",
        values=("prefill",),
    ),
    refused(
        "the draft model runs on the target's kernel backends; drop the flag",
        "speculative_draft_attention_backend",
        "speculative_moe_runner_backend",
        "speculative_moe_a2a_backend",
        "speculative_dsa_topk_backend",
    ),
    refused(
        "the draft model runs its checkpoint's own weights: load-time quantization is not built; drop the flag",
        "speculative_draft_model_quantization",
        "_speculative_draft_quantization_explicitly_set",
    ),
    refused(
        "NGRAM drafts from the requests' own tokens; an external corpus is not built yet: drop the flag",
        "speculative_ngram_external_corpus_path",
        "speculative_ngram_external_sam_budget",
        "speculative_ngram_external_corpus_max_tokens",
    ),
)

_SPECULATIVE = _table(
    _SPECULATIVE_HONORED,
    refused(
        "this speculative-decoding option belongs to an algorithm or mode not built yet (EAGLE, DFLASH, DSPARK, "
        "adaptive steps, draft windows, decoupled drafting); drop the flag",
        *(name for name, spec in FIELDS.items() if spec.group == "speculative" and name not in _SPECULATIVE_HONORED),
    ),
)

_DISAGGREGATION = _table(
    honored(
        "each PD pool's role; flotilla serve --disaggregation-mode pd runs both pools and resolves each for its role",
        "disaggregation_mode",
        values=("null",),
        refusal="flotilla serve runs the prefill and decode pools itself: pass --disaggregation-mode pd to "
        "flotilla serve (a single-role server is not built)",
    ),
    refused(
        "flotilla serve's --kv-transport picks how KV blocks move between the PD pools (nixl, or the ray fallback); "
        "drop the flag or pass nixl",
        "disaggregation_transfer_backend",
        values=("nixl",),
    ),
    honored("the decode pool keeps a prefix cache (on by default in flotilla's PD, except under decode DCP: chunk cache)", "disaggregation_decode_enable_radix_cache"),
    refused(
        "flotilla's PD pools exchange KV metadata through Ray and move blocks with NIXL; SGLang's bootstrap, "
        "devices, slots, polling and retraction options do not apply: drop the flag",
        "disaggregation_bootstrap_port",
        "disaggregation_ib_device",
        "disaggregation_decode_enable_offload_kvcache",
        "disaggregation_decode_retraction_backup",
        "num_reserved_decode_tokens",
        "disaggregation_decode_extra_slots",
        "disaggregation_decode_polling_interval",
        "optimistic_prefill_attempts",
    ),
    refused(
        "decoupled speculative decoding is not built; drop the flag",
        "decoupled_spec_bind_endpoint",
        "decoupled_spec_connect_endpoints",
        "decoupled_spec_rank",
        "decoupled_spec_role",
    ),
    refused(
        "multimodal encoder disaggregation is not built (flotilla serves text models); drop the flag",
        "encoder_only",
        "language_only",
        "language_model_only",
        "encoder_transfer_backend",
        "encoder_urls",
        "encoder_bootstrap_port",
        "encoder_register_urls",
        "enable_adaptive_dispatch_to_encoder",
    ),
    refused(
        "prefill/decode multiplexing on GPU stream partitions is not built; drop the flag",
        "enable_pdmux",
        "pdmux_config_path",
        "sm_group_num",
    ),
)

_RAY_ASSIGNS_GPUS = "Ray assigns GPUs to ranks; use CUDA_VISIBLE_DEVICES or Ray's resources instead"

_RUNTIME = _table(
    honored("where the engines run", "device", values=(None, "cpu", "cuda"), refusal="flotilla runs on cpu or cuda"),
    honored("seeds the samplers of requests without their own seed", "random_seed"),
    honored(
        "the bound on each engine step's RPC to its ranks (seconds; a one-rank in-process engine makes none)",
        "watchdog_timeout",
    ),
    noop("the engine thread already blocks while it has no work", "sleep_on_idle"),
    noop("flotilla always runs its engines as Ray actors", "use_ray"),
    refused(_RAY_ASSIGNS_GPUS, "base_gpu_id", values=(0,)),
    refused(_RAY_ASSIGNS_GPUS, "gpu_id_step", values=(1,)),
    refused(
        "this process option " + _NOT_BUILT,
        "mlx_enable_sampling",
        "soft_watchdog_timeout",
        "custom_sigquit_handler",
        "numa_node",
        "gc_threshold",
    ),
    refused(
        "multimodal inputs are not served (flotilla serves text models); drop the flag",
        "enable_multimodal",
        "mm_attention_backend",
        "enable_broadcast_mm_inputs_process",
        "enable_prefix_mm_cache",
        "mm_enable_dp_encoder",
        "mm_process_config",
        "mm_processor_worker_num",
        "mm_io_worker_num",
        "allowed_media_domains",
        "media_url_max_file_size_mb",
        "mm_preprocess_cache_size_mb",
        "trust_mm_content_hashes",
        "limit_mm_data_per_request",
        "enable_mm_global_cache",
        "image_processor_backend",
        "mm_global_cache_backend",
        "disable_fast_image_processor",
        "mm_feature_transport",
        "keep_mm_feature_on_device",
    ),
    refused(
        "LoRA adapters are not served yet (the base model would answer); drop the flag",
        "enable_lora",
        "enable_lora_overlap_loading",
        "max_lora_rank",
        "lora_target_modules",
        "lora_paths",
        "max_loaded_loras",
        "max_loras_per_batch",
        "lora_eviction_policy",
        "lora_backend",
        "max_lora_chunk_size",
        "experts_shared_outer_loras",
        "lora_use_virtual_experts",
        "lora_strict_loading",
        "lora_drain_wait_threshold",
    ),
)

_SERVING = _table(
    honored("the tokenizer the ingress and engines load", "tokenizer_path"),
    honored("no tokenizer: prompts are token ids and answers carry ids", "skip_tokenizer_init"),
    honored("the address Serve's HTTP proxy binds", "host"),
    honored("the port Serve's HTTP proxy listens on", "port"),
    honored("HTTPS: the proxy serves TLS with this key (and no plain HTTP on the port)", "ssl_keyfile"),
    honored("HTTPS: the proxy serves TLS with this certificate", "ssl_certfile"),
    refused(
        "client-certificate verification is not available through Ray Serve's HTTP options (Serve hands uvicorn "
        "the CA bundle but never asks clients for a certificate); drop the flag, or verify clients in a proxy in front",
        "ssl_ca_certs",
    ),
    honored("HTTPS: the passphrase of an encrypted key file", "ssl_keyfile_password"),
    honored("every route but /health needs 'Authorization: Bearer <key>'", "api_key"),
    honored("the admin routes (elastic EP scaling) need this key instead of --api-key", "admin_api_key"),
    honored("the model name /v1/models reports and requests must name", "served_model_name"),
    honored("the chat template (a file or Jinja text) the ingress applies", "chat_template"),
    honored("chat template keyword arguments every request starts from", "default_chat_template_kwargs"),
    honored("a stream's chunks hold at least this many tokens (with --stream-batch-ms)", "stream_interval"),
    noop("every usage block reports cached prompt tokens (prompt_tokens_details.cached_tokens)", "enable_cache_report"),
    noop("streams always send each new piece once (OpenAI deltas)", "incremental_streaming_output"),
    noop(
        "the ingress tokenizes and detokenization runs in the engine replica; scale with --num-replicas",
        "tokenizer_worker_num",
        "detokenizer_worker_num",
    ),
    noop("the engines warm up inside their runners before the endpoint reports ready", "skip_server_warmup"),
    honored(
        "the parser that splits reasoning_content from content in chat answers and deltas",
        "reasoning_parser",
        values=REASONING_PARSERS,
    ),
    honored(
        "the parser that finds tool calls in chat output (tool_choice auto)",
        "tool_call_parser",
        values=TOOL_CALL_PARSERS,
    ),
    honored(
        "constrained JSON (response_format, forced tool calls) takes no free whitespace: only the canonical ', ' and ': ' separators",
        "constrained_json_disable_any_whitespace",
    ),
    refused(
        "built-in tool servers and thinking-token controls are not built; drop the flag",
        "tool_server",
        "strip_thinking_cache",
        "enable_strict_thinking",
    ),
    refused(
        "constrained JSON takes any whitespace, or none with --constrained-json-disable-any-whitespace; drop the flag",
        "constrained_json_whitespace_pattern",
    ),
    refused(
        "the ingress loads the tokenizer's fast implementation with HuggingFace tokenizers only; drop the flag",
        "tokenizer_mode",
        "tokenizer_backend",
        values=("auto", "huggingface"),
    ),
    refused(
        "gRPC serving and sidecars are not built (flotilla serves HTTP through Ray Serve); drop the flag",
        "smg_grpc_mode",
        "grpc_mode",
        "grpc_port",
        "grpc_worker_threads",
        "sidecar",
        "sidecar_args",
    ),
    refused(
        "HTTP/2 and TLS reloading are not built (Ray Serve's proxy speaks HTTP/1.1, and HTTPS with --ssl-*); "
        "drop the flag",
        "enable_http2",
        "http2_max_concurrent_streams",
        "http2_initial_connection_window_size",
        "enable_ssl_refresh",
    ),
    refused(
        "this API option " + _NOT_BUILT,
        "fastapi_root_path",
        "warmups",
        "weight_version",
        "hf_chat_template_name",
        "completion_template",
        "file_storage_path",
        "sampling_defaults",
        "preferred_sampling_params",
        "allow_auto_truncate",
        "batch_notify_size",
        "stream_response_default_include_usage",
        "enable_streaming_session",
        "enable_dynamic_batch_tokenizer",
        "dynamic_batch_tokenizer_batch_size",
        "dynamic_batch_tokenizer_batch_timeout",
        "enable_tokenizer_batch_encode",
        "disable_tokenizer_batch_decode",
    ),
    refused("speech recognition is not served; drop the flag", "asr_max_buffer_seconds", "asr_max_concurrent_sessions"),
)

_OBSERVABILITY = _table(
    honored(
        "the level of flotilla's loggers in the driver, the ingress, the engine replicas and the ranks",
        "log_level",
        accepts=_log_level,
    ),
    honored("each request's log line carries its inputs and outputs, at --log-requests-level detail", "log_requests"),
    honored("how much of a request the log line holds: 0 metadata, 1 + sampling parameters, 2 + 2048 chars of text, 3 all", "log_requests_level"),
    honored("request log lines as text (key=value) or JSON", "log_requests_format"),
    refused(
        "request logs go to the replicas' stdout only",
        "log_requests_target",
        accepts=_log_requests_target,
    ),
    noop("GET /metrics is always served (Prometheus, flotilla: names)", "enable_metrics"),
    refused(
        "tracing (OpenTelemetry) is not built; drop the flag",
        "enable_trace",
        "trace_modules",
        "otlp_traces_endpoint",
    ),
    refused(
        "KV cache events are not built; drop the flag",
        "kv_events_config",
    ),
    refused(
        "this metrics or logging option " + _NOT_BUILT + " (GET /metrics serves flotilla's metrics)",
        "log_level_http",
        "uvicorn_access_log_exclude_prefixes",
        "crash_dump_folder",
        "show_time_cost",
        "smg_http_sidecar_port",
        "enable_mfu_metrics",
        "enable_metrics_for_all_schedulers",
        "load_snapshot_publish_interval",
        "tokenizer_metrics_custom_labels_header",
        "tokenizer_metrics_allowed_custom_labels",
        "extra_metric_labels",
        "bucket_time_to_first_token",
        "bucket_inter_token_latency",
        "bucket_e2e_request_latency",
        "prompt_tokens_buckets",
        "generation_tokens_buckets",
        "gc_warning_threshold_secs",
        "decode_log_interval",
        "enable_request_time_stats_logging",
        "load_publish_endpoint",
        "enable_forward_pass_metrics",
        "forward_pass_metrics_worker_id",
        "forward_pass_metrics_ipc_name",
        "export_metrics_to_file",
        "export_metrics_to_file_dir",
        "stat_loggers",
    ),
    refused(
        "KV canaries, tensor dumps and forward hooks are not built; drop the flag",
        "kv_canary",
        "kv_canary_real_data",
        "kv_canary_sweep_interval",
        "debug_tensor_dump_output_folder",
        "debug_tensor_dump_layers",
        "debug_tensor_dump_input_file",
        "forward_hooks",
        "msprobe_dump_config",
    ),
)

SUPPORT: Mapping[str, Support] = MappingProxyType(
    _table(_MODEL, _PARALLEL, _MOE, _KERNELS, _SCHEDULE, _GRAPHS, _MAMBA, _SPECULATIVE, _DISAGGREGATION, _RUNTIME, _SERVING, _OBSERVABILITY)
)

# Refused fields the runtime still reads: to refuse a value resolution derived (the guard
# behind this table for values no user set), or to set it itself for the groups it resolves
# (elastic EP joiners, PD pools). The table test allows these reads and no others.
GUARDED: frozenset[str] = frozenset(
    {
        "pp_size",  # cluster/topology.py refuses pp_size != 1
        "attn_cp_size",  # rank math in cluster/topology.py; PD refuses it (cluster/kv/port.py)
        "moe_dp_size",  # cluster/models/moe_dispatch.py refuses moe_dp_size > 1
        "quantization_param_path",  # cluster/engine/kv_cache_dtype.py refuses KV scales
        "hicache_storage_backend",  # cluster/engine/host_kv_tier.py refuses a storage tier
        "node_rank",  # serve/elastic_ep.py sets it for joiners and refuses a user's
        "ep_join_rank_offset",  # likewise
        "ep_join_mode",  # likewise
        "elastic_ep_initial_size",  # serve/elastic_ep.py sets it for joiners and reads the launch size
        "moe_dense_tp_size",  # serve/elastic_ep.py sets 1 for one-rank joiners (the attention-TP size)
        "moe_runner_backend",  # cluster/engine/kernel_backends.py names it in the start-up report
        "disaggregation_transfer_backend",  # serve/pd.py sets nixl for both pools and refuses others
        "hicache_host_memory_mode",  # cluster/engine/host_kv_tier.py refuses modes other than cache
        "quantization",  # no read: cluster/engine/kv_cache_dtype.py reads a checkpoint key of that name
    }
)
