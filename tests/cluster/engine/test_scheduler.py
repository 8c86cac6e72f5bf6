"""Scheduler: continuous batching, chunked prefill, prefix reuse, preemption, abort, fairness.

No model: the fake runner of tests/helpers/scheduler_harness.py writes each new token's id
into its KV slot, reads every request's context back from the slots it is told to attend to,
and "samples" a deterministic function of that context. A wrong block table, a shared block
overwritten, or a bad recompute therefore changes the outputs, which are checked against the
same function applied to the true token sequence.
"""

import random

import pytest

from flotilla.cluster.engine.block_manager import KVBlockPool
from flotilla.cluster.engine.request import Request, RequestStatus
from flotilla.cluster.engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput, UnschedulableRequestError
from helpers.prompts import ORACLE_VOCAB, reference_outputs
from helpers.scheduler_harness import check_output, make, random_request, run_to_completion, shares, step

VOCAB = ORACLE_VOCAB


# ---- configuration and admission ------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, name",
    [
        ({"num_blocks": 0}, "num_blocks"),
        ({"num_blocks": 8, "block_size": 0}, "block_size"),
        ({"num_blocks": 8, "max_num_seqs": 0}, "max_num_seqs"),
        ({"num_blocks": 8, "max_num_seqs": 64, "max_num_batched_tokens": 32}, "max_num_batched_tokens"),
    ],
)
def test_bad_config_names_the_parameter(kwargs, name):
    with pytest.raises(ValueError, match=name):
        SchedulerConfig(**kwargs)


def test_pool_must_match_config():
    with pytest.raises(ValueError, match="block_size"):
        Scheduler(SchedulerConfig(num_blocks=8, block_size=16), KVBlockPool(8, 8))


def test_bad_requests_are_rejected_with_the_parameter_named():
    with pytest.raises(ValueError, match="prompt_token_ids"):
        Request("a", [], max_tokens=4)
    with pytest.raises(ValueError, match="max_tokens"):
        Request("a", [1], max_tokens=0)
    scheduler, _ = make(num_blocks=4, block_size=4)
    assert scheduler.max_tokens_per_request() == 16
    scheduler.add(Request("fits", [1] * 10, max_tokens=6))
    with pytest.raises(ValueError, match="max_tokens"):
        scheduler.add(Request("too-long", [1] * 10, max_tokens=7))
    with pytest.raises(ValueError, match="already live"):
        scheduler.add(Request("fits", [1], max_tokens=1))


def test_without_chunked_prefill_the_budget_bounds_a_request():
    scheduler, _ = make(num_blocks=64, max_num_batched_tokens=32, enable_chunked_prefill=False)
    assert scheduler.max_tokens_per_request() == 32


# ---- continuous batching and chunked prefill ----------------------------------------


def test_new_prefill_joins_running_decodes():
    scheduler, runner = make()
    scheduler.add(Request("a", list(range(10)), max_tokens=8))
    assert shares(step(scheduler, runner)) == {"a": (0, 10)}
    scheduler.add(Request("b", list(range(100, 120)), max_tokens=8))
    assert shares(step(scheduler, runner)) == {"a": (10, 1), "b": (0, 20)}
    assert shares(step(scheduler, runner)) == {"a": (11, 1), "b": (20, 1)}
    run_to_completion(scheduler, runner)


def test_chunked_prefill_splits_a_long_prompt_under_the_budget():
    scheduler, runner = make(max_num_batched_tokens=16)
    prompt = [3] * 40
    decoding = Request("decoding", [1, 2, 3], max_tokens=20)
    scheduler.add(decoding)
    step(scheduler, runner)
    long = Request("long", prompt, max_tokens=2)
    scheduler.add(long)
    seen = []
    while not long.output_token_ids:
        output = step(scheduler, runner)
        assert output.num_batched_tokens <= 16
        # The running decode is scheduled every step, ahead of the prefill chunk.
        assert output.scheduled[0].request is decoding and output.scheduled[0].num_new_tokens == 1
        seen.append(shares(output)["long"])
        assert output.scheduled[1].samples == (seen[-1][0] + seen[-1][1] == 40)
    assert seen == [(0, 15), (15, 15), (30, 10)]
    assert long.output_token_ids == reference_outputs(prompt, 1)
    run_to_completion(scheduler, runner)


