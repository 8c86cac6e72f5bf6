"""Gated activations of MLPs: ``act(gate) * up`` over a fused ``[gate | up]`` input."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from flotilla.kernels.registry import register


def _split(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if x.shape[-1] % 2:
        raise ValueError(f"gated activation needs an even last dimension, got x.shape={tuple(x.shape)}")
    d = x.shape[-1] // 2
    return x[..., :d], x[..., d:]


@register("silu_and_mul", "torch")
def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``silu(x[..., :d]) * x[..., d:]`` for ``x[..., 2d]``."""
    gate, up = _split(x)
    return F.silu(gate) * up


@register("gelu_and_mul", "torch")
def gelu_and_mul(x: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    """``gelu(x[..., :d]) * x[..., d:]`` for ``x[..., 2d]``.

    ``approximate`` is ``"none"`` (exact erf GELU) or ``"tanh"`` (HF ``gelu_pytorch_tanh``,
    used by Gemma).
    """
    if approximate not in ("none", "tanh"):
        raise ValueError(f"approximate must be 'none' or 'tanh', got approximate={approximate!r}")
    gate, up = _split(x)
    return F.gelu(gate, approximate=approximate) * up
