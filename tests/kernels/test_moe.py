"""select_experts + fused_moe against HF's MoE blocks: Mixtral, Qwen3-MoE (softmax
top-k, renormalised or not), DeepSeek-V2 (group-limited greedy) and DeepSeek-V3
(sigmoid, correction bias, grouped top-k, scaling)."""

import pytest
import torch
from transformers import DeepseekV2Config, DeepseekV3Config, MixtralConfig, Qwen3MoeConfig
from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2Moe
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE, DeepseekV3TopkRouter
from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

from flotilla.kernels.moe import select_experts
from flotilla.kernels.registry import get

HIDDEN, INTER, TOKENS = 32, 16, 24
# fp32, the same per-expert matmuls as HF's blocks, blocked and summed in another order (GEMM
# kernel, thread split, order over a token's k experts). A K-term fp32 sum of |terms| adding up
# to S moves by ~u * S when reassociated, K * u * S at worst (u = 2^-24 = 6e-8). Each output here
# sums 16 terms with S <= 175 (over routes, w * sum_j |h_j||w2_j|; |out| <= 130) after 32-term
# sums into h: ~1e-5 typical, 1.7e-4 worst; measured <= 1.5e-5 (MKL_CBWR, ATEN_CPU_CAPABILITY,
# 1-3 threads). The error follows S, not each output (a small output can come from large terms),
# so the bound is absolute: atol 1e-4. A wrong expert, routing weight or activation moves outputs
# of this size by O(1).
ATOL, RTOL = 1e-4, 0
# Routing is compared exactly. The closest last-chosen / first-unchosen router logits of these
# blocks are 2.3e-3 apart (group and biased-sigmoid scores: >= 6.9e-4), against <= 32 * u *
# sum|x||w_gate| ~ 4e-5 of rounding in the 32-term router GEMM: no route hinges on a near-tie.


def _randomize(module):
    torch.manual_seed(1)
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(0, 0.5)
    return module


def _routes(weights, ids):
    """(id, weight) pairs per token, sorted by id: order-free comparison."""
    order = ids.argsort(dim=-1)
    return ids.gather(1, order), weights.gather(1, order)


def _run(block_experts, x, weights, ids, activation="silu"):
    return get("fused_moe")(x, block_experts.gate_up_proj.data, block_experts.down_proj.data, weights, ids, activation)


