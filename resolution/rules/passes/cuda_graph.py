"""The DeepSeek trtllm_mla prefill-graph default (SGLang's
``disable_prefill_cuda_graph_for_deepseek_trtllm_mla``), plus the one
CUDA-graph edit the passes make: switching phases off.

``cuda_graph_config`` belongs to the normalise phase; reads and edits go
through its helpers (``rules.normalise.cuda_graph``).
"""

from __future__ import annotations

from typing import Any

from flotilla.resolution.engine import rule
from flotilla.resolution.frozen import freeze
from flotilla.resolution.rules.common import attention_backends
from flotilla.resolution.rules.normalise.cuda_graph import (
    DECODE,
    DISABLED,
    PREFILL,
    is_locked,
    prefill_graph_disabled,
    with_phase,
)

__all__ = ["DECODE", "PREFILL", "with_phases_disabled"]


def with_phases_disabled(config: Any, *phases: str) -> Any:
    """A frozen copy of ``config`` with the CUDA graphs of ``phases`` switched off."""
    for phase in phases:
        config = with_phase(config, phase, backend=DISABLED)
    return freeze(config)


@rule(
    "_disable_prefill_cuda_graph_for_deepseek_trtllm_mla",
    overrides=("cuda_graph_config",),
)
def _disable_prefill_cuda_graph_for_deepseek_trtllm_mla(view, model, platform):
    """DeepSeek-V3 on trtllm_mla prefill gets no prefill CUDA graph: a captured
    prefill graph forces a slower FlashAttention fallback.

    Runs after the attention backend is final; a prefill graph backend the user
    chose is left alone.
    """
    if is_locked(view, PREFILL, "backend") or prefill_graph_disabled(view):
        return None
    if "DeepseekV3ForCausalLM" not in model.architectures:
        return None
    prefill, _ = attention_backends(view)
    if prefill != "trtllm_mla":
        return None
    return {"cuda_graph_config": with_phases_disabled(view.cuda_graph_config, PREFILL)}
