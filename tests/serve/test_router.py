"""The routing policies as plain functions (no Ray): least-loaded ranking, prefix affinity
with its overload fallback, the router's own in-flight bookkeeping and prefix memory, and
replica pins (also through the Serve router shells, built without a Ray cluster)."""

import asyncio
from types import SimpleNamespace

import pytest
from ray.serve._private.common import DeploymentHandleSource, DeploymentID, ReplicaID

from flotilla.cluster.engine.sampling_params import SamplingParams
from flotilla.serve.routing_policy import is_overloaded
from flotilla.serve.router import (
    OVERLOAD_SLACK,
    Candidate,
    InFlight,
    PrefixMemory,
    LeastLoadedRouter,
    PrefixAffinityRouter,
    generate_request_of,
    load_from_stats,
    pinned_replica,
    rank_least_loaded,
    rank_prefix_affine,
    replica_pin_of,
    router_class_path,
)
from flotilla.serve.types import GenerateRequest, ReplicaLoad, ReplicaPin


def cand(rid, running=0, waiting=0, kv=0.0, keys=(), in_flight=None, max_queued=0):
    return Candidate(rid, ReplicaLoad(running, waiting, kv, max_queued, tuple(keys)), in_flight)


def test_stats_dict_becomes_a_load_and_missing_stats_count_as_empty():
    load = load_from_stats({"running": 3, "waiting": 2, "kv_usage": 0.5, "max_queued": 8, "prefix_keys": [7, 9], "extra": 1})
    assert load == ReplicaLoad(3, 2, 0.5, 8, (7, 9)) and load.load == 5
    assert load_from_stats({}) == ReplicaLoad() and load_from_stats(None) == ReplicaLoad()


def test_least_loaded_ranks_by_reported_requests_then_kv_usage():
    ranked = rank_least_loaded([
        cand("busy", running=4),
        cand("kv-heavy", running=1, kv=0.9),
        cand("light", waiting=1, kv=0.1),
        cand("fresh"),  # no stats yet: empty
    ])
    assert ranked == ["fresh", "light", "kv-heavy", "busy"]
    # Full ties keep the input order (stable).
    assert rank_least_loaded([cand("x"), cand("y"), cand("z")]) == ["x", "y", "z"]


def test_a_fresh_in_flight_count_beats_the_lagging_report():
    # A burst: the reports still say idle, but 3 requests are on their way to "a".
    assert rank_least_loaded([cand("a", in_flight=3), cand("b", running=1)]) == ["b", "a"]
    # Requests that finished since the report: "a" reported 6, holds 0 now.
    assert rank_least_loaded([cand("a", running=6, in_flight=0), cand("b", running=1)]) == ["a", "b"]
    assert cand("a", running=6, in_flight=2).effective_load == 2
    assert cand("a", running=6).effective_load == 6  # no fresh count: the report stands in
    # Equal counts: the reported KV usage breaks the tie.
    assert rank_least_loaded([cand("a", kv=0.5, in_flight=1), cand("b", kv=0.2, in_flight=1)]) == ["b", "a"]


def test_prefix_holder_goes_first_within_the_slack():
    candidates = [cand("idle"), cand("holder", running=3, keys=(42,))]
    assert rank_prefix_affine(candidates, 42) == ["holder", "idle"]
    # Unknown key, or no key: plain least-loaded.
    assert rank_prefix_affine(candidates, 7) == ["idle", "holder"]
    assert rank_prefix_affine(candidates, None) == ["idle", "holder"]


def test_prefix_holder_gives_way_when_overloaded():
    busy = [cand("idle"), cand("holder", running=OVERLOAD_SLACK + 1, keys=(42,))]
    assert rank_prefix_affine(busy, 42) == ["idle", "holder"]
    # At heavy load the factor (2x) applies instead of the absolute slack.
    assert rank_prefix_affine([cand("a", running=20), cand("holder", running=40, keys=(42,))], 42)[0] == "holder"
    assert rank_prefix_affine([cand("a", running=20), cand("holder", running=41, keys=(42,))], 42)[0] == "a"
    # The fresh count decides here too: a stale busy report does not push the prefix away.
    stale = [cand("idle", in_flight=2), cand("holder", running=9, in_flight=1, keys=(42,))]
    assert rank_prefix_affine(stale, 42)[0] == "holder"


def test_is_overloaded_bounds():
    assert not is_overloaded(cand("h", running=4), least_load=0)
    assert is_overloaded(cand("h", running=5), least_load=0)
    assert not is_overloaded(cand("h", running=10), least_load=5, slack=2, factor=2.0)
    assert is_overloaded(cand("h", running=11), least_load=5, slack=2, factor=2.0)


def test_remembered_replica_counts_as_holder_and_least_loaded_holder_wins():
    candidates = [cand("a", running=1), cand("b", running=2), cand("c")]
    assert rank_prefix_affine(candidates, 42, remembered="b") == ["b", "c", "a"]
    both = [cand("a", running=3, keys=(42,)), cand("b", running=1, keys=(42,)), cand("c")]
    assert rank_prefix_affine(both, 42)[0] == "b"
    # A remembered replica that is gone is simply not a candidate.
    assert rank_prefix_affine([cand("a"), cand("c")], 42, remembered="b") == ["a", "c"]


