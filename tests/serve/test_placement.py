"""``placement``: which Ray resources pin each group of ranks to nodes, as a Serve config or
``serve run`` gives it, validated, and carried to the deployments' actors (the live side:
tests/serve/test_pd_live.py puts the two PD pools on two simulated nodes;
tests/cluster/engine/test_elastic_join.py lands elastic EP joiners on the second node)."""

import pytest

from flotilla.resolution import ArgumentError
from flotilla.serve.app import _placement_arg, engine_deployment_options
from flotilla.serve.plan import resolve_pool, serve_options
from flotilla.serve.types import ServeOptions


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
