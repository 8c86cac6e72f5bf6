"""The Serve application, live: ingress + the cache-aware router (the default) + 2 SmolLM2 engine
replicas on the session's Serve, driven over real HTTP on loopback by the official
``openai`` client and httpx.

One application serves the whole module (Serve startup ~2 s, each engine load ~10 s on
2 cores). It runs with ``--max-running-requests 2 --max-queued-requests 2`` so a burst
of 16 requests must overflow the engines' queues (429s) while every sequential test has
room. Generations are greedy and short.

Metrics reach ``/metrics`` through the replicas' push to the metrics hub (once a second),
so checks on them poll (helpers.live_metrics.wait_for).
"""

import asyncio
import dataclasses
from types import SimpleNamespace

import httpx
import openai
import pytest

from flotilla.cluster.engine.limits import block_size_for

from flotilla.resolution import ArgumentError
from helpers.live_metrics import metrics, total, wait_for
from flotilla.serve.app import build_app, engine_deployment_options, ingress_deployment_options, parse_build_args
from flotilla.serve.plan import resolve_pool, serve_options, served_model_name

APP = "flotilla-live-test"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def app(serve_http):
    from ray import serve

    from flotilla.deploy.serve_cmd import wait_until_healthy

    from flotilla.cluster.platform import probe

    # NOTE: one local node: probing here equals probing a worker, and skips a Ray task.
    config, model = resolve_pool({"max_running_requests": 2, "max_queued_requests": 2}, probe())
    options = serve_options(config, model=model, num_replicas=2, replica_num_cpus=0.5)
    serve.run(build_app(config, options), name=APP, route_prefix="/")
    wait_until_healthy(serve_http, 60)
    yield SimpleNamespace(url=serve_http, config=config, options=options)
    serve.delete(APP)


@pytest.fixture
def client(app):
    return openai.OpenAI(base_url=f"{app.url}/v1", api_key="unused", max_retries=0, timeout=60)


# -- the live application ----------------------------------------------------------------


def test_chat_answers_paris(client):
    reply = client.chat.completions.create(model="smollm2", messages=QUESTION, max_tokens=12, temperature=0)
    assert "Paris" in reply.choices[0].message.content
    assert reply.usage.prompt_tokens > 0 and 0 < reply.usage.completion_tokens <= 12


def test_completions_from_text_and_token_ids(client):
    text = client.completions.create(model="smollm2", prompt="The capital of France is", max_tokens=4, temperature=0)
    assert text.choices[0].text and text.choices[0].finish_reason in ("length", "stop")
    ids = client.completions.create(model="smollm2", prompt=[504, 3575, 282, 4649, 314], max_tokens=3, temperature=0)
    assert ids.usage.prompt_tokens == 5 and ids.usage.completion_tokens <= 3


