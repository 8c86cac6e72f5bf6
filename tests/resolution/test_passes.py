"""Behaviour of the passes phase (sampling default to HiCache), through full resolution.

Every expected value and error text below was checked against SGLang 0.5.19's
resolution (the reference oracle) for the same model config, platform and flags,
except where FlashInfer is absent (the oracle cannot model that; those follow
the reference code) and ``_hisparse_validation``, which SGLang runs at launch
rather than during resolution and is tested on its own.
"""

from __future__ import annotations

import pytest

from flotilla.resolution import ModelFacts, ResolutionError, ServerArgs, Violation, preset, resolve
from flotilla.resolution.engine import View
from flotilla.resolution.fields import DEFAULTS
from flotilla.resolution.platform import apply_flips
from flotilla.resolution.rules.passes.hisparse import HISPARSE_VALIDATION
from flotilla.resolution.rules.normalise.cuda_graph import phase_backend
from helpers.resolution_configs import LLAMA_128K as LLAMA

_MLA_COMMON = {
    "vocab_size": 129280,
    "hidden_size": 7168,
    "intermediate_size": 18432,
    "moe_intermediate_size": 2048,
    "num_hidden_layers": 61,
    "num_attention_heads": 128,
    "num_key_value_heads": 128,
    "n_shared_experts": 1,
    "n_routed_experts": 256,
    "routed_scaling_factor": 2.5,
    "kv_lora_rank": 512,
    "q_lora_rank": 1536,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "qk_nope_head_dim": 128,
    "n_group": 8,
    "topk_group": 4,
    "num_experts_per_tok": 8,
    "first_k_dense_replace": 3,
    "norm_topk_prob": True,
    "hidden_act": "silu",
    "max_position_embeddings": 163840,
    "rms_norm_eps": 1e-06,
    "torch_dtype": "bfloat16",
}

DSV3 = {**_MLA_COMMON, "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3"}

DSV32 = {
    **_MLA_COMMON,
    "architectures": ["DeepseekV32ForCausalLM"],
    "model_type": "deepseek_v32",
    "index_topk": 2048,
    "index_head_dim": 128,
    "index_n_heads": 64,
}

QWEN3_NEXT = {
    "architectures": ["Qwen3NextForCausalLM"],
    "model_type": "qwen3_next",
    "vocab_size": 151936,
    "hidden_size": 2048,
    "intermediate_size": 5632,
    "num_hidden_layers": 48,
    "num_attention_heads": 16,
    "num_key_value_heads": 2,
    "head_dim": 256,
    "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-06,
    "partial_rotary_factor": 0.25,
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 32,
    "decoder_sparse_step": 1,
    "moe_intermediate_size": 512,
    "shared_expert_intermediate_size": 512,
    "num_experts_per_tok": 10,
    "num_experts": 512,
    "norm_topk_prob": True,
    "mlp_only_layers": [],
    "layer_types": [kind for _ in range(12) for kind in ("linear_attention",) * 3 + ("full_attention",)],
    "torch_dtype": "bfloat16",
}

LLAMA_DUAL_CHUNK = {**LLAMA, "dual_chunk_attention_config": {"chunk_size": 8192}}

MODELS = {
    "llama": LLAMA,
    "dsv3": DSV3,
    "dsv32": DSV32,
    "qwen3next": QWEN3_NEXT,
    "llama-dual-chunk": LLAMA_DUAL_CHUNK,
}


def resolved(platform: str, args: list[str], model: str = "llama", **flips: str):
    facts = apply_flips(preset(platform), flips)
    return resolve(ServerArgs.from_cli(args), ModelFacts.from_hf_config(MODELS[model]), facts)


def rejection(platform: str, args: list[str], model: str = "llama", **flips: str) -> str:
    with pytest.raises(ResolutionError) as caught:
        resolved(platform, args, model, **flips)
    return str(caught.value)


