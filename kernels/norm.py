"""RMSNorm, with the optional fused residual add that decoder layers use."""

from __future__ import annotations

import torch

from flotilla.kernels.registry import register


@register("rms_norm", "torch")
def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Root-mean-square normalisation over the last dimension.

    ``y = x / sqrt(mean(x**2) + eps) * weight``, computed in float32 and returned
    in ``x.dtype`` (as HF ``LlamaRMSNorm``: the weight multiplies after the cast
    back).

    With ``residual`` given, first forms ``new_residual = x + residual`` and
    normalises that; returns ``(y, new_residual)`` so the caller carries the
    un-normalised stream to the next layer.
    """
    if residual is not None:
        # NOTE: the sum is kept in x.dtype, as HF adds the residual stream in the model dtype.
        x = x + residual
        new_residual = x
    dtype = x.dtype
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    y = weight * h.to(dtype)
    y = y.to(dtype)
    if residual is not None:
        return y, new_residual
    return y
