"""One token's router GEMV and expert selection in one launch (``triton_routing.router_select``)
under Triton's CPU interpreter, against the one-row GEMV then the Triton selection.

The checks are tests/gpu/test_triton_router_select.py's (``check_router_select``: logits,
weights and ids bit-identical to the two launches, the counter back at zero after each of
three calls, the torch reference's experts away from near ties, exact ties to the lowest
ids), run with ``device="cpu"`` on small shapes in float16 and float32 (the 3.6 interpreter's
bfloat16 arithmetic is unreliable). What this covers: the GEMV's arithmetic and rounding of
the logits, the selection on the stored logits, which program selects (the one that brings
the counter to the number of programs) and the reset. What it cannot: the interpreter runs
one program at a time, so the memory ordering between concurrent programs (the barrier, the
``acq_rel`` atomic, the ``.cg`` loads) is only exercised by the CUDA runs in tests/gpu.

Run (this venv has no Triton; /tmp/tritonsite is where this machine keeps a 3.6 copy):
``PYTHONPATH=/tmp/tritonsite TRITON_INTERPRET=1 pytest tests/kernels/test_triton_router_select_interpreted.py``.
Without ``TRITON_INTERPRET=1`` (CI, or a GPU machine) this file is not collected
(tests/conftest.py): the GPU tier runs the same checks on CUDA.
"""

import os

import pytest
import torch

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="runs under Triton's interpreter only (TRITON_INTERPRET=1)"
)
pytest.importorskip("triton")

SHAPES = {  # experts, top_k, hidden_size, scoring, renormalize, bias, scaling
    "softmax-renormalize": (16, 4, 256, "softmax", True, False, 1.0),
    "mixtral-like": (8, 2, 96, "softmax", True, False, 1.0),  # K tail: 96 is no multiple of BLOCK_K
    "sigmoid-bias-scaling": (32, 8, 128, "sigmoid", True, True, 2.5),
    "odd-experts-no-renormalize": (6, 3, 64, "softmax", False, True, 1.0),  # 3 programs of 2, E_PAD 8
    "top-k-is-every-expert": (4, 4, 64, "softmax", True, False, 1.0),
}
DTYPES = {  # token, router
    "fp16": (torch.float16, torch.float16),
    "float32": (torch.float32, torch.float32),
    "float32-router": (torch.float16, torch.float32),
}


@pytest.mark.parametrize("dtypes", list(DTYPES))
@pytest.mark.parametrize("shape", list(SHAPES))
def test_router_select_is_bit_identical_to_gemv_then_select(shape, dtypes):
    from gpu.test_triton_router_select import check_router_select

    experts, top_k, hidden, scoring, renormalize, bias, scaling = SHAPES[shape]
    check_router_select("cpu", *DTYPES[dtypes], experts, top_k, hidden, scoring, renormalize, bias, scaling)


@pytest.mark.parametrize("experts,top_k,levels", [(16, 4, 3), (8, 2, 2), (32, 8, 5)])
def test_router_select_ties_take_the_lowest_ids(experts, top_k, levels):
    from gpu.test_triton_router_select import check_router_select

    check_router_select("cpu", torch.float16, torch.float16, experts, top_k, 128, levels=levels, seed=7)


def test_select_experts_softmax_weights_are_within_ulps_of_the_exact_ones():
    """The selection's softmax denominator is a fixed-point integer sum (the same bits for any
    num_warps: the separate select's 1 warp at E=128 and the fused kernel's 4): the weights
    stay within ~2 ulp of the exact softmax (``_exp`` ~1 ulp, the sum and the division half
    an ulp each)."""
    from flotilla.kernels import triton_routing
    from flotilla.kernels.moe import select_experts

    gen = torch.Generator().manual_seed(5)
    logits = (torch.randn(4, 128, generator=gen) * 3).half()
    weights, ids = triton_routing.launch_select_experts(logits, 8, False, "softmax", None, 1.0)
    want_w, want_ids = select_experts(logits, 8, False)
    assert torch.equal(ids, want_ids)
    # Float64 reference: one float32 rounding of the exact softmax, within ~2 ulp (exp, division).
    exact = torch.softmax(logits.double(), dim=-1).gather(1, ids)
    torch.testing.assert_close(weights.double(), exact, rtol=3e-7, atol=0)


@pytest.mark.parametrize("kind", ["distinct", "ties", "minus-inf"])
@pytest.mark.parametrize("scoring,bias", [("softmax", False), ("softmax", True), ("sigmoid", True), ("sigmoid", False)])
@pytest.mark.parametrize("experts,top_k", [(6, 1), (6, 4), (128, 8), (256, 6)])
def test_select_experts_picks_the_best_keys_lowest_ids_first(experts, top_k, scoring, bias, kind):
    """The selection both kernels share (one packed key-and-id max per rank): the ``top_k``
    best keys, equal keys by lowest id (the order of a stable descending sort of the keys),
    distinct ids even among ``-inf`` keys, the weights within SELECT_RTOL of the reference's."""
    from flotilla.kernels import triton_routing
    from flotilla.kernels.moe import select_experts

    gen = torch.Generator().manual_seed(experts * 10 + top_k)
    logits = torch.randn(4, experts, generator=gen) * 2
    correction = torch.rand(experts, generator=gen) * 0.1 if bias else None
    if kind == "ties":
        logits = torch.randint(0, 3, (4, experts), generator=gen).float()
    elif kind == "minus-inf" and bias:
        correction[: experts - 1] = float("-inf")  # every key but one -inf
    elif kind == "minus-inf":
        logits[:, : experts // 2] = float("-inf")
    logits = logits.half()
    weights, ids = triton_routing.launch_select_experts(logits, top_k, True, scoring, correction, 2.5)
    scores = logits.float().softmax(-1) if scoring == "softmax" else logits.float().sigmoid()
    keys = scores if correction is None else scores + correction
    assert all(len(set(row)) == top_k for row in ids.tolist()), ids
    if kind == "distinct":
        # torch's scores may order an ulp-close pair otherwise; there are none at this spread
        want_w, want_ids = select_experts(logits, top_k, True, scoring, correction_bias=correction, routed_scaling_factor=2.5)
        assert torch.equal(ids, want_ids)
    else:
        # exact ties: CPU torch.topk keeps any of the equals (CUDA's keeps the lowest ids)
        assert torch.equal(ids, keys.sort(dim=-1, descending=True, stable=True).indices[:, :top_k]), ids
        chosen = scores.gather(1, ids)
        want_w = chosen / (chosen.sum(-1, keepdim=True) + 1e-20) * 2.5
    torch.testing.assert_close(weights, want_w, rtol=1e-6, atol=1e-12)
