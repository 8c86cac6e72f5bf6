"""Model-override providers of the DeepSeek side of the model phase: DeepSeek
family, DeepSeek V4, Kimi-K3, Cohere2 MoE, MiniMax M2/M3, MiMo-V2, GLM-4 MoE.

Each test resolves through the model phase (normalise + model) on a preset and
asserts what the provider decided; the expected values were checked against
SGLang 0.5.19's resolution (the oracle) on the same preset.
"""

from __future__ import annotations

import pytest

from flotilla.resolution.rules.overrides.registry import providers_for
from helpers.resolution_configs import (
    DEEPSEEK_V3,
    DEEPSEEK_V32,
    DEEPSEEK_V4,
    FP8,
    declared_by,
    model_phase_error,
    through_model_phase,
)

NVFP4 = {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16}

KIMI_K3 = {
    "architectures": ["KimiK3ForConditionalGeneration"],
    "model_type": "kimi_k3",
    "text_config": {
        "model_type": "kimi_linear",
        "hidden_size": 7168,
        "num_attention_heads": 64,
        "num_key_value_heads": 64,
        "num_hidden_layers": 48,
        "kv_lora_rank": 512,
        "q_lora_rank": 1536,
        "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64,
        "v_head_dim": 128,
        "max_position_embeddings": 262144,
        "vocab_size": 163840,
    },
    "vision_config": {},
}
MXFP4_PACK = {"quant_method": "compressed-tensors", "config_groups": {"group_0": {"format": "mxfp4-pack-quantized"}}}
COHERE2 = {
    "architectures": ["Cohere2MoeForCausalLM"],
    "model_type": "cohere2_moe",
    "hidden_size": 4096,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "num_hidden_layers": 32,
    "max_position_embeddings": 131072,
    "vocab_size": 256000,
}
MINIMAX_M2 = {
    "architectures": ["MiniMaxM2ForCausalLM"],
    "model_type": "minimax_m2",
    "hidden_size": 3072,
    "num_attention_heads": 48,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "num_hidden_layers": 62,
    "max_position_embeddings": 196608,
    "vocab_size": 200064,
}
MINIMAX_M3 = {**MINIMAX_M2, "architectures": ["MiniMaxM3SparseForCausalLM"], "model_type": "minimax_m3"}
MIMO_V2 = {
    "architectures": ["MiMoV2FlashForCausalLM"],
    "model_type": "mimo_v2_flash",
    "hidden_size": 4096,
    "num_attention_heads": 64,
    "num_key_value_heads": 4,
    "num_hidden_layers": 48,
    "max_position_embeddings": 262144,
    "vocab_size": 152576,
}
GLM4_MOE = {
    "architectures": ["Glm4MoeForCausalLM"],
    "model_type": "glm4_moe",
    "hidden_size": 5120,
    "num_attention_heads": 96,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "num_hidden_layers": 92,
    "n_routed_experts": 160,
    "n_shared_experts": 1,
    "max_position_embeddings": 131072,
    "vocab_size": 151552,
}


def rejection(argv, hf, platform="b200"):
    return str(model_phase_error(argv, hf, platform))


# -- registry ------------------------------------------------------------------


def test_registry_orders_constant_table_before_deepseek_family_provider():
    names = [r.name for r in providers_for("MistralLarge3ForCausalLM")]
    assert names[:2] == ["MODEL_OVERRIDES['MistralLarge3ForCausalLM']", "_deepseek_family_overrides"]
    assert [r.name for r in providers_for("KimiK3ForConditionalGeneration")] == [
        "_kimi_k3_overrides",
        "_kimi_k3_moe_runner_overrides",
    ]
    assert "_deepseek_family_overrides" in [r.name for r in providers_for("Dots3NoteForCausalLM")]


# -- DeepSeek family -------------------------------------------------------------


def test_deepseek_v3_on_sm100_defaults_to_trtllm_mla():
    out = through_model_phase(["--tp", "8"], DEEPSEEK_V3, "b200")
    assert declared_by(out, "_deepseek_family_overrides") == {"attention_backend": "trtllm_mla"}


