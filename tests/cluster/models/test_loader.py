"""Model sources and weight loading: HF directories (safetensors, sharded or not, and
.bin), GGUF files written here from tiny HF models, the architecture registry, and
the errors a user sees for a bad ``--model``.

Every load is checked end to end: the loaded model's prefill logits must match the
HF model the checkpoint was written from (atol 1e-4 in float32: same weights, only
the order of float32 sums differs, which moves logits by ~1e-6).
"""

from __future__ import annotations

import json
import math
import os

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config

from flotilla.cluster.models.gguf_loader import gguf_config, hf_tensor_name, undo_rope_permutation
from flotilla.cluster.models.loader import weight_files
from flotilla.cluster.models.registry import model_class, supported_architectures
from flotilla.cluster.models.sources import ModelSource, load_model, resolve_dtype, resolve_model_source
from flotilla.cluster.models.tokenizer import load_tokenizer
from flotilla.kernels.attention import AttentionMetadata

os.environ.setdefault("HF_HUB_OFFLINE", "1")

ATOL = 1e-4
_COMMON = dict(vocab_size=80, hidden_size=48, intermediate_size=96, num_hidden_layers=2, max_position_embeddings=64)
CONFIGS = {
    "llama": (LlamaConfig, "LlamaForCausalLM", dict(num_attention_heads=4, num_key_value_heads=2)),
    "qwen2": (Qwen2Config, "Qwen2ForCausalLM", dict(num_attention_heads=4, num_key_value_heads=2)),
    "qwen3": (Qwen3Config, "Qwen3ForCausalLM", dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=True)),
}
PROMPT = [3, 17, 42, 8, 8, 61, 5, 29, 70, 1]


def tiny_hf_model(kind: str = "llama", seed: int = 0):
    config_class, architecture, extra = CONFIGS[kind]
    config = config_class(**_COMMON, **extra)
    config.architectures = [architecture]
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).eval()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # unit-scale weights so logits are O(1), not ~0
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            scale = 0.2 if param.dim() == 1 else (1.0 if "embed" in name else 1 / math.sqrt(param.shape[1]))
            param.copy_(noise * scale + (1.0 if name.endswith("norm.weight") else 0.0))
    return model


def prefill_logits(model, tokens=PROMPT) -> torch.Tensor:
    n, block_size = len(tokens), 4
    blocks = -(-n // block_size)
    meta = AttentionMetadata(
        slot_mapping=torch.arange(n),
        query_start=torch.tensor([0, n]),
        seq_lens=torch.tensor([n]),
        block_tables=torch.arange(blocks).unsqueeze(0),
        max_query_len=n,
        max_seq_len=n,
        block_size=block_size,
    )
    caches = model.kv_cache_spec().allocate(blocks, block_size)
    with torch.no_grad():
        return model.compute_logits(model(torch.tensor(tokens), torch.arange(n), caches, meta))


def hf_prefill_logits(hf, tokens=PROMPT) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([tokens])).logits[0]


# --- HF directories --------------------------------------------------------------


@pytest.mark.parametrize("shard_size", [None, "40KB"], ids=["single-file", "sharded"])
def test_safetensors_directory_round_trip(tmp_path, shard_size):
    hf = tiny_hf_model("llama")
    hf.save_pretrained(tmp_path, **({"max_shard_size": shard_size} if shard_size else {}))
    files = weight_files(tmp_path)
    assert all(f.suffix == ".safetensors" for f in files)
    assert (len(files) > 1) == (shard_size is not None)
    assert (tmp_path / "model.safetensors.index.json").exists() == (shard_size is not None)
    source = resolve_model_source(str(tmp_path))
    assert source.kind == "hf_dir" and source.tokenizer_source == tmp_path.resolve()
    model = load_model(source)
    torch.testing.assert_close(prefill_logits(model), hf_prefill_logits(hf), atol=ATOL, rtol=0)


