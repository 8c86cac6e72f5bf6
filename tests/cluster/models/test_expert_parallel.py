"""MoE models under tensor, expert and DP-attention parallelism against the single-rank model.

The parent saves a tiny random Qwen3-MoE and a tiny DeepSeek-V2 (shared experts) to disk,
then starts the rank processes twice: 2 ranks running every two-rank scenario in turn, and 4
ranks running the DP-attention scenarios. For each scenario a rank joins the process groups
of its :class:`Topology` (gloo on loopback), builds the model with
``ParallelLayout.for_rank``, loads its shard with the ordinary loader and drives the paged
cache through a ragged prefill and greedy decode steps; it writes its logits. The parent runs
the same steps on the single-rank model.

Scenarios: Qwen3-MoE at tp=2 (MoE TP 2: each expert's intermediate dim split); tp=2 ep=2
with both token exchanges (``none``: all-reduce; ``deepep``: all-to-all, which on CPU is the
torch.distributed collective); ep=2 with 8 logical experts in 10 physical slots (2 redundant
copies: experts 0 and 1 on both ranks), both exchanges; tp=4 with DP attention 2 and ep=4
(attention TP 2 inside each DP rank), both exchanges, and tp=4 with DP attention 2 without
EP (MoE TP 4), the two DP ranks running different batches with idle steps (0 tokens) on
each, one of them in the first step; DeepSeek-V2 with shared experts at tp=2 (MoE TP 2) and
at ep=2, both exchanges.

Tolerance: atol 1e-4 on logits of magnitude up to ~6, float32. Every layout holds the same
weights; parallelism only changes the order of float32 sums (partial GEMMs over slices of the
expert width or the attention heads, partial expert sums per rank, the all-reduce, the
combine order of a token's k experts). We measure at most 7e-6 over all scenarios (MKL_CBWR,
ATEN_CPU_CAPABILITY, 1-3 threads; the same order as our model against HF). A pair computed
twice or missed, a wrong slot or a wrong weight slice moves logits by 1e-1 or more. Greedy
tokens must be identical: every token is chosen with a lead over the runner-up of more than
2 * ATOL (``helpers.margins.greedy_token``; the smallest is 1.3e-2). The closest routing
decision is 7e-5 apart in routing probability, against ~1e-6 of rounding (a few 1e-6 on
router logits, times p(1 - p) <= 1/4), so every layout routes every token alike. Besides, the
pairs each rank computes are counted, so work done twice (e.g. attention-TP ranks each
dispatching the same tokens) fails even though the logits would not show it.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from flotilla.cluster.eplb import ExpertPlacement, trivial_placement
from flotilla.cluster.models.base import ParallelLayout
from flotilla.cluster.models.moe_dispatch import (
    AllReduceDispatch,
    AllToAllDispatch,
    LocalDispatch,
    chunk_bounds,
    make_dispatcher,
    pack_rows,
    unpack_rows,
)
from flotilla.cluster.models.moe_layer import FusedMoE
from flotilla.cluster.topology import Topology
from helpers.margins import greedy_token
from helpers.ranks import free_port, run_ranks

ATOL = 1e-4
_COLLECTIVE_TIMEOUT_S = 30.0
_RANK_TIMEOUT_S = 150.0
_BLOCK_SIZE = 4
_TOP_K = 2  # num_experts_per_tok of both tiny models
_PROMPT_VOCAB = 128  # token ids valid in both tiny models

# name -> (model, topology sizes, moe_a2a_backend, redundant experts)
SCENARIOS = {
    "qwen-tp2": ("qwen", dict(world_size=2), "none", 0),
    "qwen-tp2-ep2-none": ("qwen", dict(world_size=2, ep=2), "none", 0),
    "qwen-tp2-ep2-a2a": ("qwen", dict(world_size=2, ep=2), "deepep", 0),
    "qwen-ep2-redundant-none": ("qwen", dict(world_size=2, ep=2), "none", 2),
    "qwen-ep2-redundant-a2a": ("qwen", dict(world_size=2, ep=2), "deepep", 2),
    "deepseek-tp2": ("deepseek", dict(world_size=2), "none", 0),
    "deepseek-ep2-none": ("deepseek", dict(world_size=2, ep=2), "none", 0),
    "deepseek-ep2-a2a": ("deepseek", dict(world_size=2, ep=2), "deepep", 0),
    "qwen-tp4-dp2": ("qwen", dict(world_size=4, dp=2), "none", 0),
    "qwen-tp4-dp2-ep4-none": ("qwen", dict(world_size=4, dp=2, ep=4), "none", 0),
    "qwen-tp4-dp2-ep4-a2a": ("qwen", dict(world_size=4, dp=2, ep=4), "deepep", 0),
}

# Per DP rank: prompt lengths and which steps it has tokens in (first active step prefills,
# later active steps decode one token per sequence; an inactive step runs with T == 0).
_PLAN_ONE_DP = {0: ((9, 1, 14, 4), (True,) * 5)}
_PLAN_TWO_DP = {
    0: ((9, 1, 14), (True, True, False, True, True, True)),
    1: ((6,), (False, True, True, False, True, True)),
}


def _plan(dp_size: int, dp_rank: int) -> tuple[list[list[int]], tuple[bool, ...]]:
    lengths, active = (_PLAN_ONE_DP if dp_size == 1 else _PLAN_TWO_DP)[dp_rank]
    generator = torch.Generator().manual_seed(1 + dp_rank)
    return [torch.randint(0, _PROMPT_VOCAB, (n,), generator=generator).tolist() for n in lengths], active


# --- the scenario, shared by the parent (one rank) and the rank processes ---------------------


def _meta(chunks, tables):
    from flotilla.kernels.attention import AttentionMetadata

    slots, query_start, seq_lens = [], [0], []
    for (start, count), blocks in zip(chunks, tables):
        slots += [blocks[p // _BLOCK_SIZE] * _BLOCK_SIZE + p % _BLOCK_SIZE for p in range(start, start + count)]
        query_start.append(query_start[-1] + count)
        seq_lens.append(start + count)
    width = max((len(b) for b in tables), default=1)
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.long),
        query_start=torch.tensor(query_start, dtype=torch.long),
        seq_lens=torch.tensor(seq_lens, dtype=torch.long),
        block_tables=torch.tensor(tables, dtype=torch.long).view(len(tables), width),
        max_query_len=max((c for _, c in chunks), default=0),
        max_seq_len=max(seq_lens, default=0),
        block_size=_BLOCK_SIZE,
    )


@torch.no_grad()
def _drive(model, prompts: list[list[int]], active) -> tuple[list[torch.Tensor], list[list[int]]]:
    """Run the steps of ``active``: the sequences' logits ``[T, V]`` of each active step, and
    each sequence's final tokens. An inactive step still runs the model with no tokens (an
    idle DP rank joins every collective)."""
    per_seq = -(-(max(map(len, prompts)) + len(active)) // _BLOCK_SIZE)
    caches = model.kv_cache_spec().allocate(len(prompts) * per_seq + 1, _BLOCK_SIZE)
    tables = [[b + i * len(prompts) + 1 for i in range(per_seq)] for b in range(len(prompts))]
    tokens = [[] for _ in prompts]
    new = [list(p) for p in prompts]
    step_logits = []
    for is_active in active:
        if not is_active:
            hidden = model(torch.empty(0, dtype=torch.long), torch.empty(0, dtype=torch.long), caches, _meta([], []))
            assert model.compute_logits(hidden).shape[0] == 0
            continue
        chunks = [(len(t), len(n)) for t, n in zip(tokens, new)]
        ids = torch.tensor([x for n in new for x in n])
        positions = torch.cat([torch.arange(s, s + c) for s, c in chunks])
        logits = model.compute_logits(model(ids, positions, caches, _meta(chunks, tables)))
        step_logits.append(logits)
        ends = torch.tensor([c for _, c in chunks]).cumsum(0) - 1
        for b in range(len(prompts)):
            tokens[b] += new[b]
        new = [[greedy_token(logits[e], 2 * ATOL)] for e in ends]
    return step_logits, [t + n for t, n in zip(tokens, new)]


def _load(model_dir: str, layout: ParallelLayout = ParallelLayout(), num_redundant: int = 0):
    from flotilla.cluster.models.base import ModelConfig
    from flotilla.cluster.models.loader import iter_hf_weights, read_hf_config
    from flotilla.cluster.models.registry import model_class

    hf = read_hf_config(model_dir)
    model = model_class(hf["architectures"][0])(ModelConfig(hf=hf, parallel=layout))
    if num_redundant:
        # NOTE: the placement seam (EPLB, elastic EP): set before the weights are loaded.
        for moe in model.modules():
            if isinstance(moe, FusedMoE):
                moe.set_placement(trivial_placement(moe.num_experts, layout.ep_size, num_redundant))
    loaded = model.load_weights(iter_hf_weights(model_dir))
    assert loaded == set(dict(model.named_parameters())), "every parameter must come from the checkpoint"
    return model


def _count_local_pairs(moe: FusedMoE) -> list[int]:
    """Count the (token, k) pairs ``moe`` computes on this rank (a one-item list, updated)."""
    count, compute = [0], moe.compute

    def counting(hidden, weights, slot_ids):
        count[0] += int((moe.expert_map[slot_ids] >= 0).sum())
        return compute(hidden, weights, slot_ids)

    moe.compute = counting
    return count


def _rank_main(rank: int, world_size: int, out_dir: str, model_dirs: dict[str, str], jobs: list[str]) -> None:
    """One rank process: every ``name:port`` job in turn, each in fresh process groups."""
    from flotilla.cluster import distributed

    torch.set_num_threads(1)
    for job in jobs:
        name, port = job.split(":")
        model_name, sizes, backend, redundant = SCENARIOS[name]
        topology = Topology.create(**sizes)
        comms = distributed.init_process_groups(topology, rank, int(port), _COLLECTIVE_TIMEOUT_S)
        try:
            layout = ParallelLayout.for_rank(topology, rank, comms, moe_a2a_backend=backend)
            model = _load(model_dirs[model_name], layout, redundant)
            moe = next(m for m in model.modules() if isinstance(m, FusedMoE))
            pairs = _count_local_pairs(moe)
            prompts, active = _plan(layout.dp_size, layout.dp_rank)
            logits, tokens = _drive(model, prompts, active)
            info = dict(
                dp_rank=layout.dp_rank,
                local_pairs=pairs[0],
                local_experts=moe.local_logical_experts,
                w13_shape=tuple(moe.w13.shape),
                dispatcher=type(moe.dispatcher).__name__,
            )
            torch.save({"logits": logits, "tokens": tokens, **info}, Path(out_dir) / f"{name}-rank{rank}.pt")
        finally:
            distributed.destroy()


# --- the parent -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    from helpers.tiny_deepseek import save_tiny_deepseek_v2
    from helpers.tiny_moe import save_tiny_qwen3_moe

    root = tmp_path_factory.mktemp("tiny-moe")
    save_tiny_qwen3_moe(root / "qwen")
    # Layer 0 dense, layers 1-2: 8 routed experts (top-2) plus 2 shared experts.
    save_tiny_deepseek_v2(
        root / "deepseek", num_hidden_layers=3, first_k_dense_replace=1, n_routed_experts=8, n_shared_experts=2
    )
    return {"qwen": str(root / "qwen"), "deepseek": str(root / "deepseek")}


def _launch(world_size: int, model_dirs, out_dir: Path) -> Path:
    names = [n for n, (_, sizes, _, _) in SCENARIOS.items() if sizes["world_size"] == world_size]
    jobs = [f"{name}:{free_port()}" for name in names]
    run_ranks(__file__, world_size, [out_dir, model_dirs["qwen"], model_dirs["deepseek"], *jobs], _RANK_TIMEOUT_S)
    return out_dir


@pytest.fixture(scope="module")
def two_rank_results(model_dirs, tmp_path_factory):
    return _launch(2, model_dirs, tmp_path_factory.mktemp("ep-two-ranks"))


@pytest.fixture(scope="module")
def four_rank_results(model_dirs, tmp_path_factory):
    return _launch(4, model_dirs, tmp_path_factory.mktemp("ep-four-ranks"))


@pytest.fixture(scope="module")
def references(model_dirs):
    """Single-rank (logits, tokens) by (model, dp_size, dp_rank): each DP rank's batch, run
    alone with its idle steps skipped."""
    torch.set_num_threads(1)
    out = {}
    for name, directory in model_dirs.items():
        model = _load(directory)
        for dp_size, plan in ((1, _PLAN_ONE_DP), (2, _PLAN_TWO_DP)):
            for dp_rank in plan:
                prompts, active = _plan(dp_size, dp_rank)
                out[name, dp_size, dp_rank] = _drive(model, prompts, [a for a in active if a])
    return out


def _check(name: str, results: Path, references) -> list[dict]:
    model_name, sizes, backend, _ = SCENARIOS[name]
    dp_size = sizes.get("dp", 1)
    got = [torch.load(results / f"{name}-rank{r}.pt") for r in range(sizes["world_size"])]
    for rank, result in enumerate(got):
        expected_logits, expected_tokens = references[model_name, dp_size, result["dp_rank"]]
        assert max(l.abs().max() for l in expected_logits) > 1.0  # not a comparison of near-zero logits
        assert len(result["logits"]) == len(expected_logits)
        for step, (actual, expected) in enumerate(zip(result["logits"], expected_logits)):
            where = f"rank {rank} step {step}"
            torch.testing.assert_close(actual, expected, atol=ATOL, rtol=0, msg=lambda m: f"{where}: {m}")
        assert result["tokens"] == expected_tokens, f"rank {rank}"
        assert result["dispatcher"] == ("AllReduceDispatch" if backend == "none" else "AllToAllDispatch")
    # Every pair of the first MoE layer is computed once per MoE-TP slice, by one EP rank: none
    # twice (attention-TP ranks hold the same tokens; the all-to-all splits them) and none missed.
    topology = Topology.create(**sizes)
    tokens = sum(
        sum(map(len, prompts)) + (sum(active) - 1) * len(prompts)
        for prompts, active in (_plan(dp_size, r) for r in range(dp_size))
    )
    assert sum(g["local_pairs"] for g in got) == _TOP_K * tokens * topology.moe_tp_size
    return got


def test_tp2_splits_each_expert_over_moe_tp(two_rank_results, references):
    """tp=2 without EP: MoE TP 2, every rank holds all 8 experts, half of each one's width."""
    got = _check("qwen-tp2", two_rank_results, references)
    assert [g["w13_shape"] for g in got] == [(8, 32, 64)] * 2  # 2 * (32 / 2) gate+up rows


