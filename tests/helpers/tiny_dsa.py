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

from flotilla.cluster.models.dsa import DSAIndexer
from flotilla.kernels.attention import causal_context_mask, gather_kv, pad_queries
from flotilla.kernels.dsa import index_scores
from helpers.tiny_fp8 import randomize
from helpers.tiny_glm import randomize_correction_bias

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


def save_fp8_twin(model, root: Path, extra: dict[str, torch.Tensor] | None = None) -> tuple[Path, Path]:
    """Save HF ``model`` as ``root/fp8`` (block FP8, see the module docstring) and
    ``root/dequant`` (the same weights dequantized, float32); returns both paths. ``extra``:
    checkpoint tensors to add (an MTP layer's, :func:`mtp_checkpoint_tensors`), quantized alike."""
    from safetensors.torch import load_file, save_file

    dequant_dir, fp8_dir = root / "dequant", root / "fp8"
    model.save_pretrained(dequant_dir)
    if extra:
        add_checkpoint_tensors(dequant_dir, extra)
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


# --- DeepSeek sparse attention (DeepSeek-V3.2, GLM-5) ---------------------------------------

# DSA at test size: MLA as DeepSeek-V3 (4 heads, so attention TP 2 / DCP 2 split them), 8 experts
# top-2 in 2 groups with a shared expert (EP up to 4), the first layer dense; the indexer keeps
# index_topk = 8 tokens per query, so the prompts of the tests (up to 45 tokens) attend to a
# fraction of their context. NOTE: 16 indexer heads: a token's score is exactly 0 only when all 16
# heads' ReLU clip it (chance 2**-16 per pair), so exact ties at the top-k boundary do not occur.
TINY_DSA = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=32,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=4,
    kv_lora_rank=32,
    q_lora_rank=24,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=12,
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_group=2,
    topk_group=1,
    n_shared_experts=1,
    first_k_dense_replace=1,
    routed_scaling_factor=2.5,
    max_position_embeddings=256,
    index_topk=8,
    index_head_dim=16,
    index_n_heads=16,
)
# GLM-5's IndexShare at test size: layers 1 and 3 reuse the previous full layer's top-k.
GLM5_PATTERN = "FSFS"
# The weights' seed of each test model, chosen so that every top-k boundary the tests meet (the
# paged and engine flows of tests/cluster/models/test_dsa.py, whose prompts the parallel-layout
# tests reuse) is at least 1e-4 wide (SelectionMargins measured >= 1.4e-4 for both), 25x the
# largest difference between HF's index scores and ours (4e-6 on scores of magnitude ~3).
SEEDS = {"deepseek_v32": 2, "glm5": 3}
# The prompts of the engine flows (a mixed batch; the longest spans two 64-token DSA pages).
ENGINE_PROMPT_LENS = (9, 20, 70)


def tiny_dsa(arch: str, seed: int | None = None, **overrides):
    """The seeded HF model (float32, eval) of :data:`TINY_DSA`: ``arch`` is ``deepseek_v32``
    (DeepseekV32ForCausalLM) or ``glm5`` (GlmMoeDsaForCausalLM with :data:`GLM5_PATTERN`).
    Unit-scale weights (``helpers.tiny_fp8.randomize``) and a drawn correction bias; ``seed``
    defaults to the arch's :data:`SEEDS` entry."""
    seed = SEEDS[arch] if seed is None else seed
    from transformers import DeepseekV32Config, DeepseekV32ForCausalLM, GlmMoeDsaConfig, GlmMoeDsaForCausalLM

    settings = {**TINY_DSA, **overrides}
    if arch == "deepseek_v32":
        config = DeepseekV32Config(**settings)
        model_cls = DeepseekV32ForCausalLM
    elif arch == "glm5":
        config = GlmMoeDsaConfig(**{"index_topk_pattern": GLM5_PATTERN, **settings})
        model_cls = GlmMoeDsaForCausalLM
    else:
        raise ValueError(f"unknown DSA test model {arch!r}")
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    randomize(model, seed)
    randomize_correction_bias(model, seed)
    return model


