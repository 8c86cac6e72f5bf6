"""Admission on a prefill engine whose KV pool is full of leased blocks, in this process
(no Serve, no KV transport): an :class:`AsyncEngine` over the tiny random Llama with a small
pool, driven through ``prefill`` / ``release_kv`` / ``generate``.

The blocks a prefill engine holds for the decode side (under a lease) belong to no running
request. When they fill the pool the next prompt must wait for a release or an expiry, and
the engine thread must neither die nor spin meanwhile; a request that cannot be scheduled
at all fails alone. Every wait is bounded.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from flotilla.cluster.engine.llm_engine import LLMEngine
from flotilla.cluster.engine.sampling_params import SamplingParams
from flotilla.cluster.engine.scheduler import UnschedulableRequestError
from flotilla.cluster.models.sources import resolve_model_source
from flotilla.resolution import ModelFacts, ServerArgs, preset, resolve
from flotilla.serve.async_engine import AsyncEngine
from flotilla.serve.types import GenerateRequest
from helpers.prompts import random_prompts
from helpers.tiny_models import save_tiny_llama
from helpers.torch_threads import one_intra_op_thread

VOCAB = 256
WAIT_S = 20.0
LEASE_S = 30.0
# The pool: 256 tokens of KV cache, 16 blocks of 16 tokens.
POOL_TOKENS = 256


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    with one_intra_op_thread():
        yield


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama-admission")
    save_tiny_llama(path, vocab_size=VOCAB)
    return path


def _engine(model_dir, **args) -> LLMEngine:
    source = resolve_model_source(str(model_dir))
    server = ServerArgs.create(model_path=str(source.path), max_total_tokens=POOL_TOKENS, **args)
    return LLMEngine(resolve(server, ModelFacts.from_hf_config(source.config_dict), preset("cpu")), source)


@pytest.fixture
def prefill(model_dir):
    engine = AsyncEngine(_engine(model_dir), 16, replica_id="p", pool="prefill")
    yield engine
    engine.shutdown()


def _request(prompt, request_id, max_tokens=4) -> GenerateRequest:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return GenerateRequest(request_id, list(prompt), params, time.time())


def _third_of_the_pool(engine: AsyncEngine, count: int, seed: int) -> list[list[int]]:
    """``count`` prompts of a third of the pool each (in whole blocks, less a token)."""
    pool = engine.engine.scheduler.pool
    blocks = pool.num_blocks // 3
    return random_prompts([blocks * pool.block_size - 1] * count, VOCAB, seed=seed)


class _CountingSchedule:
    """Counts ``scheduler.schedule()`` calls (the engine thread's steps)."""

    def __init__(self, scheduler):
        self.calls, self._real = 0, scheduler.schedule
        scheduler.schedule = self

    def __call__(self):
        self.calls += 1
        return self._real()


def test_a_prompt_that_finds_the_pool_full_of_leases_waits_for_a_release(prefill):
    scheduler = prefill.engine.scheduler
    prompts = _third_of_the_pool(prefill, 4, seed=3)

    async def main():
        held = [await prefill.prefill(_request(p, f"held-{i}"), LEASE_S) for i, p in enumerate(prompts[:3])]
        assert scheduler.pool.num_free_blocks < scheduler.pool.blocks_for_tokens(len(prompts[3]))
        waiting = asyncio.ensure_future(prefill.prefill(_request(prompts[3], "waits"), LEASE_S))
        await asyncio.sleep(0.3)  # NOTE: the add is applied and the step finds no room
        counter = _CountingSchedule(scheduler)
        await asyncio.sleep(1.0)
        assert not waiting.done() and prefill.healthy, prefill.dead_reason
        assert scheduler.waiting_for_held_blocks
        # NOTE: no spinning: nothing changes until a release, so the thread sleeps.
        assert counter.calls <= 1, counter.calls
        started = time.monotonic()
        assert await prefill.release_kv(held[0].prefill_request_id)
        outcome = await asyncio.wait_for(waiting, WAIT_S)
        took = time.monotonic() - started
        for lease in held[1:] + [outcome]:
            assert await prefill.release_kv(lease.prefill_request_id)
        return outcome, took

    outcome, took = asyncio.run(main())
    assert outcome.finish_reason == "length" and len(outcome.block_ids) == scheduler.pool.blocks_for_tokens(len(prompts[3]))
    assert took < 5.0 and prefill.healthy
    assert scheduler.num_held_blocks == 0 and scheduler.pool.num_used_blocks == 0


def test_a_lease_that_expires_lets_the_waiting_prompt_in(prefill):
    scheduler = prefill.engine.scheduler
    prompts = _third_of_the_pool(prefill, 4, seed=4)

    async def main():
        held = [await prefill.prefill(_request(p, f"short-{i}"), 0.5) for i, p in enumerate(prompts[:3])]
        started = time.monotonic()
        outcome = await asyncio.wait_for(prefill.prefill(_request(prompts[3], "after-expiry"), LEASE_S), WAIT_S)
        waited = time.monotonic() - started
        # NOTE: the fourth needs one lease's blocks, so it may run once the first lease ends;
        # the later two were granted a little later: past 0.5 s (plus 0.2 s for the idle
        # thread's wake) from the last grant every lease has ended by itself.
        await asyncio.sleep(max(0.0, started + 0.7 - time.monotonic()))
        released = [await prefill.release_kv(lease.prefill_request_id) for lease in held]
        assert await prefill.release_kv(outcome.prefill_request_id)
        return waited, released

    waited, released = asyncio.run(main())
    # NOTE: nobody released the first three: their leases ended on time and the fourth ran.
    assert waited < 5.0 and released == [False, False, False]
    assert prefill.healthy and scheduler.num_held_blocks == 0 and scheduler.pool.num_used_blocks == 0


def test_leases_that_fill_the_pool_never_stop_ordinary_requests_for_good(prefill):
    """A generate behind a full pool of leases is served once they end; the replica stays healthy."""
    scheduler = prefill.engine.scheduler
    prompts = _third_of_the_pool(prefill, 4, seed=5)

    async def main():
        held = [await prefill.prefill(_request(p, f"lease-{i}"), LEASE_S) for i, p in enumerate(prompts[:3])]

        async def generate():
            return [c async for c in prefill.generate(_request(prompts[3], "generate"))]

        task = asyncio.ensure_future(generate())
        await asyncio.sleep(0.5)
        assert not task.done() and prefill.healthy
        for lease in held:
            await prefill.release_kv(lease.prefill_request_id)
        return await asyncio.wait_for(task, WAIT_S)

    chunks = asyncio.run(main())
    assert chunks[-1].finished and chunks[-1].error is None
    assert [c.finish_reason for c in chunks[-1].completions] == ["length"]
    assert scheduler.num_held_blocks == 0 and scheduler.pool.num_used_blocks == 0


def test_a_request_that_cannot_be_scheduled_fails_alone_and_the_loop_goes_on(prefill):
    """The scheduler's last resort (a request it could never schedule) fails that request
    with an error; the engine thread serves the next one."""
    scheduler = prefill.engine.scheduler
    real_schedule = scheduler.schedule
    prompt = random_prompts([20], VOCAB, seed=6)[0]

    def refusing_schedule():
        head = scheduler.waiting[0] if scheduler.waiting else None
        if head is not None and head.request_id.startswith("doomed"):
            raise UnschedulableRequestError(head.request_id, f"request {head.request_id!r} cannot be scheduled (test)")
        return real_schedule()

    scheduler.schedule = refusing_schedule

    async def main():
        doomed = [c async for c in prefill.generate(_request(prompt, "doomed"))]
        with pytest.raises(Exception, match="cannot be scheduled"):
            await asyncio.wait_for(prefill.prefill(_request(prompt, "doomed-prefill"), LEASE_S), WAIT_S)
        served = [c async for c in prefill.generate(_request(prompt, "served"))]
        return doomed, served

    doomed, served = asyncio.run(asyncio.wait_for(main(), WAIT_S))
    assert doomed[-1].finished and "cannot be scheduled" in (doomed[-1].error or "")
    assert [c.finish_reason for c in doomed[-1].completions] == ["error"]
    assert served[-1].error is None and [c.finish_reason for c in served[-1].completions] == ["length"]
    assert prefill.healthy and scheduler.pool.num_used_blocks == 0


def test_overlap_scheduling_fails_an_unschedulable_request_without_killing_the_engine(model_dir):
    engine = _engine(model_dir)
    engine.overlap = True
    scheduler, real_schedule = engine.scheduler, engine.scheduler.schedule
    prompt = random_prompts([20], VOCAB, seed=7)[0]

    def refusing_schedule():
        head = scheduler.waiting[0] if scheduler.waiting else None
        if head is not None and head.request_id == "doomed":
            raise UnschedulableRequestError("doomed", "request 'doomed' cannot be scheduled (test)")
        return real_schedule()

    scheduler.schedule = refusing_schedule
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    engine.add_request(prompt, params, request_id="doomed")
    engine.add_request(prompt, params, request_id="served")
    for _ in range(50):
        if not engine.has_unfinished_requests():
            break
        engine.step()
    doomed, served = engine.pop_output("doomed"), engine.pop_output("served")
    assert engine.dead is None
    assert doomed.outputs[0].finish_reason == "error" and "cannot be scheduled" in doomed.error
    assert served.outputs[0].finish_reason == "length" and len(served.outputs[0].token_ids) == 3
