"""The batch-1 MoE fusions' Triton kernels under Triton's CPU interpreter (``TRITON_INTERPRET=1``):
one-launch routing (``select_and_route``) against the two launches it replaces, the down
kernel's folded route sum against the route-sum kernel, and the norm kept by the fused
norm + router GEMV.

Opt-in: the module runs only when Triton is importable AND ``TRITON_INTERPRET=1`` was set
before it was imported (the kernels are interpreted only if the variable is set when they are
defined), e.g. on a CPU box::

    PYTHONPATH=/path/to/triton-site:... TRITON_INTERPRET=1 python -m pytest tests/kernels/test_triton_moe_fusion_interpreted.py

Elsewhere it skips; the same kernels are tested on a GPU by tests/gpu/test_triton_moe_fusion.py.

Exactness: routing outputs are integers and float32 weights computed by the same operations
in the same order on both sides (the interpreter reduces a row of a 2-D tile as it reduces the
1-D row), so everything is compared with ``torch.equal``. The interpreter rounds float32 to
bfloat16 by truncation, so the floating-point kernels are checked in float32 here, where the
folded sum must equal the separate sum bit for bit (same additions, same order) and the kept
norm must equal the torch reference (float32: no rounding to a narrower dtype anywhere).
"""

from __future__ import annotations

import itertools
import os

import pytest
import torch

pytest.importorskip("triton")
if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("interpreter tests: set TRITON_INTERPRET=1 (see the module docstring)", allow_module_level=True)

from flotilla.kernels import triton_moe  # noqa: E402
from flotilla.kernels.moe import fused_moe  # noqa: E402
from flotilla.kernels.norm import rms_norm_and_linear  # noqa: E402
from flotilla.kernels.triton_gemv import rms_norm_gemv_keep_normed  # noqa: E402
from flotilla.kernels.triton_routing import launch_select_experts, route  # noqa: E402
from flotilla.kernels.triton_select_route import fits_one_program, select_and_route  # noqa: E402

ROUTING_CASES = [(8, 2), (60, 3), (128, 8)]  # (experts, top_k)
SCORINGS = [("softmax", True), ("softmax", False), ("sigmoid", True), ("sigmoid", False)]


