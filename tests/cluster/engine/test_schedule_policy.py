"""Admission order (``--schedule-policy``), priority scheduling and ``--prefill-max-requests``,
on the pure scheduler with the fake runner (every output is still checked against the
oracle, so a policy that corrupts the cache fails too), and through the engine."""

import random

import pytest

from flotilla.cluster.engine.request import Request
from flotilla.cluster.engine.schedule_policy import LPM_MAX_QUEUE, PriorityPolicy, waiting_order
from helpers.prompts import reference_outputs
from helpers.scheduler_harness import make, random_request, run_to_completion, shares, step

SHARED = list(range(1, 17))  # four full blocks of 4


def admitted_ids(output, waiting_before):
    return [item.request.request_id for item in output.scheduled if item.request.request_id in waiting_before]


def admission_order(scheduler, runner, requests):
    """Add ``requests`` (in arrival order) with one running slot, and return the order in
    which they are admitted."""
    for request in requests:
        scheduler.add(request)
    order = []
    while scheduler.has_unfinished():
        waiting = {r.request_id for r in scheduler.waiting}
        order += admitted_ids(step(scheduler, runner), waiting)
    for request in requests:
        assert request.output_token_ids == reference_outputs(request.prompt_token_ids, request.max_tokens)
    return order


def warm_prefix(scheduler, runner, prefix):
    """Run one request over ``prefix`` so its full blocks sit in the prefix cache."""
    scheduler.add(Request("warm", prefix + [99], max_tokens=1))
    run_to_completion(scheduler, runner)


def test_fcfs_admits_in_arrival_order():
    scheduler, runner = make(max_num_seqs=1, policy="fcfs")
    requests = [Request(f"r{i}", [i + 1] * 3, max_tokens=2) for i in range(4)]
    assert admission_order(scheduler, runner, requests) == ["r0", "r1", "r2", "r3"]


@pytest.mark.parametrize("policy, first", [("fcfs", "cold"), ("lpm", "hot")])
def test_lpm_admits_the_longest_cached_prefix_first(policy, first):
    scheduler, runner = make(max_num_seqs=1, policy=policy)
    warm_prefix(scheduler, runner, SHARED)
    cold = Request("cold", [50, 51, 52, 53, 54], max_tokens=2)
    hot = Request("hot", SHARED + [7, 8], max_tokens=2)
    order = admission_order(scheduler, runner, [cold, hot])
    assert order[0] == first
    if policy == "lpm":
        assert hot.num_cached_prompt_tokens == len(SHARED)


def test_lpm_falls_back_to_arrival_order_on_a_long_queue():
    scheduler, _ = make(num_blocks=1024, max_num_seqs=1, policy="lpm")
    requests = [Request(f"r{i}", [i % 50 + 1, 2], max_tokens=1) for i in range(LPM_MAX_QUEUE + 1)]
    for request in requests:
        request.arrival_order = int(request.request_id[1:])
    order = waiting_order(list(reversed(requests)), "lpm", scheduler.pool)
    assert order == requests


def test_random_is_a_seeded_shuffle():
    scheduler, _ = make(policy="random")
    requests = [Request(f"r{i}", [i + 1], max_tokens=1) for i in range(12)]
    for i, request in enumerate(requests):
        request.arrival_order = i
    first = waiting_order(requests, "random", scheduler.pool, rng=random.Random(3))
    again = waiting_order(requests, "random", scheduler.pool, rng=random.Random(3))
    assert first == again and first != requests and sorted(first, key=lambda r: r.arrival_order) == requests


def test_lof_admits_the_longest_output_budget_first():
    scheduler, runner = make(max_num_seqs=1, policy="lof")
    requests = [Request("short", [1, 2], max_tokens=2), Request("long", [3, 4], max_tokens=9), Request("mid", [5, 6], max_tokens=5)]
    assert admission_order(scheduler, runner, requests) == ["long", "mid", "short"]


def test_dfs_weight_runs_the_branch_with_most_waiting_requests_first():
    scheduler, runner = make(num_blocks=128, max_num_seqs=1, policy="dfs-weight")
    other = [40 + i for i in range(16)]
    warm_prefix(scheduler, runner, SHARED)
    warm_prefix_again = Request("warm2", other + [98], max_tokens=1)
    scheduler.add(warm_prefix_again)
    run_to_completion(scheduler, runner)
    # NOTE: arrivals interleave the branches; dfs-weight groups the busier one (SHARED: 3),
    # then the other cached branch, then what shares nothing cached.
    requests = [
        Request("o1", other + [1], max_tokens=1),
        Request("s1", SHARED + [2], max_tokens=1),
        Request("s2", SHARED + [3], max_tokens=1),
        Request("x", [90, 91], max_tokens=1),
        Request("s3", SHARED + [4], max_tokens=1),
    ]
    for request in requests:
        scheduler.add(request)
    order = waiting_order(list(scheduler.waiting), "dfs-weight", scheduler.pool)
    assert [r.request_id for r in order] == ["s1", "s2", "s3", "o1", "x"]
    run_to_completion(scheduler, runner)
    for request in requests:
        assert request.output_token_ids == reference_outputs(request.prompt_token_ids, 1)


