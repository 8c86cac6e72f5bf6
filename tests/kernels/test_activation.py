"""Gated activations against the plain formulas HF MLPs use."""

import pytest
import torch
import torch.nn.functional as F

from flotilla.kernels.registry import get


def test_silu_and_mul():
    torch.manual_seed(0)
    gate, up = torch.randn(3, 4, 16), torch.randn(3, 4, 16)
    out = get("silu_and_mul")(torch.cat([gate, up], dim=-1))
    # The strided half may take a different vectorised path than a contiguous one: 1-ulp differences.
    torch.testing.assert_close(out, F.silu(gate) * up, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_gelu_and_mul(approximate):
    torch.manual_seed(0)
    gate, up = torch.randn(5, 8), torch.randn(5, 8)
    out = get("gelu_and_mul")(torch.cat([gate, up], dim=-1), approximate=approximate)
    # The strided half may take another vectorised erf / tanh than the contiguous one (or the
    # scalar one: ATEN_CPU_CAPABILITY). For x < 0, gelu(x) = x/2 * (1 + erf(x/sqrt(2))) cancels: an
    # ulp of erf (1.2e-7) is an absolute 0.5 * |x| * 1.2e-7 of gelu, times |up|: <= 5.4e-7 at
    # |x|, |up| <= 3, whatever the output's size. Measured <= 1.8e-7 -> atol 1e-6. Exact against
    # tanh GELU differs by ~1e-3 * |up|, swapped halves by O(1).
    torch.testing.assert_close(out, F.gelu(gate, approximate=approximate) * up, rtol=1e-6, atol=1e-6)


def test_gelu_tanh_differs_from_exact():
    x = torch.linspace(-3, 3, 32).repeat(2)
    exact = get("gelu_and_mul")(x)
    tanh = get("gelu_and_mul")(x, approximate="tanh")
    assert not torch.equal(exact, tanh)


def test_odd_width_is_rejected():
    with pytest.raises(ValueError, match="even last dimension"):
        get("silu_and_mul")(torch.randn(2, 7))