# (id, model, platform, args, expected field values)
RESOLVES = [
    # default attention backend per platform (MHA)
    ("llama-a100", "llama", "a100", [], {"attention_backend": "flashinfer", "page_size": 1}),
    ("llama-h100", "llama", "h100", [], {"attention_backend": "fa3", "page_size": 1}),
    ("llama-h200", "llama", "h200", [], {"attention_backend": "fa3", "page_size": 1}),
    ("llama-b200", "llama", "b200", [], {"attention_backend": "trtllm_mha", "page_size": 64}),
    ("llama-b300", "llama", "b300", [], {"attention_backend": "trtllm_mha", "page_size": 64}),
    ("llama-gb200", "llama", "gb200", [], {"attention_backend": "trtllm_mha", "page_size": 64}),
    ("llama-rtx", "llama", "rtx-pro-6000", [], {"attention_backend": "flashinfer", "page_size": 1}),
    ("llama-mi300x", "llama", "mi300x", [], {"attention_backend": "aiter", "page_size": 1}),
    ("llama-mi355x", "llama", "mi355x", [], {"attention_backend": "aiter", "page_size": 1}),
    ("llama-cpu", "llama", "cpu", [], {"attention_backend": "torch_native", "page_size": 1}),
    # default attention backend per platform (MLA)
    ("dsv3-a100", "dsv3", "a100", ["--tp", "8"], {"attention_backend": "triton", "page_size": 1}),
    ("dsv3-h100", "dsv3", "h100", ["--tp", "8"], {"attention_backend": "fa3", "page_size": 1}),
    ("dsv3-rtx", "dsv3", "rtx-pro-6000", ["--tp", "8"], {"attention_backend": "triton"}),
    ("dsv3-mi300x-tp8", "dsv3", "mi300x", ["--tp", "8"], {"attention_backend": "aiter"}),
    ("dsv3-mi300x-tp4", "dsv3", "mi300x", ["--tp", "4"], {"attention_backend": "triton"}),
    # split backends
    (
        "split-agree",
        "llama",
        "h100",
        ["--prefill-attention-backend", "fa3", "--decode-attention-backend", "fa3"],
        {"attention_backend": "fa3"},
    ),
    (
        "split-agree-overrides-base",
        "llama",
        "h100",
        [
            "--attention-backend", "triton",
            "--prefill-attention-backend", "flashinfer",
            "--decode-attention-backend", "flashinfer",
        ],
        {"attention_backend": "flashinfer"},
    ),
    (
        "split-differ",
        "llama",
        "h100",
        ["--prefill-attention-backend", "fa3", "--decode-attention-backend", "flashinfer"],
        {"attention_backend": "fa3", "prefill_attention_backend": "fa3"},
    ),
    # page-size snaps
    ("trtllm-mha-h100", "llama", "h100", ["--attention-backend", "trtllm_mha"], {"page_size": 64}),
    ("trtllm-mha-rtx", "llama", "rtx-pro-6000", ["--attention-backend", "trtllm_mha"], {"page_size": 64}),
    ("trtllm-mha-keeps-32", "llama", "b200", ["--page-size", "32"], {"page_size": 32}),
    ("trtllm-mha-snaps-256", "llama", "b200", ["--page-size", "256"], {"page_size": 64}),
    ("flashmla", "llama", "h100", ["--attention-backend", "flashmla"], {"page_size": 64}),
    ("cutlass-mla", "llama", "h100", ["--attention-backend", "cutlass_mla"], {"page_size": 128}),
    ("hpc-ops", "llama", "b200", ["--attention-backend", "hpc_ops", "--page-size", "32"], {"page_size": 64}),
    ("fa4-b200", "llama", "b200", ["--attention-backend", "fa4"], {"page_size": 128}),
    ("fa4-overrides-user-page", "llama", "b200", ["--attention-backend", "fa4", "--page-size", "16"], {"page_size": 128}),
    ("fa4-mla-no-snap", "dsv3", "b200", ["--tp", "8", "--attention-backend", "fa4"], {"page_size": 1}),
    ("intel-xpu-page", "llama", "h100", ["--attention-backend", "intel_xpu"], {"page_size": 128}),
    (
        "intel-xpu-mla-decode",
        "dsv3",
        "h100",
        ["--tp", "8", "--decode-attention-backend", "intel_xpu", "--prefill-attention-backend", "triton"],
        {"page_size": 128},
    ),
    # CuteDSL decode fills the prefill side
    (
        "cutedsl-fill",
        "llama",
        "b200",
        ["--decode-attention-backend", "cutedsl_mla"],
        {"prefill_attention_backend": "trtllm_mla", "attention_backend": "trtllm_mha", "page_size": 64},
    ),
    (
        "cutedsl-fill-mla",
        "dsv3",
        "b200",
        ["--tp", "8", "--decode-attention-backend", "cutedsl_mla"],
        {"prefill_attention_backend": "trtllm_mla", "attention_backend": "flashinfer", "page_size": 64},
    ),
    (
        "tokenspeed-fp8",
        "dsv3",
        "b200",
        ["--tp", "8", "--attention-backend", "tokenspeed_mla", "--kv-cache-dtype", "fp8_e4m3"],
        {"attention_backend": "tokenspeed_mla", "page_size": 64},
    ),
    # fallbacks
    ("fa3-e5m2-default", "llama", "h100", ["--kv-cache-dtype", "fp8_e5m2"], {"attention_backend": "triton"}),
    (
        "fa3-e5m2-explicit",
        "llama",
        "h100",
        ["--attention-backend", "fa3", "--kv-cache-dtype", "fp8_e5m2"],
        {"attention_backend": "triton"},
    ),
    ("amx-missing", "llama", "cpu", ["--attention-backend", "intel_amx"], {"attention_backend": "torch_native"}),
    # dual-chunk attention
    (
        "dual-chunk",
        "llama-dual-chunk",
        "h100",
        ["--attention-backend", "dual_chunk_flash_attn"],
        {"disable_radix_cache": True, "enable_mixed_chunk": False},
    ),
    # sampling
    ("sampling-cuda", "llama", "h100", [], {"sampling_backend": "flashinfer"}),
    ("sampling-rocm", "llama", "mi300x", [], {"sampling_backend": "pytorch"}),
    ("sampling-cpu", "llama", "cpu", [], {"sampling_backend": "pytorch"}),
    # deterministic inference
    (
        "det-h100",
        "llama",
        "h100",
        ["--enable-deterministic-inference"],
        {"attention_backend": "fa3", "sampling_backend": "pytorch", "disable_radix_cache": False},
    ),
    (
        "det-b200-tp2",
        "llama",
        "b200",
        ["--enable-deterministic-inference", "--tp", "2"],
        {
            "attention_backend": "flashinfer",
            "sampling_backend": "pytorch",
            "disable_radix_cache": True,
            "disable_custom_all_reduce": True,
            "enable_torch_symm_mem": False,
            "page_size": 1,
        },
    ),
    (
        "det-mi300x-tp2",
        "llama",
        "mi300x",
        ["--enable-deterministic-inference", "--tp", "2"],
        {"attention_backend": "fa3", "disable_custom_all_reduce": False},
    ),
    (
        "det-drops-allreduce-fusion",
        "llama",
        "h100",
        ["--enable-deterministic-inference", "--flashinfer-allreduce-fusion-backend", "auto", "--tp", "2"],
        {"flashinfer_allreduce_fusion_backend": None},
    ),
    (
        "rl-target-enables-det",
        "llama",
        "h100",
        ["--rl-on-policy-target", "fsdp"],
        {"enable_deterministic_inference": True, "sampling_backend": "pytorch", "attention_backend": "fa3"},
    ),
    # linear attention
    (
        "gdn-flashinfer-decode-sm100",
        "qwen3next",
        "b200",
        ["--tp", "4", "--mamba-ssm-dtype", "bfloat16"],
        {"linear_attn_decode_backend": "flashinfer"},
    ),
    (
        "flashkda-decode-falls-back",
        "qwen3next",
        "b200",
        ["--tp", "4", "--linear-attn-backend", "flashkda"],
        {"linear_attn_decode_backend": "triton"},
    ),
    ("gdn-h100-no-default", "qwen3next", "h100", ["--tp", "4"], {"linear_attn_decode_backend": None}),
    # KV-cache dtypes
    ("nvfp4-trtllm-mha", "llama", "b200", ["--kv-cache-dtype", "nvfp4"], {"attention_backend": "trtllm_mha"}),
    (
        "nvfp4-fa4-prefill",
        "llama",
        "b200",
        ["--kv-cache-dtype", "nvfp4", "--prefill-attention-backend", "fa4", "--decode-attention-backend", "triton"],
        {"page_size": 128},
    ),
    ("mxfp8-b200", "llama", "b200", ["--kv-cache-dtype", "mxfp8"], {"kv_cache_dtype": "mxfp8"}),
    # small handlers
    ("amd-kv-splits", "llama", "mi300x", [], {"triton_attention_num_kv_splits": 16}),
    ("cuda-kv-splits", "llama", "h100", [], {"triton_attention_num_kv_splits": 8}),
    ("pre-warm-off-on-cpu", "llama", "cpu", ["--pre-warm-nccl"], {"pre_warm_nccl": False}),
    ("grammar-default", "llama", "h100", [], {"grammar_backend": "xgrammar"}),
    (
        "mis-flashinfer",
        "llama",
        "h100",
        ["--enable-mis", "--attention-backend", "flashinfer"],
        {"disable_radix_cache": True, "chunked_prefill_size": -1},
    ),
    # HiCache
    (
        "hicache-direct-io",
        "llama",
        "h100",
        ["--enable-hierarchical-cache", "--hicache-io-backend", "direct"],
        {"hicache_mem_layout": "page_first_direct", "hicache_io_backend": "direct"},
    ),
    (
        "hicache-direct-layout",
        "llama",
        "h100",
        ["--enable-hierarchical-cache", "--hicache-mem-layout", "page_first_direct"],
        {"hicache_io_backend": "direct"},
    ),
    (
        "hicache-mooncake",
        "llama",
        "h100",
        [
            "--enable-hierarchical-cache",
            "--hicache-storage-backend", "mooncake",
            "--hicache-mem-layout", "layer_first",
        ],
        {"hicache_mem_layout": "page_first"},
    ),
    (
        "hicache-mooncake-direct",
        "llama",
        "h100",
        [
            "--enable-hierarchical-cache",
            "--hicache-storage-backend", "mooncake",
            "--hicache-mem-layout", "layer_first",
            "--hicache-io-backend", "direct",
        ],
        {"hicache_mem_layout": "page_first_direct"},
    ),
    (
        "hicache-off-untouched",
        "llama",
        "h100",
        ["--hicache-io-backend", "direct"],
        {"hicache_mem_layout": "page_first", "hicache_io_backend": "direct"},
    ),
]