def test_sharded_bin_directory_round_trip(tmp_path):
    hf = tiny_hf_model("qwen2")
    hf.config.save_pretrained(tmp_path)
    state = hf.state_dict()
    names = sorted(state)
    shards = {"pytorch_model-00001-of-00002.bin": names[::2], "pytorch_model-00002-of-00002.bin": names[1::2]}
    for file_name, shard_names in shards.items():
        torch.save({n: state[n].clone() for n in shard_names}, tmp_path / file_name)
    weight_map = {n: f for f, shard_names in shards.items() for n in shard_names}
    (tmp_path / "pytorch_model.bin.index.json").write_text(json.dumps({"weight_map": weight_map}))
    model = load_model(resolve_model_source(str(tmp_path)))
    torch.testing.assert_close(prefill_logits(model), hf_prefill_logits(hf), atol=ATOL, rtol=0)


def test_load_model_casts_to_the_requested_dtype(tmp_path):
    hf = tiny_hf_model("llama")
    hf.save_pretrained(tmp_path)
    model = load_model(resolve_model_source(str(tmp_path)), "bfloat16")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.kv_cache_spec().dtype == torch.bfloat16
    # bfloat16 rounds weights and activations to 8 significant bits (2^-9 = 2e-3 relative) at
    # every layer: errors of ~1% of logits up to ~3 (max 0.034 over these 10 x 80 logits, the
    # same under every MKL_CBWR / ATEN_CPU_CAPABILITY / thread setting tried: the float32
    # accumulation order barely moves it). atol 0.1 is ~10 standard deviations of it; a
    # tensor loaded transposed, unconverted or into the wrong slot moves logits by O(1).
    torch.testing.assert_close(prefill_logits(model), hf_prefill_logits(hf), atol=0.1, rtol=0)


def test_resolve_dtype():
    source = ModelSource(kind="hf_dir", path=None, config_dict={"torch_dtype": "bfloat16"}, tokenizer_source=None)
    assert resolve_dtype("auto", source, "cpu") == torch.float32
    assert resolve_dtype("auto", source, "cuda") == torch.bfloat16
    assert resolve_dtype("float16", source) == torch.float16
    assert resolve_dtype(torch.float64, source) == torch.float64
    with pytest.raises(ValueError, match="dtype='int8'"):
        resolve_dtype("int8", source)


def test_directory_without_weights_is_a_clear_error(tmp_path):
    tiny_hf_model("llama").config.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="holds no weights"):
        load_model(resolve_model_source(str(tmp_path)))


# --- GGUF ------------------------------------------------------------------------


