"""``placement``: which Ray resources pin each group of ranks to nodes, as a Serve config or
``serve run`` gives it, validated, and carried to the deployments' actors (the live side:
tests/serve/test_pd_live.py puts the two PD pools on two simulated nodes;
tests/cluster/engine/test_elastic_join.py lands elastic EP joiners on the second node).

``placement_strategy``: how each pool's worker groups lay their ranks over the nodes (PACK by
default), as ``serve run`` / a Serve config gives it, validated per mode, and carried to an
engine replica's worker group (whose two ranks then sit on the session's two simulated nodes;
tests/cluster/test_worker_group.py checks a spread group's tokens)."""

import asyncio

import pytest

from flotilla.resolution import ArgumentError, preset
from flotilla.serve.app import _placement_arg, _placement_strategy_arg, engine_deployment_options, parse_build_args
from flotilla.serve.engine_replica import EngineReplica
from flotilla.serve.plan import plan_serving, resolve_pool, serve_options
from flotilla.serve.types import ServeOptions
from helpers.nodes import NODE_A, NODE_B, node_holding
from helpers.tiny_models import save_tiny_llama


def test_placement_comes_as_yaml_mappings_or_json_text():
    want = {"prefill": {"prefill_nodes": 0.001}, "decode": {"decode_nodes": 0.001}}
    assert _placement_arg(want) == want
    assert _placement_arg('{"prefill": {"prefill_nodes": 0.001}, "decode": {"decode_nodes": 0.001}}') == want
    assert _placement_arg(None) == {}
    with pytest.raises(ArgumentError, match="placement must be a mapping .*got placement='prefill'"):
        _placement_arg("prefill")
    with pytest.raises(ArgumentError, match=r"placement must be a mapping of groups .*got placement=\[1\]"):
        _placement_arg([1])


@pytest.mark.parametrize(
    "placement, words",
    [
        ({"gpus": {"a": 1}}, "placement.gpus: unknown group 'gpus'"),
        ({"decode": {"GPU": 1}}, "placement.decode: 'GPU' is not a custom resource name"),
        ({"decode": {"decode_nodes": 0}}, "placement.decode.decode_nodes must be a positive number (got 0)"),
        ({"decode": ["decode_nodes"]}, "placement.decode must map Ray resource names to amounts"),
    ],
)
def test_a_bad_placement_names_the_key_and_value(placement, words):
    with pytest.raises(ValueError, match=words.replace("(", r"\(").replace(")", r"\)")):
        ServeOptions(placement=placement)


def test_each_pool_s_replica_actors_ask_for_their_group_s_resources():
    config, model = resolve_pool({"max_total_tokens": 1024})
    options = serve_options(config, model=model, placement={"engine": {"engine_nodes": 0.5}})
    actor = engine_deployment_options(config, options)["ray_actor_options"]
    assert actor["resources"] == {"engine_nodes": 0.5}
    unpinned = engine_deployment_options(config, serve_options(config, model=model))["ray_actor_options"]
    assert "resources" not in unpinned


# -- placement strategies ------------------------------------------------------------------


def test_placement_strategy_comes_as_a_strategy_a_mapping_or_json_text():
    assert parse_build_args({"placement_strategy": "spread"})[1] == {"placement_strategy": "spread"}
    assert _placement_strategy_arg("spread") == "spread"
    assert _placement_strategy_arg({"prefill": "SPREAD"}) == {"prefill": "SPREAD"}
    assert _placement_strategy_arg('{"prefill": "SPREAD", "decode": "PACK"}') == {"prefill": "SPREAD", "decode": "PACK"}
    assert _placement_strategy_arg(None) is None
    with pytest.raises(ArgumentError, match=r"placement_strategy must be a strategy, a mapping .*got placement_strategy='\{prefill'"):
        _placement_strategy_arg("{prefill")
    with pytest.raises(ArgumentError, match=r"a mapping of pools to strategies \(got placement_strategy=\['SPREAD'\]\)"):
        _placement_strategy_arg(["SPREAD"])


