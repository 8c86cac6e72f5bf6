"""AsyncEngine (and EngineReplica built directly, without Serve) over the real engine in
this process: a tiny random Llama (no tokenizer: ids matter, text stays empty) and SmolLM2
for text and stop strings. The oracle is LLMEngine driven alone, one request at a time.

Coroutines run under ``asyncio.run`` inside plain tests (no pytest-asyncio here). Waits on
the engine thread are bounded polls (``wait_until``), never sleeps of a guessed length.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time

import pytest

from flotilla.cluster.engine.llm_engine import LLMEngine
from flotilla.cluster.engine.sampling_params import SamplingParams
from flotilla.cluster.models.sources import resolve_model_source
from flotilla.resolution import ModelFacts, ServerArgs, preset, resolve
from flotilla.serve.async_engine import AsyncEngine
from flotilla.serve.engine_replica import EngineReplica
from flotilla.cluster.engine.outputs import Logprob
from flotilla.serve.async_engine_commands import _Stream
from flotilla.serve.types import (
    CompletionChunk,
    EngineOverloadedError,
    EngineUnavailableError,
    GenerateChunk,
    GenerateRequest,
    ServeOptions,
)
from helpers.prompts import random_prompts
from helpers.tiny_models import save_tiny_llama
from helpers.torch_threads import one_intra_op_thread

VOCAB = 256
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
WAIT_S = 10.0


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    with one_intra_op_thread():
        yield


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama")
    save_tiny_llama(path, vocab_size=VOCAB)
    return path


def resolved(path, **flags):
    source = resolve_model_source(str(path))
    args = ServerArgs.create(model_path=str(source.path), max_total_tokens=2048, **flags)
    return resolve(args, ModelFacts.from_hf_config(source.config_dict), preset("cpu")), source


def make_engine(path, tokenizer=None, **flags) -> LLMEngine:
    config, source = resolved(path, **flags)
    return LLMEngine(config, source, tokenizer)


@contextlib.contextmanager
def async_engine(path, max_queued_requests=64, tokenizer=None, stream_batch_s=0.0, **flags):
    engine = AsyncEngine(make_engine(path, tokenizer, **flags), max_queued_requests, replica_id="r0", stream_batch_s=stream_batch_s)
    try:
        yield engine
    finally:
        engine.shutdown()


def alone(engine: LLMEngine, prompt, params):
    """The oracle: the request run by itself on a plain LLMEngine."""
    request_id = engine.add_request(prompt, params)
    while engine.has_unfinished_requests():
        engine.step()
    return engine.pop_output(request_id)


def request(prompt, params=GREEDY, request_id="req", prefix_key=None):
    return GenerateRequest(request_id, list(prompt), params, time.time(), prefix_key)


async def collect(engine, req):
    return [chunk async for chunk in engine.generate(req)]


def tokens_by_index(chunks):
    out: dict[int, list[int]] = {}
    for chunk in chunks:
        for c in chunk.completions:
            out.setdefault(c.index, []).extend(c.token_ids)
    return out


async def wait_until(predicate, what):
    deadline = time.monotonic() + WAIT_S
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {WAIT_S} s waiting for {what}")
        await asyncio.sleep(0.005)


def sample(engine: AsyncEngine, name, **labels):
    value = engine.metrics.registry.get_sample_value(name, {"replica": "r0", "pool": "colocated", **labels})
    return 0.0 if value is None else value


def test_concurrent_requests_get_the_tokens_of_the_engine_alone_and_metrics_count_them(model_dir):
    prompts = random_prompts([5 + 3 * i for i in range(16)], VOCAB)
    oracle = make_engine(model_dir)
    expected = [alone(oracle, p, GREEDY).outputs[0].token_ids for p in prompts]
    with async_engine(model_dir) as engine:

        async def main():
            streams = [collect(engine, request(p, request_id=f"r{i}")) for i, p in enumerate(prompts)]
            return await asyncio.gather(*streams)

        results = asyncio.run(main())
        for prompt, chunks, want in zip(prompts, results, expected):
            assert tokens_by_index(chunks) == {0: want}
            assert [c.finished for c in chunks] == [False] * (len(chunks) - 1) + [True]
            assert chunks[0].queue_time_s is not None and chunks[0].queue_time_s >= 0
            assert all(c.queue_time_s is None for c in chunks[1:])
            last = chunks[-1]
            assert (last.prompt_tokens, last.completion_tokens, last.error) == (len(prompt), 12, None)
            assert last.completions[-1].finish_reason == "length"
        assert engine.engine.scheduler.pool.num_used_blocks == 0
        assert engine.load().running == engine.load().waiting == 0

        generated = 16 * 12
        assert sample(engine, "flotilla:generation_tokens_total") == generated
        assert sample(engine, "flotilla:prompt_tokens_total") == sum(map(len, prompts))
        assert sample(engine, "flotilla:request_success_total", finished_reason="length") == 16
        for name in ("time_to_first_token", "e2e_request_latency", "request_queue_time"):
            assert sample(engine, f"flotilla:{name}_seconds_count") == 16, name
        # Every token after a completion's first one is one inter-token gap.
        assert sample(engine, "flotilla:inter_token_latency_seconds_count") == generated - 16
        assert sample(engine, "flotilla:num_requests_running") == 0


def test_a_speculating_engine_streams_the_plain_tokens_and_counts_its_drafts(model_dir):
    """NGRAM on the replica's engine: each stream gets the plain engine's tokens (a step may
    bring several per request), and the spec_decode_* metrics count what the engine verified."""
    prompts = [p * 3 for p in random_prompts([4, 6, 8, 5], VOCAB)]  # repeats: the trie has matches
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    oracle = make_engine(model_dir)
    expected = [alone(oracle, p, params).outputs[0].token_ids for p in prompts]
    with async_engine(model_dir, speculative_algorithm="NGRAM", speculative_num_draft_tokens=5) as engine:

        async def main():
            return await asyncio.gather(*(collect(engine, request(p, params, f"r{i}")) for i, p in enumerate(prompts)))

        results = asyncio.run(main())
        assert [tokens_by_index(chunks) for chunks in results] == [{0: want} for want in expected]
        stats = engine.engine.speculator.stats
        assert stats.num_draft_tokens > stats.num_accepted_tokens > 0
        assert sample(engine, "flotilla:spec_decode_num_drafts_total") == stats.num_drafts
        assert sample(engine, "flotilla:spec_decode_num_draft_tokens_total") == stats.num_draft_tokens
        assert sample(engine, "flotilla:spec_decode_num_accepted_tokens_total") == stats.num_accepted_tokens
        assert sample(engine, "flotilla:spec_decode_accepted_length_count") == stats.num_drafts
        assert sample(engine, "flotilla:spec_decode_accepted_length_sum") == stats.num_accepted_tokens
        assert sample(engine, "flotilla:generation_tokens_total") == 4 * 40
        assert engine.engine.scheduler.pool.num_used_blocks == 0


def test_n2_completions_interleave_and_match_the_engine_alone(model_dir):
    params = SamplingParams(n=2, temperature=1.0, seed=7, max_tokens=10, ignore_eos=True)
    prompt = random_prompts([9], VOCAB, seed=3)[0]
    want = alone(make_engine(model_dir), prompt, params)
    with async_engine(model_dir) as engine:
        chunks = asyncio.run(collect(engine, request(prompt, params)))
    got = tokens_by_index(chunks)
    assert got == {0: want.outputs[0].token_ids, 1: want.outputs[1].token_ids}
    assert got[0] != got[1]
    # Both completions advance every step, so they share chunks.
    assert all(sorted(c.index for c in chunk.completions) == [0, 1] for chunk in chunks)
    assert chunks[-1].finished and chunks[-1].completion_tokens == 20


def test_closing_or_cancelling_the_stream_aborts_the_request_and_frees_its_blocks(model_dir):
    long = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    prompt = random_prompts([20], VOCAB)[0]
    with async_engine(model_dir) as engine:

        async def main():
            closed = engine.generate(request(prompt, long, "closed"))
            first = await closed.__anext__()
            assert first.completions[0].token_ids and not first.finished

            async def consume():
                async for _ in engine.generate(request(prompt, long, "cancelled")):
                    pass

            task = asyncio.create_task(consume())
            await wait_until(lambda: engine.load().running == 2, "both requests running")
            assert engine.load().kv_usage > 0
            await closed.aclose()
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            await wait_until(lambda: engine.load().running == 0 and engine.load().kv_usage == 0, "the aborts")

        asyncio.run(main())
        assert engine.engine.scheduler.pool.num_used_blocks == 0
        assert not engine.engine.has_unfinished_requests()
        assert sample(engine, "flotilla:request_success_total", finished_reason="abort") == 2
        # Neither ran to its 200 tokens (a missing abort would let both finish before the wait ends).
        assert sample(engine, "flotilla:generation_tokens_total") < 2 * 200
        # The engine forgot both requests (nothing left to pop).
        assert not engine.engine._parents


def test_a_full_queue_raises_overloaded_without_queuing(model_dir):
    """The engine thread is held inside step() by a gate, so the two admitted requests
    stay counted as waiting while the third arrives (no timing involved)."""
    with async_engine(model_dir, max_queued_requests=2) as engine:
        gate, real_step = threading.Event(), engine.engine.step

        def gated_step():
            assert gate.wait(WAIT_S), "gate never opened"
            return real_step()

        engine.engine.step = gated_step
        prompt = random_prompts([6], VOCAB)[0]

        async def main():
            streams = [engine.generate(request(prompt, request_id=f"q{i}")) for i in range(2)]
            firsts = [asyncio.create_task(s.__anext__()) for s in streams]
            await wait_until(lambda: engine.load().waiting == 2, "two waiting requests")
            with pytest.raises(EngineOverloadedError) as info:
                await engine.generate(request(prompt, request_id="q2")).__anext__()
            assert info.value.retry_after_s >= 1 and "max_queued_requests=2" in str(info.value)
            assert engine.load().waiting == 2  # the refused request was not queued
            gate.set()
            for first, stream in zip(firsts, streams):
                chunks = [await first] + [c async for c in stream]
                assert chunks[-1].finished and chunks[-1].completion_tokens == 12
            # Room again: a new request is served.
            assert (await collect(engine, request(prompt, request_id="q3")))[-1].finished

        asyncio.run(main())


def grouped(prompt, group_id: str, size: int, index: int, params=GREEDY):
    """Prompt ``index`` of a multi-prompt request (``group_id`` of ``size`` prompts)."""
    req = request(prompt, params, f"{group_id}-{index}")
    req.group_id, req.group_size = group_id, size
    return req


@contextlib.contextmanager
def gated(engine: AsyncEngine):
    """Hold the engine thread inside step() until the gate opens, so admitted requests stay
    counted as waiting (no timing involved)."""
    gate, real_step = threading.Event(), engine.engine.step

    def gated_step():
        assert gate.wait(WAIT_S), "gate never opened"
        return real_step()

    engine.engine.step = gated_step
    try:
        yield gate
    finally:
        gate.set()


def test_a_multi_prompt_request_is_admitted_whole_or_refused_whole(model_dir):
    """The prompts of one HTTP request (one group) count against the queue bound together:
    a group larger than the queue is refused at every prompt (ValueError naming prompt), one
    that does not fit now gets 429 at every prompt and none of it is queued; one that fits
    holds room for its prompts still to come, so a request arriving in between is refused
    instead of them. A consumer that leaves gives the held room back and refuses the rest."""
    prompt = random_prompts([6], VOCAB)[0]
    with async_engine(model_dir, max_queued_requests=4) as engine, gated(engine) as gate:

        async def first(req):
            return await engine.generate(req).__anext__()

        async def main():
            for index in range(5):  # NOTE: five prompts never fit a queue of four
                with pytest.raises(ValueError, match=r"^prompt holds 5 prompts.*max_queued_requests=4"):
                    await first(grouped(prompt, "big", 5, index))
            lone = engine.generate(request(prompt, request_id="lone"))
            waiting = [asyncio.create_task(lone.__anext__())]
            await wait_until(lambda: engine.load().waiting == 1, "one waiting request")
            for index in range(4):  # NOTE: 1 waiting + 4 > 4: refused whole
                with pytest.raises(EngineOverloadedError, match="no room for this request's 4 prompts|other prompts"):
                    await first(grouped(prompt, "late", 4, index))
            assert engine.load().waiting == 1

            # A group of 3 fits: its first prompt holds room for the other two.
            streams = [engine.generate(grouped(prompt, "fits", 3, 0))]
            waiting.append(asyncio.create_task(streams[0].__anext__()))
            await wait_until(lambda: engine.load().waiting == 2, "the group's first prompt")
            with pytest.raises(EngineOverloadedError, match="queue is full"):
                await first(request(prompt, request_id="between"))  # 2 waiting + 2 held
            for index in (1, 2):
                streams.append(engine.generate(grouped(prompt, "fits", 3, index)))
                waiting.append(asyncio.create_task(streams[-1].__anext__()))
            await wait_until(lambda: engine.load().waiting == 4, "the whole group")

            # A group whose consumer leaves: its held room comes back, its later prompts are refused.
            gate.set()
            for task in waiting:
                await task
            for stream in [lone, *streams]:
                assert [c async for c in stream][-1].finished
            await wait_until(lambda: engine.load().waiting == 0, "an empty queue")
            left = engine.generate(grouped(prompt, "left", 3, 0, SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)))
            await left.__anext__()
            await left.aclose()
            assert engine._held == 0
            with pytest.raises(EngineOverloadedError, match="other prompts"):
                await first(grouped(prompt, "left", 3, 1))

        asyncio.run(main())


def test_room_held_for_prompts_that_never_come_is_released(model_dir, monkeypatch):
    """A group's first prompt holds room for the others; when they never come (routed to
    another replica), the room is released GROUP_HOLD_S later."""
    from flotilla.serve import async_engine as module

    monkeypatch.setattr(module, "GROUP_HOLD_S", 0.05)
    prompt = random_prompts([6], VOCAB)[0]
    with async_engine(model_dir, max_queued_requests=4) as engine:

        async def main():
            orphan = engine.generate(grouped(prompt, "orphan", 4, 0))
            await orphan.__anext__()
            assert engine._held == 3
            await asyncio.sleep(0.1)
            assert [c async for c in engine.generate(request(prompt, request_id="after"))][-1].finished
            assert engine._held == 0 and not engine._groups
            await orphan.aclose()

        asyncio.run(main())


def test_the_ingress_refuses_a_request_whose_prompts_do_not_fit_and_aborts_the_admitted_ones(model_dir):
    """Through the real ingress over a real AsyncEngine (queue bound 2): four prompts are a 400
    naming prompt with nothing generated; a request one of whose prompts the engine refuses
    (a token id beyond the vocabulary) is a 400, and its other prompts, already running
    toward 200 tokens each, are aborted at once and their KV blocks freed."""
    import httpx

    from flotilla.serve.ingress import create_app

    with async_engine(model_dir, max_queued_requests=2) as engine:
        app = create_app(engine, None, ServeOptions(served_model_name="tiny"), engine.engine.config)
        prompt = random_prompts([20], VOCAB)[0]

        async def main():
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://flotilla.test") as http:
                body = {"model": "tiny", "prompt": [prompt] * 4, "max_tokens": 200, "ignore_eos": True}
                response = await http.post("/v1/completions", json=body)
                assert response.status_code == 400 and response.json()["error"]["param"] == "prompt", response.text
                assert sample(engine, "flotilla:generation_tokens_total") == 0

                body["prompt"] = [prompt, prompt[:-1] + [VOCAB + 7]]
                response = await http.post("/v1/completions", json=body)
                assert response.status_code == 400 and response.json()["error"]["param"] == "prompt", response.text
                await wait_until(lambda: engine.load().load == 0 and engine.load().kv_usage == 0, "the abort")
                assert sample(engine, "flotilla:request_success_total", finished_reason="abort") == 1
                assert sample(engine, "flotilla:request_success_total", finished_reason="length") == 0
                assert sample(engine, "flotilla:generation_tokens_total") < 200

                good = await http.post("/v1/completions", json={"model": "tiny", "prompt": [prompt] * 2, "max_tokens": 3})
                assert good.status_code == 200 and len(good.json()["choices"]) == 2

        asyncio.run(main())


def test_bad_input_raises_value_error_before_any_chunk_and_the_engine_keeps_serving(model_dir):
    prompt = random_prompts([6], VOCAB)[0]
    bad = [
        (request([VOCAB + 5, 1, 2]), "prompt_token_ids"),
        (request(prompt, SamplingParams(max_tokens=4, stop_token_ids=[VOCAB + 1])), "stop_token_ids"),
        (request(list(range(3, 3 + 300))), "prompt_token_ids"),  # longer than the context (256)
    ]
    with async_engine(model_dir) as engine:

        async def main():
            for req, param in bad:
                seen = []
                with pytest.raises(ValueError, match=param):
                    async for chunk in engine.generate(req):
                        seen.append(chunk)
                assert seen == []
            return await collect(engine, request(prompt))

        chunks = asyncio.run(main())
        assert chunks[-1].finished and chunks[-1].completion_tokens == 12
        assert engine.load().waiting == 0


def test_stream_interval_batches_tokens_but_sends_the_first_at_once(model_dir):
    prompt = random_prompts([7], VOCAB)[0]
    with async_engine(model_dir, stream_interval=4) as engine:
        chunks = asyncio.run(collect(engine, request(prompt)))
    sizes = [len(c.completions[0].token_ids) for c in chunks]
    # 12 tokens: the first alone, then batches of 4, then the rest ([1, 4, 4, 3] when the
    # reader keeps up; batches that queued behind a late reader arrive as one, e.g. [1, 8, 3])
    assert sizes[0] == 1 and sum(sizes) == 12 and all(size % 4 == 0 for size in sizes[1:-1]), sizes
    assert tokens_by_index(chunks)[0] == alone(make_engine(model_dir), prompt, GREEDY).outputs[0].token_ids


def test_chunks_queued_behind_a_busy_reader_go_out_as_one(model_dir):
    """What the engine thread queued while the reader was away is one chunk: tokens, text
    and logprobs appended per completion, the last chunk's finish and usage; an error
    queued after chunks comes after them."""
    logprob = {7: Logprob(-0.5, rank=1)}
    steps = lambda: [  # noqa: E731 - fresh chunks for each read (a merge extends the first)
        GenerateChunk("r", [CompletionChunk(0, [7], "a", [logprob])], queue_time_s=0.25),
        GenerateChunk("r", [CompletionChunk(1, [9], "x"), CompletionChunk(0, [8], "b", [logprob])]),
        GenerateChunk(
            "r", [CompletionChunk(1, [10], "y", finish_reason="stop", stop_reason=10)],
            finished=True, prompt_tokens=5, completion_tokens=4, cached_tokens=2,
        ),
        GenerateChunk("r", [CompletionChunk(0, [99], "late")]),  # never read: the request finished
    ]  # fmt: skip

    async def read(items):
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        for item in items:
            stream.queue.put_nowait(item)
        out = []
        try:
            async for chunk in engine._chunks("r~0", stream):
                out.append(chunk)
        except RuntimeError as exc:
            out.append(exc)
        return out

    with async_engine(model_dir) as engine:
        (merged,) = asyncio.run(read(steps()))
        failed = asyncio.run(read([*steps()[:2], RuntimeError("step failed")]))
    zero, one = merged.completions
    assert (zero.index, zero.token_ids, zero.text, zero.logprobs, zero.finish_reason) == (0, [7, 8], "ab", [logprob] * 2, None)
    assert (one.index, one.token_ids, one.text, one.finish_reason, one.stop_reason) == (1, [9, 10], "xy", "stop", 10)
    assert merged.finished and (merged.prompt_tokens, merged.completion_tokens, merged.cached_tokens) == (5, 4, 2)
    assert merged.queue_time_s == 0.25
    assert len(failed) == 2 and str(failed[1]) == "step failed"
    assert tokens_by_index(failed[:1]) == {0: [7, 8], 1: [9]} and not failed[0].finished


def test_a_slow_reader_gets_every_token_in_fewer_chunks(model_dir):
    """A reader slower than the engine's steps loses nothing: the engine-alone tokens and
    the usage, in at most as many chunks as tokens."""
    prompt = random_prompts([9], VOCAB, seed=3)[0]
    with async_engine(model_dir) as engine:

        async def main():
            chunks = []
            async for chunk in engine.generate(request(prompt)):
                chunks.append(chunk)
                await asyncio.sleep(0.01)  # NOTE: slows the reader; what is asserted holds at any speed
            return chunks

        chunks = asyncio.run(main())
    assert tokens_by_index(chunks)[0] == alone(make_engine(model_dir), prompt, GREEDY).outputs[0].token_ids
    assert chunks[-1].finished and chunks[-1].completion_tokens == 12 and len(chunks) <= 12
    assert not any(c.finished for c in chunks[:-1])


def test_stream_batch_spaces_a_streams_chunks_but_not_its_first_or_last(model_dir):
    """With ``stream_batch_s`` a request's chunks after the first are at least that far
    apart (their tokens gather in between), and the tokens are the engine-alone ones."""
    batch_s, params = 0.05, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    prompt = random_prompts([6], VOCAB, seed=4)[0]
    with async_engine(model_dir, stream_batch_s=batch_s) as engine:

        async def main():
            chunks, submitted = [], time.monotonic()
            async for chunk in engine.generate(request(prompt, params)):
                chunks.append(chunk)
            return chunks, time.monotonic() - submitted

        chunks, elapsed = asyncio.run(main())
    assert tokens_by_index(chunks)[0] == alone(make_engine(model_dir), prompt, params).outputs[0].token_ids
    assert len(chunks[0].completions[0].token_ids) == 1 and chunks[-1].finished
    # NOTE: the sends between the first and the last are >= batch_s apart and after the
    # first, which is after the submit; the last arrives before `elapsed` ends. So at most
    # elapsed / batch_s chunks besides those two (~40 without the batching), at any speed.
    assert len(chunks) <= 2 + elapsed / batch_s, (len(chunks), elapsed)


def test_a_stalled_request_does_not_sit_on_its_pending_tokens(model_dir):
    """A request that gained no token in a step (preempted, waiting) but holds tokens past
    its ``stream_batch_s`` gets them sent by that step's sweep; a prefill never is."""
    from flotilla.serve.async_engine import _Live
    from flotilla.serve.async_engine_commands import _Add, _Prefill

    with async_engine(model_dir, stream_batch_s=0.05) as engine:
        loop = asyncio.new_event_loop()
        try:
            stream = _Stream(loop, asyncio.Queue())

            def live(kind, last_sent_at):
                state = _Live(kind(kind.__name__, request([1, 2, 3]), stream, 0.0, 0.0), [kind.__name__])
                state.sent_first, state.last_sent_at = True, last_sent_at
                state.pending, state.pending_tokens = {0: CompletionChunk(0, [7, 8], "")}, 2
                return state

            now = 100.0
            # NOTE: the engine thread is idle (no request queued), so this thread may use its state.
            engine._live.update(late=live(_Add, now - 0.06), recent=live(_Add, now - 0.01), prefill=live(_Prefill, 0.0))
            engine._live["stepped"] = live(_Add, 0.0)
            sent = engine._overdue_chunks({"stepped": []}, now)
            assert [(engine_id, chunk.completions[0].token_ids) for engine_id, _, chunk in sent] == [("late", [7, 8])]
            assert not engine._live["late"].pending and engine._live["late"].last_sent_at == now
            assert engine._live["recent"].pending and engine._live["prefill"].pending
        finally:
            engine._live.clear()
            loop.close()


