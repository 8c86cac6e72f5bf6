"""Rank topology: group memberships, sizes and coverage for real resolved layouts, coordinate
round trips, and the seed handlers' layout invariants (SGLang's context-parallel and DP handlers)."""

import pytest

from flotilla.cluster.topology import GROUP_NAMES, RankCoords, Topology
from flotilla.resolution import ModelFacts, ServerArgs, preset, resolve
from helpers.resolution_configs import DEEPSEEK_V3_MLA, LLAMA_128K

LLAMA = {**LLAMA_128K, "head_dim": 128}
QWEN3_MOE = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe",
    "hidden_size": 2048,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "num_hidden_layers": 48,
    "intermediate_size": 6144,
    "moe_intermediate_size": 768,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "vocab_size": 151936,
    "max_position_embeddings": 40960,
    "head_dim": 128,
    "torch_dtype": "bfloat16",
}
# SmolLM2-135M's shape: 9 query heads over 3 KV heads, so TP=3 gives one KV head per rank.
SMOLLM2 = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "num_hidden_layers": 30,
    "vocab_size": 49152,
    "max_position_embeddings": 8192,
    "tie_word_embeddings": True,
}


def resolved(hf_config, **flags):
    return resolve(ServerArgs.create(**flags), ModelFacts.from_hf_config(hf_config), preset("h100"))


# (id, model config, server flags, expected sizes (world, attn_dp, attn_cp, attn_tp, dcp, ep, moe_dp, moe_tp))
LAYOUTS = [
    ("single", LLAMA, {}, (1, 1, 1, 1, 1, 1, 1, 1)),
    ("tp2", LLAMA, dict(tp_size=2), (2, 1, 1, 2, 1, 1, 1, 2)),
    ("tp3_smollm2", SMOLLM2, dict(tp_size=3), (3, 1, 1, 3, 1, 1, 1, 3)),
    ("tp4_dp2_attn", LLAMA, dict(tp_size=4, dp_size=2, enable_dp_attention=True), (4, 2, 1, 2, 1, 1, 1, 4)),
    ("tp8_cp2", LLAMA, dict(tp_size=8, attn_cp_size=2), (8, 1, 2, 4, 1, 1, 1, 8)),
    ("tp8_ep8", QWEN3_MOE, dict(tp_size=8, ep_size=8), (8, 1, 1, 8, 1, 8, 1, 1)),
    ("tp8_ep4", QWEN3_MOE, dict(tp_size=8, ep_size=4), (8, 1, 1, 8, 1, 4, 1, 2)),
    # NOTE: the seed only allows moe_dp_size > 1 together with attn_cp_size == moe_dp_size.
    ("tp8_cp2_ep4_moedp2", QWEN3_MOE, dict(tp_size=8, attn_cp_size=2, ep_size=4, moe_dp_size=2), (8, 1, 2, 4, 1, 4, 2, 1)),
    (
        "tp8_dp4_attn_ep8",
        QWEN3_MOE,
        dict(tp_size=8, dp_size=4, enable_dp_attention=True, ep_size=8),
        (8, 4, 1, 2, 1, 8, 1, 1),
    ),
    ("tp4_dcp2", DEEPSEEK_V3_MLA, dict(tp_size=4, dcp_size=2), (4, 1, 1, 4, 2, 1, 1, 4)),
    (
        "tp8_dp2_attn_dcp2",
        DEEPSEEK_V3_MLA,
        dict(tp_size=8, dp_size=2, enable_dp_attention=True, dcp_size=2),
        (8, 2, 1, 4, 2, 1, 1, 8),
    ),
]
IDS = [layout[0] for layout in LAYOUTS]


@pytest.fixture(params=LAYOUTS, ids=IDS, scope="module")
def layout(request):
    _, hf_config, flags, sizes = request.param
    return Topology.from_config(resolved(hf_config, **flags)), sizes


def test_sizes_come_from_the_resolved_config(layout):
    topo, expected = layout
    actual = (
        topo.world_size,
        topo.attn_dp_size,
        topo.attn_cp_size,
        topo.attn_tp_size,
        topo.dcp_size,
        topo.ep_size,
        topo.moe_dp_size,
        topo.moe_tp_size,
    )
    assert actual == expected


