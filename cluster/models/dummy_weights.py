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

NOTE: the values are drawn on the ``device`` the model loads to (fast for an 8B shape on a GPU),
and CUDA's generator gives other numbers than the CPU's for the same seed: a CPU model and a GPU
model built this way differ. To compare them, draw on the CPU and move the tensors (the GPU
tests do, see tests/gpu/models.py).
"""

from __future__ import annotations

import zlib
from typing import Any, Iterator, Mapping

import torch

# transformers' own default initializer range, used when config.json has none.
DEFAULT_INITIALIZER_RANGE = 0.02


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
    config_dict: Mapping[str, Any], device: str | torch.device = "cpu", seed: int = 0
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(hf_name, tensor)`` for every tensor of the config's architecture (float32 on
    ``device``; the model's loaders cast and slice)."""
    std = float(config_dict.get("initializer_range") or DEFAULT_INITIALIZER_RANGE)
    for name, shape in hf_tensor_shapes(config_dict).items():
        if name.endswith("bias"):
            yield name, torch.zeros(shape, device=device)
        elif len(shape) == 1:  # norm weights (RMSNorm/LayerNorm scales)
            yield name, torch.ones(shape, device=device)
        else:
            generator = torch.Generator(device=device).manual_seed(seed ^ zlib.crc32(name.encode()))
            yield name, torch.empty(shape, device=device).normal_(0.0, std, generator=generator)
