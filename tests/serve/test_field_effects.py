"""What a non-default value of a serving field changes (the ingress, the engine replica, the
application's deployments, the PD decode pool, the elastic EP scale).

Each test resolves the field through the same path ``flotilla serve`` takes
(:func:`~flotilla.serve.plan.resolve_pool` and :func:`~flotilla.serve.plan.serve_options`)
and drives what it builds: the OpenAI ingress over httpx's ASGI transport against an
in-process engine, an :class:`~flotilla.serve.engine_replica.EngineReplica` built without
Serve, or the engine pool's deployment options. The last test grows an elastic EP group on
the session's Ray. The runtime-support table names these tests as evidence
(``tests/helpers/support_evidence.py``).

A tiny random Llama with a word-level tokenizer (token ``i`` is the word ``w<i>``, so a
prompt's ids read back from its text); greedy decoding.
"""

from __future__ import annotations

import asyncio
import threading
import time
from types import SimpleNamespace

import httpx
import pytest

from flotilla.cluster.engine.llm_engine import LLMEngine
from flotilla.cluster.engine.sampling_params import SamplingParams
from flotilla.cluster.models.sources import resolve_model_source
from flotilla.cluster.models.tokenizer import load_tokenizer
from flotilla.resolution import preset
from flotilla.serve.app import engine_deployment_options
from flotilla.serve.plan import resolve_pool, serve_options
from flotilla.serve.async_engine import AsyncEngine
from flotilla.serve.engine_replica import EngineReplica
from flotilla.serve.ingress import create_app
from flotilla.serve.types import EngineOverloadedError, GenerateRequest
from helpers.tiny_models import save_tiny_llama, save_word_tokenizer
from helpers.torch_threads import one_intra_op_thread

VOCAB = 256
CPU = preset("cpu")
WAIT_S = 10.0


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    with one_intra_op_thread():
        yield


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    """A tiny random Llama with a word-level tokenizer (and no chat template)."""
    path = tmp_path_factory.mktemp("tiny-llama-words")
    save_tiny_llama(path, vocab_size=VOCAB)
    save_word_tokenizer(path, VOCAB)
    return str(path)


def resolved(model_dir: str, **fields):
    return resolve_pool({"model_path": model_dir, "max_total_tokens": 1024, **fields}, CPU)


@pytest.fixture
def serving(model_dir):
    """``serve(**fields)``: the ingress app over an in-process engine, built as the ingress
    deployment builds it from the resolved fields; engines are shut down after the test."""
    engines = []

    def serve(**fields):
        config, model = resolved(model_dir, **fields)
        options = serve_options(config, model=model, served_model_name_given=fields.get("served_model_name"))
        source = resolve_model_source(model)
        engine = AsyncEngine(LLMEngine(config, source, load_tokenizer(source)), options.max_queued_requests)
        engines.append(engine)
        return create_app(engine, engine.engine.tokenizer, options, config)

    yield serve
    for engine in engines:
        engine.shutdown()


def call(app, method: str, path: str, body: dict | None = None, headers: dict | None = None) -> httpx.Response:
    async def main():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://flotilla.test") as client:
            return await client.request(method, path, json=body, headers=headers)

    return asyncio.run(main())


COMPLETION = {"prompt": "w5 w17 w42", "max_tokens": 3, "temperature": 0, "ignore_eos": True}
CHAT = {"messages": [{"role": "user", "content": "w5 w17"}], "max_tokens": 2, "temperature": 0, "ignore_eos": True,
        "return_token_ids": True}  # fmt: skip


# -- the ingress ---------------------------------------------------------------------------------


def test_api_key_makes_every_route_but_health_need_the_key(serving):
    open_app = serving()
    assert call(open_app, "POST", "/v1/completions", COMPLETION).status_code == 200
    keyed = serving(api_key="sekret")
    routes = (("POST", "/v1/completions", COMPLETION), ("GET", "/v1/models", None), ("GET", "/metrics", None))
    for method, path, body in routes:
        assert call(keyed, method, path, body).status_code == 401
        assert call(keyed, method, path, body, {"Authorization": "Bearer wrong"}).status_code == 401
    assert call(keyed, "GET", "/health").status_code == 200
    good = call(keyed, "POST", "/v1/completions", COMPLETION, {"Authorization": "Bearer sekret"})
    assert good.status_code == 200 and good.json()["usage"]["completion_tokens"] == 3


