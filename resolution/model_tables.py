"""Architecture tables and transformers class defaults behind the derived model facts.

The architecture sets mirror SGLang 0.5.19's ``configs/model_config.py`` lists
and the mamba radix-cache architecture set of ``arg_groups/overrides.py``;
:data:`CLASS_DEFAULTS` holds the transformers 5.x class defaults the
derivations read when a config omits the key.
"""

from __future__ import annotations

from typing import Any

# transformers class defaults (5.x) for the keys derivations read, per model_type.
_DEEPSEEK_DEFAULTS = {
    "hidden_size": 7168, "num_attention_heads": 128, "num_key_value_heads": 128,
    "num_hidden_layers": 61, "max_position_embeddings": 4096, "kv_lora_rank": 512,
    "qk_rope_head_dim": 64, "qk_nope_head_dim": 128, "v_head_dim": 128,
}
CLASS_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {"hidden_size": 4096, "num_attention_heads": 32, "num_hidden_layers": 32,
              "max_position_embeddings": 2048},
    "mistral": {"hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 8,
                "num_hidden_layers": 32, "max_position_embeddings": 131072, "sliding_window": 4096},
    "qwen2": {"hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 32,
              "num_hidden_layers": 32, "max_position_embeddings": 32768},
    "qwen3": {"hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 32,
              "num_hidden_layers": 32, "max_position_embeddings": 32768, "head_dim": 128},
    "qwen3_moe": {"hidden_size": 2048, "num_attention_heads": 32, "num_key_value_heads": 4,
                  "num_hidden_layers": 24, "max_position_embeddings": 32768},
    "deepseek_v2": {**{k: v for k, v in _DEEPSEEK_DEFAULTS.items() if k != "num_key_value_heads"},
                    "hidden_size": 4096, "num_attention_heads": 32, "num_hidden_layers": 32,
                    "max_position_embeddings": 2048},
    "deepseek_v3": _DEEPSEEK_DEFAULTS,
    "deepseek_v32": _DEEPSEEK_DEFAULTS,
    "kimi_k2": _DEEPSEEK_DEFAULTS,
    "glm_moe_dsa": {
        "hidden_size": 6144, "num_attention_heads": 64, "num_key_value_heads": 64,
        "num_hidden_layers": 78, "max_position_embeddings": 202752, "kv_lora_rank": 512,
        "qk_rope_head_dim": 64, "qk_nope_head_dim": 192, "v_head_dim": 256,
        "index_topk": 2048, "index_head_dim": 128, "index_n_heads": 32,
    },
    "gpt_oss": {"hidden_size": 2880, "num_attention_heads": 64, "num_key_value_heads": 8,
                "num_hidden_layers": 36, "max_position_embeddings": 131072, "head_dim": 64,
                "sliding_window": 128},
}

# Architectures whose attention is multi-head latent attention (use_mla_backend).
MLA_ARCHS = frozenset({
    "DeepseekV2ForCausalLM", "DeepseekV32ForCausalLM", "DeepseekV3ForCausalLM",
    "DeepseekV3ForCausalLMNextN", "Glm4MoeLiteForCausalLM", "Glm4MoeLiteForCausalLMNextN",
    "GlmMoeDsaForCausalLM", "GlmMoeDsaForCausalLMNextN", "LongcatFlashForCausalLM",
    "LongcatFlashForCausalLMNextN", "DotsVLMForCausalLM", "Dots3NoteForCausalLM",
    "Dots3NoteForCausalLMNextN", "MistralLarge3ForCausalLM", "MistralLarge3ForCausalLMEagle",
    "KimiK25ForConditionalGeneration", "Eagle3DeepseekV2ForCausalLM",
})
DEEPSEEK_V4_ARCHS = ("DeepseekV4ForCausalLM", "DeepseekV4ForCausalLMNextN", "DeepseekV4ForCausalLMDSpark")
KIMI_LINEAR_ARCHS = ("KimiLinearForCausalLM", "KimiK3LinearForCausalLM", "KimiK3ForConditionalGeneration")
DSA_ARCHS = frozenset({
    "DeepseekV3ForCausalLM", "DeepseekV32ForCausalLM", "DeepseekV3ForCausalLMNextN",
    "MistralLarge3ForCausalLM", "PixtralForConditionalGeneration", "GlmMoeDsaForCausalLM",
    "GlmMoeDsaForCausalLMNextN", "LongcatFlashForCausalLM", "LongcatFlashForCausalLMNextN",
    "Dots3NoteForCausalLM", "Dots3NoteForCausalLMNextN",
})