def _llama_cpp_permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's converter: RoPE halves -> interleaved pairs, per head."""
    return weight.reshape(num_heads, 2, weight.shape[0] // num_heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


_GGUF_NAMES = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def write_gguf(hf, arch: str, path) -> None:
    """Write ``hf`` as llama.cpp would (float32 tensors, llama's Q/K permutation)."""
    import gguf

    cfg = hf.config
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name(f"tiny {arch}")
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_vocab_size(cfg.vocab_size)
    if getattr(cfg, "head_dim", None):
        writer.add_key_length(cfg.head_dim)
        writer.add_value_length(cfg.head_dim)
    for name, tensor in hf.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        values = tensor.numpy().astype(np.float32)
        if arch == "llama" and ".q_proj." in name:
            values = _llama_cpp_permute(values, cfg.num_attention_heads)
        elif arch == "llama" and ".k_proj." in name:
            values = _llama_cpp_permute(values, cfg.num_key_value_heads)
        writer.add_tensor(_gguf_name(name), values)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _gguf_name(hf_name: str) -> str:
    globals_ = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight", "lm_head.weight": "output.weight"}
    if hf_name in globals_:
        return globals_[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    return f"blk.{layer}.{_GGUF_NAMES[module]}.{kind}"


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_gguf_file_round_trip(tmp_path, arch):
    hf = tiny_hf_model(arch)
    path = tmp_path / f"tiny-{arch}.gguf"
    write_gguf(hf, arch, path)
    source = resolve_model_source(str(path))
    assert source.kind == "gguf" and source.tokenizer_source == path.resolve()
    config = source.config_dict
    assert config["architectures"] == [CONFIGS[arch][1]]
    assert config["tie_word_embeddings"] == hf.config.tie_word_embeddings
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (4, 2)
    model = load_model(source)
    torch.testing.assert_close(prefill_logits(model), hf_prefill_logits(hf), atol=ATOL, rtol=0)


def test_directory_holding_one_gguf_resolves_to_it(tmp_path):
    write_gguf(tiny_hf_model("qwen3"), "qwen3", tmp_path / "only.gguf")
    source = resolve_model_source(str(tmp_path))
    assert source.kind == "gguf" and source.path == (tmp_path / "only.gguf").resolve()
    assert gguf_config(source.path)["head_dim"] == 16


def test_missing_tokenizer_is_a_clear_error(tmp_path):
    write_gguf(tiny_hf_model("qwen3"), "qwen3", tmp_path / "no-vocab.gguf")
    with pytest.raises(ValueError, match="needs tokenizer.ggml"):
        load_tokenizer(resolve_model_source(str(tmp_path / "no-vocab.gguf")))
    with pytest.raises(ValueError, match="neither a model directory nor a .gguf file"):
        load_tokenizer(tmp_path / "missing")


def test_undo_rope_permutation_inverts_llama_cpp():
    weight = torch.arange(8 * 3 * 2, dtype=torch.float32).view(8 * 2, 3)  # 2 heads of dim 8
    permuted = torch.from_numpy(_llama_cpp_permute(weight.numpy(), 2))
    assert not torch.equal(permuted, weight)
    assert torch.equal(undo_rope_permutation(permuted, 2), weight)


def test_gguf_tensor_names():
    assert hf_tensor_name("blk.3.attn_q.weight") == "model.layers.3.self_attn.q_proj.weight"
    assert hf_tensor_name("blk.0.attn_k.bias") == "model.layers.0.self_attn.k_proj.bias"
    assert hf_tensor_name("blk.11.ffn_down.weight") == "model.layers.11.mlp.down_proj.weight"
    assert hf_tensor_name("output.weight") == "lm_head.weight"
    assert hf_tensor_name("rope_freqs.weight") is None
    with pytest.raises(ValueError, match="blk.0.ffn_gate_exps.weight"):
        hf_tensor_name("blk.0.ffn_gate_exps.weight")


def test_unsupported_gguf_architecture_is_named(tmp_path):
    import gguf

    writer = gguf.GGUFWriter(str(tmp_path / "x.gguf"), "falcon")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="GGUF architecture 'falcon'.*supported: llama, qwen2, qwen3"):
        resolve_model_source(str(tmp_path / "x.gguf"))


# --- sources and registry --------------------------------------------------------


def test_unknown_model_never_downloads(tmp_path):
    with pytest.raises(ValueError, match="never downloads"):
        resolve_model_source("some-org/not-a-cached-model")
    with pytest.raises(ValueError, match="is not a local directory"):
        resolve_model_source(str(tmp_path / "missing"))


def test_bad_local_paths_are_clear_errors(tmp_path):
    (tmp_path / "weights.txt").write_text("x")
    with pytest.raises(ValueError, match="not a .gguf file"):
        resolve_model_source(str(tmp_path / "weights.txt"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="has no config.json"):
        resolve_model_source(str(tmp_path / "empty"))
    (tmp_path / "bad.gguf").write_bytes(b"not gguf at all")
    with pytest.raises(ValueError, match="not a readable GGUF file"):
        resolve_model_source(str(tmp_path / "bad.gguf"))


def test_registry_resolves_dense_architectures_and_names_unknown_ones():
    for architecture in ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        assert model_class(architecture).architecture == architecture
    assert {"Qwen3MoeForCausalLM", "MixtralForCausalLM", "DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM"} <= set(
        supported_architectures()
    )
    with pytest.raises(ValueError, match=r"'GPT2LMHeadModel'.*supported: .*LlamaForCausalLM.*Qwen3ForCausalLM"):
        model_class("GPT2LMHeadModel")


def test_config_without_architectures_is_a_clear_error(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    source = resolve_model_source(str(tmp_path))
    with pytest.raises(ValueError, match="no 'architectures' entry"):
        load_model(source)