def test_streaming_with_usage(client):
    chunks = list(
        client.chat.completions.create(
            model="smollm2",
            messages=QUESTION,
            max_tokens=6,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    usage = chunks[-1].usage
    assert text and finishes in (["length"], ["stop"])
    assert usage is not None and 0 < usage.completion_tokens <= 6 and usage.prompt_tokens > 0
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens


def test_health_models_and_request_id_echo(app):
    assert httpx.get(f"{app.url}/health", timeout=10).status_code == 200
    models = httpx.get(f"{app.url}/v1/models", timeout=10).json()
    assert [m["id"] for m in models["data"]] == ["smollm2"]
    response = httpx.post(
        f"{app.url}/v1/completions",
        json={"model": "smollm2", "prompt": "Hello", "max_tokens": 2},
        headers={"X-Request-Id": "trace-me-42"},
        timeout=60,
    )
    assert response.status_code == 200 and response.headers["x-request-id"] == "trace-me-42"


def test_metrics_families_are_served_and_move(app, client):
    before = metrics(app.url)
    for family in (
        "flotilla:time_to_first_token_seconds_count",
        "flotilla:inter_token_latency_seconds_count",
        "flotilla:e2e_request_latency_seconds_count",
        "flotilla:request_queue_time_seconds_count",
        "flotilla:num_requests_running",
        "flotilla:num_requests_waiting",
        "flotilla:kv_cache_usage_perc",
        "flotilla:prompt_tokens_total",
        "flotilla:generation_tokens_total",
        "flotilla:prefix_cache_hits_total",
    ):
        assert family in before, f"{family} missing from /metrics"
    assert len(before["flotilla:kv_cache_usage_perc"]) == 2  # one series per replica
    client.completions.create(model="smollm2", prompt="One, two, three,", max_tokens=5, temperature=0, extra_body={"ignore_eos": True})

    def moved():
        after = metrics(app.url)
        grew = total(after, "flotilla:generation_tokens_total") >= total(before, "flotilla:generation_tokens_total") + 5
        done = total(after, "flotilla:e2e_request_latency_seconds_count") > total(before, "flotilla:e2e_request_latency_seconds_count")
        return grew and done

    assert wait_for(moved)


def test_the_cache_aware_router_spreads_system_prompts_and_follows_each(app, client):
    """Two system prompts behind one shared preamble block (their first-block hash is the
    same), sent one at a time so that the router sees every earlier placement. System
    prompt A's first request goes to some replica; B's (1 of its 41 blocks held there, under
    half) goes to the other replica, which holds fewer blocks: it finds nothing cached. Then
    A, A, B, B: each lands where its system prompt was computed and finds all 41 blocks cached.
    Least-loaded (ties keep one order) sends B to A's replica (16 cached tokens); round-robin
    sends the second A to B's replica; a first-block hash sends everything to one replica.

    NOTE: the margin over the module's earlier requests: they put a few blocks in either
    replica's share of the router's tree, far fewer than the 41 of A's prompt."""
    block = block_size_for(app.config)
    preamble = [3000 + i for i in range(block)]
    system_a = [4000 + i for i in range(40 * block)]
    system_b = [9000 + i for i in range(40 * block)]

    def cached(system, user):
        reply = client.completions.create(model="smollm2", prompt=preamble + system + [user, user + 1], max_tokens=1, temperature=0)
        return reply.usage.prompt_tokens_details.cached_tokens

    assert cached(system_a, 100) == 0
    assert cached(system_b, 100) == 0  # spread: not the replica holding the preamble
    whole = 41 * block
    assert [cached(system_a, 200), cached(system_a, 300), cached(system_b, 200), cached(system_b, 300)] == [whole] * 4

def test_two_ingress_replicas_run_and_each_pushes_its_metrics(app, client):
    """The default two ingress replicas run, and each pushes its own series to the metrics hub
    (the /metrics of either merges them; tests/serve/test_ingress.py checks the merge). Which
    replica a request reaches is Serve's proxy's choice (it prefers replicas on its own node)."""
    import ray
    from ray import serve

    from flotilla.serve.metrics import get_metrics_hub

    assert app.options.num_ingress_replicas == 2
    ingress = serve.status().applications[APP].deployments["ingress"]
    assert ingress.replica_states.get("RUNNING") == 2
    client.completions.create(model="smollm2", prompt="Say hi.", max_tokens=1, temperature=0)

    def pushing() -> list[str]:
        return [key for key in ray.get(get_metrics_hub().replicas.remote(), timeout=30) if key.startswith("ingress-")]

    assert wait_for(lambda: len(pushing()) >= 2), pushing()
    series = metrics(app.url)["flotilla:http_requests_total"]
    assert all(dict(k).get("ingress") for k in series), series


def test_client_disconnect_aborts_and_frees_kv(app):
    """A stream the client drops mid-way is aborted: the abort counter moves and KV usage
    returns to 0 long before the 400 requested tokens could have been generated (~20 s at
    batch 1 on 2 cores; the wait is 8 s)."""
    aborted_before = total(metrics(app.url), "flotilla:request_success_total", finished_reason="abort")
    body = {"model": "smollm2", "prompt": "Count: 1, 2, 3,", "max_tokens": 400, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{app.url}/v1/completions", json=body, timeout=60) as response:
        assert response.status_code == 200
        lines = response.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))
    # The connection is closed here, after one frame.

    def freed():
        m = metrics(app.url)
        aborted = total(m, "flotilla:request_success_total", finished_reason="abort") > aborted_before
        return aborted and total(m, "flotilla:kv_cache_usage_perc") == 0 and total(m, "flotilla:num_requests_running") == 0

    assert wait_for(freed)


def test_burst_beyond_the_queue_bound_gets_429_never_5xx(app):
    """16 concurrent requests against 2 replicas that each run 2 and queue 2: some must be
    refused with 429 + Retry-After in OpenAI's envelope, the rest complete, none is a 5xx;
    afterwards no request or KV block is left behind. (How many complete depends on how
    the burst interleaves with the engine steps: requests a replica has not admitted yet
    count as queued, so a replica takes as few as 2 of a tight burst.)"""

    async def burst():
        async with httpx.AsyncClient(base_url=app.url, timeout=60) as http:
            body = {"model": "smollm2", "prompt": [1, 2, 3, 4], "max_tokens": 12, "ignore_eos": True}
            return await asyncio.gather(*[http.post("/v1/completions", json=body) for _ in range(16)])

    responses = asyncio.run(burst())
    statuses = sorted(r.status_code for r in responses)
    assert set(statuses) <= {200, 429}, statuses
    refused = [r for r in responses if r.status_code == 429]
    assert refused and 200 in statuses, statuses
    assert all(r.headers.get("retry-after") for r in refused)
    assert all(set(r.json()["error"]) >= {"message", "type", "param", "code"} for r in refused)

    def drained():
        m = metrics(app.url)
        return all(total(m, name) == 0 for name in ("flotilla:num_requests_running", "flotilla:num_requests_waiting", "flotilla:kv_cache_usage_perc"))

    assert wait_for(drained)


# -- building the application (no Serve needed) ---------------------------------------------


def test_build_args_use_sglang_field_names_and_cli_parsing():
    given, options = parse_build_args(
        {"model": "smollm2", "tp_size": "2", "max_total_tokens": "4k", "enable_dp_attention": "true",
         "disable_radix_cache": False, "router": "prefix-affinity", "num_replicas": "3"}
    )
    assert given == {"model_path": "smollm2", "tp_size": 2, "max_total_tokens": 4000, "enable_dp_attention": True}
    assert options == {"router": "prefix-affinity", "num_replicas": "3"}
    with pytest.raises(ArgumentError, match="tp_szie.*did you mean.*tp_size"):
        parse_build_args({"tp_szie": "2"})
    with pytest.raises(ArgumentError, match="expects true or false"):
        parse_build_args({"enable_dp_attention": "maybe"})


def test_served_name_and_options_come_from_the_config(tmp_path):
    assert served_model_name(None) == served_model_name("SmolLM2") == "smollm2"
    assert served_model_name("org/model") == "org/model"
    gguf = tmp_path / "tiny.Q4.gguf"
    gguf.write_bytes(b"")
    assert served_model_name(str(gguf)) == "tiny.Q4" and served_model_name(str(tmp_path)) == tmp_path.name
    assert served_model_name("x", explicit="mine") == "mine"
    from flotilla.resolution import preset

    config, model = resolve_pool({"max_queued_requests": 5, "api_key": "k", "max_running_requests": 3}, preset("cpu"))
    options = serve_options(config, model=model)
    assert (options.max_queued_requests, options.api_key, options.num_replicas, options.router) == (5, "k", 1, "cache-aware")
    engine = engine_deployment_options(config, options)
    # The engine's own bound (3 running + 5 queued) rejects before Serve's in-flight bound.
    assert engine["max_ongoing_requests"] > 3 + 5 and engine["name"] == "engine"
    assert engine["request_router_config"].request_router_class.endswith("CacheAwareRouter")
    # The router's tree cuts prompts into the engines' KV blocks.
    # NOTE: the pool's tree is shared by every ingress replica's router, named per pool and config.
    tree = f"flotilla-prefix-tree-colocated-{config.digest[:16]}"
    assert engine["request_router_config"].request_router_kwargs == {"block_size": block_size_for(config), "tree_name": tree}
    assert ingress_deployment_options(config, options)["max_ongoing_requests"] >= engine["max_ongoing_requests"]
    with pytest.raises(ValueError, match="router='nope'"):
        serve_options(config, model=None, router="nope")


def test_client_limits_reach_serve_options_serve_http_options_and_build_args():
    """The limits on clients: flotilla serve's flags reach ServeOptions (the ingress's limits)
    and Serve's http_options (keep-alive, request timeout; Serve's own HTTPOptions takes
    them); serve run / config files take the ingress's as build() arguments; bad values are
    refused naming the flag or option."""
    from ray.serve.config import HTTPOptions

    from flotilla.deploy.config_file import arg_flags
    from flotilla.deploy.serve_cmd import http_options, parse_serve_args, plan_for
    from flotilla.resolution import preset
    from flotilla.serve.plan import check_client_limits

    flags = ["--max-prompts-per-request", "8", "--request-body-timeout-s", "2.5", "--max-header-bytes", "4096",
             "--http-keep-alive-timeout-s", "7", "--http-request-timeout-s", "600", "--max-total-tokens", "2048"]  # fmt: skip
    opts, given = parse_serve_args(flags)
    plan = plan_for(opts, given, preset("cpu"))
    config, _, options = plan.config, plan.decode_config, plan.options
    assert (options.max_prompts_per_request, options.request_body_timeout_s, options.max_header_bytes) == (8, 2.5, 4096)
    served = http_options(config, options)
    assert served["keep_alive_timeout_s"] == 7 and served["request_timeout_s"] == 600.0
    assert HTTPOptions(**served).keep_alive_timeout_s == 7
    defaults = plan_for(*parse_serve_args(["--max-total-tokens", "2048"]), preset("cpu")).options
    assert (defaults.max_prompts_per_request, defaults.request_body_timeout_s, defaults.max_header_bytes) == (64, 30.0, 32768)
    assert set(http_options(config, defaults)) == {"host", "port"}  # NOTE: Serve's own defaults stay
    for flag, value in (("--max-prompts-per-request", "0"), ("--request-body-timeout-s", "0"), ("--max-header-bytes", "100"),
                        ("--http-keep-alive-timeout-s", "-1"), ("--http-request-timeout-s", "0")):  # fmt: skip
        with pytest.raises(ArgumentError, match=f"{flag} must be"):
            parse_serve_args([flag, value])

    _, option_args = parse_build_args({"max_prompts_per_request": "8", "request_body_timeout_s": "2.5", "max_header_bytes": 4096})
    assert option_args == {"max_prompts_per_request": "8", "request_body_timeout_s": "2.5", "max_header_bytes": 4096}
    assert arg_flags("max_prompts_per_request", 8) == ["--max-prompts-per-request", "8"]
    options = serve_options(config, model=None, max_prompts_per_request=8, request_body_timeout_s=2.5, max_header_bytes=4096)
    assert (options.max_prompts_per_request, options.request_body_timeout_s, options.max_header_bytes) == (8, 2.5, 4096)
    with pytest.raises(ValueError, match=r"max_prompts_per_request must be an integer >= 1 \(got max_prompts_per_request=0\)"):
        serve_options(config, model=None, max_prompts_per_request=0)
    with pytest.raises(ValueError, match="http_keep_alive_timeout_s"):
        check_client_limits(dataclasses.replace(options, http_keep_alive_timeout_s=1.5))


class _FakeResponse:
    """What ``handle.options(stream=True).generate.remote(req)`` returns, scripted."""

    def __init__(self, items):
        self.items, self.cancelled = list(items), False

    def __aiter__(self):
        return self

    async def __anext__(self):
        if not self.items:
            raise StopAsyncIteration
        item = self.items.pop(0)
        if isinstance(item, BaseException):
            raise item
        return item

    def cancel(self):
        self.cancelled = True


class _FakeHandle:
    def __init__(self, items):
        self.response = _FakeResponse(items)

    def options(self, **kwargs):
        assert kwargs == {"stream": True, "method_name": "generate"}
        return SimpleNamespace(remote=lambda request: self.response)


def test_serve_engine_client_streams_cancels_and_maps_errors():
    from ray.exceptions import ActorDiedError, RayTaskError
    from ray.serve.exceptions import BackPressureError

    from flotilla.cluster.engine.sampling_params import SamplingParams
    from flotilla.serve.app import ServeEngineClient
    from flotilla.serve.types import EngineOverloadedError, EngineUnavailableError, GenerateChunk, GenerateRequest

    request = GenerateRequest("r", [1, 2], SamplingParams(max_tokens=2), 0.0)

    async def drain(client, stop_after=None):
        got = []
        stream = client.generate(request)
        async for chunk in stream:
            got.append(chunk)
            if stop_after is not None and len(got) == stop_after:
                await stream.aclose()
                break
        return got

    done = _FakeHandle([GenerateChunk("r"), GenerateChunk("r", finished=True)])
    assert len(asyncio.run(drain(ServeEngineClient(done)))) == 2 and not done.response.cancelled
    left = _FakeHandle([GenerateChunk("r"), GenerateChunk("r"), GenerateChunk("r", finished=True)])
    assert len(asyncio.run(drain(ServeEngineClient(left), stop_after=1))) == 1
    assert left.response.cancelled  # the client left: the replica's stream is cancelled (abort)

    remote_bad_input = RayTaskError("generate", "traceback", ValueError("max_tokens: bad")).as_instanceof_cause()
    cases = [
        (remote_bad_input, ValueError, "max_tokens: bad"),
        (BackPressureError(num_queued_requests=4, max_queued_requests=4), EngineOverloadedError, "busy"),
        (ActorDiedError(), EngineUnavailableError, "replica serving this request stopped; retry"),
    ]
    for raised, expected, text in cases:
        with pytest.raises(expected, match=text) as info:
            asyncio.run(drain(ServeEngineClient(_FakeHandle([raised]))))
        assert "traceback" not in str(info.value)


def test_n2_logprobs_seed_and_stop_over_http(client):
    """The sampling features through the live server: two seeded completions repeat exactly,
    each with logprobs; a stop string ends a completion before it."""
    kwargs = dict(model="smollm2", messages=QUESTION, max_tokens=6, temperature=0.9, seed=7, n=2)
    first = client.chat.completions.create(**kwargs, logprobs=True, top_logprobs=2)
    again = client.chat.completions.create(**kwargs)
    assert len(first.choices) == 2
    assert [c.message.content for c in first.choices] == [c.message.content for c in again.choices]
    for choice in first.choices:
        assert choice.logprobs.content and all(len(t.top_logprobs) == 2 for t in choice.logprobs.content)
    stopped = client.completions.create(
        model="smollm2", prompt="The capital of France is", max_tokens=12, temperature=0, stop=[" Paris"]
    )
    assert "Paris" not in stopped.choices[0].text and stopped.choices[0].finish_reason == "stop"
