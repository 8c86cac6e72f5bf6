"""The cache-aware routers of several ingress replicas share their pool's prefix tree (a named
Ray actor on the session's cluster): a router that never saw a system prompt sends its users
where another router sent it, and spreads a new system prompt away from it. When the actor
is gone a router ranks from its own tree and finds (or makes) the actor again afterwards."""

import asyncio
import time
import uuid
from types import SimpleNamespace

from ray.serve._private.common import DeploymentHandleSource, DeploymentID, ReplicaID

from flotilla.cluster.engine.sampling_params import SamplingParams
from flotilla.serve.prefix_tree import block_keys
from flotilla.serve.router import CacheAwareRouter
from flotilla.serve.routing_policy import Candidate
from flotilla.serve.shared_prefix_tree import SLOW_BACKOFF_S, TREE_NAMESPACE, PrefixTreeService, SharedPrefixTree
from flotilla.serve.types import GenerateRequest, ReplicaLoad

BLOCK = 4
PREAMBLE = [1, 2, 3, 4]


def test_the_service_ranks_records_its_choice_and_forgets_a_replica():
    service = PrefixTreeService(BLOCK)
    policy = {"threshold": 0.5, "slack": 4, "factor": 2.0}
    candidates = [Candidate(tag, ReplicaLoad()) for tag in ("a", "b")]
    system_a, system_b = PREAMBLE + [10] * 8, PREAMBLE + [20] * 8
    first = service.rank(block_keys(system_a, BLOCK), candidates, policy)[0]
    # B holds 1 of 3 blocks where A went: it spreads; A's users follow A.
    second = service.rank(block_keys(system_b, BLOCK), candidates, policy)[0]
    assert {first, second} == {"a", "b"}
    assert service.rank(block_keys(system_a + [7] * 4, BLOCK), candidates, policy)[0] == first
    assert service.tree.size(first) == 4 and service.tree.size(second) == 3
    service.forget(first)
    assert service.tree.size(first) == 0


def _router(deployment, tree_name):
    router = CacheAwareRouter(deployment, DeploymentHandleSource.UNKNOWN)
    router.initialize_state(block_size=BLOCK, tree_name=tree_name)
    return router


def _call(request_id, tokens):
    return SimpleNamespace(
        args=[GenerateRequest(request_id, list(tokens), SamplingParams(max_tokens=1), 0.0)],
        kwargs={},
        metadata=SimpleNamespace(internal_request_id=request_id),
        routing_context=SimpleNamespace(should_backoff=False),
    )


def test_routers_of_two_ingress_replicas_agree_through_the_shared_tree(ray_cluster):
    import ray

    deployment = DeploymentID(name="engine", app_name="app")
    name = f"flotilla-prefix-tree-test-{uuid.uuid4().hex[:8]}"
    first, second = _router(deployment, name), _router(deployment, name)
    # NOTE: the routers started the actor; wait for it (a decision waits at most 0.25 s).
    ray.get(ray.get_actor(name, namespace=TREE_NAMESPACE).forget.remote("nobody"), timeout=60)
    replicas = [SimpleNamespace(replica_id=ReplicaID(tag, deployment), routing_stats={}) for tag in ("a", "b")]

    def choose(router, request_id, tokens):
        ranked = asyncio.run(router.choose_replicas(replicas, _call(request_id, tokens)))
        return ranked[0][0].replica_id.unique_id

    system_a, system_b = PREAMBLE + [10] * 8, PREAMBLE + [20] * 8
    where_a = choose(first, "q1", system_a)
    # The second router never saw system prompt A: B (1 of 3 blocks held where A went) spreads
    # to the other replica, and A's users follow A, whichever router they come through.
    where_b = choose(second, "q2", system_b)
    assert {where_a, where_b} == {"a", "b"}
    assert [choose(second, "q3", system_a + [7, 7]), choose(first, "q4", system_b + [8, 8])] == [where_a, where_b]
    assert first.tree.shared_views == 2 and second.tree.shared_views == 2
    # The actor is gone: a decision comes from the router's own tree (it knows A and B, as it
    # recorded them) and the router starts a fresh actor, which its next decisions use.
    ray.kill(ray.get_actor(name, namespace=TREE_NAMESPACE), no_restart=True)
    deadline = time.monotonic() + 30
    while _alive(name):  # NOTE: ray.kill returns before the actor is gone
        assert time.monotonic() < deadline, "the killed tree actor is still registered"
        time.sleep(0.05)
    assert choose(first, "q5", system_a + [9, 9]) == where_a
    assert first.tree.shared_views == 2
    ray.get(ray.get_actor(name, namespace=TREE_NAMESPACE).forget.remote("nobody"), timeout=60)
    choose(first, "q6", [50] * 8)
    assert first.tree.shared_views == 3


def _alive(name: str) -> bool:
    import ray

    try:
        ray.get_actor(name, namespace=TREE_NAMESPACE)
    except ValueError:
        return False
    return True


class _SlowActor:
    """A tree actor that never answers a ranking (it records inserts); counts the rankings asked."""

    def __init__(self):
        import concurrent.futures

        self.asked = 0
        outer = self

        class _Rank:
            def remote(self, *args):
                outer.asked += 1
                never = concurrent.futures.Future()  # NOTE: one per call: a timed-out wait cancels it
                return SimpleNamespace(future=lambda: never)

        self.rank = _Rank()
        self.insert = SimpleNamespace(remote=lambda *args: None)


def test_a_slow_shared_tree_is_skipped_for_a_while_after_a_timeout():
    now = [100.0]
    tree = SharedPrefixTree(None, BLOCK, clock=lambda: now[0])
    tree.name, tree._actor = "slow", _SlowActor()
    candidates = [Candidate("a"), Candidate("b")]
    policy = {"threshold": 0.5, "slack": 4, "factor": 2.0}
    blocks = tree.blocks(PREAMBLE * 3)

    def rank():
        started = time.monotonic()
        order = asyncio.run(tree.rank(blocks, candidates, policy))
        return order, time.monotonic() - started

    order, waited = rank()
    assert order and tree._actor.asked == 1 and waited >= 0.2  # NOTE: it waited VIEW_TIMEOUT_S (0.25 s)
    # Within the back-off no decision asks (or waits for) the slow tree.
    now[0] += SLOW_BACKOFF_S - 0.1
    order, waited = rank()
    assert order and tree._actor.asked == 1 and waited < 0.2
    # After it, the shared tree is asked again.
    now[0] += 0.2
    rank()
    assert tree._actor.asked == 2
