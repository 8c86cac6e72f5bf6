"""ModelFacts derivations match what SGLang 0.5.19's ModelConfig concludes.

Expected values were checked against SGLang's ModelConfig built for the same
config.json (transformers 5.x loading it).
"""

import json

import pytest

from flotilla.resolution.errors import ModelConfigError, Violation
from flotilla.resolution.model import ModelFacts
from flotilla.resolution.model_derive import check_context_length, context_length
from flotilla.resolution.model_quant import parse_quant_config, verify_quantization
from helpers.resolution_configs import DEEPSEEK_V3_MLA, LLAMA_SHAPE

LLAMA = {
    **LLAMA_SHAPE,
    "max_position_embeddings": 131072,
    "rope_parameters": {"rope_theta": 500000.0, "rope_type": "default"},
}

DSV3 = {
    **DEEPSEEK_V3_MLA,
    "max_position_embeddings": 163840,
    "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]},
}

GLM5 = {
    "architectures": ["GlmMoeDsaForCausalLM"],
    "model_type": "glm_moe_dsa",
    "num_hidden_layers": 6,
    "index_topk": 2048,
}


def facts(**changes):
    base = dict(changes.pop("base", LLAMA))
    for key, value in changes.items():
        if value is None:
            base.pop(key, None)
        else:
            base[key] = value
    return ModelFacts.from_hf_config(base)


# --- attention architecture and shapes ---------------------------------------------------


def test_llama_is_mha_with_symmetric_kv():
    m = facts()
    assert (m.is_mla, m.has_asymmetric_kv, m.head_dim, m.v_head_dim) == (False, False, 128, 128)
    assert (m.total_num_kv_heads, m.num_kv_heads(8), m.num_kv_heads(16)) == (8, 1, 1)
    assert m.num_kv_heads(4) == 2


def test_deepseek_v3_is_mla_with_asymmetric_kv_and_per_rank_heads():
    m = ModelFacts.from_hf_config(DSV3)
    assert m.is_mla and m.has_asymmetric_kv
    assert (m.head_dim, m.v_head_dim) == (256, 128)
    # MLA models still shard their configured KV heads (aiter's 16/128 check reads this).
    assert (m.num_kv_heads(8), m.num_kv_heads(1)) == (16, 128)
    assert m.num_kv_heads(8, dcp_size=2) == 32
    assert not m.is_dsa and m.index_topk is None


def test_glm5_mla_is_symmetric_and_minimal_config_takes_class_defaults():
    m = ModelFacts.from_hf_config(GLM5)
    assert m.is_mla and not m.has_asymmetric_kv  # v_head_dim defaults to 256
    assert m.is_dsa and m.index_topk == 2048
    assert m.context_len == 202752  # GlmMoeDsaConfig's max_position_embeddings
    assert m.get("num_key_value_heads") == 64


def test_minimal_deepseek_config_uses_class_defaults():
    m = ModelFacts.from_hf_config({"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3"})
    assert m.is_mla and m.context_len == 4096 and m.total_num_kv_heads == 128
    assert (m.swa_head_dim, m.swa_v_head_dim) == (64, 64)  # head_dim points at the RoPE slice


def test_kv_head_count_sources():
    assert facts(num_key_value_heads=None).total_num_kv_heads == 32
    falcon = {"architectures": ["FalconForCausalLM"], "model_type": "falcon", "hidden_size": 1024,
              "num_attention_heads": 16, "multi_query": True}
    assert ModelFacts.from_hf_config(falcon).total_num_kv_heads == 1
    new_falcon = dict(falcon, new_decoder_architecture=True, num_kv_heads=4)
    assert ModelFacts.from_hf_config(new_falcon).total_num_kv_heads == 4
    glm = {"architectures": ["ChatGLMModel"], "model_type": "chatglm", "hidden_size": 1024,
           "num_attention_heads": 16, "multi_query_group_num": 2}
    assert ModelFacts.from_hf_config(glm).total_num_kv_heads == 2
    mpt = {"architectures": ["MPTForCausalLM"], "model_type": "mpt", "num_attention_heads": 16,
           "attn_config": {"kv_n_heads": 4}}
    assert ModelFacts.from_hf_config(mpt).total_num_kv_heads == 4


def test_explicit_v_head_dim_makes_kv_asymmetric():
    assert facts(v_head_dim=64).has_asymmetric_kv
    assert not facts(v_head_dim=0).has_asymmetric_kv  # 0 means "same as head_dim"


