"""Tiny block-FP8 checkpoints (DeepSeek-V3 / Qwen3-*-FP8 layout) and their dequantized twins.

:func:`save_fp8_pair` starts from a seeded random HF model in float32, quantizes every
projection (q/k/v/o, gate/up/down, routed experts) to float8_e4m3fn with one scale per 128x128
block (``amax / 448``), and writes two model directories: the FP8 checkpoint
(``<name>.weight`` float8 + ``<name>.weight_scale_inv``, ``quantization_config`` in
config.json) and the same weights dequantized into a plain float32 checkpoint, the oracle.

The block quantizer here is written independently of ``flotilla.kernels.fp8``, so the tests
do not check flotilla against itself.
"""

from __future__ import annotations

import json
import math
import re
import shutil
from pathlib import Path
from typing import Sequence

import torch

BLOCK = 128
FP8_MAX = 448.0
# The tiny models the FP8 tests build (CPU: tests/cluster/models/test_fp8_checkpoint.py; GPU:
# tests/gpu/test_fp8_checkpoint_gpu.py): shapes that cut on 128x128 scale blocks, head dim 128.
# Each case: (transformers config class, its extra fields, module names kept unquantized,
# scale dtype). Qwen3 dense; Llama with q/k/v/o biases, one KV head, bfloat16 scales and one
# projection kept in float32; Qwen3-MoE with 8 experts top-2, a dense layer and the routers
# unquantized, as the real Qwen3-MoE FP8 checkpoints list them.
VOCAB = 384
COMMON_CONFIG = dict(vocab_size=VOCAB, hidden_size=256, num_hidden_layers=2, max_position_embeddings=128)
FP8_CASES = {
    "qwen3": (
        "Qwen3Config",
        dict(intermediate_size=512, num_attention_heads=4, num_key_value_heads=2, head_dim=128),
        (),
        torch.float32,
    ),
    "llama": (
        "LlamaConfig",
        dict(intermediate_size=512, num_attention_heads=2, num_key_value_heads=1, attention_bias=True),
        ("lm_head", "model.layers.1.mlp.down_proj"),
        torch.bfloat16,
    ),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        dict(
            intermediate_size=512, moe_intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
            head_dim=128, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[1],
        ),
        ("lm_head", "model.layers.0.mlp.gate"),
        torch.float32,
    ),
}  # fmt: skip
# Checkpoint names of the projections an FP8 checkpoint quantizes (experts included).
_PROJECTION = re.compile(r"\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)\.weight$")


def fp8_quantization_config(skip: Sequence[str] = (), **overrides) -> dict:
    """A config.json ``quantization_config`` of a block-FP8 checkpoint."""
    section = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
    if skip:
        section["modules_to_not_convert"] = list(skip)
    return {**section, **overrides}


def quantize(weight: torch.Tensor, scale_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``weight[N, K]`` (multiples of 128) -> ``(fp8 weight, scale_inv[N/128, K/128], dequantized float32)``."""
    n, k = weight.shape
    blocks = weight.float().reshape(n // BLOCK, BLOCK, k // BLOCK, BLOCK)
    scale = (blocks.abs().amax(dim=(1, 3)) / FP8_MAX).clamp(min=1e-12).to(scale_dtype)
    expanded = scale.float()[:, None, :, None]
    q = (blocks / expanded).to(torch.float8_e4m3fn)
    return q.reshape(n, k), scale, (q.float() * expanded).reshape(n, k)


def randomize(model: torch.nn.Module, seed: int = 0) -> None:
    """Unit-scale random weights: ``randn / sqrt(fan_in)`` for matrices (routers x4, so no
    expert choice hinges on a near-tie), ``1 + 0.2 randn`` for norms, ``randn`` embeddings;
    logits spread over several units, far above float32 summation-order noise."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            if name.endswith("norm.weight"):
                param.copy_(1 + 0.2 * noise)
            elif "embed_tokens" in name:
                param.copy_(noise)
            elif param.dim() == 1:
                param.copy_(0.1 * noise)  # biases
            else:
                param.copy_(noise / math.sqrt(param.shape[-1]) * (4.0 if name.endswith("mlp.gate.weight") else 1.0))


def save_fp8_pair(
    config,
    root: Path,
    *,
    skip: Sequence[str] = (),
    scale_dtype: torch.dtype = torch.float32,
    seed: int = 0,
) -> tuple[Path, Path]:
    """Save a random model of HF ``config`` as ``root/fp8`` (block FP8) and ``root/dequant``
    (the FP8 weights dequantized, float32). ``skip`` lists checkpoint module names kept in
    float32 (written to ``modules_to_not_convert``; exact names here). Returns both paths."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).eval()
    randomize(model, seed)
    dequant_dir, fp8_dir = root / "dequant", root / "fp8"
    model.save_pretrained(dequant_dir)
    fp8_dir.mkdir(parents=True)
    for path in dequant_dir.iterdir():
        if path.suffix != ".safetensors":
            shutil.copy(path, fp8_dir / path.name)
    for file in sorted(dequant_dir.glob("*.safetensors")):
        plain = load_file(file)
        fp8 = {}
        for name, tensor in plain.items():
            if _PROJECTION.search(name) and name.removesuffix(".weight") not in skip:
                fp8[name], fp8[f"{name}_scale_inv"], plain[name] = quantize(tensor, scale_dtype)
            else:
                fp8[name] = tensor
        save_file(plain, str(file), metadata={"format": "pt"})
        save_file(fp8, str(fp8_dir / file.name), metadata={"format": "pt"})
    hf = json.loads((fp8_dir / "config.json").read_text())
    hf["quantization_config"] = fp8_quantization_config(skip)
    (fp8_dir / "config.json").write_text(json.dumps(hf))
    return fp8_dir, dequant_dir


def rewrite_checkpoint(model_dir: Path, edit) -> None:
    """Apply ``edit(tensors: dict) -> None`` to every safetensors file of ``model_dir`` (for
    broken-checkpoint tests)."""
    from safetensors.torch import load_file, save_file

    for file in model_dir.glob("*.safetensors"):
        tensors = load_file(file)
        edit(tensors)
        save_file(tensors, str(file), metadata={"format": "pt"})


def save_fp8_case(case: str, root: Path) -> tuple[Path, Path]:
    """:func:`save_fp8_pair` of the :data:`FP8_CASES` model ``case`` under ``root / case``."""
    import transformers

    config_name, extra, skip, scale_dtype = FP8_CASES[case]
    config = getattr(transformers, config_name)(**COMMON_CONFIG, **extra)
    return save_fp8_pair(config, root / case, skip=skip, scale_dtype=scale_dtype)
