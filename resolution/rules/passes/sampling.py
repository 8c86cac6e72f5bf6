"""The sampling-backend default (SGLang's ``_sampling_backend_default`` pass)."""

from __future__ import annotations

from flotilla.resolution.engine import rule


@rule("_sampling_backend_default", whitelist=True)
def _sampling_backend_default(view, model, platform):
    """Sampling runs on FlashInfer when it is usable, else on PyTorch.

    Only fills an unset backend; the CPU platform default (pytorch) is declared
    earlier by the normalise phase.
    """
    if view.sampling_backend is not None:
        return None
    return {"sampling_backend": "flashinfer" if platform.flashinfer_available else "pytorch"}