def test_cached_prompt_tokens_are_reported_and_counted(model_dir):
    prompt = random_prompts([40], VOCAB, seed=5)[0]
    with async_engine(model_dir) as engine:
        first = asyncio.run(collect(engine, request(prompt, request_id="a")))[-1]
        second = asyncio.run(collect(engine, request(prompt, request_id="b", prefix_key=1234)))[-1]
        assert first.cached_tokens == 0
        assert 0 < second.cached_tokens < len(prompt)
        assert sample(engine, "flotilla:prefix_cache_queries_total") == 2 * len(prompt)
        assert sample(engine, "flotilla:prefix_cache_hits_total") == second.cached_tokens
        assert engine.load().prefix_keys == (1234,)


def test_a_failing_step_errors_every_request_then_the_engine_is_unavailable(model_dir):
    with async_engine(model_dir) as engine:
        runner, calls = engine.engine.runner, []
        real_execute = runner.execute

        def failing_execute(step, rows):
            calls.append(1)
            if len(calls) > 3:
                raise RuntimeError("rank 0 lost")
            return real_execute(step, rows)

        runner.execute = failing_execute
        prompts = random_prompts([5, 8], VOCAB)
        long = SamplingParams(temperature=0, max_tokens=50, ignore_eos=True)

        async def main():
            results = await asyncio.gather(*[collect(engine, request(p, long, f"f{i}")) for i, p in enumerate(prompts)])
            with pytest.raises(EngineUnavailableError, match="rank 0 lost"):
                await collect(engine, request(prompts[0]))
            return results, await engine.is_healthy()

        results, healthy = asyncio.run(main())
        for chunks in results:
            last = chunks[-1]
            assert last.finished and "rank 0 lost" in last.error
            assert last.completions[-1].finish_reason == "error"
        assert not healthy
        assert engine.engine.scheduler.pool.num_used_blocks == 0
        assert sample(engine, "flotilla:request_success_total", finished_reason="error") == 2


