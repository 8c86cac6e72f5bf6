"""Block-FP8 checkpoints on the GPU, end to end, against the CPU reference engine.

Each case is a tiny random model saved twice by ``helpers.tiny_fp8.save_fp8_pair`` (the CPU
suite's ``tests/cluster/models/test_fp8_checkpoint.py`` uses the same pair): as an FP8
checkpoint (float8_e4m3fn projections with 128x128 ``weight_scale_inv`` blocks) and as those
weights dequantized into float32. The GPU runs the FP8 checkpoint in bf16 with the CUDA
backends (the FP8 projections on the resolved ``fp8`` backend, flashinfer attention, Triton MoE,
decode CUDA graphs); the CPU reference runs the dequantized twin in float32 with the torch
kernels, so both hold the same weights and the comparison isolates the GPU path.

The metric is ``test_e2e_greedy.py``'s teacher-forced agreement (both runners fed the
reference's token every step): >= 95% of positions in bf16, the issue's bf16 acceptance.

Run on a GPU machine: ``FLOTILLA_GPU_TESTS=1 pytest tests/gpu/test_fp8_checkpoint_gpu.py``.
"""

from __future__ import annotations

import pytest
import torch

from gpu.test_cuda_graph_decode import build_runner, teacher_forced
from helpers.prompts import random_prompts
from helpers.tiny_fp8 import VOCAB, save_fp8_case

pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"), pytest.mark.timeout(1800)]

STEPS = 24
MIN_AGREEMENT = 0.95
CASES = ("qwen3", "qwen3_moe")  # of helpers.tiny_fp8.FP8_CASES: head dim 128, flashinfer's FA3 sizes
GPU_FLAGS = dict(dtype="bfloat16", cuda_graph_max_bs_decode=8)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """case -> (fp8 dir, dequantized float32 dir)."""
    root = tmp_path_factory.mktemp("fp8-gpu")
    return {case: save_fp8_case(case, root) for case in CASES}


@pytest.mark.parametrize("case", CASES)
def test_fp8_checkpoint_on_the_gpu_agrees_with_its_dequantized_twin_on_the_cpu(case, checkpoints):
    fp8_dir, dequant_dir = checkpoints[case]
    cpu = build_runner(str(dequant_dir), "cpu")
    gpu = build_runner(str(fp8_dir), "cuda", **GPU_FLAGS)
    report = gpu.startup_report()
    backends = gpu.backends.as_dict()
    print(f"{case}: GPU backends {backends}; start-up {report}")
    assert backends["fp8"] != "torch", backends  # the FP8 projections run a CUDA kernel
    assert report["graph_batch_sizes"] == [1, 2, 4, 8], report
    prompts = random_prompts((5, 11, 23, 40), VOCAB)
    replays = gpu.graphs.num_replays
    result = teacher_forced(cpu, gpu, prompts, STEPS)
    print(result.report(f"{case} FP8 bf16 GPU vs dequantized float32 CPU"))
    assert gpu.graphs.num_replays - replays == STEPS  # every decode step replayed a graph
    assert result.agreement >= MIN_AGREEMENT, result.report(case)
