"""A seeded tiny random-weight Qwen3-MoE checkpoint on disk for the expert-parallel tests: the
model tests over rank processes and the engine tests on Ray load it by path. (A DeepSeek-V2
with routed and shared experts: ``helpers.tiny_deepseek.save_tiny_deepseek_v2`` with
``first_k_dense_replace`` below ``num_hidden_layers``.)"""

from __future__ import annotations

from pathlib import Path

import torch

# Shapes every parallel layout of the tests can shard: 4 q / 2 KV heads (attention TP up to 2),
# 8 experts (EP up to 4, or 2 with 2 redundant slots), expert width 32 (MoE TP up to 4).
_QWEN3_MOE = dict(
    vocab_size=256,
    hidden_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    intermediate_size=96,
    moe_intermediate_size=32,
    num_hidden_layers=3,
    num_experts=8,
    num_experts_per_tok=2,
    norm_topk_prob=True,
    mlp_only_layers=[1],
    max_position_embeddings=256,
)


def save_tiny_qwen3_moe(path: Path, seed: int = 0):
    """Save a seeded tiny random Qwen3-MoE to ``path`` (safetensors, one tensor per expert
    matrix as real checkpoints have); returns the HF model.

    Layers 0 and 2 are sparse (8 experts, top-2, renormalised), layer 1 dense.

    NOTE: initializer_range 0.2 (not HF's 0.02) spreads the logits, so greedy choices are
    decided by margins far above float32 summation-order noise (<= 6e-6,
    ``helpers.margins.ENGINE_MIN_LEAD``), including the reduction-order differences of a
    sharded (tensor- or expert-parallel) model: the smallest greedy lead measured over the EP
    and elastic tests' prompts is 2.7e-3. It spreads the router logits the same way: the
    closest last-chosen / first-unchosen experts are 1.9e-4 apart in routing probability,
    against ~1.5e-6 of rounding (6e-6 on logits times p(1 - p) <= 1/4).
    """
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**_QWEN3_MOE, initializer_range=0.2)).eval()
    model.save_pretrained(path)
    return model
