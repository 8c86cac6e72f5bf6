"""The engine side of prefill/decode disaggregation, in this process and without Serve:
a ``prefill`` and a ``decode`` :class:`EngineReplica` over the tiny random Llama, their KV
endpoints real NIXL agents on UCX loopback (``UCX_NET_DEVICES=lo``, tests/conftest.py).

The oracle is an LLMEngine driven alone (the colocated answer). Every test also checks
that no block is left referenced: ``flotilla:kv_cache_used_blocks`` and
``flotilla:kv_transfer_leased_blocks`` back to 0 on both engines. Waits on the engine
threads are bounded polls.
"""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

import flotilla.serve.async_engine as async_engine_module
from flotilla.cluster.engine.kv_contract import KVHandoffError
from flotilla.cluster.engine.llm_engine import LLMEngine
from flotilla.cluster.engine.sampling_params import SamplingParams
from flotilla.cluster.models.sources import resolve_model_source
from flotilla.resolution import ModelFacts, ServerArgs, preset, resolve
from flotilla.serve.async_engine import AsyncEngine
from flotilla.serve.engine_replica import EngineReplica
from flotilla.serve.types import EngineUnavailableError, GenerateRequest, ReplicaPin, ServeOptions
from helpers.prompts import random_prompts
from helpers.tiny_models import save_tiny_llama
from helpers.torch_threads import one_intra_op_thread

VOCAB = 256
BLOCK = 16
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
WAIT_S = 10.0
LEASE_S = 30.0


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    with one_intra_op_thread():
        yield


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama-pd")
    save_tiny_llama(path, vocab_size=VOCAB)
    return path


def resolved(path):
    source = resolve_model_source(str(path))
    args = ServerArgs.create(model_path=str(source.path), max_total_tokens=2048)
    return resolve(args, ModelFacts.from_hf_config(source.config_dict), preset("cpu")), source


@pytest.fixture(scope="module")
def oracle(model_dir):
    """The colocated answer: ``want(prompt, params)`` runs the request alone on an LLMEngine."""
    engine = LLMEngine(*resolved(model_dir))

    def want(prompt, params=GREEDY):
        request_id = engine.add_request(prompt, params)
        while engine.has_unfinished_requests():
            engine.step()
        return engine.pop_output(request_id).outputs[0].token_ids

    return want


@pytest.fixture(scope="module")
def pd(model_dir):
    """``(prefill, decode)`` replicas; the decode side recomputes a prompt whose KV read fails."""
    config, _ = resolved(model_dir)
    options = ServeOptions(
        model=str(model_dir), kv_transport="nixl", kv_lease_s=LEASE_S, kv_transfer_timeout_s=10.0,
        kv_load_failure_policy="recompute",
    )
    prefill = EngineReplica(config, options, pool="prefill", replica_id="p0")
    try:
        decode = EngineReplica(config, options, pool="decode", replica_id="d0")
    except BaseException:
        prefill.shutdown()
        raise
    yield prefill, decode
    decode.shutdown()
    prefill.shutdown()


def request(prompt, params=GREEDY, request_id="req", prefix_key=None):
    return GenerateRequest(request_id, list(prompt), params, time.time(), prefix_key)


def metric(replica: EngineReplica, name: str, **labels) -> float:
    labels = {"replica": replica.replica_id, "pool": replica.pool, **labels}
    value = replica.engine.metrics.registry.get_sample_value(name, labels)
    return 0.0 if value is None else value


def joined_tokens(chunks) -> list[int]:
    return [t for chunk in chunks for c in chunk.completions for t in c.token_ids]


async def wait_until(predicate, what, timeout_s=WAIT_S):
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        await asyncio.sleep(0.005)


def no_blocks_held(*replicas: EngineReplica) -> bool:
    return all(
        metric(r, "flotilla:kv_cache_used_blocks") == 0 and metric(r, "flotilla:kv_transfer_leased_blocks") == 0
        for r in replicas
    )


async def assert_no_blocks_held(*replicas: EngineReplica) -> None:
    # NOTE: the gauges are published by the engine threads after each command and step.
    await wait_until(lambda: no_blocks_held(*replicas), "every block to be freed")
    for r in replicas:
        assert r.engine.engine.scheduler.pool.num_used_blocks == 0
        assert r.engine.engine.scheduler.num_held_blocks == 0


async def handoff(prefill: EngineReplica, decode: EngineReplica, req: GenerateRequest):
    """The ingress's flow: prefill, stream the decode, release (asserting it released)."""
    ticket = await prefill.prefill(req)
    try:
        chunks = [c async for c in decode.generate_prefilled(req, ticket)]
    finally:
        released = await prefill.release_kv(ReplicaPin(ticket.replica_id), ticket.prefill_request_id)
    assert released
    return ticket, chunks


