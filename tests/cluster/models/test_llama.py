"""The dense decoders (Llama, Llama 3 scaling, Mistral, Qwen2, Qwen3) against HF transformers.

Each case builds a tiny random-weight HF model from its transformers config class,
copies its state dict into ours with ``load_weights``, and compares logits over
paged, varlen batches: one prompt, a ragged batch of prompts in one step, decode
steps after a prefill, chunked prefill mixed with decode, and greedy continuations.

Tolerance: atol 1e-4 in float32. Both sides use the same weights; what differs is
the order of floating-point sums (merged q/k/v and gate/up GEMMs, attention over
padded paged context with a mask instead of HF's per-sequence attention). The weights
are re-drawn at unit scale so logits reach ~60 and attention is far from uniform; two
layers of reassociated float32 sums move those logits by up to 2e-5 (measured with
MKL_CBWR, ATEN_CPU_CAPABILITY and 1-3 threads; ~3e-7 of their size), while a wrong mask,
position or weight mapping moves them by far more than 1e-4.

Greedy tokens are compared with HF's ``generate``: every token chosen here leads the
runner-up by more than 2 * ATOL (``helpers.margins.greedy_token``; the smallest lead is
6e-3), so a choice cannot flip while the logits agree within ATOL.
"""

from __future__ import annotations

import math

import pytest
import torch
from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config
from transformers import AutoModelForCausalLM

from flotilla.cluster.models.base import ModelConfig
from flotilla.cluster.models.llama import rope_settings
from flotilla.cluster.models.registry import model_class
from flotilla.kernels.attention import AttentionMetadata
from helpers.margins import greedy_token

ATOL = 1e-4
VOCAB = 96

_COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=112, num_hidden_layers=2, max_position_embeddings=128)

CASES = {
    "llama": (LlamaConfig, "LlamaForCausalLM", dict(num_attention_heads=4, num_key_value_heads=2)),
    # Llama 3 RoPE scaling with a short original context so the scaled frequencies matter
    # at test lengths; tied embeddings and biases as SmolLM2-style checkpoints may have.
    "llama3-scaled-tied": (
        LlamaConfig,
        "LlamaForCausalLM",
        dict(
            num_attention_heads=4,
            num_key_value_heads=1,
            tie_word_embeddings=True,
            attention_bias=True,
            mlp_bias=True,
            rope_parameters=dict(
                rope_type="llama3",
                rope_theta=500.0,
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=16,
            ),
        ),
    ),
    # A window shorter than the prompts, so the sliding mask is exercised.
    "mistral-sliding": (MistralConfig, "MistralForCausalLM", dict(num_attention_heads=4, num_key_value_heads=2, sliding_window=5)),
    # MHA, q/k/v bias; layer 1 (from max_window_layers on) uses a sliding window.
    "qwen2-sliding": (
        Qwen2Config,
        "Qwen2ForCausalLM",
        dict(num_attention_heads=4, num_key_value_heads=4, use_sliding_window=True, sliding_window=6, max_window_layers=1),
    ),
    # q/k norm, explicit head_dim that is not hidden/heads.
    "qwen3": (Qwen3Config, "Qwen3ForCausalLM", dict(num_attention_heads=4, num_key_value_heads=2, head_dim=24)),
}


