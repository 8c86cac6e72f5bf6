"""FusedMoE on one rank routes and runs its experts as one op (``fused_moe_from_logits``), the
seam where the Triton backend saves launches at decode batch sizes (tests/gpu/test_triton_moe_fusion.py).

On the CPU the op is the torch reference, so the layer's output through it must EQUAL the
output of the separate path (``route``, then the dispatcher and ``compute``): the same
operations on the same values. The routing arguments of a DeepSeek-V3-style layer (sigmoid
scores, group-limited choice, correction bias, scaling) must all reach the op, the expert-load
recorder must still see the router's ids, and layouts the op does not cover (redundant expert
copies: a slot is not the logical id) must keep the separate path.
"""

from __future__ import annotations

import torch

from flotilla.cluster.models.moe_layer import FusedMoE

E, K, H, I = 8, 2, 16, 8


def _layer(**kwargs) -> FusedMoE:
    layer = FusedMoE(E, K, H, I, renormalize=True, **kwargs)
    gen = torch.Generator().manual_seed(0)
    layer.w13.data.copy_(torch.randn(layer.w13.shape, generator=gen) / H**0.5)
    layer.w2.data.copy_(torch.randn(layer.w2.shape, generator=gen) / I**0.5)
    return layer


def _separate(layer: FusedMoE, x, logits, bias=None):
    weights, ids = layer.route(logits, bias)
    return layer.compute(x, weights, layer.slots_for(ids))


class _CountingOp:
    def __init__(self, op):
        self.op, self.calls = op, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.op(*args, **kwargs)


class _Recorder:
    def __init__(self):
        self.seen = []

    def record(self, layer_index, ids):
        self.seen.append((layer_index, ids.clone()))


def test_one_rank_takes_the_from_logits_op_with_every_routing_argument():
    layer = _layer(scoring="sigmoid", num_expert_group=4, topk_group=2, routed_scaling_factor=2.5)
    op = layer._from_logits = _CountingOp(layer._from_logits)
    recorder = layer.load_recorder = _Recorder()
    gen = torch.Generator().manual_seed(1)
    x, logits = torch.randn(6, H, generator=gen), torch.randn(6, E, generator=gen)
    bias = torch.rand(E, generator=gen) * 0.5
    got = layer(x, logits, bias)
    assert op.calls == 1
    want = _separate(layer, x, logits, bias)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    # NOTE: the arguments matter here: without the bias or the groups the choice changes.
    assert not torch.equal(_separate(layer, x, logits), want)
    assert recorder.seen[0][0] == layer.load_layer_index
    assert torch.equal(recorder.seen[0][1], layer.route(logits, bias)[1])


def test_redundant_copies_keep_the_separate_path():
    layer = _layer(num_redundant_experts=2)
    assert not layer.identity_slots
    op = layer._from_logits = _CountingOp(layer._from_logits)
    gen = torch.Generator().manual_seed(2)
    x, logits = torch.randn(5, H, generator=gen), torch.randn(5, E, generator=gen)
    got = layer(x, logits)
    assert op.calls == 0
    torch.testing.assert_close(got, _separate(layer, x, logits), rtol=0, atol=0)
