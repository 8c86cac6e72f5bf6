"""Model-override providers: MOSS-VL.

not ported: the info log line (logging only).
"""

from __future__ import annotations

from flotilla.resolution.engine import ensure
from flotilla.resolution.rules.common import attention_backend_not_set, attention_backends
from flotilla.resolution.rules.overrides.registry import provider


@provider("MossVLForConditionalGeneration")
def _moss_vl_overrides(view, model, platform):
    """MOSS-VL needs flashinfer prefill attention (cross-attention custom masks): default it, reject others."""
    declared = {}
    if attention_backend_not_set(view):
        declared["prefill_attention_backend"] = "flashinfer"
    prefill = declared.get("prefill_attention_backend") or attention_backends(view)[0]
    ensure(
        prefill == "flashinfer",
        "MossVLForConditionalGeneration requires flashinfer prefill "
        "attention backend for cross-attention custom mask support.",
    )
    return declared
