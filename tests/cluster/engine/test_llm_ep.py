"""``LLM(model, tp_size=2, ep_size=2, moe_a2a_backend=...)`` on a local Ray worker group
(loopback, CPU, gloo) against ``LLM(model)`` in process, on a tiny Qwen3-MoE: each rank holds
half the experts, and greedy continuations of prompts of different lengths match token for
token with both token exchanges (``none``: partial outputs all-reduced; ``deepep``: pairs
dispatched to and combined from their experts' ranks, on CPU with torch.distributed's
all-to-all)."""

import pytest

from flotilla import LLM, SamplingParams
from flotilla.cluster.engine.group_runner import GroupRunner
from helpers.tiny_moe import save_tiny_qwen3_moe
from helpers.prompts import random_prompts

NEW_TOKENS = 32
PROMPT_LENS = (5, 17, 40)
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-qwen3-moe-ep")
    save_tiny_qwen3_moe(path)
    prompts = random_prompts(PROMPT_LENS, 256)
    return str(path), prompts


def _greedy(path: str, prompts, **flags) -> list[list[int]]:
    llm = LLM(path, max_total_tokens=1024, **flags)
    try:
        if flags:
            assert isinstance(llm.engine.runner, GroupRunner)
            resolved = (llm.config.ep_size, llm.config.moe_a2a_backend, llm.config.ep_num_redundant_experts)
            assert resolved == (flags["ep_size"], flags["moe_a2a_backend"], flags["ep_num_redundant_experts"])
        return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]
    finally:
        llm.shutdown()


@pytest.fixture(scope="module")
def single_rank(tiny_moe):
    path, prompts = tiny_moe
    tokens = _greedy(path, prompts)
    assert all(len(t) == NEW_TOKENS for t in tokens)
    return tokens


@pytest.mark.parametrize("backend, redundant", [("none", 0), ("deepep", 0), ("deepep", 2)])
def test_tp2_ep2_greedy_matches_single_rank(ray_cluster, tiny_moe, single_rank, backend, redundant):
    """``redundant``: ``--ep-num-redundant-experts`` copies (10 physical slots for 8 experts,
    5 per rank): tokens routed to a copied expert go to one replica, with the same result."""
    path, prompts = tiny_moe
    flags = dict(tp_size=2, ep_size=2, moe_a2a_backend=backend, ep_num_redundant_experts=redundant)
    assert _greedy(path, prompts, **flags) == single_rank


@pytest.mark.parametrize("backend", ["none", "deepep"])
def test_dp_attention_with_ep4_runs_moe_in_lockstep(ray_cluster, tiny_moe, single_rank, backend):
    """Four ranks: two DP-attention ranks (each with its own scheduler and KV pool, attention
    TP 2) whose MoE layers exchange tokens across all four EP ranks every step; with three
    prompts one DP rank has fewer requests, and greedy tokens still match the single rank."""
    path, prompts = tiny_moe
    flags = dict(
        tp_size=4, dp_size=2, enable_dp_attention=True, ep_size=4, moe_a2a_backend=backend, ep_num_redundant_experts=0
    )
    assert _greedy(path, prompts, **flags) == single_rank


def test_deepseek_v2_with_dp_attention_and_ep_matches_single_rank(ray_cluster, tmp_path):
    """MLA attention replicated per DP rank (attention TP 1), routed experts split over EP=2
    with the all-to-all exchange, shared experts per DP rank; a single prompt leaves one DP
    rank idle (empty batches) on every step."""
    from helpers.tiny_deepseek import save_tiny_deepseek_v2

    save_tiny_deepseek_v2(tmp_path, first_k_dense_replace=1)
    prompts = [[5, 9, 17, 33, 2, 71]]
    single = _greedy(str(tmp_path), prompts)
    flags = dict(
        tp_size=2, dp_size=2, enable_dp_attention=True, ep_size=2, moe_a2a_backend="deepep", ep_num_redundant_experts=0
    )
    assert _greedy(str(tmp_path), prompts, **flags) == single