def test_an_unexpected_add_failure_answers_every_caller_and_marks_the_engine_dead(model_dir):
    """Not bad input but a broken engine: the caller gets the error, the loop stops, and no
    other caller (queued in the same batch or later) is left waiting."""
    with async_engine(model_dir) as engine:

        def broken_add(*args, **kwargs):
            raise RuntimeError("boom")

        engine.engine.add_request = broken_add

        async def attempt(i):
            try:
                await collect(engine, request([3, 4, 5], request_id=f"x{i}"))
            except Exception as exc:  # noqa: BLE001 - the test sorts them below
                return exc

        async def main():
            return await asyncio.wait_for(asyncio.gather(*[attempt(i) for i in range(3)]), WAIT_S)

        errors = asyncio.run(main())
        assert sum(type(e) is RuntimeError and "RuntimeError: boom" in str(e) for e in errors) == 1
        assert sum(isinstance(e, EngineUnavailableError) for e in errors) == 2
        assert not asyncio.run(engine.is_healthy())
        assert "boom" in engine.dead_reason


def test_idle_engine_thread_sleeps_and_shutdown_stops_it(model_dir):
    with async_engine(model_dir) as engine:
        checks = []
        real = engine.engine.has_unfinished_requests
        engine.engine.has_unfinished_requests = lambda: checks.append(1) or real()
        time.sleep(0.5)
        # A bounded wait of IDLE_WAIT_S (1 s) per check: a spinning loop would make thousands.
        assert len(checks) <= 3
        engine.shutdown()
        assert not engine._thread.is_alive()
        assert not asyncio.run(engine.is_healthy())
        with pytest.raises(EngineUnavailableError):
            asyncio.run(collect(engine, request([3, 4, 5])))


