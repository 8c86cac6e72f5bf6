"""Prefill/decode disaggregation, live: SmolLM2 served by a prefill pool and a decode pool
(KV blocks moved by NIXL over UCX on loopback) next to the same model served colocated,
both on the session's Serve, driven over real HTTP by the official ``openai`` client.

The prefill pool is pinned to the session's first simulated Ray node and the decode pool to
the second (``placement``), so every KV handoff crosses nodes.

The oracle is the colocated deployment: greedy outputs through PD must equal its outputs
for short, long and prefix-sharing prompts, streamed and not. Metrics are read from the PD
application's ``/metrics``: every series carries a ``pool`` label, so the checks pick the
prefill and decode replicas out of the session's metrics hub.

Heterogeneous TP and the failure policies run on a tiny random Llama in
``test_pd_faults_live.py`` (SmolLM2's 9 attention heads do not split over 2 ranks).
"""

import time
from types import SimpleNamespace

import openai
import pytest

from helpers.live_metrics import metrics, total, wait_for
from helpers.nodes import NODE_A, NODE_B, node_holding

PD_APP, COLOCATED_APP = "flotilla-pd-test", "flotilla-colocated-test"
MAX_TOKENS = 12
# A shared system prompt long enough to fill several KV blocks: the prefix both sides cache.
SYSTEM = (
    "You are a concise assistant for a geography quiz. Answer in one short sentence, name the "
    "place exactly, and never add commentary. The quiz covers capitals, rivers and mountains."
)
RIVERS_SYSTEM = (
    "You are a tutor for a class on the rivers of the world. Give the name of one river that "
    "answers the question, with the country it flows through, in a single short sentence. Do not "
    "list alternatives, do not explain, and do not repeat the question back to the student."
)
QUESTIONS = (
    "What is the capital of France?",
    "Name the longest river in Africa.",
    "Which mountain is the highest on Earth? Answer with its name and the country or countries it "
    "lies in, and say which range it belongs to, in at most one sentence please, thank you.",
)


def _messages(question: str, system: bool) -> list[dict]:
    head = [{"role": "system", "content": SYSTEM}] if system else []
    return head + [{"role": "user", "content": question}]


@pytest.fixture(scope="module")
def apps(serve_http):
    from ray import serve

    from flotilla.cluster.platform import probe
    from flotilla.deploy.serve_cmd import wait_until_healthy
    from flotilla.serve.app import build_app, build_pd_app
    from flotilla.serve.plan import resolve_pool, serve_options
    from flotilla.serve.plan import pd_server_fields

    platform = probe()  # NOTE: one local node: probing here equals probing a worker
    given = {"max_total_tokens": 4096}
    colocated, model = resolve_pool(given, platform)
    prefill_fields, decode_fields = pd_server_fields(given)
    prefill, _ = resolve_pool(prefill_fields, platform)
    decode, _ = resolve_pool(decode_fields, platform)
    # NOTE: prefill on the session's first simulated node, decode on the second: KV crosses nodes.
    placement = {"prefill": {NODE_A: 1}, "decode": {NODE_B: 1}}
    pd_options = serve_options(decode, model=model, disaggregation_mode="pd", kv_transport="nixl", placement=placement)
    serve.run(build_pd_app(prefill, decode, pd_options), name=PD_APP, route_prefix="/pd")
    serve.run(build_app(colocated, serve_options(colocated, model=model)), name=COLOCATED_APP, route_prefix="/colo")
    wait_until_healthy(f"{serve_http}/pd", 120)
    wait_until_healthy(f"{serve_http}/colo", 120)
    yield SimpleNamespace(pd=f"{serve_http}/pd", colocated=f"{serve_http}/colo")
    serve.delete(PD_APP)
    serve.delete(COLOCATED_APP)


def test_the_pools_run_on_the_nodes_their_placement_names(apps):
    from ray import serve

    for pool, resource in (("prefill", NODE_A), ("decode", NODE_B)):
        where = serve.get_deployment_handle(pool, app_name=PD_APP).describe.remote().result(timeout_s=30)
        assert where["pool"] == pool and where["node_id"] == node_holding(resource)


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)


def _chat(url: str, messages: list[dict], stream: bool) -> str:
    kwargs = dict(model="smollm2", messages=messages, max_tokens=MAX_TOKENS, temperature=0)
    if not stream:
        return _client(url).chat.completions.create(**kwargs).choices[0].message.content
    parts = _client(url).chat.completions.create(stream=True, **kwargs)
    return "".join(c.choices[0].delta.content or "" for c in parts if c.choices)