def test_ray_object_transport_between_worker_group_runners(model_dir, oracle, ray_cluster):
    """``kv_transport="ray"``: both replicas run their rank in a worker actor (GroupRunner),
    and the decode ranks pull the blocks through the prefill ranks' ``kv_export``.

    NOTE: first in the module, before the NIXL replicas of ``pd`` exist: each NIXL agent's
    progress thread keeps a core busy, which would starve the worker actors on a small box."""
    config, _ = resolved(model_dir)
    options = ServeOptions(model=str(model_dir), kv_transport="ray", kv_lease_s=LEASE_S, kv_transfer_timeout_s=10.0)
    replicas = []
    try:
        for pool, replica_id in (("prefill", "rp0"), ("decode", "rd0")):
            replicas.append(EngineReplica(config, options, pool=pool, replica_id=replica_id))
        prefill, decode = replicas
        assert type(prefill.engine.engine.runner).__name__ == "GroupRunner"
        prompt = random_prompts([37], VOCAB, seed=19)[0]

        async def main():
            _, chunks = await handoff(prefill, decode, request(prompt, request_id="ray"))
            await assert_no_blocks_held(prefill, decode)
            return chunks

        assert joined_tokens(asyncio.run(main())) == oracle(prompt)
        assert metric(decode, "flotilla:kv_transfer_seconds_count") == 1
        assert metric(decode, "flotilla:kv_transfer_bytes_total") > 0
    finally:
        for replica in replicas:
            replica.shutdown()