def _randomize(model: torch.nn.Module, seed: int) -> None:
    """Unit-scale weights: linear layers ~ 1/sqrt(fan_in), norms ~ 1 +- 0.2, biases ~ 0.2."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            if name.endswith("norm.weight"):
                param.copy_(1 + 0.2 * noise)
            elif name.endswith(".bias"):
                param.copy_(0.2 * noise)
            elif "embed_tokens" in name:
                param.copy_(noise)
            else:
                param.copy_(noise / math.sqrt(param.shape[1]))


def build_pair(case: str, seed: int = 0):
    """(hf_model, our_model) with identical random weights."""
    config_class, architecture, extra = CASES[case]
    hf_config = config_class(**_COMMON, **extra)
    hf_config._attn_implementation = "eager"
    torch.manual_seed(seed)
    hf = AutoModelForCausalLM.from_config(hf_config).eval()
    _randomize(hf, seed)
    hf_dict = hf_config.to_dict()
    hf_dict["architectures"] = [architecture]
    ours = model_class(architecture)(ModelConfig(hf=hf_dict))
    ours.load_weights(hf.state_dict().items())
    return hf, ours


class PagedRunner:
    """Drives a model over hand-built paged batches: sequence ``b`` owns a shuffled set
    of cache blocks; each :meth:`step` appends new tokens to any subset of sequences."""

    def __init__(self, model, num_seqs: int, max_len: int, block_size: int = 4, seed: int = 0):
        self.model, self.block_size = model, block_size
        blocks_per_seq = -(-max_len // block_size)
        num_blocks = num_seqs * blocks_per_seq + 3
        order = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed))
        self.block_tables = order[: num_seqs * blocks_per_seq].view(num_seqs, blocks_per_seq)
        self.kv_caches = model.kv_cache_spec().allocate(num_blocks, block_size)
        self.tokens: list[list[int]] = [[] for _ in range(num_seqs)]

    def step(self, new_tokens: dict[int, list[int]]) -> dict[int, torch.Tensor]:
        """Run one varlen step; returns each stepped sequence's logits for its new tokens."""
        seqs = list(new_tokens)
        ids, positions, slots, query_start, seq_lens = [], [], [], [0], []
        for b in seqs:
            start = len(self.tokens[b])
            self.tokens[b] += new_tokens[b]
            pos = torch.arange(start, len(self.tokens[b]))
            ids += new_tokens[b]
            positions.append(pos)
            slots.append(self.block_tables[b, pos // self.block_size] * self.block_size + pos % self.block_size)
            query_start.append(query_start[-1] + len(new_tokens[b]))
            seq_lens.append(len(self.tokens[b]))
        meta = AttentionMetadata(
            slot_mapping=torch.cat(slots),
            query_start=torch.tensor(query_start),
            seq_lens=torch.tensor(seq_lens),
            block_tables=self.block_tables[seqs],
            max_query_len=max(len(new_tokens[b]) for b in seqs),
            max_seq_len=max(seq_lens),
            block_size=self.block_size,
        )
        with torch.no_grad():
            hidden = self.model(torch.tensor(ids), torch.cat(positions), self.kv_caches, meta)
            logits = self.model.compute_logits(hidden)
        return {b: logits[query_start[i] : query_start[i + 1]] for i, b in enumerate(seqs)}


def hf_logits(hf, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([tokens])).logits[0]


def _prompts(lengths, seed=1) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=generator).tolist() for n in lengths]


@pytest.fixture(params=list(CASES), scope="module")
def pair(request):
    return build_pair(request.param)


def test_single_prompt_prefill_matches_hf(pair):
    hf, ours = pair
    (prompt,) = _prompts([13])
    out = PagedRunner(ours, 1, 16).step({0: prompt})[0]
    expected = hf_logits(hf, prompt)
    assert expected.abs().max() > 1.0  # the comparison is not between near-zero logits
    torch.testing.assert_close(out, expected, atol=ATOL, rtol=0)


def test_ragged_batch_prefill_in_one_step_matches_hf(pair):
    hf, ours = pair
    prompts = _prompts([9, 1, 14, 4])
    out = PagedRunner(ours, len(prompts), 16).step(dict(enumerate(prompts)))
    for b, prompt in enumerate(prompts):
        torch.testing.assert_close(out[b], hf_logits(hf, prompt), atol=ATOL, rtol=0)


def test_decode_steps_after_prefill_match_hf(pair):
    hf, ours = pair
    prompts = _prompts([7, 3, 10])
    runner = PagedRunner(ours, len(prompts), 24)
    last = {b: logits[-1] for b, logits in runner.step(dict(enumerate(prompts))).items()}
    for _ in range(5):
        step = {b: [int(last[b].argmax())] for b in last}
        out = runner.step(step)
        for b in out:
            torch.testing.assert_close(out[b][0], hf_logits(hf, runner.tokens[b])[-1], atol=ATOL, rtol=0)
        last = {b: out[b][-1] for b in out}