def test_prefix_memory_is_bounded_and_forgets_dead_replicas():
    memory = PrefixMemory(capacity=2)
    memory.remember(1, "a")
    memory.remember(2, "b")
    memory.remember(1, "c")  # re-sent elsewhere: newest wins and becomes most recent
    memory.remember(3, "a")  # evicts key 2 (the oldest)
    assert (memory.get(1), memory.get(2), memory.get(3), len(memory)) == ("c", None, "a", 2)
    memory.remember(None, "a")
    assert len(memory) == 2 and memory.get(None) is None
    memory.forget("a")
    assert memory.get(3) is None and memory.get(1) == "c"
    with pytest.raises(ValueError, match="capacity"):
        PrefixMemory(0)


def test_in_flight_assign_confirm_complete_and_expire():
    now = [0.0]
    flight = InFlight(ttl_s=5.0, clock=lambda: now[0])
    flight.assign("r1", "a")
    flight.assign("r2", "a")
    flight.assign("r3", "b", confirmed=True)
    assert (flight.count("a"), flight.count("b")) == (2, 1)
    flight.assign("r2", "b", confirmed=True)  # Serve sent it elsewhere after all
    assert (flight.count("a"), flight.count("b")) == (1, 2)
    flight.complete("r3")
    flight.complete("never-assigned")
    assert flight.count("b") == 1
    now[0] = 6.0
    flight.expire()  # r1 was never confirmed (cancelled while queued): dropped
    assert (flight.count("a"), flight.count("b")) == (0, 1)
    flight.forget_replica("b")
    assert flight.count("b") == 0


def test_generate_request_is_found_in_args_or_kwargs():
    req = GenerateRequest("r", [1, 2], SamplingParams(max_tokens=1), 0.0, prefix_key=5)
    assert generate_request_of(SimpleNamespace(args=["x", req], kwargs={})) is req
    assert generate_request_of(SimpleNamespace(args=[], kwargs={"request": req})) is req
    assert generate_request_of(SimpleNamespace(args=[1], kwargs={})) is None
    assert generate_request_of(None) is None


def test_router_names():
    assert router_class_path("least-loaded").endswith("LeastLoadedRouter")
    assert router_class_path("prefix-affinity").endswith("PrefixAffinityRouter")
    with pytest.raises(ValueError, match="router='random'.*least-loaded"):
        router_class_path("random")


def test_a_pin_is_found_among_the_arguments_and_names_a_candidate_by_its_tag():
    pin = ReplicaPin("b2")
    assert replica_pin_of(SimpleNamespace(args=[pin, "prefill-7"], kwargs={})) is pin
    assert replica_pin_of(SimpleNamespace(args=[], kwargs={"pin": pin})) is pin
    assert replica_pin_of(SimpleNamespace(args=["x"], kwargs={})) is None and replica_pin_of(None) is None
    deployment = DeploymentID(name="prefill", app_name="app")
    ids = [ReplicaID(tag, deployment) for tag in ("a1", "b2")]
    assert pinned_replica(ids, pin) is ids[1]
    assert pinned_replica(["a1", "b2"], pin) == "b2"  # plain ids match by equality
    assert pinned_replica(ids, ReplicaPin("gone")) is None and pinned_replica(ids, None) is None


def pending(*args, request_id="q"):
    return SimpleNamespace(
        args=list(args),
        kwargs={},
        metadata=SimpleNamespace(internal_request_id=request_id),
        routing_context=SimpleNamespace(should_backoff=False),
    )


@pytest.mark.parametrize("router_class", [LeastLoadedRouter, PrefixAffinityRouter])
def test_serve_routers_send_a_pinned_call_to_its_replica_alone_while_it_is_a_candidate(router_class):
    deployment = DeploymentID(name="prefill", app_name="app")
    router = router_class(deployment, DeploymentHandleSource.UNKNOWN)
    router.initialize_state()
    # "busy" holds the most requests: least-loaded would rank it last.
    replicas = [
        SimpleNamespace(replica_id=ReplicaID(tag, deployment), routing_stats={"running": running})
        for tag, running in (("idle", 0), ("mid", 2), ("busy", 9))
    ]

    def choose(call):
        ranked = asyncio.run(router.choose_replicas(replicas, call))
        return [[r.replica_id.unique_id for r in group] for group in ranked]

    assert choose(pending(ReplicaPin("busy"), "prefill-1", request_id="q1")) == [["busy"]]
    assert router.in_flight.count(replicas[2].replica_id) == 1  # counted like any assignment
    # The pinned replica is gone: ranked as usual (the receiver sees the pin is not its own).
    # (busy now counts q1 in flight, so it ranks by that fresh count.)
    assert choose(pending(ReplicaPin("dead"), "prefill-2", request_id="q2")) == [["idle"], ["busy"], ["mid"]]
    # No pin: every candidate is ranked.
    plain = GenerateRequest("p", [1, 2, 3], SamplingParams(max_tokens=1), 0.0)
    assert sorted(group[0] for group in choose(pending(plain, request_id="q3"))) == ["busy", "idle", "mid"]
