"""Page sizes the attention backends impose (the page-size passes of SGLang's
``handle_attention_backend_compatibility``).

Each snap only moves ``page_size`` when the backend cannot run the current one;
they run before ``_page_size_default``, so an unset page size counts as
unsupported and takes the backend's size.
"""

from __future__ import annotations

from flotilla.resolution.engine import rule
from flotilla.resolution.rules.common import attention_backends


def _uses(view, backend: str, *, prefill: bool = True) -> bool:
    """``backend`` is the base or decode backend (or the prefill one, when
    ``prefill`` is true)."""
    sides = [view.attention_backend, view.decode_attention_backend]
    if prefill:
        sides.append(view.prefill_attention_backend)
    return backend in sides


@rule("_mla_backend_page_constraints", overrides=("page_size",), whitelist=True)
def _mla_backend_page_constraints(view, model, platform):
    """Page size the MLA/TensorRT-LLM kernel family supports: FlashMLA 64,
    Cutlass MLA 128, TRT-LLM/tokenspeed/CuteDSL MLA 32 or 64, TRT-LLM MHA
    16-128, HPC-Ops 64 (others snap to 64).

    The snaps chain: a later backend's check sees the size an earlier one chose.
    """
    page_size = view.page_size
    if _uses(view, "flashmla", prefill=False):
        page_size = 64
    if _uses(view, "cutlass_mla", prefill=False):
        page_size = 128
    if _uses(view, "trtllm_mla", prefill=False) and page_size not in (32, 64):
        page_size = 64
    if _uses(view, "tokenspeed_mla", prefill=False) and page_size not in (32, 64):
        page_size = 64
    if _uses(view, "cutedsl_mla") and page_size not in (32, 64):
        page_size = 64
    trtllm_mha = _uses(view, "trtllm_mha") or view.speculative_draft_attention_backend == "trtllm_mha"
    if trtllm_mha and page_size not in (16, 32, 64, 128):
        page_size = 64
    if _uses(view, "hpc_ops") and page_size != 64:
        page_size = 64
    if page_size != view.page_size:
        return {"page_size": page_size}
    return None


@rule("_fa4_page_constraint", overrides=("page_size",), whitelist=True)
def _fa4_page_constraint(view, model, platform):
    """FA4 on SM100 runs non-MLA models with 128-token pages, except for EAGLE
    trees (topk > 1), whose page-tree cascade only works with single-token pages."""
    if (
        _uses(view, "fa4")
        and not model.is_mla
        and platform.is_sm100
        and (view.speculative_eagle_topk or 0) <= 1
    ):
        return {"page_size": 128}
    return None


@rule("_intel_xpu_page_constraint", overrides=("page_size",), whitelist=True)
def _intel_xpu_page_constraint(view, model, platform):
    """Intel XPU decode attention supports pages of 64 or 128 tokens (16-128 for
    MLA decode); anything else becomes 128."""
    _, decode = attention_backends(view)
    if decode != "intel_xpu":
        return None
    supported = (16, 32, 64, 128) if model.is_mla else (64, 128)
    if view.page_size not in supported:
        return {"page_size": 128}
    return None
