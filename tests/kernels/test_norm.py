"""rms_norm against HF LlamaRMSNorm, with and without the fused residual add."""

import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from flotilla.kernels.registry import get


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_matches_llama_rms_norm(dtype):
    torch.manual_seed(0)
    hf = LlamaRMSNorm(64, eps=1e-5).to(dtype)
    hf.weight.data = torch.randn(64).to(dtype)
    x = torch.randn(7, 64).to(dtype)
    y = get("rms_norm")(x, hf.weight, 1e-5)
    assert y.dtype == dtype
    # Same operations in the same order: bit-exact.
    torch.testing.assert_close(y, hf(x), rtol=0, atol=0)


def test_rms_norm_fused_residual():
    torch.manual_seed(0)
    hf = LlamaRMSNorm(32, eps=1e-6)
    hf.weight.data = torch.randn(32)
    x, residual = torch.randn(5, 32), torch.randn(5, 32)
    y, new_residual = get("rms_norm")(x, hf.weight, 1e-6, residual=residual)
    torch.testing.assert_close(new_residual, x + residual, rtol=0, atol=0)
    torch.testing.assert_close(y, hf(x + residual), rtol=0, atol=0)
