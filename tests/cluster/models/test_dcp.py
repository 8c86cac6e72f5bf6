"""Decode context parallelism in DeepSeek-V2 (MLA) over gloo against the single-rank model.

The parent saves tiny random-weight DeepSeek-V2 checkpoints (dense MLPs; one without and
one with ``q_lora_rank``) and runs a scenario on one rank: a ragged prefill (prompts of 1,
6 and 7 tokens: the 1-token prompt is shorter than dcp_size, so one rank's shard of it is
empty), then a step with decodes next to a second prefill chunk, then greedy decode steps,
over a shuffled paged cache with logical blocks of 4 tokens (2 per rank under dcp=2), so
every sequence crosses block boundaries. Rank processes (``helpers.ranks``) join gloo with
a topology of ``tp_size`` ranks and ``dcp_size`` 2, load their shard with the ordinary
loader and run the same scenario with the LOCAL caches (blocks of 2 rows); rank 0 writes
its logits.

Cases (one rank launch runs them all): tp=2 dcp=2 with ``ag_rs`` and with ``a2a``, for
both checkpoints; tp=2 without DCP as a baseline; and tp=4 dcp=2 (two DCP groups, so the
second group's heads start at head 2: the head offset of the gathered queries and of
``w_kc``/``w_vc`` is exercised).

Tolerance: atol 1e-4 in float32. Both sides hold the same weights; DCP only splits each
softmax over two shards and merges them by LSE, and TP reorders float32 sums, which moves
logits of size up to ~4 by up to 2e-6 (measured with MKL_CBWR, ATEN_CPU_CAPABILITY and 1-3
threads). A token on the wrong rank, a wrong true position in the causal mask, or a head of
the wrong group moves them by far more. Greedy tokens must be identical: every token is
chosen with a lead over the runner-up of more than 2 * ATOL (``helpers.margins.greedy_token``;
the smallest is 6.9e-3).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from helpers.ranks import free_port, run_ranks

ATOL = 1e-4
DCP = 2
LOGICAL_BLOCK = 4
_COLLECTIVE_TIMEOUT_S = 20.0
_RANK_TIMEOUT_S = 120.0
_PROMPTS = (1, 6, 7)
_SECOND_CHUNK = 5  # the 7-token prompt gets 5 more prompt tokens in step 2
_DECODE_STEPS = 4
CHECKPOINTS = {"v2-lite": None, "v2-q-lora": 24}


# --- the scenario, shared by the parent (one rank) and the rank processes ------------------


def _paged_scenario(model, vocab: int, dcp_size: int) -> tuple[list[torch.Tensor], list[list[int]]]:
    """Returns the logits of every step (``[T, V]``) and each sequence's tokens."""
    from helpers.margins import greedy_token
    from helpers.paged import build_meta

    num_seqs = len(_PROMPTS)
    max_len = max(_PROMPTS) + _SECOND_CHUNK + _DECODE_STEPS + 2
    per_seq = -(-max_len // LOGICAL_BLOCK)
    num_blocks = num_seqs * per_seq + 3
    order = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(0)).tolist()
    tables = [order[b * per_seq : (b + 1) * per_seq] for b in range(num_seqs)]
    caches = model.kv_cache_spec().allocate(num_blocks, LOGICAL_BLOCK // dcp_size)
    generator = torch.Generator().manual_seed(1)
    lengths = [n + (_SECOND_CHUNK if b == 2 else 0) for b, n in enumerate(_PROMPTS)]
    prompts = [torch.randint(0, vocab, (n,), generator=generator).tolist() for n in lengths]
    tokens: list[list[int]] = [[] for _ in range(num_seqs)]
    new = {b: prompts[b][:n] for b, n in enumerate(_PROMPTS)}
    step_logits = []
    for step in range(_DECODE_STEPS + 2):
        chunks = [(len(tokens[b]), len(new[b])) for b in range(num_seqs)]
        ids = [t for b in range(num_seqs) for t in new[b]]
        positions = torch.cat([torch.arange(s, s + n) for s, n in chunks])
        meta = build_meta(chunks, tables, LOGICAL_BLOCK)
        with torch.no_grad():
            logits = model.compute_logits(model(torch.tensor(ids), positions, caches, meta))
        step_logits.append(logits)
        ends = meta.query_start[1:].tolist()
        for b in range(num_seqs):
            tokens[b] += new[b]
            new[b] = [greedy_token(logits[ends[b] - 1], 2 * ATOL)]
        if step == 0:  # the third sequence is still prefilling: its next chunk, not a sample
            new[2] = prompts[2][_PROMPTS[2] :]
    return step_logits, tokens


def _build_model(model_dir: str, layout):
    from flotilla.cluster.models.base import ModelConfig
    from flotilla.cluster.models.loader import iter_hf_weights, read_hf_config
    from flotilla.cluster.models.registry import model_class

    hf = read_hf_config(model_dir)
    model = model_class(hf["architectures"][0])(ModelConfig(hf=hf, parallel=layout))
    model.load_weights(iter_hf_weights(model_dir))
    return model, int(hf["vocab_size"])


def _rank_main(rank: int, world_size: int, root: str, port: int, out_path: str) -> None:
    """One rank process: join gloo with dcp_size 2, run every case, rank 0 saves the logits."""
    from flotilla.cluster import distributed
    from flotilla.cluster.models.base import ParallelLayout
    from flotilla.cluster.topology import Topology

    torch.set_num_threads(1)
    topology = Topology(world_size, dcp_size=DCP)
    comms = distributed.init_process_groups(topology, rank, port, _COLLECTIVE_TIMEOUT_S)
    results = {}
    try:
        for name in CHECKPOINTS:
            model_dir = str(Path(root) / name)
            if world_size == 2:
                plain = ParallelLayout(tp_size=2, tp_rank=rank, group=comms["attn_tp"], comms=comms)
                results[(name, "tp-only")] = _paged_scenario(*_build_model(model_dir, plain), 1)
            for backend in ("ag_rs", "a2a"):
                layout = ParallelLayout.for_rank(topology, rank, comms, dcp_comm_backend=backend)
                model, vocab = _build_model(model_dir, layout)
                results[(name, backend)] = _paged_scenario(model, vocab, DCP)
        if rank == 0:
            torch.save(results, out_path)
    finally:
        distributed.destroy()


# --- the parent ---------------------------------------------------------------------------


def _expected(root: Path) -> dict[str, tuple[list[torch.Tensor], list[list[int]]]]:
    from flotilla.cluster.models.base import ParallelLayout
    from helpers.tiny_deepseek import save_tiny_deepseek_v2

    expected = {}
    for name, q_lora_rank in CHECKPOINTS.items():
        save_tiny_deepseek_v2(root / name, q_lora_rank=q_lora_rank)
        model, vocab = _build_model(str(root / name), ParallelLayout())
        expected[name] = _paged_scenario(model, vocab, 1)
        assert max(l.abs().max() for l in expected[name][0]) > 1.0  # not near-zero logits
    return expected


def _check(got, expected, label: str) -> None:
    logits, tokens = got
    assert len(logits) == len(expected[0])
    for step, (actual, want) in enumerate(zip(logits, expected[0])):
        assert actual.shape == want.shape, (label, step)
        torch.testing.assert_close(actual, want, atol=ATOL, rtol=0, msg=lambda m: f"{label} step {step}: {m}")
    assert tokens == expected[1], label


def test_tp2_dcp2_ag_rs_and_a2a_match_single_rank(tmp_path):
    expected = _expected(tmp_path)
    out_path = tmp_path / "rank0.pt"
    run_ranks(__file__, 2, [tmp_path, free_port(), out_path], _RANK_TIMEOUT_S)
    got = torch.load(out_path)
    assert set(got) == {(n, c) for n in CHECKPOINTS for c in ("tp-only", "ag_rs", "a2a")}
    for (name, comm), result in got.items():
        _check(result, expected[name], f"{name} tp=2 {comm}")


def test_tp4_dcp2_two_dcp_groups_match_single_rank(tmp_path):
    expected = _expected(tmp_path)
    out_path = tmp_path / "rank0.pt"
    run_ranks(__file__, 4, [tmp_path, free_port(), out_path], _RANK_TIMEOUT_S)
    for (name, comm), result in torch.load(out_path).items():
        _check(result, expected[name], f"{name} tp=4 dcp=2 {comm}")


class _NoCollectives:
    """A DCP communicator that must not be used."""

    size, rank = 2, 1

    def __getattr__(self, name):
        raise AssertionError(f"unexpected collective {name}")


def _attention(backend: str = "ag_rs", tp_rank: int = 3, dcp_rank: int = 1):
    from flotilla.cluster.models.base import ModelConfig, ParallelLayout
    from flotilla.cluster.models.deepseek import MLAttention
    from flotilla.cluster.models.moe_models import RotaryEmbedding
    from helpers.tiny_deepseek import TINY_DEEPSEEK_V2

    layout = ParallelLayout(
        tp_size=4, tp_rank=tp_rank, dcp_size=2, dcp_rank=dcp_rank, dcp_comm_backend=backend,
        comms={"dcp": _NoCollectives()},
    )
    rotary = RotaryEmbedding(TINY_DEEPSEEK_V2["qk_rope_head_dim"], 64, 10000.0, None, False)
    return MLAttention(ModelConfig(hf={**TINY_DEEPSEEK_V2, "q_lora_rank": None}, parallel=layout), rotary)


def test_dcp_attention_holds_its_groups_heads_and_names_bad_backends():
    attn = _attention()  # tp rank 3 = second DCP group, DCP rank 1: own head 3, group heads 2..3
    assert (attn.num_heads, attn.attn_heads, attn.attn_head_start) == (1, 2, 2)
    assert attn.w_kc.shape[0] == attn.w_vc.shape[0] == 2
    assert _attention("fi_a2a").dcp_exchange == "a2a"
    with pytest.raises(ValueError, match="dcp_comm_backend='bogus'"):
        _attention("bogus")


def test_dcp_attention_of_an_empty_batch_needs_no_collective():
    """An idle rank's empty step: the whole DCP group (one attention-TP batch) is empty."""
    from helpers.paged import build_meta

    attn = _attention()
    meta = build_meta([(0, 0)], [[0]], LOGICAL_BLOCK)
    empty = torch.zeros(0, 1, attn.nope_dim), torch.zeros(0, 1, attn.rope_dim)
    out = attn._attend_dcp(*empty, torch.zeros(0, attn.kv_lora_rank), torch.zeros(0, attn.rope_dim), None, meta)
    assert out.shape == (0, 1, attn.v_dim)


if __name__ == "__main__":
    # argv: rank, world_size, checkpoints root, port, out_path (see helpers.ranks.run_ranks)
    _rank_main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], int(sys.argv[4]), sys.argv[5])
