"""The batch-1 MoE decode fusions on CUDA, against the ops they replace and the torch references:

- ``rms_norm_and_linear`` (triton): the post-attention fused-add RMSNorm and the router GEMV in
  one launch, also writing the normalized row the experts read;
- ``select_and_route``: ``select_experts`` and the routing sort in one launch;
- the down kernel's folded route sum (``fold_sum``);
- ``fused_moe_from_logits`` (triton), which puts the last two together, and the whole fused
  sequence captured in a CUDA graph.

Tolerances, and why:

- the new residual is ``x + residual`` rounded once on both sides: bit-identical;
- the normalized row is rounded as the reference rounds it (``h * rstd`` to the dtype, then
  times the weight to the dtype); only ``rstd`` may differ in its last float32 bits (the sum
  of squares is reduced in another order, ``1/sqrt`` against ``rsqrt``), which can flip an
  element's rounding: allowed, by at most 2 ulps of the element (a flip of the first
  rounding, carried through the weight product), on at most 1% of the elements;
- the router logits come from the one-pass product (float32 normalized row, ``rstd`` applied
  at the end), so they are compared with the bound of ``test_rms_norm_gemv_fuses_the_norm...``
  in test_triton_gemv.py, and bit for bit with ``rms_norm_gemv`` (the same kernel without the
  kept row);
- routing: ids and the segment layout exactly (distinct logits, and for softmax the order of
  the scores is the order of ``exp(x - max)``, computed identically; the 2-D tile may reduce
  the softmax sum in another order, which scales every score of a row alike), weights to
  1e-6 relative; ``sorted_route`` lists each segment's routes in route order, the route
  kernel's atomics may list them in another order: compared as a set per row block;
- the folded sum adds the same float32 parts in the same order as the route-sum kernel:
  bit-identical;
- the fused MoE against the float32 oracle with the tolerances of test_triton_moe.py.

Run on a GPU machine: ``FLOTILLA_GPU_TESTS=1 pytest tests/gpu/test_triton_moe_fusion.py``.
"""

from __future__ import annotations

import importlib

import pytest
import torch
import torch.nn.functional as F

from flotilla.kernels import registry
from flotilla.kernels.moe import fused_moe as torch_fused_moe
from flotilla.kernels.moe import select_experts as torch_select_experts
from flotilla.kernels.norm import rms_norm_and_linear as torch_rms_norm_and_linear

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
pytest.importorskip("triton")

ULP = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}
MAX_FLIP_FRACTION = 0.01
REL_NORM_TOL = 1e-2  # as test_triton_moe.py
ELEM_TOL = 2e-2
SELECT_RTOL = 1e-6


def _modules():
    """Import the triton backend's modules (they register their ops)."""
    for name in ("triton_gemv", "triton_moe", "triton_routing", "triton_select_route"):
        importlib.import_module(f"flotilla.kernels.{name}")
    from flotilla.kernels import triton_gemv, triton_moe, triton_routing, triton_select_route

    return triton_gemv, triton_moe, triton_routing, triton_select_route