# ---- priorities ----------------------------------------------------------------------------


def prioritized(request_id, priority, prompt=(1, 2, 3), max_tokens=2):
    return Request(request_id, list(prompt), max_tokens=max_tokens, priority=priority)


@pytest.mark.parametrize("low_first, expected", [(False, ["hi", "hi2", "mid", "lo"]), (True, ["lo", "mid", "hi", "hi2"])])
def test_priority_levels_come_first_and_fcfs_orders_each_level(low_first, expected):
    policy = PriorityPolicy(low_values_first=low_first, preemption=False)
    scheduler, runner = make(max_num_seqs=1, priority=policy)
    requests = [prioritized("lo", -5), prioritized("hi", 7), prioritized("mid", 0), prioritized("hi2", 7)]
    assert admission_order(scheduler, runner, requests) == expected


def test_a_more_urgent_arrival_preempts_the_least_urgent_running_request():
    scheduler, runner = make(max_num_seqs=2, priority=PriorityPolicy(preemption_threshold=3))
    low, mid = prioritized("low", 0, max_tokens=30), prioritized("mid", 2, max_tokens=30)
    scheduler.add(low)
    scheduler.add(mid)
    step(scheduler, runner)
    urgent = prioritized("urgent", 10)
    scheduler.add(urgent)
    output = step(scheduler, runner)
    # NOTE: gap 10 > 3 over "low" and 8 > 3 over "mid": the least urgent one goes.
    assert [r.request_id for r in output.preempted] == ["low"]
    assert "urgent" in shares(output) and "low" not in shares(output)
    run_to_completion(scheduler, runner)
    for request in (low, mid, urgent):
        assert request.output_token_ids == reference_outputs(request.prompt_token_ids, request.max_tokens)


@pytest.mark.parametrize("policy", [PriorityPolicy(preemption=False), PriorityPolicy(preemption_threshold=10)])
def test_no_preemption_when_disabled_or_the_gap_is_within_the_threshold(policy):
    scheduler, runner = make(max_num_seqs=1, priority=policy)
    scheduler.add(prioritized("running", 0, max_tokens=5))
    step(scheduler, runner)
    scheduler.add(prioritized("urgent", 10))  # NOTE: a gap of 10 is not above a threshold of 10
    output = step(scheduler, runner)
    assert not output.preempted and set(shares(output)) == {"running"}


def test_pool_pressure_preempts_the_least_urgent_request_not_the_latest():
    # NOTE: 5 blocks of 4 tokens; two 4-token prompts decoding to 12 tokens need 3 blocks each.
    scheduler, runner = make(num_blocks=5, max_num_seqs=3, priority=PriorityPolicy(preemption=False))
    requests = [prioritized("urgent-late", 9, [1] * 4, 8), prioritized("lazy-early", -9, [2] * 4, 8)]
    scheduler.add(requests[1])
    scheduler.add(requests[0])
    preempted = []
    while scheduler.has_unfinished():
        preempted += [r.request_id for r in step(scheduler, runner).preempted]
    assert preempted and set(preempted) == {"lazy-early"}
    for request in requests:
        assert request.output_token_ids == reference_outputs(request.prompt_token_ids, request.max_tokens)


def test_prefill_max_requests_caps_admissions_per_step():
    scheduler, runner = make(max_new_requests=2)
    for i in range(5):
        scheduler.add(Request(f"r{i}", [i + 1] * 3, max_tokens=3))
    waiting = {r.request_id for r in scheduler.waiting}
    assert admitted_ids(step(scheduler, runner), waiting) == ["r0", "r1"]
    waiting = {r.request_id for r in scheduler.waiting}
    assert admitted_ids(step(scheduler, runner), waiting) == ["r2", "r3"]
    run_to_completion(scheduler, runner)


@pytest.mark.parametrize("policy", ["fcfs", "lpm", "random", "dfs-weight", "lof"])
@pytest.mark.parametrize("priority", [None, PriorityPolicy(preemption_threshold=1)])
def test_a_random_mix_under_every_policy_keeps_the_cache_right(policy, priority):
    # NOTE: a tight pool (preemptions), shared prefixes (cache hits) and priorities in [-3, 3]:
    # every request's tokens must still match the oracle, and the scheduler's invariants hold.
    rng = random.Random(f"{policy}-{priority is None}")
    scheduler, runner = make(num_blocks=24, max_num_seqs=4, max_num_batched_tokens=16, policy=policy, priority=priority)
    prefixes = [[rng.randrange(1, 50) for _ in range(8)] for _ in range(3)]
    requests = []
    for index in range(60):
        request = random_request(rng, scheduler, prefixes, f"r{index}")
        request.priority = rng.randrange(-3, 4)
        scheduler.add(request)
        requests.append(request)
        step(scheduler, runner)
    run_to_completion(scheduler, runner)
    for request in requests:
        assert request.output_token_ids == reference_outputs(request.prompt_token_ids, request.max_tokens)


