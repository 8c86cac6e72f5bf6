"""Inference-time weight packing: swap a loaded model's linear layers for ones over
pre-packed oneDNN weights (CPU only; see :mod:`flotilla.kernels.linear`).

Runs once, after ``load_weights`` and before the first step. A packed layer keeps
the interface the model code uses (``forward``, ``split`` of merged projections,
``compute_logits`` of the LM head) and drops its reference to the original weight,
so the unpacked copy is freed (a tied LM head's weight lives on in the embedding).
"""

from __future__ import annotations

import torch
from torch import nn

from flotilla.cluster.models.layers import ColumnParallelLinear, ParallelLMHead, RowParallelLinear
from flotilla.kernels.linear import onednn_packing_available, pack_linear_weight, packed_linear


class PackedLinear(nn.Module):
    """A column- or row-parallel linear layer (single rank) over a packed weight."""

    def __init__(self, layer: ColumnParallelLinear | RowParallelLinear):
        super().__init__()
        self.register_buffer("packed_weight", pack_linear_weight(layer.weight), persistent=False)
        self.bias = layer.bias
        self.output_sizes = getattr(layer, "output_sizes", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return packed_linear(x, self.packed_weight, self.bias)

    def split(self, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """As :meth:`MergedColumnParallelLinear.split`."""
        return tuple(y.split(self.output_sizes, dim=-1))


class PackedLMHead(nn.Module):
    """:class:`ParallelLMHead` (single rank) over a packed weight."""

    def __init__(self, head: ParallelLMHead):
        super().__init__()
        self.register_buffer("packed_weight", pack_linear_weight(head.weight), persistent=False)
        self.vocab_size = head.vocab_size

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return packed_linear(hidden, self.packed_weight)[..., : self.vocab_size].float()


def pack_linear_layers(model: nn.Module) -> int:
    """Replace every packable single-rank linear layer and LM head of ``model`` in place;
    returns how many were replaced (0 off CPU, or without oneDNN)."""
    replaced = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            packed = _packed(child)
            if packed is not None:
                setattr(parent, name, packed)
                replaced += 1
    return replaced


def _packed(module: nn.Module) -> nn.Module | None:
    if isinstance(module, ParallelLMHead):
        ok = module.parallel.tp_size == 1 and onednn_packing_available(module.weight)
        return PackedLMHead(module) if ok else None
    if isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
        # NOTE: tensor-parallel layers keep their own forward (the row-parallel all-reduce), and
        # so do block-FP8 layers (onednn_packing_available refuses their float8 weight).
        ok = module.parallel.tp_size == 1 and onednn_packing_available(module.weight)
        return PackedLinear(module) if ok else None
    return None
