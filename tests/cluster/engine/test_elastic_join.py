"""Elastic EP joins on a live Ray worker group (CPU, gloo, loopback), below the serving layer.

A tiny Qwen3-MoE engine in the elastic layout (``--elastic-ep-backend ray --max-ep-size 2``,
DP attention at one rank) grows to EP 2 between two steps while requests are in flight:

- every request, in flight across the commit or added after it, gets exactly the greedy
  tokens an engine that never grew gives (the oracle: the same engine before any join);
- requests added after the commit are routed to the new DP rank, whose worker runs
  non-empty steps; the running rank loaded no weights (its expert rows are unchanged);
- a joiner killed between loading and the commit, or a commit that cannot rendezvous,
  leaves the engine serving at its old size with the joiners gone.

The running rank is pinned to the session's first simulated node and joiners to the second
(``LLMEngine(placement=...)``), so the grown group spans two Ray nodes.
"""

from __future__ import annotations

import threading
import time

import pytest
import ray

from flotilla import SamplingParams
from flotilla.cluster.elastic import ElasticJoinError
from flotilla.cluster.eplb import ExpertPlacement
from flotilla.cluster.engine.dp_scheduler import DPScheduler
from flotilla.cluster.engine.group_runner import GroupRunner
from flotilla.cluster.engine.llm_engine import LLMEngine
from flotilla.cluster.models.sources import resolve_model_source
from flotilla.cluster.platform import probe
from flotilla.resolution import ModelFacts, ServerArgs, resolve
from flotilla.serve.plan import joiner_fields
from helpers.elastic_live import ELASTIC
from helpers.nodes import NODE_A, NODE_B, node_holding
from helpers.prompts import random_prompts
from helpers.tiny_moe import save_tiny_qwen3_moe

NEW_TOKENS = 24
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
FLAGS = dict(
    ELASTIC, max_total_tokens=1024, disable_radix_cache=True, expert_distribution_recorder_mode="stat",
    # NOTE: bounds a rendezvous with a dead peer (the commit's worst case) to keep the tests short.
    dist_timeout=20,
)
JOIN_TIMEOUT_S = 120.0


def _config(path: str, **flags):
    source = resolve_model_source(path)
    args = ServerArgs.create(model_path=path, **{**FLAGS, **flags})
    return resolve(args, ModelFacts.from_hf_config(source.config_dict), probe()), source


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-qwen3-moe-elastic")
    save_tiny_qwen3_moe(path)
    config, source = _config(str(path))
    joiner, _ = _config(str(path), **joiner_fields({}, current=1, new=2, initial=1))
    return config, joiner, source, random_prompts((5, 17, 40, 9, 23, 12), 256)


def _run(engine: LLMEngine, prompts, ids) -> dict[str, list[int]]:
    for rid, prompt in zip(ids, prompts):
        engine.add_request(prompt, GREEDY, request_id=rid)
    while engine.has_unfinished_requests():
        engine.step()
    return {rid: engine.get_output(rid).outputs[0].token_ids for rid in ids}


@pytest.fixture(scope="module")
def engine(ray_cluster, model):
    config, _, source, _ = model
    engine = LLMEngine(config, source, placement={"ranks": {NODE_A: 1}, "joiners": {NODE_B: 1}})
    yield engine
    engine.runner.shutdown()


@pytest.fixture(scope="module")
def oracle(engine, model):
    """Greedy tokens of every prompt from the engine at EP 1 (before any join)."""
    prompts = model[3]
    return _run(engine, prompts, [f"oracle-{i}" for i in range(len(prompts))])


def test_elastic_engine_starts_as_a_growable_one_rank_group(engine):
    assert isinstance(engine.runner, GroupRunner) and isinstance(engine.scheduler, DPScheduler)
    assert (engine.runner.ep_size, engine.runner.dp_size, engine.scheduler.dp_size) == (1, 1, 1)