def test_mixtral_block():
    config = MixtralConfig(hidden_size=HIDDEN, intermediate_size=INTER, num_local_experts=8, num_experts_per_tok=2)
    block = _randomize(MixtralSparseMoeBlock(config)).eval()
    x = torch.randn(TOKENS, HIDDEN)
    logits = x @ block.gate.weight.t()
    weights, ids = select_experts(logits, top_k=2, renormalize=True)
    assert weights.dtype == torch.float32
    with torch.no_grad():
        expected = block(x.unsqueeze(0))[0]
        _, hf_weights, hf_ids = block.gate(x)
    torch.testing.assert_close(_routes(weights, ids), _routes(hf_weights, hf_ids))
    torch.testing.assert_close(_run(block.experts, x, weights, ids), expected, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_qwen3_moe_block(norm_topk_prob):
    config = Qwen3MoeConfig(
        hidden_size=HIDDEN, moe_intermediate_size=INTER, num_experts=8, num_experts_per_tok=3, norm_topk_prob=norm_topk_prob
    )
    block = _randomize(Qwen3MoeSparseMoeBlock(config)).eval()
    x = torch.randn(TOKENS, HIDDEN)
    weights, ids = select_experts(x @ block.gate.weight.t(), top_k=3, renormalize=norm_topk_prob)
    with torch.no_grad():
        expected = block(x.unsqueeze(0))[0]
    torch.testing.assert_close(_run(block.experts, x, weights, ids), expected, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("topk_method", ["greedy", "group_limited_greedy"])
def test_deepseek_v2_routing(topk_method):
    config = DeepseekV2Config(
        hidden_size=HIDDEN, moe_intermediate_size=INTER, n_routed_experts=16, num_experts_per_tok=3,
        n_group=4, topk_group=2, topk_method=topk_method, routed_scaling_factor=2.5, n_shared_experts=1,
    )
    block = _randomize(DeepseekV2Moe(config)).eval()
    x = torch.randn(TOKENS, HIDDEN)
    grouped = topk_method == "group_limited_greedy"
    weights, ids = select_experts(
        x @ block.gate.weight.t(), top_k=3, renormalize=False,
        num_expert_group=4 if grouped else None, topk_group=2 if grouped else None, routed_scaling_factor=2.5,
    )
    with torch.no_grad():
        _, hf_weights, hf_ids = block.gate(x)
        expected = block(x.unsqueeze(0))[0] - block.shared_experts(x)
    torch.testing.assert_close(_routes(weights, ids), _routes(hf_weights, hf_ids))
    torch.testing.assert_close(_run(block.experts, x, weights, ids), expected, rtol=RTOL, atol=ATOL)


def test_group_limit_changes_routing():
    """A test that can fail: with groups, experts outside the chosen groups are never picked."""
    torch.manual_seed(0)
    logits = torch.randn(64, 16)
    _, free_ids = select_experts(logits, top_k=4, renormalize=False)
    _, ids = select_experts(logits, top_k=4, renormalize=False, num_expert_group=4, topk_group=1)
    assert ((ids // 4) == (ids[:, :1] // 4)).all()  # all four from one group
    assert not torch.equal(free_ids.sort(-1)[0], ids.sort(-1)[0])


def test_deepseek_v3_gate_and_block():
    config = DeepseekV3Config(
        hidden_size=HIDDEN, moe_intermediate_size=INTER, n_routed_experts=16, num_experts_per_tok=4,
        n_group=4, topk_group=2, norm_topk_prob=True, routed_scaling_factor=2.5, n_shared_experts=1,
    )
    block = _randomize(DeepseekV3MoE(config)).eval()
    assert isinstance(block.gate, DeepseekV3TopkRouter)
    bias = torch.randn(16) * 0.5
    block.gate.e_score_correction_bias.copy_(bias)
    x = torch.randn(TOKENS, HIDDEN)
    weights, ids = select_experts(
        x @ block.gate.weight.t(), top_k=4, renormalize=True, scoring="sigmoid",
        num_expert_group=4, topk_group=2, correction_bias=bias, routed_scaling_factor=2.5,
    )
    with torch.no_grad():
        _, hf_weights, hf_ids = block.gate(x)
        expected = block(x.unsqueeze(0))[0] - block.shared_experts(x)
    torch.testing.assert_close(_routes(weights, ids), _routes(hf_weights, hf_ids))
    # Weights sum to the scaling factor after renormalisation.
    torch.testing.assert_close(weights.sum(-1), torch.full((TOKENS,), 2.5))
    torch.testing.assert_close(_run(block.experts, x, weights, ids), expected, rtol=RTOL, atol=ATOL)


def test_expert_map_splits_work_across_ranks():
    """Two 'ranks' holding half the experts each sum to the single-rank result; unheld routes add nothing."""
    torch.manual_seed(0)
    num_experts = 6
    w13, w2 = torch.randn(num_experts, 2 * INTER, HIDDEN), torch.randn(num_experts, HIDDEN, INTER)
    x = torch.randn(TOKENS, HIDDEN)
    weights, ids = select_experts(torch.randn(TOKENS, num_experts), top_k=2, renormalize=True)
    fused_moe = get("fused_moe")
    full = fused_moe(x, w13, w2, weights, ids)
    partial = torch.zeros_like(full)
    for held in (torch.tensor([0, 2, 4]), torch.tensor([1, 3, 5])):
        expert_map = torch.full((num_experts,), -1)
        expert_map[held] = torch.arange(len(held))
        partial += fused_moe(x, w13[held], w2[held], weights, ids, expert_map=expert_map)
    # The same per-expert products on the same tokens; only the order of adding a token's two
    # routes can differ: <= 1 ulp of |out| <= 500 (3e-5).
    torch.testing.assert_close(partial, full, rtol=0, atol=1e-4)
    nothing = fused_moe(x, w13[:0], w2[:0], weights, ids, expert_map=torch.full((num_experts,), -1))
    assert torch.equal(nothing, torch.zeros_like(full))


def test_gelu_activation_and_bad_arguments():
    torch.manual_seed(0)
    w13, w2 = torch.randn(2, 2 * INTER, HIDDEN), torch.randn(2, HIDDEN, INTER)
    x = torch.randn(3, HIDDEN)
    ids, weights = torch.tensor([[1], [0], [1]]), torch.ones(3, 1)
    out = get("fused_moe")(x, w13, w2, weights, ids, activation="gelu_tanh")
    gate, up = (x[0] @ w13[1].t()).chunk(2)
    # fp32, a [1, 32] matvec here against fused_moe's [2, 32] GEMM, then 16-term sums with
    # S = sum|h||w2| <= 263 (unit-normal weights, |out| <= 232): ~u * S = 1.6e-5 plus the first
    # GEMM's error carried through h; measured <= 3.8e-5 (6.4e-5 on scalar ATen kernels), worst
    # case 16 * u * S = 2.5e-4 -> atol 3e-4. Exact instead of tanh GELU moves these outputs by
    # 1.5e-2, silu by 5.7.
    expected = (torch.nn.functional.gelu(gate, approximate="tanh") * up) @ w2[1].t()
    torch.testing.assert_close(out[0], expected, rtol=0, atol=3e-4)
    with pytest.raises(ValueError, match="activation"):
        get("fused_moe")(x, w13, w2, weights, ids, activation="relu2")
    with pytest.raises(ValueError, match="scoring"):
        select_experts(torch.randn(3, 4), 1, False, scoring="softplus")