@pytest.mark.parametrize("backend", ["none", "a2a"])
def test_tp2_ep2_matches_single_rank(two_rank_results, references, backend):
    got = _check(f"qwen-tp2-ep2-{backend}", two_rank_results, references)
    assert [g["local_experts"] for g in got] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert [g["w13_shape"] for g in got] == [(4, 64, 64)] * 2  # whole experts (MoE TP 1)


@pytest.mark.parametrize("backend", ["none", "a2a"])
def test_ep2_with_redundant_experts_matches_single_rank(two_rank_results, references, backend):
    """8 logical experts in 10 slots: experts 0 and 1 live on both ranks, and their tokens are
    split between the copies."""
    got = _check(f"qwen-ep2-redundant-{backend}", two_rank_results, references)
    assert [g["local_experts"] for g in got] == [[0, 1, 2, 3, 4], [5, 6, 7, 0, 1]]


def test_dp_attention_without_ep_gathers_tokens_for_moe_tp(four_rank_results, references):
    """tp=4, DP attention 2, no EP: MoE TP 4 (a quarter of every expert per rank) over the
    tokens of both DP ranks, gathered, idle steps included."""
    got = _check("qwen-tp4-dp2", four_rank_results, references)
    assert [g["w13_shape"] for g in got] == [(8, 16, 64)] * 4