def test_partial_chunks_sample_nothing():
    scheduler, runner = make(max_num_batched_tokens=8)
    request = Request("a", list(range(20)), max_tokens=3)
    scheduler.add(request)
    output = scheduler.schedule()
    assert not output.scheduled[0].samples
    assert scheduler.update(output, {"a": None}) == []
    assert request.num_computed_tokens == 8 and request.output_token_ids == []
    # A token for a partial chunk is ignored, not appended.
    output = scheduler.schedule()
    assert scheduler.update(output, {"a": 42}) == [] and request.output_token_ids == []


def test_update_needs_a_token_when_a_prefill_completes():
    scheduler, _ = make()
    scheduler.add(Request("a", [1, 2, 3], max_tokens=3))
    output = scheduler.schedule()
    with pytest.raises(ValueError, match="sampled"):
        scheduler.update(output, {})


def test_without_chunked_prefill_a_prompt_waits_for_the_whole_budget():
    scheduler, runner = make(max_num_batched_tokens=32, enable_chunked_prefill=False)
    scheduler.add(Request("a", [1] * 8, max_tokens=4))
    scheduler.add(Request("b", [2] * 8, max_tokens=4))
    step(scheduler, runner)
    scheduler.add(Request("c", [3] * 30, max_tokens=1))
    # Two decodes leave 30 of 32 tokens: c's 30-token prompt fits whole.
    assert shares(step(scheduler, runner)) == {"a": (8, 1), "b": (8, 1), "c": (0, 30)}
    scheduler.add(Request("d", [4] * 31, max_tokens=1))
    # d (31 tokens) does not fit next to two decodes and is not split; it runs
    # once a and b have finished.
    assert shares(step(scheduler, runner)) == {"a": (9, 1), "b": (9, 1)}
    assert shares(step(scheduler, runner)) == {"a": (10, 1), "b": (10, 1)}
    assert shares(step(scheduler, runner)) == {"d": (0, 31)}


def test_max_num_seqs_caps_the_running_batch():
    scheduler, runner = make(max_num_seqs=2)
    for index in range(3):
        scheduler.add(Request(f"r{index}", [index] * 5, max_tokens=2))
    assert set(shares(step(scheduler, runner))) == {"r0", "r1"}
    assert scheduler.num_waiting == 1
    # r0 and r1 finish this step (max_tokens 2); r2 joins the next.
    step(scheduler, runner)
    assert set(shares(step(scheduler, runner))) == {"r2"}


# ---- prefix caching --------------------------------------------------------------------


def test_shared_prefix_shares_blocks_and_counts_hits():
    scheduler, runner = make(block_size=4)
    prefix = list(range(16))
    a = Request("a", prefix + [90, 91, 92, 93], max_tokens=4)
    scheduler.add(a)
    step(scheduler, runner)
    b = Request("b", prefix + [80, 81, 82, 83], max_tokens=4)
    scheduler.add(b)
    output = step(scheduler, runner)
    assert shares(output)["b"] == (16, 4)
    assert b.block_ids[:4] == a.block_ids[:4] and b.block_ids[4] != a.block_ids[4]
    assert all(scheduler.pool.ref_count(block) == 2 for block in a.block_ids[:4])
    assert b.num_cached_prompt_tokens == 16 and a.num_cached_prompt_tokens == 0
    pool = scheduler.pool
    assert (pool.prefix_queries, pool.prefix_query_tokens, pool.prefix_hit_tokens) == (2, 40, 16)
    assert pool.hit_rate == pytest.approx(0.4)
    run_to_completion(scheduler, runner)
    assert b.output_token_ids == reference_outputs(b.prompt_token_ids, 4)
    assert pool.num_free_blocks == pool.num_blocks


def test_a_finished_requests_prefix_serves_a_later_identical_prompt():
    scheduler, runner = make(block_size=4)
    prompt = list(range(12))
    first = Request("first", prompt, max_tokens=3)
    scheduler.add(first)
    run_to_completion(scheduler, runner)
    again = Request("again", prompt, max_tokens=3)
    scheduler.add(again)
    # Never the whole prompt: the last block is recomputed so logits exist.
    assert shares(step(scheduler, runner)) == {"again": (8, 4)}
    run_to_completion(scheduler, runner)
    assert again.output_token_ids == first.output_token_ids == reference_outputs(prompt, 3)


