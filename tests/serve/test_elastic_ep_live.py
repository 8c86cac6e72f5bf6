"""Elastic EP, live: a tiny random Qwen3-MoE (8 experts; a word-level tokenizer whose text
reads back as token ids) served in the issue's layout (``--tp 1 --dp 1 --ep 1
--enable-dp-attention --enable-dp-lm-head --elastic-ep-backend ray --max-ep-size 2
--disable-cuda-graph``) through the real Serve application on the session's Serve, driven
over HTTP; the group grows from one rank to two while streams are in flight.

The oracle is the same deployment before the scale: every greedy stream (64 tokens, prefix
cache off so no request reads another's KV) must produce the tokens its prompt produced at
EP=1, whether it ran before, across or after the commit. The tests run in order (one
deployment for the module): the state at EP=1, the refusals, then the scale.
"""

import threading
import time

import pytest

from helpers.elastic_live import deploy_elastic, is_scaling, model_card, scale, stream_tokens
from helpers.live_metrics import metrics, total, wait_for

APP, PREFIX = "flotilla-elastic-ep-test", "/elastic"
MAX_TOKENS = 64
# Streams running at once while the group grows.
STREAMS = 3


@pytest.fixture(scope="module")
def elastic(serve_http, tmp_path_factory):
    from ray import serve

    deployment = deploy_elastic(serve_http, tmp_path_factory.mktemp("tiny-qwen3-moe-elastic-live"), APP, PREFIX)
    assert sorted(deployment.plan.joiner_configs) == [(1, 2)]
    yield deployment
    serve.delete(APP)


def _stream(deployment, prompt: list[int], on_first=None) -> list[int]:
    return stream_tokens(deployment, prompt, MAX_TOKENS, on_first)


def test_it_starts_at_one_rank_and_says_so_everywhere(elastic):
    assert is_scaling(elastic) is False and is_scaling(elastic, "POST") is False
    assert wait_for(lambda: total(metrics(elastic.url), "flotilla:ep_size") == 1)
    card = model_card(elastic)
    assert (card["ep_size"], card["max_ep_size"]) == (1, 2)
    # The oracle: each prompt's greedy tokens at EP=1.
    for i, prompt in enumerate(elastic.prompts):
        elastic.reference[i] = _stream(elastic, prompt)
        assert len(elastic.reference[i]) == MAX_TOKENS


def test_a_size_beyond_max_or_not_a_number_is_a_400_and_it_keeps_serving(elastic):
    for value, words in ((3, "max_ep_size=2"), ("x", "must be an integer")):
        response = scale(elastic, {"new_ep_size": value})
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == "new_ep_size" and words in error["message"], error
    assert is_scaling(elastic) is False and model_card(elastic)["ep_size"] == 1
    assert _stream(elastic, elastic.prompts[0]) == elastic.reference[0]


def test_it_grows_to_two_ranks_under_streams_with_the_same_greedy_tokens(elastic):
    assert elastic.reference, "needs the EP=1 oracle of the first test"
    stop, streaming = threading.Event(), threading.Event()
    results: list[tuple[int, float, float, object]] = []  # (prompt, start, end, tokens or error)
    lock = threading.Lock()

    def worker(k: int) -> None:
        i = k
        while not stop.is_set():
            start = time.monotonic()
            try:
                outcome = _stream(elastic, elastic.prompts[i], streaming.set)
            except Exception as exc:  # noqa: BLE001 - reported by the assertions below
                outcome = exc
            with lock:
                results.append((i, start, time.monotonic(), outcome))
            i = (i + STREAMS) % len(elastic.prompts)

    workers = [threading.Thread(target=worker, args=(k,), daemon=True) for k in range(STREAMS)]
    for w in workers:
        w.start()
    assert streaming.wait(60), "no stream started"

    answer: dict = {}
    scaler = threading.Thread(target=lambda: answer.update(response=scale(elastic, {"new_ep_size": 2})))
    scaler.start()
    assert wait_for(lambda: is_scaling(elastic), timeout_s=30, interval_s=0.05), "the scale never showed as running"
    conflict = scale(elastic, {"new_data_parallel_size": 2})  # vLLM's spelling, same route
    assert conflict.status_code == 409, conflict.text
    scaler.join(300)
    done = time.monotonic()
    response = answer["response"]
    assert response.status_code == 200, response.text
    report = response.json()
    assert (report["old_ep_size"], report["new_ep_size"]) == (1, 2) and report["commit_pause_s"] >= 0

    # Let every worker finish a stream that started after the commit, then stop.
    def after_commit() -> bool:
        with lock:
            return sum(1 for _, start, _, _ in results if start > done) >= STREAMS

    assert wait_for(after_commit, timeout_s=120, interval_s=0.1)
    stop.set()
    for w in workers:
        w.join(120)

    failed = [(i, r) for i, _, _, r in results if isinstance(r, Exception)]
    assert not failed, failed
    for i, _, _, tokens in results:
        assert tokens == elastic.reference[i], f"prompt {i} changed its greedy tokens"
    assert any(start < done < end for _, start, end, _ in results), "no stream was in flight across the scale"
    assert is_scaling(elastic) is False and model_card(elastic)["ep_size"] == 2

    def grown() -> bool:
        m = metrics(elastic.url)
        return (
            total(m, "flotilla:ep_size") == 2
            and total(m, "flotilla:ep_scale_total", outcome="success") == 1
            and total(m, "flotilla:dp_rank_requests_total", dp_rank="1") > 0
        )

    assert wait_for(grown), metrics(elastic.url).get("flotilla:dp_rank_requests_total")