def test_every_group_kind_partitions_the_world(layout):
    topo, _ = layout
    size_of = {
        "tp": topo.world_size,
        "attn_tp": topo.attn_tp_size,
        "attn_cp": topo.attn_cp_size,
        "attn_dp": topo.attn_dp_size,
        "dcp": topo.dcp_size,
        "ep": topo.ep_size,
        "moe_tp": topo.moe_tp_size,
        "moe_dp": topo.moe_dp_size,
    }
    for name in GROUP_NAMES:
        groups = topo.groups(name)
        members = [rank for group in groups for rank in group]
        assert sorted(members) == list(range(topo.world_size)), name  # coverage and disjointness
        assert all(len(group) == size_of[name] for group in groups), name
        assert len(groups) == topo.world_size // size_of[name], name
        assert all(list(group) == sorted(group) for group in groups), name


def test_groups_agree_with_coordinates(layout):
    """Members of a group share every coordinate but the group's own, which runs 0..size-1."""
    topo, _ = layout
    varies = {
        "attn_tp": "attn_tp",
        "attn_cp": "attn_cp",
        "attn_dp": "attn_dp",
        "ep": "ep",
        "moe_tp": "moe_tp",
        "moe_dp": "moe_dp",
    }
    attention = ("attn_dp", "attn_cp", "attn_tp")
    moe = ("moe_dp", "ep", "moe_tp")
    for name, field in varies.items():
        view = attention if field in attention else moe
        for group in topo.groups(name):
            coords = [topo.coords(rank) for rank in group]
            assert [getattr(c, field) for c in coords] == list(range(len(group))), (name, group)
            for other in view:
                if other != field:
                    assert len({getattr(c, other) for c in coords}) == 1, (name, group, other)


def test_dcp_groups_are_consecutive_slices_of_attention_tp_groups(layout):
    topo, _ = layout
    for group in topo.dcp_groups:
        assert list(group) == list(range(group[0], group[0] + topo.dcp_size))
        (owner,) = [tp_group for tp_group in topo.attn_tp_groups if group[0] in tp_group]
        assert set(group) <= set(owner)
        assert [topo.coords(rank).dcp for rank in group] == list(range(topo.dcp_size))


def test_coordinates_round_trip_with_tp_fastest(layout):
    topo, _ = layout
    for rank in range(topo.world_size):
        c = topo.coords(rank)
        assert rank == (c.attn_dp * topo.attn_cp_size + c.attn_cp) * topo.attn_tp_size + c.attn_tp
        assert rank == (c.moe_dp * topo.ep_size + c.ep) * topo.moe_tp_size + c.moe_tp
        assert topo.attention_rank(c.attn_dp, c.attn_cp, c.attn_tp) == rank
        assert topo.moe_rank(c.moe_dp, c.ep, c.moe_tp) == rank
        assert c.dcp == c.attn_tp % topo.dcp_size


def test_groups_of_names_each_kind_and_holds_the_rank(layout):
    topo, _ = layout
    for rank in range(topo.world_size):
        groups = topo.groups_of(rank)
        assert tuple(groups) == GROUP_NAMES
        for name, group in groups.items():
            assert rank in group and group in topo.groups(name)


def test_tp_group_is_the_whole_engine_group(layout):
    topo, _ = layout
    assert topo.tp_groups == (tuple(range(topo.world_size)),)


# -- exact memberships for the layouts the acceptance runs on ------------------------------


def test_dp_attention_splits_attention_tp_and_keeps_moe_across_the_world():
    topo = Topology.from_config(resolved(LLAMA, tp_size=4, dp_size=2, enable_dp_attention=True))
    assert topo.attn_tp_groups == ((0, 1), (2, 3))
    assert topo.attn_dp_groups == ((0, 2), (1, 3))
    assert topo.attn_cp_groups == ((0,), (1,), (2,), (3,))
    assert topo.attn_dp_leaders == (0, 2)
    assert topo.coords(3) == RankCoords(attn_dp=1, attn_cp=0, attn_tp=1, moe_dp=0, ep=0, moe_tp=3, dcp=0)


def test_dp_without_dp_attention_is_replicas_outside_the_group():
    """dp_size > 1 with DP attention off counts independent replicas, not ranks of this group."""
    topo = Topology.from_config(resolved(LLAMA, tp_size=2, dp_size=2))
    assert (topo.world_size, topo.attn_dp_size, topo.attn_tp_size) == (2, 1, 2)