def test_gemma4_global_head_dim_is_the_full_attention_width():
    cfg = {
        "architectures": ["Gemma4ForConditionalGeneration"],
        "model_type": "gemma4",
        "text_config": {"model_type": "gemma4_text", "hidden_size": 2304, "num_attention_heads": 8,
                        "num_key_value_heads": 4, "head_dim": 256, "global_head_dim": 512,
                        "num_hidden_layers": 4, "max_position_embeddings": 131072},
        "vision_config": {},
    }
    m = ModelFacts.from_hf_config(cfg)
    assert (m.head_dim, m.v_head_dim, m.swa_head_dim, m.swa_v_head_dim) == (512, 512, 256, 256)
    assert not m.has_asymmetric_kv and m.is_hybrid_swa and m.is_multimodal


# --- DSA -------------------------------------------------------------------------------------


def test_dsa_needs_a_dsa_architecture_and_index_topk():
    assert ModelFacts.from_hf_config(dict(DSV3, architectures=["DeepseekV32ForCausalLM"], index_topk=2048)).is_dsa
    assert not ModelFacts.from_hf_config(dict(DSV3, architectures=["DeepseekV32ForCausalLM"])).is_dsa
    assert not ModelFacts.from_hf_config(dict(LLAMA, index_topk=2048)).is_dsa


def test_explicit_index_topk_pattern_wins_over_indexer_types():
    m = ModelFacts.from_hf_config(dict(GLM5, index_topk_pattern="FFSS", indexer_types=["full"] * 4))
    assert m.index_topk_pattern == "FFSS"


def test_pattern_derived_from_indexer_types_when_null():
    types = ["full", "full", "full", "shared", "shared", "full"]
    m = ModelFacts.from_hf_config(dict(GLM5, index_topk_pattern=None, indexer_types=types))
    assert m.index_topk_pattern == "FFFSSF"
    m = ModelFacts.from_hf_config(dict(GLM5, indexer_types=types))
    assert m.index_topk_pattern == "FFFSSF"


def test_unknown_indexer_type_falls_back_to_frequency():
    m = ModelFacts.from_hf_config(dict(GLM5, indexer_types=["full", "sparse"], index_topk_freq=2))
    assert m.index_topk_pattern is None and m.index_topk_freq == 2
    assert ModelFacts.from_hf_config(dict(GLM5, index_topk_freq=None)).index_topk_freq == 1


# --- quantization ----------------------------------------------------------------------------


def test_plain_fp8_checkpoint():
    m = ModelFacts.from_hf_config(DSV3)
    assert (m.quant_method, m.quantization) == ("fp8", "fp8")


@pytest.mark.parametrize(
    "algo, expected",
    [("NVFP4", "modelopt_fp4"), ("FP8", "modelopt_fp8"), ("MXFP8", "mxfp8"), ("W8A8", "modelopt")],
)
def test_modelopt_quant_algo_mapping(algo, expected):
    m = facts(quantization_config={"quant_method": "modelopt", "quant_algo": algo})
    assert m.quantization == expected
    # SGLang rewrites the config its rules read with the concrete method.
    assert m.quant_method == expected and m.quantization_config["quant_algo"] == algo


def test_modelopt_mixed_precision_depends_on_nvfp4_layers():
    nvfp4 = {"quant_method": "modelopt", "quant_algo": "MIXED_PRECISION", "quantized_layers": {"x": {"quant_algo": "NVFP4"}}}
    w4a8 = {"quant_method": "modelopt", "quant_algo": "MIXED_PRECISION", "quantized_layers": {"x": {"quant_algo": "W4A8_AWQ"}}}
    assert facts(quantization_config=nvfp4).quantization == "modelopt_mixed"
    assert facts(quantization_config=w4a8).quantization == "w4afp8"


def test_quant_algo_without_quant_method_is_modelopt():
    assert facts(quantization_config={"quant_algo": "NVFP4", "group_size": 16}).quantization == "modelopt_fp4"


def test_compression_config_and_no_quantization():
    ct = facts(compression_config={"quant_method": "compressed-tensors", "config_groups": {}})
    assert ct.quantization == "compressed-tensors" and ct.quant_method is None
    plain = facts()
    assert (plain.quantization, plain.quant_method, plain.quant_config) == (None, None, None)


def test_unidentifiable_quantization_config_is_rejected_at_verification():
    m = facts(quantization_config={"bits": 4, "group_size": 64})
    assert m.quantization is None
    with pytest.raises(Violation, match=r"Unknown quantization method: \. Must be one of \['fp8', 'mxfp8'"):
        verify_quantization(m.quant_config, None)


def test_cli_quantization_compatibility():
    fp8 = ModelFacts.from_hf_config(DSV3).quant_config
    assert verify_quantization(fp8, "modelopt_fp4") == "modelopt_fp4"
    assert verify_quantization(fp8, "quark_mxfp4") == "quark_mxfp4"
    with pytest.raises(Violation, match=r"model config \(fp8\) does not match .*`quantization` argument \(awq\)"):
        verify_quantization(fp8, "awq")
    nvfp4 = parse_quant_config({"quantization_config": {"quant_method": "modelopt", "quant_algo": "NVFP4"}})
    assert verify_quantization(nvfp4, "modelopt") == "modelopt_fp4"
    assert verify_quantization(nvfp4, "modelopt_fp8") == "modelopt_fp4"  # the checkpoint wins
    assert verify_quantization(None, "fp8") == "fp8"


