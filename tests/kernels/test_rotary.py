"""rope_cache and rotary_embedding against transformers' RoPE init functions and
apply_rotary_pos_emb (Llama, neox) / apply_rotary_pos_emb_interleave (DeepSeek-V3)."""

import pytest
import torch
from transformers import DeepseekV3Config, LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.deepseek_v3.modeling_deepseek_v3 import apply_rotary_pos_emb_interleave
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

from flotilla.kernels.registry import get
from flotilla.kernels.rotary import rope_cache

HEAD_DIM = 32
MAX_POS = 256


def _llama_config(rope_parameters, head_dim=HEAD_DIM, partial_rotary_factor=None):
    config = LlamaConfig(
        hidden_size=head_dim * 4,
        num_attention_heads=4,
        head_dim=head_dim,
        max_position_embeddings=MAX_POS,
        rope_parameters=rope_parameters,
    )
    if partial_rotary_factor is not None:
        config.rope_parameters["partial_rotary_factor"] = partial_rotary_factor
    return config


def _hf_cos_sin(config, positions):
    """HF's cos/sin ([T, head_dim], cat(freqs, freqs) layout, attention factor applied)."""
    rope = LlamaRotaryEmbedding(config)
    x = torch.zeros(1, 1, dtype=torch.float32)
    cos, sin = rope(x, positions.unsqueeze(0))
    return cos[0], sin[0]


SCALINGS = {
    "default": {"rope_type": "default", "rope_theta": 10000.0},
    "linear": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
    "dynamic": {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0},
    "llama3": {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    },
    "yarn": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64},
    "yarn-deepseek": {
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 40.0,
        "original_max_position_embeddings": 64,
        "beta_fast": 32,
        "beta_slow": 1,
        "mscale": 0.707,
        "mscale_all_dim": 1.0,
    },
}


