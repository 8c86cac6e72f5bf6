"""Tiny random-weight HF checkpoints for engine and cluster tests."""

from __future__ import annotations

from pathlib import Path

import torch


def save_tiny_llama(path: Path, vocab_size: int = 256, seed: int = 0):
    """Save a seeded tiny random Llama to ``path`` (safetensors); returns the HF model.

    NOTE: initializer_range 0.2 (not HF's 0.02) spreads the logits, so greedy choices are
    decided by margins far above float32 summation-order noise (~1e-6), including the
    reduction-order differences of a sharded (tensor-parallel) model.
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
        max_position_embeddings=256,
        initializer_range=0.2,
    )
    model = LlamaForCausalLM(config).eval()
    model.save_pretrained(path)
    return model