def test_context_parallel_interleaves_by_attention_tp():
    topo = Topology.create(world_size=8, attn_cp=2)
    assert topo.attn_tp_groups == ((0, 1, 2, 3), (4, 5, 6, 7))
    assert topo.attn_cp_groups == ((0, 4), (1, 5), (2, 6), (3, 7))


def test_expert_parallel_with_moe_tp_strides_by_moe_tp():
    topo = Topology.create(world_size=8, ep=4)
    assert topo.moe_tp_groups == ((0, 1), (2, 3), (4, 5), (6, 7))
    assert topo.ep_groups == ((0, 2, 4, 6), (1, 3, 5, 7))
    assert topo.moe_dp_groups == tuple((r,) for r in range(8))


def test_moe_dp_with_context_parallel():
    topo = Topology.create(world_size=8, attn_cp=2, ep=4, moe_dp=2)
    assert topo.ep_groups == ((0, 1, 2, 3), (4, 5, 6, 7))
    assert topo.moe_dp_groups == ((0, 4), (1, 5), (2, 6), (3, 7))
    assert topo.moe_dp_groups == topo.attn_cp_groups


def test_dcp_slices_within_dp_attention_blocks():
    topo = Topology.create(world_size=8, dp=2, dcp=2)
    assert topo.attn_tp_groups == ((0, 1, 2, 3), (4, 5, 6, 7))
    assert topo.dcp_groups == ((0, 1), (2, 3), (4, 5), (6, 7))
    assert [topo.coords(r).dcp for r in range(8)] == [0, 1, 0, 1, 0, 1, 0, 1]


def test_topology_is_a_hashable_value():
    assert Topology.create(world_size=4, dp=2) == Topology.create(world_size=4, dp=2)
    assert len({Topology.create(world_size=4, dp=2), Topology.create(world_size=4, dp=2)}) == 1
    with pytest.raises(AttributeError):
        Topology.create(world_size=2).world_size = 4


# -- invalid layouts -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "sizes, fragments",
    [
        (dict(world_size=6, attn_cp=4), ["attn_cp_size=4", "tp_size=6"]),
        (dict(world_size=6, dp=4), ["dp_size=4", "tp_size=6"]),
        (dict(world_size=8, dp=2, attn_cp=8), ["attn_cp_size=8", "dp_size=2"]),
        (dict(world_size=4, dcp=3), ["dcp_size=3", "attention TP size=4"]),
        (dict(world_size=4, dp=2, dcp=4), ["dcp_size=4", "attention TP size=2"]),
        (dict(world_size=4, ep=8), ["ep_size=8", "tp_size=4"]),
        (dict(world_size=6, ep=4), ["ep_size=4", "tp_size=6"]),
        (dict(world_size=8, ep=2, moe_dp=2, attn_cp=2), ["ep_size * moe_dp_size must equal", "ep_size=2"]),
        (dict(world_size=8, moe_dp=2), ["moe_dp_size=2", "attn_cp_size=1"]),
        (dict(world_size=0), ["world_size=0"]),
        (dict(world_size=2, ep=0), ["ep_size=0"]),
    ],
)
def test_invalid_layouts_name_the_sizes(sizes, fragments):
    with pytest.raises(ValueError) as info:
        Topology.create(**sizes)
    for fragment in fragments:
        assert fragment in str(info.value)


def test_pipeline_parallel_config_is_rejected():
    config = resolved(LLAMA, tp_size=2, pp_size=2)
    with pytest.raises(ValueError, match="pp_size=2"):
        Topology.from_config(config)


def test_out_of_range_ranks_and_coordinates_are_rejected():
    topo = Topology.create(world_size=4, dp=2)
    with pytest.raises(ValueError, match="rank=4"):
        topo.coords(4)
    with pytest.raises(ValueError, match="rank=-1"):
        topo.groups_of(-1)
    with pytest.raises(ValueError, match="attn_dp=2"):
        topo.attention_rank(2, 0, 0)
    with pytest.raises(ValueError, match="ep=1"):
        topo.moe_rank(0, 1, 0)
    with pytest.raises(ValueError, match="unknown group kind 'pp'"):
        topo.groups("pp")
