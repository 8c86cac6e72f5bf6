"""Prefill/decode disaggregation with heterogeneous TP and the failure policies, live, on a
tiny random Llama (4 attention heads, 2 KV heads; vocabulary 256, with a word-level
tokenizer whose text reads back as token ids) served through the real Serve application
over HTTP; prompts are token ids.

Two deployments, one after the other (the session's Ray has 4 CPUs):

- prefill TP=2 -> decode TP=1, KV by NIXL, ``kv_load_failure_policy=recompute``;
- prefill TP=1 -> decode TP=2, KV by the Ray-object fallback (so the prefill rank runs in
  a worker actor), ``kv_load_failure_policy=fail``.

The oracle is the in-process engine's greedy continuation (``LLM`` on the same checkpoint,
one rank). A killed prefill rank is a prefill replica whose engine dies at its next step:
the ingress then sees the prefill fail (recompute: the decode pool computes the prompt;
fail: a 503 naming the policy).
"""

from types import SimpleNamespace

import httpx
import pytest

from helpers.live_metrics import metrics, pd_blocks_all_free, total, wait_for
from helpers.prompts import random_prompts
from helpers.tiny_models import save_tiny_llama, save_word_tokenizer, word_token_ids

VOCAB = 256
MAX_TOKENS = 10
PROMPT_LENS = (5, 17, 40)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The checkpoint, its prompts (three lengths, plus two sharing a 32-token prefix) and
    the in-process engine's greedy continuations of them."""
    from flotilla.cluster.engine.llm import LLM
    from flotilla.cluster.engine.sampling_params import SamplingParams

    path = tmp_path_factory.mktemp("tiny-llama-pd")
    save_tiny_llama(path, vocab_size=VOCAB)
    save_word_tokenizer(path, VOCAB)
    prompts = random_prompts(PROMPT_LENS, VOCAB)
    shared = random_prompts((32,), VOCAB, seed=7)[0]
    prompts += [shared + [1, 2, 3], shared + [4, 5, 6, 7]]
    llm = LLM(str(path), max_total_tokens=1024)
    try:
        outputs = llm.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True))
        expected = [list(o.outputs[0].token_ids) for o in outputs]
    finally:
        llm.shutdown()
    return SimpleNamespace(path=str(path), name=path.name, prompts=prompts, expected=expected)


def _deploy(serve_http: str, tiny, app: str, prefix: str, prefill_tp: int, decode_tp: int, transport: str, policy: str):
    from ray import serve

    from flotilla.cluster.platform import probe
    from flotilla.deploy.serve_cmd import wait_until_healthy
    from flotilla.serve.app import build_pd_app
    from flotilla.serve.plan import resolve_pool, serve_options
    from flotilla.serve.plan import pd_server_fields

    platform = probe()
    given = {"model_path": tiny.path, "max_total_tokens": 1024}
    prefill_fields, decode_fields = pd_server_fields(given, prefill_tp, decode_tp)
    prefill, model = resolve_pool(prefill_fields, platform)
    decode, _ = resolve_pool(decode_fields, platform)
    options = serve_options(
        decode, model=model, disaggregation_mode="pd", kv_transport=transport, kv_load_failure_policy=policy
    )
    serve.run(build_pd_app(prefill, decode, options), name=app, route_prefix=prefix)
    url = f"{serve_http}{prefix}"
    wait_until_healthy(url, 120)
    return SimpleNamespace(url=url, app=app, name=options.served_model_name)


