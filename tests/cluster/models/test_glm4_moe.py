"""GLM-4.5 (``Glm4MoeForCausalLM``) against HF transformers (the oracle), tiny random weights,
float32.

Logit tolerance: atol 1e-4. Our layers compute what HF's do in a different float32 order
(merged q/k/v and gate/up GEMMs, fused MoE sums, SDPA over a paged cache): about 1e-6 on
logits of magnitude ~5, whatever the CPU's SIMD width (a few ulps of float32 per op, summed
over 3 layers). A partial rotary applied to the whole head, the wrong rotate-half layout, a
missing q/k norm or bias, or a wrong routing choice moves the logits by 1e-2 or more.
"""

from __future__ import annotations

import pytest
import torch

from flotilla import LLM, SamplingParams
from flotilla.cluster.models.base import ModelConfig
from flotilla.cluster.models.glm4_moe import Glm4MoeForCausalLM
from flotilla.cluster.models.registry import model_class
from helpers.paged import PagedRunner
from helpers.prompts import random_prompts
from helpers.tiny_glm import save_tiny_glm4_moe, tiny_glm4_moe
from helpers.tiny_models import hf_greedy
from helpers.torch_threads import one_intra_op_thread

ATOL = 1e-4
NEW_TOKENS = 32


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    with one_intra_op_thread():
        yield


def _pair(**overrides):
    hf = tiny_glm4_moe(**overrides)
    ours = Glm4MoeForCausalLM(ModelConfig(hf=hf.config.to_dict()))
    loaded = ours.load_weights(hf.state_dict().items())
    assert loaded == set(dict(ours.named_parameters())), "every parameter must come from the checkpoint"
    return hf, ours


def test_architecture_is_registered():
    assert model_class("Glm4MoeForCausalLM") is Glm4MoeForCausalLM


def test_layers_follow_the_config():
    _, ours = _pair()
    assert [type(layer.mlp).__name__ for layer in ours.layers] == ["GatedMLP", "DeepseekMoE", "DeepseekMoE"]
    attn = ours.layers[0].self_attn
    assert attn.rotary.cos_sin_cache.shape[-1] == 8  # half of the 16-wide head rotates
    assert attn.q_norm is not None and attn.qkv_proj.bias is not None and attn.o_proj.bias is None
    assert ours.layers[1].mlp.gate.e_score_correction_bias is not None
    assert ours.kv_cache_spec().tensors_per_layer == ((2, 16), (2, 16))


@pytest.mark.parametrize("overrides", [{}, {"use_qk_norm": False, "attention_bias": False, "partial_rotary_factor": 1.0}])
def test_ragged_prefill_logits_and_greedy_decode_match_hf(overrides):
    hf, ours = _pair(**overrides)
    prompts = random_prompts((11, 6), 128)
    runner = PagedRunner(ours, len(prompts), max(map(len, prompts)) + NEW_TOKENS)
    prefill = runner.step(dict(enumerate(prompts)))
    outputs = [[int(prefill[b][-1].argmax())] for b in range(len(prompts))]
    for _ in range(NEW_TOKENS - 1):
        logits = runner.step({b: out[-1:] for b, out in enumerate(outputs)})
        for b, out in enumerate(outputs):
            out.append(int(logits[b][-1].argmax()))
    for b, prompt in enumerate(prompts):
        with torch.no_grad():
            expected = hf(torch.tensor([prompt])).logits[0]
        torch.testing.assert_close(prefill[b], expected, atol=ATOL, rtol=0)
        assert outputs[b] == hf_greedy(hf, prompt, NEW_TOKENS)


GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)


def test_engine_greedy_equals_hf_through_chunks_preemption_and_the_prefix_cache(tmp_path):
    """A mixed batch through chunked prefill (16-token chunks) and a pool small enough to
    preempt (8 blocks of 16); then a prompt served again from the prefix cache."""
    hf = save_tiny_glm4_moe(tmp_path)
    prompts = random_prompts((7, 20, 45), 128, seed=2)
    expected = [hf_greedy(hf, p, NEW_TOKENS) for p in prompts]
    llm = LLM(str(tmp_path), chunked_prefill_size=16, max_total_tokens=128)
    outs = llm.generate(prompts, GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert llm.engine.scheduler.num_preemptions > 0
    again = llm.generate([prompts[2]], GREEDY)[0]
    assert again.num_cached_tokens >= 32 and again.outputs[0].token_ids == expected[2]
