"""Reading a llama.cpp GGUF file: its HF-style config and its weights under HF names.

Every tensor is dequantized to float32 with the ``gguf`` package
(``gguf.quants.dequantize``), exactly as transformers does when it loads a GGUF
file, so a model loaded here and transformers' own load of the same file hold
identical weights.

llama.cpp's converter permutes the rows of Q and K for the ``llama`` architecture
(it stores RoPE pairs interleaved, HF stores them as halves); that permutation is
undone here, for ``llama`` only (Qwen2/Qwen3 files are not permuted).

Supported GGUF architectures: ``llama`` (Llama, SmolLM2; Mistral when the file's
name says so), ``qwen2``, ``qwen3``. Not supported: split files
(``-00001-of-0000N.gguf``), llama.cpp's ``rope_freqs`` tensor (Llama 3.1 RoPE
factors; ignored, as transformers ignores it).
"""

from __future__ import annotations

import copy
import functools
import os
import re
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch

# llama.cpp architecture -> (HF model_type, HF architecture)
_ARCHITECTURES = {
    "llama": ("llama", "LlamaForCausalLM"),
    "qwen2": ("qwen2", "Qwen2ForCausalLM"),
    "qwen3": ("qwen3", "Qwen3ForCausalLM"),
}
_MISTRAL = ("mistral", "MistralForCausalLM")

# GGUF metadata key (after "<arch>.") -> HF config key.
_CONFIG_KEYS = {
    "block_count": "num_hidden_layers",
    "context_length": "max_position_embeddings",
    "embedding_length": "hidden_size",
    "feed_forward_length": "intermediate_size",
    "attention.head_count": "num_attention_heads",
    "attention.head_count_kv": "num_key_value_heads",
    "attention.layer_norm_rms_epsilon": "rms_norm_eps",
    "attention.key_length": "head_dim",
    "attention.sliding_window": "sliding_window",
    "vocab_size": "vocab_size",
}
_TOKEN_ID_KEYS = {
    "tokenizer.ggml.bos_token_id": "bos_token_id",
    "tokenizer.ggml.eos_token_id": "eos_token_id",
    "tokenizer.ggml.padding_token_id": "pad_token_id",
}

# llama.cpp tensor name (after "blk.N.") -> HF name (after "model.layers.N.").
_LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_TENSORS = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_SKIPPED_TENSORS = ("rope_freqs.weight",)
_LAYER_NAME = re.compile(r"^blk\.(\d+)\.([a-z_0-9]+)\.(weight|bias)$")


def open_gguf(path: str | Path):
    """A ``gguf.GGUFReader`` over ``path`` (memory-mapped).

    NOTE: parsing the metadata of a file with a 50k-token vocabulary takes seconds,
    and both the config and the weights need it, so readers are cached by path,
    modification time and size (a rewritten file is read again).
    """
    path = Path(path).resolve()
    if not path.is_file():
        raise ValueError(f"GGUF file {str(path)!r} does not exist")
    stat = os.stat(path)
    return _cached_reader(str(path), stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=2)
def _cached_reader(path: str, mtime_ns: int, size: int):
    from gguf import GGUFReader

    try:
        return GGUFReader(path)
    except Exception as exc:  # the gguf package raises assorted errors for non-GGUF input
        raise ValueError(f"{path!r} is not a readable GGUF file ({type(exc).__name__}: {exc})") from None