def save_tiny_dsa(path: Path, arch: str, seed: int | None = None, **overrides):
    """Save :func:`tiny_dsa` to ``path`` (safetensors, per-expert tensors); returns the HF model."""
    model = tiny_dsa(arch, seed, **overrides)
    model.save_pretrained(path)
    return model


class SelectionMargins:
    """Records, for every indexer call of a flotilla DSA model, the smallest gap between the last
    selected and the first unselected score of any query that sees more tokens than it keeps:
    the test's evidence that no selection hinges on float32 noise (HF's scores and ours differ by
    summation order only, ~1e-6). ``attach(model)`` installs it; ``smallest`` is the minimum seen."""

    def __init__(self):
        self.smallest = float("inf")

    def attach(self, model) -> "SelectionMargins":
        for module in model.modules():
            if isinstance(module, DSAIndexer):
                module.observer = self
        return self

    def __call__(self, indexer, q, weights, index_cache, meta, local) -> None:
        if local is not None or q.shape[0] == 0:
            return
        keys, _ = gather_kv(index_cache, meta)
        scores = index_scores(pad_queries(q, meta), pad_queries(weights, meta), keys.squeeze(2), indexer.scale)
        scores = scores.masked_fill(~causal_context_mask(meta), float("-inf"))
        width = indexer.topk
        if scores.shape[-1] <= width:
            return
        best = scores.topk(width + 1, dim=-1).values
        contested = ~torch.isneginf(best[..., width])
        if bool(contested.any()):
            gaps = (best[..., width - 1] - best[..., width])[contested]
            self.smallest = min(self.smallest, float(gaps.min()))


# --- MTP layers in the checkpoint layout ----------------------------------------------------

_STACKED_EXPERTS = re.compile(r"^(.*\.experts)\.(gate_up_proj|down_proj)$")


def mtp_checkpoint_tensors(main, layers: dict[str, torch.Tensor], first: int) -> dict[str, torch.Tensor]:
    """The checkpoint tensors of MTP layers given as transformers' ``MtpModel`` state
    (``layers.<k>.enorm.weight``, ``layers.<k>.mtp_block.<decoder layer>``, ``layers.<k>.post_norm``):
    named as DeepSeek's checkpoints name them (``model.layers.<first + k>.enorm.weight``, the block's
    tensors directly under the layer with one tensor per expert matrix, ``shared_head.norm``), plus
    the layer's copies of the main model's embedding and LM head (``embed_tokens``,
    ``shared_head.head``)."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in layers.items():
        match = re.match(r"^layers\.(\d+)\.(.+)$", name)
        if match is None:
            continue  # the shared embedding and head of the MtpModel
        index, rest = first + int(match.group(1)), match.group(2)
        prefix = f"model.layers.{index}."
        out.setdefault(prefix + "embed_tokens.weight", main.get_input_embeddings().weight.detach().clone())
        out.setdefault(prefix + "shared_head.head.weight", main.lm_head.weight.detach().clone())
        if rest.startswith("post_norm."):
            out[prefix + "shared_head.norm." + rest[len("post_norm.") :]] = tensor
            continue
        rest = rest.removeprefix("mtp_block.")
        stacked = _STACKED_EXPERTS.match(rest)
        if stacked is None:
            out[prefix + rest] = tensor
            continue
        experts, kind = stacked.groups()
        for e in range(tensor.shape[0]):
            if kind == "down_proj":
                out[f"{prefix}{experts}.{e}.down_proj.weight"] = tensor[e].contiguous()
            else:
                gate, up = tensor[e].chunk(2, dim=0)
                out[f"{prefix}{experts}.{e}.gate_proj.weight"] = gate.contiguous()
                out[f"{prefix}{experts}.{e}.up_proj.weight"] = up.contiguous()
    return out


def add_checkpoint_tensors(model_dir: Path, tensors: dict[str, torch.Tensor]) -> None:
    """Add ``tensors`` to the (single) safetensors file of ``model_dir``."""
    from safetensors.torch import load_file, save_file

    (file,) = model_dir.glob("*.safetensors")
    merged = {**load_file(file), **{k: v.detach().contiguous() for k, v in tensors.items()}}
    save_file(merged, str(file), metadata={"format": "pt"})
