"""GLM-5.x behaviour from SGLang PR 29580 (GLM DSA serving on SM120, RTX PRO
6000) that SGLang 0.5.19's server-argument resolution does not carry:

- the decode CUDA-graph batch cap (256) for GLM DSA on SM120, whose 96 GB
  cards run out of memory capturing the default 512;
- shared-expert fusion disabled for ModelOpt FP4 GLM checkpoints that keep
  their shared experts out of quantization (SGLang decides this at model load;
  flotilla resolves it once, here).

The flashinfer_sparse_mla DSA backends the PR adds are part of
``_dsa_split_backend_resolution``; the top-k sharing pattern it derives from
``indexer_types`` is a model fact (``ModelFacts.index_topk_pattern``).

not ported: the PR's automatic mem_fraction_static cap (no value is given).
"""

from __future__ import annotations

from flotilla.resolution.engine import rule
from flotilla.resolution.rules.overrides.support import (
    decode_graph_disabled,
    is_deepseek_dsa,
    is_locked,
    phase_settings,
    with_phase,
)

GLM_DSA_SM120_DECODE_MAX_BS = 256
_GLM_MOE_ARCHS = ("GlmMoeDsaForCausalLM", "Glm4MoeForCausalLM")


def _user_sized_decode_graph(view) -> bool:
    return is_locked(view, "decode", "max_bs") or is_locked(view, "decode", "bs")


@rule("_apply_glm_dsa_sm120_cuda_graph_memory_defaults", overrides=("cuda_graph_config",))
def glm_dsa_sm120_decode_graph_cap(view, model, platform):
    """GLM DSA on SM120 captures decode CUDA graphs up to batch 256 (512 OOMs on
    96 GB cards) unless the user sized them; from PR 29580, not in SGLang 0.5.19."""
    if not (
        model.architecture == "GlmMoeDsaForCausalLM"
        and is_deepseek_dsa(model)
        and platform.is_cuda
        and platform.capability_major == 12
    ):
        return None
    if decode_graph_disabled(view) or _user_sized_decode_graph(view):
        return None
    decode = phase_settings(view.cuda_graph_config, "decode")
    max_bs = decode.get("max_bs")
    if max_bs is None:
        return {"cuda_graph_max_bs_decode": GLM_DSA_SM120_DECODE_MAX_BS}
    if max_bs <= GLM_DSA_SM120_DECODE_MAX_BS:
        return None
    capped: dict = {"max_bs": GLM_DSA_SM120_DECODE_MAX_BS}
    if decode.get("bs") is not None:
        capped["bs"] = [bs for bs in decode["bs"] if bs <= GLM_DSA_SM120_DECODE_MAX_BS]
    return {"cuda_graph_config": with_phase(view.cuda_graph_config, "decode", **capped)}


def modelopt_fp4_excludes_shared_experts(model) -> bool:
    """The checkpoint's quantization config leaves the shared experts unquantized
    (an ``exclude_modules`` / ``ignore`` entry names ``shared_experts``)."""
    qc = model.quantization_config or {}
    excluded = list(qc.get("exclude_modules") or ()) + list(qc.get("ignore") or ())
    return any("shared_experts" in str(pattern) for pattern in excluded)


def glm_shared_experts_unfusable(model, quantization: str | None) -> bool:
    """Whether a GLM MoE checkpoint's shared experts cannot be fused into the FP4
    routed-expert slots: ModelOpt FP4 with the shared experts left unquantized
    (PR 29580).

    NOTE: this is a load-time decision, as in the PR (which made it in the GLM
    model code, not in the server arguments): the model loader consults it, and
    resolution leaves ``disable_shared_experts_fusion`` as the reference resolves
    it. ``quantization`` is the resolved ``quantization`` field.
    """
    if model.architecture not in _GLM_MOE_ARCHS:
        return False
    if (quantization or model.quantization) != "modelopt_fp4":
        return False
    return modelopt_fp4_excludes_shared_experts(model)