def test_an_engine_that_goes_idle_after_serving_gives_its_free_heap_back_at_most_every_interval(model_dir, monkeypatch):
    """glibc keeps the memory the steps freed (RSS creeps up under load); once the engine is
    idle after serving it calls malloc_trim, at most every HEAP_TRIM_INTERVAL_S, never while
    requests run, and an idle engine that served nothing does not (the loop stays asleep)."""
    from flotilla.serve import async_engine as module

    trims, running_then = [], []
    monkeypatch.setattr(module, "HEAP_TRIM_INTERVAL_S", 0.2)
    with async_engine(model_dir) as engine:

        def trim():
            trims.append(time.monotonic())
            running_then.append(engine.engine.has_unfinished_requests())
            return True

        monkeypatch.setattr(module, "release_free_heap", trim)
        time.sleep(0.5)
        assert trims == []  # NOTE: nothing served yet
        prompt = random_prompts([6], VOCAB)[0]

        async def burst():
            await asyncio.gather(*(collect(engine, request(prompt, request_id=f"t{i}")) for i in range(4)))

        for bursts in (1, 2):
            asyncio.run(burst())
            deadline = time.monotonic() + WAIT_S
            while len(trims) < bursts and time.monotonic() < deadline:
                time.sleep(0.02)
        time.sleep(0.5)
        assert len(trims) == 2 and not any(running_then), (trims, running_then)
        assert trims[1] - trims[0] >= 0.2


