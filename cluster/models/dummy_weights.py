"""``--load-format dummy``: deterministic random weights instead of a checkpoint.

For benchmarks and tests of model shapes that are too large to ship (a Llama-3.1-8B
shape, say): the model directory needs only its ``config.json``. Every tensor the HF
checkpoint of that architecture would hold is generated under its HF name and handed
to the model's ordinary ``load_weights``, so each rank slices its shard out of the
same full tensor: a tensor-parallel group holds exactly the weights of the one-rank
model (unlike SGLang's and vLLM's dummy format, which draw each rank's shard
independently), and greedy outputs can be compared across layouts.

Values: normal(0, ``initializer_range``) for matrices, ones for norm weights, zeros
for biases; each tensor's generator is seeded from ``seed`` and its name.

A block-FP8 config (``quantization_config``, see :mod:`~flotilla.cluster.models.fp8_config`)
gets the tensors an FP8 checkpoint holds: each quantized projection's draws block-quantized
(``weight`` in float8_e4m3fn, ``weight_scale_inv`` = block amax / 448), routed experts under
per-expert names, so the FP8 model is the float one up to FP8 rounding.

NOTE: the values are drawn on the ``device`` the model loads to (fast for an 8B shape on a GPU),
and CUDA's generator gives other numbers than the CPU's for the same seed: a CPU model and a GPU
model built this way differ. To compare them, draw on the CPU and move the tensors (the GPU
tests do, see tests/gpu/models.py).
"""

from __future__ import annotations

import re
import zlib
from typing import Any, Iterator, Mapping

import torch

from flotilla.cluster.models.fp8_config import BlockFp8Config
from flotilla.kernels.fp8 import quantize_block_fp8

# transformers' own default initializer range, used when config.json has none.
DEFAULT_INITIALIZER_RANGE = 0.02
# transformers 5 keeps a layer's experts stacked in memory: experts.gate_up_proj[E, 2I, H], experts.down_proj[E, H, I].
STACKED_EXPERTS = re.compile(r"^(.*\.experts)\.(gate_up_proj|down_proj)$")


def hf_tensor_shapes(config_dict: Mapping[str, Any]) -> dict[str, tuple[int, ...]]:
    """The names and shapes of the tensors an HF checkpoint of this config holds, read from
    transformers' model class built on the meta device (no memory is allocated)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(**dict(config_dict))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    shapes = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    if getattr(config, "tie_word_embeddings", False):
        shapes.pop("lm_head.weight", None)
    return shapes


def iter_dummy_weights(
    config_dict: Mapping[str, Any],
    device: str | torch.device = "cpu",
    seed: int = 0,
    fp8: BlockFp8Config | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(hf_name, tensor)`` for every tensor of the config's architecture (float32 on
    ``device``; the model's loaders cast and slice); with ``fp8``, the quantized projections
    as a block-FP8 checkpoint stores them (see the module docstring)."""
    std = float(config_dict.get("initializer_range") or DEFAULT_INITIALIZER_RANGE)
    for name, shape in hf_tensor_shapes(config_dict).items():
        if name.endswith("bias"):
            yield name, torch.zeros(shape, device=device)
        elif len(shape) == 1:  # norm weights (RMSNorm/LayerNorm scales)
            yield name, torch.ones(shape, device=device)
        else:
            generator = torch.Generator(device=device).manual_seed(seed ^ zlib.crc32(name.encode()))
            tensor = torch.empty(shape, device=device).normal_(0.0, std, generator=generator)
            yield from ([(name, tensor)] if fp8 is None else _as_block_fp8(name, tensor, fp8))


def _as_block_fp8(name: str, tensor: torch.Tensor, fp8: BlockFp8Config) -> Iterator[tuple[str, torch.Tensor]]:
    """``name``'s tensor as a block-FP8 checkpoint holds it: ``weight`` + ``weight_scale_inv``
    for a quantized projection, one expert matrix per name for stacked experts, else as is."""
    stacked = STACKED_EXPERTS.match(name)
    if stacked:
        prefix, kind = stacked.groups()
        parts = ("gate_proj", "up_proj") if kind == "gate_up_proj" else ("down_proj",)
        if not fp8.quantizes(f"{prefix}.0.{parts[0]}"):
            yield name, tensor
            return
        for part, rows in zip(parts, tensor.chunk(len(parts), dim=1)):
            weight, scale = quantize_block_fp8(rows)
            for expert in range(tensor.shape[0]):
                yield f"{prefix}.{expert}.{part}.weight", weight[expert]
                yield f"{prefix}.{expert}.{part}.weight_scale_inv", scale[expert]
    elif fp8.quantizes_tensor(name, tensor.shape):
        weight, scale = quantize_block_fp8(tensor)
        yield name, weight
        yield f"{name}_scale_inv", scale
    else:
        yield name, tensor
