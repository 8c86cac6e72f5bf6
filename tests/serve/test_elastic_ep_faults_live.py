"""Elastic EP, live, when things go wrong and when nobody asks: a joiner killed mid-join, and
the autoscaler growing the group by itself under a bounded burst of load.

- Fault: the test kills the joining rank's actor (found by its name,
  ``flotilla-ep-joiner-<rank>-<tag>``) while the join runs. The scale answers 500 saying the
  deployment keeps serving at EP 1 (``/v1/models`` says so), the failure is counted
  (``flotilla:ep_scale_total{outcome="failure"}``) and logged by the replica, the joiners'
  placement group is released, requests still get their EP 1 tokens, and a later scale works.
- Autoscaling: a deployment with ``--elastic-ep-autoscale`` (queue signal only, a short window,
  a cooldown longer than the test, ``--max-ep-size 3`` so a second join would be possible) sees
  light load (one request at a time) and does not scale; then a burst of requests queued
  behind a small running cap: exactly one join, to EP 2, and every request of the burst
  completes.
"""

from __future__ import annotations

import concurrent.futures
import glob
import os
import threading
import time

import pytest

from helpers.elastic_live import deploy_elastic, model_card, scale, stream_tokens
from helpers.live_metrics import metrics, total, wait_for

MAX_TOKENS = 32


@pytest.fixture(scope="module")
def fault_deployment(serve_http, tmp_path_factory):
    from ray import serve

    app = "flotilla-elastic-fault-test"
    deployment = deploy_elastic(serve_http, tmp_path_factory.mktemp("tiny-qwen3-moe-elastic-fault"), app, "/elastic-fault")
    yield deployment
    serve.delete(app)


def _joiner_actors() -> list[dict]:
    import ray

    from flotilla.cluster.group import JOINER_NAME_PREFIX

    return [a for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].startswith(JOINER_NAME_PREFIX)]


def _kill_first_joiner(timeout_s: float) -> str | None:
    """Kill the first joining rank's actor that appears; its name, or None if none appeared."""
    import ray

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for actor in _joiner_actors():
            ray.kill(ray.get_actor(actor["name"], namespace=actor["namespace"]), no_restart=True)
            return actor["name"]
        time.sleep(0.01)
    return None


def _logged(text: str) -> bool:
    """Whether any log file of this Ray session holds ``text`` (replicas log there)."""
    import ray

    session = ray._private.worker._global_node.get_session_dir_path()
    for path in glob.glob(os.path.join(session, "logs", "**", "*"), recursive=True):
        if os.path.isfile(path):
            with open(path, errors="replace") as f:
                if text in f.read():
                    return True
    return False


def test_a_joiner_killed_mid_join_leaves_the_deployment_serving_at_the_old_size(fault_deployment):
    d = fault_deployment
    reference = stream_tokens(d, d.prompts[0], MAX_TOKENS)
    answer: dict = {}
    request = threading.Thread(target=lambda: answer.update(response=scale(d, {"new_ep_size": 2})))
    request.start()
    killed = _kill_first_joiner(timeout_s=60)
    request.join(300)
    assert killed is not None, "no joining rank appeared"
    response = answer["response"]
    assert response.status_code == 500, response.text
    message = response.json()["error"]["message"]
    assert "keeps serving at ep_size=1" in message and "joining rank 1" in message, message
    assert model_card(d)["ep_size"] == 1
    assert wait_for(lambda: total(metrics(d.url), "flotilla:ep_scale_total", outcome="failure") == 1)
    assert wait_for(lambda: _logged("elastic EP: scaling 1 -> 2 failed"), timeout_s=10), "the failure was not logged"
    assert _joiner_actors() == [], "the killed join left joiner actors behind"
    # Still serving, with the EP 1 tokens; and the next scale goes through.
    assert stream_tokens(d, d.prompts[0], MAX_TOKENS) == reference
    retry = scale(d, {"new_ep_size": 2})
    assert retry.status_code == 200, retry.text
    assert model_card(d)["ep_size"] == 2
    assert stream_tokens(d, d.prompts[0], MAX_TOKENS) == reference


@pytest.fixture(scope="module")
def autoscaled(serve_http, tmp_path_factory):
    from ray import serve

    from flotilla.serve.types import ElasticAutoscaleOptions

    app = "flotilla-elastic-autoscale-test"
    policy = ElasticAutoscaleOptions(
        enabled=True,
        interval_s=0.25,
        # NOTE: the queue alone decides (KV usage and TTFT off): its value is set by the test's load.
        waiting_per_rank_threshold=2,
        kv_usage_threshold=None,
        ttft_p90_threshold_s=None,
        window_s=1.5,
        cooldown_s=600,
    )
    deployment = deploy_elastic(
        serve_http,
        tmp_path_factory.mktemp("tiny-qwen3-moe-elastic-autoscale"),
        app,
        "/elastic-autoscale",
        flags={"max_ep_size": 3, "max_running_requests": 2},
        elastic_autoscale=policy,
    )
    yield deployment
    serve.delete(app)


def test_the_autoscaler_joins_once_under_a_burst_and_never_under_light_load(autoscaled):
    d = autoscaled
    # NOTE: /metrics merges every replica of the Serve namespace (the other test's application
    # may still be up): count this deployment's scales as the change from here.
    before = metrics(d.url)

    def scales(m, outcome: str) -> float:
        return total(m, "flotilla:ep_scale_total", outcome=outcome) - total(before, "flotilla:ep_scale_total", outcome=outcome)

    # Light load: one request at a time for several windows: nothing queues, nothing scales.
    light_until = time.monotonic() + 5
    while time.monotonic() < light_until:
        stream_tokens(d, d.prompts[1], 8)
    assert model_card(d)["ep_size"] == 1
    m = metrics(d.url)
    assert scales(m, "success") == scales(m, "failure") == 0
    # A bounded burst: 24 requests at once behind a running cap of 2.
    with concurrent.futures.ThreadPoolExecutor(24) as pool:
        futures = [pool.submit(stream_tokens, d, d.prompts[i % len(d.prompts)], 48) for i in range(24)]
        grown = wait_for(lambda: model_card(d)["ep_size"] == 2, timeout_s=120, interval_s=0.25)
        results = [f.result(timeout=300) for f in futures]
    assert grown, "the autoscaler did not grow the group under the burst"
    assert all(len(tokens) == 48 for tokens in results)
    # Exactly one join: the burst is over, and the cooldown holds any other.
    time.sleep(2)
    m = metrics(d.url)
    assert (scales(m, "success"), scales(m, "failure")) == (1, 0)
    assert model_card(d)["ep_size"] == 2
