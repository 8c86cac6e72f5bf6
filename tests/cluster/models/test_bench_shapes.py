"""The GLM-4.x, DeepSeek-V3.2 and GLM-5 shapes of ``flotilla bench --shape`` (deploy/bench_shapes/): each resolves
for an H200, has the published size, and flotilla's model class builds it with random
weights: every tensor of the HF checkpoint (``--load-format dummy`` generates exactly those)
lands on a parameter of its shape. The build runs on the meta device (no memory) with the layer
count cut to the first dense layers plus one MoE layer: the widths are what a rank builds.
"""

from __future__ import annotations

import math

import pytest
import torch

from flotilla.cluster.models.base import ModelConfig
from flotilla.cluster.models.dummy_weights import hf_tensor_shapes
from flotilla.cluster.models.registry import architecture_of, model_class
from flotilla.deploy.bench import shape_config, shape_names
from flotilla.resolution import ModelFacts, ServerArgs, resolve
from flotilla.resolution.platform import PRESETS

# Parameters transformers counts (the MTP layers left out, as transformers' class has none) and
# those one token reads (routed experts at top-k of n; embedding table included), in billions;
# the model cards count the MTP layer too (see deploy/bench_shapes/README.md).
SHAPES = {
    "glm-4.5": (352.8, 33.6),
    "glm-4.5-air": (106.9, 13.4),
    "glm-4.6": (352.8, 33.6),
    "deepseek-v3.2": (671.9, 38.4),
    "glm-5": (743.9, 41.8),
}


def test_the_shapes_are_bundled():
    assert set(SHAPES) <= set(shape_names())


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_shape_resolves_for_h200_with_its_published_size(name):
    config = shape_config(name)
    resolved = resolve(
        ServerArgs.create(model_path=f"/models/{name}", load_format="dummy", tp_size=8),
        ModelFacts.from_hf_config(config),
        PRESETS["h200"],
    )
    assert (resolved.device, resolved.load_format) == ("cuda", "dummy")
    shapes = hf_tensor_shapes(config)
    total = sum(math.prod(s) for s in shapes.values())
    experts = sum(math.prod(s) for n, s in shapes.items() if ".mlp.experts." in n)
    active = total - experts + experts * config["num_experts_per_tok"] / config["n_routed_experts"]
    assert (total / 1e9, active / 1e9) == pytest.approx(SHAPES[name], rel=0.002)


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_random_weights_of_the_shape_land_on_flotillas_model(name):
    config = dict(shape_config(name))
    config["num_hidden_layers"] = int(config.get("first_k_dense_replace", 0)) + 1
    # NOTE: the bfloat16 build (a published FP8 shape's FP8 layers are tests/cluster/models/
    # test_fp8_deepseek.py's; random FP8 weights are drawn on a real device, not the meta one).
    config.pop("quantization_config", None)
    with torch.device("meta"):
        model = model_class(architecture_of(config))(ModelConfig(hf=config, dtype=torch.bfloat16))
        weights = ((n, torch.empty(s, device="meta")) for n, s in hf_tensor_shapes(config).items())
        loaded = model.load_weights(weights)
    assert loaded == set(dict(model.named_parameters()))
