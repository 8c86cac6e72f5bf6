"""WorkerGroup on a real local Ray cluster (loopback, CPU, gloo): the config broadcast,
one- and two-rank groups matching the in-process ModelRunner's greedy tokens on a tiny
random Llama, a TP=2 x EP=2 DeepSeek-V3 group whose ranks sit on the session's two simulated
nodes matching one rank, the placement strategies, and a killed rank turning into a bounded
WorkerGroupError (the ``ray_cluster`` fixture lives in tests/conftest.py)."""

import time

import pytest
import ray

from flotilla.cluster.engine.model_runner import ModelRunner
from flotilla.cluster.engine.request import Request
from flotilla.cluster.engine.sampler import SamplingRow
from flotilla.cluster.engine.sampling_params import SamplingParams
from flotilla.cluster.engine.scheduler import Scheduler, SchedulerConfig
from flotilla.cluster.group import WorkerGroup, WorkerGroupError
from flotilla.cluster.models.sources import resolve_model_source
from flotilla.cluster.worker import ConfigMismatchError, StepBatch, WorkerActor
from helpers.nodes import NODE_A, NODE_B, node_holding
from flotilla.resolution import ModelFacts, ServerArgs, preset, resolve
from helpers.tiny_deepseek import save_tiny_deepseek_v3
from helpers.tiny_models import save_tiny_llama

PROMPT = [11, 42, 7, 99, 3, 250, 17, 64, 5, 120]
V3_PROMPT = [5, 9, 17, 33, 2, 71, 100, 44, 12, 90]  # the tiny DeepSeek-V3 has 128 tokens
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
NUM_TOKENS = 16


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama")
    save_tiny_llama(path)
    return resolve_model_source(str(path))


def resolved(source, **flags):
    args = ServerArgs.create(model_path=str(source.path), max_total_tokens=512, **flags)
    return resolve(args, ModelFacts.from_hf_config(source.config_dict), preset("cpu"))


def greedy_tokens(execute, kv_layout, n=NUM_TOKENS, prompt=PROMPT):
    """Drive one greedy request through prefill and decodes with a real scheduler."""
    scheduler = Scheduler(
        SchedulerConfig(num_blocks=kv_layout.num_blocks, block_size=kv_layout.block_size, max_num_seqs=4, max_num_batched_tokens=64)
    )
    request = Request("r0", prompt, max_tokens=n)
    scheduler.add(request)
    while not request.reached_max_tokens:
        step = scheduler.schedule()
        sampling = [item.request for item in step.scheduled if item.samples]
        rows = [SamplingRow(GREEDY, r.all_token_ids, r.num_prompt_tokens) for r in sampling]
        tokens = execute(StepBatch(step, rows))
        scheduler.update(step, {r.request_id: t.token_id for r, t in zip(sampling, tokens)})
    return list(request.output_token_ids)


@pytest.fixture(scope="module")
def single_rank_tokens(source):
    runner = ModelRunner(resolved(source), source)
    return greedy_tokens(lambda s: runner.execute(s.schedule, s.rows), runner.kv_layout)


def test_config_is_broadcast_once_and_a_mismatched_digest_is_refused(ray_cluster, source):
    config = resolved(source)
    ref = ray.put(config)
    workers = [WorkerActor.options(num_cpus=0.1).remote(rank, 2, config.digest) for rank in range(2)]
    assert ray.get([w.accept_config.remote(ref) for w in workers], timeout=30) == [config.digest] * 2

    other = resolved(source, random_seed=1234)
    assert other.digest != config.digest
    stranger = WorkerActor.options(num_cpus=0.1).remote(0, 1, other.digest)
    with pytest.raises(ConfigMismatchError) as info:
        ray.get(stranger.accept_config.remote(ref), timeout=30)
    assert config.digest in str(info.value) and other.digest in str(info.value)
    for w in [*workers, stranger]:
        ray.kill(w)


