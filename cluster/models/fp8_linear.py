"""A linear layer over a block-quantized FP8 weight, as HF FP8 checkpoints store it.

A checkpoint with ``quantization_config = {"quant_method": "fp8", "weight_block_size":
[128, 128]}`` (DeepSeek-V3, Qwen3-*-FP8) keeps each linear weight as ``weight``
(``float8_e4m3fn``, ``[N, K]``) and ``weight_scale_inv`` (``[ceil(N/128), ceil(K/128)]``, the
blockwise multiplier). :class:`Fp8BlockLinear` holds that pair unchanged and calls op
``fp8_block_linear`` of its backend (``torch``: dequantize and multiply in float32;
``deep_gemm``: FP8 tensor cores with per-token activation scales).

The layer is replicated (no tensor-parallel split): sharding an FP8 weight must cut on
128-row/column block boundaries so that the scales shard with it, which the parallel linear
layers do not do yet.
"""

from __future__ import annotations

import torch
from torch import nn

from flotilla.cluster.models.layers import default_weight_loader
from flotilla.kernels import fp8, registry

FP8_BLOCK = 128


class Fp8BlockLinear(nn.Module):
    """``y = x dequant(W)^T + b`` with ``W`` stored as block-quantized FP8.

    Args:
        in_features: ``K``.
        out_features: ``N``.
        bias: keep a bias ``[N]`` (in ``dtype``).
        dtype: activation dtype (the output's; the bias's).
        backend: kernel backend of op ``fp8_block_linear`` (``"torch"`` or ``"deep_gemm"``).

    Parameters (names as in the checkpoint): ``weight[N, K]`` float8_e4m3fn and
    ``weight_scale_inv[ceil(N/128), ceil(K/128)]`` float32 (a checkpoint's bfloat16 scales are
    converted on load, since DeepGEMM reads float32).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = False,
        dtype: torch.dtype = torch.bfloat16,
        backend: str = "torch",
    ):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        scale_shape = (-(-out_features // FP8_BLOCK), -(-in_features // FP8_BLOCK))
        self.weight = nn.Parameter(
            torch.empty(out_features, in_features, dtype=torch.float8_e4m3fn), requires_grad=False
        )
        self.weight_scale_inv = nn.Parameter(torch.empty(scale_shape, dtype=torch.float32), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype), requires_grad=False) if bias else None
        for param in (self.weight, self.weight_scale_inv, self.bias):
            if param is not None:
                param.weight_loader = self._load  # type: ignore[attr-defined]
        if backend == "deep_gemm":
            try:
                fp8._deep_gemm()  # fail at construction, not at the first forward
            except ImportError as exc:
                raise ValueError(f"fp8 linear backend 'deep_gemm' is not available on this machine: {exc}") from None
        self._linear = registry.get("fp8_block_linear", backend)

    @staticmethod
    def _load(param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        if shard_id is not None:
            raise ValueError(f"Fp8BlockLinear is not sharded; got shard_id={shard_id!r}")
        if param.dtype == torch.float8_e4m3fn and loaded.dtype != torch.float8_e4m3fn:
            raise ValueError(f"FP8 weight expected as float8_e4m3fn, got {loaded.dtype}")
        default_weight_loader(param, loaded.to(param.dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._linear(x, self.weight, self.weight_scale_inv, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, fp8 block {FP8_BLOCK}"
