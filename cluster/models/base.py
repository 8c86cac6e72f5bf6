"""The interface every model implements, and the configuration it is built from.

A model is a ``torch.nn.Module`` built from flotilla's own layers. The engine
drives it through four calls:

- ``forward(input_ids[T], positions[T], kv_caches, meta) -> hidden[T, H]`` over a
  flattened varlen batch (see :class:`flotilla.kernels.attention.AttentionMetadata`);
  ``kv_caches[i]`` is layer ``i``'s cache as laid out by :meth:`kv_cache_spec`.
- ``compute_logits(hidden[N, H]) -> logits[N, V]`` in float32.
- ``load_weights(weights)`` from an iterable of ``(hf_name, tensor)`` pairs, HF
  checkpoint names; each parameter knows how to load its (future: tensor-parallel) shard.
- ``kv_cache_spec() -> KVCacheSpec``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Protocol

import torch

from flotilla.kernels.attention import AttentionMetadata


@dataclass(frozen=True)
class ParallelLayout:
    """This rank's place in the tensor-parallel group.

    ``group`` is the communicator the layers reduce and gather through (a
    :class:`flotilla.cluster.distributed.TPGroup`, or anything with its
    ``all_reduce(x)`` / ``all_gather(x, dim)``); None on one rank.
    NOTE: ``group`` is excluded from equality and hashing: two layouts describe the
    same shard whatever live communicator they carry.
    """

    tp_size: int = 1
    tp_rank: int = 0
    group: Any = field(default=None, compare=False, hash=False, repr=False)


@dataclass(frozen=True)
class ModelConfig:
    """What a model is built from.

    Attributes:
        hf: the HF config.json dict (``text_config`` already merged for VLMs is not assumed).
        dtype: parameter and activation dtype.
        parallel: tensor-parallel layout of this rank.
        attention_backend: name of the kernel backend for attention ops.
    """

    hf: Mapping[str, Any]
    dtype: torch.dtype = torch.float32
    parallel: ParallelLayout = field(default_factory=ParallelLayout)
    attention_backend: str = "torch"

    def get(self, key: str, default: Any = None) -> Any:
        value = self.hf.get(key, default)
        return default if value is None else value


@dataclass(frozen=True)
class KVCacheSpec:
    """Per-layer cache layout: each layer holds ``len(tensors_per_layer)`` tensors of
    shape ``[num_blocks, block_size, *shape]`` (e.g. K and V of ``(num_kv_heads, head_dim)``;
    MLA: one latent tensor of ``(1, kv_lora_rank + rope_dim)``)."""

    num_layers: int
    tensors_per_layer: tuple[tuple[int, ...], ...]
    dtype: torch.dtype

    def bytes_per_token(self) -> int:
        elems = sum(int(torch.Size(shape).numel()) for shape in self.tensors_per_layer)
        return elems * self.num_layers * torch.tensor([], dtype=self.dtype).element_size()

    def allocate(self, num_blocks: int, block_size: int, device: str | torch.device = "cpu") -> list[tuple[torch.Tensor, ...]]:
        return [
            tuple(torch.zeros(num_blocks, block_size, *shape, dtype=self.dtype, device=device) for shape in self.tensors_per_layer)
            for _ in range(self.num_layers)
        ]


class Model(Protocol):
    """What the engine needs from a model (see the module docstring)."""

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list, meta: AttentionMetadata
    ) -> torch.Tensor: ...

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor: ...

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None: ...

    def kv_cache_spec(self) -> KVCacheSpec: ...