@pytest.mark.parametrize("backend", ["none", "a2a"])
def test_dp_attention_with_idle_ranks_matches_single_rank(four_rank_results, references, backend):
    """tp=4, DP attention 2 (attention TP 2 each), ep=4: DP ranks with different token counts,
    each idle (0 tokens) in some steps, DP rank 1 from the first step."""
    got = _check(f"qwen-tp4-dp2-ep4-{backend}", four_rank_results, references)
    assert [g["dp_rank"] for g in got] == [0, 0, 1, 1]
    assert [g["local_experts"] for g in got] == [[0, 1], [2, 3], [4, 5], [6, 7]]


def test_deepseek_shared_experts_at_tp2(two_rank_results, references):
    got = _check("deepseek-tp2", two_rank_results, references)
    assert [g["w13_shape"] for g in got] == [(8, 32, 64)] * 2


@pytest.mark.parametrize("backend", ["none", "a2a"])
def test_deepseek_shared_experts_at_ep2(two_rank_results, references, backend):
    got = _check(f"deepseek-ep2-{backend}", two_rank_results, references)
    assert [g["local_experts"] for g in got] == [[0, 1, 2, 3], [4, 5, 6, 7]]


# --- the layer alone: placement -> slots -> weights --------------------------------------------

_E, _H, _I = 8, 16, 8