def _field(reader, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def gguf_config(path: str | Path) -> dict[str, Any]:
    """The HF ``config.json`` dict equivalent of a GGUF file's metadata (a fresh dict; the
    file is parsed once per process while its size and mtime stay the same)."""
    stat = os.stat(path)
    return copy.deepcopy(_gguf_config(str(Path(path).resolve()), stat.st_size, stat.st_mtime_ns))


@functools.lru_cache(maxsize=8)
def _gguf_config(path: str, size: int, mtime_ns: int) -> dict[str, Any]:
    reader = open_gguf(path)
    arch = _field(reader, "general.architecture")
    if arch not in _ARCHITECTURES:
        raise ValueError(
            f"GGUF architecture {arch!r} in {str(path)!r} is not supported; supported: {', '.join(sorted(_ARCHITECTURES))}"
        )
    model_type, architecture = _ARCHITECTURES[arch]
    if arch == "llama" and "mistral" in str(_field(reader, "general.name", "")).lower():
        model_type, architecture = _MISTRAL
    config: dict[str, Any] = {"architectures": [architecture], "model_type": model_type, "hidden_act": "silu"}
    for gguf_key, hf_key in _CONFIG_KEYS.items():
        value = _field(reader, f"{arch}.{gguf_key}")
        if value is not None:
            config[hf_key] = value
    for gguf_key, hf_key in _TOKEN_ID_KEYS.items():
        value = _field(reader, gguf_key)
        if value is not None:
            config[hf_key] = value
    if "vocab_size" not in config:
        config["vocab_size"] = len(reader.fields["tokenizer.ggml.tokens"].data)
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    config["head_dim"] = head_dim
    config["rope_parameters"] = _rope_parameters(reader, arch, head_dim)
    tensor_names = {t.name for t in reader.tensors}
    config["tie_word_embeddings"] = "output.weight" not in tensor_names
    if arch == "llama":
        config["attention_bias"] = "blk.0.attn_q.bias" in tensor_names
    return config


def _rope_parameters(reader, arch: str, head_dim: int) -> dict[str, Any]:
    params: dict[str, Any] = {"rope_theta": float(_field(reader, f"{arch}.rope.freq_base", 10000.0)), "rope_type": "default"}
    rotary_dim = _field(reader, f"{arch}.rope.dimension_count")
    if rotary_dim and rotary_dim != head_dim:
        params["partial_rotary_factor"] = rotary_dim / head_dim
    scaling = _field(reader, f"{arch}.rope.scaling.type")
    if scaling and scaling != "none":
        params["rope_type"] = scaling
        params["factor"] = float(_field(reader, f"{arch}.rope.scaling.factor", 1.0))
        original = _field(reader, f"{arch}.rope.scaling.original_context_length")
        if original:
            params["original_max_position_embeddings"] = int(original)
    return params


def hf_tensor_name(gguf_name: str) -> str | None:
    """The HF checkpoint name of a llama.cpp tensor, or None for tensors with no HF
    counterpart (``rope_freqs``). ValueError for names this loader does not know."""
    if gguf_name in _SKIPPED_TENSORS:
        return None
    match = _LAYER_NAME.match(gguf_name)
    if match and match.group(2) in _LAYER_TENSORS:
        layer, part, kind = match.groups()
        return f"model.layers.{layer}.{_LAYER_TENSORS[part]}.{kind}"
    stem, _, kind = gguf_name.rpartition(".")
    if stem in _GLOBAL_TENSORS:
        return f"{_GLOBAL_TENSORS[stem]}.{kind}"
    raise ValueError(f"GGUF tensor {gguf_name!r} has no known HF name (dense llama/qwen2/qwen3 files only)")


def undo_rope_permutation(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Invert llama.cpp's Q/K row permutation: within each head, llama.cpp orders the
    rows as interleaved RoPE pairs ``(0, d/2), (1, d/2+1), ...``; HF orders them as
    the first half then the second half."""
    rows = weight.shape[0]
    half = rows // num_heads // 2
    return weight.reshape(num_heads, half, 2, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)


def iter_gguf_weights(path: str | Path, config: dict[str, Any] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(hf_name, float32 tensor)`` for every tensor of a GGUF file, dequantized
    and (for ``llama``) with the Q/K permutation undone."""
    from gguf.quants import dequantize

    reader = open_gguf(path)
    config = gguf_config(path) if config is None else config
    permuted = _field(reader, "general.architecture") == "llama"
    heads = {"q_proj": config["num_attention_heads"], "k_proj": config.get("num_key_value_heads", config["num_attention_heads"])}
    for tensor in reader.tensors:
        name = hf_tensor_name(tensor.name)
        if name is None:
            continue
        values = dequantize(tensor.data, tensor.tensor_type)
        # NOTE: unquantized tensors come back as read-only views of the memory map.
        weight = torch.from_numpy(values if values.flags.writeable else np.array(values)).to(torch.float32)
        projection = name.rsplit(".", 2)[-2]
        if permuted and projection in heads:
            weight = undo_rope_permutation(weight, heads[projection])
        yield name, weight