# ---- through the engine: the resolved flags reach the scheduler -------------------------------


@pytest.fixture(scope="module")
def tiny_llama_dir(tmp_path_factory):
    from helpers.tiny_models import save_tiny_llama

    path = tmp_path_factory.mktemp("tiny-llama-policy")
    save_tiny_llama(path)
    return str(path)


def first_token_order(llm, prompts, priorities=None):
    """Add every prompt, then step: the order in which the requests get their first token."""
    from flotilla import SamplingParams

    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    ids = [
        engine.add_request(prompt, params, request_id=f"q{i}", priority=None if priorities is None else priorities[i])
        for i, prompt in enumerate(prompts)
    ]
    order = []
    while engine.has_unfinished_requests():
        for delta in engine.step():
            if delta.request_id not in order:
                order.append(delta.request_id)
    assert sorted(order) == sorted(ids)
    return order


def test_engine_priority_flags(tiny_llama_dir):
    from flotilla import LLM

    prompts = [[5, 6, 7], [8, 9, 10], [11, 12, 13]]
    off = LLM(tiny_llama_dir, max_running_requests=1)
    assert first_token_order(off, prompts, [0, 5, 9]) == ["q0", "q1", "q2"]  # NOTE: ignored when off
    on = LLM(tiny_llama_dir, max_running_requests=1, enable_priority_scheduling=True)
    assert first_token_order(on, prompts, [0, 5, 9]) == ["q2", "q1", "q0"]
    low = LLM(tiny_llama_dir, max_running_requests=1, enable_priority_scheduling=True, schedule_low_priority_values_first=True)
    assert first_token_order(low, prompts, [0, 5, 9]) == ["q0", "q1", "q2"]
    # NOTE: the default priority 4 puts the request without one between 0 and 9.
    default = LLM(tiny_llama_dir, max_running_requests=1, enable_priority_scheduling=True, default_priority_value=4)
    assert first_token_order(default, prompts, [0, None, 9]) == ["q2", "q1", "q0"]
    strict = LLM(tiny_llama_dir, abort_on_priority_when_disabled=True)
    with pytest.raises(ValueError, match=r"priority: this server does not schedule by priority \(got priority=3\)"):
        strict.engine.add_request([5, 6], priority=3)
    with pytest.raises(ValueError, match=r"priority must be an integer in \(-2\*\*31, 2\*\*31\) \(got priority=4294967296\)"):
        on.engine.add_request([5, 6], priority=1 << 32)


def test_engine_priority_preemption_flags(tiny_llama_dir):
    from flotilla import LLM, SamplingParams

    def preempted_by_an_urgent_arrival(**flags):
        llm = LLM(tiny_llama_dir, max_running_requests=1, enable_priority_scheduling=True, **flags)
        engine = llm.engine
        engine.add_request([5, 6, 7], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True), "slow", priority=0)
        engine.step()
        engine.add_request([8, 9], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True), "urgent", priority=20)
        engine.step()
        while engine.has_unfinished_requests():
            engine.step()
        return engine.scheduler.num_preemptions > 0

    assert preempted_by_an_urgent_arrival()
    assert not preempted_by_an_urgent_arrival(disable_priority_preemption=True)
    assert not preempted_by_an_urgent_arrival(priority_scheduling_preemption_threshold=30)


def test_engine_schedule_policy_and_prefill_max_requests(tiny_llama_dir):
    from flotilla import LLM, SamplingParams

    llm = LLM(tiny_llama_dir, max_running_requests=1, schedule_policy="lof")
    engine = llm.engine
    for request_id, max_tokens in (("short", 2), ("long", 6)):
        engine.add_request([5, 6, 7], SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True), request_id)
    engine.step()
    assert [r.request_id for r in engine.scheduler.running] == ["long"]
    assert [r.request_id for r in engine.scheduler.waiting] == ["short"]
    capped = LLM(tiny_llama_dir, prefill_max_requests=1)
    for i in range(3):
        capped.engine.add_request([5 + i, 6], SamplingParams(temperature=0, max_tokens=2), f"c{i}")
    capped.engine.step()
    assert capped.engine.scheduler.num_running == 1 and capped.engine.scheduler.num_waiting == 2