def _expert_weights(seed: int = 0) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    weights = {}
    for e in range(_E):
        for part in ("gate_proj", "up_proj"):
            weights[f"experts.{e}.{part}.weight"] = torch.randn(_I, _H, generator=generator) / _H**0.5
        weights[f"experts.{e}.down_proj.weight"] = torch.randn(_H, _I, generator=generator) / _I**0.5
    return weights


def _moe(weights, **layout) -> FusedMoE:
    redundant = layout.pop("num_redundant", 0)
    moe = FusedMoE(_E, 2, _H, _I, renormalize=True, parallel=ParallelLayout(**layout), num_redundant_experts=redundant)
    for name, tensor in weights.items():
        param_name, shard_id = FusedMoE.checkpoint_shard(name)
        param = getattr(moe, param_name)
        param.weight_loader(param, tensor, shard_id)
    return moe


def test_each_local_slot_loads_the_logical_expert_the_placement_names():
    weights = _expert_weights()
    for rank, expected in enumerate([[0, 1, 2, 3, 4], [5, 6, 7, 0, 1]]):
        moe = _moe(weights, ep_size=2, ep_rank=rank, num_redundant=2)
        assert moe.local_logical_experts == expected
        assert moe.expert_map.tolist() == trivial_placement(_E, 2, 2).local_expert_map(rank)
        for row, expert in enumerate(expected):
            gate, up = weights[f"experts.{expert}.gate_proj.weight"], weights[f"experts.{expert}.up_proj.weight"]
            assert torch.equal(moe.w13[row], torch.cat([gate, up]))
            assert torch.equal(moe.w2[row], weights[f"experts.{expert}.down_proj.weight"])


