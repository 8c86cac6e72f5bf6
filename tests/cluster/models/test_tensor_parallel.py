"""Tensor-parallel dense decoders over gloo against the single-rank model.

The parent builds a tiny random-weight HF model, saves it once with
``save_pretrained`` (safetensors), and runs a scenario at tp=1: a ragged prefill
of four prompts through the paged cache, then greedy decode steps. It then starts
``tp`` copies of this file as rank processes on loopback; each joins a gloo group,
builds the model with its ``ParallelLayout``, loads its shard with the ordinary
loader and runs the same scenario. Rank 0 writes its logits to a file.

Cases: Llama at tp=2 (4 q / 2 KV heads, a vocabulary that does not divide by 2, so
the padded last vocab shard is exercised); Qwen3 at tp=2 with one KV head
(replicated on both ranks) and tied embeddings; a SmolLM2-shaped Llama with 9 q /
3 KV heads at tp=3.

Tolerance: atol 1e-4 in float32. Both sides hold the same weights; tensor
parallelism only changes the order of float32 sums (each rank's partial GEMM over
its slice of the reduced dimension, then the all-reduce), which moves logits of
size up to ~60 by up to 1.5e-5 (measured with MKL_CBWR, ATEN_CPU_CAPABILITY and 1-3
threads). A wrong head, KV-replica or vocab-shard mapping moves them by far more.
Greedy tokens must be identical: every token is chosen with a lead over the runner-up
of more than 2 * ATOL (``helpers.margins.greedy_token``; the smallest is 7.8e-3), so a
choice cannot flip while the logits agree within ATOL.

Every wait is bounded: gloo collectives time out, and the rank processes are
killed when they do not finish in time, so a failing rank cannot hang the test.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import torch

from helpers.ranks import free_port, run_ranks

ATOL = 1e-4
_COLLECTIVE_TIMEOUT_S = 20.0
_RANK_TIMEOUT_S = 90.0
_PROMPT_LENGTHS = (9, 1, 14, 4)
_DECODE_STEPS = 4


# --- the scenario, shared by the parent (tp=1) and the rank processes --------------


def _paged_scenario(model, vocab: int) -> tuple[list[torch.Tensor], list[list[int]]]:
    """Ragged prefill then greedy decode steps over a shuffled paged cache.

    Returns the logits of every step (``[T, V]``, sequences in order) and each
    sequence's final tokens.
    """
    from flotilla.kernels.attention import AttentionMetadata
    from helpers.margins import greedy_token

    block_size, num_seqs = 4, len(_PROMPT_LENGTHS)
    max_len = max(_PROMPT_LENGTHS) + _DECODE_STEPS + 1
    blocks_per_seq = -(-max_len // block_size)
    num_blocks = num_seqs * blocks_per_seq + 3
    order = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(0))
    block_tables = order[: num_seqs * blocks_per_seq].view(num_seqs, blocks_per_seq)
    kv_caches = model.kv_cache_spec().allocate(num_blocks, block_size)
    generator = torch.Generator().manual_seed(1)
    tokens: list[list[int]] = [[] for _ in range(num_seqs)]
    new = {b: torch.randint(0, vocab, (n,), generator=generator).tolist() for b, n in enumerate(_PROMPT_LENGTHS)}
    step_logits = []
    for _ in range(_DECODE_STEPS + 1):
        ids, positions, slots, query_start, seq_lens = [], [], [], [0], []
        for b in range(num_seqs):
            start = len(tokens[b])
            tokens[b] += new[b]
            pos = torch.arange(start, len(tokens[b]))
            ids += new[b]
            positions.append(pos)
            slots.append(block_tables[b, pos // block_size] * block_size + pos % block_size)
            query_start.append(query_start[-1] + len(new[b]))
            seq_lens.append(len(tokens[b]))
        meta = AttentionMetadata(
            slot_mapping=torch.cat(slots),
            query_start=torch.tensor(query_start),
            seq_lens=torch.tensor(seq_lens),
            block_tables=block_tables,
            max_query_len=max(len(t) for t in new.values()),
            max_seq_len=max(seq_lens),
            block_size=block_size,
        )
        with torch.no_grad():
            logits = model.compute_logits(model(torch.tensor(ids), torch.cat(positions), kv_caches, meta))
        step_logits.append(logits)
        new = {b: [greedy_token(logits[query_start[b + 1] - 1], 2 * ATOL)] for b in range(num_seqs)}
    for b in range(num_seqs):
        tokens[b] += new[b]
    return step_logits, tokens


def _load_model(model_dir: str, tp_size: int = 1, tp_rank: int = 0, group=None):
    from flotilla.cluster.models.base import ModelConfig, ParallelLayout
    from flotilla.cluster.models.loader import iter_hf_weights, read_hf_config
    from flotilla.cluster.models.registry import model_class

    hf = read_hf_config(model_dir)
    layout = ParallelLayout(tp_size=tp_size, tp_rank=tp_rank, group=group)
    model = model_class(hf["architectures"][0])(ModelConfig(hf=hf, parallel=layout))
    model.load_weights(iter_hf_weights(model_dir))
    return model, int(hf["vocab_size"])


def _rank_main(model_dir: str, rank: int, world_size: int, port: int, out_path: str) -> None:
    """One rank process: join gloo, load this rank's shard, run the scenario."""
    from flotilla.cluster import distributed

    torch.set_num_threads(1)
    group = distributed.init_gloo(rank, world_size, port, _COLLECTIVE_TIMEOUT_S)
    # gloo collectives run on the CPU: a decode CUDA graph could never hold them.
    assert not group.on_device
    try:
        model, vocab = _load_model(model_dir, world_size, rank, group)
        logits, tokens = _paged_scenario(model, vocab)
        if rank == 0:
            torch.save({"logits": logits, "tokens": tokens}, out_path)
    finally:
        distributed.destroy()


