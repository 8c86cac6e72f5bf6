"""Qwen3-MoE and Mixtral against HF transformers (the oracle), plus the FusedMoE layer.

Tiny random-weight models (HF's init, std 0.02), float32, seeded. Logit tolerance: atol
1e-5. Our forward runs the same float32 math in a different order (routed experts gathered
per expert and accumulated in float32, q/k/v and gate/up as one matmul, attention over a
paged cache); through two or three layers that moves logits of magnitude ~0.7 by <= 3e-7
(measured with MKL_CBWR, ATEN_CPU_CAPABILITY and 1-3 threads), so 1e-5 leaves 30x headroom
while any real bug (wrong expert weights, window or normalisation) moves logits by 1e-3 or
more.

Greedy tokens are compared with HF's ``generate``: every token chosen here leads the
runner-up by more than 2 * ATOL (``helpers.margins.greedy_token``; the smallest lead is
8.6e-5). Routing is a choice too: the closest last-chosen / first-unchosen experts are 3e-5
apart in router logits (8.7e-6 in probability), 100x their rounding (~u * sum|h||w_gate|,
below 1e-7 at this init), so no expert choice differs from HF's either.
"""

from __future__ import annotations

import pytest
import torch
from transformers import MixtralConfig, Qwen3MoeConfig
from transformers import MixtralForCausalLM as HFMixtral
from transformers import Qwen3MoeForCausalLM as HFQwen3Moe

from flotilla.cluster.models.base import ModelConfig
from flotilla.cluster.models.loader import iter_hf_weights
from flotilla.cluster.models.moe_models import MixtralForCausalLM, Qwen3MoeForCausalLM
from helpers.margins import greedy_token
from helpers.paged import PagedRunner
from helpers.torch_threads import one_intra_op_thread

ATOL = 1e-5
BLOCK_SIZE = 4
NEW_TOKENS = 32

