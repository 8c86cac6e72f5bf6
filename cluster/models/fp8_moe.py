"""Routed experts over block-quantized FP8 weights, as FP8 checkpoints store them.

A block-FP8 checkpoint keeps each expert matrix as ``experts.<e>.gate_proj.weight``
(``float8_e4m3fn``) plus ``experts.<e>.gate_proj.weight_scale_inv`` (one multiplier per 128x128
block), likewise ``up_proj`` and ``down_proj``. :class:`Fp8FusedMoE` is
:class:`~flotilla.cluster.models.moe_layer.FusedMoE` with its stacked weights in float8 and
their scales beside them, ``w13_scale_inv[S, 2*I/128, H/128]`` and
``w2_scale_inv[S, H/128, I/128]`` (``I`` per MoE-TP rank), loaded per expert; the experts run
op ``fp8_grouped_moe`` of the MoE backend. Placement, routing and dispatch are FusedMoE's.
"""

from __future__ import annotations

import torch
from torch import nn

from flotilla.cluster.models.base import ModelConfig
from flotilla.cluster.models.fp8_config import FP8_BLOCK
from flotilla.cluster.models.fp8_linear import FP8, blocks, check_fp8_weight, check_scale, scale_parameter
from flotilla.cluster.models.moe_layer import FusedMoE

_PARTS = ("gate_proj", "up_proj", "down_proj")
_CHECKPOINT_PART = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


class Fp8FusedMoE(FusedMoE):
    """:class:`FusedMoE` over block-FP8 experts; ``prefix`` is the checkpoint name of the
    layer's experts (``model.layers.0.mlp.experts``), for messages. The other arguments are
    FusedMoE's. Each rank's expert width (``moe_intermediate_size / moe_tp_size``) must be a
    multiple of 128, so gate and up rows and the MoE-TP slices cut on scale blocks."""

    experts_op = "fp8_grouped_moe"

    def __init__(self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int, *, prefix: str, **kwargs):
        self.prefix = prefix
        super().__init__(num_experts, top_k, hidden_size, intermediate_size, **kwargs)
        if self.intermediate_per_rank % FP8_BLOCK:
            raise ValueError(
                f"{prefix}: moe_intermediate_size={intermediate_size} gives {self.intermediate_per_rank} rows per "
                f"MoE-TP rank (moe_tp_size={self.parallel.moe_tp_size}), not a multiple of the {FP8_BLOCK}-row FP8 "
                f"scale blocks; choose a layout (ep_size) that leaves a multiple of {FP8_BLOCK}"
            )

    def _allocate(self, slots: int) -> None:
        i, h = self.intermediate_per_rank, self.hidden_size
        self.w13 = nn.Parameter(torch.empty(slots, 2 * i, h, dtype=FP8), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(slots, h, i, dtype=FP8), requires_grad=False)
        self.w13.weight_loader = self._load  # type: ignore[attr-defined]
        self.w2.weight_loader = self._load  # type: ignore[attr-defined]
        self.w13_scale_inv = scale_parameter((slots, 2 * blocks(i), blocks(h)), self._load_scale)
        self.w2_scale_inv = scale_parameter((slots, blocks(h), blocks(i)), self._load_scale)

    def _load(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: tuple[str, int] | None = None) -> None:
        if shard_id is None:
            raise ValueError(
                f"{self.prefix}: FP8 experts load one expert matrix at a time (experts.<e>.gate_proj.weight with "
                f"its weight_scale_inv, up_proj, down_proj), not a stacked tensor of every expert"
            )
        part, expert = shard_id
        check_fp8_weight(loaded, f"{self.prefix}.{expert}.{_CHECKPOINT_PART[part]}.weight")
        super()._load(param, loaded, shard_id)

    def _load_scale(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: tuple[str, int] | None = None) -> None:
        if shard_id is None:
            raise ValueError(f"{self.prefix}: FP8 expert scales load per expert (experts.<e>.<part>.weight_scale_inv)")
        part, expert = shard_id
        full_i, h = self.intermediate_per_rank * self.parallel.moe_tp_size, self.hidden_size
        full = (h, full_i) if part == "w2" else (full_i, h)
        check_scale(loaded, full, f"{self.prefix}.{expert}.{_CHECKPOINT_PART[part]}.weight_scale_inv")
        i = self.intermediate_per_rank // FP8_BLOCK
        start = self.parallel.moe_tp_rank * i
        for row, held in enumerate(self.local_logical_experts):
            if held != expert:
                continue
            if part == "w2":
                param.data[row].copy_(loaded.narrow(1, start, i))
            else:
                rows = slice(0, i) if part == "w1" else slice(i, 2 * i)
                param.data[row, rows].copy_(loaded.narrow(0, start, i))

    def compute(self, hidden: torch.Tensor, weights: torch.Tensor, slot_ids: torch.Tensor) -> torch.Tensor:
        return self._experts(
            hidden, self.w13, self.w13_scale_inv, self.w2, self.w2_scale_inv, weights, slot_ids,
            activation=self.activation, expert_map=self.expert_map,
        )  # fmt: skip


def routed_experts(cfg: ModelConfig, prefix: str | None, num_experts: int, *args, **kwargs) -> FusedMoE:
    """The routed experts of checkpoint module ``prefix`` (``model.layers.0.mlp.experts``):
    :class:`Fp8FusedMoE` when the checkpoint quantizes them, else (or when ``prefix`` is None)
    :class:`FusedMoE`. ``args``/``kwargs``: FusedMoE's after ``num_experts``."""
    parts = [f"{e}.{p}" for e in range(num_experts) for p in _PARTS]
    if prefix is not None and cfg.fp8 is not None and cfg.fp8.quantizes_all(prefix, parts):
        return Fp8FusedMoE(num_experts, *args, prefix=prefix, **kwargs)
    return FusedMoE(num_experts, *args, **kwargs)
