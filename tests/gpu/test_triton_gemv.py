"""The Triton decode GEMV (``linear`` / ``silu_and_mul_linear`` backend ``triton``) against
``F.linear`` on float32 copies of the same values, on CUDA.

The kernel accumulates in float32 and rounds the output to the input dtype once, so the
difference from the float32 product is the output rounding (half an ulp: 2^-9 relative
in bf16, 2^-12 in fp16) plus float32 summation-order noise (~1e-6 relative). The fused
activation also rounds silu(gate) * up to the dtype before the product, as the separate
activation kernel stores it; the oracle does the same rounding.
"""

import pytest
import torch
import torch.nn.functional as F

from flotilla.kernels import registry

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
pytest.importorskip("triton")

ULP = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}


def _gemv():
    from flotilla.kernels import triton_gemv

    return triton_gemv


def _close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    # NOTE: one output rounding (<= half an ulp of |want|) plus float32 noise scaled by the
    # row's magnitude (cancellation makes some outputs small against their terms).
    bound = ULP[dtype] * want.abs() + 1e-5 * want.abs().max()
    assert got.dtype == dtype
    excess = (got.float() - want).abs() - bound
    assert excess.max().item() <= 0, f"max excess {excess.max().item():.3e} over the rounding bound"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m", [1, 2, 4])
@pytest.mark.parametrize("n,k", [(6144, 4096), (4096, 14336), (17, 300), (1000, 96), (5120, 2048), (2048, 4096), (128, 2048)])
@pytest.mark.parametrize("bias", [False, True])
def test_gemv_matches_the_float32_product(dtype, m, n, k, bias):
    gen = torch.Generator(device="cuda").manual_seed(n * 31 + k + m)
    x = torch.randn(m, k, device="cuda", generator=gen).to(dtype)
    w = (torch.randn(n, k, device="cuda", generator=gen) / k**0.5).to(dtype)
    b = torch.randn(n, device="cuda", generator=gen).to(dtype) if bias else None
    want = F.linear(x.float(), w.float(), None if b is None else b.float())
    _close(_gemv().gemv(x, w, b), want, dtype)


@pytest.mark.parametrize("config", [{"BLOCK_N": 2, "BLOCK_K": 256, "num_warps": 4}, {"BLOCK_N": 16, "BLOCK_K": 1024, "num_warps": 8}])
def test_gemv_configs_agree(config):
    x = torch.randn(1, 4096 + 64, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(333, 4096 + 64, device="cuda", dtype=torch.bfloat16) / 64
    want = F.linear(x.float(), w.float())
    _close(_gemv().gemv(x, w, config=config), want, torch.bfloat16)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n,k", [(4096, 14336), (576, 1536), (64, 200)])
def test_silu_and_mul_linear_fuses_the_activation(dtype, n, k):
    gen = torch.Generator(device="cuda").manual_seed(n + k)
    gate_up = (2 * torch.randn(1, 2 * k, device="cuda", generator=gen)).to(dtype)
    w = (torch.randn(n, k, device="cuda", generator=gen) / k**0.5).to(dtype)
    act = (F.silu(gate_up[:, :k].float()) * gate_up[:, k:].float()).to(dtype)
    want = F.linear(act.float(), w.float())
    fused = registry.get("silu_and_mul_linear", "triton")
    _close(fused(gate_up, w, silu_and_mul=None), want, dtype)
    # more than one row: the separate activation, then F.linear
    rows = gate_up.repeat(3, 1)
    separate = fused(rows, w, silu_and_mul=lambda t: (F.silu(t[:, :k].float()) * t[:, k:].float()).to(dtype))
    torch.testing.assert_close(separate, F.linear(act.repeat(3, 1), w))


def test_decode_linear_takes_one_row_and_leaves_the_rest_to_torch():
    linear = registry.get("linear", "triton")
    w = torch.randn(256, 512, device="cuda", dtype=torch.bfloat16) / 16
    one = torch.randn(1, 512, device="cuda", dtype=torch.bfloat16)
    many = torch.randn(5, 512, device="cuda", dtype=torch.bfloat16)
    _close(linear(one, w), F.linear(one.float(), w.float()), torch.bfloat16)
    torch.testing.assert_close(linear(many, w), F.linear(many, w), rtol=0, atol=0)
    strided = torch.randn(1, 1024, device="cuda", dtype=torch.bfloat16)[:, ::2]
    torch.testing.assert_close(linear(strided, w), F.linear(strided, w), rtol=0, atol=0)


def test_gemv_replays_in_a_cuda_graph():
    x = torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16) / 64
    linear = registry.get("linear", "triton")
    want = linear(x, w)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        linear(x, w)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = linear(x, w)
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out, linear(x, w), rtol=0, atol=0)
    assert not torch.equal(out, want)


def test_gemv_rejects_what_it_cannot_run():
    gemv = _gemv().gemv
    w = torch.randn(8, 16, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"at most 4 rows"):
        gemv(torch.randn(5, 16, device="cuda", dtype=torch.bfloat16), w)
    with pytest.raises(ValueError, match=r"weight\[N, K\]"):
        gemv(torch.randn(1, 32, device="cuda", dtype=torch.bfloat16), w)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n,k", [(6144, 4096), (28672, 4096), (5120, 2048), (333, 300)])
@pytest.mark.parametrize("with_residual", [True, False])
@pytest.mark.parametrize("config", [None, {"BLOCK_N": 16, "BLOCK_K": 512, "num_warps": 8}], ids=["default", "16x512w8"])
def test_rms_norm_gemv_fuses_the_norm_into_the_projection(dtype, n, k, with_residual, config):
    from flotilla.kernels.norm import rms_norm

    gen = torch.Generator(device="cuda").manual_seed(n + k + with_residual)
    x = torch.randn(1, k, device="cuda", generator=gen).to(dtype)
    residual = torch.randn(1, k, device="cuda", generator=gen).to(dtype) if with_residual else None
    norm_weight = (1 + 0.1 * torch.randn(k, device="cuda", generator=gen)).to(dtype)
    w = (torch.randn(n, k, device="cuda", generator=gen) / k**0.5).to(dtype)
    x_before = x.clone()
    y, new_residual = _gemv().rms_norm_gemv(x, residual, norm_weight, 1e-5, w, config=config)
    if with_residual:
        normed, want_residual = rms_norm(x, norm_weight, 1e-5, residual)
        # the sum is rounded once to the dtype on both sides (round to nearest even)
        torch.testing.assert_close(new_residual, want_residual, rtol=0, atol=0)
    else:
        normed = rms_norm(x, norm_weight, 1e-5)
        assert new_residual is x
    torch.testing.assert_close(x, x_before, rtol=0, atol=0)
    # NOTE: the kernel keeps the normalized row in float32 (rstd scales the product at the
    # end) where the reference rounds it twice to the dtype (x * rstd, then weight * that):
    # each element can differ from the reference's by up to one ulp, so allow one ulp of the
    # row's elements on top of the output rounding.
    want = F.linear(normed.float(), w.float())
    slack = ULP[dtype] * F.linear(normed.float().abs(), w.float().abs())
    excess = (y.float() - want).abs() - ULP[dtype] * want.abs() - slack - 1e-5 * want.abs().max()
    assert excess.max().item() <= 0, f"max excess {excess.max().item():.3e}"
