"""Model-override providers: Inkling.

not ported: the info log line (logging only).
not ported here: Inkling's full-graph prefill CUDA-graph default (SGLang sets it
inline before the CUDA-graph config is parsed, so it belongs to the normalise phase).
"""

from __future__ import annotations

from flotilla.resolution.engine import Env
from flotilla.resolution.rules.common import attention_backend_not_set
from flotilla.resolution.rules.overrides.registry import provider

_INKLING_MEMORY_RATIO = 0.1


@provider(
    "InklingForConditionalGeneration",
    "InklingForConditionalGenerationMTP",
    overrides=("swa_full_tokens_ratio", "mamba_full_memory_ratio", "mamba_radix_cache_strategy"),
)
def _inkling_overrides(view, model, platform):
    """Inkling needs small SWA/mamba pools, extra-buffer mamba, the unified radix tree and fa4/triton attention.

    Each field default yields to a user value other than SGLang's default; the
    attention backend (fa4 on SM100, else triton) only applies when none was chosen.
    """
    declared = {}
    # NOTE: SGLang compares with the class default, so a user value equal to
    # the default is replaced too (hence the fields in ``overrides``).
    if view.swa_full_tokens_ratio == view.default("swa_full_tokens_ratio"):
        declared["swa_full_tokens_ratio"] = _INKLING_MEMORY_RATIO
    if view.mamba_full_memory_ratio == view.default("mamba_full_memory_ratio"):
        declared["mamba_full_memory_ratio"] = _INKLING_MEMORY_RATIO
    if view.mamba_radix_cache_strategy == view.default("mamba_radix_cache_strategy"):
        declared["mamba_radix_cache_strategy"] = "extra_buffer"
    if attention_backend_not_set(view):
        declared["attention_backend"] = "fa4" if platform.is_sm100 else "triton"
    declared[Env("SGLANG_ENABLE_UNIFIED_RADIX_TREE")] = "True"
    return declared