_SMALL = dict(vocab_size=128, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
CASES = {
    # norm_topk_prob on; layer 1 dense (mlp_only_layers); q/k norm.
    "qwen3_moe": (
        HFQwen3Moe,
        Qwen3MoeForCausalLM,
        Qwen3MoeConfig(
            **_SMALL, head_dim=16, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
            num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[1],
        ),
    ),
    # decoder_sparse_step=2: only odd layers are sparse; weights not renormalised.
    "qwen3_moe_sparse_step": (
        HFQwen3Moe,
        Qwen3MoeForCausalLM,
        Qwen3MoeConfig(
            **_SMALL, head_dim=16, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2,
            num_experts=4, num_experts_per_tok=2, norm_topk_prob=False, decoder_sparse_step=2,
        ),
    ),
    # A sliding window shorter than the prompts, so it masks during prefill and decode.
    "mixtral": (
        HFMixtral,
        MixtralForCausalLM,
        MixtralConfig(
            **_SMALL, intermediate_size=48, num_hidden_layers=2, num_local_experts=4, num_experts_per_tok=2,
            sliding_window=7,
        ),
    ),
}
PROMPT_LENS = (11, 6)


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    with one_intra_op_thread():
        yield


# --------------------------------------------------------------------------- paged-step helper


def greedy(model, prompts: list[list[int]], new_tokens: int) -> tuple[list[torch.Tensor], list[list[int]]]:
    """Prefill every prompt in one varlen step, then decode all sequences together.
    Returns the prefill logits and the greedy continuations."""
    runner = PagedRunner(model, len(prompts), max(map(len, prompts)) + new_tokens)
    prefill = runner.step(dict(enumerate(prompts)))
    outputs = [[greedy_token(prefill[b][-1], 2 * ATOL)] for b in range(len(prompts))]
    for _ in range(new_tokens - 1):
        logits = runner.step({b: out[-1:] for b, out in enumerate(outputs)})
        for b, out in enumerate(outputs):
            out.append(greedy_token(logits[b][-1], 2 * ATOL))
    return [prefill[b] for b in range(len(prompts))], outputs


def hf_generate(hf_model, prompt: list[int], new_tokens: int) -> list[int]:
    """HF greedy ``generate``. NOTE: without an EOS id nothing stops or masks it early
    (``min_new_tokens`` would forbid EOS, which our plain argmax may pick)."""
    hf_model.generation_config.eos_token_id = None
    out = hf_model.generate(torch.tensor([prompt]), max_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    return out[0, len(prompt) :].tolist()


def build_pair(case: str):
    hf_cls, our_cls, hf_config = CASES[case]
    torch.manual_seed(0)
    hf_model = hf_cls(hf_config).eval()
    ours = our_cls(ModelConfig(hf=hf_config.to_dict()))
    loaded = ours.load_weights(hf_model.state_dict().items())
    assert loaded == set(dict(ours.named_parameters())), "every parameter must come from the checkpoint"
    return hf_model, ours


def prompts_for(vocab: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(1)
    return [torch.randint(0, vocab, (n,), generator=generator).tolist() for n in PROMPT_LENS]


# --------------------------------------------------------------------------- tests


@pytest.mark.parametrize("case", sorted(CASES))
def test_ragged_prefill_logits_and_greedy_decode_match_hf(case):
    hf_model, ours = build_pair(case)
    prompts = prompts_for(hf_model.config.vocab_size)
    prefill_logits, continuations = greedy(ours, prompts, NEW_TOKENS)
    with torch.no_grad():
        for prompt, logits in zip(prompts, prefill_logits):
            expected = hf_model(torch.tensor([prompt])).logits[0]
            torch.testing.assert_close(logits, expected, atol=ATOL, rtol=0)
    for prompt, continuation in zip(prompts, continuations):
        assert continuation == hf_generate(hf_model, prompt, NEW_TOKENS)


@pytest.mark.parametrize("case", ["qwen3_moe", "mixtral"])
def test_chunked_prefill_beside_a_decode_matches_hf(case):
    """Prompt 0 arrives in two chunks (the second attends to cached blocks) while
    prompt 1 is prefilled and then decoded in the same steps."""
    hf_model, ours = build_pair(case)
    prompts = prompts_for(hf_model.config.vocab_size)
    first, rest = prompts[0][:5], prompts[0][5:]
    runner = PagedRunner(ours, 2, 32)
    step1 = runner.step({0: first, 1: prompts[1]})
    next_token = int(step1[1][-1].argmax())
    step2 = runner.step({0: rest, 1: [next_token]})
    with torch.no_grad():
        full0 = hf_model(torch.tensor([prompts[0]])).logits[0]
        full1 = hf_model(torch.tensor([prompts[1] + [next_token]])).logits[0]
    torch.testing.assert_close(torch.cat([step1[0], step2[0]]), full0, atol=ATOL, rtol=0)
    torch.testing.assert_close(step2[1][-1], full1[-1], atol=ATOL, rtol=0)


@pytest.mark.parametrize("case", ["qwen3_moe", "mixtral"])
def test_checkpoint_per_expert_names_load_like_the_in_memory_state(case, tmp_path):
    """A saved checkpoint names every expert separately (Mixtral: ``block_sparse_moe.experts.N.w1``);
    it must land exactly where transformers' stacked in-memory experts do."""
    hf_model, from_memory = build_pair(case)
    hf_model.save_pretrained(tmp_path)
    names = [name for name, _ in iter_hf_weights(tmp_path)]
    assert any(".experts.0." in name for name in names)
    hf_cls, our_cls, hf_config = CASES[case]
    from_disk = our_cls(ModelConfig(hf=hf_config.to_dict()))
    assert from_disk.load_weights(iter_hf_weights(tmp_path)) == set(dict(from_disk.named_parameters()))
    for name, param in from_memory.named_parameters():
        assert torch.equal(param, dict(from_disk.named_parameters())[name]), name


def test_unknown_checkpoint_tensor_is_rejected():
    _, ours = build_pair("mixtral")
    with pytest.raises(ValueError, match="layers.0.mlp.shared_expert"):
        ours.load_weights([("model.layers.0.mlp.shared_expert.weight", torch.zeros(1))])


def test_kv_cache_spec_is_per_kv_head():
    _, ours = build_pair("qwen3_moe")
    spec = ours.kv_cache_spec()
    assert spec.num_layers == 3 and spec.tensors_per_layer == ((2, 16), (2, 16))
