"""The validate phase: late checks and capability adjustments (SGLang 0.5.19's
pipeline tail). Expected values were checked against the reference oracle."""

import pytest

from flotilla.resolution import ModelFacts, ServerArgs, preset, resolve
from flotilla.resolution.errors import ResolutionError
from flotilla.resolution.rules.validate import STEPS
from helpers.resolution_configs import LLAMA_SHAPE

LLAMA = {**LLAMA_SHAPE, "num_hidden_layers": 4, "vocab_size": 1000, "max_position_embeddings": 131072}
SDAR = dict(LLAMA, architectures=["SDARForCausalLM"], model_type="qwen3", head_dim=128, max_position_embeddings=32768)
HRM = dict(LLAMA, architectures=["HrmTextForCausalLM"])
BERT = {"architectures": ["BertModel"], "model_type": "bert", "hidden_size": 768, "num_attention_heads": 12,
        "num_hidden_layers": 2, "max_position_embeddings": 512, "vocab_size": 1000}
EMBEDDING_GEMMA = {"architectures": ["Gemma3TextModel"], "model_type": "gemma3_text", "use_bidirectional_attention": True,
                   "hidden_size": 768, "num_attention_heads": 3, "num_key_value_heads": 1, "head_dim": 256,
                   "num_hidden_layers": 4, "max_position_embeddings": 2048, "vocab_size": 1000}
VL_TEXT = {"model_type": "qwen2_5_vl_text", "hidden_size": 2048, "num_attention_heads": 16, "num_key_value_heads": 2,
           "num_hidden_layers": 4, "max_position_embeddings": 128000, "vocab_size": 1000}
QWEN_VL = {"architectures": ["Qwen2_5_VLForConditionalGeneration"], "model_type": "qwen2_5_vl",
           "text_config": VL_TEXT, "vision_config": {"depth": 2}}
MLLAMA = {"architectures": ["MllamaForConditionalGeneration"], "model_type": "mllama",
          "text_config": dict(VL_TEXT, model_type="mllama_text_model"), "vision_config": {}}
DSV3 = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "hidden_size": 7168,
    "num_attention_heads": 128, "num_key_value_heads": 128, "num_hidden_layers": 61, "kv_lora_rank": 512,
    "qk_rope_head_dim": 64, "qk_nope_head_dim": 128, "v_head_dim": 128, "max_position_embeddings": 163840,
    "n_routed_experts": 256, "num_experts_per_tok": 8, "n_shared_experts": 1, "first_k_dense_replace": 3,
    "vocab_size": 129280, "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]},
}


def run(config, platform, *flags):
    args = ServerArgs.from_cli(["--model-path", "/models/m", *flags])
    return resolve(args, ModelFacts.from_hf_config(config), preset(platform))


def rejected(config, platform, *flags) -> str:
    with pytest.raises(ResolutionError) as info:
        run(config, platform, *flags)
    return str(info.value)


def graphs(resolved):
    config = resolved.cuda_graph_config
    return config["decode"]["backend"], config["prefill"]["backend"]


def test_steps_are_named_after_their_sglang_sources():
    names = [step.name for step in STEPS]
    assert names[:2] == ["_gguf_quantization", "_handle_load_format"]
    assert names.index("_dllm_attention_backend") < names.index("_dllm_page_size") < names.index("_handle_other_validations")
    assert names[-2:] == ["validate_deepep_v2_speculative_draft", "validate_deepep_v2_dispatch_token_budget"]


# --- diffusion LLMs ----------------------------------------------------------------------------


def test_dllm_on_hopper_uses_flashinfer_block_pages_and_no_overlap():
    r = run(SDAR, "h100", "--dllm-algorithm", "LowConfidence")
    assert (r.attention_backend, r.page_size, r.disable_overlap_schedule) == ("flashinfer", 4, True)


def test_dllm_without_decode_graphs_keeps_the_default_backend():
    r = run(SDAR, "h100", "--dllm-algorithm", "LowConfidence", "--disable-cuda-graph")
    assert (r.attention_backend, r.page_size) == ("fa3", 4)


def test_dllm_page_size_is_capped_at_the_block_size_and_kept_when_radix_is_off():
    assert run(SDAR, "h100", "--dllm-algorithm", "LowConfidence", "--attention-backend", "triton",
               "--page-size", "16").page_size == 4
    assert run(SDAR, "h100", "--dllm-algorithm", "LowConfidence", "--disable-radix-cache",
               "--page-size", "2").page_size == 2


def test_dllm_on_rocm_runs_eagerly_on_its_own_backends():
    r = run(SDAR, "mi300x", "--dllm-algorithm", "LowConfidence")
    assert r.attention_backend == "aiter" and graphs(r) == ("disabled", "disabled")
    forced = run(SDAR, "mi300x", "--dllm-algorithm", "LowConfidence", "--attention-backend", "flashinfer")
    assert forced.attention_backend == "triton"


