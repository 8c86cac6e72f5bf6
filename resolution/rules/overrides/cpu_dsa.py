"""flotilla's deviation from the seeds for DeepSeek sparse attention (DSA) on the ``cpu`` platform.

The seeds reach DSA's kv-cache dtype pass on a CPU and crash there (SGLang reads the CUDA device
capability: "Torch not compiled with CUDA enabled"). flotilla's runtime runs DSA on its torch
reference (``flotilla.kernels.dsa``), so on the ``cpu`` platform a DSA model resolves to it: the
prefill, decode and top-k backends are ``torch`` (where the user left them unset), the seeds'
GPU-only DSA passes (kv-cache dtype, split backends) are skipped, and the kv-cache dtype stays as
given. Every other platform keeps the seeds' rules and messages (docs/resolution.md, "Where
flotilla deviates from the seeds").
"""

from __future__ import annotations

from flotilla.resolution.engine import rule
from flotilla.resolution.rules.overrides.support import DEEPSEEK_BRANCH_ARCHS, is_deepseek_dsa

TORCH_DSA = "torch"


def reference_dsa_platform(model, platform) -> bool:
    """A DSA model on the ``cpu`` platform: flotilla's torch reference serves it."""
    return platform.is_cpu and model.architecture in DEEPSEEK_BRANCH_ARCHS and is_deepseek_dsa(model)


@rule("_flotilla_cpu_reference_dsa")
def cpu_reference_dsa(view, model, platform):
    """On the cpu platform DSA runs flotilla's torch reference: torch prefill, decode and top-k
    backends (a deviation: the seeds crash on a CPU, see the module docstring)."""
    if not reference_dsa_platform(model, platform):
        return None
    declared = {}
    for name in ("dsa_prefill_backend", "dsa_decode_backend"):
        if getattr(view, name) is None:
            declared[name] = TORCH_DSA
    if not view.explicit("dsa_topk_backend"):
        declared["dsa_topk_backend"] = TORCH_DSA
    return declared
