"""The model phase (SGLang's ``handle_model_specific_adjustments``): its order,
the DeepSeek/MLA/DSA branch and its passes, DeepSeek V4, the architecture
checks, the mamba radix cache passes, all-reduce fusion, and the GLM-5.x SM120
rules from PR 29580.

Tests resolve through the model phase (normalise + model) on a preset; the
expected values were checked against SGLang 0.5.19's resolution (the oracle),
except the PR 29580 rules SGLang 0.5.19 lacks.
"""

from __future__ import annotations

import pytest

from flotilla.resolution import ModelFacts, preset
from flotilla.resolution.engine import ProviderGroup, View
from flotilla.resolution.fields import DEFAULTS
from flotilla.resolution.rules import overrides
from flotilla.resolution.rules.overrides import deepseek_passes, glm_sm120
from helpers.resolution_configs import (
    DEEPSEEK_V3,
    DEEPSEEK_V32,
    DEEPSEEK_V4,
    LLAMA_8K as LLAMA,
    declared_by,
    model_phase_error as rejection,
    through_model_phase,
)

GLM5 = {**DEEPSEEK_V32, "architectures": ["GlmMoeDsaForCausalLM"], "model_type": "glm_moe_dsa", "num_hidden_layers": 78}
GLM52_NVFP4 = {**GLM5, "quantization_config": {
    "quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16, "kv_cache_quant_algo": "FP8",
    "exclude_modules": ["lm_head", "model.layers.*.self_attn*", "model.layers.*.mlp.shared_experts*"]}}
QWEN3_NEXT = {
    "architectures": ["Qwen3NextForCausalLM"],
    "model_type": "qwen3_next",
    "hidden_size": 2048,
    "num_attention_heads": 16,
    "num_key_value_heads": 2,
    "head_dim": 256,
    "num_hidden_layers": 48,
    "full_attention_interval": 4,
    "linear_num_value_heads": 32,
    "linear_num_key_heads": 16,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_conv_kernel_dim": 4,
    "num_experts": 512,
    "max_position_embeddings": 262144,
    "vocab_size": 151936,
}


# -- order ------------------------------------------------------------------------


def test_steps_follow_handle_model_specific_adjustments():
    names = [step.name for step in overrides.STEPS]
    assert names[:2] == ["_handle_model_specific_adjustments"] * 2
    provider_at = next(i for i, s in enumerate(overrides.STEPS) if isinstance(s, ProviderGroup))
    order = [
        "_mamba_radix_cache_resolution",  # pre-dispatch slot
        "model_overrides",
        "apply_kimi_k3_linear_attn_defaults",
        "_deepseek_v4_kv_cache_dtype",
        "_dsa_kv_cache_dtype_default",
        "_dsa_split_backend_resolution",
        "_deepseek_moe_quant_resolution",
        "_deepseek_spec_moe_resolution",
        "validate_deepseek_v4_cp",
        "_sparse_head_overlap_disable",
        "_flashinfer_allreduce_fusion_auto_enable",
        "_enforce_disable_allreduce_fusion",
    ]
    positions = [names.index(name) for name in order]
    assert positions == sorted(positions)
    assert names.index("_mamba_radix_cache_resolution") < provider_at
    # the second mamba pass follows every architecture branch
    second_mamba = len(names) - 1 - names[::-1].index("_mamba_radix_cache_resolution")
    assert second_mamba > names.index("validate_deepseek_v4_mega_moe_token_budget")


# -- opening resets and architecture flag checks ---------------------------------------


def test_deterministic_inference_forces_allreduce_fusion_off():
    out = through_model_phase(["--tp", "8", "--enable-deterministic-inference"], DEEPSEEK_V3, "b200")
    assert out.values["enforce_disable_flashinfer_allreduce_fusion"] is True
    assert out.values["flashinfer_allreduce_fusion_backend"] is None
    assert out.values["uses_mamba_radix_cache"] is False


def test_dsa_cache_layer_split_needs_a_dsa_model():
    error = rejection(["--tp", "8", "--enable-dsa-cache-layer-split"], LLAMA, "h100")
    assert "--enable-dsa-cache-layer-split is only supported for DSA" in str(error)