def test_world_size_1_matches_in_process_runner(ray_cluster, source, single_rank_tokens):
    group = WorkerGroup(resolved(source), source, rpc_timeout_s=30)
    try:
        assert group.infos[0].digest == resolved(source).digest
        # The default strategy is PACK (one node when the group fits one).
        assert group.placement_strategy == "PACK"
        assert ray.util.placement_group_table(group.placement)["strategy"] == "PACK"
        assert greedy_tokens(group.execute, group.kv_layout) == single_rank_tokens
    finally:
        group.shutdown()


@pytest.mark.parametrize("compiled", [False, True], ids=["actor-calls", "compiled-steps"])
def test_world_size_2_matches_world_size_1(ray_cluster, source, single_rank_tokens, compiled):
    # NOTE: pinned to the session's second simulated node: rank 0 hosts the rendezvous there,
    # and the TP group packs onto that one node.
    group = WorkerGroup(
        resolved(source, tp_size=2), source, rpc_timeout_s=30, bundle_resources={NODE_B: 1}, compiled_steps=compiled
    )
    try:
        assert (group.compiled_off is None) == compiled, group.compiled_off
        assert group.call("node_id") == group.rank_nodes() == [node_holding(NODE_B)] * 2
        # Each rank holds one of the two KV heads: half the single-rank cache bytes per token.
        assert group.kv_layout.bytes_per_token * 2 == ModelRunner(resolved(source), source).kv_layout.bytes_per_token
        assert greedy_tokens(group.execute, group.kv_layout) == single_rank_tokens
    finally:
        group.shutdown()