def test_moe_tp_rank_loads_its_slice_of_every_expert():
    weights = _expert_weights()
    moe = _moe(weights, tp_size=2, tp_rank=1, moe_tp_size=2, moe_tp_rank=1)
    half = _I // 2
    gate, up, down = (weights[f"experts.5.{p}.weight"] for p in ("gate_proj", "up_proj", "down_proj"))
    assert torch.equal(moe.w13[5], torch.cat([gate[half:], up[half:]]))
    assert torch.equal(moe.w2[5], down[:, half:])


def test_slots_follow_choose_replica():
    moe = _moe(_expert_weights(), ep_size=2, ep_rank=0, num_redundant=2)
    ids = torch.randint(0, _E, (13, 2), generator=torch.Generator().manual_seed(3))
    expected = trivial_placement(_E, 2, 2).dispatch_slots(ids.tolist())
    assert moe.slots_for(ids).tolist() == expected
    # Expert 0's consecutive rows alternate between its two copies (slots 0 and 8).
    assert moe.slots_for(torch.zeros(4, 1, dtype=torch.long)).view(-1).tolist() == [0, 8, 0, 8]
    assert moe.slots_for(torch.zeros(2, 1, dtype=torch.long), first_row=1).view(-1).tolist() == [8, 0]


def test_every_rank_and_slice_together_compute_the_single_rank_output():
    """The layer's local work (no collectives): summed over EP ranks (with redundant copies)
    and MoE-TP slices, each rank computing only its slots, it equals one rank's output.
    Tolerance 1e-5: float32 partial sums of O(1) values in a different order (~1e-7)."""
    weights = _expert_weights()
    x = torch.randn(11, _H, generator=torch.Generator().manual_seed(4))
    logits = torch.randn(11, _E, generator=torch.Generator().manual_seed(5))
    whole = _moe(weights)(x, logits)
    parts = []
    for ep_rank in range(2):
        for tp_rank in range(2):
            moe = _moe(weights, ep_size=2, ep_rank=ep_rank, moe_tp_size=2, moe_tp_rank=tp_rank, num_redundant=2)
            weights_k, ids = moe.route(logits)
            parts.append(moe.compute(x, weights_k, moe.slots_for(ids)))
    torch.testing.assert_close(sum(parts), whole, atol=1e-5, rtol=0)
    assert not torch.allclose(parts[0], whole, atol=1e-2)