def test_served_model_name_is_the_name_models_reports_and_requests_must_use(serving, model_dir):
    default = serving()
    dir_name = resolve_model_source(model_dir).path.name
    assert [m["id"] for m in call(default, "GET", "/v1/models").json()["data"]] == [dir_name]
    named = serving(served_model_name="tiny-words")
    assert [m["id"] for m in call(named, "GET", "/v1/models").json()["data"]] == ["tiny-words"]
    assert call(named, "POST", "/v1/completions", {**COMPLETION, "model": "tiny-words"}).status_code == 200
    refused = call(named, "POST", "/v1/completions", {**COMPLETION, "model": dir_name})
    assert refused.status_code == 404 and "tiny-words" in refused.json()["error"]["message"]


TEMPLATE = "{% for m in messages %}w1 {{ m['content'] }} {% endfor %}{% if add_generation_prompt %}w2{% endif %}"


def test_chat_template_is_the_template_the_ingress_renders_chats_with(serving, tmp_path):
    """The checkpoint's tokenizer has no chat template: chats are refused (400) by default;
    with ``--chat-template`` (Jinja text, or a file holding it) they are rendered by it."""
    refused = call(serving(), "POST", "/v1/chat/completions", CHAT)
    assert refused.status_code == 400 and "--chat-template" in refused.json()["error"]["message"]
    template_file = tmp_path / "words.jinja"
    template_file.write_text(TEMPLATE)
    for template in (TEMPLATE, str(template_file)):
        reply = call(serving(chat_template=template), "POST", "/v1/chat/completions", CHAT)
        assert reply.status_code == 200, reply.text
        assert reply.json()["prompt_token_ids"] == [1, 5, 17, 2]


KWARGS_TEMPLATE = "{% if terse %}w3 {% endif %}" + TEMPLATE


def test_default_chat_template_kwargs_are_what_every_request_starts_from(serving):
    """The template reads ``terse``: unset by default, true from
    ``--default-chat-template-kwargs``, and a request's own ``chat_template_kwargs`` win."""
    plain = call(serving(chat_template=KWARGS_TEMPLATE), "POST", "/v1/chat/completions", CHAT)
    assert plain.json()["prompt_token_ids"] == [1, 5, 17, 2]
    app = serving(chat_template=KWARGS_TEMPLATE, default_chat_template_kwargs={"terse": True})
    assert call(app, "POST", "/v1/chat/completions", CHAT).json()["prompt_token_ids"] == [3, 1, 5, 17, 2]
    override = call(app, "POST", "/v1/chat/completions", {**CHAT, "chat_template_kwargs": {"terse": False}})
    assert override.json()["prompt_token_ids"] == [1, 5, 17, 2]


# -- the engine replica and the deployments -------------------------------------------------------


def test_max_queued_requests_is_the_replicas_queue_bound(model_dir):
    """An engine replica built from ``--max-queued-requests 2``: with its engine thread held
    inside a step (a gate), two requests wait and the third is refused as overloaded without
    being queued; once the gate opens all admitted requests finish."""
    config, model = resolved(model_dir, max_queued_requests=2)
    options = serve_options(config, model=model)
    replica = EngineReplica(config, options, replica_id="bounded")
    engine = replica.engine
    try:
        gate, real_step = threading.Event(), engine.engine.step

        def gated_step():
            assert gate.wait(WAIT_S), "gate never opened"
            return real_step()

        engine.engine.step = gated_step
        params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)

        def request(i):
            return GenerateRequest(f"q{i}", [5, 17, 42], params, time.time())

        async def main():
            streams = [replica.generate(request(i)) for i in range(2)]
            firsts = [asyncio.create_task(s.__anext__()) for s in streams]
            deadline = time.monotonic() + WAIT_S
            while engine.load().waiting < 2:
                assert time.monotonic() < deadline, "the two requests never queued"
                await asyncio.sleep(0.005)
            with pytest.raises(EngineOverloadedError, match="max_queued_requests=2"):
                await replica.generate(request(2)).__anext__()
            assert engine.load().waiting == 2
            gate.set()
            for first, stream in zip(firsts, streams):
                chunks = [await first] + [c async for c in stream]
                assert chunks[-1].finished and chunks[-1].completion_tokens == 4

        asyncio.run(main())
    finally:
        replica.shutdown()