MIMO_V2_ARCHS = ("MiMoV2ForCausalLM", "MiMoV2FlashForCausalLM")
SWA_SINK_ARCHS = frozenset({"GptOssForCausalLM", "GraniteSWAForCausalLM", "GraniteMoeSWAForCausalLM"})
HYBRID_SWA_ARCHS = frozenset({
    "Llama4ForConditionalGeneration", *DEEPSEEK_V4_ARCHS, *SWA_SINK_ARCHS, *MIMO_V2_ARCHS,
    "MiMoV2MTP", "Step3p5ForCausalLM", "Step3p5MTP", "Step3p7ForConditionalGeneration",
    "Gemma4ForCausalLM", "Gemma4ForConditionalGeneration", "Gemma4UnifiedForConditionalGeneration",
    "LagunaForCausalLM", "MellumForCausalLM", "MuseGlimmerForCausalLM",
    "MuseGlimmerForConditionalGeneration", "InklingForConditionalGeneration",
    "InklingForConditionalGenerationMTP", "UnlimitedOCRForCausalLM",
})

MULTIMODAL_ARCHS = frozenset({
    "CLIPModel", "Cohere2VisionForConditionalGeneration", "DeepseekVL2ForCausalLM",
    "Ernie4_5_VLMoeForConditionalGeneration", "MiniMaxM3SparseForConditionalGeneration",
    "Gemma3ForConditionalGeneration", "Gemma3nForConditionalGeneration",
    "Gemma4ForConditionalGeneration", "Gemma4UnifiedForConditionalGeneration",
    "Glm4vForConditionalGeneration", "Glm4vMoeForConditionalGeneration",
    "GlmOcrForConditionalGeneration", "GlmAsrForConditionalGeneration",
    "GlmImageForConditionalGeneration", "Grok1VForCausalLM", "Grok1AForCausalLM",
    "LlavaLlamaForCausalLM", "Llama4ForConditionalGeneration", "LlavaMistralForCausalLM",
    "LlavaQwenForCausalLM", "LlavaForConditionalGeneration", "LlavaVidForCausalLM",
    "Lfm2VlForConditionalGeneration", "LightOnOCRForConditionalGeneration", "MiMoV2ForCausalLM",
    "MiMoV2ASRForCausalLM", "MiniCPMO", "MiniCPMV", "Mistral3ForConditionalGeneration",
    "MultiModalityCausalLM", "MllamaForConditionalGeneration", "MossVLForConditionalGeneration",
    "NemotronH_Nano_VL_V2", "NemotronH_Nano_Omni_Reasoning_V3",
    "MuseGlimmerForConditionalGeneration", "PixtralForConditionalGeneration",
    "Qwen2AudioForConditionalGeneration", "Qwen2VLForConditionalGeneration",
    "Qwen2_5_VLForConditionalGeneration", "Qwen3VLForConditionalGeneration",
    "Qwen3VLMoeForConditionalGeneration", "Qwen3_5ForConditionalGeneration",
    "Qwen3_5MoeForConditionalGeneration", "InternS2PreviewForConditionalGeneration",
    "InternS2MobiusForConditionalGeneration", "Qwen3ASRForConditionalGeneration",
    "Qwen3OmniMoeForConditionalGeneration", "KimiVLForConditionalGeneration",
    "LocateAnythingForConditionalGeneration", "InternVLChatModel",
    "InternS1ForConditionalGeneration", "InternS1ProForConditionalGeneration",
    "Phi4MMForCausalLM", "VoxtralForConditionalGeneration", "WhisperForConditionalGeneration",
    "Step3VLForConditionalGeneration", "POINTSV15ChatModel", "DotsVLMForCausalLM",
    "Dots3NoteForCausalLM", "DotsOCRForCausalLM", "Sarashina2VisionForCausalLM",
    "NVILAForConditionalGeneration", "NVILALiteForConditionalGeneration",
    "DeepseekOCRForCausalLM", "UnlimitedOCRForCausalLM", "JetVLMForConditionalGeneration",
    "PaddleOCRVLForConditionalGeneration", "MiDashengLMModel", "StepVLForConditionalGeneration",
    "Step3p7ForConditionalGeneration", "KimiK25ForConditionalGeneration",
})
# Multimodal models that are served text-only unless --enable-multimodal is given.
MULTIMODAL_OFF_BY_DEFAULT = frozenset({
    "Gemma3ForConditionalGeneration", "Llama4ForConditionalGeneration",
    "Step3VLForConditionalGeneration", "InklingForConditionalGeneration",
})
NO_MM_CHUNKED_PREFILL = frozenset({
    "Grok1VForCausalLM", "Grok1AForCausalLM", "LlavaLlamaForCausalLM",
    "MllamaForConditionalGeneration", "MossVLForConditionalGeneration", "CLIPModel",
})
PIECEWISE_GRAPH_DISABLED = frozenset({*DEEPSEEK_V4_ARCHS, "Qwen3NextForCausalLM", "BailingMoeV2_5ForCausalLM", "LLaDAModelLM"})
MM_PIECEWISE_GRAPH_OK = frozenset({
    "KimiK25ForConditionalGeneration", "MiniMaxM3SparseForCausalLM", "MiniMaxM3SparseForConditionalGeneration",
})
MM_BREAKABLE_GRAPH_OK = frozenset({
    "Cohere2VisionForConditionalGeneration", "InternS2MobiusForConditionalGeneration",
    "PaddleOCRVLForConditionalGeneration", "Qwen3_5ForConditionalGeneration",
    "Qwen3_5MoeForConditionalGeneration", "MuseGlimmerForConditionalGeneration",
    "KimiK3ForConditionalGeneration", "KimiK25ForConditionalGeneration",
})
ENCODER_DECODER_ARCHS = frozenset({"WhisperForConditionalGeneration", "MllamaForConditionalGeneration", "MossVLForConditionalGeneration"})
NON_GENERATION_ARCHS = frozenset({
    "LlamaEmbeddingModel", "MistralModel", "LlamaForSequenceClassification",
    "LlamaForSequenceClassificationWithNormal_Weights", "InternLM2ForRewardModel",
    "Qwen2ForRewardModel", "Qwen3ForRewardModel", "Qwen2ForSequenceClassification",
    "Qwen3ForSequenceClassification", "Qwen3Model", "CLIPModel", "BertModel", "Contriever",
    "BertForSequenceClassification", "XLMRobertaModel", "XLMRobertaForSequenceClassification",
    "Gemma2ForSequenceClassification", "Lfm2BidirectionalModel",
})
# Architectures that are embedding-only: serving them turns embedding mode on.
EMBEDDING_ARCHS = frozenset({"BertModel", "CLIPModel", "Contriever", "LlamaEmbeddingModel", "MistralModel", "XLMRobertaModel"})
CLASSIFICATION_ARCHS = frozenset({
    "BertForSequenceClassification", "LlamaForSequenceClassification",
    "LlamaForSequenceClassificationWithNormal_Weights", "Qwen2ForSequenceClassification",
    "Qwen3ForSequenceClassification", "XLMRobertaForSequenceClassification",
})

# Hybrid linear-attention models whose prefix caching runs through the mamba radix cache.
MAMBA_RADIX_CACHE_ARCHS = frozenset({
    "KimiLinearForCausalLM", "KimiK3ForConditionalGeneration", "BailingMoeV2_5ForCausalLM",
    "BailingMoeV3ForCausalLM", "Qwen3NextForCausalLM", "Qwen3_5MoeForConditionalGeneration",
    "InternS2PreviewForConditionalGeneration", "InternS2MobiusForConditionalGeneration",
    "Qwen3_5ForConditionalGeneration", "Qwen3_5MoeForCausalLM", "Qwen3_5ForCausalLM",
    "MiniCPMV4_6ForConditionalGeneration", "NemotronHForCausalLM", "NemotronHPuzzleForCausalLM",
    "FalconH1ForCausalLM", "JetNemotronForCausalLM", "JetVLMForConditionalGeneration",
    "Lfm2ForCausalLM", "Lfm2MoeForCausalLM", "ZayaForCausalLM",
})