def test_platform_dependent_quantization_checks():
    mx = {"quant_method": "mxfp4"}
    assert verify_quantization(mx, None, device="hip", capability=(9, 5), gcn_arch="gfx950") == "mxfp4"
    with pytest.raises(Violation, match="Unknown quantization method: mxfp4"):
        verify_quantization(mx, None, device="hip", capability=(9, 4), gcn_arch="gfx942")
    with pytest.raises(Violation, match="^modelopt_fp4 quantization is currently not supported in ROCm.$"):
        nvfp4 = parse_quant_config({"quantization_config": {"quant_method": "modelopt", "quant_algo": "NVFP4"}})
        verify_quantization(nvfp4, None, device="hip", capability=(9, 4))
    unknown_modelopt = {"quant_method": "modelopt", "quant_algo": "W8A8"}
    assert verify_quantization(unknown_modelopt, None, device="hip", capability=(9, 4)) == "petit_nvfp4"


def test_marlin_conversion_only_with_marlin_kernels():
    awq = {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True}
    assert verify_quantization(awq, None) == "awq"
    assert verify_quantization(awq, None, marlin_kernels=True) == "awq_marlin"
    assert verify_quantization(awq, None, device="hip", capability=(9, 4), marlin_kernels=True) == "awq"


def test_nvfp4_moe_meta_and_fp4_experts():
    qc = {"quant_method": "modelopt", "quant_algo": "MIXED_PRECISION", "moe_quant_algo": "NVFP4",
          "group_size": 16, "ignore": ["lm_head"]}
    m = facts(quantization_config=qc)
    assert m.nvfp4_moe_meta["group_size"] == 16
    assert list(m.nvfp4_moe_meta["exclude_modules"]) == ["lm_head"]
    assert facts().nvfp4_moe_meta is None
    routed = dict(DSV3, quantization_config=dict(DSV3["quantization_config"], routed_experts_quant_method="mxfp4"))
    assert ModelFacts.from_hf_config(routed).is_fp4_experts
    assert not ModelFacts.from_hf_config(DSV3).is_fp4_experts
    assert ModelFacts.from_hf_config({"architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4"}).is_fp4_experts


# --- context length --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "rope, expected",
    [
        ({"rope_scaling": {"type": "linear", "factor": 4.0}}, 4 * 131072),
        ({"rope_scaling": {"type": "yarn", "factor": 4.0}}, 131072),  # transformers adds the original length
        ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, 131072),
        ({"rope_scaling": {"type": "dynamic", "factor": 2.0, "original_max_position_embeddings": 8192}}, 131072),
        ({"rope_parameters": {"rope_type": "linear", "factor": 2.0}}, 2 * 131072),
        ({"rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 8.0}}}, 131072),
    ],
)
def test_context_length_rope_scaling(rope, expected):
    assert facts(**{"rope_parameters": None, **rope}).context_len == expected


def test_context_length_key_priority_and_default():
    assert facts(seq_length=4096).context_len == 4096
    assert context_length({}) == 2048


def test_context_length_override_check():
    check_context_length(131072, 4096)
    check_context_length(131072, None)
    check_context_length(4096, 8192, allow_longer=True)
    with pytest.raises(Violation, match=r"User-specified context_length \(8192\) is greater than the derived context_length \(4096\)"):
        check_context_length(4096, 8192)


# --- sliding window, sinks, multimodal, embeddings, mamba ----------------------------------------


def test_gpt_oss_hybrid_swa_with_sinks():
    m = ModelFacts.from_hf_config({"architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss"})
    assert m.is_hybrid_swa and m.has_attention_sinks and m.context_len == 131072


def test_hybrid_swa_opt_in_and_mimo_sinks():
    assert facts(is_hybrid_swa=True).is_hybrid_swa and not facts().is_hybrid_swa
    mimo = dict(LLAMA, architectures=["MiMoV2FlashForCausalLM"], model_type="mimo_v2_flash")
    assert ModelFacts.from_hf_config(mimo).is_hybrid_swa
    assert not ModelFacts.from_hf_config(mimo).has_attention_sinks
    assert ModelFacts.from_hf_config(dict(mimo, add_swa_attention_sink_bias=True)).has_attention_sinks


VL_TEXT = {"model_type": "qwen2_5_vl_text", "hidden_size": 2048, "num_attention_heads": 16,
           "num_key_value_heads": 2, "num_hidden_layers": 4, "max_position_embeddings": 128000}


