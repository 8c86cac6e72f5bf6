"""Wide-EP prefill/decode disaggregation, live: both pools DP attention 2 x EP 2 (two ranks per
replica, attention TP 1, experts split over both), served through the real Serve application
and driven over HTTP by the official ``openai`` client, KV blocks moved by NIXL on loopback.

Two deployments, one after the other (the session's Ray has 4 + 2 CPUs):

- tiny DeepSeek-V3 (MLA): the prefill pool pinned to the first simulated node and the decode
  pool to the second (``placement``), so every KV read crosses nodes;
- tiny GLM-5 (MLA with DSA: the blocks hold the indexer keys too): the prefill pool pinned to
  the first node, the decode pool's group ``STRICT_SPREAD`` over both nodes (one rank on
  each), so one pool's group is split across nodes.

The oracle is the single in-process engine (``LLM`` on the same checkpoint, one rank): greedy
tokens must be equal (the checkpoints ship a word tokenizer whose text reads back as token
ids; exact equality needs no tolerance: helpers/tiny_deepseek.py and test_dsa.py show the
greedy margins dwarf the sharded model's float32 noise). After 64 mixed requests (lengths,
shared prefixes, streamed or not, ``n=2`` run whole on the decode side, one-token answers
from the prefill side), KV bytes are counted and no block or lease is left. The PD fault
cases hold with these pools: an injected transfer failure is recomputed, and a killed
prefill rank leaves the decode pool computing the prompts itself.
"""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import openai
import pytest

from helpers.live_metrics import metrics, pd_blocks_all_free, total, wait_for
from helpers.nodes import NODE_A, NODE_B, node_holding
from helpers.prompts import random_prompts
from helpers.tiny_models import save_word_tokenizer, word_token_ids

VOCAB = 128
NEW_TOKENS = 8
FIELDS = {"max_total_tokens": 1024, "moe_a2a_backend": "deepep", "ep_num_redundant_experts": 0}
# Both pools: --prefill-tp 2 --prefill-dp 2 --prefill-ep 2 --decode-tp 2 --decode-dp 2 --decode-ep 2.
WIDE_EP = {f"{pool}_{kind}": 2 for pool in ("prefill", "decode") for kind in ("tp", "dp", "ep")}
MIXED_REQUESTS = 64


def _save(kind: str, path) -> None:
    if kind == "deepseek_v3":
        from helpers.tiny_deepseek import save_tiny_deepseek_v3

        save_tiny_deepseek_v3(path)
    else:
        from helpers.tiny_dsa import save_tiny_dsa

        save_tiny_dsa(path, "glm5")
    save_word_tokenizer(path, VOCAB)


def _mixed_prompts(seed: int) -> list[list[int]]:
    """64 prompts: four lengths, and a quarter sharing a 24-token head (prefix-cached blocks)."""
    rng = random.Random(seed)
    shared = random_prompts((24,), VOCAB, seed=seed)[0]
    prompts = []
    for i in range(MIXED_REQUESTS):
        length = (5, 17, 33, 61)[i % 4]
        tail = [rng.randrange(VOCAB) for _ in range(length)]
        prompts.append(shared + tail[:8] if i % 4 == 3 else tail)
    return prompts


@pytest.fixture(scope="class")
def pd(request, serve_http, tmp_path_factory):
    """The class's deployment (``MODEL``, ``APP``, ``PREFIX``, ``PLACEMENT``, ``STRATEGY``) and
    the single engine's greedy tokens of its prompts; deleted after the class."""
    from ray import serve

    from flotilla import LLM, SamplingParams
    from flotilla.cluster.platform import probe
    from flotilla.deploy.serve_cmd import wait_until_healthy
    from flotilla.serve.app import build_pd_app
    from flotilla.serve.plan import plan_serving

    cls = request.cls
    path = tmp_path_factory.mktemp(f"tiny-{cls.MODEL}-wide-ep")
    _save(cls.MODEL, path)
    prompts = _mixed_prompts(seed=31)
    llm = LLM(str(path), **FIELDS)
    try:
        greedy = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
        expected = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, greedy)]
    finally:
        llm.shutdown()
    plan = plan_serving(
        {**FIELDS, "model_path": str(path)}, platform=probe(), pd=True, prefill_tp=2, decode_tp=2,
        pool_sizes={k: v for k, v in WIDE_EP.items() if not k.endswith("_tp")},
        kv_transport="nixl", placement=cls.PLACEMENT, placement_strategy=cls.STRATEGY,
    )  # fmt: skip
    for config in (plan.config, plan.decode_config):
        assert (config.enable_dp_attention, config.dp_size, config.ep_size, config.tp_size) == (True, 2, 2, 2)
    serve.run(build_pd_app(plan.config, plan.decode_config, plan.options), name=cls.APP, route_prefix=cls.PREFIX)
    url = f"{serve_http}{cls.PREFIX}"
    try:
        wait_until_healthy(url, 240)
        yield SimpleNamespace(url=url, app=cls.APP, name=plan.options.served_model_name, prompts=prompts, expected=expected)
    finally:
        serve.delete(cls.APP)


def _client(pd) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{pd.url}/v1", api_key="unused", max_retries=0, timeout=180)