def _complete(deployment, prompt: list[int]) -> httpx.Response:
    body = {"model": deployment.name, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
    return httpx.post(f"{deployment.url}/v1/completions", json=body, timeout=120)


def _tokens(deployment, prompt: list[int]) -> list[int]:
    """The completion's token ids, read back from its text."""
    response = _complete(deployment, prompt)
    assert response.status_code == 200, response.text
    return word_token_ids(response.json()["choices"][0]["text"])


def _handle(app: str, deployment: str):
    from ray import serve

    return serve.get_deployment_handle(deployment, app_name=app)


def _kill_prefill_rank(app: str, rank: int) -> None:
    import ray

    ranks = _handle(app, "prefill").describe.remote().result(timeout_s=30)["rank_actors"]
    assert len(ranks) > rank, "the prefill replica's ranks must run in worker actors here"
    ray.kill(ranks[rank], no_restart=True)


def _decode_holds_no_block(url: str) -> bool:
    m = metrics(url)
    return bool(m.get("flotilla:kv_cache_used_blocks")) and total(m, "flotilla:kv_cache_used_blocks", pool="decode") == 0


@pytest.fixture(scope="class")
def pd(request, serve_http, tiny):
    """The test class's PD deployment (its ``APP``, ``PREFIX`` and ``SETUP``: prefill TP,
    decode TP, transport, policy), deleted after the class: one deployment at a time."""
    from ray import serve

    cls = request.cls
    deployment = _deploy(serve_http, tiny, cls.APP, cls.PREFIX, *cls.SETUP)
    yield deployment
    serve.delete(cls.APP)


class TestPrefillTP2DecodeTP1Recompute:
    APP, PREFIX, SETUP = "flotilla-pd-tp21", "/pd21", (2, 1, "nixl", "recompute")

    def test_greedy_tokens_equal_the_single_engine(self, pd, tiny):
        assert [_tokens(pd, p) for p in tiny.prompts] == tiny.expected

    def test_an_injected_transfer_failure_is_recomputed(self, pd, tiny):
        failures = lambda: total(metrics(pd.url), "flotilla:kv_transfer_failures_total", pool="decode")  # noqa: E731
        before = failures()
        _handle(self.APP, "decode").kv_set_fail_next_reads.remote(1).result(timeout_s=30)
        assert _tokens(pd, tiny.prompts[2]) == tiny.expected[2]
        assert wait_for(lambda: failures() > before)
        assert wait_for(lambda: pd_blocks_all_free(pd.url))

    def test_a_killed_prefill_rank_is_recomputed_on_the_decode_side(self, pd, tiny):
        _kill_prefill_rank(self.APP, 1)
        # NOTE: the prefill engine dies at its next step; the decode pool computes the prompt.
        assert _tokens(pd, tiny.prompts[1]) == tiny.expected[1]
        assert _tokens(pd, tiny.prompts[2]) == tiny.expected[2]
        assert wait_for(lambda: _decode_holds_no_block(pd.url))


class TestPrefillTP1DecodeTP2FailOverRay:
    APP, PREFIX, SETUP = "flotilla-pd-tp12", "/pd12", (1, 2, "ray", "fail")

    def test_greedy_tokens_equal_the_single_engine(self, pd, tiny):
        assert [_tokens(pd, p) for p in tiny.prompts] == tiny.expected
        # NOTE: replicas push their metrics about once a second: poll, as the other checks do.
        assert wait_for(lambda: total(metrics(pd.url), "flotilla:kv_transfer_bytes_total", pool="decode") > 0)

    def test_an_injected_transfer_failure_fails_the_request_clearly(self, pd, tiny):
        _handle(self.APP, "decode").kv_set_fail_next_reads.remote(1).result(timeout_s=30)
        response = _complete(pd, tiny.prompts[2])
        assert response.status_code == 503, response.text
        assert "kv_load_failure_policy='fail'" in response.json()["error"]["message"]
        assert wait_for(lambda: pd_blocks_all_free(pd.url))
        # NOTE: the failure was the request's alone: the next one is served.
        assert _tokens(pd, tiny.prompts[0]) == tiny.expected[0]

    def test_a_killed_decode_rank_fails_the_request_and_frees_the_prefill_blocks(self, pd, tiny):
        import ray

        ranks = _handle(self.APP, "decode").describe.remote().result(timeout_s=30)["rank_actors"]
        ray.kill(ranks[1], no_restart=True)
        # NOTE: the decode engine dies at its next step: the request fails with the rank named,
        # and the ingress still releases the prefill side's blocks.
        response = _complete(pd, tiny.prompts[0])
        assert response.status_code >= 500, response.text
        assert "rank 1" in response.text, response.text
        assert wait_for(lambda: total(metrics(pd.url), "flotilla:kv_transfer_leased_blocks", pool="prefill") == 0)

    def test_a_killed_prefill_rank_fails_the_request_clearly(self, pd, tiny):
        _kill_prefill_rank(self.APP, 0)
        response = _complete(pd, tiny.prompts[1])
        assert response.status_code == 503, response.text
        message = response.json()["error"]["message"]
        assert "prefill" in message and "kv_load_failure_policy='fail'" in message
        assert wait_for(lambda: _decode_holds_no_block(pd.url))