def test_cp_decode_attn_tp_needs_replicated_attention_linears():
    error = rejection(["--tp", "8", "--enable-cp-decode-attn-tp"], DEEPSEEK_V3, "b200")
    assert "Got DeepseekV3ForCausalLM; supported: ['DeepseekV4ForCausalLM'," in str(error)
    through_model_phase(["--tp", "8", "--enable-cp-decode-attn-tp"], GLM5, "b200")  # accepted


def test_intern_s2_mobius_rejects_pipeline_and_expert_parallelism():
    hf = {**LLAMA, "architectures": ["InternS2MobiusForConditionalGeneration"], "model_type": "interns2_mobius"}
    error = rejection(["--tp", "8", "--pp-size", "2", "--ep-size", "8"], hf, "h100")
    assert ("Intern-S2-Mobius does not support: pipeline parallelism (--pp-size must be 1); "
            "expert parallelism (--ep-size must be 1).") in str(error)


# -- DSA ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "platform, kv, prefill, decode",
    [
        ("h100", "bfloat16", "flashmla_sparse", "fa3"),
        ("b200", "fp8_e4m3", "trtllm", "trtllm"),
        ("mi300x", "bfloat16", "tilelang", "tilelang"),
    ],
)
def test_dsa_kv_cache_dtype_and_split_backends(platform, kv, prefill, decode):
    out = through_model_phase(["--tp", "8"], DEEPSEEK_V32, platform)
    assert (out.values["kv_cache_dtype"], out.values["dsa_prefill_backend"], out.values["dsa_decode_backend"]) == (
        kv, prefill, decode)
    assert out.env["SGLANG_DSA_PREFILL_DENSE_ATTN_KV_LEN_THRESHOLD"] == "2048"


def test_dsa_bf16_alias_is_normalised_and_fp8_on_blackwell_selects_trtllm_decode():
    out = through_model_phase(["--tp", "8", "--kv-cache-dtype", "bf16"], DEEPSEEK_V32, "b200")
    assert out.values["kv_cache_dtype"] == "bfloat16"
    assert out.values["dsa_prefill_backend"] == "flashmla_sparse" and out.values["dsa_decode_backend"] == "trtllm"


def test_dsa_rejects_other_kv_cache_dtypes():
    error = rejection(["--tp", "8", "--kv-cache-dtype", "fp8_e5m2"], DEEPSEEK_V32, "h100")
    assert "DeepSeek DSA only supports bf16/bfloat16 or fp8_e4m3 kv_cache_dtype" in str(error)
    assert error.violations[0].kind == "AssertionError"


def test_dsa_tilelang_with_fp8_kv_is_rejected_on_cuda():
    error = rejection(["--tp", "8", "--dsa-prefill-backend", "tilelang", "--kv-cache-dtype", "fp8_e4m3"],
                      DEEPSEEK_V32, "b200")
    assert "The tilelang DSA prefill/decode kernels only support an fp8_e4m3 KV cache on ROCm/HIP" in str(error)


def test_dsa_on_rocm_with_one_user_backend_follows_the_kv_dtype_rule():
    out = through_model_phase(["--tp", "8", "--dsa-decode-backend", "aiter"], DEEPSEEK_V32, "mi300x")
    assert out.values["dsa_prefill_backend"] == "flashmla_sparse" and out.values["dsa_decode_backend"] == "aiter"
    assert out.env["SGLANG_OPT_USE_TOPK_V2"] == "False"


def test_glm_dsa_fp8_on_sm120_selects_flashinfer_sparse_mla():
    out = through_model_phase(["--tp", "8"], GLM5, "rtx-pro-6000")
    assert out.values["kv_cache_dtype"] == "fp8_e4m3"
    assert out.values["dsa_prefill_backend"] == out.values["dsa_decode_backend"] == "flashinfer_sparse_mla"
    out = through_model_phase(["--tp", "8", "--dsa-decode-backend", "trtllm"], GLM5, "rtx-pro-6000")
    assert out.values["dsa_prefill_backend"] == "flashinfer_sparse_mla" and out.values["dsa_decode_backend"] == "trtllm"
    out = through_model_phase(["--tp", "8", "--kv-cache-dtype", "bfloat16"], GLM5, "rtx-pro-6000")
    assert out.values["dsa_prefill_backend"] == "flashmla_sparse" and out.values["dsa_decode_backend"] == "trtllm"