# (id, model, platform, args, flips, distinctive error text)
REJECTS = [
    ("trtllm-mla-h100", "dsv3", "h100", ["--tp", "8", "--attention-backend", "trtllm_mla"], {},
     "TRTLLM MLA backend is only supported on Blackwell GPUs (SM100/SM12x)"),
    ("trtllm-mla-e5m2", "dsv3", "b200",
     ["--tp", "8", "--attention-backend", "trtllm_mla", "--kv-cache-dtype", "fp8_e5m2"], {},
     "TensorRT-LLM MLA backend only supports kv-cache-dtype of fp8_e4m3, fp4_e2m1, bf16, or auto."),
    ("tokenspeed-auto-kv", "dsv3", "b200", ["--tp", "8", "--attention-backend", "tokenspeed_mla"], {},
     "tokenspeed_mla backend requires kv-cache-dtype=fp8_e4m3, got auto."),
    ("cutedsl-hopper", "llama", "h100", ["--decode-attention-backend", "cutedsl_mla"], {},
     "CuteDSL MLA backend is only supported on Blackwell GPUs (SM100)."),
    ("cutedsl-prefill", "llama", "b200", ["--prefill-attention-backend", "cutedsl_mla"], {},
     "CuteDSL MLA only supports decoding for now"),
    ("trtllm-mha-ampere", "llama", "a100", ["--attention-backend", "trtllm_mha"], {},
     "TRTLLM MHA backend for prefill requires Hopper (SM90), Blackwell (SM100), or SM120 GPUs."),
    ("trtllm-mha-sm120-fp8", "llama", "rtx-pro-6000",
     ["--attention-backend", "trtllm_mha", "--kv-cache-dtype", "fp8_e4m3"], {},
     "TRTLLM FMHAv2 prefill on SM120 does not support fp8_e4m3 KV cache or skip-softmax."),
    ("trtllm-mha-cp-hopper", "llama", "h100",
     ["--tp", "8", "--attn-cp-size", "2", "--attention-backend", "trtllm_mha"], {},
     "Prefill context parallelism with the TRTLLM MHA prefill backend requires SM100"),
    ("dual-chunk-wrong-backend", "llama-dual-chunk", "h100", [], {},
     "Dual chunk attention is enabled, but attention backend is set to fa3. "
     "Please set it to 'dual_chunk_flash_attn'."),
    ("det-unsupported-backend", "llama", "h100",
     ["--enable-deterministic-inference", "--attention-backend", "trtllm_mha"], {},
     "Currently only ['ascend', 'fa3', 'fa4', 'flashinfer', 'intel_xpu', 'triton'] attention backends "
     "are supported for deterministic inference, but you explicitly specified 'trtllm_mha'."),
    ("det-mla-flashinfer", "dsv3", "b200",
     ["--tp", "8", "--enable-deterministic-inference", "--attention-backend", "flashinfer"], {},
     "Currently only ['ascend', 'fa3', 'fa4', 'triton'] attention backends are supported for "
     "deterministic inference with absorbed-MLA models. But you're using flashinfer."),
    ("det-mla-fa4-sm120", "dsv3", "rtx-pro-6000",
     ["--tp", "8", "--enable-deterministic-inference", "--attention-backend", "fa4"], {},
     "Deterministic inference with absorbed-MLA models on the fa4 attention backend requires SM100/SM110"),
    ("mis-needs-flashinfer", "llama", "h100", ["--enable-mis"], {},
     "Multi-item scoring requires flashinfer attention backend for custom attention mask support. "
     "Please set --attention-backend flashinfer when using --enable-mis. "
     "Current backends: prefill=fa3, decode=fa3"),
    ("nvfp4-hopper", "llama", "h100", ["--kv-cache-dtype", "nvfp4"], {},
     "--kv-cache-dtype=nvfp4 requires Blackwell SM100 or SM120."),
    ("nvfp4-flashinfer", "llama", "rtx-pro-6000", ["--kv-cache-dtype", "nvfp4"], {},
     "KV4 MHA expects attention_backend to be one of ['triton', 'torch_native', 'flex_attention', "
     "'trtllm_mha'], but got flashinfer"),
    ("fp4mx-rocm", "llama", "mi300x", ["--kv-cache-dtype", "fp4_mx_block16"], {},
     "KV4 is not tested on non-CUDA platforms."),
    ("mxfp8-hopper", "llama", "h100", ["--kv-cache-dtype", "mxfp8"], {},
     "--kv-cache-dtype mxfp8 requires an SM100+ (Blackwell) GPU"),
    ("flashkda-decode", "qwen3next", "b200", ["--tp", "4", "--linear-attn-decode-backend", "flashkda"], {},
     "--linear-attn-decode-backend flashkda is not supported: FlashKDA is prefill-only."),
    ("gdn-flashinfer-fp32", "qwen3next", "b200",
     ["--tp", "4", "--linear-attn-backend", "flashinfer", "--mamba-ssm-dtype", "float32"], {},
     "--linear-attn-decode-backend flashinfer on SM100+ requires --mamba-ssm-dtype bfloat16, got 'float32'"),
    ("stochastic-rounding-dtype", "qwen3next", "h100",
     ["--tp", "4", "--enable-mamba-cache-stochastic-rounding"], {},
     "Stochastic rounding for the Mamba SSM cache requires --mamba-ssm-dtype float16, got None."),
    ("stochastic-rounding-triton-sm90", "qwen3next", "h100",
     ["--tp", "4", "--enable-mamba-cache-stochastic-rounding", "--mamba-ssm-dtype", "float16"], {},
     "--mamba-backend triton requires SM100 with CUDA >= 12.8"),
    ("mamba-states-zero", "qwen3next", "h100", ["--tp", "4", "--mamba-max-states-per-path", "0"], {},
     "--mamba-max-states-per-path must be -1 (unlimited) or a positive integer, got 0."),
    ("int8-ckpt-hicache", "qwen3next", "h100",
     ["--tp", "4", "--enable-int8-mamba-checkpoint", "--enable-hierarchical-cache"], {},
     "--enable-int8-mamba-checkpoint is not supported together with --enable-hierarchical-cache"),
    ("replayssm-flashinfer", "qwen3next", "h100",
     ["--tp", "4", "--enable-linear-replayssm", "--linear-attn-decode-backend", "flashinfer"], {},
     "--enable-linear-replayssm requires Triton, or Helion for KDA, as the linear-attn decode backend; "
     "got --linear-attn-decode-backend='flashinfer'."),
    ("hicache-buffer-no-storage", "llama", "h100",
     ["--enable-hierarchical-cache", "--hicache-host-memory-mode", "buffer_only"], {},
     "--hicache-host-memory-mode buffer_only requires a storage backend"),
    ("hicache-buffer-write-back", "llama", "h100",
     ["--enable-hierarchical-cache", "--hicache-host-memory-mode", "buffer_only",
      "--hicache-storage-backend", "file", "--hicache-write-policy", "write_back"], {},
     "--hicache-host-memory-mode buffer_only does not support --hicache-write-policy write_back"),
    ("hicache-dcp-mha", "llama", "h100", ["--tp", "8", "--dcp-size", "2", "--enable-hierarchical-cache"], {},
     "HiCache with --dcp-size > 1 is only supported for MLA models"),
    ("hicache-dcp-lmcache", "dsv3", "h100",
     ["--tp", "8", "--dcp-size", "8", "--enable-hierarchical-cache", "--enable-lmcache"], {},
     "--enable-lmcache with --dcp-size > 1 is not supported"),
]