def test_set_placement_keeps_unchanged_rows_and_reports_the_rest():
    weights = _expert_weights()
    moe = _moe(weights, ep_size=2, ep_rank=1)
    before = moe.w13.detach().clone()
    swapped = ExpertPlacement.from_phy2log([0, 1, 2, 3, 4, 7, 6, 5], num_logical=_E, ep_size=2)
    assert moe.set_placement(swapped) == [1, 3]  # rank 1's slots now hold 4, 7, 6, 5 (was 4..7)
    assert moe.local_logical_experts == [4, 7, 6, 5]
    assert torch.equal(moe.w13[0], before[0]) and torch.equal(moe.w13[2], before[2])
    assert moe.expert_map.tolist() == [-1, -1, -1, -1, 0, 1, 2, 3]
    assert moe.slots_for(torch.tensor([[5, 7]])).tolist() == [[7, 5]]
    grown = trivial_placement(_E, 2, 2)
    assert moe.set_placement(grown) == [0, 1, 2, 3, 4]  # 5 slots per rank: reallocated
    assert moe.w13.shape[0] == 5 and moe.expert_map.shape == (10,)
    with pytest.raises(ValueError, match="ep_size=4"):
        moe.set_placement(trivial_placement(_E, 4))


class _FakeComm:
    def __init__(self, size: int):
        self.size = size


def test_dispatcher_choice_and_unsupported_layouts():
    assert isinstance(make_dispatcher(ParallelLayout()), LocalDispatch)
    assert isinstance(make_dispatcher(ParallelLayout(tp_size=2, group=_FakeComm(2))), LocalDispatch)
    assert isinstance(make_dispatcher(ParallelLayout(ep_size=2, comms={"tp": _FakeComm(2)})), AllReduceDispatch)
    a2a = ParallelLayout(ep_size=2, moe_a2a_backend="deepep", comms={"tp": _FakeComm(2)})
    assert isinstance(make_dispatcher(a2a), AllToAllDispatch)
    with pytest.raises(NotImplementedError, match="moe_tp_size=2"):
        make_dispatcher(ParallelLayout(ep_size=2, moe_tp_size=2, moe_a2a_backend="deepep", comms={"tp": _FakeComm(4)}))
    with pytest.raises(NotImplementedError, match="moe_dp_size=2"):
        make_dispatcher(ParallelLayout(ep_size=2, comms={"tp": _FakeComm(4)}))


def test_byte_rows_round_trip_and_chunks_cover_the_rows():
    hidden = torch.randn(3, 4, dtype=torch.bfloat16)
    weights, ids = torch.rand(3, 2), torch.randint(0, 100, (3, 2))
    packed = pack_rows(hidden, weights, ids)
    assert packed.dtype == torch.uint8 and packed.shape == (3, 8 + 8 + 16)
    back = unpack_rows(packed, [(torch.bfloat16, (4,)), (torch.float32, (2,)), (torch.int64, (2,))])
    assert all(torch.equal(a, b) for a, b in zip(back, (hidden, weights, ids)))
    empty = unpack_rows(pack_rows(hidden[:0], ids[:0]), [(torch.bfloat16, (4,)), (torch.int64, (2,))])
    assert [tuple(t.shape) for t in empty] == [(0, 4), (0, 2)]
    for rows in (0, 1, 5, 8):
        bounds = [chunk_bounds(rows, 3, i) for i in range(3)]
        assert bounds[0][0] == 0 and bounds[-1][1] == rows
        assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))
        assert max(h - l for l, h in bounds) - min(h - l for l, h in bounds) <= 1


if __name__ == "__main__":
    # argv: rank, world_size, out_dir, qwen_dir, deepseek_dir, name:port... (helpers.ranks.run_ranks)
    _rank_main(
        int(sys.argv[1]),
        int(sys.argv[2]),
        sys.argv[3],
        {"qwen": sys.argv[4], "deepseek": sys.argv[5]},
        sys.argv[6:],
    )