def test_prefill_then_decode_on_another_engine_gives_the_colocated_tokens(pd, oracle):
    prefill, decode = pd
    prompts = random_prompts([5, 17, 40], VOCAB, seed=11)
    steps, execute = [], decode.engine.engine.runner.execute

    def recording(step, rows):
        steps.append([item.num_new_tokens for item in step.scheduled])
        return execute(step, rows)

    decode.engine.engine.runner.execute = recording
    bytes_before = metric(decode, "flotilla:kv_transfer_bytes_total")
    reads_before = metric(decode, "flotilla:kv_transfer_seconds_count")
    try:

        async def main():
            results = []
            for i, prompt in enumerate(prompts):
                ticket = await prefill.prefill(request(prompt, request_id=f"h{i}", prefix_key=1000 + i))
                # Held under a lease until released.
                assert metric(prefill, "flotilla:kv_transfer_leased_blocks") == len(ticket.block_ids)
                assert metric(prefill, "flotilla:kv_cache_used_blocks") >= len(ticket.block_ids)
                req = request(prompt, request_id=f"h{i}", prefix_key=1000 + i)
                chunks = [c async for c in decode.generate_prefilled(req, ticket)]
                wrong_pin = await prefill.release_kv(ReplicaPin("someone-else"), ticket.prefill_request_id)
                first = await prefill.release_kv(ReplicaPin("p0"), ticket.prefill_request_id)
                second = await prefill.release_kv(ReplicaPin("p0"), ticket.prefill_request_id)
                results.append((ticket, chunks, (wrong_pin, first, second)))
            await assert_no_blocks_held(prefill, decode)
            return results

        results = asyncio.run(main())
    finally:
        decode.engine.engine.runner.execute = execute
    for prompt, (ticket, chunks, releases) in zip(prompts, results):
        want = oracle(prompt)
        assert joined_tokens(chunks) == want
        # The first token goes out on its own as soon as the blocks are in, before any step.
        assert joined_tokens(chunks[:1]) == [want[0]]
        assert [c.finished for c in chunks] == [False] * (len(chunks) - 1) + [True]
        last = chunks[-1]
        assert (last.prompt_tokens, last.completion_tokens, last.error) == (len(prompt), len(want), None)
        assert last.completions[-1].finish_reason == "length"
        assert (ticket.replica_id, ticket.first_token, ticket.finish_reason) == ("p0", want[0], "length")
        assert ticket.lease_s == LEASE_S and ticket.peer_id == prefill.kv_peer_id and ticket.peer_id.startswith("p0-")
        assert len(ticket.peer_metadata) == 1
        assert len(ticket.block_ids) == -(-len(prompt) // BLOCK) and ticket.prompt_token_ids == prompt
        assert ticket.chunk.finished and joined_tokens([ticket.chunk]) == [want[0]]
        # A pin naming another replica releases nothing; the second release finds nothing.
        assert releases == (False, True, False)
    # Prefilled prompts count for prefix affinity on both sides.
    for replica in (prefill, decode):
        assert {1000, 1001, 1002} <= set(replica.record_routing_stats()["prefix_keys"])
    # The decode engine never computed a prompt: every step decoded one token per request.
    assert steps and all(counts == [1] for counts in steps)
    assert metric(decode, "flotilla:kv_transfer_seconds_count") - reads_before == len(prompts)
    assert metric(decode, "flotilla:kv_transfer_bytes_total") > bytes_before
    assert metric(decode, "flotilla:kv_transfer_failures_total") == 0


def test_a_first_token_that_ends_the_request_is_answered_from_the_ticket(pd, oracle):
    prefill, decode = pd
    prompt = random_prompts([21], VOCAB, seed=12)[0]
    first = oracle(prompt)[0]
    one_token = SamplingParams(temperature=0, max_tokens=1)
    stopped = SamplingParams(temperature=0, max_tokens=10, stop_token_ids=[first])
    reads_before = metric(decode, "flotilla:kv_transfer_seconds_count")

    async def main():
        out = []
        for i, params in enumerate((one_token, stopped)):
            ticket, chunks = await handoff(prefill, decode, request(prompt, params, f"s{i}"))
            out.append((ticket, chunks))
        await assert_no_blocks_held(prefill, decode)
        return out

    (length_ticket, length_chunks), (stop_ticket, stop_chunks) = asyncio.run(main())
    assert length_chunks == [length_ticket.chunk] and length_ticket.finish_reason == "length"
    assert stop_chunks == [stop_ticket.chunk] and stop_ticket.finish_reason == "stop"
    for chunks in (length_chunks, stop_chunks):
        assert joined_tokens(chunks) == [first] and chunks[-1].finished and chunks[-1].completion_tokens == 1
    assert stop_chunks[0].completions[0].stop_reason == first
    # The decode engine read nothing and ran nothing.
    assert metric(decode, "flotilla:kv_transfer_seconds_count") == reads_before


def test_a_failed_read_is_recomputed_or_fails_clearly_and_leaks_nothing(pd, oracle):
    prefill, decode = pd
    prompts = random_prompts([19, 33], VOCAB, seed=13)
    failures_before = metric(decode, "flotilla:kv_transfer_failures_total")

    async def main():
        # recompute (the replica's policy): the client sees the colocated tokens.
        await decode.kv_set_fail_next_reads(1)
        _, recomputed = await handoff(prefill, decode, request(prompts[0], request_id="rc"))
        await assert_no_blocks_held(prefill, decode)
        # fail: one final chunk with the error, before any token (the ingress answers 503).
        await decode.kv_set_fail_next_reads(1)
        req = request(prompts[1], request_id="fl")
        ticket = await prefill.prefill(req)
        seen = [chunk async for chunk in decode.engine.generate_prefilled(req, ticket, "fail", 10.0)]
        assert len(seen) == 1 and seen[0].finished and joined_tokens(seen) == []
        assert [c.finish_reason for c in seen[0].completions] == ["error"]
        assert "kv_load_failure_policy='fail'" in seen[0].error and "injected KV transfer failure" in seen[0].error
        assert await prefill.release_kv(ReplicaPin("p0"), ticket.prefill_request_id)
        # A ticket too old for its lease is not read; under fail that is an error before any chunk.
        stale = GenerateRequest("old", prompts[1], GREEDY, time.time() - 0.95 * LEASE_S)
        ticket = await prefill.prefill(stale)
        with pytest.raises(KVHandoffError, match="lease on its KV blocks may have ended.*kv_load_failure_policy='fail'"):
            async for chunk in decode.engine.generate_prefilled(stale, ticket, "fail", 10.0):
                seen.append(chunk)
        assert len(seen) == 1
        assert await prefill.release_kv(ReplicaPin("p0"), ticket.prefill_request_id)
        await assert_no_blocks_held(prefill, decode)
        return recomputed

    recomputed = asyncio.run(main())
    assert joined_tokens(recomputed) == oracle(prompts[0]) and recomputed[-1].error is None
    assert metric(decode, "flotilla:kv_transfer_failures_total") - failures_before == 3
    assert not decode.engine.engine.has_unfinished_requests()


def test_a_request_too_old_for_its_lease_is_not_read_but_recomputed(pd, oracle):
    """The prefill side may have freed (and reused) blocks past the lease: reading them would
    decode from the wrong KV silently, so the decode side goes through the policy instead."""
    prefill, decode = pd
    prompt = random_prompts([23], VOCAB, seed=18)[0]
    stale = GenerateRequest("stale", prompt, GREEDY, time.time() - 0.95 * LEASE_S)
    reads_before = metric(decode, "flotilla:kv_transfer_seconds_count")
    failures_before = metric(decode, "flotilla:kv_transfer_failures_total")

    async def main():
        _, chunks = await handoff(prefill, decode, stale)
        await assert_no_blocks_held(prefill, decode)
        return chunks

    assert joined_tokens(asyncio.run(main())) == oracle(prompt)
    assert metric(decode, "flotilla:kv_transfer_seconds_count") == reads_before
    assert metric(decode, "flotilla:kv_transfer_failures_total") - failures_before == 1


def test_a_lease_never_released_expires_while_the_engine_is_idle(pd, monkeypatch):
    """A long idle wait (30 s) proves the thread wakes for the lease deadline itself."""
    prefill, _ = pd
    monkeypatch.setattr(async_engine_module, "IDLE_WAIT_S", 30.0)
    prompt = random_prompts([30], VOCAB, seed=14)[0]

    async def main():
        outcome = await prefill.engine.prefill(request(prompt, request_id="lease"), lease_s=0.3)
        granted = time.monotonic()
        assert metric(prefill, "flotilla:kv_transfer_leased_blocks") == len(outcome.block_ids) == 2
        await wait_until(lambda: no_blocks_held(prefill), "the lease to expire", timeout_s=5.0)
        return outcome, time.monotonic() - granted, await prefill.engine.release_kv(outcome.prefill_request_id)

    outcome, waited, released = asyncio.run(main())
    assert 0.25 <= waited < 5.0 and released is False
    assert prefill.engine.engine.held_kv_blocks(outcome.prefill_request_id) is None


def test_aborted_prefills_and_abandoned_decodes_free_their_blocks(pd):
    """The prefill engine's step is gated, so each case meets the engine in a known state."""
    prefill, decode = pd
    prompt = random_prompts([26], VOCAB, seed=15)[0]
    long = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    entered, gate, real_step = threading.Event(), threading.Event(), prefill.engine.engine.step

    def gated_step():
        entered.set()
        assert gate.wait(WAIT_S), "gate never opened"
        return real_step()

    async def barrier():
        # NOTE: a call runs on the engine thread after every command queued before it.
        assert await prefill.engine.release_kv("barrier") is False

    async def cancelled_prefill(request_id):
        task = asyncio.create_task(prefill.prefill(request(prompt, request_id=request_id)))
        await wait_until(lambda: prefill.engine.load().waiting == 1, "the prefill to be queued")
        return task

    async def main():
        # 1. Cancelled while its step runs: the prefill finishes and is leased, then the
        #    abort finds the lease and releases it.
        task = await cancelled_prefill("finished-first")
        await wait_until(entered.is_set, "the engine thread to enter its step")
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        gate.set()
        await barrier()
        await assert_no_blocks_held(prefill)
        # 2. Cancelled before its first step: the abort meets it queued in the engine.
        gate.clear()
        entered.clear()
        kick = asyncio.create_task(barrier())  # a command, so the thread steps (and waits at the gate)
        await wait_until(entered.is_set, "the engine thread to enter its step")
        task = await cancelled_prefill("aborted-first")
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        gate.set()
        await kick
        await barrier()
        await assert_no_blocks_held(prefill)
        # 3. A decode stream whose consumer leaves after the first chunk is aborted.
        req = request(prompt, long, "left")
        ticket = await prefill.prefill(req)
        stream = decode.generate_prefilled(req, ticket)
        first = await stream.__anext__()
        assert first.completions[0].token_ids[0] == ticket.first_token and not first.finished
        await stream.aclose()
        assert await prefill.release_kv(ReplicaPin("p0"), ticket.prefill_request_id)
        await assert_no_blocks_held(prefill, decode)

    prefill.engine.engine.step = gated_step
    try:
        asyncio.run(main())
    finally:
        gate.set()
        prefill.engine.engine.step = real_step
    assert not decode.engine.engine.has_unfinished_requests()
    assert metric(decode, "flotilla:request_success_total", finished_reason="abort") >= 1


def test_requests_a_handoff_cannot_carry_run_whole_on_the_decode_engine(pd, oracle):
    prefill, decode = pd
    prompt = random_prompts([12], VOCAB, seed=16)[0]
    with_logprobs = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=2)
    reads_before = metric(decode, "flotilla:kv_transfer_seconds_count")
    failures_before = metric(decode, "flotilla:kv_transfer_failures_total")

    async def main():
        ticket = await prefill.prefill(request(prompt, request_id="lp"))
        assert await prefill.release_kv(ReplicaPin("p0"), ticket.prefill_request_id)
        # The ticket's blocks are gone: a read would fail; the request must not read them.
        return [c async for c in decode.generate_prefilled(request(prompt, with_logprobs, "lp"), ticket)]

    chunks = asyncio.run(main())
    assert joined_tokens(chunks) == oracle(prompt, with_logprobs)
    assert all(c.logprobs for chunk in chunks for c in chunk.completions if c.token_ids)
    assert metric(decode, "flotilla:kv_transfer_seconds_count") == reads_before
    assert metric(decode, "flotilla:kv_transfer_failures_total") == failures_before


