"""``attention_shape()`` of every model family: per-rank heads after tensor parallelism,
the softmax scale the layers really pass (DeepSeek's YaRN ``mscale**2`` included), the
sliding window and the dtype; MLA models describe their latent (absorbed) attention."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import DeepseekV2Config, LlamaConfig, MistralConfig, MixtralConfig, Qwen2Config, Qwen3Config, Qwen3MoeConfig

from flotilla.cluster.models.base import ModelConfig, ParallelLayout
from flotilla.cluster.models.registry import model_class
from flotilla.kernels.attention import AttentionShape
from tests.helpers.tiny_deepseek import TINY_DEEPSEEK_V2

_SMALL = dict(vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=2, max_position_embeddings=128)


def _build(hf_config, architecture: str, **model_config) -> torch.nn.Module:
    hf = hf_config.to_dict()
    hf["architectures"] = [architecture]
    return model_class(architecture)(ModelConfig(hf=hf, **model_config))


def test_llama_gqa_shape():
    model = _build(LlamaConfig(**_SMALL, num_attention_heads=4, num_key_value_heads=2), "LlamaForCausalLM")
    assert model.attention_shape() == AttentionShape(
        num_q_heads=4, num_kv_heads=2, head_dim=16, head_dim_v=16, scale=16**-0.5, sliding_window=None, dtype=torch.float32
    )


@pytest.mark.parametrize("tp_size, q_heads, kv_heads", [(2, 2, 1), (4, 1, 1)])
def test_llama_heads_are_per_rank_and_kv_heads_replicate_past_their_count(tp_size, q_heads, kv_heads):
    config = LlamaConfig(**_SMALL, num_attention_heads=4, num_key_value_heads=2)
    model = _build(config, "LlamaForCausalLM", parallel=ParallelLayout(tp_size=tp_size, tp_rank=tp_size - 1))
    shape = model.attention_shape()
    assert (shape.num_q_heads, shape.num_kv_heads, shape.head_dim) == (q_heads, kv_heads, 16)


def test_mistral_window_and_dtype():
    config = MistralConfig(**_SMALL, num_attention_heads=4, num_key_value_heads=2, sliding_window=5)
    shape = _build(config, "MistralForCausalLM", dtype=torch.bfloat16).attention_shape()
    assert shape.sliding_window == 5 and shape.dtype == torch.bfloat16


def test_qwen3_explicit_head_dim_sets_dims_and_scale():
    config = Qwen3Config(**_SMALL, num_attention_heads=4, num_key_value_heads=2, head_dim=24)
    shape = _build(config, "Qwen3ForCausalLM").attention_shape()
    assert (shape.head_dim, shape.head_dim_v) == (24, 24)
    assert shape.scale == pytest.approx(24**-0.5)


def test_mixed_windows_are_rejected_with_the_windows_named():
    config = Qwen2Config(
        **_SMALL, num_attention_heads=4, num_key_value_heads=4, use_sliding_window=True, sliding_window=6, max_window_layers=1
    )
    model = _build(config, "Qwen2ForCausalLM")
    with pytest.raises(ValueError, match="different attention windows per layer"):
        model.attention_shape()


def test_qwen3_moe_and_mixtral_shapes():
    qwen = Qwen3MoeConfig(
        **_SMALL, num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=32,
    )
    shape = _build(qwen, "Qwen3MoeForCausalLM", parallel=ParallelLayout(tp_size=2)).attention_shape()
    assert (shape.num_q_heads, shape.num_kv_heads, shape.head_dim, shape.sliding_window) == (2, 1, 16, None)
    assert shape.scale == pytest.approx(16**-0.5) and not shape.is_mla
    mixtral = MixtralConfig(
        **_SMALL, num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, sliding_window=7
    )
    assert _build(mixtral, "MixtralForCausalLM").attention_shape().sliding_window == 7


def test_deepseek_mla_shape_is_the_latent_attention():
    config = DeepseekV2Config(**TINY_DEEPSEEK_V2, first_k_dense_replace=2)
    shape = _build(config, "DeepseekV2ForCausalLM", parallel=ParallelLayout(tp_size=2, tp_rank=1)).attention_shape()
    latent, rope = TINY_DEEPSEEK_V2["kv_lora_rank"], TINY_DEEPSEEK_V2["qk_rope_head_dim"]
    assert shape == AttentionShape(
        num_q_heads=2,
        num_kv_heads=1,
        head_dim=latent + rope,
        head_dim_v=latent,
        scale=(TINY_DEEPSEEK_V2["qk_nope_head_dim"] + rope) ** -0.5,
        sliding_window=None,
        dtype=torch.float32,
        kv_lora_rank=latent,
        qk_rope_head_dim=rope,
    )
    assert shape.is_mla


def test_deepseek_yarn_mscale_multiplies_the_scale():
    yarn = dict(
        type="yarn", factor=40.0, original_max_position_embeddings=64, mscale=0.707, mscale_all_dim=0.707,
        beta_fast=32, beta_slow=1,
    )
    config = DeepseekV2Config(**TINY_DEEPSEEK_V2, first_k_dense_replace=2, rope_scaling=yarn)
    shape = _build(config, "DeepseekV2ForCausalLM").attention_shape()
    mscale = 0.1 * 0.707 * math.log(40.0) + 1.0
    expected = (TINY_DEEPSEEK_V2["qk_nope_head_dim"] + TINY_DEEPSEEK_V2["qk_rope_head_dim"]) ** -0.5 * mscale**2
    assert shape.scale == pytest.approx(expected)
    assert shape.scale > 1.1 * (TINY_DEEPSEEK_V2["qk_nope_head_dim"] + TINY_DEEPSEEK_V2["qk_rope_head_dim"]) ** -0.5


def test_deepseek_dcp_attends_for_the_whole_dcp_group():
    config = DeepseekV2Config(**TINY_DEEPSEEK_V2, first_k_dense_replace=2)
    parallel = ParallelLayout(tp_size=2, tp_rank=0, dcp_size=2, dcp_rank=0, comms={"dcp": object()})
    shape = _build(config, "DeepseekV2ForCausalLM", parallel=parallel).attention_shape()
    assert shape.num_q_heads == TINY_DEEPSEEK_V2["num_attention_heads"]  # 2 own heads x 2 DCP ranks


def test_backends_default_to_torch_and_reach_the_ops():
    """An unknown backend name fails when the model is built, naming the backend."""
    config = ModelConfig(hf={})
    assert (config.elementwise_backend, config.moe_backend) == ("torch", "torch")
    with pytest.raises(ValueError, match="'nope'"):
        _build(LlamaConfig(**_SMALL, num_attention_heads=4), "LlamaForCausalLM", elementwise_backend="nope")
    moe = Qwen3MoeConfig(**_SMALL, num_attention_heads=4, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
    with pytest.raises(ValueError, match="'nope'"):
        _build(moe, "Qwen3MoeForCausalLM", moe_backend="nope")