@pytest.mark.parametrize(
    "model, platform, args, expect", [c[1:] for c in RESOLVES], ids=[c[0] for c in RESOLVES]
)
def test_resolves(model, platform, args, expect):
    config = resolved(platform, args, model)
    got = {field: getattr(config, field) for field in expect}
    assert got == expect


@pytest.mark.parametrize(
    "model, platform, args, flips, message", [c[1:] for c in REJECTS], ids=[c[0] for c in REJECTS]
)
def test_rejects(model, platform, args, flips, message):
    assert message in rejection(platform, args, model, **flips)


def _rules_for(config, field):
    return [change.rule for change in config.provenance if change.field == field]


def test_default_backend_and_page_size_provenance():
    config = resolved("b200", [])
    assert _rules_for(config, "attention_backend") == ["_attention_backend_default"]
    assert _rules_for(config, "page_size") == ["_mla_backend_page_constraints"]
    h100 = resolved("h100", [])
    assert _rules_for(h100, "page_size") == ["_page_size_default"]
    assert _rules_for(h100, "sampling_backend") == ["_sampling_backend_default"]


def test_explicit_page_size_snap_is_recorded_as_override():
    config = resolved("b200", ["--attention-backend", "fa4", "--page-size", "16"])
    change = [c for c in config.provenance if c.field == "page_size"][-1]
    assert (change.rule, change.old, change.new, change.overrode_user) == (
        "_fa4_page_constraint", 16, 128, True,
    )