def _complete(pd, prompt: list[int], stream: bool = False, max_tokens: int = NEW_TOKENS, n: int = 1) -> list[list[int]]:
    """Each choice's token ids, read back from its text."""
    kwargs = dict(model=pd.name, prompt=prompt, max_tokens=max_tokens, temperature=0, n=n, extra_body={"ignore_eos": True})
    if not stream:
        reply = _client(pd).completions.create(**kwargs)
        assert reply.usage.completion_tokens == max_tokens * n
        return [word_token_ids(c.text) for c in sorted(reply.choices, key=lambda c: c.index)]
    texts = [""] * n
    for chunk in _client(pd).completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            texts[choice.index] += choice.text
    return [word_token_ids(t) for t in texts]


def _describe(app: str, pool: str) -> dict:
    from ray import serve

    return serve.get_deployment_handle(pool, app_name=app).describe.remote().result(timeout_s=30)


class WideEPChecks:
    """The checks both deployments pass (each class names its model and layout)."""

    MODEL = APP = PREFIX = ""
    PLACEMENT: dict = {}
    STRATEGY: dict | None = None

    def test_greedy_tokens_equal_the_single_engine_streamed_or_not(self, pd):
        for i in (0, 1, 2, 3):
            assert _complete(pd, pd.prompts[i], stream=bool(i % 2)) == [pd.expected[i]]

    def test_64_mixed_requests_count_kv_bytes_and_leave_no_block_held(self, pd):
        read_bytes = lambda: total(metrics(pd.url), "flotilla:kv_transfer_bytes_total", pool="decode")  # noqa: E731
        before = read_bytes()

        def one(i: int):
            prompt = pd.prompts[i]
            if i % 16 == 5:  # a one-token answer: the prefill replica's first token is the whole answer
                return _complete(pd, prompt, max_tokens=1) == [pd.expected[i][:1]]
            if i % 16 == 9:  # n=2 cannot ride a handoff: the decode pool runs it whole
                return _complete(pd, prompt, n=2) == [pd.expected[i]] * 2
            return _complete(pd, prompt, stream=bool(i % 2)) == [pd.expected[i]]

        with ThreadPoolExecutor(max_workers=8) as pool:
            outcomes = list(pool.map(one, range(MIXED_REQUESTS)))
        assert [i for i, ok in enumerate(outcomes) if not ok] == []
        assert wait_for(lambda: read_bytes() > before)
        assert wait_for(lambda: pd_blocks_all_free(pd.url))
        # Concurrent requests spread over both DP ranks of each pool.
        m = metrics(pd.url)
        for pool in ("prefill", "decode"):
            ranks = {dict(k)["dp_rank"] for k, v in m["flotilla:dp_rank_requests_total"].items() if dict(k)["pool"] == pool and v > 0}
            assert ranks == {"0", "1"}, (pool, m["flotilla:dp_rank_requests_total"])

    def test_an_injected_transfer_failure_is_recomputed(self, pd):
        from ray import serve

        failures = lambda: total(metrics(pd.url), "flotilla:kv_transfer_failures_total", pool="decode")  # noqa: E731
        before = failures()
        serve.get_deployment_handle("decode", app_name=pd.app).kv_set_fail_next_reads.remote(1).result(timeout_s=30)
        # NOTE: each decode rank fails its own next read; a lone request lands on DP rank 0.
        assert _complete(pd, pd.prompts[2]) == [pd.expected[2]]
        assert wait_for(lambda: failures() > before)
        assert wait_for(lambda: pd_blocks_all_free(pd.url))

    def test_a_killed_prefill_rank_leaves_the_decode_pool_computing_the_prompts(self, pd):
        import ray

        ranks = _describe(pd.app, "prefill")["rank_actors"]
        ray.kill(ranks[1], no_restart=True)
        # NOTE: the prefill engine dies at its next step; the decode pool computes the prompt.
        for i in (1, 2):
            assert _complete(pd, pd.prompts[i]) == [pd.expected[i]]
        assert wait_for(lambda: total(metrics(pd.url), "flotilla:kv_cache_used_blocks", pool="decode") == 0)


class TestDeepSeekV3PoolsOnTwoNodes(WideEPChecks):
    MODEL, APP, PREFIX = "deepseek_v3", "flotilla-wide-ep-dsv3", "/wide-ep-dsv3"
    PLACEMENT = {"prefill": {NODE_A: 1}, "decode": {NODE_B: 1}}

    def test_each_pool_runs_on_its_node(self, pd):
        for pool, resource in (("prefill", NODE_A), ("decode", NODE_B)):
            where = _describe(pd.app, pool)
            assert where["rank_nodes"] == [node_holding(resource)] * 2


class TestGLM5DecodeGroupSplitAcrossNodes(WideEPChecks):
    MODEL, APP, PREFIX = "glm5", "flotilla-wide-ep-glm5", "/wide-ep-glm5"
    PLACEMENT = {"prefill": {NODE_A: 1}}
    STRATEGY = {"decode": "STRICT_SPREAD"}

    def test_the_decode_group_spans_both_nodes(self, pd):
        prefill, decode = _describe(pd.app, "prefill"), _describe(pd.app, "decode")
        assert prefill["rank_nodes"] == [node_holding(NODE_A)] * 2
        assert decode["placement_strategy"] == "STRICT_SPREAD"
        assert sorted(decode["rank_nodes"]) == sorted([node_holding(NODE_A), node_holding(NODE_B)])