def _ulps(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """One ulp of each element of ``x`` (a ``dtype`` value) in ``dtype``, as float32."""
    mantissa = {torch.bfloat16: 7, torch.float16: 10}[dtype]
    exponent = torch.floor(torch.log2(x.float().abs().clamp(min=2.0**-14)))
    return torch.exp2(exponent - mantissa)


# --------------------------------------------------------------------------- norm + router


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("n,k", [(128, 2048), (8, 4096), (60, 2048), (17, 300)])
@pytest.mark.parametrize("with_residual", [True, False])
def test_rms_norm_and_linear_keeps_the_norm_and_computes_the_router(dtype, n, k, with_residual):
    triton_gemv = _modules()[0]
    gen = torch.Generator(device="cuda").manual_seed(n * 7 + k + with_residual)
    x = (2 * torch.randn(1, k, device="cuda", generator=gen)).to(dtype)
    residual = torch.randn(1, k, device="cuda", generator=gen).to(dtype) if with_residual else None
    norm_weight = (1 + 0.1 * torch.randn(k, device="cuda", generator=gen)).to(dtype)
    w = (torch.randn(n, k, device="cuda", generator=gen) / k**0.5).to(dtype)
    x_before = x.clone()
    y, new_residual, normed = registry.get("rms_norm_and_linear", "triton")(x, residual, norm_weight, 1e-6, w)
    _, want_residual, want_normed = torch_rms_norm_and_linear(x, residual, norm_weight, 1e-6, w)
    torch.testing.assert_close(x, x_before, rtol=0, atol=0)
    assert y.dtype == normed.dtype == new_residual.dtype == dtype and y.shape == (1, n)
    torch.testing.assert_close(new_residual, want_residual, rtol=0, atol=0)
    diff = (normed.float() - want_normed.float()).abs()
    assert (diff <= 2 * _ulps(want_normed, dtype)).all(), f"normalized row off by {diff.max().item():.3e}"
    assert (diff > 0).float().mean().item() <= MAX_FLIP_FRACTION, f"{(diff > 0).sum().item()} of {k} elements differ"
    # logits: the fused norm GEMV's own bound (the normalized row in float32, rstd at the end)
    want = F.linear(want_normed.float(), w.float())
    slack = ULP[dtype] * F.linear(want_normed.float().abs(), w.float().abs())
    excess = (y.float() - want).abs() - ULP[dtype] * want.abs() - slack - 1e-5 * want.abs().max()
    assert excess.max().item() <= 0, f"router logits: max excess {excess.max().item():.3e}"
    # the kept row is an epilogue: the product is the plain fused norm GEMV's, bit for bit
    plain_y, _ = triton_gemv.rms_norm_gemv(x, residual, norm_weight, 1e-6, w)
    torch.testing.assert_close(y, plain_y, rtol=0, atol=0)


def test_rms_norm_and_linear_declines_what_it_does_not_fuse():
    op = registry.get("rms_norm_and_linear", "triton")
    g = torch.ones(64, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(8, 64, device="cuda", dtype=torch.bfloat16)
    two_rows = torch.randn(2, 64, device="cuda", dtype=torch.bfloat16)
    assert op(two_rows, two_rows.clone(), g, 1e-6, w) is None
    one = torch.randn(1, 64, device="cuda", dtype=torch.bfloat16)
    assert op(one.float(), one.float(), g.float(), 1e-6, w.float()) is None  # float32: the reference path
    assert op(one, one.clone(), g, 1e-6, w.float()) is None  # a float32 router (DeepSeek's) is not fused


# --------------------------------------------------------------------------- one-launch routing


def _distinct_logits(tokens, experts, seed, dtype=torch.float32):
    """Logits whose scores are never within rounding of each other (see test_triton_moe.py)."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    levels = torch.rand(tokens, experts, device="cuda", generator=gen).argsort(dim=-1).float()
    jitter = 0.5 * torch.rand(tokens, experts, device="cuda", generator=gen)
    return ((levels - experts / 2 + jitter) * (4.0 / experts)).to(dtype)


def _expert_map(kind, experts, seed):
    """``(expert_map, num_local)``: none; a third of the experts elsewhere (-1) and the rest at
    scrambled rows; or an EP rank's quarter of the experts."""
    gen = torch.Generator().manual_seed(seed)
    if kind == "none":
        return None, experts
    if kind == "holes":
        expert_map = torch.randperm(experts, generator=gen)
        expert_map[::3] = -1
        return expert_map.cuda(), experts
    local = max(1, experts // 4)
    expert_map = torch.full((experts,), -1, dtype=torch.int64)
    expert_map[torch.randperm(experts, generator=gen)[:local]] = torch.randperm(local, generator=gen)
    return expert_map.cuda(), local


def _same_routing(got, want, label):
    assert torch.equal(got.route_expert, want.route_expert), f"{label}: route_expert"
    assert torch.equal(got.block_expert, want.block_expert), f"{label}: block_expert"
    assert torch.equal(_rows_by_block(got), _rows_by_block(want)), f"{label}: sorted_route differs as sets per row block"


def _rows_by_block(routing) -> torch.Tensor:
    """``sorted_route`` as ``[blocks, block_m]``, each block's routes sorted (the last block
    padded with the sentinel)."""
    block_m, sentinel = routing.block_m, routing.route_expert.numel()
    rows = F.pad(routing.sorted_route, (0, routing.block_expert.numel() * block_m - routing.sorted_route.numel()), value=sentinel)
    return rows.view(-1, block_m).sort(dim=-1).values


@pytest.mark.parametrize("map_kind", ["none", "holes", "subset"])
@pytest.mark.parametrize("scoring,renormalize", [("softmax", True), ("softmax", False), ("sigmoid", True)])
@pytest.mark.parametrize("experts,top_k", [(128, 8), (60, 4), (8, 2)])
def test_select_and_route_matches_the_two_launches(experts, top_k, scoring, renormalize, map_kind):
    _, triton_moe, triton_routing, triton_select_route = _modules()
    for tokens in range(1, 9):
        expert_map, num_local = _expert_map(map_kind, experts, seed=tokens + experts)
        logits = _distinct_logits(tokens, experts, seed=tokens * 100 + experts + top_k)
        label = f"T={tokens} E={experts} k={top_k} {scoring} renormalize={renormalize} map={map_kind}"
        want_w, want_ids = triton_routing.launch_select_experts(logits, top_k, renormalize, scoring, None, 1.0)
        want = triton_routing.route(want_ids, num_local, expert_map, 16, num_tiles=4)
        got_w, got_ids, got = triton_select_route.select_and_route(
            logits, top_k, renormalize, scoring, None, 1.0, num_local, expert_map, 16, num_tiles=4
        )
        assert torch.equal(got_ids, want_ids), label
        torch.testing.assert_close(got_w, want_w, rtol=SELECT_RTOL, atol=1e-12, msg=lambda m: f"{label}: {m}")
        _same_routing(got, want, label)
        assert torch.equal(got.tile_counts, torch.zeros_like(got.tile_counts)), label
        ref_w, ref_ids = torch_select_experts(logits, top_k, renormalize, scoring)
        assert torch.equal(got_ids, ref_ids), f"{label}: not the torch reference's choice"


# --------------------------------------------------------------------------- folded route sum


def _weights(experts, hidden, inter, dtype, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    w13 = torch.randn(experts, 2 * inter, hidden, device="cuda", generator=gen) / hidden**0.5
    w2 = torch.randn(experts, hidden, inter, device="cuda", generator=gen) / inter**0.5
    return w13.to(dtype), w2.to(dtype)


def _compare(got, want, label):
    """``got`` (model dtype) against the float32 oracle, as test_triton_moe.py compares them."""
    assert torch.isfinite(got).all(), f"{label}: non-finite output"
    diff = (got.float() - want).abs()
    rel = (diff.norm() / want.norm().clamp(min=1e-12)).item()
    bound = ELEM_TOL * (want.abs() + want.abs().max() / 4)
    assert rel < REL_NORM_TOL and bool((diff <= bound).all()), f"{label}: rel_norm_err={rel:.2e}"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("map_kind", ["none", "holes", "subset"])
@pytest.mark.parametrize("tokens,experts,top_k,hidden,inter", [
    (1, 128, 8, 2048, 768), (4, 128, 8, 2048, 768), (8, 128, 8, 2048, 768), (3, 16, 4, 200, 72), (16, 8, 2, 256, 128),
])  # fmt: skip
def test_folded_route_sum_is_the_route_sum_kernels(tokens, experts, top_k, hidden, inter, map_kind, dtype):
    _, triton_moe, _, _ = _modules()
    expert_map, num_local = _expert_map(map_kind, experts, seed=tokens)
    w13, w2 = _weights(num_local, hidden, inter, dtype, seed=experts + hidden)
    x = torch.randn(tokens, hidden, device="cuda").to(dtype)
    logits = _distinct_logits(tokens, experts, seed=tokens + 1)
    weights, ids = torch_select_experts(logits, top_k, True)
    label = f"T={tokens} E={experts} k={top_k} H={hidden} I={inter} map={map_kind} {dtype}"
    assert triton_moe.folds_sum(tokens, top_k), label
    folded = triton_moe.fused_moe_with_config(x, w13, w2, weights, ids, "silu", expert_map, fold_sum=True)
    separate = triton_moe.fused_moe_with_config(x, w13, w2, weights, ids, "silu", expert_map, fold_sum=False)
    torch.testing.assert_close(folded, separate, rtol=0, atol=0, msg=lambda m: f"{label}: {m}")
    oracle = torch_fused_moe(x.float(), w13.float(), w2.float(), weights, ids, "silu", expert_map)
    _compare(folded, oracle, label)
    if expert_map is not None:  # tokens none of whose experts are held here: zeros
        unheld = ~(expert_map[ids] >= 0).any(dim=1)
        assert torch.equal(folded[unheld], torch.zeros_like(folded[unheld])), label


def test_fold_follows_the_route_limit():
    _, triton_moe, _, _ = _modules()
    assert triton_moe.folds_sum(8, 8) and not triton_moe.folds_sum(9, 8) and triton_moe.folds_sum(64, 1)


# --------------------------------------------------------------------------- fused_moe_from_logits


@pytest.mark.parametrize("map_kind", ["none", "holes"])
@pytest.mark.parametrize("tokens", [1, 2, 4, 8, 16, 64])
def test_fused_moe_from_logits_matches_the_oracle(tokens, map_kind):
    _, triton_moe, triton_routing, _ = _modules()
    experts, top_k, hidden, inter = 128, 8, 2048, 768
    expert_map, num_local = _expert_map(map_kind, experts, seed=5)
    w13, w2 = _weights(num_local, hidden, inter, torch.bfloat16, seed=1)
    x = torch.randn(tokens, hidden, device="cuda").bfloat16()
    logits = _distinct_logits(tokens, experts, seed=tokens, dtype=torch.bfloat16)  # the router's dtype
    label = f"T={tokens} map={map_kind}"
    out, weights, ids = registry.get("fused_moe_from_logits", "triton")(
        x, logits, w13, w2, top_k, True, expert_map=expert_map
    )
    want_w, want_ids = triton_routing.select_experts(logits, top_k, True)
    assert torch.equal(ids, want_ids), label
    torch.testing.assert_close(weights, want_w, rtol=SELECT_RTOL, atol=1e-12)
    oracle = torch_fused_moe(x.float(), w13.float(), w2.float(), weights, ids, "silu", expert_map)
    _compare(out, oracle, label)
    separate = triton_moe.fused_moe_with_config(x, w13, w2, weights, ids, "silu", expert_map, fold_sum=False)
    # NOTE: same weights and ids; rows are computed independently of their order in a segment.
    torch.testing.assert_close(out, separate, rtol=0, atol=0, msg=lambda m: f"{label}: {m}")


def test_fused_moe_from_logits_delegates_group_routing_and_checks_inputs():
    w13, w2 = _weights(64, 256, 128, torch.bfloat16)
    x = torch.randn(3, 256, device="cuda").bfloat16()
    logits = _distinct_logits(3, 64, seed=2)
    bias = torch.linspace(0, 0.1, 64, device="cuda")
    kwargs = dict(num_expert_group=8, topk_group=4, correction_bias=bias, routed_scaling_factor=2.5, scoring="sigmoid")
    out, weights, ids = registry.get("fused_moe_from_logits", "triton")(x, logits, w13, w2, 6, True, **kwargs)
    want_w, want_ids = torch_select_experts(logits, 6, True, **kwargs)
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(weights, want_w, rtol=SELECT_RTOL, atol=1e-12)
    _compare(out, torch_fused_moe(x.float(), w13.float(), w2.float(), weights, ids), "grouped")
    with pytest.raises(ValueError, match="router_logits must be"):
        registry.get("fused_moe_from_logits", "triton")(x, logits[:2], w13, w2, 6, True)
    with pytest.raises(ValueError, match="top_k=65"):
        registry.get("fused_moe_from_logits", "triton")(x, logits, w13, w2, 65, True)


def test_one_group_is_no_group_limit(monkeypatch):
    # DeepSeek-V2-Lite: n_group = topk_group = 1, float32 router logits, 64 experts, top 6.
    _, _, _, triton_select_route = _modules()
    calls = []
    one_launch = triton_select_route.select_and_route
    monkeypatch.setattr(triton_select_route, "select_and_route", lambda *a, **k: calls.append(1) or one_launch(*a, **k))
    w13, w2 = _weights(64, 256, 128, torch.bfloat16, seed=4)
    x = torch.randn(2, 256, device="cuda").bfloat16()
    logits = _distinct_logits(2, 64, seed=9)
    kwargs = dict(num_expert_group=1, topk_group=1)
    out, weights, ids = registry.get("fused_moe_from_logits", "triton")(x, logits, w13, w2, 6, False, **kwargs)
    assert calls == [1], "one group should route in one launch"
    want_w, want_ids = torch_select_experts(logits, 6, False, **kwargs)
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(weights, want_w, rtol=SELECT_RTOL, atol=1e-12)
    _compare(out, torch_fused_moe(x.float(), w13.float(), w2.float(), weights, ids), "one group")


def test_moe_layer_routes_through_the_one_launch_op():
    from flotilla.cluster.models.moe_layer import FusedMoE

    _modules()
    layer = FusedMoE(16, 4, 64, 32, renormalize=True, backend="triton")
    assert layer._from_logits is registry.get("fused_moe_from_logits", "triton")


# --------------------------------------------------------------------------- the fused sequence in a graph


@pytest.mark.parametrize("batch", [1, 4])
def test_fused_sequence_replays_in_a_cuda_graph(batch):
    """The decode layer's MoE half as the model runs it: at batch 1 the norm fused with the
    router, then routing and experts from the logits (all Triton); at batch 4 (the norm and
    router are cuBLAS's and flashinfer's business there) routing and experts from given
    logits. Replays with new inputs equal eager runs bit for bit (every kernel is
    deterministic; the folded sum's last program varies, its order does not)."""
    experts, top_k, hidden, inter = 128, 8, 2048, 768
    w13, w2 = _weights(experts, hidden, inter, torch.bfloat16, seed=3)
    gen = torch.Generator(device="cuda").manual_seed(batch)
    router = (torch.randn(experts, hidden, device="cuda", generator=gen) / hidden**0.5).bfloat16()
    g = (1 + 0.1 * torch.randn(hidden, device="cuda", generator=gen)).bfloat16()
    x = torch.randn(batch, hidden, device="cuda", generator=gen).bfloat16()
    residual = torch.randn(batch, hidden, device="cuda", generator=gen).bfloat16()
    given_logits = (x.float() @ router.float().t()).bfloat16()
    norm_router = registry.get("rms_norm_and_linear", "triton")
    moe = registry.get("fused_moe_from_logits", "triton")

    def step():
        if batch == 1:
            logits, new_residual, normed = norm_router(x, residual, g, 1e-6, router)
        else:
            logits, new_residual, normed = given_logits, residual, x
        out, _, ids = moe(normed, logits, w13, w2, top_k, True)
        return out, new_residual, ids

    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        step()  # compile outside the graph
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    chosen = []
    for seed in (7, 8):
        gen = torch.Generator(device="cuda").manual_seed(seed)
        x.copy_(torch.randn(batch, hidden, device="cuda", generator=gen).bfloat16())
        residual.copy_(torch.randn(batch, hidden, device="cuda", generator=gen).bfloat16())
        given_logits.copy_((x.float() @ router.float().t()).bfloat16())
        graph.replay()
        torch.cuda.synchronize()
        eager = step()
        for got, want, name in zip(captured, eager, ("out", "residual", "ids")):
            torch.testing.assert_close(got, want, rtol=0, atol=0, msg=lambda m: f"batch={batch} seed={seed} {name}: {m}")
        chosen.append(captured[2].clone())
    assert not torch.equal(chosen[0], chosen[1]), "new inputs should route to other experts"