def test_vision_language_model_reads_its_text_config():
    m = ModelFacts.from_hf_config({"architectures": ["Qwen2_5_VLForConditionalGeneration"],
                                   "model_type": "qwen2_5_vl", "text_config": VL_TEXT})
    assert m.is_multimodal and m.multimodal_chunked_prefill and m.context_len == 128000
    assert m.total_num_kv_heads == 2 and m.text("num_attention_heads") == 16
    assert m.get("num_hidden_layers") == 4  # mirrored onto the top level, as SGLang's loader does


def test_multimodal_off_by_default_and_language_model_only():
    gemma3 = ModelFacts.from_hf_config({"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
                                        "text_config": dict(VL_TEXT, model_type="gemma3_text")})
    assert not gemma3.multimodal_default_enabled and gemma3.multimodal_capable
    assert not gemma3.is_multimodal and not gemma3.multimodal_chunked_prefill
    lm_only = ModelFacts.from_hf_config({"architectures": ["Qwen2_5_VLForConditionalGeneration"],
                                         "language_model_only": True, "text_config": VL_TEXT})
    assert not lm_only.is_multimodal


def test_multimodal_chunked_prefill_unsupported_arch():
    m = ModelFacts.from_hf_config({"architectures": ["MllamaForConditionalGeneration"], "model_type": "mllama",
                                   "text_config": VL_TEXT})
    assert m.is_multimodal and not m.multimodal_chunked_prefill and m.is_encoder_decoder


def test_embedding_architectures():
    bert = ModelFacts.from_hf_config({"architectures": ["BertModel"], "model_type": "bert", "hidden_size": 768,
                                      "num_attention_heads": 12})
    assert bert.auto_enable_embedding and not bert.is_generation
    gemma = ModelFacts.from_hf_config({"architectures": ["Gemma3TextModel"], "model_type": "gemma3_text",
                                       "use_bidirectional_attention": True, "hidden_size": 768,
                                       "num_attention_heads": 3})
    assert gemma.is_embedding_gemma and gemma.auto_enable_embedding and not gemma.is_generation
    cls = facts(architectures=["Qwen3ForSequenceClassification"])
    assert not cls.auto_enable_embedding and not cls.is_generation
    assert facts().is_generation and not facts().auto_enable_embedding


def test_mamba_radix_cache_architectures():
    assert facts(architectures=["Qwen3NextForCausalLM"]).uses_mamba_radix_cache
    granite = dict(LLAMA, architectures=["GraniteMoeHybridForCausalLM"])
    assert ModelFacts.from_hf_config(dict(granite, layer_types=["mamba", "attention"])).uses_mamba_radix_cache
    assert not ModelFacts.from_hf_config(dict(granite, layer_types=["attention"])).uses_mamba_radix_cache
    assert not facts().uses_mamba_radix_cache


def test_graph_capability_facts():
    assert facts(architectures=["Qwen3NextForCausalLM"]).piecewise_graph_disabled_arch
    kimi = facts(architectures=["KimiK25ForConditionalGeneration"])
    assert kimi.multimodal_piecewise_graph_arch and kimi.multimodal_breakable_graph_arch
    assert not facts().piecewise_graph_disabled_arch


# --- reading config.json ---------------------------------------------------------------------


def test_from_path_reads_a_model_directory(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(LLAMA))
    assert ModelFacts.from_path(tmp_path).architecture == "LlamaForCausalLM"


@pytest.mark.parametrize("text, message", [("{not json", "not valid JSON"), ("[1, 2]", "must hold a JSON object")])
def test_bad_config_json_is_a_model_config_error(tmp_path, text, message):
    (tmp_path / "config.json").write_text(text)
    with pytest.raises(ModelConfigError, match=message):
        ModelFacts.from_path(tmp_path)


def test_missing_config_json(tmp_path):
    with pytest.raises(ModelConfigError, match="no such file"):
        ModelFacts.from_path(tmp_path)
    with pytest.raises(ModelConfigError, match="JSON object"):
        ModelFacts.from_hf_config(["not", "a", "dict"])


def test_multimodal_flags_helpers():
    from flotilla.resolution.model_derive import is_multimodal, multimodal_chunked_prefill_supported

    gemma3 = ModelFacts.from_hf_config({"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
                                        "text_config": dict(VL_TEXT, model_type="gemma3_text"), "vision_config": {}})
    assert not is_multimodal(gemma3, None, "auto")
    assert is_multimodal(gemma3, True, "auto") and is_multimodal(gemma3, None, "transformers")
    assert multimodal_chunked_prefill_supported(gemma3, True) and not multimodal_chunked_prefill_supported(gemma3, None)
    text_only_with_tower = facts(vision_config={"depth": 1})
    assert not is_multimodal(text_only_with_tower, None) and is_multimodal(text_only_with_tower, None, "transformers")
    assert not is_multimodal(facts(), True)
