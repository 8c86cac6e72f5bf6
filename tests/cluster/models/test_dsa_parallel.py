"""DSA and GLM-4.5 under parallel layouts: ``LLM(model, tp_size=2, ...)`` on a local Ray worker
group (loopback, CPU, gloo) against ``LLM(model)`` in this process, greedy tokens token for token.

GLM-5 (IndexShare, 4 MLA heads, 8 experts): TP 2 with EP 2 (MLA heads split, the indexer on both
ranks, half the experts each, partial outputs all-reduced); DP attention 2 x EP 2 (each DP rank its
own replica of attention, scheduler and KV pool, experts exchanged all-to-all); DCP 2 (the latent
and indexer-key caches sharded by token, each rank scoring its shard, the group's top-k merged,
partial attention merged by LSE). GLM-4.5 (GQA): TP 2 with EP 2.

Exact token equality: the layouts change float32 summation order only (~1e-6 on logits spread
over units); the prompts and flags are those of test_dsa.py's engine test, whose top-k boundaries
are checked there to be at least 1e-4 wide, so no selection flips either.
"""

from __future__ import annotations

import pytest

from flotilla import LLM, SamplingParams
from flotilla.cluster.engine.group_runner import GroupRunner
from helpers.prompts import random_prompts
from helpers.tiny_dsa import ENGINE_PROMPT_LENS, save_tiny_dsa
from helpers.tiny_glm import save_tiny_glm4_moe

NEW_TOKENS = 32
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
FLAGS = dict(chunked_prefill_size=16, max_total_tokens=192)


def _greedy(path, prompts, **flags) -> list[list[int]]:
    llm = LLM(str(path), **{**FLAGS, **flags})
    try:
        if flags:
            assert isinstance(llm.engine.runner, GroupRunner)
            resolved = {name: getattr(llm.config, name) for name in flags if name != "max_total_tokens"}
            assert resolved == {name: v for name, v in flags.items() if name != "max_total_tokens"}
        if flags.get("dcp_size"):
            # The scheduler sees logical blocks of dcp_size * the 64-token DSA page.
            assert llm.engine.runner.kv_layout.block_size == 2 * 64
        return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]
    finally:
        llm.shutdown()


@pytest.fixture(scope="module")
def glm5(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-glm5-parallel")
    save_tiny_dsa(path, "glm5")
    prompts = random_prompts(ENGINE_PROMPT_LENS, 128, seed=2)
    return path, prompts, _greedy(path, prompts)


@pytest.mark.parametrize(
    "flags",
    [
        dict(tp_size=2, ep_size=2),
        dict(tp_size=2, dp_size=2, enable_dp_attention=True, ep_size=2, moe_a2a_backend="deepep"),
        dict(tp_size=2, dcp_size=2, max_total_tokens=512),
    ],
    ids=["tp2-ep2", "dp-attention2-ep2", "dcp2"],
)
def test_glm5_layouts_equal_one_rank(ray_cluster, glm5, flags):
    path, prompts, single = glm5
    assert _greedy(path, prompts, **flags) == single


def test_glm45_tp2_ep2_equals_one_rank(ray_cluster, tmp_path):
    save_tiny_glm4_moe(tmp_path)
    prompts = random_prompts((7, 20, 45), 128, seed=2)
    assert _greedy(tmp_path, prompts, tp_size=2, ep_size=2) == _greedy(tmp_path, prompts)
