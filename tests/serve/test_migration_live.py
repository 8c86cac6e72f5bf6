"""Request migration, live: 8 greedy streams over HTTP on 2 engine replicas of a tiny random
Llama (word-level tokenizer: the text reads back as token ids), one replica killed while
they run (``ray.kill`` of its Serve actor, as a node loss would), and once with a single
replica, whose streams wait for the replica Serve starts in its place; and a TP=2 replica
whose rank is killed, which rebuilds its worker group in place.

- ``--migration-limit 1`` (the default): every stream ends normally with the in-process
  engine's greedy tokens, the streams of the killed replica continued by the other one.
- ``--migration-limit 0``: a stream of the killed replica ends with an error event in
  OpenAI's envelope and no normal finish; the others finish.

Either way the surviving replica holds no KV block afterwards. One deployment at a time
(the session's Ray has 4 CPUs); Serve replaces the killed replica in the background.
"""

import asyncio
import json
import time
from types import SimpleNamespace

import httpx
import pytest

from helpers.live_metrics import metrics, total, wait_for
from helpers.margins import ENGINE_MIN_LEAD
from helpers.prompts import random_prompts
from helpers.tiny_models import save_tiny_llama, save_word_tokenizer, word_token_ids

VOCAB = 256
MAX_TOKENS = 160  # NOTE: long enough that every stream is mid-way when the replica dies
STREAMS = 8


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The checkpoint, 8 distinct prompts and the in-process engine's greedy continuations,
    each greedy choice clear of a near-tie (the migrated tokens are recomputed in one
    prefill, not step by step)."""
    from flotilla.cluster.engine.llm import LLM
    from flotilla.cluster.engine.sampling_params import SamplingParams

    path = tmp_path_factory.mktemp("tiny-llama-migration")
    save_tiny_llama(path, vocab_size=VOCAB)
    save_word_tokenizer(path, VOCAB)
    prompts = random_prompts((6, 9, 12, 15, 18, 21, 24, 27), VOCAB, seed=11)
    llm = LLM(str(path), max_total_tokens=4096)
    try:
        params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, logprobs=2)
        outputs = llm.generate(prompts, params)
    finally:
        llm.shutdown()
    expected = []
    for out in outputs:
        completion = out.outputs[0]
        for step in completion.logprobs:
            top = sorted((entry.logprob for entry in step.values()), reverse=True)
            assert top[0] - top[1] > ENGINE_MIN_LEAD, "greedy near-tie in the oracle: choose another seed"
        expected.append(list(completion.token_ids))
    return SimpleNamespace(path=str(path), prompts=prompts, expected=expected)


def _deploy(serve_http: str, tiny, app: str, prefix: str, replicas: int, migration_limit: int, tp_size: int = 1):
    from ray import serve

    from flotilla.cluster.platform import probe
    from flotilla.deploy.serve_cmd import wait_until_healthy
    from flotilla.serve.app import build_app
    from flotilla.serve.plan import resolve_pool, serve_options

    config, model = resolve_pool({"model_path": tiny.path, "max_total_tokens": 4096, "tp_size": tp_size}, probe())
    # NOTE: round-robin: the 8 streams split 4 / 4 over the replicas, so the kill cuts some.
    options = serve_options(config, model=model, num_replicas=replicas, router="round-robin", migration_limit=migration_limit)
    serve.run(build_app(config, options), name=app, route_prefix=prefix)
    url = f"{serve_http}{prefix}"
    wait_until_healthy(url, 120)
    return SimpleNamespace(url=url, app=app, name=options.served_model_name, replicas=replicas)


async def _stream(client: httpx.AsyncClient, deployment, prompt: list[int], progress: list[int], i: int) -> dict:
    """One streamed completion: its text, finish reasons and error events, counting the
    tokens it has received in ``progress[i]``."""
    body = {
        "model": deployment.name, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
        "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
    }  # fmt: skip
    text, finishes, errors, done, gap, last, usage = "", [], [], False, 0.0, None, None
    async with client.stream("POST", f"{deployment.url}/v1/completions", json=body) as response:
        assert response.status_code == 200, await response.aread()
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[len("data: ") :]
            if data == "[DONE]":
                done = True
                continue
            now = time.monotonic()
            gap, last = (gap if last is None else max(gap, now - last)), now
            event = json.loads(data)
            if "error" in event:
                errors.append(event["error"])
                continue
            usage = event.get("usage") or usage
            for choice in event["choices"]:
                text += choice["text"]
                progress[i] = len(text.split())
                if choice.get("finish_reason"):
                    finishes.append(choice["finish_reason"])
    return dict(tokens=word_token_ids(text), finishes=finishes, errors=errors, done=done, gap=gap, usage=usage)


def _engine_replica_actors(app: str) -> list:
    import ray

    prefix = f"SERVE_REPLICA::{app}#engine#"
    return [
        ray.get_actor(a["name"], namespace=a["namespace"])
        for a in ray.util.list_named_actors(all_namespaces=True)
        if a["name"].startswith(prefix)
    ]


def _kill_an_engine_replica(deployment) -> None:
    import ray

    actors = _engine_replica_actors(deployment.app)
    assert len(actors) == deployment.replicas, actors
    ray.kill(actors[0], no_restart=True)


async def _streams_with_a_kill(deployment, tiny, kill=_kill_an_engine_replica, streams: int = STREAMS) -> list[dict]:
    """The first ``streams`` prompts streamed, ``kill(deployment)`` called once each stream has
    received a few tokens."""
    progress = [0] * streams
    async with httpx.AsyncClient(timeout=httpx.Timeout(180.0)) as client:
        prompts = tiny.prompts[:streams]
        tasks = [asyncio.create_task(_stream(client, deployment, p, progress, i)) for i, p in enumerate(prompts)]
        deadline = time.monotonic() + 120
        while min(progress) < 4 and time.monotonic() < deadline and not any(t.done() for t in tasks):
            await asyncio.sleep(0.01)
        assert min(progress) >= 4 and max(progress) < MAX_TOKENS, f"the streams were not all mid-way: {progress}"
        kill(deployment)
        return await asyncio.wait_for(asyncio.gather(*tasks), 180)


def _no_block_held(url: str) -> bool:
    m = metrics(url)
    return bool(m.get("flotilla:kv_cache_used_blocks")) and total(m, "flotilla:kv_cache_used_blocks") == 0


@pytest.mark.parametrize(
    "replicas, limit", [(2, 1), (2, 0), (1, 1)], ids=["migration-on", "migration-off", "one-replica-replaced"]
)
def test_a_replica_killed_under_8_streams(serve_http, tiny, replicas, limit):
    """With one replica, the migrated streams wait for the replica Serve starts in place of the
    killed one (at most serve.migration.MIGRATION_WAIT_S)."""
    from ray import serve

    app = f"flotilla-migration-{replicas}-{limit}"
    deployment = _deploy(serve_http, tiny, app, f"/migration{replicas}{limit}", replicas, limit)
    try:
        started = time.monotonic()
        results = asyncio.run(_streams_with_a_kill(deployment, tiny))
        took = time.monotonic() - started
        complete = [r for r, want in zip(results, tiny.expected) if r["tokens"] == want and r["finishes"] == ["length"]]
        if limit:
            # Every stream finished normally with the undisturbed greedy tokens.
            for r, want in zip(results, tiny.expected):
                assert r["errors"] == [] and r["finishes"] == ["length"] and r["done"], r
                assert r["tokens"] == want and r["usage"]["completion_tokens"] == MAX_TOKENS
            # NOTE: the kill cut some streams: the ingress replicas counted their migrations (an
            # ingress replica's series reach /metrics through the hub, within a push period).
            assert wait_for(lambda: total(metrics(deployment.url), "flotilla:requests_migrated_total") >= 1)
        else:
            cut = [r for r in results if r["errors"]]
            assert cut, "no stream was on the killed replica"
            assert total(metrics(deployment.url), "flotilla:requests_migrated_total") == 0
            assert len(cut) + len(complete) == STREAMS
            for r in cut:
                # The error event says the replica stopped; no normal finish was sent.
                assert r["finishes"] == [] and r["errors"][0]["code"] == "service_unavailable", r
                assert "engine replica" in r["errors"][0]["message"]
        # The surviving replica (and the replacement Serve starts) hold no KV block.
        assert wait_for(lambda: _no_block_held(deployment.url), timeout_s=60)
        # NOTE: the longest pause between two events of one stream: the time to recover.
        pause = max(r["gap"] for r in results)
        print(f"replicas={replicas} migration_limit={limit}: 8 streams of {MAX_TOKENS} tokens in {took:.1f} s, "
              f"one replica killed; longest pause in a stream {pause:.2f} s")  # fmt: skip
    finally:
        serve.delete(app)


def test_a_rank_killed_under_load_restarts_the_group_and_the_streams_go_on(serve_http, tiny):
    """One TP=2 replica, one of its rank actors killed under 4 streams: the engine fails its
    next step, its streams migrate, and the replica rebuilds its worker group in place (the
    gang restarted; Serve's health check holds off meanwhile). The streams go on on the new
    group with the undisturbed tokens."""
    import ray
    from ray import serve

    app = "flotilla-migration-tp2"
    deployment = _deploy(serve_http, tiny, app, "/migration-tp2", 1, 1, tp_size=2)
    try:
        handle = serve.get_deployment_handle("engine", app_name=app)
        ranks = handle.describe.remote().result(timeout_s=30)["rank_actors"]
        assert len(ranks) == 2, ranks
        kill_rank = lambda _: ray.kill(ranks[1], no_restart=True)  # noqa: E731
        results = asyncio.run(_streams_with_a_kill(deployment, tiny, kill_rank, streams=4))
        for r, want in zip(results, tiny.expected):
            assert r["errors"] == [] and r["finishes"] == ["length"] and r["done"], r
            assert r["tokens"] == want and r["usage"]["completion_tokens"] == MAX_TOKENS
        assert wait_for(lambda: total(metrics(deployment.url), "flotilla:requests_migrated_total") >= 4)
        assert total(metrics(deployment.url), "flotilla:engine_restarts_total") == 1
        assert wait_for(lambda: _no_block_held(deployment.url), timeout_s=60)
        print(f"TP=2 rank killed: longest pause in a stream {max(r['gap'] for r in results):.2f} s")
    finally:
        serve.delete(app)