# --- the parent -----------------------------------------------------------------------

_COMMON = dict(vocab_size=97, num_hidden_layers=2, max_position_embeddings=64)
CASES = {
    "llama-tp2": ("LlamaConfig", dict(hidden_size=64, intermediate_size=112, num_attention_heads=4, num_key_value_heads=2), 2),
    "qwen3-replicated-kv-tp2": (
        "Qwen3Config",
        dict(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=1, head_dim=24, tie_word_embeddings=True),
        2,
    ),
    "llama-9q-3kv-tp3": ("LlamaConfig", dict(hidden_size=72, intermediate_size=96, num_attention_heads=9, num_key_value_heads=3), 3),
}


def _save_random_model(case: str, model_dir: Path) -> None:
    """A tiny HF model with unit-scale random weights, saved as safetensors."""
    import transformers

    config_name, extra, _ = CASES[case]
    config = getattr(transformers, config_name)(**_COMMON, **extra)
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(config).eval()
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in hf.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            if name.endswith("norm.weight"):
                param.copy_(1 + 0.2 * noise)
            elif "embed_tokens" in name:
                param.copy_(noise)
            else:
                param.copy_(noise / math.sqrt(param.shape[1]))
    hf.save_pretrained(model_dir)


def _check_case(case: str, tmp_path: Path) -> None:
    model_dir = tmp_path / case
    _save_random_model(case, model_dir)
    world_size = CASES[case][2]
    reference_model, vocab = _load_model(str(model_dir))
    expected_logits, expected_tokens = _paged_scenario(reference_model, vocab)
    assert max(l.abs().max() for l in expected_logits) > 1.0  # not a comparison of near-zero logits

    out_path = tmp_path / f"{case}-rank0.pt"
    run_ranks(__file__, world_size, [model_dir, free_port(), out_path], _RANK_TIMEOUT_S)
    got = torch.load(out_path)
    assert len(got["logits"]) == len(expected_logits)
    for step, (actual, expected) in enumerate(zip(got["logits"], expected_logits)):
        assert actual.shape == expected.shape == (actual.shape[0], vocab), step
        torch.testing.assert_close(actual, expected, atol=ATOL, rtol=0, msg=lambda m: f"step {step}: {m}")
    assert got["tokens"] == expected_tokens


def test_llama_tp2_matches_single_rank(tmp_path):
    _check_case("llama-tp2", tmp_path)


def test_qwen3_tp2_with_replicated_kv_head_matches_single_rank(tmp_path):
    _check_case("qwen3-replicated-kv-tp2", tmp_path)


def test_llama_9q_3kv_heads_tp3_matches_single_rank(tmp_path):
    _check_case("llama-9q-3kv-tp3", tmp_path)


def test_single_rank_group_is_identity():
    from flotilla.cluster.distributed import Communicator

    group = Communicator.single()
    x = torch.randn(3, 4)
    assert group.all_reduce(x) is x
    assert group.all_gather(x, dim=-1) is x


def test_kv_heads_per_rank_replicates_or_divides():
    import pytest

    from flotilla.cluster.models.layers import kv_heads_per_rank

    assert kv_heads_per_rank(8, 2) == 4
    assert kv_heads_per_rank(3, 3) == 1
    assert kv_heads_per_rank(1, 4) == 1
    with pytest.raises(ValueError, match="tp_size=4"):
        kv_heads_per_rank(3, 4)
    with pytest.raises(ValueError, match="num_key_value_heads=6"):
        kv_heads_per_rank(6, 4)


if __name__ == "__main__":
    # argv: rank, world_size, model_dir, port, out_path (see helpers.ranks.run_ranks)
    _rank_main(sys.argv[3], int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[4]), sys.argv[5])