@pytest.mark.parametrize("sharing", [{"index_topk_pattern": "FFSS"}, {"index_topk_freq": 2}])
def test_two_batch_overlap_rejects_dsa_topk_sharing(sharing):
    error = rejection(["--tp", "8", "--enable-two-batch-overlap", "--moe-a2a-backend", "deepep"],
                      {**GLM5, **sharing}, "h200")
    assert "--enable-two-batch-overlap is not supported with DSA index-topk sharing" in str(error)


def test_two_batch_overlap_is_fine_without_topk_sharing():
    out = through_model_phase(["--tp", "8", "--enable-two-batch-overlap", "--moe-a2a-backend", "deepep"],
                              {**GLM5, "index_topk_pattern": "FFFF"}, "h200")
    assert out.values["attention_backend"] == "dsa"


def test_dsa_prefill_cp_disables_prefill_graphs():
    out = through_model_phase(["--tp", "8", "--enable-prefill-cp", "--cp-strategy", "zigzag"], DEEPSEEK_V32, "h200")
    assert out.values["cuda_graph_config"]["prefill"]["backend"] == "disabled"


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--disaggregation-mode", "decode", "--enable-prefill-cp", "--cp-strategy", "interleave"],
         "CP is only supported for prefill when PD disaggregation"),
        (["--enable-dsa-cache-layer-split"], "only supported on PD prefill workers"),
        (["--enable-dsa-cache-layer-split", "--disaggregation-mode", "prefill"],
         "--enable-dsa-cache-layer-split requires --enable-prefill-cp and --cp-strategy interleave"),
        (["--enable-dsa-cache-layer-split", "--disaggregation-mode", "prefill", "--enable-prefill-cp",
          "--cp-strategy", "interleave", "--disaggregation-transfer-backend", "nixl"],
         "currently only supports the mooncake transfer backend"),
    ],
)
def test_dsa_context_parallel_checks(argv, message):
    assert message in str(rejection(["--tp", "8", *argv], DEEPSEEK_V32, "h200"))


# -- DeepSeek quantization / MoE passes ----------------------------------------------------


def test_deepseek_fp8_on_sm100_adopts_quantization_and_trtllm_moe():
    out = through_model_phase(["--tp", "8"], DEEPSEEK_V3, "b200")
    assert declared_by(out, "_deepseek_moe_quant_resolution") == {
        "quantization": "fp8", "moe_runner_backend": "flashinfer_trtllm"}


def test_deepseek_without_quantization_config_stays_bf16_but_uses_trtllm_moe():
    hf = {k: v for k, v in DEEPSEEK_V3.items() if k != "quantization_config"}
    out = through_model_phase(["--tp", "8"], hf, "b200")
    assert declared_by(out, "_deepseek_moe_quant_resolution") == {"moe_runner_backend": "flashinfer_trtllm"}


def test_deepseek_modelopt_checkpoint_reads_the_rewritten_method():
    hf = {**DEEPSEEK_V3, "quantization_config": {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16}}
    out = through_model_phase(["--tp", "8"], hf, "b200")
    assert declared_by(out, "_deepseek_moe_quant_resolution")["quantization"] == "modelopt_fp4"


def test_deepseek_with_all_to_all_keeps_auto_moe_runner():
    out = through_model_phase(["--tp", "8", "--ep-size", "8", "--moe-a2a-backend", "deepep"], DEEPSEEK_V3, "b200")
    assert "moe_runner_backend" not in declared_by(out, "_deepseek_moe_quant_resolution")


