"""The sampler's backend choice on the CPU: unknown or unavailable backends fail at
construction, and the torch backend is the default (the flashinfer path itself is tested on
the GPU in tests/gpu/test_flashinfer_ops.py)."""

import importlib.util

import pytest
import torch

from flotilla.cluster.engine.sampler import Sampler, SamplingRow
from flotilla.cluster.engine.sampling_params import SamplingParams


def test_unknown_backend_is_rejected_by_name():
    with pytest.raises(ValueError, match="backend='cuda'"):
        Sampler(backend="cuda")


@pytest.mark.skipif(importlib.util.find_spec("flashinfer") is not None, reason="flashinfer is installed here")
def test_flashinfer_backend_without_flashinfer_fails_at_construction():
    with pytest.raises(ValueError, match="flashinfer"):
        Sampler(backend="flashinfer")


def test_default_backend_is_torch_and_samples_seeded_rows_reproducibly():
    logits = torch.randn(2, 30, generator=torch.Generator().manual_seed(0))
    params = SamplingParams(temperature=1.0, seed=7)

    def draw():
        rows = [SamplingRow(params, generator=torch.Generator().manual_seed(7)) for _ in range(2)]
        return [t.token_id for t in Sampler()(logits, rows)]

    assert Sampler().backend == "torch"
    assert draw() == draw()