@pytest.fixture(scope="module")
def tiny_v3(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-deepseek-v3")
    save_tiny_deepseek_v3(path)
    return resolve_model_source(str(path))


def test_tp2_ep2_ranks_on_two_nodes_match_a_single_rank(ray_cluster, tiny_v3):
    """STRICT_SPREAD puts the two ranks of a TP=2 x EP=2 DeepSeek-V3 group (MLA heads split
    over TP, four of the eight routed experts per rank, tokens dispatched to their experts'
    rank by all-to-all) on the session's two simulated nodes: rank 0 hosts the rendezvous at
    its node's address and the other rank meets it from the other node. The greedy tokens are
    the in-process single rank's."""
    single = ModelRunner(resolved(tiny_v3), tiny_v3)
    want = greedy_tokens(lambda s: single.execute(s.schedule, s.rows), single.kv_layout, prompt=V3_PROMPT)
    config = resolved(tiny_v3, tp_size=2, ep_size=2, moe_a2a_backend="deepep")
    group = WorkerGroup(config, tiny_v3, rpc_timeout_s=60, placement_strategy="strict_spread")
    try:
        assert group.placement_strategy == "STRICT_SPREAD"
        assert ray.util.placement_group_table(group.placement)["strategy"] == "STRICT_SPREAD"
        nodes = group.rank_nodes()
        assert sorted(nodes) == sorted([node_holding(NODE_A), node_holding(NODE_B)]) and nodes[0] != nodes[1]
        assert group.call("node_id") == nodes
        assert greedy_tokens(group.execute, group.kv_layout, prompt=V3_PROMPT) == want
    finally:
        group.shutdown()


def test_a_placement_the_cluster_cannot_grant_names_the_strategy(ray_cluster, source):
    """Four ranks, each on its own node, on a cluster of two nodes: no placement, reported
    within the bound with the strategy and what it needs."""
    start = time.monotonic()
    with pytest.raises(WorkerGroupError, match=r"no STRICT_SPREAD placement for 4 bundles .*fewer nodes with room than ranks"):
        WorkerGroup(resolved(source, tp_size=4), source, rpc_timeout_s=3, placement_strategy="STRICT_SPREAD")
    assert time.monotonic() - start < 15


@pytest.mark.parametrize("strategy", ["TIGHT", "", None, 1])
def test_a_bad_placement_strategy_names_the_parameter_and_value(source, strategy):
    with pytest.raises(ValueError) as info:
        WorkerGroup(resolved(source), source, placement_strategy=strategy)
    message = str(info.value)
    assert f"placement_strategy={strategy!r}" in message and "PACK, STRICT_PACK, SPREAD, STRICT_SPREAD" in message, message


@pytest.mark.parametrize("compiled", [False, True], ids=["actor-calls", "compiled-steps"])
def test_killed_rank_is_reported_within_the_timeout(ray_cluster, source, compiled):
    group = WorkerGroup(
        resolved(source, tp_size=2), source, rpc_timeout_s=15, collective_timeout_s=5, compiled_steps=compiled
    )
    try:
        assert (group.compiled_off is None) == compiled, group.compiled_off
        ray.kill(group.actors[1], no_restart=True)
        start = time.monotonic()
        with pytest.raises(WorkerGroupError) as info:
            greedy_tokens(group.execute, group.kv_layout, n=2)
        assert time.monotonic() - start < 20
        assert info.value.rank == 1 and "rank 1" in str(info.value), str(info.value)
        # The group stays broken: the next step fails at once with the same error.
        with pytest.raises(WorkerGroupError, match="rank 1"):
            group.execute(None)
    finally:
        group.shutdown()


def test_compiled_steps_serve_other_calls_between_steps_and_break_on_a_rank_error(ray_cluster, source, single_rank_tokens):
    group = WorkerGroup(resolved(source, tp_size=2), source, rpc_timeout_s=30, compiled_steps=True)
    try:
        assert group.compiled_off is None
        seen = []

        def execute(step):
            tokens = group.execute(step)
            # NOTE: a plain actor call between compiled steps (the ranks' main threads answer it).
            seen.append([stats["steps"] for stats in group.call("step_stats")])
            return tokens

        assert greedy_tokens(execute, group.kv_layout) == single_rank_tokens
        assert seen[-1] == [len(seen)] * 2
        # A step no rank can run: every rank raises, the group breaks with the ranks' error.
        with pytest.raises(WorkerGroupError, match="a rank raised while trying to execute a step: AttributeError"):
            group.execute(StepBatch(None, ()))
        with pytest.raises(WorkerGroupError, match="AttributeError"):
            group.execute(StepBatch(None, ()))
    finally:
        group.shutdown()


def test_cpu_groups_step_through_actor_calls_by_default(ray_cluster, source, monkeypatch):
    monkeypatch.delenv("FLOTILLA_COMPILED_STEPS", raising=False)
    group = WorkerGroup(resolved(source), source, rpc_timeout_s=30)
    try:
        assert "CPU group" in group.compiled_off
    finally:
        group.shutdown()


def test_when_steps_go_through_a_compiled_graph(monkeypatch):
    from flotilla.cluster.compiled_steps import compiled_steps_off_reason

    monkeypatch.delenv("FLOTILLA_COMPILED_STEPS", raising=False)
    assert compiled_steps_off_reason(on_gpu=True) is None
    assert "CPU group" in compiled_steps_off_reason(on_gpu=False)
    assert compiled_steps_off_reason(on_gpu=False, requested=True) is None
    assert "turned off" in compiled_steps_off_reason(on_gpu=True, requested=False)
    monkeypatch.setenv("FLOTILLA_COMPILED_STEPS", "0")
    assert compiled_steps_off_reason(on_gpu=True) == "FLOTILLA_COMPILED_STEPS=0"
    monkeypatch.setenv("FLOTILLA_COMPILED_STEPS", "1")
    assert compiled_steps_off_reason(on_gpu=False) is None
    monkeypatch.setenv("FLOTILLA_COMPILED_STEPS", "yes")
    with pytest.raises(ValueError, match="FLOTILLA_COMPILED_STEPS='yes'"):
        compiled_steps_off_reason(on_gpu=True)


def test_worker_group_error_pickles():
    import pickle

    error = pickle.loads(pickle.dumps(WorkerGroupError(1, "its actor died")))
    assert error.rank == 1 and str(error) == "rank 1 failed: its actor died"