def test_deterministic_tensor_parallel_pins_nccl_tree():
    config = resolved("b200", ["--enable-deterministic-inference", "--tp", "2"])
    assert config.env["NCCL_ALGO"] == "allreduce:tree"
    assert config.env["NCCL_MIN_NCHANNELS"] == config.env["NCCL_MAX_NCHANNELS"] == "8"
    single = resolved("b200", ["--enable-deterministic-inference"])
    assert "NCCL_ALGO" not in single.env
    assert single.disable_custom_all_reduce is False


def test_rl_target_sets_deterministic_env():
    config = resolved("h100", ["--rl-on-policy-target", "fsdp"])
    assert config.env["SGLANG_VLM_CACHE_SIZE_MB"] == "0"
    assert config.env["SGLANG_ENABLE_DETERMINISTIC_INFERENCE"] == "True"


def test_torch_native_disables_both_graph_phases():
    config = resolved("h100", ["--attention-backend", "torch_native"])
    assert phase_backend(config, "decode") == "disabled"
    assert phase_backend(config, "prefill") == "disabled"
    assert phase_backend(resolved("h100", []), "decode") == "full"


def test_multi_item_scoring_disables_graphs():
    config = resolved("h100", ["--enable-mis", "--attention-backend", "flashinfer"])
    assert (phase_backend(config, "decode"), phase_backend(config, "prefill")) == ("disabled", "disabled")