def _decode_handle():
    from ray import serve

    return serve.get_deployment_handle("decode", app_name=PD_APP)


def _pool_total(url: str, name: str, pool: str) -> float:
    return total(metrics(url), name, pool=pool)


def _no_blocks_held(url: str) -> bool:
    """Both pools' replicas report no KV block held by a request and no leased block."""
    m = metrics(url)
    pools = {dict(k).get("pool") for k in m.get("flotilla:kv_cache_used_blocks", {})}
    if not {"prefill", "decode"} <= pools:
        return False
    held = sum(total(m, "flotilla:kv_cache_used_blocks", pool=p) for p in ("prefill", "decode"))
    leased = total(m, "flotilla:kv_transfer_leased_blocks", pool="prefill")
    return held == 0 and leased == 0


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_pd_greedy_answers_equal_the_colocated_deployment(apps, stream):
    for question in QUESTIONS:
        for system in (False, True):
            messages = _messages(question, system)
            assert _chat(apps.pd, messages, stream) == _chat(apps.colocated, messages, stream), (question, system)


def test_pd_completions_of_a_prompt_list_equal_the_colocated_ones(apps):
    prompts = ["The capital of France is", SYSTEM + " The capital of Italy is"]
    kwargs = dict(model="smollm2", prompt=prompts, max_tokens=MAX_TOKENS, temperature=0)
    pd = _client(apps.pd).completions.create(**kwargs)
    colocated = _client(apps.colocated).completions.create(**kwargs)
    assert [c.text for c in sorted(pd.choices, key=lambda c: c.index)] == [
        c.text for c in sorted(colocated.choices, key=lambda c: c.index)
    ]
    assert pd.usage.prompt_tokens == colocated.usage.prompt_tokens
    assert pd.usage.completion_tokens == colocated.usage.completion_tokens


def test_a_one_token_answer_comes_from_the_prefill_side(apps):
    kwargs = dict(model="smollm2", messages=_messages(QUESTIONS[0], False), max_tokens=1, temperature=0)
    pd = _client(apps.pd).chat.completions.create(**kwargs)
    colocated = _client(apps.colocated).chat.completions.create(**kwargs)
    assert pd.choices[0].message.content == colocated.choices[0].message.content
    assert pd.choices[0].finish_reason == "length"


def _settled(read, timeout_s: float = 15.0) -> float:
    """``read()`` once two reads a push interval apart agree (the replicas push their
    metrics about once a second, so a fresh read may still miss the last request)."""
    deadline = time.monotonic() + timeout_s
    value = read()
    while time.monotonic() < deadline:
        time.sleep(1.5)
        again = read()
        if again == value:
            return value
        value = again
    return value


def test_transfers_are_counted_and_a_shared_prefix_moves_fewer_bytes(apps):
    def moved() -> float:
        return _pool_total(apps.pd, "flotilla:kv_transfer_bytes_total", "decode")

    # NOTE: a system prompt no other test sends: the first request moves every block; the
    # second finds the shared prefix's blocks in the decode side's prefix cache and moves
    # only the blocks after it.
    system = [{"role": "system", "content": RIVERS_SYSTEM}]
    before = _settled(moved)
    _chat(apps.pd, system + [{"role": "user", "content": "Name a river in Europe."}], stream=False)
    first = _settled(moved) - before
    _chat(apps.pd, system + [{"role": "user", "content": "Name a river in Asia."}], stream=False)
    second = _settled(moved) - before - first
    assert first > 0 and 0 < second < first
    m = metrics(apps.pd)
    assert total(m, "flotilla:kv_transfer_seconds_count", pool="decode") >= 2
    assert total(m, "flotilla:request_success_total", pool="prefill") > 0
    assert total(m, "flotilla:request_success_total", pool="decode") > 0
    assert total(m, "flotilla:prefix_cache_hits_total", pool="prefill") > 0


def test_an_injected_transfer_failure_is_recomputed_and_leaks_nothing(apps):
    failures = lambda: _pool_total(apps.pd, "flotilla:kv_transfer_failures_total", "decode")  # noqa: E731
    before = failures()
    _decode_handle().kv_set_fail_next_reads.remote(1).result(timeout_s=30)
    messages = _messages(QUESTIONS[1], False)
    assert _chat(apps.pd, messages, stream=True) == _chat(apps.colocated, messages, stream=True)
    assert wait_for(lambda: failures() > before)
    assert wait_for(lambda: _no_blocks_held(apps.pd))


def test_no_block_is_left_held_after_the_requests(apps):
    _chat(apps.pd, _messages(QUESTIONS[2], True), stream=True)
    assert wait_for(lambda: _no_blocks_held(apps.pd))
