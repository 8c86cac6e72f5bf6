"""Prefill/decode disaggregation under a hostile client, live: SmolLM2 served by one prefill
and one decode replica (KV by NIXL over UCX on loopback) on the session's Serve, driven over
real HTTP by clients that leave early.

The prefill pool is small (``--max-total-tokens 1024``, 64 blocks of 16 tokens), so three
~300-token prompts fill it: the blocks a prefill replica holds for the decode side under a
lease belong to no running request, and leases decide whether a waiting prompt fits.
"""

import threading
import time
from types import SimpleNamespace

import httpx
import pytest

from helpers.live_metrics import metrics, total, wait_for
from helpers.prompts import random_prompts

APP, PREFIX = "flotilla-pd-hostile", "/pdh"
POOL_TOKENS = 1024
PROMPT_TOKENS = 300
# SmolLM2's vocabulary is 49152 ids; ids from 1000 up are ordinary word pieces.
VOCAB_LOW, VOCAB = 1000, 40000
# Every wait on the server is bounded by this (a stream's first frame, a whole request).
REQUEST_TIMEOUT_S = 60.0


@pytest.fixture(scope="module")
def pd(serve_http):
    from ray import serve

    from flotilla.cluster.platform import probe
    from flotilla.deploy.serve_cmd import wait_until_healthy
    from flotilla.serve.app import build_pd_app
    from flotilla.serve.plan import resolve_pool, serve_options
    from flotilla.serve.plan import pd_server_fields

    platform = probe()
    prefill_fields, decode_fields = pd_server_fields({"max_total_tokens": POOL_TOKENS})
    prefill, model = resolve_pool(prefill_fields, platform)
    decode, _ = resolve_pool(decode_fields, platform)
    options = serve_options(decode, model=model, disaggregation_mode="pd", kv_transport="nixl")
    serve.run(build_pd_app(prefill, decode, options), name=APP, route_prefix=PREFIX)
    url = f"{serve_http}{PREFIX}"
    wait_until_healthy(url, 180)
    yield SimpleNamespace(url=url, name=options.served_model_name)
    serve.delete(APP)


def _prompts(count: int, seed: int) -> list[list[int]]:
    return random_prompts([PROMPT_TOKENS] * count, VOCAB, seed=seed, low=VOCAB_LOW)


def _first_frame_then_leave(pd, prompt: list[int], max_tokens: int = 32) -> float | str:
    """Stream a completion, read its first SSE frame and close the connection: the seconds
    the frame took, or what went wrong instead."""
    body = {"model": pd.name, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    started = time.monotonic()
    try:
        with httpx.stream("POST", f"{pd.url}/v1/completions", json=body, timeout=REQUEST_TIMEOUT_S) as response:
            if response.status_code != 200:
                return f"HTTP {response.status_code}: {response.read().decode()[:300]}"
            for line in response.iter_lines():
                if line.startswith("data: "):
                    if '"error"' in line:
                        return f"error frame: {line[:300]}"
                    return time.monotonic() - started
    except httpx.HTTPError as exc:
        return f"{type(exc).__name__}: {exc}"
    return "the stream ended without a frame"


def _concurrently(fn, args: list) -> list:
    results: list = [None] * len(args)

    def run(i):
        results[i] = fn(*args[i])

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(args))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(REQUEST_TIMEOUT_S + 10)
    return results


def _leased_blocks(pd) -> float:
    return total(metrics(pd.url), "flotilla:kv_transfer_leased_blocks", pool="prefill")


def _pool_healthy(pool: str, timeout_s: float = 10.0) -> bool:
    from ray import serve

    return bool(serve.get_deployment_handle(pool, app_name=APP).is_healthy.remote().result(timeout_s=timeout_s))


def _leave_after(pd, prompt: list[int], delay_s: float) -> None:
    """Send a streamed completion and hang up ``delay_s`` after sending it (before or after
    its first frame)."""
    body = {"model": pd.name, "prompt": prompt, "max_tokens": 32, "temperature": 0, "stream": True}
    deadline = time.monotonic() + delay_s
    try:
        with httpx.stream("POST", f"{pd.url}/v1/completions", json=body, timeout=delay_s) as response:
            for _ in response.iter_lines():
                if time.monotonic() >= deadline:
                    break
    except httpx.HTTPError:
        pass


