"""Rules of the normalise phase, in the order they run (see STEPS).

Everything SGLang 0.5.19's resolution pipeline does before the model-specific
adjustments: flag aliases and deprecated spellings, defaults that need no model
knowledge (device, tokenizer path), serving-mode checks, the legacy CP aliases,
DCP/DWDP, the CUDA-graph config, per-device backends and the memory-derived
defaults.

not ported: model source path handling (Hub GGUF references, object-store
downloads, ModelScope): flotilla reads config.json from a local directory.
"""

from flotilla.resolution.rules.normalise import (
    defaults,
    early,
    graph_rules,
    memory,
    platform_defaults,
    serving_modes,
)
from flotilla.resolution.rules.normalise.legacy import handle_legacy_cp_arguments
from flotilla.resolution.rules.normalise.model_config import verify_model_config
from flotilla.resolution.rules.normalise.parallel_early import handle_dcp_validation, handle_dwdp
from flotilla.resolution.rules.normalise.validations import (
    handle_asr_validation,
    handle_multimodal,
    handle_ssl_validation,
    validate_prefill_only_disable_kv_cache_args,
)

STEPS: list = [
    *early.STEPS,
    handle_multimodal,
    handle_ssl_validation,
    handle_asr_validation,
    *defaults.STEPS,
    *serving_modes.STEPS,
    # NOTE: the legacy CP aliases resolve before any validation or model default
    # reads enable_prefill_cp / cp_strategy (the parallel phase re-runs the rule).
    handle_legacy_cp_arguments,
    validate_prefill_only_disable_kv_cache_args,
    handle_dcp_validation,
    # NOTE: SGLang first builds its ModelConfig (context/quantization checks)
    # in the Inkling prefill-graph default, the first rule of this group.
    verify_model_config,
    *graph_rules.STEPS_BEFORE_DWDP,
    # NOTE: DWDP declares disable_cuda_graph, so it precedes the graph config build.
    handle_dwdp,
    *graph_rules.STEPS,
    *platform_defaults.STEPS,
    # NOTE: memory defaults read the final graph config and the per-device choices.
    *memory.STEPS,
]
