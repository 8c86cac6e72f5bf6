"""A seeded tiny random-weight GLM-4.5 (``Glm4MoeForCausalLM``) for model and engine tests.

GLM-4.5's features at test size: GQA (4 q / 2 KV heads, so attention TP 2 leaves one KV head
per rank), partial rotary (half of each 16-wide head rotates), q/k RMSNorm, q/k/v biases
without an o_proj bias, sigmoid routing over 2 expert groups (one chosen) with a non-zero
correction bias, 8 experts top-2 (EP up to 4), a shared expert, the first layer dense.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from helpers.tiny_fp8 import randomize

TINY_GLM4_MOE = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=32,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_shared_experts=1,
    n_group=2,
    topk_group=1,
    first_k_dense_replace=1,
    routed_scaling_factor=2.5,
    norm_topk_prob=True,
    use_qk_norm=True,
    attention_bias=True,
    max_position_embeddings=256,
    num_nextn_predict_layers=0,
)


def randomize_correction_bias(model: torch.nn.Module, seed: int = 0) -> None:
    """HF starts ``e_score_correction_bias`` (a buffer) at zero; draw it so it changes choices."""
    generator = torch.Generator().manual_seed(seed + 17)
    with torch.no_grad():
        for module in model.modules():
            bias = getattr(module, "e_score_correction_bias", None)
            if isinstance(bias, torch.Tensor):
                bias.copy_(0.05 * torch.randn(bias.shape, generator=generator))


def tiny_glm4_moe(seed: int = 0, **overrides: Any):
    """The seeded HF model (float32, eval) of :data:`TINY_GLM4_MOE` with ``overrides``.

    NOTE: unit-scale weights (:func:`helpers.tiny_fp8.randomize`: logits spread over several
    units, routers x4), so greedy choices and expert choices are decided by margins far above
    float32 summation-order noise, including a sharded model's.
    """
    from transformers import Glm4MoeConfig, Glm4MoeForCausalLM

    torch.manual_seed(seed)
    model = Glm4MoeForCausalLM(Glm4MoeConfig(**{**TINY_GLM4_MOE, **overrides})).eval()
    randomize(model, seed)
    randomize_correction_bias(model, seed)
    return model


def save_tiny_glm4_moe(path: Path, seed: int = 0, **overrides: Any):
    """Save :func:`tiny_glm4_moe` to ``path`` (safetensors, one tensor per expert matrix as the
    real checkpoints have); returns the HF model."""
    model = tiny_glm4_moe(seed, **overrides)
    model.save_pretrained(path)
    return model