def test_deepseek_fp4_eagle_draft_on_rocm_runs_triton_moe():
    # NOTE: run on a view: SGLang's ROCm quantization check rejects modelopt_fp4
    # before the model phase, so the arm is unreachable from a full launch.
    view = View({**DEFAULTS, "quantization": "modelopt_fp4", "speculative_algorithm": "EAGLE"},
                {}, frozenset({"quantization"}), DEFAULTS)
    model = ModelFacts.from_hf_config(DEEPSEEK_V3)
    spec_moe = deepseek_passes.deepseek_spec_moe_resolution.fn
    assert spec_moe(view, model, preset("mi355x")) == {
        "speculative_moe_runner_backend": "triton", "speculative_moe_a2a_backend": "none"}
    assert spec_moe(view, model, preset("b200")) is None


# -- DeepSeek V4 ------------------------------------------------------------------------------


def test_deepseek_v4_defaults():
    out = through_model_phase(["--tp", "8"], DEEPSEEK_V4, "b200")
    assert out.values["kv_cache_dtype"] == "fp8_e4m3"
    assert out.values["max_running_requests"] == 256


def test_deepseek_v4_rejects_unsupported_kv_dtype_and_speculation():
    assert "fp8_e5m2 is not supported for DeepseekV4ForCausalLM" in str(
        rejection(["--tp", "8", "--kv-cache-dtype", "fp8_e5m2"], DEEPSEEK_V4, "b200"))
    assert "Only EAGLE and DSPARK speculative algorithms are supported" in str(
        rejection(["--tp", "8", "--speculative-algorithm", "NGRAM"], DEEPSEEK_V4, "h100"))


def test_deepseek_v4_prefill_cp_layout():
    out = through_model_phase(["--tp", "8", "--enable-prefill-cp", "--cp-strategy", "interleave"], DEEPSEEK_V4, "h100")
    assert declared_by(out, "validate_deepseek_v4_cp") == {
        "enable_dsa_prefill_context_parallel": True,
        "enable_prefill_context_parallel": False,
        "dsa_prefill_cp_mode": "round-robin-split",
        "enable_dp_attention": True,
        "moe_dense_tp_size": 1,
        "attn_cp_size": 8,
    }
    assert out.env["SGLANG_OPT_FLASHMLA_SPARSE_PREFILL"] == "False"
    error = rejection(["--tp", "8", "--enable-prefill-cp", "--cp-strategy", "zigzag"], DEEPSEEK_V4, "h100")
    assert "DeepSeekV4 only supports interleave CP strategy, got zigzag" in str(error)


def test_deepseek_v4_megamoe_token_budget():
    error = rejection(["--tp", "8", "--moe-a2a-backend", "megamoe", "--chunked-prefill-size", "16384"],
                      DEEPSEEK_V4, "b200")
    assert "required_per_rank=16384" in str(error)
    through_model_phase(["--tp", "8", "--ep-size", "8", "--moe-a2a-backend", "megamoe",
                         "--chunked-prefill-size", "4096"], DEEPSEEK_V4, "b200")


def test_deepseek_v4_platform_kernel_switches():
    rocm = through_model_phase(["--tp", "8"], DEEPSEEK_V4, "mi355x").env
    assert rocm["SGLANG_OPT_USE_AITER_INDEXER"] == "True" and rocm["SGLANG_OPT_FLASHMLA_SPARSE_PREFILL"] == "False"
    sm120 = through_model_phase(["--tp", "8"], DEEPSEEK_V4, "rtx-pro-6000").env
    assert sm120["SGLANG_OPT_USE_TOPK_V2"] == "False" and sm120["SGLANG_OPT_USE_TILELANG_INDEXER"] == "True"


# -- architecture checks ------------------------------------------------------------------------