# ---- preemption ------------------------------------------------------------------------


def test_preemption_takes_the_latest_arrivals_back_to_the_front_of_the_queue():
    scheduler, runner = make(num_blocks=3, block_size=4, enable_prefix_caching=False)
    a, b, c = (Request(name, [i] * 3, max_tokens=4) for i, name in enumerate("abc"))
    for request in (a, b, c):
        scheduler.add(request)
    step(scheduler, runner)  # three prefills, one block each
    step(scheduler, runner)  # decodes at position 3, still in block 0
    scheduler.add(Request("d", [9], max_tokens=1))
    output = step(scheduler, runner)  # position 4 needs a second block each
    # a takes c's block; b then finds none and, the latest left, gives up its own.
    assert output.preempted == [c, b]
    assert shares(output) == {"a": (4, 1)}
    assert list(scheduler.waiting) == [b, c, scheduler.get("d")]
    for request in (b, c):
        assert request.status is RequestStatus.PREEMPTED and request.num_preemptions == 1
        assert request.block_ids == [] and request.num_computed_tokens == 0
        assert len(request.output_token_ids) == 2  # kept for the recompute
    assert scheduler.num_preemptions == 2


def test_a_preempted_request_recomputes_prompt_and_outputs():
    scheduler, runner = make(num_blocks=3, block_size=4, enable_prefix_caching=False)
    a = Request("a", [1] * 4, max_tokens=6)
    b = Request("b", [2] * 4, max_tokens=3)
    scheduler.add(a)
    scheduler.add(b)
    step(scheduler, runner)
    output = step(scheduler, runner)
    assert output.preempted == [b]
    recompute = None
    while recompute is None:
        output = step(scheduler, runner)
        recompute = next((item for item in output.scheduled if item.request is b), None)
    # Prompt (4) plus the one token sampled before preemption, from position 0.
    assert (recompute.start_position, recompute.num_new_tokens, recompute.samples) == (0, 5, True)
    run_to_completion(scheduler, runner)
    assert a.output_token_ids == reference_outputs(a.prompt_token_ids, 6)
    assert b.output_token_ids == reference_outputs(b.prompt_token_ids, 3)


def step_until(scheduler, runner, predicate, max_steps=100) -> SchedulerOutput:
    for _ in range(max_steps):
        output = step(scheduler, runner)
        if predicate(output):
            return output
    raise AssertionError("condition not reached")


def test_recompute_after_preemption_reuses_its_own_cached_blocks():
    scheduler, runner = make(num_blocks=7, block_size=4)
    a = Request("a", [1] * 9, max_tokens=8)  # grows to 4 blocks
    b = Request("b", [2] * 9, max_tokens=8)  # grows to 4 blocks
    scheduler.add(a)
    scheduler.add(b)
    outputs = [step(scheduler, runner) for _ in range(5)]
    # Position 12 needs a 4th block each: a takes the last free one, b gives up its 3.
    assert outputs[-1].preempted == [b] and len(b.output_token_ids) == 4
    while a.status is RequestStatus.RUNNING:
        assert b not in [item.request for item in step(scheduler, runner).scheduled]
    # b's three full blocks stayed cached while free (a took the uncached block):
    # the recompute computes only the token sampled before preemption.
    assert shares(step(scheduler, runner)) == {"b": (12, 1)}
    assert b.num_cached_prompt_tokens == 0  # usage reports the first admission only
    assert scheduler.pool.prefix_queries == 2
    run_to_completion(scheduler, runner)
    assert b.output_token_ids == reference_outputs(b.prompt_token_ids, 8)