def test_metrics_text_has_the_kv_transfer_series_with_pool_labels(pd):
    prefill, decode = pd

    async def main():
        return await prefill.metrics_text(), await decode.metrics_text()

    prefill_text, decode_text = asyncio.run(main())
    for name in ("kv_cache_used_blocks", "kv_transfer_leased_blocks", "kv_transfer_bytes_total",
                 "kv_transfer_failures_total", "kv_transfer_seconds_count", "generation_tokens_total"):
        assert f'flotilla:{name}{{pool="prefill",replica="p0"}}' in prefill_text, name
        assert f'flotilla:{name}{{pool="decode",replica="d0"}}' in decode_text, name


def test_colocated_replicas_refuse_pd_calls(model_dir):
    config, _ = resolved(model_dir)
    replica = EngineReplica(config, ServeOptions(model=str(model_dir)), replica_id="c0")
    try:
        with pytest.raises(RuntimeError, match="pool 'colocated'.*pool='prefill'"):
            asyncio.run(replica.prefill(request([3, 4, 5])))
        assert replica.kv_peer_id is None and replica.engine.metrics.pool == "colocated"
        assert asyncio.run(replica.health()) == {"healthy": True, "reason": None, "replica_id": "c0", "pool": "colocated"}
    finally:
        replica.shutdown()
    # NOTE: what the ingress's pool watches read: the state and why, at once.
    assert asyncio.run(asyncio.wait_for(replica.health(), 1.0))["reason"] == "the engine was shut down"
    with pytest.raises(ValueError, match="pool='mixed'"):
        EngineReplica(config, ServeOptions(model=str(model_dir)), pool="mixed", replica_id="x")


