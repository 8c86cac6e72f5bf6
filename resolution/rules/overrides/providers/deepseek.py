"""Model-override provider for the DeepSeek family (V3/R1, V3.2 DSA, GLM-5,
Kimi-K2.5, Mistral Large 3, LongCat, dots3): attention backend, DSA page size,
and the DSA / MLA prefill context-parallel layout.

not ported: the instance-connector early return (no config.json to key on).
"""

from __future__ import annotations

from flotilla.resolution.engine import ensure
from flotilla.resolution.rules.common import attention_backend_not_set
from flotilla.resolution.rules.overrides.registry import provider
from flotilla.resolution.rules.overrides.support import DEEPSEEK_FAMILY_ARCHS, is_deepseek_dsa

_CP_FIELDS = ("enable_dp_attention", "moe_dense_tp_size", "moe_a2a_backend", "ep_size", "attn_cp_size")


def aiter_preshuffle_paged_mqa(platform) -> bool:
    """Whether ROCm's aiter preshuffle paged-MQA path serves the DSA indexer.

    It needs aiter switched on (``SGLANG_USE_AITER``) and Triton >= 3.5 (taken
    to hold wherever aiter is enabled); with aiter off the legacy page-size-1
    path is used.
    """
    return platform.is_hip and platform.aiter_enabled


@provider(*sorted(DEEPSEEK_FAMILY_ARCHS), overrides=("page_size", *_CP_FIELDS))
def _deepseek_family_overrides(view, model, platform):
    """DeepSeek family defaults: dsa/trtllm_mla attention, DSA page size, prefill-CP layout."""
    declared: dict = {}
    if is_deepseek_dsa(model):
        if attention_backend_not_set(view):
            declared["attention_backend"] = "dsa"
        if not platform.is_npu and not platform.is_xpu:
            if view.enable_prefill_cp:
                declared["enable_dp_attention"] = True
                declared["moe_dense_tp_size"] = 1
                if view.cp_strategy == "zigzag":
                    declared["moe_a2a_backend"] = "deepep"
                    declared["ep_size"] = view.tp_size
                else:
                    ensure(view.dp_size == 1, "interleave DSA CP does not support DP attention.")
                ensure(
                    view.tp_size <= 8,
                    "Context parallel only supports single machine (tp_size <= 8). "
                    "Cross-machine CP has precision issues.",
                )
                # NOTE: attention TP stays 1 under DSA CP (attn_cp_size spans the group).
                declared["attn_cp_size"] = view.tp_size // view.dp_size
            declared["page_size"] = 1 if platform.is_hip and not aiter_preshuffle_paged_mqa(platform) else 64
        return declared

    if platform.is_sm100 and attention_backend_not_set(view):
        declared["attention_backend"] = "trtllm_mla"
    if view.enable_prefill_cp and model.is_mla:
        declared.update(
            enable_dp_attention=True,
            moe_dense_tp_size=1,
            moe_a2a_backend="deepep",
            ep_size=view.tp_size,
            attn_cp_size=view.tp_size // view.dp_size,
        )
    return declared