def test_deepseek_v3_on_hopper_leaves_attention_to_the_default_pass():
    out = through_model_phase(["--tp", "8"], DEEPSEEK_V3, "h100")
    assert declared_by(out, "_deepseek_family_overrides") == {}
    assert out.values["attention_backend"] is None


def test_explicit_attention_backend_suppresses_trtllm_mla():
    out = through_model_phase(["--tp", "8", "--attention-backend", "fa3"], DEEPSEEK_V3, "b200")
    assert out.values["attention_backend"] == "fa3"


@pytest.mark.parametrize("platform, page_size", [("h100", 64), ("b200", 64), ("mi300x", 1), ("mi355x", 1)])
def test_dsa_uses_dsa_backend_and_page_size_per_platform(platform, page_size):
    out = through_model_phase(["--tp", "8"], DEEPSEEK_V32, platform)
    assert declared_by(out, "_deepseek_family_overrides") == {"attention_backend": "dsa", "page_size": page_size}


def test_dsa_page_size_overrides_an_explicit_page_size():
    out = through_model_phase(["--tp", "8", "--page-size", "32"], DEEPSEEK_V32, "h100")
    assert out.values["page_size"] == 64
    change = next(c for c in out.provenance if c.field == "page_size" and c.rule == "_deepseek_family_overrides")
    assert change.overrode_user


def test_dsa_zigzag_prefill_cp_lays_out_deepep_and_full_cp_group():
    out = through_model_phase(["--tp", "8", "--enable-prefill-cp", "--cp-strategy", "zigzag"], DEEPSEEK_V32, "h200")
    assert declared_by(out, "_deepseek_family_overrides") == {
        "attention_backend": "dsa",
        "enable_dp_attention": True,
        "moe_dense_tp_size": 1,
        "moe_a2a_backend": "deepep",
        "ep_size": 8,
        "attn_cp_size": 8,
        "page_size": 64,
    }


def test_dsa_interleave_prefill_cp_rejects_dp_attention():
    message = rejection(
        ["--tp", "8", "--dp-size", "2", "--enable-dp-attention", "--enable-prefill-cp", "--cp-strategy", "interleave"],
        DEEPSEEK_V32,
        "h200",
    )
    assert "interleave DSA CP does not support DP attention." in message


def test_mla_prefill_cp_auto_config_on_hopper():
    out = through_model_phase(["--tp", "8", "--enable-prefill-cp", "--cp-strategy", "interleave"], DEEPSEEK_V3, "h100")
    assert declared_by(out, "_deepseek_family_overrides") == {
        "enable_dp_attention": True,
        "moe_dense_tp_size": 1,
        "moe_a2a_backend": "deepep",
        "ep_size": 8,
        "attn_cp_size": 8,
    }


# -- DeepSeek V4 -------------------------------------------------------------------


def test_deepseek_v4_provider_on_b200():
    out = through_model_phase(["--tp", "8"], DEEPSEEK_V4, "b200")
    assert declared_by(out, "_deepseek_v4_overrides") == {
        "attention_backend": "dsv4",
        "page_size": 256,
        "swa_full_tokens_ratio": 0.1,
        "moe_runner_backend": "flashinfer_mxfp4",
    }


def test_deepseek_v4_on_rocm_keeps_the_auto_moe_runner():
    out = through_model_phase(["--tp", "8"], DEEPSEEK_V4, "mi355x")
    assert "moe_runner_backend" not in declared_by(out, "_deepseek_v4_overrides")
    assert out.values["moe_runner_backend"] == "auto"


def test_deepseek_v4_with_all_to_all_or_non_default_swa_ratio():
    out = through_model_phase(["--tp", "8", "--swa-full-tokens-ratio", "0.5", "--moe-a2a-backend", "deepep"],
                              DEEPSEEK_V4, "h100")
    declared = declared_by(out, "_deepseek_v4_overrides")
    assert "swa_full_tokens_ratio" not in declared and "moe_runner_backend" not in declared
    assert out.values["swa_full_tokens_ratio"] == 0.5


