"""Tensor-parallel linear layers over block-quantized FP8 weights, as FP8 checkpoints store them.

A checkpoint whose ``quantization_config`` is block FP8 (see
:mod:`~flotilla.cluster.models.fp8_config`) keeps each quantized linear as ``weight[N, K]``
(``float8_e4m3fn``) and ``weight_scale_inv[ceil(N/128), ceil(K/128)]`` (the blockwise
multiplier). The layers here are the FP8 variants of :mod:`~flotilla.cluster.models.layers`'
merged column-, q/k/v- and row-parallel layers: same sharding, same ``weight_loader`` seam,
plus a float32 ``weight_scale_inv`` sharded with matching offsets, and a forward through op
``fp8_block_linear`` of the model's ``fp8_backend`` (``torch``: dequantize and multiply in
float32; ``triton``: float8 tiles widened in registers).

Sharding an FP8 weight must cut on its 128x128 scale blocks, so:

- a column-parallel shard holds a multiple of 128 rows of each part (q, k, v; gate, up), and
  the parts of a merged matrix other than the last hold a multiple of 128 rows even on one
  rank (part ``i``'s scale rows land at ``part_offset / 128``);
- a row-parallel shard holds a multiple of 128 input columns.

A layout that breaks this is a ValueError naming the layer and the sizes when the model is
built. Scales start as NaN, and :func:`check_fp8_scales_loaded` names any block no checkpoint
tensor filled (a missing ``weight_scale_inv``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
from torch import nn

from flotilla.cluster.models.base import ModelConfig, ParallelLayout
from flotilla.cluster.models.fp8_config import FP8_BLOCK, BlockFp8Config
from flotilla.cluster.models.layers import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from flotilla.kernels import registry

FP8 = torch.float8_e4m3fn
_SCALE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def blocks(n: int) -> int:
    """Scale blocks along a dimension of ``n`` elements."""
    return -(-n // FP8_BLOCK)


def scale_parameter(shape: tuple[int, ...], loader) -> nn.Parameter:
    """A float32 ``*_scale_inv`` parameter, NaN until loaded (see :func:`check_fp8_scales_loaded`)."""
    param = nn.Parameter(torch.full(shape, float("nan"), dtype=torch.float32), requires_grad=False)
    param.weight_loader = loader  # type: ignore[attr-defined]
    return param


def check_fp8_weight(loaded: torch.Tensor, name: str) -> None:
    """ValueError unless the checkpoint tensor ``name`` is float8_e4m3fn."""
    if loaded.dtype != FP8:
        raise ValueError(
            f"{name} is {loaded.dtype} in the checkpoint, but quantization_config (quant_method 'fp8') quantizes "
            f"it: expected float8_e4m3fn; a checkpoint that keeps it unquantized lists it in modules_to_not_convert"
        )


def check_scale(loaded: torch.Tensor, weight_shape: tuple[int, int], name: str) -> None:
    """ValueError unless ``loaded`` is the scale of a full ``weight_shape`` weight: one
    float32/bfloat16 value per 128x128 block."""
    want = (blocks(weight_shape[0]), blocks(weight_shape[1]))
    if tuple(loaded.shape) != want:
        raise ValueError(
            f"{name} has shape {tuple(loaded.shape)}, expected {want} for a {list(weight_shape)} weight "
            f"(one scale per {FP8_BLOCK}x{FP8_BLOCK} block)"
        )
    if loaded.dtype not in _SCALE_DTYPES:
        raise ValueError(f"{name} is {loaded.dtype}, expected float32 or bfloat16")


class _Fp8Stacked:
    """The FP8 part of a merged column-parallel projection (a mixin over
    :class:`MergedColumnParallelLinear` and :class:`QKVParallelLinear`)."""

    weight_dtype = FP8
    output_sizes: list[int]
    parallel: ParallelLayout

    def _init_fp8(self, in_features: int, prefix: str, parts: Sequence[str], backend: str) -> None:
        if len(parts) != len(self.output_sizes):
            raise ValueError(f"{prefix}: {len(parts)} part names for {len(self.output_sizes)} parts")
        self.prefix, self.parts = prefix, tuple(parts)
        for shard, (part, size) in enumerate(zip(parts, self.output_sizes)):
            if size % FP8_BLOCK == 0:
                continue
            if self._slices(shard) > 1:
                raise ValueError(
                    f"{prefix}.{part}: its rows per rank ({size} of {size * self._slices(shard)}, "
                    f"tp_size={self.parallel.tp_size}) do not cut on the {FP8_BLOCK}-row blocks of its FP8 "
                    f"weight_scale_inv; choose a tp_size that leaves a multiple of {FP8_BLOCK} rows per rank"
                )
            if shard < len(parts) - 1:
                raise ValueError(
                    f"{prefix}.{part} has {size} rows, not a multiple of {FP8_BLOCK}: flotilla stacks it before "
                    f"{prefix}.{parts[shard + 1]} in one FP8 matrix, whose {FP8_BLOCK}-row scale blocks cannot "
                    f"straddle two parts"
                )
        self.weight.weight_loader = self._load_fp8_part  # type: ignore[attr-defined]
        shape = (blocks(sum(self.output_sizes)), blocks(in_features))
        self.weight_scale_inv = scale_parameter(shape, self._load_scale_part)
        self._fp8_linear = registry.get("fp8_block_linear", backend)

    def _slices(self, shard_id: int) -> int:
        """How many ranks' slices part ``shard_id`` is cut into."""
        return self.parallel.tp_size

    def _load_fp8_part(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        if shard_id is not None:
            check_fp8_weight(loaded, f"{self.prefix}.{self.parts[shard_id]}.weight")
        self._load_part(param, loaded, shard_id)

    def _load_scale_part(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        if shard_id is None:
            raise ValueError(f"{self.prefix}: a merged projection's scales need the shard_id of the part being loaded")
        size = self.output_sizes[shard_id]
        full = (size * self._slices(shard_id), self.weight.shape[1])
        check_scale(loaded, full, f"{self.prefix}.{self.parts[shard_id]}.weight_scale_inv")
        offset, rows = sum(self.output_sizes[:shard_id]) // FP8_BLOCK, blocks(size)
        start = self._part_rank(shard_id) * size // FP8_BLOCK
        param.data.narrow(0, offset, rows).copy_(loaded.narrow(0, start, rows))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._fp8_linear(x, self.weight, self.weight_scale_inv, self.bias)


class Fp8MergedColumnParallelLinear(_Fp8Stacked, MergedColumnParallelLinear):
    """:class:`MergedColumnParallelLinear` (e.g. ``[gate; up]``) over a block-FP8 weight.

    ``prefix`` and ``parts`` name the checkpoint modules (``model.layers.0.mlp``, ``("gate_proj",
    "up_proj")``) for messages; ``backend`` is the kernel backend of op ``fp8_block_linear``.
    """

    def __init__(
        self,
        in_features: int,
        output_sizes: Sequence[int],
        bias: bool = False,
        parallel: ParallelLayout = ParallelLayout(),
        dtype: torch.dtype = torch.float32,
        *,
        prefix: str,
        parts: Sequence[str],
        backend: str = "torch",
    ):
        MergedColumnParallelLinear.__init__(self, in_features, output_sizes, bias, parallel, dtype)
        self._init_fp8(in_features, prefix, parts, backend)


class Fp8QKVParallelLinear(_Fp8Stacked, QKVParallelLinear):
    """:class:`QKVParallelLinear` over a block-FP8 weight (``prefix``: the attention module,
    e.g. ``model.layers.0.self_attn``; parts ``q_proj``, ``k_proj``, ``v_proj``)."""

    def __init__(
        self,
        in_features: int,
        head_dim: int,
        num_heads: int,
        num_kv_heads: int,
        bias: bool = False,
        parallel: ParallelLayout = ParallelLayout(),
        dtype: torch.dtype = torch.float32,
        *,
        prefix: str,
        backend: str = "torch",
    ):
        QKVParallelLinear.__init__(self, in_features, head_dim, num_heads, num_kv_heads, bias, parallel, dtype)
        self._init_fp8(in_features, prefix, ("q_proj", "k_proj", "v_proj"), backend)

    def _slices(self, shard_id: int) -> int:
        # NOTE: with fewer KV heads than ranks, kv_replicas ranks hold the same K/V slice.
        return self.parallel.tp_size if shard_id == 0 else self.parallel.tp_size // self.kv_replicas


class Fp8RowParallelLinear(RowParallelLinear):
    """:class:`RowParallelLinear` over a block-FP8 weight (``prefix``: the checkpoint module,
    e.g. ``model.layers.0.mlp.down_proj``); each rank holds a multiple of 128 input columns."""

    weight_dtype = FP8

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = False,
        parallel: ParallelLayout = ParallelLayout(),
        dtype: torch.dtype = torch.float32,
        all_reduce=None,
        *,
        prefix: str,
        backend: str = "torch",
    ):
        super().__init__(in_features, out_features, bias, parallel, dtype, all_reduce)
        self.prefix = prefix
        if parallel.tp_size > 1 and self.in_per_rank % FP8_BLOCK:
            raise ValueError(
                f"{prefix}: its input columns per rank ({self.in_per_rank} of {in_features}, tp_size={parallel.tp_size}) "
                f"do not cut on the {FP8_BLOCK}-column blocks of its FP8 weight_scale_inv; choose a tp_size that "
                f"leaves a multiple of {FP8_BLOCK} columns per rank"
            )
        self.weight.weight_loader = self._load_fp8_cols  # type: ignore[attr-defined]
        self.weight_scale_inv = scale_parameter((blocks(out_features), blocks(self.in_per_rank)), self._load_scale)
        self._fp8_linear = registry.get("fp8_block_linear", backend)

    def _load_fp8_cols(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        check_fp8_weight(loaded, f"{self.prefix}.weight")
        self._load_cols(param, loaded, shard_id)

    def _load_scale(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        full = (self.weight.shape[0], self.in_per_rank * self.parallel.tp_size)
        check_scale(loaded, full, f"{self.prefix}.weight_scale_inv")
        cols = param.shape[1]
        param.data.copy_(loaded.narrow(1, self.parallel.tp_rank * cols, cols))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.reduce_partial(self._fp8_linear(x, self.weight, self.weight_scale_inv))


@dataclass(frozen=True)
class ParallelLinears:
    """Builds a model's projections: the FP8 variant where the checkpoint quantizes the module,
    else the plain layer. ``prefix`` arguments are checkpoint module names (``None``: a module
    outside the checkpoint's FP8 naming, always plain).

    Attributes:
        fp8: the checkpoint's quantization (None: every layer plain).
        backend: the kernel backend of op ``fp8_block_linear``.
    """

    fp8: BlockFp8Config | None = None
    backend: str = "torch"

    @classmethod
    def of(cls, cfg: ModelConfig) -> "ParallelLinears":
        return cls(cfg.fp8, cfg.fp8_backend)

    def merged(
        self,
        prefix: str | None,
        parts: Sequence[str],
        in_features: int,
        output_sizes: Sequence[int],
        bias: bool,
        parallel: ParallelLayout,
        dtype: torch.dtype,
    ) -> MergedColumnParallelLinear:
        """``parts`` of module ``prefix`` (``gate_proj``, ``up_proj``) stacked in one matrix."""
        if prefix is not None and self.fp8 is not None and self.fp8.quantizes_all(prefix, parts):
            return Fp8MergedColumnParallelLinear(
                in_features, output_sizes, bias, parallel, dtype, prefix=prefix, parts=parts, backend=self.backend
            )
        return MergedColumnParallelLinear(in_features, output_sizes, bias, parallel, dtype)

    def qkv(
        self,
        prefix: str | None,
        in_features: int,
        head_dim: int,
        num_heads: int,
        num_kv_heads: int,
        bias: bool,
        parallel: ParallelLayout,
        dtype: torch.dtype,
    ) -> QKVParallelLinear:
        """The ``q_proj``/``k_proj``/``v_proj`` of attention module ``prefix``."""
        args = (in_features, head_dim, num_heads, num_kv_heads, bias, parallel, dtype)
        if prefix is not None and self.fp8 is not None and self.fp8.quantizes_all(prefix, ("q_proj", "k_proj", "v_proj")):
            return Fp8QKVParallelLinear(*args, prefix=prefix, backend=self.backend)
        return QKVParallelLinear(*args)

    def row(
        self,
        name: str | None,
        in_features: int,
        out_features: int,
        bias: bool,
        parallel: ParallelLayout,
        dtype: torch.dtype,
    ) -> RowParallelLinear:
        """The row-parallel module ``name`` (``model.layers.0.self_attn.o_proj``)."""
        if name is not None and self.fp8 is not None and self.fp8.quantizes(name):
            return Fp8RowParallelLinear(
                in_features, out_features, bias, parallel, dtype, prefix=name, backend=self.backend
            )
        return RowParallelLinear(in_features, out_features, bias, parallel, dtype)


def check_fp8_scales_loaded(model: nn.Module) -> None:
    """ValueError naming every FP8 scale parameter with blocks no checkpoint tensor filled
    (they start as NaN): a checkpoint without some ``weight_scale_inv``."""
    missing = []
    for name, param in model.named_parameters():
        if name.endswith("scale_inv") and bool(torch.isnan(param).any()):
            rows = ""
            if param.dim() == 3:  # stacked experts: which local rows
                rows = f" (local expert rows {torch.isnan(param).flatten(1).any(1).nonzero().flatten().tolist()})"
            missing.append(name + rows)
    if missing:
        raise ValueError(
            f"the FP8 checkpoint provides no scales for {len(missing)} parameter(s), e.g. {missing[:5]}: every "
            f"quantized <module>.weight needs its <module>.weight_scale_inv"
        )
