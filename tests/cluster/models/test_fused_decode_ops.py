"""The model plumbing of the fused decode ops (``use_linear_op``: a linear kernel, the norm
fused into the projection after it, the activation fused into the down projection), on the CPU.

The CUDA kernels behind these ops (``kernels/triton_gemv.py``) are tested on a GPU
(tests/gpu/test_triton_gemv.py). Here the same contracts are implemented with the torch
references, handed to a tiny Llama through ``use_linear_op``, and the engine's greedy tokens
must equal those of the unfused model while every fused op is actually called, batch-1 decode
steps taking the fused path and other steps the separate ops.

The two runs batch differently (both prompts together, then one at a time), so their float32
logits differ by GEMM summation order (~1e-6 on logits of a few units); the smallest lead of a
chosen token over the runner-up here is 9.8e-3, so no greedy choice can flip.
"""

import pytest
import torch
import torch.nn.functional as F
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

from flotilla.cluster.engine.llm_engine import LLMEngine
from flotilla.cluster.engine.model_runner import ModelRunner
from flotilla.cluster.engine.sampling_params import SamplingParams
from flotilla.cluster.models.layers import use_linear_op
from flotilla.cluster.models.sources import resolve_model_source
from flotilla.kernels.activation import silu_and_mul
from flotilla.kernels.norm import rms_norm
from flotilla.resolution import ModelFacts, ServerArgs, preset, resolve
from helpers.tiny_models import save_tiny_llama

PROMPTS = [[11, 42, 7, 99, 3, 250, 17, 64], [5, 6, 7, 8, 9]]
PARAMS = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def save_tiny_qwen3_moe(path):
    """A seeded tiny Qwen3-MoE (q/k norm; layer 1 dense, the others sparse) saved to ``path``."""
    torch.manual_seed(0)
    config = Qwen3MoeConfig(
        vocab_size=256, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3, num_experts=8, num_experts_per_tok=2,
        norm_topk_prob=True, mlp_only_layers=[1], max_position_embeddings=256, initializer_range=0.2,
    )  # fmt: skip
    Qwen3MoeForCausalLM(config).save_pretrained(path)


@pytest.fixture(scope="module", params=["llama", "qwen3_moe"])
def model_path(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(f"tiny-{request.param}-fused")
    if request.param == "llama":
        save_tiny_llama(path, vocab_size=256)
    else:
        save_tiny_qwen3_moe(path)
    return request.param, path


def engine_for(path):
    source = resolve_model_source(str(path))
    args = ServerArgs.create(model_path=str(source.path))
    config = resolve(args, ModelFacts.from_hf_config(source.config_dict), preset("cpu"))
    # NOTE: no oneDNN weight packing (it replaces the linear layers): the fused ops read plain weights.
    return LLMEngine(config, source, runner=ModelRunner(config, source, pack_weights=False))


def greedy(engine, prompts):
    ids = [engine.add_request(p, PARAMS) for p in prompts]
    while engine.has_unfinished_requests():
        engine.step()
    return [engine.pop_output(i).outputs[0].token_ids for i in ids]


class Calls:
    """Reference implementations of the fused ops' contracts that count their calls."""

    def __init__(self):
        self.counts = {"linear": 0, "rms_norm_linear": 0, "rms_norm_linear_declined": 0, "silu_and_mul_linear": 0}

    def linear(self, x, weight, bias=None):
        self.counts["linear"] += 1
        return F.linear(x, weight, bias)

    def rms_norm_linear(self, x, residual, norm_weight, eps, weight, bias=None):
        if x.shape[0] != 1:
            self.counts["rms_norm_linear_declined"] += 1
            return None
        self.counts["rms_norm_linear"] += 1
        if residual is None:
            return F.linear(rms_norm(x, norm_weight, eps), weight, bias), x
        normed, new_residual = rms_norm(x, norm_weight, eps, residual)
        return F.linear(normed, weight, bias), new_residual

    def silu_and_mul_linear(self, x, weight, act):
        self.counts["silu_and_mul_linear"] += 1
        return F.linear(act(x) if x.shape[0] != 1 else silu_and_mul(x), weight)


def test_fused_ops_give_the_unfused_tokens(model_path):
    case, path = model_path
    want = greedy(engine_for(path), PROMPTS)
    engine = engine_for(path)
    calls = Calls()
    layers = len(engine.runner.model.layers) if case == "qwen3_moe" else len(engine.runner.model.model.layers)
    changed = use_linear_op(
        engine.runner.model, calls.linear, rms_norm_linear=calls.rms_norm_linear,
        silu_and_mul_linear=calls.silu_and_mul_linear,
    )  # fmt: skip
    # Llama: q/k/v, o, gate/up, down per layer. Qwen3-MoE: q/k/v and o, plus gate/up and
    # down of its one dense layer, plus the router of each sparse layer (the experts have
    # their own kernel).
    assert changed == (4 * layers if case == "llama" else 2 * layers + 2 + (layers - 1))
    # one prompt at a time: batch-1 decode steps take the fused path, prefills decline it
    got = [greedy(engine, [p])[0] for p in PROMPTS]
    assert got == want
    counts = calls.counts
    decode_steps = sum(PARAMS.max_tokens - 1 for _ in PROMPTS)
    steps = decode_steps + len(PROMPTS)
    # Llama fuses both norms of a layer; the MoE layers only the input norm (the router and
    # the experts both read the post-attention norm's output).
    fused_norms = 2 if case == "llama" else 1
    assert counts["rms_norm_linear"] == fused_norms * layers * decode_steps, counts
    assert counts["rms_norm_linear_declined"] == layers * len(PROMPTS), counts
    dense_layers = layers if case == "llama" else 1
    assert counts["silu_and_mul_linear"] == dense_layers * steps, counts
    assert counts["linear"] > 0, counts  # o_proj, and every projection of the prefills