def test_every_pool_packs_unless_told_otherwise():
    config, model = resolve_pool({"max_total_tokens": 1024})
    assert ServeOptions().placement_strategy_for("engine") == "PACK"
    assert serve_options(config, model=model).placement_strategy == {"engine": "PACK"}
    assert serve_options(config, model=model, placement_strategy="spread").placement_strategy == {"engine": "SPREAD"}
    pd = serve_options(config, model=model, disaggregation_mode="pd", kv_transport="ray")
    assert pd.placement_strategy == {"prefill": "PACK", "decode": "PACK"}
    mixed = serve_options(
        config, model=model, disaggregation_mode="pd", kv_transport="ray", placement_strategy={"decode": "STRICT_SPREAD"}
    )
    assert mixed.placement_strategy == {"prefill": "PACK", "decode": "STRICT_SPREAD"}
    planned = plan_serving({"max_total_tokens": 1024}, platform=preset("cpu"), pd=True, kv_transport="ray", placement_strategy="SPREAD")
    assert planned.options.placement_strategy == {"prefill": "SPREAD", "decode": "SPREAD"}


@pytest.mark.parametrize(
    "strategy, mode, words",
    [
        ("tight", "null", "placement_strategy must be one of PACK, STRICT_PACK, SPREAD, STRICT_SPREAD (got placement_strategy='tight')"),
        ({"engine": "loose"}, "null", "got placement_strategy.engine='loose'"),
        ({"prefil": "PACK"}, "pd", "placement_strategy.prefil: unknown pool 'prefil'"),
        ({"joiners": "SPREAD"}, "null", "unknown pool 'joiners'; use one of ('engine', 'prefill', 'decode') (elastic EP joiners always PACK)"),
        ({"decode": "SPREAD"}, "null", "placement_strategy.decode='SPREAD': the prefill and decode pools exist only with disaggregation_mode pd"),
        ({"engine": "SPREAD"}, "pd", "placement_strategy.engine='SPREAD': with disaggregation_mode pd the pools are prefill and decode"),
        (3, "null", "placement_strategy must be a strategy for every pool or a mapping of pools"),
    ],
)  # fmt: skip
def test_a_bad_placement_strategy_names_the_key_and_value(strategy, mode, words):
    config, model = resolve_pool({"max_total_tokens": 1024})
    with pytest.raises(ValueError) as info:
        serve_options(config, model=model, disaggregation_mode=mode, kv_transport="ray", placement_strategy=strategy)
    assert words in str(info.value), str(info.value)


def test_serve_options_refuses_a_strategy_that_is_not_a_mapping_of_pools():
    with pytest.raises(ValueError, match=r"placement_strategy must map pools .*got placement_strategy='SPREAD'"):
        ServeOptions(placement_strategy="SPREAD")
    with pytest.raises(ValueError, match=r"got placement_strategy.decode='wide'"):
        ServeOptions(placement_strategy={"decode": "wide"})


def test_an_engine_replica_s_ranks_take_its_pool_s_strategy(ray_cluster, tmp_path):
    """A TP=2 engine replica (built without Serve) whose pool spreads strictly: its worker
    group's two ranks sit on the session's two nodes, and ``describe()`` says so."""
    save_tiny_llama(tmp_path)
    config, model = resolve_pool({"model_path": str(tmp_path), "tp_size": 2, "max_total_tokens": 512}, preset("cpu"))
    replica = EngineReplica(config, serve_options(config, model=model, placement_strategy="STRICT_SPREAD"), replica_id="spread")
    try:
        where = asyncio.run(replica.describe())
        assert where["placement_strategy"] == "STRICT_SPREAD" and where["tp_size"] == 2
        assert sorted(where["rank_nodes"]) == sorted([node_holding(NODE_A), node_holding(NODE_B)])
        assert where["rank_nodes"][0] != where["rank_nodes"][1]
    finally:
        replica.shutdown()