def test_deepseek_trtllm_mla_drops_prefill_graph_unless_chosen():
    default = resolved("b200", ["--tp", "8"], "dsv3")
    assert default.attention_backend == "trtllm_mla"
    assert phase_backend(default, "prefill") == "disabled"
    assert phase_backend(default, "decode") == "full"
    chosen = resolved("b200", ["--tp", "8", "--cuda-graph-backend-prefill", "breakable"], "dsv3")
    assert phase_backend(chosen, "prefill") == "breakable"
    flashinfer = resolved("b200", ["--tp", "8", "--attention-backend", "flashinfer"], "dsv3")
    assert phase_backend(flashinfer, "prefill") == "breakable"


def test_aiter_long_context_shrinks_static_memory():
    long_context = resolved("mi300x", ["--mem-fraction-static", "0.8"])
    assert long_context.mem_fraction_static == pytest.approx(0.8 * 0.85)
    short_context = resolved("mi300x", ["--mem-fraction-static", "0.8", "--context-length", "4096"])
    assert short_context.mem_fraction_static == pytest.approx(0.8)
    cuda = resolved("h100", ["--mem-fraction-static", "0.8"])
    assert cuda.mem_fraction_static == pytest.approx(0.8)


def test_sampling_without_flashinfer_is_pytorch():
    config = resolved("a100", [], flashinfer="false")
    assert (config.sampling_backend, config.attention_backend) == ("pytorch", "triton")