def test_chunked_prefill_mixed_with_decode_matches_hf(pair):
    """A long prompt prefilled in chunks while another sequence decodes in the same steps."""
    hf, ours = pair
    long_prompt, short_prompt = _prompts([15, 5])
    runner = PagedRunner(ours, 2, 24, block_size=3)
    runner.step({1: short_prompt})
    for chunk in (long_prompt[:6], long_prompt[6:11], long_prompt[11:]):
        out = runner.step({0: chunk, 1: [int(runner.tokens[1][-1] * 7 % VOCAB)]})
        torch.testing.assert_close(out[0], hf_logits(hf, runner.tokens[0])[-len(chunk) :], atol=ATOL, rtol=0)
        torch.testing.assert_close(out[1][0], hf_logits(hf, runner.tokens[1])[-1], atol=ATOL, rtol=0)


def test_greedy_continuations_match_hf_generate(pair):
    hf, ours = pair
    # NOTE: seed 3 gave qwen2-sliding a 9.6e-5 near-tie, within float32 noise of HF's logits.
    prompts = _prompts([6, 11], seed=11)
    new_tokens = 12
    runner = PagedRunner(ours, len(prompts), 32)
    out = runner.step(dict(enumerate(prompts)))
    generated = {b: [greedy_token(out[b][-1], 2 * ATOL)] for b in out}
    for _ in range(new_tokens - 1):
        out = runner.step({b: [generated[b][-1]] for b in generated})
        for b in out:
            generated[b].append(greedy_token(out[b][0], 2 * ATOL))
    for b, prompt in enumerate(prompts):
        with torch.no_grad():
            # NOTE: an explicit attention mask, or generate masks prompt tokens equal to pad_token_id.
            expected = hf.generate(
                torch.tensor([prompt]),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.int64),
                max_new_tokens=new_tokens,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )[0, len(prompt) :]
        assert generated[b] == expected.tolist()


def test_kv_cache_spec_is_k_and_v_per_layer():
    _, ours = build_pair("qwen3")
    spec = ours.kv_cache_spec()
    assert spec.num_layers == 2
    assert spec.tensors_per_layer == ((2, 24), (2, 24))
    assert spec.bytes_per_token() == 2 * 2 * 2 * 24 * 4


def test_tied_embeddings_share_one_tensor():
    _, ours = build_pair("llama3-scaled-tied")
    assert ours.lm_head.weight is ours.model.embed_tokens.weight


def test_sliding_windows_per_layer():
    _, mistral = build_pair("mistral-sliding")
    _, qwen2 = build_pair("qwen2-sliding")
    assert mistral.settings.sliding_windows == (5, 5)
    assert qwen2.settings.sliding_windows == (None, 6)


def test_load_weights_rejects_unknown_and_missing_tensors():
    hf, ours = build_pair("llama")
    state = dict(hf.state_dict())
    with pytest.raises(ValueError, match="model.layers.0.self_attn.rotary_gate.weight"):
        ours.load_weights([*state.items(), ("model.layers.0.self_attn.rotary_gate.weight", torch.zeros(1))])
    del state["model.layers.1.self_attn.k_proj.weight"]
    with pytest.raises(ValueError, match=r"missing 1 weight.*qkv_proj.weight\[shard 1\]"):
        ours.load_weights(state.items())


def test_unsupported_activation_is_rejected():
    config = LlamaConfig(**_COMMON, num_attention_heads=4, hidden_act="gelu").to_dict()
    with pytest.raises(ValueError, match="hidden_act='gelu'"):
        model_class("LlamaForCausalLM")(ModelConfig(hf=config))


@pytest.mark.parametrize(
    "hf_config, expected",
    [
        ({"rope_theta": 5e5}, (5e5, None, 64)),
        ({"rope_parameters": {"rope_theta": 1e6, "rope_type": "default"}, "rope_theta": 7.0}, (1e6, None, 64)),
        (
            {"rope_theta": 5e5, "max_position_embeddings": 4096, "rope_scaling": {"type": "linear", "factor": 2.0}},
            (5e5, {"type": "linear", "factor": 2.0, "rope_type": "linear"}, 64),
        ),
        (
            {"rope_parameters": {"rope_theta": 1e4, "rope_type": "yarn", "factor": 4.0}, "max_position_embeddings": 4096},
            (1e4, {"rope_theta": 1e4, "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096}, 64),
        ),
        ({"rope_parameters": {"rope_theta": 1e4, "partial_rotary_factor": 0.5}}, (1e4, None, 32)),
    ],
)
def test_rope_settings_read_both_config_spellings(hf_config, expected):
    assert rope_settings(hf_config, head_dim=64) == expected
