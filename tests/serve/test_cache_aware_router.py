"""The cache-aware router: its prefix tree (matching, eviction, a dead replica), the policy as
a plain function, the Serve router shells (built without a Ray cluster, as Serve builds them),
and the shared-preamble workload of benchmarks/router_bench.py routed by the real router
classes: the cache-aware router's hit rate is at least the first-block router's and its
busiest/idlest replica ratio is at most 1.5 (issue 30's acceptance)."""

import asyncio
from types import SimpleNamespace

import pytest
from ray.serve._private.common import DeploymentHandleSource, DeploymentID, ReplicaID

from flotilla.cluster.engine.sampling_params import SamplingParams
from flotilla.serve.prefix_tree import PrefixTree, block_keys
from flotilla.serve.router import CacheAwareRouter, RoundRobinRouter, router_class_path
from flotilla.serve.routing_policy import OVERLOAD_SLACK, Candidate, rank_cache_aware
from flotilla.serve.types import GenerateRequest, ReplicaLoad

from helpers.benchmark_scripts import import_benchmark

router_bench = import_benchmark("router_bench")


def cand(rid, running=0):
    return Candidate(rid, ReplicaLoad(running=running))


def test_block_keys_are_the_full_blocks_only():
    assert block_keys(list(range(10)), 4) == [(0, 1, 2, 3), (4, 5, 6, 7)]
    assert block_keys([1, 2, 3], 4) == []
    with pytest.raises(ValueError, match="block_size=0"):
        block_keys([1], 0)


def test_match_counts_each_replicas_leading_blocks():
    tree = PrefixTree(block_size=2)
    shared, a_only, b_only = (1, 2), (3, 4), (5, 6)
    tree.insert([shared, a_only], "a")
    tree.insert([shared, b_only], "b")
    assert tree.match([shared, a_only, (7, 8)]) == {"a": 2, "b": 1}
    assert tree.match([shared, b_only]) == {"a": 1, "b": 2}
    # A prompt whose first block nobody was sent matches nobody, even if a later block matches.
    assert tree.match([(9, 9), a_only]) == {}
    assert tree.size("a") == 2 and tree.size("b") == 2 and len(tree) == 3


def test_eviction_drops_the_least_recently_routed_leaves_first():
    tree = PrefixTree(block_size=1, capacity_blocks=3)
    tree.insert([(1,), (2,)], "a")
    tree.insert([(1,), (3,)], "a")  # (1,) is now the most recent; (2,) the oldest
    tree.insert([(1,), (4,)], "a")  # over capacity: (2,) goes, not the shared root block
    assert tree.size("a") == 3
    assert tree.match([(1,), (2,)]) == {"a": 1}
    assert tree.match([(1,), (4,)]) == {"a": 2}
    assert len(tree) == 3  # the evicted node nobody holds is pruned


def test_a_dead_replica_is_forgotten_and_its_nodes_pruned():
    tree = PrefixTree(block_size=1)
    tree.insert([(1,), (2,)], "a")
    tree.insert([(1,)], "b")
    tree.forget("a")
    assert tree.match([(1,), (2,)]) == {"b": 1}
    assert tree.size("a") == 0 and len(tree) == 1
    tree.forget("never-seen")  # no error


def test_a_long_prompt_is_deeper_than_the_recursion_limit():
    tree = PrefixTree(block_size=1)
    blocks = [(i,) for i in range(5000)]
    tree.insert(blocks, "a")
    assert tree.match(blocks) == {"a": 5000} and len(tree) == 5000


def test_the_longest_match_wins_above_the_threshold():
    # 'a' holds 3 of 4 blocks (0.75 >= 0.5): first, although busier.
    order = rank_cache_aware([cand("a", running=2), cand("b")], {"a": 3, "b": 1}, 4, {"a": 9, "b": 1})
    assert order == ["a", "b"]
    # Equal matches: the less loaded goes first.
    assert rank_cache_aware([cand("a", running=2), cand("b")], {"a": 3, "b": 3}, 4, {})[0] == "b"


def test_below_the_threshold_the_replica_holding_least_goes_first():
    # The best match is 1 of 4 blocks (a shared preamble): spread to the smaller tree.
    order = rank_cache_aware([cand("a"), cand("b", running=1)], {"a": 1}, 4, {"a": 10, "b": 2})
    assert order == ["b", "a"]
    # Equal trees: the less loaded.
    assert rank_cache_aware([cand("a", running=1), cand("b")], {}, 4, {"a": 5, "b": 5})[0] == "b"
    # A prompt without a full block: plain least-loaded.
    assert rank_cache_aware([cand("a", running=1), cand("b")], {}, 0, {"a": 0, "b": 9}) == ["b", "a"]


