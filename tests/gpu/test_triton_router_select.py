"""One token's router GEMV and expert selection in one launch (op ``router_select``, backend
``triton``) against the two launches it replaces, on CUDA.

The fused kernel runs the one-row GEMV's jit code with its launch configuration, stores the
logits rounded to the router's dtype, and its last program runs ``select_experts``' selection
(whose every reduction is exact or order-free) on them. So the logits, weights and ids must
be BIT-IDENTICAL to ``triton_gemv.gemv`` followed by the ``triton`` ``select_experts``: no
tolerance. The torch reference is checked on top only for the ids, away from near ties (the
Triton selection's scores differ from torch's by an ulp or two, tests/gpu/test_triton_moe.py).

The check helpers take a ``device``, so the same comparisons run under Triton's CPU
interpreter (tests/kernels/test_triton_folds_interpreted.py, small shapes, float16/float32).
The interpreter runs one program at a time: there they check the arithmetic and the counting
(the last program selects, the counter back at zero), not the memory ordering between
concurrent programs, which the CUDA runs below add.
"""

import importlib

import pytest
import torch

from flotilla.kernels import registry

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
triton = pytest.importorskip("triton")


def _routing():
    return importlib.import_module("flotilla.kernels.triton_routing")


def router_case(device, x_dtype, w_dtype, experts, hidden_size, seed, bias=False, levels=None):
    """A token ``x[1, H]``, a router ``w[E, H]`` scaled for O(1) logits, and a correction
    bias ``[E]`` float32 (or None). ``levels``: the router's rows are drawn from that many
    distinct rows, so many logits tie exactly (equal rows give equal dot products)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(1, hidden_size, generator=gen).to(x_dtype)
    w = torch.randn(levels or experts, hidden_size, generator=gen) / hidden_size**0.5
    if levels:
        w = w[torch.randint(0, levels, (experts,), generator=gen)]
    b = torch.rand(experts, generator=gen) * 0.1 if bias else None
    return x.to(device), w.to(w_dtype).to(device), None if b is None else b.to(device)


def separate(x, w, top_k, renormalize, scoring, bias, scaling):
    """The two launches the fused kernel replaces: the one-row GEMV (on ``x`` in the router's
    dtype, as ``MoERouter`` casts it) and the Triton selection. ``(weights, ids, logits)``."""
    from flotilla.kernels.triton_gemv import gemv

    logits = gemv(x.to(w.dtype), w)
    weights, ids = _routing().launch_select_experts(logits, top_k, renormalize, scoring, bias, scaling)
    return weights, ids, logits


def assert_same(got, want, label):
    """``(weights, ids, logits)`` equal bit for bit (NaN-free inputs: ``torch.equal``)."""
    for name, a, b in zip(("weights", "ids", "logits"), got, want):
        assert a.dtype == b.dtype and a.shape == b.shape, f"{label}: {name} {a.dtype}{tuple(a.shape)} vs {b.dtype}{tuple(b.shape)}"
        assert torch.equal(a, b), f"{label}: {name} differ in {(a != b).sum().item()} places: {a} vs {b}"


def assert_counter_zero(device, label):
    """The router_select counter of ``device`` (a tensor's device) is back at zero."""
    counter = _routing()._SELECT_COUNTERS[device]
    assert not counter.any(), f"{label}: counter left at {counter.tolist()}"


def check_router_select(
    device, x_dtype, w_dtype, experts, top_k, hidden_size, scoring="softmax", renormalize=True, bias=False,
    scaling=1.0, levels=None, calls=3, seed=0,
):  # fmt: skip
    """``calls`` tokens in a row through the fused kernel: logits, weights and ids bit-identical
    to :func:`separate`, the counter back at zero after each call (a leftover count would make
    the next call select early, from logits not yet stored, or never), and the ids those of
    the torch reference where its k-th and (k+1)-th keys are apart."""
    from flotilla.kernels.moe import select_experts

    for call in range(calls):
        x, w, b = router_case(device, x_dtype, w_dtype, experts, hidden_size, seed + call, bias, levels)
        label = f"call {call}: E={experts} k={top_k} H={hidden_size} x {x_dtype} router {w_dtype} {scoring} bias={bias}"
        got = _routing().launch_router_select(x, w, top_k, renormalize, scoring, b, scaling)
        assert_counter_zero(x.device, label)
        want = separate(x, w, top_k, renormalize, scoring, b, scaling)
        assert_same(got, want, label)
        ref_w, ref_ids = select_experts(want[2], top_k, renormalize, scoring, correction_bias=b, routed_scaling_factor=scaling)
        scores = want[2].float().softmax(-1) if scoring == "softmax" else want[2].float().sigmoid()
        keys = (scores if b is None else scores + b).sort(dim=-1, descending=True, stable=True)
        if top_k == experts or keys.values[0, top_k - 1] - keys.values[0, top_k] > 1e-5:
            assert torch.equal(got[1].sort(-1).values, ref_ids.sort(-1).values), f"{label}: not the reference's experts"
        if levels:  # exact ties: the lowest ids first (the order of a stable descending sort)
            assert torch.equal(got[1], keys.indices[:, :top_k]), f"{label}: ties not to the lowest ids"


SHAPES = {  # experts, top_k, hidden_size, scoring, renormalize, bias, scaling
    "qwen3-30b-a3b": (128, 8, 2048, "softmax", True, False, 1.0),
    "mixtral": (8, 2, 4096, "softmax", True, False, 1.0),
    "deepseek-v3-sigmoid": (256, 8, 7168, "sigmoid", True, True, 2.5),
    "softmax-bias-no-renorm": (60, 4, 1000, "softmax", False, True, 1.0),  # K tail, E not a power of 2
}
DTYPES = {  # token, router
    "bf16": (torch.bfloat16, torch.bfloat16),
    "fp16": (torch.float16, torch.float16),
    "float32-router": (torch.bfloat16, torch.float32),
}


@pytest.mark.parametrize("dtypes", list(DTYPES))
@pytest.mark.parametrize("shape", list(SHAPES))
def test_router_select_is_bit_identical_to_gemv_then_select(shape, dtypes):
    experts, top_k, hidden, scoring, renormalize, bias, scaling = SHAPES[shape]
    check_router_select("cuda", *DTYPES[dtypes], experts, top_k, hidden, scoring, renormalize, bias, scaling)


@pytest.mark.parametrize("dtypes", ["bf16", "fp16"])
@pytest.mark.parametrize("experts,top_k,levels", [(128, 8, 5), (8, 2, 3), (64, 6, 2)])
def test_router_select_ties_take_the_lowest_ids(experts, top_k, levels, dtypes):
    check_router_select("cuda", *DTYPES[dtypes], experts, top_k, 2048, levels=levels, seed=7)


def test_router_select_in_a_cuda_graph():
    """Captured after one call, replayed five times with a new token in the captured buffer:
    each replay equals the separate launches run eagerly, bit for bit, and the counter is back
    at zero after each."""
    routing = _routing()
    x, w, _ = router_case("cuda", torch.bfloat16, torch.bfloat16, 128, 2048, seed=50)
    routing.router_select_experts(x, w, 8, True)  # compile, and make the counter, outside the graph
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        weights, ids = routing.router_select_experts(x, w, 8, True)
    for replay in range(5):
        x.copy_(router_case("cuda", torch.bfloat16, torch.bfloat16, 128, 2048, seed=51 + replay)[0])
        graph.replay()
        torch.cuda.synchronize()
        assert_counter_zero(x.device, f"replay {replay}")
        want_w, want_ids, _ = separate(x, w, 8, True, "softmax", None, 1.0)
        assert torch.equal(ids, want_ids) and torch.equal(weights, want_w), f"replay {replay}: {ids} vs {want_ids}"


def test_router_select_op_declines_what_it_does_not_cover():
    routing = _routing()
    op = registry.get("router_select", "triton")
    x, w, _ = router_case("cuda", torch.bfloat16, torch.bfloat16, 64, 512, seed=3)
    assert op(x, w, 4, True) is not None
    assert op(torch.cat([x, x]), w, 4, True) is None  # two tokens
    assert op(x.cpu(), w.cpu(), 4, True) is None  # not CUDA
    assert op(x, w, 4, True, num_expert_group=4, topk_group=2) is None  # group-limited
    assert op(x, w, 4, True, num_expert_group=1, topk_group=1) is not None  # one group: no limit
    assert op(x, w.half(), 4, True) is None  # router in another half dtype
    assert op(x.float(), w.float(), 4, True) is None  # a float32 model: no one-row GEMV there
    wide = torch.randn(routing.MAX_EXPERTS + 1, 512, device="cuda", dtype=torch.bfloat16)
    assert op(x, wide, 4, True) is None
    before = routing.FUSED_ROUTER_SELECT
    routing.FUSED_ROUTER_SELECT = False
    try:
        assert op(x, w, 4, True) is None
    finally:
        routing.FUSED_ROUTER_SELECT = before


def test_router_select_names_bad_parameters():
    select = _routing().router_select_experts
    x, w, _ = router_case("cuda", torch.bfloat16, torch.bfloat16, 16, 256, seed=4)
    with pytest.raises(ValueError, match="top_k=17"):
        select(x, w, 17, True)
    with pytest.raises(ValueError, match="scoring='relu'"):
        select(x, w, 2, True, scoring="relu")
    with pytest.raises(ValueError, match=r"shape \(2, 256\)"):
        select(torch.cat([x, x]), w, 2, True)
    with pytest.raises(ValueError, match=r"weight must be .* \[E, 256\]"):
        select(x, w[:, :128], 2, True)
    with pytest.raises(ValueError, match="weight.dtype=torch.float16"):
        select(x, w.half(), 2, True)
    with pytest.raises(ValueError, match="correction_bias"):
        select(x, w, 2, True, correction_bias=torch.zeros(15, device="cuda"))
    with pytest.raises(ValueError, match="CUDA"):
        select(x.cpu(), w.cpu(), 2, True)


# --------------------------------------------------------------------------- the MoE layer


def moe_layer(experts, top_k, hidden, inter, router_dtype, scoring="softmax", bias=False, redundant=0, seed=0):
    """A ``FusedMoE`` (backend ``triton``) and its ``MoERouter`` on CUDA in bf16, random weights,
    the router on the ``triton`` linear op and handed ``router_select`` (as ``use_linear_op``)."""
    from flotilla.cluster.models.moe_layer import FusedMoE, MoERouter

    gen = torch.Generator(device="cuda").manual_seed(seed)
    moe = FusedMoE(
        experts, top_k, hidden, inter, renormalize=True, scoring=scoring, routed_scaling_factor=2.5 if bias else 1.0,
        num_redundant_experts=redundant, dtype=torch.bfloat16, backend="triton",
    ).cuda()  # fmt: skip
    moe.w13.data.copy_(torch.randn(moe.w13.shape, generator=gen, device="cuda") / hidden**0.5)
    moe.w2.data.copy_(torch.randn(moe.w2.shape, generator=gen, device="cuda") / inter**0.5)
    float32_logits = router_dtype == torch.float32
    router = MoERouter(hidden, experts, bias, float32_logits, dtype=torch.bfloat16).cuda()
    router.weight.data.copy_(torch.randn(experts, hidden, generator=gen, device="cuda") / hidden**0.5)
    if bias:
        router.e_score_correction_bias.data.copy_(torch.rand(experts, generator=gen, device="cuda") * 0.1)
    router.linear_op = registry.get("linear", "triton")
    router.router_select = registry.get("router_select", "triton")
    return moe, router


def _with_fused(on, fn, *args):
    routing = _routing()
    before = routing.FUSED_ROUTER_SELECT
    routing.FUSED_ROUTER_SELECT = on
    try:
        return fn(*args)
    finally:
        routing.FUSED_ROUTER_SELECT = before


@pytest.mark.parametrize("redundant", [0, 4])  # 4: replica slots, so slots_for maps the logical ids
def test_moe_block_one_token_is_the_same_with_and_without_the_fused_router(redundant):
    """A Qwen3-30B-A3B-shaped MoE block (bf16 router: the fused path replaces the one-row GEMV
    and the Triton select exactly): one decode token's output is bit-identical with
    FUSED_ROUTER_SELECT on and off, the fused op took the call, and a batch of 3 declines it."""
    moe, router = moe_layer(128, 8, 2048, 768, torch.bfloat16, redundant=redundant)
    for seed in range(3):
        x = torch.randn(1, 2048, generator=torch.Generator().manual_seed(seed)).bfloat16().cuda()
        on = _with_fused(True, moe.forward_with_router, x, router)
        off = _with_fused(False, moe.forward_with_router, x, router)
        assert torch.equal(on, off), f"seed {seed}: differs in {(on != off).sum().item()} values"
        assert torch.equal(on, moe(x, router(x)))
    assert router.router_select(x, router.weight, 8, True) is not None
    batch = torch.randn(3, 2048, device="cuda").bfloat16()
    assert router.router_select(batch, router.weight, 8, True) is None
    assert torch.equal(moe.forward_with_router(batch, router), moe(batch, router(batch)))


def test_moe_block_float32_router_matches_the_triton_gemv_logits():
    """A DeepSeek-style block (float32 router, sigmoid, correction bias, scaling): the fused
    path's output is that of the experts on ``gemv(x.float(), W)``'s logits, bit for bit. (Its
    switched-off path computes the float32 logits with cuBLAS, another summation order.)"""
    from flotilla.kernels.triton_gemv import gemv

    moe, router = moe_layer(64, 6, 2048, 256, torch.float32, scoring="sigmoid", bias=True, seed=1)
    x = torch.randn(1, 2048, generator=torch.Generator().manual_seed(9)).bfloat16().cuda()
    got = _with_fused(True, moe.forward_with_router, x, router)
    want = moe(x, gemv(x.float(), router.weight), router.e_score_correction_bias)
    assert torch.equal(got, want)
