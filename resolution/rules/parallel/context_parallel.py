"""Context parallelism: the CP-v2 default and the CP/MoE-DP layout checks
(SGLang's ``handle_context_parallelism``).

not ported: ``init_cp_strategy`` (binds a runtime singleton; its only check,
an unknown ``cp_strategy``, cannot trigger after the ``--cp-strategy`` check and
the flag's choices).
"""

from __future__ import annotations

import re

from flotilla.resolution import model_derive
from flotilla.resolution.engine import ensure, reject, rule
from flotilla.resolution.rules.common import env_flag
from flotilla.resolution.rules.live import Live

# Architectures whose prefill CP runs the v2 code path by default
# (SGLang's ``CP_V2_DEFAULT_MODEL_CLASSES``).
CP_V2_DEFAULT_ARCHITECTURES = frozenset(
    {
        "DeepseekV32ForCausalLM",
        "GlmMoeDsaForCausalLM",
        "GptOssForCausalLM",
        "MiMoV2FlashForCausalLM",
        "MiMoV2ForCausalLM",
        "Qwen3MoeForCausalLM",
        "DeepseekV3ForCausalLM",
    }
)
MIMO_V2_ARCHITECTURES = ("MiMoV2ForCausalLM", "MiMoV2FlashForCausalLM")
CP_V2_ENV = "SGLANG_ENABLE_CP_V2"


def is_instance_connector(model_path) -> bool:
    """The model is loaded through an ``instance://`` connector (no local config)."""
    if not isinstance(model_path, str):
        return False
    match = re.match(r"(.+)://(.*)", model_path)
    return match is not None and match.group(1) == "instance"


def _cp_v2_checks(live: Live, model) -> None:
    """Declare the CP-v2 default for the architectures that have it; MiMo V2 limits."""
    arch = model.architecture
    if arch in CP_V2_DEFAULT_ARCHITECTURES:
        # DSA models run CP v2 only with the interleave strategy.
        wants_v2 = not model.is_dsa or (live.enable_prefill_cp and live.cp_strategy == "interleave")
        if wants_v2 and live.env(CP_V2_ENV) is None:
            live.set_env(CP_V2_ENV, "True")
    if live.enable_prefill_cp and arch in MIMO_V2_ARCHITECTURES and env_flag(live, CP_V2_ENV):
        if live.cp_strategy != "zigzag":
            reject("MiMo V2 CP-v2 only supports --cp-strategy zigzag.")
        multimodal = model_derive.is_multimodal(model, live.enable_multimodal, live.model_impl)
        if multimodal and not live.language_only and not live.language_model_only:
            reject("MiMo V2 CP-v2 only supports text inference; add --language-only.")


def _layout_checks(view) -> None:
    """Attention-CP and MoE-DP sizes must tile the TP world."""
    tp, cp, moe_dp, ep = view.tp_size, view.attn_cp_size, view.moe_dp_size, view.ep_size
    if cp > 1:
        ensure(tp % cp == 0, "tp_size must be divisible by attn_cp_size")
        ensure(tp % (view.dp_size * cp) == 0, "tp_size must be divisible by dp_size * attn_cp_size")
        ensure(
            not view.enable_aiter_allreduce_fusion,
            "Aiter allreduce fusion is not supported with context parallelism",
        )
    if moe_dp > 1:
        ensure(tp % moe_dp == 0, "tp_size must be divisible by moe_dp_size")
        ensure(ep * moe_dp <= tp, "ep_size * moe_dp_size must be less than or equal to tp_size")
        ensure(view.pp_size == 1, "PP is not supported with context parallelism")
        if ep > 1:
            ensure(ep * moe_dp == tp, "ep_size * moe_dp_size must be equal to tp_size")
        ensure(
            not view.enable_aiter_allreduce_fusion,
            "Aiter allreduce fusion is not supported with context parallelism",
        )
    if cp != moe_dp:
        ensure(moe_dp == 1, "attn_cp_size != moe_dp_size is only supported when moe_dp_size == 1")


@rule("handle_context_parallelism")
def handle_context_parallelism(view, model, platform):
    """Prefill CP uses the v2 path by default on its validated architectures; CP flags and sizes must be consistent.

    Declares ``SGLANG_ENABLE_CP_V2=True`` for the CP-v2 default architectures
    (DSA ones only with ``--cp-strategy interleave``) unless it is already set.
    """
    live = Live(view)
    if not is_instance_connector(view.model_path):
        _cp_v2_checks(live, model)
    if view.enable_prefill_cp and view.cp_strategy is None:
        reject("--cp-strategy must be set when --enable-prefill-cp is enabled.")
    if view.enable_prefill_context_parallel and view.enable_dsa_prefill_context_parallel:
        reject(
            "--enable-prefill-context-parallel and "
            "--enable-nsa-prefill-context-parallel are mutually "
            "exclusive. Use --enable-nsa-prefill-context-parallel for "
            "DeepSeek V3.2 (NSA) models and "
            "--enable-prefill-context-parallel for MLA-based models "
            "(DeepSeek V3/R1, Kimi K2.5) or MHA/GQA-based models."
        )
    _layout_checks(view)
    return live.out