def test_engine_death_fails_waiting_prefills_and_ends_every_lease(model_dir):
    engine = AsyncEngine(LLMEngine(*resolved(model_dir)), 8, replica_id="dying", pool="prefill")
    try:
        runner, real_execute = engine.engine.runner, engine.engine.runner.execute
        prompt = random_prompts([20], VOCAB, seed=17)[0]

        def failing_execute(step, rows):
            raise RuntimeError("rank 0 lost")

        async def main():
            held = await engine.prefill(request(prompt, request_id="held"), lease_s=LEASE_S)
            runner.execute = failing_execute
            with pytest.raises(EngineUnavailableError, match="rank 0 lost"):
                await asyncio.wait_for(engine.prefill(request(prompt, request_id="dies"), lease_s=LEASE_S), WAIT_S)
            with pytest.raises(EngineUnavailableError):
                await engine.prefill(request(prompt, request_id="after"), lease_s=LEASE_S)
            return held, await engine.release_kv(held.prefill_request_id)

        held, released = asyncio.run(main())
        runner.execute = real_execute
        assert released is False and not engine.healthy
        assert engine.engine.scheduler.num_held_blocks == 0 and engine.engine.scheduler.pool.num_used_blocks == 0
        labels = {"replica": "dying", "pool": "prefill"}
        assert engine.metrics.registry.get_sample_value("flotilla:kv_transfer_leased_blocks", labels) == 0
        assert len(held.block_ids) == 2
    finally:
        engine.shutdown()


def test_prefill_and_generate_prefilled_check_their_arguments(pd):
    prefill, decode = pd
    prompt = [5, 6, 7]

    async def first(stream):
        return await stream.__anext__()

    with pytest.raises(ValueError, match="lease_s=0"):
        asyncio.run(prefill.engine.prefill(request(prompt), lease_s=0))
    with pytest.raises(ValueError, match="policy='maybe'"):
        asyncio.run(first(decode.engine.generate_prefilled(request(prompt), None, "maybe")))
    with pytest.raises(ValueError, match="timeout_s=-1"):
        asyncio.run(first(decode.engine.generate_prefilled(request(prompt), None, "fail", -1)))

