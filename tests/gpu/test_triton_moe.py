"""The Triton fused MoE (backend ``triton``) against the torch reference, on CUDA.

Inputs and weights are bfloat16/float16 values; the oracle is the torch reference run on
float32 copies of those same values, so every difference comes from the kernels' own
roundings: the activated intermediate is rounded to the model dtype once (the reference in
the model dtype rounds gate, up, their product and the down output), the output once.
Both stay within ~2^-8 relative of the float32 result; the bounds below leave 2-4x room.

One token's route sum folded into the down kernel (``triton_moe.FOLD_ROUTE_SUM``) does the
separate route-sum kernel's float32 operations in its order, so folded and unfolded outputs
must be bit-identical. The fold helpers take a ``device``, so the same checks run under
Triton's CPU interpreter (``TRITON_INTERPRET=1``, float16: the 3.6 interpreter's bf16
``tl.dot`` is wrong; tests/kernels/test_triton_folds_interpreted.py). The interpreter runs
one program at a time, so there they check the arithmetic and the counting (which program
sums, the counters back at zero), not the memory ordering between concurrent programs: that
is what the CUDA runs below add.
"""

import importlib

import pytest
import torch

from flotilla.kernels import registry
from flotilla.kernels.moe import fused_moe as torch_fused_moe

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
triton = pytest.importorskip("triton")

REL_NORM_TOL = 1e-2  # ||got - want|| / ||want||
ELEM_TOL = 2e-2  # |got - want| <= ELEM_TOL * (|want| + max|want| / 4)

_WEIGHTS: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}


def _triton_moe():
    importlib.import_module("flotilla.kernels.triton_moe")  # registers the backend, whatever the registry table says
    return registry.get("fused_moe", "triton")


def _weights(experts, hidden, inter, dtype):
    """Random expert weights scaled so activations stay O(1); cached per shape (they are large)."""
    key = (experts, hidden, inter, dtype)
    if key not in _WEIGHTS:
        _WEIGHTS.clear()
        gen = torch.Generator(device="cuda").manual_seed(experts * 7 + hidden + inter)
        w13 = torch.randn(experts, 2 * inter, hidden, device="cuda", generator=gen) / hidden**0.5
        w2 = torch.randn(experts, hidden, inter, device="cuda", generator=gen) / inter**0.5
        _WEIGHTS[key] = (w13.to(dtype), w2.to(dtype))
    return _WEIGHTS[key]