def test_engine_replica_built_without_serve(model_dir):
    config, _ = resolved(model_dir)
    replica = EngineReplica(config, ServeOptions(model=str(model_dir), max_queued_requests=8), replica_id="rep-1")
    try:
        prompt = random_prompts([6], VOCAB)[0]

        async def main():
            chunks = [c async for c in replica.generate(request(prompt, prefix_key=99))]
            await replica.check_health()
            return chunks, await replica.metrics_text()

        chunks, text = asyncio.run(main())
        assert chunks[-1].finished and chunks[-1].completion_tokens == 12
        stats = replica.record_routing_stats()
        assert stats == {"running": 0, "waiting": 0, "kv_usage": 0.0, "max_queued": 8, "prefix_keys": (99,)}
        assert 'flotilla:generation_tokens_total{pool="colocated",replica="rep-1"} 12.0' in text
        replica.engine.shutdown()
        with pytest.raises(RuntimeError, match="rep-1 is unhealthy"):
            asyncio.run(replica.check_health())
    finally:
        replica.shutdown()


@pytest.fixture(scope="module")
def smollm2():
    from flotilla.cluster.models.tokenizer import load_tokenizer

    source = resolve_model_source(None)
    tokenizer = load_tokenizer(source)
    args = ServerArgs.create(model_path=str(source.path), max_total_tokens=4096)
    config = resolve(args, ModelFacts.from_hf_config(source.config_dict), preset("cpu"))
    engine = AsyncEngine(LLMEngine(config, source, tokenizer), 16, replica_id="r0")
    yield engine, tokenizer
    engine.shutdown()


def test_smollm2_text_and_stop_strings_stream_through_the_engine(smollm2):
    engine, tokenizer = smollm2
    ids = tokenizer.encode("The capital of France is")
    plain = SamplingParams(temperature=0, max_tokens=8)
    stopped = SamplingParams(temperature=0, max_tokens=8, stop=[" Paris"])

    async def main():
        return await asyncio.gather(
            collect(engine, request(ids, plain, "plain")), collect(engine, request(ids, stopped, "stop"))
        )

    plain_chunks, stop_chunks = asyncio.run(main())
    text = "".join(c.text for chunk in plain_chunks for c in chunk.completions)
    assert text == tokenizer.decode(tokens_by_index(plain_chunks)[0], skip_special_tokens=True)
    assert "Paris" in text
    stop_text = "".join(c.text for chunk in stop_chunks for c in chunk.completions)
    final = stop_chunks[-1].completions[-1]
    assert (final.finish_reason, final.stop_reason) == ("stop", " Paris")
    assert stop_text == text[: text.index(" Paris")]
