"""Opening of SGLang's ``handle_attention_backend_compatibility``: the default
attention backend and what the chosen backend implies for CUDA graphs and the
radix cache.

The rest of the handler lives in ``attention_pages`` (page-size snaps) and
``attention_checks`` (validations and fallbacks); ``passes.STEPS`` interleaves
them in the handler's order.

not ported: out-of-tree platform default backends (no such platforms here).
"""

from __future__ import annotations

from flotilla.resolution.engine import ensure, rule
from flotilla.resolution.rules.common import default_attention_backend
from flotilla.resolution.rules.passes.cuda_graph import DECODE, PREFILL, with_phases_disabled

_ENCODER_DECODER_ARCHES = frozenset(
    {
        "WhisperForConditionalGeneration",
        "MllamaForConditionalGeneration",
        "MossVLForConditionalGeneration",
    }
)


@rule("_attention_backend_default", overrides=("attention_backend",), whitelist=True)
def _attention_backend_default(view, model, platform):
    """The attention backend: the split backends when prefill and decode agree,
    else SGLang's per-platform default when nothing chose one yet."""
    prefill = view.prefill_attention_backend
    if prefill is not None and prefill == view.decode_attention_backend:
        return {"attention_backend": prefill}
    if view.attention_backend is None:
        return {"attention_backend": default_attention_backend(view, model, platform)}
    return None


@rule(
    "_handle_attention_backend_compatibility",
    overrides=("cuda_graph_config", "disable_radix_cache"),
)
def _attention_graph_and_radix_adjustments(view, model, platform):
    """The torch-native and flex attention backends cannot be captured in CUDA
    graphs (both phases go eager; flex also refuses speculative decoding), and
    Whisper's padded encoder tokens rule out prefix caching."""
    declared: dict = {}
    backend = view.attention_backend
    if backend in ("torch_native", "flex_attention"):
        declared["cuda_graph_config"] = with_phases_disabled(
            view.cuda_graph_config, DECODE, PREFILL
        )
    if backend == "flex_attention":
        ensure(
            view.speculative_algorithm is None,
            "Speculative decoding is currently not supported with Flex Attention backend",
        )
    is_encoder_decoder = any(arch in _ENCODER_DECODER_ARCHES for arch in model.architectures)
    if (
        is_encoder_decoder
        and not view.disable_radix_cache
        and "WhisperForConditionalGeneration" in model.architectures
    ):
        declared["disable_radix_cache"] = True
    return declared
