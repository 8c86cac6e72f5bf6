"""Reading a local HF model directory: ``config.json`` and the weight files.

Weights are safetensors (one file, or shards listed in ``model.safetensors.index.json``)
or, failing that, PyTorch ``.bin`` files read with ``torch.load(weights_only=True)``
(one ``pytorch_model.bin`` or shards listed in ``pytorch_model.bin.index.json``).
Tensors are yielded one at a time under their HF names, so a model's
``load_weights`` can copy each into its (future: tensor-parallel) shard without
the whole checkpoint in memory at once.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator

import torch

_SAFETENSORS_INDEX = "model.safetensors.index.json"
_BIN_INDEX = "pytorch_model.bin.index.json"


def read_hf_config(model_dir: str | Path) -> dict[str, Any]:
    """The ``config.json`` of ``model_dir`` as a dict; ValueError when it is missing or invalid."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise ValueError(f"model directory {str(model_dir)!r} has no config.json; pass an HF model directory or a .gguf file")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is not valid JSON ({exc})") from None


def weight_files(model_dir: str | Path) -> list[Path]:
    """The weight files of ``model_dir`` in load order (safetensors preferred over .bin)."""
    model_dir = Path(model_dir)
    for index_name, pattern in ((_SAFETENSORS_INDEX, "*.safetensors"), (_BIN_INDEX, "*.bin")):
        index = model_dir / index_name
        if index.is_file():
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
            missing = [name for name in shards if not (model_dir / name).is_file()]
            if missing:
                raise ValueError(f"{index} lists shard(s) that are not in the directory: {missing}")
            return [model_dir / name for name in shards]
        files = sorted(p for p in model_dir.glob(pattern) if not p.name.startswith("training_args"))
        if files:
            return files
    raise ValueError(
        f"model directory {str(model_dir)!r} holds no weights (*.safetensors or pytorch_model*.bin); "
        "for a GGUF checkpoint pass the .gguf file itself"
    )


def iter_hf_weights(model_dir: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(hf_name, tensor)`` for every tensor of every weight file of ``model_dir``."""
    for path in weight_files(model_dir):
        if path.suffix == ".safetensors":
            yield from _iter_safetensors(path)
        else:
            state = torch.load(path, map_location="cpu", weights_only=True)
            yield from state.items()
            del state


def _iter_safetensors(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt", device="cpu") as f:
        for name in f.keys():
            yield name, f.get_tensor(name)