def test_streams_closed_after_their_first_frame_release_their_prefill_blocks(pd):
    # NOTE: one-block prompts: each stream's first frame comes while its release is on its way.
    for prompt in random_prompts([12] * 10, VOCAB, seed=5, low=VOCAB_LOW):
        took = _first_frame_then_leave(pd, prompt)
        assert isinstance(took, float), took
    # NOTE: well inside the 30 s lease: only released blocks are back this soon.
    assert wait_for(lambda: _leased_blocks(pd) == 0, timeout_s=8.0), _leased_blocks(pd)


def test_clients_that_hang_up_at_any_moment_leave_no_block_leased(pd):
    prompts = random_prompts([12] * 12, VOCAB, seed=6, low=VOCAB_LOW)
    for i, prompt in enumerate(prompts):
        _leave_after(pd, prompt, 0.03 * (i + 1))  # before the prefill, during it, after the first frame
    assert wait_for(lambda: _leased_blocks(pd) == 0, timeout_s=8.0), _leased_blocks(pd)


def test_long_prompts_that_fill_the_prefill_pool_keep_its_engine_alive(pd):
    """Twelve concurrent prompts of a third of the pool each, whose clients leave after the
    first frame: the prefill replica's leases fill its pool while prompts wait."""
    results = _concurrently(_first_frame_then_leave, [(pd, p) for p in _prompts(12, seed=21)])
    assert all(isinstance(r, float) for r in results), results
    assert _pool_healthy("prefill")
    assert wait_for(lambda: _leased_blocks(pd) == 0, timeout_s=8.0), _leased_blocks(pd)


def _kill_the_prefill_replica() -> float:
    import ray

    names = [a for a in ray.util.list_named_actors(all_namespaces=True) if f"{APP}#prefill#" in a["name"]]
    assert len(names) == 1, names
    ray.kill(ray.get_actor(names[0]["name"], namespace=names[0]["namespace"]), no_restart=True)
    return time.monotonic()


def _prefill_is_back() -> bool:
    try:
        return _pool_healthy("prefill", timeout_s=1.0)
    except Exception:  # noqa: BLE001 - not there yet
        return False


def test_while_the_prefill_pool_is_down_decode_serves_and_health_is_degraded(pd):
    """Destructive (last in the module): the prefill replica is killed; until Serve's
    replacement has loaded the model, ``/health`` answers 200 within 1 s and requests are
    computed whole on the decode pool; then PD resumes."""
    killed = _kill_the_prefill_replica()
    health_s, statuses = [], []
    body = {"model": pd.name, "max_tokens": 4, "temperature": 0}
    answered = []
    for i, prompt in enumerate(random_prompts([12] * 3, VOCAB, seed=31, low=VOCAB_LOW)):
        started = time.monotonic()
        response = httpx.get(f"{pd.url}/health", timeout=10)
        health_s.append(time.monotonic() - started)
        statuses.append(response.status_code)
        started = time.monotonic()
        response = httpx.post(f"{pd.url}/v1/completions", json={**body, "prompt": prompt}, timeout=REQUEST_TIMEOUT_S)
        assert response.status_code == 200, response.text
        answered.append(time.monotonic() - started)
    served_at = time.monotonic()
    assert max(health_s) < 1.0 and statuses == [200] * 3 and max(answered) < 10.0, (health_s, statuses, answered)
    deadline = killed + 180
    while not _prefill_is_back():
        assert time.monotonic() < deadline, "the prefill replica was not replaced within 180 s"
        time.sleep(0.5)
    back_at = time.monotonic()
    # NOTE: the requests were answered while the pool was down, not after its replacement.
    assert served_at < back_at, (served_at - killed, back_at - killed)

    def moved() -> float:
        return total(metrics(pd.url), "flotilla:kv_transfer_bytes_total", pool="decode")

    before = moved()
    prompt = random_prompts([40], VOCAB, seed=32, low=VOCAB_LOW)[0]

    def pd_again() -> bool:
        response = httpx.post(f"{pd.url}/v1/completions", json={**body, "prompt": prompt}, timeout=REQUEST_TIMEOUT_S)
        assert response.status_code == 200, response.text
        return wait_for(lambda: moved() > before, timeout_s=3.0)

    assert wait_for(pd_again, timeout_s=15.0, interval_s=1.0), "PD did not resume after the replacement"
    assert httpx.get(f"{pd.url}/health", timeout=10).status_code == 200