def test_dp_size_without_dp_attention_runs_that_many_engine_replicas(model_dir):
    """``--dp-size 2`` alone: two engine replicas behind the router (each a whole engine);
    under ``--enable-dp-attention`` the DP ranks live inside one engine instead
    (tests/cluster/engine/test_llm_dp.py)."""
    for dp_size in (1, 2):
        config, model = resolved(model_dir, dp_size=dp_size)
        options = serve_options(config, model=model)
        assert options.num_replicas == dp_size
        assert engine_deployment_options(config, options)["num_replicas"] == dp_size


# -- PD: the decode pool's prefix cache -------------------------------------------------------------


def test_disaggregation_decode_enable_radix_cache_keeps_the_decode_pools_prefix_cache(model_dir):
    """The decode pool as ``flotilla serve --disaggregation-mode pd`` resolves it keeps a prefix
    cache (flotilla's PD default): a repeated prompt is served from cached blocks. With
    ``--disaggregation-decode-enable-radix-cache false`` it runs without one (SGLang's decode
    default), and the repeat caches nothing."""
    from flotilla.serve.plan import pd_server_fields

    prompt = list(range(3, 43))
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    cached = {}
    for given in ({}, {"disaggregation_decode_enable_radix_cache": False}):
        _, decode_fields = pd_server_fields({"model_path": model_dir, "max_total_tokens": 1024, **given})
        config, model = resolve_pool(decode_fields, CPU)
        assert config.disaggregation_mode == "decode"
        engine = LLMEngine(config, resolve_model_source(model))
        outs = []
        for _ in range(2):
            rid = engine.add_request(prompt, params)
            while engine.has_unfinished_requests():
                engine.step()
            outs.append(engine.pop_output(rid))
        cached[bool(given)] = [o.num_cached_tokens for o in outs]
        assert outs[0].outputs[0].token_ids == outs[1].outputs[0].token_ids
    assert cached[False] == [0, 32]
    assert cached[True] == [0, 0]


# -- elastic EP: the bound on one scale ---------------------------------------------------------------


def test_elastic_ep_scale_timeout_bounds_a_scale_whose_joiners_never_start(ray_cluster, tmp_path):
    """An elastic EP replica (on the session's Ray) whose joiners need a resource no node has:
    a scale to EP 2 waits ``--elastic-ep-scale-timeout`` 3 s for their placement (the default
    600 s would hold it that long), then fails, and the replica serves on at EP 1."""
    from flotilla.serve.plan import plan_serving
    from flotilla.serve.elastic_ep import ScaleFailedError
    from helpers.elastic_live import ELASTIC
    from helpers.tiny_moe import save_tiny_qwen3_moe

    save_tiny_qwen3_moe(tmp_path)
    given = {"model_path": str(tmp_path), **ELASTIC, "max_total_tokens": 1024, "elastic_ep_scale_timeout": 3}
    planned = plan_serving(given, platform=CPU, placement={"joiners": {"no-such-node": 1}})
    config, options = planned.config, planned.options
    assert options.elastic_plan.scale_timeout_s == 3.0
    replica = EngineReplica(config, options, replica_id="elastic")
    try:

        async def scale():
            start = time.monotonic()
            with pytest.raises(ScaleFailedError) as info:
                await replica.scale_elastic_ep(2)
            return time.monotonic() - start, str(info.value), await replica.elastic_ep_state()

        elapsed, error, state = asyncio.run(scale())
        assert 3 <= elapsed < 3 + 10, elapsed
        assert "within --elastic-ep-scale-timeout (3s)" in error, error
        assert state["ep_size"] == 1 and not state["scaling"]
        chunks = SimpleNamespace(items=[])

        async def serve_one():
            params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
            chunks.items = [c async for c in replica.generate(GenerateRequest("after", [5, 17, 42], params, time.time()))]

        asyncio.run(serve_one())
        assert chunks.items[-1].finished and chunks.items[-1].completion_tokens == 3
    finally:
        replica.shutdown()

