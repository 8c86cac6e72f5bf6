"""ResolvedConfig is frozen, hashable, and round-trips exactly through JSON."""

import json

import pytest

from flotilla.resolution import ModelFacts, ResolvedConfig, ServerArgs, preset, resolve

LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 512,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "num_hidden_layers": 2,
    "vocab_size": 1000,
    "max_position_embeddings": 2048,
}


@pytest.fixture(scope="module")
def resolved():
    args = ServerArgs.from_cli(["--tp", "2", "--cuda-graph-bs", "1", "2", "4"])
    return resolve(args, ModelFacts.from_hf_config(LLAMA), preset("h100"))


def test_json_round_trip_is_exact(resolved):
    text = resolved.to_json()
    again = ResolvedConfig.from_json(text)
    assert again == resolved
    assert again.to_json() == text
    assert hash(again) == hash(resolved)
    assert again.digest == resolved.digest


def test_config_is_frozen_and_reads_fields_as_attributes(resolved):
    assert resolved.tp_size == 2
    with pytest.raises(TypeError):
        resolved.config["tp_size"] = 4
    with pytest.raises(AttributeError):
        resolved.tp_size = 4
    with pytest.raises(AttributeError, match="no server field"):
        resolved.not_a_field


def test_to_dict_has_every_field_and_the_provenance_shape(resolved):
    data = resolved.to_dict()
    assert set(data) == {"config", "env", "provenance"}
    assert len(data["config"]) >= 450
    assert data["config"]["cuda_graph_bs_decode"] == [1, 2, 4]
    assert all({"field", "old", "new", "rule", "reason"} <= set(c) for c in data["provenance"])
    json.dumps(data)  # plain JSON types only


def test_same_inputs_give_equal_configs_and_different_inputs_differ():
    model = ModelFacts.from_hf_config(LLAMA)
    a = resolve(ServerArgs.from_cli(["--tp", "2"]), model, preset("h100"))
    b = resolve(ServerArgs.from_cli(["--tp", "2"]), model, preset("h100"))
    c = resolve(ServerArgs.from_cli(["--tp", "4"]), model, preset("h100"))
    assert a == b and a.digest == b.digest
    assert a.digest != c.digest
