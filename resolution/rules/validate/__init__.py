"""Rules of the validate phase, in the order they run (see STEPS).

SGLang 0.5.19's pipeline tail after ``validate_cutedsl_a2a_token_budget``:
model loading format, encoder disaggregation, tokenizer batching, environment-
driven flags, KV-cache compatibility, the unified memory pool, diffusion-LLM
inference, the remaining flag validations, model-capability adjustments and the
DeepEP v2 budget checks.
"""

from flotilla.resolution.rules.validate.capability import (
    embedding_architecture,
    embedding_gemma_graphs,
    embedding_gemma_serving,
    hrm_text_adjustments,
    hrm_text_attention_force,
    multimodal_chunked_prefill,
)
from flotilla.resolution.rules.validate.deepep import (
    validate_deepep_v2_dispatch_token_budget,
    validate_deepep_v2_speculative_draft,
)
from flotilla.resolution.rules.validate.dllm import (
    dllm_attention_backend,
    dllm_overlap_disable,
    dllm_page_size,
    dllm_rocm_graphs,
    dllm_unsupported_features,
)
from flotilla.resolution.rules.validate.kv_cache import (
    handle_cache_compatibility,
    handle_page_major_kv_layout,
    handle_unified_memory_pool,
)
from flotilla.resolution.rules.validate.load_format import gguf_quantization, handle_load_format
from flotilla.resolution.rules.validate.serving import (
    handle_encoder_disaggregation,
    handle_environment_variables,
    handle_multimodal_feature_transport,
    handle_other_validations,
    handle_tokenizer_batching,
)

STEPS: list = [
    # handle_load_format
    gguf_quantization,
    handle_load_format,
    handle_encoder_disaggregation,
    handle_tokenizer_batching,
    # handle_environment_variables (feature transport first, as SGLang calls it)
    handle_multimodal_feature_transport,
    handle_environment_variables,
    handle_cache_compatibility,
    handle_page_major_kv_layout,
    handle_unified_memory_pool,
    # handle_dllm_inference
    dllm_rocm_graphs,
    dllm_attention_backend,
    dllm_overlap_disable,
    dllm_page_size,
    dllm_unsupported_features,
    # handle_crash_dump_env / handle_debug_utils: environment / CI only (not ported)
    handle_other_validations,
    # handle_model_capability_adjustments
    hrm_text_attention_force,
    hrm_text_adjustments,
    embedding_architecture,
    embedding_gemma_serving,
    embedding_gemma_graphs,
    multimodal_chunked_prefill,
    validate_deepep_v2_speculative_draft,
    validate_deepep_v2_dispatch_token_budget,
]