def test_deepseek_v4_nvfp4_hybrid_checkpoint_uses_routed_trtllm():
    hybrid = {**DEEPSEEK_V4, "quantization_config": {
        "quant_method": "modelopt", "quant_algo": "MIXED_PRECISION", "moe_quant_algo": "NVFP4", "group_size": 16}}
    out = through_model_phase(["--tp", "8"], hybrid, "b200")
    assert declared_by(out, "_deepseek_v4_overrides")["moe_runner_backend"] == "flashinfer_trtllm_routed"


# -- Kimi-K3 ---------------------------------------------------------------------------


def test_kimi_k3_dcp_on_b200_keeps_cutedsl_decode():
    out = through_model_phase(["--tp", "8", "--dcp-size", "8"], KIMI_K3, "b200")
    assert declared_by(out, "_kimi_k3_overrides") == {
        "prefill_attention_backend": "trtllm_mla",
        "decode_attention_backend": "cutedsl_mla",
        "dcp_replicate_q_proj": True,
        "dcp_comm_backend": "a2a",
    }


def test_kimi_k3_dcp_on_mnnvl_fabric_uses_flashinfer_all_to_all():
    out = through_model_phase(["--tp", "4", "--dcp-size", "4", "--enable-symm-mem"], KIMI_K3, "gb200")
    declared = declared_by(out, "_kimi_k3_overrides")
    assert declared["dcp_comm_backend"] == "fi_a2a"
    assert declared["enable_symm_mem"] is False


def test_kimi_k3_dcp_tokenspeed_forces_fp8_kv():
    out = through_model_phase(["--tp", "8", "--dcp-size", "8", "--decode-attention-backend", "tokenspeed_mla"],
                              KIMI_K3, "b200")
    assert out.values["prefill_attention_backend"] == "tokenspeed_mla"
    assert out.values["kv_cache_dtype"] == "fp8_e4m3"


def test_kimi_k3_dcp_rejects_other_decode_backends():
    message = rejection(["--tp", "8", "--dcp-size", "8", "--attention-backend", "triton"], KIMI_K3, "b200")
    assert "must be 'cutedsl_mla' or 'tokenspeed_mla', got 'triton'" in message


def test_kimi_k3_dcp_needs_flashinfer_for_cutedsl():
    message = rejection(["--tp", "8", "--dcp-size", "8"], KIMI_K3, "mi300x")
    assert "requires FlashInfer 0.6.17 or newer" in message


def test_kimi_k3_without_dcp_on_sm100_defaults_to_trtllm_mla_and_mxfp4_runner():
    hf = {**KIMI_K3, "text_config": {**KIMI_K3["text_config"], "quantization_config": MXFP4_PACK}}
    out = through_model_phase(["--tp", "8"], hf, "b200")
    assert declared_by(out, "_kimi_k3_overrides") == {
        "decode_attention_backend": "trtllm_mla",
        "prefill_attention_backend": "trtllm_mla",
    }
    assert declared_by(out, "_kimi_k3_moe_runner_overrides") == {"moe_runner_backend": "flashinfer_mxfp4"}


def test_kimi_k3_on_hopper_is_left_alone():
    out = through_model_phase(["--tp", "8"], KIMI_K3, "h100")
    assert declared_by(out, "_kimi_k3_overrides") == {}


# -- Cohere2 MoE, MiniMax, MiMo-V2, GLM-4 MoE -------------------------------------------


def test_cohere2_moe_bf16_on_sm100_uses_trtllm_moe():
    assert declared_by(through_model_phase(["--tp", "4"], COHERE2, "b200"), "_cohere2_moe_runner_overrides") == {
        "moe_runner_backend": "flashinfer_trtllm"}
    fp8 = {**COHERE2, "quantization_config": FP8}
    assert declared_by(through_model_phase(["--tp", "4"], fp8, "b200"), "_cohere2_moe_runner_overrides") == {}
    assert declared_by(through_model_phase(["--tp", "4"], COHERE2, "h100"), "_cohere2_moe_runner_overrides") == {}


