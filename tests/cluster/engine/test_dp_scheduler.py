"""DPScheduler: routing to the least-loaded DP rank, lockstep parts, per-rank pools.

No model: each DP rank has its own fake paged cache of token ids (a DP rank's KV cache
is its own); a step runs every part on its rank's cache, reads each request's context
back from the slots the scheduler gave it and "samples" a deterministic function of
that context. A request run against the wrong DP rank's blocks, or a block table that
points into another request's blocks, changes its outputs.
"""

import random
from types import SimpleNamespace

import pytest

from flotilla.cluster.engine.dp_scheduler import (
    DPScheduler,
    DPSchedulerOutput,
    build_scheduler,
    parent_request_id,
    part_for_rank,
)
from flotilla.cluster.engine.request import Request, RequestStatus
from flotilla.cluster.engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from helpers.prompts import ORACLE_VOCAB, next_token, reference_outputs

VOCAB = ORACLE_VOCAB


class FakeDPRunner:
    """One slot array per DP rank, standing in for each DP rank's KV cache."""

    def __init__(self, scheduler: DPScheduler) -> None:
        self.block_size = scheduler.config.block_size
        self.caches = [[None] * (s.pool.num_blocks * self.block_size) for s in scheduler.schedulers]

    def _slot(self, request: Request, position: int) -> int:
        return request.block_ids[position // self.block_size] * self.block_size + position % self.block_size

    def execute(self, output: DPSchedulerOutput) -> dict[str, int | None]:
        sampled: dict[str, int | None] = {}
        for cache, part in zip(self.caches, output.parts):
            for item in part.scheduled:
                request = item.request
                context = [cache[self._slot(request, p)] for p in range(item.start_position)]
                assert context == request.all_token_ids[: item.start_position], f"{request}: wrong context"
                for offset, token in enumerate(item.token_ids):
                    cache[self._slot(request, item.start_position + offset)] = token
                sampled[request.request_id] = next_token(context + item.token_ids) if item.samples else None
        return sampled


def make(dp_size=2, num_blocks=16, block_size=4, **kwargs) -> DPScheduler:
    kwargs.setdefault("max_num_seqs", 8)
    kwargs.setdefault("max_num_batched_tokens", 32)
    return DPScheduler(SchedulerConfig(num_blocks=num_blocks, block_size=block_size, **kwargs), dp_size)


def step(scheduler: DPScheduler, runner: FakeDPRunner) -> DPSchedulerOutput:
    """One engine step; finishes requests at max_tokens like the engine does."""
    output = scheduler.schedule()
    assert len(output.parts) == scheduler.dp_size
    for part, child in zip(output.parts, scheduler.schedulers):
        assert part.num_batched_tokens <= child.config.max_num_batched_tokens
        assert all(item.request in child.running for item in part.scheduled)
    for request in scheduler.update(output, runner.execute(output)):
        if request.reached_max_tokens:
            assert scheduler.finish(request.request_id, RequestStatus.FINISHED_LENGTH)
    scheduler.check_invariants()
    return output


def req(request_id: str, prompt_len: int = 6, max_tokens: int = 4, seed: int = 0) -> Request:
    rng = random.Random(f"{request_id}/{seed}")
    return Request(request_id, [rng.randrange(VOCAB) for _ in range(prompt_len)], max_tokens)


# --- routing ----------------------------------------------------------------------------


def test_new_requests_go_to_the_least_loaded_rank_ties_to_the_lowest():
    scheduler = make(dp_size=3)
    assert [scheduler.add(req(str(i))) for i in range(7)] == [0, 1, 2, 0, 1, 2, 0]
    assert [scheduler.load(rank)[0] for rank in range(3)] == [3, 2, 2]


def test_equal_request_counts_route_by_fewest_used_blocks():
    scheduler = make(dp_size=2)
    scheduler.add(req("long", prompt_len=20))  # rank 0
    scheduler.add(req("short", prompt_len=2))  # rank 1
    scheduler.schedule()  # both admitted: rank 0 holds 5 blocks, rank 1 holds 1
    assert scheduler.load(0) == (1, 5) and scheduler.load(1) == (1, 1)
    assert scheduler.add(req("next")) == 1


def test_completions_of_one_request_share_a_rank_while_live():
    scheduler = make(dp_size=2)
    scheduler.add(req("other"))  # rank 0 is now busier
    ranks = [scheduler.add(Request(f"p#{i}", [1, 2, 3, 4, 5], 2)) for i in range(3)]
    assert ranks == [1, 1, 1]
    # NOTE: after the whole group finished, the key is free to route anew.
    for i in range(3):
        assert scheduler.abort(f"p#{i}")
    scheduler.add(req("x"))  # rank 1 (rank 0 has "other")
    assert scheduler.add(Request("p#0", [1, 2, 3], 2)) == 0
    scheduler.check_invariants()


def test_parent_request_id():
    assert parent_request_id("abc#2") == "abc"
    assert parent_request_id("a#b#10") == "a#b"
    for plain in ("abc", "abc#", "#3", "abc#x"):
        assert parent_request_id(plain) == plain


def test_duplicate_ids_are_refused_across_ranks():
    scheduler = make(dp_size=2)
    scheduler.add(req("a"))
    with pytest.raises(ValueError, match="already live"):
        scheduler.add(req("a"))


# --- lockstep parts -------------------------------------------------------------------


def test_parts_are_per_rank_and_scheduled_is_dp_major():
    scheduler = make(dp_size=3)
    for name in ("a", "b", "c", "d"):  # ranks 0, 1, 2, 0
        scheduler.add(req(name))
    output = scheduler.schedule()
    ids = [[item.request.request_id for item in part.scheduled] for part in output.parts]
    assert ids == [["a", "d"], ["b"], ["c"]]
    assert [item.request.request_id for item in output.scheduled] == ["a", "d", "b", "c"]
    assert output.num_batched_tokens == 4 * 6 and not output.is_empty and output.idle_ranks == []
    assert [output.sampling_rows(rank) for rank in range(3)] == [slice(0, 2), slice(2, 3), slice(3, 4)]
    assert part_for_rank(output, 1, 3) == (output.parts[1], slice(2, 3))


def test_an_idle_rank_gets_an_empty_part_every_step():
    scheduler = make(dp_size=2)
    runner = FakeDPRunner(scheduler)
    scheduler.add(req("only", max_tokens=3))
    steps = 0
    while scheduler.has_unfinished():
        output = step(scheduler, runner)
        assert output.idle_ranks == [1] and output.parts[1].is_empty and output.parts[1].scheduled == []
        assert output.sampling_rows(1) == slice(1, 1)
        steps += 1
    assert steps == 3 and scheduler.num_steps == 3 and scheduler.num_steps_with_idle_rank == 3
    output = scheduler.schedule()
    assert output.is_empty and output.idle_ranks == [0, 1] and scheduler.num_steps == 3


def test_update_routes_each_token_to_its_rank():
    scheduler = make(dp_size=2)
    a, b = req("a", prompt_len=3), req("b", prompt_len=5)
    scheduler.add(a)
    scheduler.add(b)
    output = scheduler.schedule()
    advanced = scheduler.update(output, {"b": 11, "a": 7})
    assert advanced == [a, b]
    assert a.output_token_ids == [7] and b.output_token_ids == [11]
    assert scheduler.schedulers[0].running == [a] and scheduler.schedulers[1].running == [b]
    with pytest.raises(ValueError, match="parts"):
        scheduler.update(DPSchedulerOutput([SchedulerOutput()]), {})


def test_part_for_rank_checks_the_step_shape():
    plain = SchedulerOutput()
    assert part_for_rank(plain, 0, 1) == (plain, slice(None))
    with pytest.raises(ValueError, match="DPSchedulerOutput"):
        part_for_rank(plain, 0, 2)
    with pytest.raises(ValueError, match="dp_size=3"):
        part_for_rank(DPSchedulerOutput([SchedulerOutput(), SchedulerOutput()]), 0, 3)


def test_random_workload_matches_the_reference_on_every_rank():
    """Many requests of mixed lengths over 3 small pools (chunked prefill, preemption):
    every request's outputs equal the reference, and every pool ends empty."""
    rng = random.Random(5)
    scheduler = make(dp_size=3, num_blocks=12, block_size=4, max_num_batched_tokens=10, max_num_seqs=4)
    runner = FakeDPRunner(scheduler)
    requests = []
    for i in range(24):
        request = Request(str(i), [rng.randrange(VOCAB) for _ in range(rng.randint(1, 20))], rng.randint(1, 12))
        requests.append(request)
        scheduler.add(request)
    for _ in range(2000):
        if not scheduler.has_unfinished():
            break
        step(scheduler, runner)
    assert not scheduler.has_unfinished()
    for request in requests:
        assert request.output_token_ids == reference_outputs(request.prompt_token_ids, request.max_tokens)
    assert scheduler.pool.num_used_blocks == 0 and scheduler.num_preemptions > 0
    assert all(s.pool.prefix_query_tokens > 0 for s in scheduler.schedulers)  # every rank served requests


# --- pools --------------------------------------------------------------------------------


def test_abort_frees_the_blocks_of_the_right_rank():
    scheduler = make(dp_size=2)
    scheduler.add(req("a", prompt_len=10))  # rank 0: 3 blocks
    scheduler.add(req("b", prompt_len=7))  # rank 1: 2 blocks
    scheduler.schedule()
    pools = [s.pool for s in scheduler.schedulers]
    assert [p.num_used_blocks for p in pools] == [3, 2] and scheduler.pool.num_used_blocks == 5
    assert scheduler.abort("b")
    assert [p.num_used_blocks for p in pools] == [3, 0]
    assert scheduler.get("b") is None and scheduler.rank_of("b") is None and scheduler.get("a") is not None
    assert not scheduler.abort("b")
    assert scheduler.abort("a") and scheduler.pool.num_used_blocks == 0
    scheduler.check_invariants()


def test_capacity_is_per_rank():
    """Each DP rank has the whole pool of one KV layout: one request may use a whole
    pool, and every rank can hold such a request at the same time."""
    scheduler = make(dp_size=2, num_blocks=4, block_size=4)
    assert scheduler.max_tokens_per_request() == 16
    with pytest.raises(ValueError, match="max_tokens"):
        scheduler.add(Request("big", list(range(10)), 7))
    assert scheduler.rank_of("big") is None
    scheduler.add(Request("a", list(range(12)), 4))
    scheduler.add(Request("b", list(range(1, 13)), 4))
    output = scheduler.schedule()
    assert output.idle_ranks == [] and [p.num_used_blocks for p in (s.pool for s in scheduler.schedulers)] == [3, 3]
    assert scheduler.pool.num_blocks == 8 and scheduler.pool.usage == pytest.approx(6 / 8)


def test_combined_stats_sum_over_ranks():
    scheduler = make(dp_size=2)
    shared = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    runner = FakeDPRunner(scheduler)
    scheduler.add(Request("a", shared, 1))
    scheduler.add(Request("b", shared, 1))  # rank 1: no shared cache with rank 0
    step(scheduler, runner)
    scheduler.add(Request("c", shared, 1))  # rank 0 again: hits rank 0's cache (8 tokens)
    step(scheduler, runner)
    assert scheduler.rank_of("c") is None and scheduler.pool.prefix_hit_tokens == 8
    assert scheduler.pool.hit_rate == pytest.approx(8 / 27)
    assert scheduler.num_running == scheduler.num_waiting == 0
    scheduler.pool.reset_prefix_cache()
    assert all(s.pool.num_cached_blocks == 0 for s in scheduler.schedulers)


# --- building ---------------------------------------------------------------------------


def _config(**fields) -> SimpleNamespace:
    return SimpleNamespace(**{"dp_size": 1, "enable_dp_attention": False, "max_running_requests": None, **fields})


def test_build_scheduler_picks_dp_only_with_dp_attention():
    base = SchedulerConfig(num_blocks=8, max_num_seqs=16, max_num_batched_tokens=64)
    assert type(build_scheduler(_config(), base)) is Scheduler
    assert type(build_scheduler(_config(dp_size=2), base)) is Scheduler  # replicas, not DP attention
    dp = build_scheduler(_config(dp_size=2, enable_dp_attention=True), base)
    assert isinstance(dp, DPScheduler) and dp.dp_size == 2 and dp.config == base
    assert all(s.pool.num_blocks == 8 for s in dp.schedulers)
    # NOTE: --max-running-requests counts the whole group (SGLang): each DP rank runs its share.
    split = build_scheduler(_config(dp_size=4, enable_dp_attention=True, max_running_requests=10), base)
    assert split.config.max_num_seqs == 2
    with pytest.raises(ValueError, match="dp_size"):
        DPScheduler(base, 0)


def test_grow_adds_empty_dp_ranks_and_routes_new_requests_to_them():
    """Elastic EP: live requests stay on their DP rank; the new, empty rank takes the next one."""
    scheduler = DPScheduler(SchedulerConfig(num_blocks=16, block_size=4), 1)
    first = Request("a", [1, 2, 3], 4)
    scheduler.add(first)
    scheduler.grow(2)
    assert scheduler.dp_size == 2 and len(scheduler.schedulers) == 2
    assert scheduler.pool.num_blocks == 32
    assert scheduler.add(Request("b", [4, 5], 4)) == 1
    assert scheduler.rank_of("a") == 0
    out = scheduler.schedule()
    assert len(out.parts) == 2 and not out.idle_ranks
    scheduler.check_invariants()
    with pytest.raises(ValueError, match="new_dp_size must be an integer >= dp_size=2"):
        scheduler.grow(1)


# --- KV handoff (PD pools with DP attention) --------------------------------------------------


def test_held_blocks_stay_on_the_dp_rank_that_computed_them_until_released():
    """A prefill pool's held prompt blocks are its DP rank's pool's (held_rank says which);
    releasing them frees that pool, whatever ranks other requests live on."""
    scheduler, prompts = make(dp_size=2), {}
    runner = FakeDPRunner(scheduler)
    for name in ("a", "b"):
        prompts[name] = req(name, prompt_len=9, max_tokens=1)
        scheduler.add(prompts[name])
    output = scheduler.schedule()
    scheduler.update(output, runner.execute(output))
    held = {name: scheduler.hold_blocks(name) for name in ("a", "b")}
    for name in ("a", "b"):
        assert scheduler.finish(name, RequestStatus.FINISHED_LENGTH)
    assert {scheduler.held_rank("a"), scheduler.held_rank("b")} == {0, 1}
    assert scheduler.held_blocks("a") == held["a"] and scheduler.num_held_blocks == 6
    rank_a = scheduler.held_rank("a")
    assert scheduler.schedulers[rank_a].pool.num_used_blocks == 3
    assert scheduler.release_held_blocks("a") == held["a"]
    assert scheduler.schedulers[rank_a].pool.num_used_blocks == 0 and scheduler.held_rank("a") is None
    assert scheduler.release_held_blocks("a") is None and scheduler.num_held_blocks == 3
    scheduler.check_invariants()


def test_prefilled_requests_load_on_their_routed_dp_rank_and_drain_there():
    """A decode pool admits a prefilled request on the DP rank it was routed to (the block ids
    are that pool's), runs it there once loaded, and frees a request aborted mid-read on its
    rank once the read ended."""
    scheduler = make(dp_size=2)
    runner = FakeDPRunner(scheduler)
    scheduler.add(req("busy", prompt_len=5))  # rank 0
    loaded, aborted = req("loaded", prompt_len=8), req("aborted", prompt_len=8)
    assert scheduler.add(loaded) == 1
    blocks, cached = scheduler.admit_prefilled("loaded")
    assert (len(blocks), cached, scheduler.num_loading) == (2, 0, 1)
    assert scheduler.schedulers[1].pool.num_used_blocks == 2 and scheduler.schedulers[0].pool.num_used_blocks == 0
    # The "read": the prompt's tokens land in rank 1's cache slots the blocks name.
    for position, token in enumerate(loaded.prompt_token_ids):
        runner.caches[1][runner._slot(loaded, position)] = token
    scheduler.remote_kv_loaded("loaded", next_token(loaded.prompt_token_ids))
    assert scheduler.add(aborted) == 0
    assert scheduler.admit_prefilled("aborted") is None  # rank 0's queue has "busy" ahead of it
    while scheduler.get("loaded") is not None:
        step(scheduler, runner)
    assert loaded.output_token_ids == reference_outputs(loaded.prompt_token_ids, 4)
    late = req("late", prompt_len=8)
    assert scheduler.add(late) == 1
    scheduler.admit_prefilled("late")
    assert scheduler.abort("late") and scheduler.is_draining("late")
    assert scheduler.schedulers[1].pool.num_used_blocks == 2
    assert scheduler.release_draining("late") and not scheduler.release_draining("late")
    assert scheduler.schedulers[1].pool.num_used_blocks == 0
    scheduler.check_invariants()
