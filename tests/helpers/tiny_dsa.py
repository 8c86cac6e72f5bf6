"""Tiny random-weight DeepSeek-family checkpoints for model and engine tests: DeepSeek-V3 in the
published block-FP8 layout, DeepSeek-V3.2 and GLM-5 (DeepSeek sparse attention), with their
dequantized twins and HF oracles.

:func:`save_fp8_twin` writes a model the way DeepSeek's FP8 checkpoints are laid out: every
projection of attention (``q_a_proj``, ``q_b_proj``, ``kv_a_proj_with_mqa``, ``kv_b_proj``,
``o_proj``, V2-Lite's ``q_proj``; GLM-4.x's ``q_proj``/``k_proj``/``v_proj``), of the dense and shared MLPs and of each routed expert (one
tensor per expert matrix), and the DSA indexer's ``wq_b`` / ``wk``, stored as float8_e4m3fn with
``weight_scale_inv`` (one float32 multiplier per 128x128 block, partial edge blocks included);
routers, norms, embeddings, the LM head and the indexer's ``weights_proj`` stay float32. The twin
holds the same weights dequantized, the oracle's checkpoint. The quantizer here is written
independently of ``flotilla.kernels.fp8``.
"""

from __future__ import annotations

import json
import math
import re
import shutil
from pathlib import Path

import torch

BLOCK = 128
FP8_MAX = 448.0
# Checkpoint names of what DeepSeek's FP8 checkpoints quantize.
FP8_WEIGHTS = re.compile(
    r"\.(q_proj|k_proj|v_proj|q_a_proj|q_b_proj|kv_a_proj_with_mqa|kv_b_proj|o_proj|gate_proj|up_proj|down_proj|wq_b|wk)"
    r"\.weight$"
)


def fp8_quantization_config() -> dict:
    """DeepSeek-V3's ``quantization_config``."""
    return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}


def quantize_blocks(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``weight[N, K]`` (any sizes) -> ``(fp8 weight, scale_inv[ceil(N/128), ceil(K/128)],
    dequantized float32)``; each block's scale is its amax / 448 (edge blocks padded with zeros)."""
    n, k = weight.shape
    rows, cols = math.ceil(n / BLOCK), math.ceil(k / BLOCK)
    padded = torch.zeros(rows * BLOCK, cols * BLOCK)
    padded[:n, :k] = weight.float()
    blocks = padded.view(rows, BLOCK, cols, BLOCK)
    scale = (blocks.abs().amax(dim=(1, 3)) / FP8_MAX).clamp(min=1e-12)
    q = (blocks / scale[:, None, :, None]).to(torch.float8_e4m3fn)
    dequant = (q.float() * scale[:, None, :, None]).view(rows * BLOCK, cols * BLOCK)[:n, :k]
    return q.view(rows * BLOCK, cols * BLOCK)[:n, :k].contiguous(), scale, dequant.contiguous()


def save_fp8_twin(model, root: Path) -> tuple[Path, Path]:
    """Save HF ``model`` as ``root/fp8`` (block FP8, see the module docstring) and
    ``root/dequant`` (the same weights dequantized, float32); returns both paths."""
    from safetensors.torch import load_file, save_file

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
            if FP8_WEIGHTS.search(name) and tensor.dim() == 2:
                fp8[name], fp8[f"{name}_scale_inv"], plain[name] = quantize_blocks(tensor)
            else:
                fp8[name] = tensor
        save_file(plain, str(file), metadata={"format": "pt"})
        save_file(fp8, str(fp8_dir / file.name), metadata={"format": "pt"})
    config = json.loads((fp8_dir / "config.json").read_text())
    config["quantization_config"] = fp8_quantization_config()
    (fp8_dir / "config.json").write_text(json.dumps(config))
    return fp8_dir, dequant_dir