def test_dllm_turns_off_unsupported_features():
    r = run(SDAR, "h100", "--dllm-algorithm", "LowConfidence", "--pp-size", "2", "--enable-lora",
            "--enable-mixed-chunk", "--enable-hierarchical-cache")
    assert (r.pp_size, r.enable_lora, r.enable_mixed_chunk, r.enable_hierarchical_cache) == (1, False, False, False)


def test_dllm_rejects_an_unknown_architecture():
    assert "Unknown diffusion LLM: LlamaForCausalLM" in rejected(LLAMA, "h100", "--dllm-algorithm", "LowConfidence")


# --- model capability adjustments ---------------------------------------------------------------


def test_hrm_text_forces_triton_and_eager_unchunked_prefill():
    r = run(HRM, "h100", "--attention-backend", "flashinfer")
    assert r.attention_backend == "triton"
    assert (r.chunked_prefill_size, r.disable_radix_cache, r.disable_cuda_graph) == (-1, True, True)
    assert graphs(r) == ("disabled", "disabled")


def test_hrm_text_without_prefix_lm_is_left_alone():
    r = run(dict(HRM, prefix_lm=False), "h100")
    assert r.attention_backend == "fa3" and r.chunked_prefill_size != -1


def test_embedding_architecture_turns_embedding_mode_on():
    assert run(BERT, "h100").is_embedding is True
    assert run(LLAMA, "h100").is_embedding is False


def test_embedding_gemma_on_hopper_skips_the_paged_kv_cache():
    r = run(EMBEDDING_GEMMA, "h100")
    assert (r.is_embedding, r.disable_radix_cache, r.chunked_prefill_size) == (True, True, -1)
    assert r.enable_tokenizer_batch_encode and r.prefill_only_disable_kv_cache
    assert graphs(r) == ("disabled", "breakable")
    assert r.cuda_graph_config["prefill"]["max_bs"] == 16384


def test_embedding_gemma_with_triton_or_on_rocm():
    triton = run(EMBEDDING_GEMMA, "h100", "--attention-backend", "triton")
    assert not triton.prefill_only_disable_kv_cache and graphs(triton) == ("disabled", "breakable")
    rocm = run(EMBEDDING_GEMMA, "mi300x")
    assert not rocm.prefill_only_disable_kv_cache and graphs(rocm) == ("disabled", "disabled")


def test_multimodal_chunked_prefill_is_off_where_unsupported():
    assert run(MLLAMA, "h100").chunked_prefill_size == -1
    assert run(QWEN_VL, "h100").chunked_prefill_size == 8192


# --- serving checks ----------------------------------------------------------------------------


def test_encoder_transfer_backend_is_resolved():
    assert run(LLAMA, "h100").encoder_transfer_backend == "zmq_to_scheduler"
    assert run(QWEN_VL, "h100", "--encoder-only").encoder_transfer_backend == "zmq_to_scheduler"


@pytest.mark.parametrize(
    "config, flags, message",
    [
        (LLAMA, ["--encoder-only"], "Model type LlamaForCausalLM is not supported for encoder disaggregation."),
        (QWEN_VL, ["--encoder-only", "--language-only"], "Cannot set --encoder-only and --language-only together"),
        (LLAMA, ["--enable-prefix-mm-cache"], "--enable-prefix-mm-cache requires --encoder-only to be enabled"),
        (LLAMA, ["--language-model-only"], "--language-model-only does not support ['LlamaForCausalLM']."),
    ],
)
def test_encoder_disaggregation_rejections(config, flags, message):
    assert message in rejected(config, "h100", *flags)


def test_tokenizer_batching():
    assert "Cannot enable both --enable-tokenizer-batch-encode" in rejected(
        LLAMA, "h100", "--enable-tokenizer-batch-encode", "--enable-dynamic-batch-tokenizer")
    r = run(LLAMA, "h100", "--skip-tokenizer-init", "--detokenizer-worker-num", "4", "--enable-tokenizer-batch-encode")
    assert (r.detokenizer_worker_num, r.enable_tokenizer_batch_encode) == (1, False)


def test_multimodal_feature_transport():
    assert (run(LLAMA, "h100").mm_feature_transport, run(QWEN_VL, "h100").mm_feature_transport) == ("cpu", "cpu")
    kept = run(LLAMA, "h100", "--keep-mm-feature-on-device")
    assert (kept.mm_feature_transport, kept.keep_mm_feature_on_device) == ("cuda_ipc", False)
    assert "--mm-feature-transport=cuda_ipc requires NVIDIA CUDA." in rejected(
        LLAMA, "mi300x", "--mm-feature-transport", "cuda_ipc")