def test_load_overrides_the_cache():
    busy = [cand("idle"), cand("holder", running=OVERLOAD_SLACK + 1)]
    assert rank_cache_aware(busy, {"holder": 4}, 4, {})[0] == "idle"
    assert rank_cache_aware([cand("idle"), cand("holder", running=OVERLOAD_SLACK)], {"holder": 4}, 4, {})[0] == "holder"


def serve_router(router_class, **kwargs):
    deployment = DeploymentID(name="engine", app_name="app")
    router = router_class(deployment, DeploymentHandleSource.UNKNOWN)
    router.initialize_state(**kwargs)
    return router, deployment


def call(request_id, tokens):
    return SimpleNamespace(
        args=[GenerateRequest(request_id, list(tokens), SamplingParams(max_tokens=1), 0.0)],
        kwargs={},
        metadata=SimpleNamespace(internal_request_id=request_id),
        routing_context=SimpleNamespace(should_backoff=False),
    )


def test_the_serve_router_follows_a_prompt_it_sent_and_spreads_new_ones():
    router, deployment = serve_router(CacheAwareRouter, block_size=4)
    replicas = [SimpleNamespace(replica_id=ReplicaID(tag, deployment), routing_stats={}) for tag in ("a", "b")]

    def choose(request_id, tokens):
        return asyncio.run(router.choose_replicas(replicas, call(request_id, tokens)))[0][0].replica_id.unique_id

    preamble = [1, 2, 3, 4]
    first = choose("q1", preamble + [10] * 8)
    # Another system prompt behind the same preamble (1 of 3 blocks held): the other replica.
    second = choose("q2", preamble + [20] * 8)
    assert {first, second} == {"a", "b"}
    # A user of the first system prompt: back where it went, though that replica is as busy.
    assert choose("q3", preamble + [10] * 8 + [99, 98]) == first
    # The replica dies: its prompts are forgotten, so they spread again.
    router.on_replica_actor_died(ReplicaID(first, deployment))
    assert router.tree.local.size(ReplicaID(first, deployment)) == 0


def test_the_serve_router_refuses_unknown_or_bad_kwargs():
    with pytest.raises(ValueError, match="unknown request_router_kwargs"):
        serve_router(CacheAwareRouter, block_size=4, nonsense=1)
    with pytest.raises(ValueError, match="threshold=1.5"):
        serve_router(CacheAwareRouter, threshold=1.5)
    with pytest.raises(ValueError, match="block_size=0"):
        serve_router(CacheAwareRouter, block_size=0)


def test_round_robin_takes_turns_whatever_the_load():
    router, deployment = serve_router(RoundRobinRouter)
    replicas = [
        SimpleNamespace(replica_id=ReplicaID(tag, deployment), routing_stats={"running": running})
        for tag, running in (("b", 0), ("a", 9))
    ]
    firsts = [asyncio.run(router.choose_replicas(replicas, call(f"q{i}", [1])))[0][0].replica_id.unique_id for i in range(4)]
    assert firsts == ["a", "b", "a", "b"]


def test_router_names_include_the_new_policies():
    assert router_class_path("cache-aware").endswith("CacheAwareRouter")
    assert router_class_path("round-robin").endswith("RoundRobinRouter")


def test_on_the_shared_preamble_workload_cache_aware_hits_more_and_stays_balanced():
    # benchmarks/router_bench.py's workload: 4 system prompts x 16 users behind a 48-token
    # preamble (3 blocks: a first-block key is the same for every prompt), 8 in flight.
    prompts = router_bench.shared_preamble_workload(4, 16, 48, 160, 32, router_bench.SIMULATED_VOCAB, seed=0)
    results = {name: router_bench.simulate(name, prompts, 2, 8, 16) for name in router_bench.ROUTERS}
    cache_aware, first_block, round_robin = results["cache-aware"], results["prefix-affinity"], results["round-robin"]
    assert sum(cache_aware["requests_per_replica"]) == 64
    assert cache_aware["hit_rate"] >= first_block["hit_rate"]
    assert cache_aware["hit_rate"] > round_robin["hit_rate"]
    assert cache_aware["max_min_load_ratio"] is not None and cache_aware["max_min_load_ratio"] <= 1.5
    # The best any router can do: each system prompt computed once (its first request hits
    # only the preamble, the very first nothing); 240-token prompts of 15 whole blocks.
    best = (60 * 208 + 3 * 48) / (64 * 240)
    assert cache_aware["hit_rate"] <= best + 1e-9
