"""A refused multi-prompt request leaves nothing running, live: a tiny random Llama served by
one engine replica that queues at most 4 requests, on the session's Serve, over real HTTP.

A ``/v1/completions`` request lists several prompts; each prompt reaches the replica as a
call of its own. Before the fix, a request with more prompts than the queue holds got 429
while the prompts admitted before the refusal generated to the end for nobody; now the
replica refuses the whole request up front, and when one prompt is refused for any reason
the ingress aborts the others (their KV blocks freed) before it answers.

Metrics reach ``/metrics`` through the replica's push (about once a second): checks poll.
"""

import time
from types import SimpleNamespace

import httpx
import pytest

from helpers.live_metrics import metrics, total, wait_for
from helpers.prompts import random_prompts
from helpers.tiny_models import save_tiny_llama

APP, PREFIX = "flotilla-refused-live", "/refused"
VOCAB = 256
QUEUE = 4
LONG = 200  # tokens each admitted prompt would generate if nobody aborted it


@pytest.fixture(scope="module")
def app(serve_http, tmp_path_factory):
    from ray import serve

    from flotilla.cluster.platform import probe
    from flotilla.deploy.serve_cmd import wait_until_healthy
    from flotilla.serve.app import build_app
    from flotilla.serve.plan import resolve_pool, serve_options

    path = tmp_path_factory.mktemp("tiny-llama-refused")
    save_tiny_llama(path, vocab_size=VOCAB)
    given = {"model_path": str(path), "max_total_tokens": 2048, "max_queued_requests": QUEUE, "max_running_requests": QUEUE}
    config, model = resolve_pool(given, probe())
    options = serve_options(config, model=model, num_replicas=1)
    serve.run(build_app(config, options), name=APP, route_prefix=PREFIX)
    url = f"{serve_http}{PREFIX}"
    wait_until_healthy(url, 120)
    yield SimpleNamespace(url=url, name=options.served_model_name)
    serve.delete(APP)


def _idle(url: str):
    m = metrics(url)
    busy = sum(total(m, name) for name in ("flotilla:num_requests_running", "flotilla:num_requests_waiting", "flotilla:kv_cache_usage_perc"))
    return m if busy == 0 and "flotilla:generation_tokens_total" in m else None


def _settled(url: str):
    """The metrics once the replica is idle and two pushes apart agree (the counters of the
    requests before have arrived)."""
    last = {}

    def same():
        m = _idle(url)
        if m is None:
            return None
        counters = {k: m.get(k) for k in ("flotilla:request_success_total", "flotilla:generation_tokens_total")}
        previous, last["counters"] = last.get("counters"), counters
        if previous != counters:
            time.sleep(1.2)  # NOTE: a push interval, so that the next read is a later push
            return None
        return m

    return wait_for(same, timeout_s=15)


def _complete(app, prompts, max_tokens=LONG) -> httpx.Response:
    body = {"model": app.name, "prompt": prompts, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    return httpx.post(f"{app.url}/v1/completions", json=body, timeout=60)


def test_more_prompts_than_the_queue_holds_are_refused_whole_and_nothing_runs(app):
    before = _settled(app.url)
    assert before, "the replica is not idle before the test"
    response = _complete(app, random_prompts([16] * (QUEUE + 2), VOCAB))
    # Nothing was admitted: no token is generated for the refused client, now or later.
    after = _settled(app.url)
    generated = total(after, "flotilla:generation_tokens_total") - total(before, "flotilla:generation_tokens_total")
    assert generated == 0, f"{generated} tokens generated for a refused request ({response.status_code})"
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "prompt" and f"queues at most {QUEUE}" in error["message"], error
    assert _complete(app, random_prompts([8], VOCAB, seed=1), max_tokens=3).status_code == 200


def test_one_refused_prompt_aborts_the_admitted_ones_and_frees_their_blocks(app):
    """Three prompts fit the queue; two start toward 200 tokens each and the engine refuses
    the third (a token id beyond the vocabulary): the answer is a 400 naming prompt, and the two
    are aborted (not finished by length) with their KV blocks freed."""
    before = _settled(app.url)
    assert before, "the replica is not idle before the test"
    good = random_prompts([24, 24], VOCAB, seed=2)
    response = _complete(app, good + [[5, 6, VOCAB + 9]])
    assert response.status_code == 400 and response.json()["error"]["param"] == "prompt", response.text

    def aborted():
        m = _idle(app.url)
        moved = m and total(m, "flotilla:request_success_total", finished_reason="abort") >= (
            total(before, "flotilla:request_success_total", finished_reason="abort") + 2
        )
        return m if moved else None

    after = wait_for(aborted)
    assert after, "the two admitted prompts were not aborted"
    finished = total(after, "flotilla:request_success_total", finished_reason="length")
    assert finished == total(before, "flotilla:request_success_total", finished_reason="length")
    assert total(after, "flotilla:generation_tokens_total") - total(before, "flotilla:generation_tokens_total") < 2 * LONG
    assert _complete(app, random_prompts([8], VOCAB, seed=3), max_tokens=3).status_code == 200