def test_architecture_backend_checks():
    gpt_oss = {**LLAMA, "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss"}
    assert "GptOssForCausalLM requires one of" in str(
        rejection(["--tp", "8", "--attention-backend", "flashinfer"], gpt_oss, "h100"))
    llama4 = {**LLAMA, "architectures": ["Llama4ForCausalLM"], "model_type": "llama4_text"}
    assert "is required for Llama4 model but got flashinfer" in str(
        rejection(["--tp", "8", "--attention-backend", "flashinfer"], llama4, "h100"))
    exaone = {**LLAMA, "architectures": ["Exaone4ForCausalLM"], "model_type": "exaone4", "sliding_window": 4096}
    assert "One of the attention backends in ['fa3', 'triton', 'trtllm_mha'] is required" in str(
        rejection(["--tp", "2"], exaone, "h100"))
    olmo2 = {**LLAMA, "architectures": ["Olmo2ForCausalLM"], "model_type": "olmo2"}
    assert "FlashInfer backend can significantly degrade" in str(
        rejection(["--attention-backend", "flashinfer"], olmo2, "h100"))


def test_mimo_v2_fused_qkv_needs_matching_attention_tp():
    hf = {**LLAMA, "architectures": ["MiMoV2ForCausalLM"], "model_type": "mimo_v2",
          "attention_projection_layout": "fused_qkv", "num_key_value_heads": 4}
    assert "MiMoV2ForCausalLM requires effective attention TP size 4" in str(rejection(["--tp", "8"], hf, "h100"))
    through_model_phase(["--tp", "4"], hf, "h100")


# -- mamba radix cache --------------------------------------------------------------------------


def test_hybrid_model_with_overlap_uses_extra_buffer():
    out = through_model_phase(["--tp", "4"], QWEN3_NEXT, "h100")
    assert out.values["uses_mamba_radix_cache"] is True
    assert out.values["mamba_radix_cache_strategy"] == "extra_buffer"


def test_hybrid_model_without_radix_cache_keeps_it_off():
    out = through_model_phase(["--tp", "4", "--disable-radix-cache"], QWEN3_NEXT, "h100")
    assert out.values["uses_mamba_radix_cache"] is False


def test_no_buffer_strategy_needs_overlap_off():
    error = rejection(["--tp", "4", "--mamba-radix-cache-strategy", "no_buffer"], QWEN3_NEXT, "h100")
    assert "no_buffer do not support overlap schedule" in str(error)
    out = through_model_phase(["--tp", "4", "--disable-overlap-schedule"], QWEN3_NEXT, "h100")
    assert out.values["mamba_radix_cache_strategy"] == "no_buffer"


def test_extra_buffer_needs_the_triton_linear_attention_backend():
    error = rejection(["--tp", "4", "--mamba-radix-cache-strategy", "extra_buffer",
                       "--linear-attn-backend", "flashinfer"], QWEN3_NEXT, "h100")
    assert "extra_buffer is not supported for Qwen3NextForCausalLM; use no_buffer." in str(error)


@pytest.mark.parametrize(
    "argv",
    [
        ["--page-size", "48"],  # 256-token track interval is not a multiple of it
        ["--speculative-algorithm", "EAGLE", "--speculative-num-steps", "3", "--speculative-eagle-topk", "1",
         "--speculative-num-draft-tokens", "300"],  # drafts longer than the track interval
    ],
)
def test_extra_buffer_geometry_checks(argv):
    error = rejection(["--tp", "4", *argv], QWEN3_NEXT, "h100")
    assert error.violations[0].kind == "AssertionError"
    assert "mamba_track_interval (256) must" in str(error)


def test_granite_hybrid_uses_mamba_cache_only_with_mamba_layers():
    granite = {**LLAMA, "architectures": ["GraniteMoeHybridForCausalLM"], "model_type": "granitemoehybrid",
               "layer_types": ["mamba", "attention"]}
    assert through_model_phase(["--tp", "2"], granite, "h100").values["uses_mamba_radix_cache"] is True
    dense = {**granite, "layer_types": ["attention", "attention"]}
    assert through_model_phase(["--tp", "2"], dense, "h100").values["uses_mamba_radix_cache"] is False


# -- all-reduce fusion --------------------------------------------------------------------------