def test_environment_driven_flags():
    assert run(LLAMA, "cpu", "--debug-cuda-graph").debug_cuda_graph is False
    assert run(LLAMA, "h100", "--debug-cuda-graph").debug_cuda_graph is True
    assert "requires SM100 or SM120 GPUs" in rejected(LLAMA, "h100", "--enable-deepseek-v4-fp4-indexer")
    assert run(LLAMA, "b200", "--enable-deepseek-v4-fp4-indexer").enable_deepseek_v4_fp4_indexer


def test_tensor_dump_runs_eagerly_without_warmup():
    r = run(LLAMA, "h100", "--debug-tensor-dump-output-folder", "/tmp/dump")
    assert r.skip_server_warmup and graphs(r) == ("disabled", "disabled")


def test_optimistic_prefill_is_dropped_with_pipeline_parallelism():
    r = run(LLAMA, "h100", "--optimistic-prefill-attempts", "2", "--disaggregation-mode", "prefill", "--pp-size", "2")
    assert r.optimistic_prefill_attempts == 0
    kept = run(LLAMA, "h100", "--optimistic-prefill-attempts", "2", "--disaggregation-mode", "prefill")
    assert kept.optimistic_prefill_attempts == 2


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--default-chat-template-kwargs", "[1]"], "--default-chat-template-kwargs must decode to a JSON object"),
        (["--limit-mm-data-per-request", '{"image": 2, "text": 1}'], "Invalid modality 'text' in --limit-mm-data-per-request."),
        (["--enable-hierarchical-cache", "--disable-radix-cache"], "are mutually exclusive"),
        (["--disaggregation-decode-retraction-backup", "host_pool"], "host_pool is only supported on a PD decode server."),
        (["--disaggregation-decode-enable-offload-kvcache"], "is only supported for decode side."),
        (["--swa-full-tokens-ratio", "1.5"], "--swa-full-tokens-ratio should be in range (0, 1.0]."),
        (["--weight-cache-mode", "client", "--speculative-algorithm", "NGRAM"], "--weight-cache-mode is not supported together"),
    ],
)
def test_flag_combination_rejections(flags, message):
    assert message in rejected(LLAMA, "h100", *flags)


# --- loading format ----------------------------------------------------------------------------


def test_load_format_defaults_and_remote_instance_fallback():
    r = run(LLAMA, "h100")
    assert (r.load_format, list(r.custom_weight_loader), r.quantization) == ("auto", [], None)
    assert run(LLAMA, "h100", "--load-format", "remote_instance").load_format == "auto"


def test_gguf_model_path_selects_gguf_loading():
    args = ServerArgs.from_cli(["--model-path", "/models/llama-q4.gguf"])
    r = resolve(args, ModelFacts.from_hf_config(LLAMA), preset("h100"))
    assert (r.load_format, r.quantization) == ("gguf", "gguf")


# --- unified memory / page-major layout ----------------------------------------------------------


def test_unified_memory_implies_page_major_layout_and_decode_only_graphs():
    r = run(LLAMA, "b200", "--enable-unified-memory")
    assert r.enable_page_major_kv_layout and graphs(r) == ("full", "disabled")


def test_unified_memory_rejections():
    assert "--enable-page-major-kv-layout without --enable-unified-memory" in rejected(
        LLAMA, "h100", "--enable-page-major-kv-layout")
    assert "supports decode cuda-graph capture only" in rejected(
        LLAMA, "b200", "--enable-unified-memory", "--cuda-graph-backend-prefill", "breakable")
    assert "not yet compatible with hierarchical" in rejected(
        LLAMA, "h100", "--enable-unified-memory", "--enable-hierarchical-cache")


def test_unified_memory_needs_uniform_kv_rows_for_mha_models():
    asym = dict(LLAMA, head_dim=128, v_head_dim=64)
    assert "requires uniform K/V rows" in rejected(asym, "h100", "--enable-unified-memory", "--attention-backend", "triton")


# --- DeepEP v2 ---------------------------------------------------------------------------------


def test_deepep_v2_dispatch_budget():
    message = rejected(DSV3, "b200", "--tp", "8", "--ep", "8", "--moe-a2a-backend", "deepep_v2")
    assert "DeepEP v2 per-rank prefill budget exceeds" in message and "capacity=128" in message
    r = run(DSV3, "b200", "--tp", "8", "--ep", "8", "--moe-a2a-backend", "deepep_v2",
            "--chunked-prefill-size", "64", "--cuda-graph-max-bs", "16")
    assert r.moe_a2a_backend == "deepep_v2"


def test_deepep_v2_is_not_a_speculative_draft_backend():
    message = rejected(DSV3, "b200", "--tp", "8", "--ep", "8", "--moe-a2a-backend", "deepep",
                       "--speculative-algorithm", "EAGLE", "--speculative-moe-a2a-backend", "deepep_v2")
    assert "DeepEP v2 MoE is not validated as a speculative draft backend." in message