def _expert_map(kind: str, experts: int, gen: torch.Generator) -> tuple[torch.Tensor | None, int]:
    """``(expert_map, num_local)``: none; every expert held but scrambled, a third elsewhere
    (-1); or an EP rank's subset (a quarter of the experts, at scrambled local rows)."""
    if kind == "none":
        return None, experts
    if kind == "holes":
        expert_map = torch.randperm(experts, generator=gen)
        expert_map[::3] = -1
        return expert_map, experts
    local = max(1, experts // 4)
    expert_map = torch.full((experts,), -1, dtype=torch.int64)
    expert_map[torch.randperm(experts, generator=gen)[:local]] = torch.randperm(local, generator=gen)
    return expert_map, local


@pytest.mark.parametrize("map_kind", ["none", "holes", "subset"])
@pytest.mark.parametrize("scoring,renormalize", SCORINGS)
@pytest.mark.parametrize("experts,top_k", ROUTING_CASES)
def test_select_and_route_equals_the_two_launches(experts, top_k, scoring, renormalize, map_kind):
    for tokens in range(1, 9):
        gen = torch.Generator().manual_seed(tokens * 1000 + experts * 10 + top_k)
        expert_map, num_local = _expert_map(map_kind, experts, gen)
        assert fits_one_program(tokens, experts, top_k, num_local)
        logits = torch.randn(tokens, experts, generator=gen) * 2
        scale = 2.5 if scoring == "sigmoid" else 1.0
        label = f"T={tokens} E={experts} k={top_k} {scoring} renormalize={renormalize} map={map_kind}"
        want_w, want_ids = launch_select_experts(logits, top_k, renormalize, scoring, None, scale)
        want = route(want_ids, num_local, expert_map, 16, num_tiles=3)
        got_w, got_ids, got = select_and_route(logits, top_k, renormalize, scoring, None, scale, num_local, expert_map, 16, 3)
        assert torch.equal(got_ids, want_ids), label
        assert torch.equal(got_w, want_w), label
        for field in ("sorted_route", "block_expert", "route_expert", "tile_counts"):
            assert torch.equal(getattr(got, field), getattr(want, field)), f"{label}: {field}"
        assert torch.equal(got.tile_counts, torch.zeros(3, dtype=torch.int32)), label


def test_select_and_route_with_correction_bias_and_ties():
    gen = torch.Generator().manual_seed(7)
    bias = torch.rand(64, generator=gen) * 0.1
    for tokens, logits in ((3, torch.randn(3, 64, generator=gen)), (5, torch.randint(0, 3, (5, 64), generator=gen).float())):
        want_w, want_ids = launch_select_experts(logits, 6, True, "sigmoid", bias, 2.5)
        want = route(want_ids, 64, None, 16)
        got_w, got_ids, got = select_and_route(logits, 6, True, "sigmoid", bias, 2.5, 64, None, 16)
        assert torch.equal(got_ids, want_ids) and torch.equal(got_w, want_w), tokens
        assert got.tile_counts is None and want.tile_counts is None
        for field in ("sorted_route", "block_expert", "route_expert"):
            assert torch.equal(getattr(got, field), getattr(want, field)), (tokens, field)


def test_calls_that_do_not_fit_one_program_are_refused():
    assert fits_one_program(8, 128, 8, 128) and not fits_one_program(9, 128, 8, 128)
    assert not fits_one_program(1, 2048, 1, 2048) and not fits_one_program(0, 8, 2, 8)
    with pytest.raises(ValueError, match="fit one program"):
        select_and_route(torch.randn(9, 128), 8, True, "softmax", None, 1.0, 128, None, 16)


@pytest.mark.parametrize("tokens", [1, 2, 3, 5, 8])
@pytest.mark.parametrize("map_kind", ["none", "holes", "subset"])
def test_down_kernel_folds_the_route_sum(tokens, map_kind):
    experts, top_k, hidden, inter = 16, 4, 96, 48
    gen = torch.Generator().manual_seed(tokens + len(map_kind))
    expert_map, num_local = _expert_map(map_kind, experts, gen)
    w13 = torch.randn(num_local, 2 * inter, hidden, generator=gen) / hidden**0.5
    w2 = torch.randn(num_local, hidden, inter, generator=gen) / inter**0.5
    x = torch.randn(tokens, hidden, generator=gen)
    weights, ids = torch.randn(tokens, experts, generator=gen).softmax(-1).topk(top_k, dim=-1)
    # NOTE: tiles not dividing H or I: the column and K tails are masked in both kernels.
    cfg = triton_moe.MoEConfig(16, 32, 32, 4, 2, 64, 32, 4, 2)
    assert triton_moe.folds_sum(tokens, top_k)
    outs = []
    for fold in (False, True):
        routing = route(ids, num_local, expert_map, cfg.block_m, num_tiles=triton_moe.down_tiles(hidden, cfg) if fold else 0)
        outs.append(triton_moe.run_experts(x, w13, w2, weights, routing, top_k, "silu", cfg))
    assert torch.equal(outs[1], outs[0])
    want = fused_moe(x, w13, w2, weights, ids, "silu", expert_map)
    torch.testing.assert_close(outs[1], want, rtol=1e-5, atol=1e-6)
    if expert_map is not None:  # a token none of whose experts is held here gets zeros
        unheld = ~(expert_map[ids] >= 0).any(dim=1)
        assert torch.equal(outs[1][unheld], torch.zeros_like(outs[1][unheld]))


@pytest.mark.parametrize("with_residual", [True, False])
@pytest.mark.parametrize("n,k", [(128, 2048), (17, 300)])
def test_norm_gemv_keeps_the_normalized_row(n, k, with_residual):
    gen = torch.Generator().manual_seed(n + k)
    x = torch.randn(1, k, generator=gen)
    residual = torch.randn(1, k, generator=gen) if with_residual else None
    g = 1 + 0.1 * torch.randn(k, generator=gen)
    w = torch.randn(n, k, generator=gen) / k**0.5
    y, new_residual, normed = rms_norm_gemv_keep_normed(x, residual, g, 1e-6, w)
    want_y, want_residual, want_normed = rms_norm_and_linear(x, residual, g, 1e-6, w)
    assert torch.equal(new_residual, want_residual)
    # float32: rstd (1/sqrt vs rsqrt) may differ in its last bit: a few float32 ulps.
    torch.testing.assert_close(normed, want_normed, rtol=1e-6, atol=0)
    torch.testing.assert_close(y, want_y, rtol=1e-5, atol=1e-5)


def test_the_grids_cover_what_the_probe_runs():
    # the Qwen3-30B-A3B decode shapes of benchmarks/moe_decode_probe.py take the one-program path
    for tokens, (experts, top_k) in itertools.product((1, 4), [(128, 8)]):
        assert fits_one_program(tokens, experts, top_k, experts) and triton_moe.folds_sum(tokens, top_k)