def test_allreduce_fusion_auto_enable_and_its_exceptions():
    assert through_model_phase(["--tp", "8"], DEEPSEEK_V3, "b200").values["flashinfer_allreduce_fusion_backend"] == "auto"
    assert through_model_phase(["--tp", "16", "--nnodes", "2"], DEEPSEEK_V3, "h100").values[
        "flashinfer_allreduce_fusion_backend"] is None
    assert through_model_phase(["--tp", "8"], LLAMA, "b200").values["flashinfer_allreduce_fusion_backend"] is None
    out = through_model_phase(["--tp", "8", "--enforce-disable-flashinfer-allreduce-fusion"], DEEPSEEK_V3, "b200")
    assert out.values["flashinfer_allreduce_fusion_backend"] is None


# -- GLM-5.x on SM120 (PR 29580) ------------------------------------------------------------------


def _view(values, explicit=()):
    return View({**DEFAULTS, **values}, {}, frozenset(explicit), DEFAULTS)


SIZED_GRAPHS = {
    "decode": {"backend": "full", "max_bs": 512, "bs": [1, 2, 4, 8, 256, 272, 512]},
    "prefill": {"backend": "breakable", "max_bs": 2048, "bs": [4, 8]},
    "locked": [],
}


def test_glm_dsa_sm120_caps_the_decode_graph_batch():
    glm5, rtx = ModelFacts.from_hf_config(GLM5), preset("rtx-pro-6000")
    declared = glm_sm120.glm_dsa_sm120_decode_graph_cap.fn(_view({"cuda_graph_config": SIZED_GRAPHS}), glm5, rtx)
    decode = declared["cuda_graph_config"]["decode"]
    assert decode["max_bs"] == 256 and decode["bs"] == [1, 2, 4, 8, 256]
    assert declared["cuda_graph_config"]["prefill"] == SIZED_GRAPHS["prefill"]


def test_glm_dsa_sm120_cap_leaves_user_sizes_other_gpus_and_other_models():
    glm5, rtx = ModelFacts.from_hf_config(GLM5), preset("rtx-pro-6000")
    locked = {**SIZED_GRAPHS, "locked": ["decode.max_bs"]}
    cap = glm_sm120.glm_dsa_sm120_decode_graph_cap.fn
    assert cap(_view({"cuda_graph_config": locked}), glm5, rtx) is None
    assert cap(_view({"cuda_graph_config": SIZED_GRAPHS}), glm5, preset("b200")) is None
    assert cap(_view({"cuda_graph_config": SIZED_GRAPHS}), ModelFacts.from_hf_config(DEEPSEEK_V32), rtx) is None


def test_glm_dsa_sm120_cap_through_the_model_phase():
    out = through_model_phase(["--tp", "8"], GLM5, "rtx-pro-6000")
    config = out.values["cuda_graph_config"]
    assert config["decode"]["max_bs"] <= 256
    out = through_model_phase(["--tp", "8", "--cuda-graph-max-bs", "384"], GLM5, "rtx-pro-6000")
    assert out.values["cuda_graph_config"]["decode"]["max_bs"] == 384


def test_glm_modelopt_fp4_unquantized_shared_experts_are_a_load_time_fact():
    # The PR decides this in the model loader; the resolved field stays as the
    # reference resolves it (scenario glm52-nvfp4-rtx6000-pr-launch).
    glm52 = ModelFacts.from_hf_config(GLM52_NVFP4)
    assert glm_sm120.glm_shared_experts_unfusable(glm52, "modelopt_fp4")
    out = through_model_phase(["--tp", "8", "--quantization", "modelopt_fp4"], GLM52_NVFP4, "rtx-pro-6000")
    assert out.values["disable_shared_experts_fusion"] is False
    quantized_shared = {**GLM52_NVFP4, "quantization_config": {
        **GLM52_NVFP4["quantization_config"], "exclude_modules": ["lm_head"]}}
    assert not glm_sm120.glm_shared_experts_unfusable(ModelFacts.from_hf_config(quantized_shared), "modelopt_fp4")
    assert not glm_sm120.glm_shared_experts_unfusable(ModelFacts.from_hf_config(GLM5), None)
    assert not glm_sm120.glm_shared_experts_unfusable(glm52, "fp8")
