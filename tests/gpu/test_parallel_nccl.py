"""Every parallel layout over NCCL on two GPUs, against the one-GPU engine.

The CPU suite checks the same layouts over gloo; here the collectives are NCCL's
(all-reduce, all-gather, all-to-all with uneven splits, reduce-scatter), the ranks are
Ray actors holding one GPU each, and the tiny models run in float32, so greedy tokens
must be identical (reduction-order noise ~1e-6 is far below the tiny models' margins,
see tests/helpers). The last test runs TP=2 on the GPU kernel backends in bf16 with decode
CUDA graphs captured over NCCL, the steps pipelined through the compiled step graph, against
the same group without graphs. Run on a 2-GPU machine: ``FLOTILLA_GPU_TESTS=1 pytest tests/gpu``.
"""

import pytest

from flotilla import LLM, SamplingParams
from helpers.tiny_deepseek import save_tiny_deepseek_v2
from helpers.tiny_models import save_tiny_llama
from helpers.tiny_moe import save_tiny_qwen3_moe
from helpers.prompts import random_prompts
from gpu.test_cuda_graph_decode import first_divergence

GREEDY = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
# torch_native: the torch reference kernels (the GPU kernel backends are a later issue).
COMMON = dict(dtype="float32", attention_backend="torch_native", max_total_tokens=2048, disable_cuda_graph=True)

MODELS = {"llama": save_tiny_llama, "qwen3_moe": save_tiny_qwen3_moe, "deepseek_v2": save_tiny_deepseek_v2}
LAYOUTS = [
    ("llama", dict(tp_size=2)),
    ("qwen3_moe", dict(tp_size=2)),
    ("qwen3_moe", dict(tp_size=2, ep_size=2, moe_a2a_backend="none")),
    ("qwen3_moe", dict(tp_size=2, ep_size=2, moe_a2a_backend="deepep")),
    ("qwen3_moe", dict(tp_size=2, dp_size=2, enable_dp_attention=True, ep_size=2, moe_a2a_backend="deepep")),
    ("deepseek_v2", dict(tp_size=2, dcp_size=2, dcp_comm_backend="ag_rs")),
    ("deepseek_v2", dict(tp_size=2, dcp_size=2, dcp_comm_backend="a2a")),
]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    paths = {}
    for name, save in MODELS.items():
        path = tmp_path_factory.mktemp(name)
        save(path, first_k_dense_replace=1) if name == "deepseek_v2" else save(path)
        paths[name] = str(path)
    vocab = 128  # the smallest of the three vocabularies
    prompts = random_prompts((1, 7, 30), vocab)
    return paths, prompts


def _greedy(path, prompts, **flags):
    llm = LLM(path, **COMMON, **flags)
    try:
        assert llm.config.device == "cuda"
        return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]
    finally:
        llm.shutdown()


@pytest.fixture(scope="module")
def single_gpu(gpu_ray_cluster, models):
    paths, prompts = models
    return {name: _greedy(path, prompts) for name, path in paths.items()}


@pytest.mark.parametrize("model, flags", LAYOUTS, ids=[f"{m}-" + "-".join(f"{k}={v}" for k, v in f.items()) for m, f in LAYOUTS])
def test_two_gpu_layout_matches_one_gpu(gpu_ray_cluster, models, single_gpu, model, flags):
    paths, prompts = models
    assert _greedy(paths[model], prompts, **flags) == single_gpu[model]


# -- TP=2 on the GPU kernel backends, decode CUDA graphs captured over NCCL ----------------

# bf16: the graph and eager runs differ only in the attention wrapper (fixed-size graph
# wrapper vs the eager one) and rounding order, so free-running greedy tokens may part at a
# near-tie; a near-tie here is a reference gap below 0.1 in logprob (random tiny weights with
# initializer_range 0.2 give top-1 margins mostly above 1).
NEAR_TIE = 0.1
GRAPH_STEPS = 24


def _save_flashinfer_llama(path) -> str:
    """A tiny random Llama whose attention the flashinfer kernels take (head dim 64)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
        num_hidden_layers=2, vocab_size=256, max_position_embeddings=512, initializer_range=0.2,
    )
    LlamaForCausalLM(config).eval().save_pretrained(path)
    return str(path)


def _tp2_greedy(path, prompts, **flags):
    """Greedy outputs (tokens and top-2 logprobs) of a TP=2 bf16 engine, and its ranks' step stats."""
    params = SamplingParams(temperature=0, max_tokens=GRAPH_STEPS, ignore_eos=True, logprobs=2)
    llm = LLM(path, dtype="bfloat16", tp_size=2, max_total_tokens=4096, **flags)
    try:
        outputs = [o.outputs[0] for o in llm.generate(prompts, params)]
        return outputs, llm.engine.runner.group.call("step_stats"), llm.engine.runner.group.call("startup_report")
    finally:
        llm.shutdown()


def test_tp2_decode_graphs_replay_over_nccl_and_match_eager(gpu_ray_cluster, tmp_path):
    path = _save_flashinfer_llama(tmp_path / "llama-hd64")
    prompts = random_prompts((1, 7, 30, 100), 256)
    graphs, graph_stats, reports = _tp2_greedy(path, prompts, cuda_graph_max_bs_decode=8)
    eager, eager_stats, _ = _tp2_greedy(path, prompts, disable_cuda_graph=True)
    for report in reports:
        assert report["graph_batch_sizes"][:4] == [1, 2, 4, 8] and report["graphs_off_reason"] is None
    # Every rank replayed its graphs for the decode steps (the same count: they decide alike).
    replays = {stats["graph_replays"] for stats in graph_stats}
    assert len(replays) == 1 and replays.pop() >= GRAPH_STEPS - 2
    assert {stats["graph_replays"] for stats in eager_stats} == {0}
    for ours, theirs in zip(graphs, eager):
        step = first_divergence(ours.token_ids, theirs.token_ids)
        if step is None:
            continue
        # At the first divergence the eager run's own top two must have been a near-tie.
        top = sorted((lp.logprob for lp in theirs.logprobs[step].values()), reverse=True)
        assert len(top) >= 2 and top[0] - top[1] < NEAR_TIE, (step, top)