def test_minimax_m2_nvfp4_on_sm100_uses_routed_trtllm():
    out = through_model_phase(["--tp", "8"], {**MINIMAX_M2, "quantization_config": NVFP4}, "b200")
    assert declared_by(out, "_minimax_m2_overrides") == {
        "enable_tf32_matmul": True,
        "moe_runner_backend": "flashinfer_trtllm_routed",
    }
    out = through_model_phase(["--tp", "8"], MINIMAX_M2, "h100")
    assert declared_by(out, "_minimax_m2_overrides") == {"enable_tf32_matmul": True}


def test_minimax_m3_bf16_on_sm100():
    out = through_model_phase(["--tp", "8"], MINIMAX_M3, "b200")
    assert declared_by(out, "_minimax_m3_overrides") == {
        "attention_backend": "fa4",
        "page_size": 128,
        "moe_runner_backend": "triton",
    }


def test_minimax_m3_fp8_kv_on_sm100_prefers_trtllm_mha():
    out = through_model_phase(["--tp", "8", "--kv-cache-dtype", "fp8_e4m3"], MINIMAX_M3, "b200")
    assert out.values["attention_backend"] == "trtllm_mha" and out.values["page_size"] == 128


def test_minimax_m3_on_hopper_uses_fa3_with_page_128():
    out = through_model_phase(["--tp", "8"], MINIMAX_M3, "h100")
    assert declared_by(out, "_minimax_m3_overrides") == {
        "attention_backend": "fa3",
        "page_size": 128,
        "moe_runner_backend": "triton",
    }


def test_minimax_m3_on_rocm_sets_rope_env_and_keeps_nccl_all_reduce():
    out = through_model_phase(["--tp", "8", "--ep-size", "8", "--enable-aiter-allreduce-fusion"], MINIMAX_M3, "mi300x")
    assert declared_by(out, "_minimax_m3_overrides") == {
        "attention_backend": "triton",
        "enable_aiter_allreduce_fusion": False,
        "disable_custom_all_reduce": True,
        "moe_runner_backend": "triton",
    }
    assert out.env["USE_ROCM_AITER_ROPE_BACKEND"] == "0"


def test_minimax_m3_mxfp8_checkpoint_adopts_quantization_and_deep_gemm():
    hf = {**MINIMAX_M3, "quantization_config": {"quant_method": "modelopt", "quant_algo": "MXFP8", "group_size": 32}}
    out = through_model_phase(["--tp", "8"], hf, "b200")
    declared = declared_by(out, "_minimax_m3_overrides")
    assert declared["quantization"] == "mxfp8" and declared["moe_runner_backend"] == "deep_gemm"


def test_mimo_v2_eagle_and_fp8_on_sm100():
    out = through_model_phase(["--tp", "8", "--speculative-algorithm", "EAGLE"],
                              {**MIMO_V2, "quantization_config": FP8}, "b200")
    assert declared_by(out, "_mimo_v2_overrides") == {
        "enable_multi_layer_eagle": True, "moe_runner_backend": "flashinfer_trtllm"}
    out = through_model_phase(["--tp", "8"], MIMO_V2, "h100")
    assert declared_by(out, "_mimo_v2_overrides") == {}


def test_glm4_moe_on_sm100_adopts_checkpoint_quantization():
    out = through_model_phase(["--tp", "8"], {**GLM4_MOE, "quantization_config": FP8}, "b200")
    assert declared_by(out, "_glm4_moe_overrides") == {"quantization": "fp8", "enable_tf32_matmul": True}
    out = through_model_phase(["--tp", "8"], {**GLM4_MOE, "quantization_config": NVFP4}, "b200")
    assert declared_by(out, "_glm4_moe_overrides") == {
        "quantization": "modelopt_fp4",
        "moe_runner_backend": "flashinfer_trtllm",
        "enable_tf32_matmul": True,
    }


def test_glm4_moe_off_sm100_only_enables_tf32():
    out = through_model_phase(["--tp", "8"], {**GLM4_MOE, "quantization_config": FP8}, "h100")
    assert declared_by(out, "_glm4_moe_overrides") == {"enable_tf32_matmul": True}
