"""Tiny random-weight HF checkpoints for engine and cluster tests."""

from __future__ import annotations

from pathlib import Path

import torch

from helpers.margins import topk_margin


def save_tiny_llama(path: Path, vocab_size: int = 256, seed: int = 0, max_position_embeddings: int = 256):
    """Save a seeded tiny random Llama to ``path`` (safetensors); returns the HF model
    (``max_position_embeddings``: its context).

    NOTE: initializer_range 0.2 (not HF's 0.02) spreads the logits (|logits| <= ~5), so
    greedy choices are decided by margins far above float32 summation-order noise (<= 6e-6,
    ``helpers.margins.ENGINE_MIN_LEAD``), including the reduction-order differences of a
    sharded (tensor-parallel) model: over the engine tests' prompts the smallest lead of a
    greedy token over the runner-up is 1.7e-4 (asserted for ``tiny_llama_prompts``).
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_hidden_layers=2,
        vocab_size=vocab_size,
        max_position_embeddings=max_position_embeddings,
        initializer_range=0.2,
    )
    model = LlamaForCausalLM(config).eval()
    model.save_pretrained(path)
    return model


def save_word_tokenizer(path: Path, vocab_size: int = 256) -> None:
    """Save a word-level tokenizer for a tiny model to ``path``: token ``i`` is the word
    ``w<i>`` and text is words joined by spaces, so a completion's text reads back as its
    token ids (:func:`word_token_ids`). No token is special (none is dropped from text)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.WordLevel({f"w{i}": i for i in range(vocab_size)}, unk_token="w0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.decoder = decoders.WordPiece(prefix="##")  # NOTE: joins words with spaces
    PreTrainedTokenizerFast(tokenizer_object=tokenizer).save_pretrained(path)


def word_token_ids(text: str) -> list[int]:
    """The token ids of a text written by :func:`save_word_tokenizer`'s tokenizer."""
    return [int(word[1:]) for word in text.split()]


def hf_greedy(model, prompt: list[int], new_tokens: int, min_lead: float | None = None) -> list[int]:
    """HF's greedy continuation with end-of-sequence switched off: ``ignore_eos`` semantics
    (``min_new_tokens`` would instead forbid the eos token and change the choice).

    With ``min_lead`` (``helpers.margins.ENGINE_MIN_LEAD`` for a comparison with the engine),
    asserts that every chosen token leads the runner-up by more than it, so the tokens it is
    compared with cannot differ by a near-tie."""
    model.generation_config.eos_token_id = None
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]), max_new_tokens=new_tokens, do_sample=False,
            output_logits=True, return_dict_in_generate=True,
        )  # fmt: skip
    if min_lead is not None:
        lead = topk_margin(torch.cat(out.logits))
        assert lead > min_lead, f"greedy near-tie in HF's continuation: a lead of {lead:.3g} <= {min_lead:.3g}"
    return out.sequences[0, len(prompt) :].tolist()