def test_no_request_joins_in_a_step_that_preempted():
    scheduler, runner = make(
        num_blocks=4, block_size=4, max_num_seqs=2, max_num_batched_tokens=4, enable_prefix_caching=False
    )
    a = Request("a", [0], max_tokens=8)
    c = Request("c", list(range(1, 13)), max_tokens=3)
    scheduler.add(a)
    scheduler.add(c)
    for _ in range(4):  # c's prompt in chunks of 3 beside a's decodes: 3 blocks, the pool is full
        step(scheduler, runner)
    output = step(scheduler, runner)
    # a's 2nd block frees c's 3; c's next 3-token chunk would fit, but waits a step.
    assert output.preempted == [c] and shares(output) == {"a": (4, 1)}
    assert shares(step(scheduler, runner)) == {"a": (5, 1), "c": (0, 3)}
    run_to_completion(scheduler, runner)
    assert c.output_token_ids == reference_outputs(c.prompt_token_ids, 3)


def test_a_request_that_cannot_fit_alone_raises_instead_of_looping():
    scheduler, runner = make(num_blocks=2, block_size=4)
    request = Request("a", [1] * 4, max_tokens=4)
    scheduler.add(request)
    # An engine that ignores max_tokens: the request outgrows the whole pool.
    with pytest.raises(UnschedulableRequestError, match="whole pool free") as raised:
        for _ in range(20):
            output = scheduler.schedule()
            scheduler.update(output, runner.execute(output))
    assert raised.value.request_id == "a"


def _hold_finished(scheduler, runner, request_id: str) -> list[int]:
    """Step until ``request_id`` finishes, holding its blocks (a prefill engine's handoff)."""
    for _ in range(100):
        waiting_before = {r.request_id for r in scheduler.waiting}
        output = scheduler.schedule()
        check_output(scheduler, output, waiting_before)
        for request in scheduler.update(output, runner.execute(output)):
            if request.reached_max_tokens:
                if request.request_id == request_id:
                    scheduler.hold_blocks(request_id)
                scheduler.finish(request.request_id, RequestStatus.FINISHED_LENGTH)
        scheduler.check_invariants()
        if scheduler.held_blocks(request_id) is not None:
            return scheduler.held_blocks(request_id)
    raise AssertionError(f"{request_id} did not finish")


def test_held_blocks_that_fill_the_pool_make_the_queue_wait_not_fail():
    # NOTE: a prefill engine's leased blocks belong to no running request: with them filling
    # the pool, nothing runs and the head does not fit; it waits until a release.
    scheduler, runner = make(num_blocks=8, block_size=4, enable_prefix_caching=False)
    for name, token in (("a", 1), ("b", 2)):
        scheduler.add(Request(name, [token] * 13, max_tokens=1))  # 4 blocks each
        _hold_finished(scheduler, runner, name)
    assert scheduler.num_held_blocks == 8 and scheduler.pool.num_free_blocks == 0
    c = Request("c", [3] * 9, max_tokens=1)
    scheduler.add(c)
    for _ in range(3):
        assert scheduler.schedule().is_empty
        assert scheduler.waiting_for_held_blocks and c.status is RequestStatus.WAITING
        scheduler.check_invariants()
    assert scheduler.release_held_blocks("a") is not None
    assert not scheduler.waiting_for_held_blocks
    assert shares(step(scheduler, runner)) == {"c": (0, 9)}
    assert not scheduler.waiting_for_held_blocks
    scheduler.release_held_blocks("b")
    assert scheduler.pool.num_used_blocks == 0 and not scheduler.has_unfinished()


def test_a_running_request_squeezed_out_by_held_blocks_waits_for_them():
    # NOTE: chunked prefill admits a prompt by its first chunk; held blocks taken meanwhile can
    # leave its next chunk no block: it preempts itself and waits, it does not fail.
    scheduler, runner = make(num_blocks=8, block_size=4, max_num_batched_tokens=8, enable_prefix_caching=False)
    scheduler.add(Request("a", [1] * 15, max_tokens=1))  # 4 blocks, in two chunks
    b = Request("b", [2] * 20, max_tokens=1)  # 5 blocks, in chunks of the budget's rest
    scheduler.add(b)
    _hold_finished(scheduler, runner, "a")  # a: 8 + 7 tokens; b: 1 token beside a's rest
    assert len(b.block_ids) == 1 and scheduler.pool.num_free_blocks == 3
    assert shares(step(scheduler, runner)) == {"b": (1, 8)}  # 2 more blocks: 1 left free
    output = scheduler.schedule()  # b's next chunk needs 2: it preempts itself
    assert output.is_empty and output.preempted == [b] and b.status is RequestStatus.PREEMPTED
    assert scheduler.waiting_for_held_blocks
    scheduler.check_invariants()
    scheduler.release_held_blocks("a")
    run_to_completion(scheduler, runner)
    assert scheduler.pool.num_used_blocks == 0


