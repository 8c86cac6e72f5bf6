"""Every parallel layout over NCCL on two GPUs, against the one-GPU engine.

The CPU suite checks the same layouts over gloo; here the collectives are NCCL's
(all-reduce, all-gather, all-to-all with uneven splits, reduce-scatter), the ranks are
Ray actors holding one GPU each, and the tiny models run in float32, so greedy tokens
must be identical (reduction-order noise ~1e-6 is far below the tiny models' margins,
see tests/helpers). Run on a 2-GPU machine: ``FLOTILLA_GPU_TESTS=1 pytest tests/gpu``.
"""

import pytest

from flotilla import LLM, SamplingParams
from helpers.tiny_deepseek import save_tiny_deepseek_v2
from helpers.tiny_models import save_tiny_llama
from helpers.tiny_moe import save_tiny_qwen3_moe
from helpers.prompts import random_prompts

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