def _wait_until_dead(actor, timeout_s: float = 30.0) -> None:
    """Block until ``actor`` (just ``ray.kill``-ed) fails its calls. NOTE: ray.kill is asynchronous:
    a call sent right after it can still be served by the live actor."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            ray.get(actor.ping.remote(), timeout=timeout_s)
        except ray.exceptions.RayActorError:
            return
        assert time.monotonic() < deadline, "the killed actor still answers its calls"
        time.sleep(0.1)


def test_a_joiner_killed_before_the_commit_leaves_the_old_size(engine, model, oracle):
    _, joiner_config, _, prompts = model
    joiners = engine.runner.prepare_join(joiner_config, 2, JOIN_TIMEOUT_S)
    joiner = joiners.actors[0]
    ray.kill(joiner, no_restart=True)
    _wait_until_dead(joiner)
    with pytest.raises(ElasticJoinError, match="joining rank 1"):
        engine.commit_elastic_join(joiners)
    assert (engine.runner.ep_size, engine.scheduler.dp_size) == (1, 1)
    assert joiners.actors == [] and joiners.placement is None
    # Still serving, with the same tokens.
    assert _run(engine, prompts[:2], ["after-kill-0", "after-kill-1"]) == {
        "after-kill-0": oracle["oracle-0"], "after-kill-1": oracle["oracle-1"]
    }


def test_a_commit_that_fails_after_the_rendezvous_rolls_back_to_the_old_world(engine, model, oracle):
    """Every rank joined the grown world, then adopting the placements failed: the running rank
    goes back to its old world and placements, the joiner is dropped, serving goes on."""
    _, joiner_config, _, prompts = model
    before = engine.runner.group.call("expert_placements")[0]
    joiners = engine.runner.prepare_join(joiner_config, 2, JOIN_TIMEOUT_S)
    layer, grown = next(iter(joiners.placements.items()))
    # A grown placement that moves rank 0's slots (its experts in reverse order): every rank
    # refuses it after the rendezvous.
    moved = list(reversed(grown.phy2log[: grown.slots_per_rank])) + list(grown.phy2log[grown.slots_per_rank :])
    joiners.placements = {**joiners.placements, layer: ExpertPlacement.from_phy2log(moved, grown.num_logical, 2)}
    with pytest.raises(ElasticJoinError, match="moves the experts of EP rank .*the group kept its 1 ranks"):
        engine.commit_elastic_join(joiners)
    assert (engine.runner.ep_size, engine.scheduler.dp_size) == (1, 1) and joiners.actors == []
    assert engine.runner.group.call("expert_placements")[0] == before
    assert _run(engine, prompts[2:4], ["rolled-back-2", "rolled-back-3"]) == {
        "rolled-back-2": oracle["oracle-2"], "rolled-back-3": oracle["oracle-3"]
    }


def test_growth_beyond_max_ep_size_is_refused(engine, model):
    with pytest.raises(ElasticJoinError, match="new_ep_size=3 exceeds max_ep_size=2"):
        engine.runner.prepare_join(model[1], 3, JOIN_TIMEOUT_S)


def test_grow_to_ep2_mid_generation_keeps_every_greedy_token(engine, model, oracle):
    _, joiner_config, _, prompts = model
    before = engine.runner.group.call("expert_placements")[0]
    # Half the prompts start at EP 1 and run a few steps ...
    first = [f"inflight-{i}" for i in range(3)]
    for rid, prompt in zip(first, prompts[:3]):
        engine.add_request(prompt, GREEDY, request_id=rid)
    for _ in range(4):
        engine.step()
    # ... the joiners load from another thread while the engine keeps stepping ...
    prepared: dict = {}
    loader = threading.Thread(target=lambda: prepared.update(j=engine.runner.prepare_join(joiner_config, 2, JOIN_TIMEOUT_S)))
    loader.start()
    steps_while_loading = 0
    # NOTE: a bounded number of steps, so the in-flight requests are still running at the commit.
    while loader.is_alive() and steps_while_loading < 8:
        engine.step()
        steps_while_loading += 1
    loader.join(timeout=JOIN_TIMEOUT_S)
    assert steps_while_loading > 0
    assert "j" in prepared, "prepare_join failed (see the thread's traceback)"
    assert all(len(engine.get_output(rid).outputs[0].token_ids) < NEW_TOKENS for rid in first), "finished before the commit"
    # ... and the commit lands between two steps.
    engine.commit_elastic_join(prepared["j"])
    assert (engine.runner.ep_size, engine.runner.dp_size, engine.scheduler.dp_size) == (2, 2, 2)
    second = [f"after-{i}" for i in range(3, 6)]
    for rid, prompt in zip(second, prompts[3:]):
        engine.add_request(prompt, GREEDY, request_id=rid)
    assert {engine.dp_rank_of(rid) for rid in first} == {0}
    assert 1 in {engine.dp_rank_of(rid) for rid in second}
    while engine.has_unfinished_requests():
        engine.step()
    got = {rid: engine.get_output(rid).outputs[0].token_ids for rid in first + second}
    want = {rid: oracle[f"oracle-{rid.split('-')[1]}"] for rid in first + second}
    assert got == want
    assert engine.runner.group.call("node_id") == [node_holding(NODE_A), node_holding(NODE_B)]
    stats = engine.runner.group.call("step_stats")
    assert stats[1]["steps"] > stats[1]["empty_steps"], f"the new rank never ran a batch: {stats}"
    after = engine.runner.group.call("expert_placements")
    for layer, placement in before.items():
        grown = after[0][layer]
        assert grown.ep_size == 2 and grown.phy2log[: placement.num_physical] == placement.phy2log
        assert after[1][layer] == grown
    # Everything the grown engine serves is still the oracle's.
    assert _run(engine, prompts, [f"grown-{i}" for i in range(len(prompts))]) == {
        f"grown-{i}": oracle[f"oracle-{i}"] for i in range(len(prompts))
    }
