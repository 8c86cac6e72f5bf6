"""Model-override providers: Qwen3-VL (dense).

not ported: the info log line (logging only).
"""

from __future__ import annotations

from flotilla.resolution.rules.common import env_flag
from flotilla.resolution.rules.overrides.registry import provider

_AITER_UNIFIED_ATTN_PAGE_SIZE = 16


@provider("Qwen3VLForConditionalGeneration")
def _qwen3vl_overrides(view, model, platform):
    """On ROCm with aiter unified attention (SGLANG_USE_AITER_UNIFIED_ATTN) Qwen3-VL uses 16-token pages."""
    if platform.is_hip and env_flag(view, "SGLANG_USE_AITER_UNIFIED_ATTN") and view.page_size is None:
        return {"page_size": _AITER_UNIFIED_ATTN_PAGE_SIZE}
    return {}
