"""Model-override providers: Intern-S2-Mobius (its MoE runner; the attention
defaults it shares with Qwen3.5 live in qwen3_5)."""

from __future__ import annotations

from flotilla.resolution.rules.overrides.registry import provider


@provider("InternS2MobiusForConditionalGeneration", overrides=("moe_runner_backend",))
def _interns2_mobius_baseline_overrides(view, model, platform):
    """Intern-S2-Mobius uses triton_kernel, the only MoE runner validated for its 2,560 experts."""
    if view.moe_runner_backend == "auto":
        return {"moe_runner_backend": "triton_kernel"}
    return {}