# ---- abort -----------------------------------------------------------------------------


def test_abort_frees_blocks_at_once():
    scheduler, runner = make(num_blocks=16, block_size=4, enable_prefix_caching=False)
    running = Request("running", [1] * 10, max_tokens=5)
    scheduler.add(running)
    step(scheduler, runner)
    waiting = Request("waiting", [2] * 3, max_tokens=5)
    scheduler.add(waiting)
    assert scheduler.pool.num_free_blocks == 13
    assert scheduler.abort("running")
    assert scheduler.pool.num_free_blocks == 16 and running.block_ids == []
    assert running.status is RequestStatus.FINISHED_ABORTED and running.finish_reason == "abort"
    assert scheduler.abort("waiting") and scheduler.num_waiting == 0
    assert not scheduler.abort("waiting") and not scheduler.abort("unknown")
    assert not scheduler.has_unfinished()
    scheduler.check_invariants()


def test_abort_between_schedule_and_update_is_skipped():
    scheduler, runner = make()
    a = Request("a", [1] * 5, max_tokens=5)
    b = Request("b", [2] * 5, max_tokens=2)
    scheduler.add(a)
    scheduler.add(b)
    output = scheduler.schedule()
    sampled = runner.execute(output)
    scheduler.abort("a")
    assert scheduler.update(output, sampled) == [b]
    assert a.output_token_ids == [] and a.num_computed_tokens == 0
    scheduler.check_invariants()


def test_finish_needs_a_finished_status():
    scheduler, _ = make()
    scheduler.add(Request("a", [1], max_tokens=1))
    with pytest.raises(ValueError, match="status"):
        scheduler.finish("a", RequestStatus.RUNNING)
    assert scheduler.finish("a", RequestStatus.FINISHED_STOPPED)


# ---- remote KV (the decode side of a handoff) ----------------------------------------------


