"""``--load-format dummy``: deterministic random weights, the same full tensors on every rank.

A tensor-parallel group must hold exactly the one-rank model's weights (the GPU TP benchmark
compares greedy tokens across layouts on a config-only Llama-3.1-8B shape), so each rank's
shard must equal the matching slice of the one-rank parameter, bit for bit.
"""

import json

import pytest
import torch

from flotilla.cluster.models.base import ParallelLayout
from flotilla.cluster.models.sources import load_model, resolve_model_source

CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_hidden_layers": 2,
    "vocab_size": 255,
    "max_position_embeddings": 256,
    "initializer_range": 0.2,
}


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    path = tmp_path_factory.mktemp("config-only")
    (path / "config.json").write_text(json.dumps(CONFIG))
    return resolve_model_source(str(path))


def test_dummy_weights_are_deterministic_and_shaped_like_the_checkpoint(source):
    first = load_model(source, load_format="dummy").state_dict()
    second = load_model(source, load_format="dummy").state_dict()
    assert first.keys() == second.keys()
    assert all(torch.equal(first[k], second[k]) for k in first)
    embed = first["model.embed_tokens.weight"]
    # normal(0, initializer_range): the sample std of 255x64 draws is within a few % of 0.2.
    assert embed.std().item() == pytest.approx(0.2, rel=0.05)
    assert torch.equal(first["model.norm.weight"], torch.ones(64))


def test_each_tensor_parallel_shard_is_a_slice_of_the_one_rank_weights(source):
    full = load_model(source, load_format="dummy").state_dict()
    for rank in range(2):
        shard = load_model(source, load_format="dummy", parallel=ParallelLayout(tp_size=2, tp_rank=rank)).state_dict()
        down = "model.layers.1.mlp.down_proj.weight"  # row-parallel: input columns split
        assert torch.equal(shard[down], full[down][:, rank * 64 : (rank + 1) * 64])
        gate_up = "model.layers.0.mlp.gate_up_proj.weight"  # [gate; up], each split by rows
        gate, up = full[gate_up].split(128)
        expected = torch.cat([gate[rank * 64 : (rank + 1) * 64], up[rank * 64 : (rank + 1) * 64]])
        assert torch.equal(shard[gate_up], expected)


def test_an_unsupported_load_format_is_named(source):
    with pytest.raises(ValueError, match="load_format='npcache'"):
        load_model(source, load_format="npcache")