def test_flashinfer_mamba_needs_flashinfer():
    message = rejection("h100", ["--tp", "4", "--mamba-backend", "flashinfer"], "qwen3next", flashinfer="false")
    assert "FlashInfer mamba module not available, please check the FlashInfer installation." in message


def _hisparse(model: str, platform: str, **values):
    view = View({**DEFAULTS, "enable_hisparse": True, **values}, {}, frozenset(values), DEFAULTS)
    return HISPARSE_VALIDATION.fn(view, ModelFacts.from_hf_config(MODELS[model]), preset(platform))


def test_hisparse_accepts_dsa_with_matching_backend():
    assert _hisparse(
        "dsv32", "b200", disable_radix_cache=True, kv_cache_dtype="fp8_e4m3", dsa_decode_backend="flashmla_kv"
    ) is None


@pytest.mark.parametrize(
    "model, values, message",
    [
        ("llama", {"disable_radix_cache": True}, "--enable-hisparse is only supported for DSA"),
        ("dsv32", {}, "Hierarchical sparse attention currently requires --disable-radix-cache."),
        (
            "dsv32",
            {"disable_radix_cache": True, "kv_cache_dtype": "fp8_e5m2"},
            "HiSparse requires one of ('bfloat16', 'fp8_e4m3') KV cache dtypes, but got "
            "--kv-cache-dtype=fp8_e5m2. Please use --kv-cache-dtype=bfloat16 or --kv-cache-dtype=fp8_e4m3.",
        ),
        (
            "dsv32",
            {"disable_radix_cache": True, "kv_cache_dtype": "fp8_e4m3", "dsa_decode_backend": "flashmla_sparse"},
            "HiSparse supports DSA decode backend(s) ['flashinfer_sparse_mla', 'flashmla_kv'] on this "
            "platform with --kv-cache-dtype=fp8_e4m3, but got --dsa-decode-backend=flashmla_sparse.",
        ),
    ],
    ids=["not-dsa", "radix-cache", "kv-dtype", "decode-backend"],
)
def test_hisparse_rejects(model, values, message):
    with pytest.raises(Violation) as caught:
        _hisparse(model, "b200", **values)
    assert message in caught.value.message