def _load(scheduler, runner, request_id: str) -> Request:
    """What a finished KV read does: the prompt's slots hold its tokens (the fake KV); then
    the request joins ``running`` with the first token the prefill engine would sample."""
    request = scheduler.get(request_id)
    assert request.status is RequestStatus.WAITING_FOR_REMOTE_KV
    size = scheduler.pool.block_size
    for position, token in enumerate(request.prompt_token_ids):
        runner.slots[request.block_ids[position // size] * size + position % size] = token
    return scheduler.remote_kv_loaded(request_id, reference_outputs(request.prompt_token_ids, 1)[0])


def test_a_loading_request_holds_its_slot_and_blocks_and_is_never_scheduled():
    scheduler, runner = make(num_blocks=32, block_size=4, max_num_seqs=2)
    p = Request("p", list(range(9)), max_tokens=4)
    scheduler.add(p)
    blocks, num_cached = scheduler.admit_prefilled("p")
    assert (len(blocks), num_cached) == (3, 0) and scheduler.num_loading == 1 and scheduler.has_unfinished()
    a, b = Request("a", [1] * 5, max_tokens=3), Request("b", [2] * 5, max_tokens=3)
    scheduler.add(a)
    scheduler.add(b)
    # One slot left: a runs, b waits; p is in no step while its KV is read.
    for _ in range(2):
        output = step(scheduler, runner)
        assert "p" not in shares(output) and b.status is RequestStatus.WAITING
    assert scheduler.pool.num_used_blocks >= 3
    _load(scheduler, runner, "p")
    assert shares(step(scheduler, runner)) == {"a": (6, 1), "p": (9, 1)}
    run_to_completion(scheduler, runner)
    for request in (p, a, b):
        assert request.output_token_ids == reference_outputs(request.prompt_token_ids, request.max_tokens)
    assert scheduler.pool.num_used_blocks == 0


def test_a_pool_short_only_by_loading_blocks_waits_instead_of_failing():
    scheduler, runner = make(num_blocks=4, block_size=4, enable_prefix_caching=False)
    scheduler.add(Request("p", [3] * 13, max_tokens=2))  # all 4 blocks
    scheduler.admit_prefilled("p")
    c = Request("c", [4] * 5, max_tokens=1)
    scheduler.add(c)
    for _ in range(3):
        assert scheduler.schedule().is_empty and not scheduler.waiting_for_held_blocks
        scheduler.check_invariants()
    _load(scheduler, runner, "p")
    run_to_completion(scheduler, runner)
    assert c.output_token_ids == reference_outputs(c.prompt_token_ids, 1) and scheduler.pool.num_used_blocks == 0


def test_an_abort_while_loading_keeps_the_blocks_until_the_read_ends():
    scheduler, _ = make(num_blocks=16, block_size=4)
    scheduler.add(Request("p", list(range(10)), max_tokens=4))
    blocks, _ = scheduler.admit_prefilled("p")
    assert scheduler.abort("p") and not scheduler.has_unfinished()
    # The read may still write into them: referenced, counted, never handed out.
    assert scheduler.is_draining("p") and scheduler.num_draining_blocks == 3 and scheduler.pool.num_free_blocks == 13
    scheduler.check_invariants()
    with pytest.raises(ValueError, match="aborted while its KV read is in flight"):
        scheduler.add(Request("p", [1], max_tokens=1))
    assert scheduler.release_draining("p") and not scheduler.release_draining("p")
    assert scheduler.pool.num_free_blocks == 16 and not scheduler.is_draining("p")
    scheduler.add(Request("p", [1], max_tokens=1))
    scheduler.check_invariants()


def test_a_failed_load_requeues_the_request_as_the_latest_arrival():
    scheduler, runner = make(num_blocks=32, block_size=4)
    p = Request("p", list(range(9)), max_tokens=3)
    scheduler.add(p)
    scheduler.admit_prefilled("p")
    a = Request("a", [1] * 5, max_tokens=4)
    scheduler.add(a)
    step(scheduler, runner)
    b = Request("b", [2] * 5, max_tokens=2)
    scheduler.add(b)
    failed = scheduler.remote_kv_failed("p")
    assert failed is p and p.status is RequestStatus.WAITING and p.block_ids == [] and not p.prefilled
    assert p.arrival_order > b.arrival_order and list(scheduler.waiting) == [b, p]
    scheduler.check_invariants()
    run_to_completion(scheduler, runner)
    # It computed its prompt here and sampled its own tokens.
    assert p.output_token_ids == reference_outputs(p.prompt_token_ids, 3) and scheduler.pool.num_used_blocks == 0


def test_a_request_preempted_while_another_loads_keeps_its_place_and_the_loads_blocks_stay():
    # NOTE: r1 and r2 grow to 4 blocks each in a pool of 8, while p holds 2 of them loading:
    # r2 (the latest running) is preempted, never p, whose blocks the read writes.
    scheduler, runner = make(num_blocks=8, block_size=4, enable_prefix_caching=False)
    r1, r2 = Request("r1", [1] * 7, max_tokens=9), Request("r2", [2] * 7, max_tokens=9)
    for request in (r1, r2):
        scheduler.add(request)
    step(scheduler, runner)
    p = Request("p", [3] * 8, max_tokens=2)
    scheduler.add(p)
    scheduler.admit_prefilled("p")
    preempted = []
    while not preempted:
        preempted = step(scheduler, runner).preempted
    assert preempted == [r2] and p.status is RequestStatus.WAITING_FOR_REMOTE_KV and len(p.block_ids) == 2
    _load(scheduler, runner, "p")
    scheduler.check_invariants()
    run_to_completion(scheduler, runner)
    for request in (r1, r2, p):
        assert request.output_token_ids == reference_outputs(request.prompt_token_ids, request.max_tokens)
    assert scheduler.pool.num_used_blocks == 0


# ---- fairness --------------------------------------------------------------------------


def test_admission_follows_arrival_order_under_a_stream_of_short_requests():
    scheduler, runner = make(num_blocks=256, block_size=4, max_num_batched_tokens=16, max_num_seqs=16)
    admitted = []
    long = None
    for index in range(40):
        scheduler.add(Request(f"short{index}", [index % 7] * 3, max_tokens=3))
        if index == 5:
            long = Request("long", list(range(64)), max_tokens=2)
            scheduler.add(long)
        output = step(scheduler, runner)
        admitted += [item.request for item in output.scheduled if item.start_position == 0]
    run_to_completion(scheduler, runner)
    orders = [request.arrival_order for request in admitted]
    assert orders == sorted(orders), "a later request was admitted before an earlier one"
    assert long.finish_reason == "length" and long.output_token_ids == reference_outputs(long.prompt_token_ids, 2)


def test_a_large_head_request_is_not_overtaken_by_smaller_ones():
    scheduler, runner = make(num_blocks=8, block_size=4, max_num_batched_tokens=64, enable_prefix_caching=False)
    holder = Request("holder", [1] * 12, max_tokens=3)  # 3 blocks, then a 4th for its last decode
    scheduler.add(holder)
    step(scheduler, runner)
    big = Request("big", [2] * 24, max_tokens=1)  # needs 6 blocks; 5 are free
    small = Request("small", [3] * 2, max_tokens=1)  # would fit, but arrived later
    scheduler.add(big)
    scheduler.add(small)
    output = step(scheduler, runner)
    assert shares(output) == {"holder": (12, 1)}
    run_to_completion(scheduler, runner)
    assert big.finish_reason == small.finish_reason == "length"


# ---- property-style: no leaks after any mix -----------------------------------------------


@pytest.mark.parametrize("prefix_caching", [True, False])
@pytest.mark.parametrize("chunked", [True, False])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_mix_of_finish_abort_and_preemption_leaks_nothing(prefix_caching, chunked, seed):
    rng = random.Random(seed)
    scheduler, runner = make(
        num_blocks=12,
        block_size=4,
        max_num_seqs=6,
        max_num_batched_tokens=32,
        enable_prefix_caching=prefix_caching,
        enable_chunked_prefill=chunked,
    )
    shared_prefixes = [[rng.randrange(VOCAB) for _ in range(rng.randrange(4, 14))] for _ in range(3)]
    live: list[Request] = []
    finished: list[Request] = []
    aborted = 0
    for index in range(300):
        if rng.random() < 0.35:
            request = random_request(rng, scheduler, shared_prefixes, f"r{index}")
            scheduler.add(request)
            live.append(request)
        if live and rng.random() < 0.05:
            victim = rng.choice(live)
            if scheduler.abort(victim.request_id):
                aborted += 1
        waiting_before = {request.request_id for request in scheduler.waiting}
        output = scheduler.schedule()
        check_output(scheduler, output, waiting_before)
        sampled = runner.execute(output)
        if live and rng.random() < 0.05:  # abort in flight: between schedule and update
            victim = rng.choice(live)
            if scheduler.abort(victim.request_id):
                aborted += 1
        for request in scheduler.update(output, sampled):
            if request.reached_max_tokens:
                scheduler.finish(request.request_id, RequestStatus.FINISHED_LENGTH)
            elif rng.random() < 0.05:  # a stop token, as the engine would see it
                scheduler.finish(request.request_id, RequestStatus.FINISHED_STOPPED)
        scheduler.check_invariants()
        finished += [r for r in live if r.is_finished]
        live = [r for r in live if not r.is_finished]
    run_to_completion(scheduler, runner)
    finished += live
    pool = scheduler.pool
    assert pool.num_free_blocks == pool.num_blocks and pool.usage == 0.0
    pool.check_invariants({})
    # The mix really exercised every path.
    assert scheduler.num_preemptions > 0 and aborted > 0
    assert {r.status for r in finished} >= {
        RequestStatus.FINISHED_LENGTH,
        RequestStatus.FINISHED_STOPPED,
        RequestStatus.FINISHED_ABORTED,
    }
    if prefix_caching:
        assert pool.prefix_hit_tokens > 0
    for request in finished:
        assert request.output_token_ids == reference_outputs(request.prompt_token_ids, request.num_output_tokens)
