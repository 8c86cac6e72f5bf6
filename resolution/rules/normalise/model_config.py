"""The first ``ModelConfig`` build of SGLang 0.5.19's pipeline.

SGLang builds (and memoises) the model configuration the first time a handler
asks for it, at ``apply_inkling_prefill_cuda_graph_default``; building it runs
the context-length and quantization checks. Flotilla's model facts are parsed
up front, so this rule re-runs those two checks at the same slot.

not ported: dtype verification and the dual-chunk-attention config check (not
part of the resolved configuration); ``is_in_ci()`` (a CI escape hatch).
not ported: the memo's lazy build (SGLang skips the build at this slot when an
explicit prefill graph backend makes the Inkling default return early; the
checks then fire at the next model-config read, which changes only which of
two simultaneous errors is reported first).
"""

from __future__ import annotations

from flotilla.resolution.model_derive import check_context_length
from flotilla.resolution.model_quant import verify_quantization
from flotilla.resolution.engine import rule
from flotilla.resolution.rules.common import env_flag

_ALLOW_LONGER_CONTEXT_ENV = "SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN"


@rule("ModelConfig.__init__")
def verify_model_config(view, model, platform):
    """Building the model config rejects a --context-length beyond the model's
    derived context and a quantization the checkpoint or the device cannot serve.

    Declares nothing: ``ModelConfig.quantization`` stays on the model config and
    never flows back into ``--quantization``.
    """
    # NOTE: ModelConfig derives the context length before it verifies quantization.
    check_context_length(
        model.context_len,
        view.context_length,
        allow_longer=env_flag(view, _ALLOW_LONGER_CONTEXT_ENV),
    )
    verify_quantization(
        model.quant_config,
        view.quantization,
        device=platform.device,
        capability=platform.capability,
        gcn_arch=platform.gcn_arch,
    )
    return None