def _routing(tokens, experts, top_k, seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    logits = torch.randn(tokens, experts, device="cuda", generator=gen)
    weights, ids = logits.softmax(-1).topk(top_k, dim=-1)
    return weights / weights.sum(-1, keepdim=True), ids


def _compare(got, want, label):
    """Assert ``got`` (model dtype) matches the float32 oracle ``want``; explain any miss."""
    assert got.shape == want.shape and got.dtype != torch.float32, label
    assert torch.isfinite(got).all(), f"{label}: non-finite output ({(~torch.isfinite(got)).sum().item()} values)"
    diff = (got.float() - want).abs()
    rel = (diff.norm() / want.norm().clamp(min=1e-12)).item()
    bound = ELEM_TOL * (want.abs() + want.abs().max() / 4)
    worst = (diff - bound).flatten().argmax().item()
    row, col = divmod(worst, want.shape[1])
    msg = (
        f"{label}: rel_norm_err={rel:.2e} (tol {REL_NORM_TOL}), max_abs_err={diff.max().item():.3e}, "
        f"max|want|={want.abs().max().item():.3e}; worst at token {row} column {col}: "
        f"got {got[row, col].item():.5f} want {want[row, col].item():.5f}"
    )
    assert rel < REL_NORM_TOL and bool((diff <= bound).all()), msg


def _oracle(hidden, w13, w2, weights, ids, activation="silu", expert_map=None):
    return torch_fused_moe(hidden.float(), w13.float(), w2.float(), weights, ids, activation, expert_map)


@pytest.mark.parametrize("hidden_size,inter", [(256, 128), (2048, 768)])
@pytest.mark.parametrize("top_k", [2, 8])
@pytest.mark.parametrize("experts", [8, 64, 128])
@pytest.mark.parametrize("tokens", [1, 3, 64, 300, 1024])
def test_matches_reference_bf16(tokens, experts, top_k, hidden_size, inter):
    w13, w2 = _weights(experts, hidden_size, inter, torch.bfloat16)
    x = torch.randn(tokens, hidden_size, device="cuda").to(torch.bfloat16)
    weights, ids = _routing(tokens, experts, top_k, seed=tokens + experts + top_k)
    got = _triton_moe()(x, w13, w2, weights, ids)
    _compare(got, _oracle(x, w13, w2, weights, ids), f"T={tokens} E={experts} k={top_k} H={hidden_size} I={inter}")


@pytest.mark.parametrize("activation", ["silu", "gelu", "gelu_tanh"])
def test_fp16_and_activations(activation):
    w13, w2 = _weights(8, 256, 128, torch.float16)
    x = torch.randn(64, 256, device="cuda").half()
    weights, ids = _routing(64, 8, 2, seed=5)
    got = _triton_moe()(x, w13, w2, weights, ids, activation)
    assert got.dtype == torch.float16
    _compare(got, _oracle(x, w13, w2, weights, ids, activation), f"fp16 {activation}")


@pytest.mark.parametrize("tokens", [37, 1])  # 1: the single-token tiles (BLOCK_K 256)
def test_odd_sizes_mask_the_tails(tokens):
    # H and I not multiples of any block size: the K loops' tails and the column tails.
    w13, w2 = _weights(6, 200, 72, torch.bfloat16)
    x = torch.randn(tokens, 200, device="cuda").bfloat16()
    weights, ids = _routing(tokens, 6, 3, seed=9)
    _compare(_triton_moe()(x, w13, w2, weights, ids), _oracle(x, w13, w2, weights, ids), f"odd sizes, {tokens} tokens")


@pytest.mark.parametrize("tokens", [1, 300])
def test_expert_parallel_subset_and_replicas(tokens):
    # 64 global slots, 16 held here in a scrambled order; two slots map to the same row
    # (redundant copies of one expert share weights); the rest belong to other ranks.
    global_slots, local = 64, 16
    w13, w2 = _weights(local, 512, 256, torch.bfloat16)
    gen = torch.Generator().manual_seed(3)
    held = torch.randperm(global_slots, generator=gen)[: local + 1]
    expert_map = torch.full((global_slots,), -1, dtype=torch.int64)
    expert_map[held[:local]] = torch.randperm(local, generator=gen)
    expert_map[held[local]] = expert_map[held[0]]
    expert_map = expert_map.cuda()
    x = torch.randn(tokens, 512, device="cuda").bfloat16()
    weights, ids = _routing(tokens, global_slots, 8, seed=tokens)
    got = _triton_moe()(x, w13, w2, weights, ids, "silu", expert_map)
    _compare(got, _oracle(x, w13, w2, weights, ids, "silu", expert_map), f"EP T={tokens}")


@pytest.mark.parametrize("tokens", [5, 1])  # 1: no routing sort, zeros written per route
def test_no_local_routes_give_zeros_and_empty_batch(tokens):
    w13, w2 = _weights(8, 256, 128, torch.bfloat16)
    expert_map = torch.full((16,), -1, dtype=torch.int64, device="cuda")
    expert_map[:8] = torch.arange(8, device="cuda")
    x = torch.randn(tokens, 256, device="cuda").bfloat16()
    weights, ids = _routing(tokens, 8, 2, seed=1)
    got = _triton_moe()(x, w13, w2, weights, ids + 8, "silu", expert_map)  # all on another rank
    assert torch.equal(got, torch.zeros_like(got)), got
    empty = _triton_moe()(x[:0], w13, w2, weights[:0], ids[:0])
    assert empty.shape == (0, 256)


def test_routing_places_every_route_once():
    from flotilla.kernels import triton_moe

    tokens, top_k, experts, block_m = 300, 8, 64, 16
    _, ids = _routing(tokens, experts, top_k, seed=11)
    expert_map = torch.arange(experts, device="cuda")
    expert_map[::5] = -1  # some experts live elsewhere
    r = triton_moe.route(ids, experts, expert_map, block_m)
    sorted_route = r.sorted_route.cpu()
    block_expert = r.block_expert.cpu()
    local = expert_map[ids.reshape(-1)].cpu()
    real = sorted_route[sorted_route < ids.numel()]
    assert sorted(real.tolist()) == sorted((local >= 0).nonzero().flatten().tolist())
    for row, route in enumerate(sorted_route.tolist()):
        if route < ids.numel():
            assert block_expert[row // block_m] == local[route], (row, route)
    assert torch.equal(r.route_expert.cpu(), local.to(torch.int32))


@pytest.mark.parametrize("batch", [1, 8])
def test_cuda_graph_capture_and_replay(batch):
    moe = _triton_moe()
    w13, w2 = _weights(64, 2048, 768, torch.bfloat16)
    x = torch.randn(batch, 2048, device="cuda").bfloat16()
    weights, ids = _routing(batch, 64, 8, seed=21)
    moe(x, w13, w2, weights, ids)  # compile outside the graph
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = moe(x, w13, w2, weights, ids)
    for seed in (22, 23):  # new inputs in the captured buffers, then replay
        new_weights, new_ids = _routing(batch, 64, 8, seed=seed)
        x.copy_(torch.randn(batch, 2048, device="cuda").bfloat16())
        weights.copy_(new_weights)
        ids.copy_(new_ids)
        graph.replay()
        torch.cuda.synchronize()
        _compare(out.clone(), _oracle(x, w13, w2, weights, ids), f"graph replay batch={batch} seed={seed}")


# --------------------------------------------------------------------------- one token: folded route sum


def fold_case(device, dtype, hidden_size, inter, experts, top_k, seed, local=None):
    """One token's inputs: ``(x, w13, w2, weights, ids, expert_map)``, weights scaled so
    activations stay O(1). ``local``: this rank holds that many of the ``experts`` global
    slots (a scrambled map; the others are another rank's), and the token is routed to both
    kinds."""
    gen = torch.Generator().manual_seed(seed)
    num_local = local or experts
    w13 = (torch.randn(num_local, 2 * inter, hidden_size, generator=gen) / hidden_size**0.5).to(dtype)
    w2 = (torch.randn(num_local, hidden_size, inter, generator=gen) / inter**0.5).to(dtype)
    expert_map = None
    if local is not None:
        expert_map = torch.full((experts,), -1, dtype=torch.int64)
        expert_map[torch.randperm(experts, generator=gen)[:local]] = torch.randperm(local, generator=gen)
        expert_map = expert_map.to(device)
    x, weights, ids = one_token(device, dtype, hidden_size, experts, top_k, seed, expert_map)
    return x, w13.to(device), w2.to(device), weights, ids, expert_map


def one_token(device, dtype, hidden_size, experts, top_k, seed, expert_map=None):
    """A token and its routes ``(x, weights, ids)``; with an ``expert_map``, checked to hold
    both routes computed here and routes of another rank."""
    gen = torch.Generator().manual_seed(seed + 1000)
    x = torch.randn(1, hidden_size, generator=gen).to(dtype)
    weights, ids = torch.randn(1, experts, generator=gen).softmax(-1).topk(top_k, dim=-1)
    weights = weights / weights.sum(-1, keepdim=True)
    if expert_map is not None:
        held = expert_map.cpu()[ids[0]] >= 0
        assert held.any() and not held.all(), f"seed {seed}: want local and remote routes, got {held.tolist()}"
    return x.to(device), weights.to(device), ids.to(device)


def run_with_fold(fold, moe, *args):
    """``moe(*args)`` with ``triton_moe.FOLD_ROUTE_SUM`` set to ``fold`` (restored after)."""
    from flotilla.kernels import triton_moe

    before = triton_moe.FOLD_ROUTE_SUM
    triton_moe.FOLD_ROUTE_SUM = fold
    try:
        return moe(*args)
    finally:
        triton_moe.FOLD_ROUTE_SUM = before


def check_folded_route_sum(device, dtype, hidden_size, inter, experts, top_k, local=None, calls=3, seed=0):
    """``calls`` one-token calls in a row (one weight set, a new token and new routes each):
    the folded route sum is bit-identical to the separate route-sum kernel and matches the
    float32 oracle, and every tile counter is back at 0 after each call (a leftover count
    would make the next call's sum come early, from rows not yet written, or never)."""
    from flotilla.kernels import triton_moe

    moe = _triton_moe()
    x, w13, w2, weights, ids, expert_map = fold_case(device, dtype, hidden_size, inter, experts, top_k, seed, local)
    tiles = triton.cdiv(hidden_size, triton_moe.pick_config(top_k, w13.shape[0], 1).block_n_2)
    for call in range(calls):
        if call:
            x, weights, ids = one_token(device, dtype, hidden_size, experts, top_k, seed + call, expert_map)
        label = f"call {call}: H={hidden_size} I={inter} E={experts} k={top_k} local={local} {dtype}"
        unfolded = run_with_fold(False, moe, x, w13, w2, weights, ids, "silu", expert_map)
        folded = run_with_fold(True, moe, x, w13, w2, weights, ids, "silu", expert_map)
        counters = triton_moe._TILE_COUNTERS[(folded.device, tiles)]
        assert not counters.any(), f"{label}: counters left at {counters.tolist()}"
        assert torch.equal(folded, unfolded), f"{label}: folded differs in {(folded != unfolded).sum().item()} values"
        _compare(folded, _oracle(x, w13, w2, weights, ids, "silu", expert_map), label)


FOLD_SHAPES = {  # (hidden_size, inter, experts, top_k, local)
    "qwen3-30b-a3b": (2048, 768, 128, 8, None),
    "odd-tails": (200, 72, 6, 3, None),  # H, I multiples of no block size: column and K tails
    "ep-remote-routes": (512, 256, 64, 8, 16),  # routes held by another rank count in too
}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", list(FOLD_SHAPES))
def test_folded_route_sum_is_bit_identical(shape, dtype):
    check_folded_route_sum("cuda", dtype, *FOLD_SHAPES[shape])


def test_folded_route_sum_fp8_experts_is_bit_identical():
    """Block-FP8 experts at one token take the fold too (the table's tiles)."""
    from flotilla.kernels import fp8

    importlib.import_module("flotilla.kernels.triton_fp8")
    moe = registry.get("fp8_grouped_moe", "triton")
    x, w13, w2, weights, ids, _ = fold_case("cuda", torch.float32, 512, 256, 8, 2, seed=4)
    (w13_q, w13_s), (w2_q, w2_s) = fp8.quantize_block_fp8(w13), fp8.quantize_block_fp8(w2)
    args = (x.bfloat16(), w13_q, w13_s, w2_q, w2_s, weights, ids, "silu", None)
    assert torch.equal(run_with_fold(True, moe, *args), run_with_fold(False, moe, *args))


def test_folded_route_sum_in_a_cuda_graph():
    """One graph captured with the fold (EP map: remote routes too), replayed five times with
    a new token and new routes in its buffers: each replay equals the unfolded eager call bit
    for bit, and the counters are back at 0 after each."""
    from flotilla.kernels import triton_moe

    moe = _triton_moe()
    x, w13, w2, weights, ids, expert_map = fold_case("cuda", torch.bfloat16, 2048, 768, 128, 8, seed=40, local=64)
    args = (x, w13, w2, weights, ids, "silu", expert_map)
    run_with_fold(True, moe, *args)  # compile, and make the counters, outside the graph
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run_with_fold(True, moe, *args)
    counters = triton_moe._TILE_COUNTERS[(out.device, triton.cdiv(2048, triton_moe.SINGLE_TOKEN.block_n_2))]
    for replay in range(5):
        new_x, new_weights, new_ids = one_token("cuda", torch.bfloat16, 2048, 128, 8, 41 + replay, expert_map)
        x.copy_(new_x)
        weights.copy_(new_weights)
        ids.copy_(new_ids)
        graph.replay()
        torch.cuda.synchronize()
        assert not counters.any(), f"replay {replay}: counters left at {counters.tolist()}"
        want = run_with_fold(False, moe, *args)
        assert torch.equal(out, want), f"replay {replay}: differs in {(out != want).sum().item()} values"


# --------------------------------------------------------------------------- FP8 experts (weight-only)


@pytest.mark.parametrize("tokens,experts,top_k,hidden_size,inter,local", [
    (1, 8, 2, 512, 256, 8), (64, 64, 8, 2048, 768, 64), (300, 128, 8, 2048, 768, 128), (37, 32, 4, 512, 256, 12),
])
def test_fp8_experts_match_dequantized_reference(tokens, experts, top_k, hidden_size, inter, local):
    # Weight-only FP8: the weights are exact in both paths, so the bf16 tolerances apply.
    from flotilla.kernels import fp8

    gen = torch.Generator(device="cuda").manual_seed(tokens + experts)
    w13 = torch.randn(local, 2 * inter, hidden_size, device="cuda", generator=gen) / hidden_size**0.5
    w2 = torch.randn(local, hidden_size, inter, device="cuda", generator=gen) / inter**0.5
    (w13_q, w13_s), (w2_q, w2_s) = fp8.quantize_block_fp8(w13), fp8.quantize_block_fp8(w2)
    expert_map = None
    if local < experts:
        expert_map = torch.full((experts,), -1, dtype=torch.int64, device="cuda")
        expert_map[torch.randperm(experts, device="cuda", generator=gen)[:local]] = torch.arange(local, device="cuda")
    x = torch.randn(tokens, hidden_size, device="cuda", generator=gen).bfloat16()
    weights, ids = _routing(tokens, experts, top_k, seed=tokens)
    importlib.import_module("flotilla.kernels.triton_fp8")  # registers the triton FP8 ops
    got = registry.get("fp8_grouped_moe", "triton")(x, w13_q, w13_s, w2_q, w2_s, weights, ids, "silu", expert_map)
    want = fp8.fp8_grouped_moe(x.float(), w13_q, w13_s, w2_q, w2_s, weights, ids, "silu", expert_map)
    _compare(got, want, f"fp8 experts T={tokens} E={experts} k={top_k} H={hidden_size} I={inter} local={local}")


# --------------------------------------------------------------------------- select_experts (routing)
#
# The Triton select_experts against the torch reference run on the same CUDA logits. Scores
# agree to a few ulp (both use accurate exp and IEEE division; the softmax sums are reduced
# in different orders), so weights must match within SELECT_RTOL. The logits are distinct
# with gaps of at least 2/E, so no two experts' scores are within rounding of each other and
# the ids (best first) must be equal; correction-bias keys are continuous, so there a near
# tie at the k-th place (gap below NEAR_TIE) may pick either expert.

SELECT_RTOL = 1e-6
NEAR_TIE = 1e-5


def _triton_select():
    importlib.import_module("flotilla.kernels.triton_moe")  # registers select_experts through triton_routing
    return registry.get("select_experts", "triton")


def _distinct_logits(tokens, experts, seed):
    """``[T, E]`` float32 logits in about [-2, 2]: a random permutation of ``E`` levels
    ``4/E`` apart, each jittered by at most half a level."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    levels = torch.rand(tokens, experts, device="cuda", generator=gen).argsort(dim=-1).float()
    jitter = 0.5 * torch.rand(tokens, experts, device="cuda", generator=gen)
    return (levels - experts / 2 + jitter) * (4.0 / experts)


def _by_id(weights, ids):
    order = ids.argsort(dim=-1)
    return weights.gather(1, order), ids.gather(1, order)


@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("scoring", ["softmax", "sigmoid"])
@pytest.mark.parametrize("top_k", [1, 2, 6, 8])
@pytest.mark.parametrize("experts", [8, 60, 128, 256])
@pytest.mark.parametrize("tokens", [1, 3, 64, 257])
def test_select_experts_matches_torch(tokens, experts, top_k, scoring, renormalize):
    from flotilla.kernels.moe import select_experts

    logits = _distinct_logits(tokens, experts, seed=tokens * 1000 + experts * 10 + top_k)
    scale = 2.5 if scoring == "sigmoid" else 1.0  # DeepSeek-V3 scales its sigmoid weights
    got_w, got_ids = _triton_select()(logits, top_k, renormalize, scoring, routed_scaling_factor=scale)
    want_w, want_ids = select_experts(logits, top_k, renormalize, scoring, routed_scaling_factor=scale)
    label = f"T={tokens} E={experts} k={top_k} {scoring} renormalize={renormalize}"
    assert got_w.dtype == torch.float32 and got_ids.dtype == want_ids.dtype == torch.int64, label
    assert got_w.shape == got_ids.shape == (tokens, top_k), label
    mismatched = (got_ids != want_ids).any(dim=-1).nonzero().flatten().tolist()
    first = mismatched[:1]
    assert not mismatched, f"{label}: ids differ in tokens {mismatched[:5]}: {got_ids[first]} vs {want_ids[first]}"
    torch.testing.assert_close(got_w, want_w, rtol=SELECT_RTOL, atol=1e-12, msg=lambda m: f"{label}: {m}")


@pytest.mark.parametrize("tokens", [1, 64, 257])
@pytest.mark.parametrize("scoring,experts,top_k", [("sigmoid", 256, 8), ("softmax", 60, 4)])
def test_select_experts_correction_bias(tokens, scoring, experts, top_k):
    from flotilla.kernels.moe import select_experts

    logits = _distinct_logits(tokens, experts, seed=tokens + experts)
    bias = torch.rand(experts, device="cuda", generator=torch.Generator(device="cuda").manual_seed(4)) * 0.1
    got_w, got_ids = _triton_select()(logits, top_k, True, scoring, correction_bias=bias, routed_scaling_factor=2.5)
    want_w, want_ids = select_experts(logits, top_k, True, scoring, correction_bias=bias, routed_scaling_factor=2.5)
    scores = logits.softmax(-1) if scoring == "softmax" else logits.sigmoid()
    top = (scores + bias).topk(top_k + 1, dim=-1).values
    clear = (top[:, top_k - 1] - top[:, top_k]) > NEAR_TIE * top[:, top_k - 1].abs()
    assert clear.float().mean() > 0.9, "the test data should rarely tie"
    (got_w, got_ids), (want_w, want_ids) = _by_id(got_w, got_ids), _by_id(want_w, want_ids)
    assert torch.equal(got_ids[clear], want_ids[clear]), f"T={tokens} {scoring}: ids differ away from near ties"
    torch.testing.assert_close(got_w[clear], want_w[clear], rtol=SELECT_RTOL, atol=1e-12)


def test_select_experts_ties_take_the_lowest_ids():
    # bf16 integer logits: many exact ties. Among equal scores the lowest ids come first, the
    # set CUDA torch.topk keeps (gatherTopK fills the last places with the first-seen equals).
    from flotilla.kernels.moe import select_experts

    gen = torch.Generator(device="cuda").manual_seed(8)
    logits = torch.randint(0, 3, (64, 128), device="cuda", generator=gen).to(torch.bfloat16)
    got_w, got_ids = _triton_select()(logits, 8, True)
    stable = torch.sort(logits.float(), dim=-1, descending=True, stable=True).indices[:, :8]
    assert torch.equal(got_ids, stable)
    want_w, want_ids = select_experts(logits, 8, True)
    assert torch.equal(got_ids.sort(-1).values, want_ids.sort(-1).values), "not the set torch.topk picks"
    torch.testing.assert_close(got_w, want_w, rtol=SELECT_RTOL, atol=1e-12)  # tied weights are equal


def test_select_experts_delegates_group_routing_and_empty_batch():
    from flotilla.kernels.moe import select_experts

    logits = _distinct_logits(5, 256, seed=3)
    bias = torch.linspace(0, 0.1, 256, device="cuda")
    kwargs = dict(num_expert_group=8, topk_group=4, correction_bias=bias, routed_scaling_factor=2.5)
    got = _triton_select()(logits, 8, True, "sigmoid", **kwargs)
    want = select_experts(logits, 8, True, "sigmoid", **kwargs)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    weights, ids = _triton_select()(logits[:0], 8, True)
    assert weights.shape == ids.shape == (0, 8)
    with pytest.raises(ValueError, match="top_k=9"):
        _triton_select()(logits[:, :8], 9, True)


def test_select_experts_cuda_graph_capture_and_replay():
    from flotilla.kernels.moe import select_experts

    select = _triton_select()
    logits = _distinct_logits(4, 128, seed=30)
    select(logits, 8, True)  # compile outside the graph
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        weights, ids = select(logits, 8, True)
    for seed in (31, 32):
        logits.copy_(_distinct_logits(4, 128, seed=seed))
        graph.replay()
        torch.cuda.synchronize()
        want_w, want_ids = select_experts(logits, 8, True)
        assert torch.equal(ids, want_ids), f"replay seed={seed}"
        torch.testing.assert_close(weights, want_w, rtol=SELECT_RTOL, atol=1e-12)


def test_moe_layer_routes_with_the_triton_select():
    from flotilla.cluster.models.moe_layer import FusedMoE

    layer = FusedMoE(16, 4, 64, 32, renormalize=True, backend="triton")
    assert layer._select is _triton_select()
