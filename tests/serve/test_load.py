"""A bounded load test on loopback: 200 streaming completions at concurrency 32 through the
live Serve application (one SmolLM2 engine replica, the least-loaded router).

Every request must complete or be refused with 429 (never a 5xx or a dropped connection),
and afterwards the engine holds nothing: no running or waiting requests and no KV blocks in
use, as ``/metrics`` reports them (the replica pushes its metrics about once a second, so
the check polls).
"""

import asyncio
import random

import pytest

from flotilla.deploy.loadgen import http_load
from flotilla.serve.app import build_app
from flotilla.serve.plan import resolve_pool, serve_options

from helpers.live_metrics import metrics, total, wait_for

APP = "flotilla-load-test"
NUM_REQUESTS = 200
CONCURRENCY = 32


@pytest.fixture(scope="module")
def app_url(serve_http):
    from ray import serve

    from flotilla.cluster.platform import probe
    from flotilla.deploy.serve_cmd import wait_until_healthy

    config, model = resolve_pool({"max_total_tokens": 4096}, probe())
    options = serve_options(config, model=model, num_replicas=1)
    serve.run(build_app(config, options), name=APP, route_prefix="/")
    wait_until_healthy(serve_http, 60)
    yield serve_http
    serve.delete(APP)


def test_200_requests_at_concurrency_32_complete_or_get_429_and_leak_nothing(app_url):
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 49152) for _ in range(rng.randrange(4, 24))] for _ in range(NUM_REQUESTS)]
    report = asyncio.run(http_load(app_url, "smollm2", prompts, max_tokens=8, concurrency=CONCURRENCY, timeout_s=300))
    summary = report.summary()
    assert summary["requests"] == NUM_REQUESTS
    assert summary["server_errors_5xx"] == 0 and summary["other_failures"] == 0, summary
    assert summary["completed"] + summary["rejected_429"] == NUM_REQUESTS
    assert summary["completed"] > 0
    assert all(r.output_tokens == 8 for r in report.results if r.status == 200)

    def drained():
        m = metrics(app_url)
        idle = total(m, "flotilla:num_requests_running") == 0 and total(m, "flotilla:num_requests_waiting") == 0
        return idle and total(m, "flotilla:kv_cache_usage_perc") == 0 and m

    m = wait_for(drained, timeout_s=15)
    assert m, "the engine still holds requests or KV blocks after the load"
    assert total(m, "flotilla:generation_tokens_total") >= 8 * summary["completed"]