@pytest.mark.parametrize("name", list(SCALINGS))
def test_rope_cache_matches_transformers(name):
    params = SCALINGS[name]
    config = _llama_config(dict(params))
    positions = torch.arange(MAX_POS)
    hf_cos, hf_sin = _hf_cos_sin(config, positions)
    cache = rope_cache(HEAD_DIM, MAX_POS, params["rope_theta"], scaling=params)
    cos, sin = cache.chunk(2, dim=-1)
    # Same float32 operations as HF (outer product instead of a K=1 matmul): 1 ulp of
    # cos/sin at angles up to ~256 rad is ~2e-5 relative; allow a little more.
    torch.testing.assert_close(cos, hf_cos[:, : HEAD_DIM // 2], rtol=0, atol=1e-5)
    torch.testing.assert_close(sin, hf_sin[:, : HEAD_DIM // 2], rtol=0, atol=1e-5)


@pytest.mark.parametrize("name", ["linear", "llama3", "yarn", "yarn-deepseek"])
def test_inv_freq_matches_rope_init_function(name):
    """The frequencies themselves (so the cache test is not just comparing cosines)."""
    params = SCALINGS[name]
    config = _llama_config(dict(params))
    inv_freq, attention_factor = ROPE_INIT_FUNCTIONS[params["rope_type"]](config, "cpu")
    cache = rope_cache(HEAD_DIM, 2, params["rope_theta"], scaling=params)
    # Row 1 holds cos(inv_freq) * attention_factor and sin(inv_freq) * attention_factor.
    cos1, sin1 = cache[1].chunk(2)
    torch.testing.assert_close(cos1, inv_freq.cos() * attention_factor, rtol=0, atol=1e-6)
    torch.testing.assert_close(sin1, inv_freq.sin() * attention_factor, rtol=0, atol=1e-6)
    torch.testing.assert_close(cache[0, : HEAD_DIM // 2], torch.full((HEAD_DIM // 2,), attention_factor))


def test_yarn_attention_factor_is_applied():
    """Plain YaRN scales cos/sin by 0.1 ln(factor) + 1; DeepSeek's mscale pair cancels to 1 when equal."""
    cache = rope_cache(16, 1, 10000.0, scaling=SCALINGS["yarn"])
    assert cache[0, 0].item() == pytest.approx(0.1 * torch.log(torch.tensor(4.0)).item() + 1)
    equal = {**SCALINGS["yarn-deepseek"], "mscale": 1.0, "mscale_all_dim": 1.0}
    assert rope_cache(16, 1, 10000.0, scaling=equal)[0, 0].item() == pytest.approx(1.0)


def test_legacy_type_key_and_unknown_type():
    legacy = {"type": "linear", "factor": 2.0}
    torch.testing.assert_close(
        rope_cache(8, 16, 10000.0, scaling=legacy),
        rope_cache(8, 16, 10000.0, scaling={"rope_type": "linear", "factor": 2.0}),
    )
    with pytest.raises(ValueError, match="unsupported rope_type 'su'"):
        rope_cache(8, 16, 10000.0, scaling={"rope_type": "su"})


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_neox_rotation_matches_llama(dtype):
    torch.manual_seed(0)
    params = SCALINGS["llama3"]
    config = _llama_config(dict(params))
    positions = torch.tensor([0, 5, 17, 3, 200, 255])
    T = positions.numel()
    q, k = torch.randn(T, 4, HEAD_DIM).to(dtype), torch.randn(T, 2, HEAD_DIM).to(dtype)
    cos, sin = _hf_cos_sin(config, positions)
    # HF layout [batch, heads, seq, dim]; our layout [T, heads, dim].
    hf_q, hf_k = apply_rotary_pos_emb(
        q.transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0), cos.unsqueeze(0).to(dtype), sin.unsqueeze(0).to(dtype)
    )
    cache = rope_cache(HEAD_DIM, MAX_POS, params["rope_theta"], scaling=params)
    out_q, out_k = get("rotary_embedding")(positions, q, k, cache, is_neox=True)
    assert out_q.dtype == dtype
    # fp32: cos/sin agree to ~1e-6 (see above), |q| ~ 4 sigma -> 1e-5. bf16: one bf16 ulp near 4 (3e-2).
    atol = 1e-5 if dtype == torch.float32 else 3.2e-2
    torch.testing.assert_close(out_q, hf_q[0].transpose(0, 1), rtol=0, atol=atol)
    torch.testing.assert_close(out_k, hf_k[0].transpose(0, 1), rtol=0, atol=atol)


def test_partial_rotary_leaves_tail_untouched():
    torch.manual_seed(0)
    positions = torch.tensor([1, 9, 30])
    rotary_dim = 8
    q, k = torch.randn(3, 2, HEAD_DIM), torch.randn(3, 1, HEAD_DIM)
    cache = rope_cache(rotary_dim, 64, 10000.0)
    out_q, out_k = get("rotary_embedding")(positions, q, k, cache, rotary_dim=rotary_dim)
    torch.testing.assert_close(out_q[..., rotary_dim:], q[..., rotary_dim:], rtol=0, atol=0)
    # The rotated part equals a full rotation of a rotary_dim-wide head.
    full_q, _ = get("rotary_embedding")(positions, q[..., :rotary_dim].contiguous(), None, cache)
    torch.testing.assert_close(out_q[..., :rotary_dim], full_q, rtol=0, atol=0)
    assert out_k.shape == k.shape


def test_interleaved_matches_deepseek_up_to_layout():
    """GPT-J style pairs; HF returns the rotated pairs de-interleaved, we keep them interleaved."""
    torch.manual_seed(0)
    rope_dim = 16
    params = SCALINGS["yarn-deepseek"]
    config = DeepseekV3Config(
        hidden_size=64, num_attention_heads=4, qk_rope_head_dim=rope_dim, max_position_embeddings=MAX_POS,
        rope_parameters=dict(params), rope_interleave=True,
    )
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3RotaryEmbedding

    positions = torch.tensor([0, 3, 64, 255])
    cos, sin = DeepseekV3RotaryEmbedding(config)(torch.zeros(1), positions.unsqueeze(0))
    q_pe, k_pe = torch.randn(4, 4, rope_dim), torch.randn(4, rope_dim)
    hf_q, hf_k = apply_rotary_pos_emb_interleave(
        q_pe.transpose(0, 1).unsqueeze(0), k_pe.unsqueeze(0).unsqueeze(0), cos, sin
    )
    cache = rope_cache(rope_dim, MAX_POS, params["rope_theta"], scaling=params)
    out_q, out_k = get("rotary_embedding")(positions, q_pe, k_pe, cache, is_neox=False)
    deinterleave = torch.cat([torch.arange(0, rope_dim, 2), torch.arange(1, rope_dim, 2)])
    torch.testing.assert_close(out_q[..., deinterleave], hf_q[0].transpose(0, 1), rtol=0, atol=1e-5)
    torch.testing.assert_close(out_k[..., deinterleave], hf_k[0, 0], rtol=0, atol=1e-5)
    # Layout aside, dot products (all attention sees) are identical.
    torch.testing.assert_close(
        torch.einsum("thd,td->th", out_q, out_k), torch.einsum("htd,td->th", hf_q[0], hf_k[0, 0]), rtol=0, atol=1e-4
    )
