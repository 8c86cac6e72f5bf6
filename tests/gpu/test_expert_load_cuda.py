"""The expert-load recorder on a CUDA device: its counters live on the GPU (``index_add_``,
no host sync) and read back equal to a bincount of the ids. Run on a GPU machine:
``FLOTILLA_GPU_TESTS=1 pytest tests/gpu``."""

import pytest
import torch

from flotilla.cluster.models.expert_load import ExpertLoadRecorder

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

E, K = 8, 2


def test_counts_on_cuda():
    generator = torch.Generator().manual_seed(7)
    ids = torch.stack([torch.randperm(E, generator=generator)[:K] for _ in range(9)])
    recorder = ExpertLoadRecorder(num_layers=1, num_experts=E, device="cuda")
    recorder.record(0, ids.cuda())
    recorder.end_pass()
    assert recorder.snapshot()["total"] == torch.bincount(ids.reshape(-1), minlength=E).tolist()
