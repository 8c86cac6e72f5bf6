"""A seeded tiny random-weight DeepSeek-V2 checkpoint (MLA) for cluster and engine tests."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch

# MLA shapes as in DeepSeek-V2 (latent much wider than a head's value), scaled down; 4 heads
# so tp=2 / dcp=2 leaves each rank 2 heads of its own and a DCP group of 4.
TINY_DEEPSEEK_V2 = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    kv_lora_rank=32,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=12,
    n_routed_experts=4,
    num_experts_per_tok=2,
    n_shared_experts=1,
    max_position_embeddings=256,
)

# DeepSeek-V3's layout scaled down (query LoRA, grouped routing with a correction bias, one dense
# layer first) with one MTP layer: the MTP and NEXTN tests' target.
TINY_DEEPSEEK_V3_MTP = dict(
    vocab_size=128, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2,
    num_attention_heads=4, kv_lora_rank=32, q_lora_rank=24, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12,
    n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1, n_shared_experts=1, first_k_dense_replace=1,
    norm_topk_prob=True, routed_scaling_factor=2.5, max_position_embeddings=256, num_nextn_predict_layers=1,
)  # fmt: skip


def save_tiny_deepseek_v2(path: Path, q_lora_rank: int | None = None, seed: int = 0, **overrides: Any):
    """Save a seeded tiny random DeepSeek-V2 to ``path`` (safetensors); returns the HF model.

    Every layer's MLP is dense (``first_k_dense_replace = num_hidden_layers``) unless
    ``overrides`` say otherwise. ``q_lora_rank=None`` is the V2-Lite query path (one
    ``q_proj``); an integer adds the ``q_a_proj -> q_a_layernorm -> q_b_proj`` path.

    NOTE: weights are drawn unit-scale (``randn / sqrt(fan_in)``, norms ``1 + 0.2 randn``,
    embeddings ``randn``), so logits spread over several units and greedy choices are decided
    by margins far above float32 summation-order noise, including a sharded model's (~1e-6
    here): the smallest greedy lead measured over the DCP, EP and KV-runner tests is 3.8e-3.
    """
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

    settings = {**TINY_DEEPSEEK_V2, "first_k_dense_replace": TINY_DEEPSEEK_V2["num_hidden_layers"], **overrides}
    config = DeepseekV2Config(**settings, q_lora_rank=q_lora_rank)
    torch.manual_seed(seed)
    model = DeepseekV2ForCausalLM(config).eval()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            if param.dim() == 1:
                param.copy_(1 + 0.2 * noise if name.endswith("norm.weight") else 0.1 * noise)
            elif "embed_tokens" in name:
                param.copy_(noise)
            else:
                param.copy_(noise / math.sqrt(param.shape[-1]))
    model.save_pretrained(path)
    return model


def save_tiny_deepseek_v3(path: Path, seed: int = 0):
    """Save a seeded tiny random DeepSeek-V3 (:data:`TINY_DEEPSEEK_V3_MTP` without its MTP
    layer: query LoRA, grouped routing over 8 experts with a drawn correction bias, one dense
    layer first) to ``path``; returns the HF model. Weights as ``tiny_fp8.randomize`` draws
    them (routers x4), so greedy choices lead by far more than a sharded model's noise."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    from helpers.tiny_fp8 import randomize
    from helpers.tiny_glm import randomize_correction_bias

    settings = {k: v for k, v in TINY_DEEPSEEK_V3_MTP.items() if k != "num_nextn_predict_layers"}
    torch.manual_seed(seed)
    model = DeepseekV3ForCausalLM(DeepseekV3Config(**settings)).eval()
    randomize(model, seed)
    randomize_correction_bias(model, seed)
    model.save_pretrained(path)
    return model
