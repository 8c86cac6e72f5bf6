"""Parallel-ready layers: every model is written against these.

Each parameter carries a ``weight_loader(param, loaded, shard_id=None)`` that
copies this rank's slice of a full checkpoint tensor, so tensor parallelism is a
property of the layer, not of the model code. Today the layout is a single rank
(``tp_size == 1``); the slicing rules are already the tensor-parallel ones:

- :class:`ColumnParallelLinear` splits the output dimension across ranks;
- :class:`MergedColumnParallelLinear` is several column-parallel projections
  stacked (gate/up; q/k/v), each loaded by its ``shard_id``;
- :class:`RowParallelLinear` splits the input dimension and all-reduces its output;
- :class:`QKVParallelLinear` splits attention heads, replicating KV heads when
  there are fewer of them than ranks;
- :class:`VocabParallelEmbedding` / :class:`ParallelLMHead` split the vocabulary.

Across ranks the layers communicate through ``parallel.group`` (see
:class:`flotilla.cluster.models.base.ParallelLayout`); on one rank none is needed.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from flotilla.cluster.models.base import ParallelLayout


# ``linear_op(x, weight, bias=None)``: ``F.linear``'s contract.
LinearOp = Callable[..., torch.Tensor]


def use_linear_op(model: nn.Module, linear_op: LinearOp, **fused_ops: Callable | None) -> int:
    """Run every module of ``model`` that has a ``linear_op`` (the column- and row-parallel
    linear layers, MoE routers) on ``linear_op`` (a kernel backend's ``linear``, e.g. the Triton
    decode GEMV), and hand each fused op to the modules that have an attribute of its name (None
    there means "run the separate ops"): ``silu_and_mul_linear`` (gated MLPs: the activation
    fused into the down projection), ``rms_norm_linear`` (decoder layers: a norm fused into the
    projection after it). Returns how many modules got ``linear_op``. The embedding and LM head
    keep ``F.linear``."""
    changed = 0
    for module in model.modules():
        # NOTE: a block-FP8 layer keeps its own forward (op fp8_block_linear over its float8
        # weight and scales), and a module holding one (a decoder layer, a gated MLP) keeps its
        # separate ops: every op handed out here reads ``.weight`` as a half-precision matrix.
        if holds_block_fp8(module):
            continue
        if hasattr(module, "linear_op"):
            module.linear_op = linear_op
            changed += 1
        for name, op in fused_ops.items():
            if op is not None and hasattr(module, name):
                setattr(module, name, op)
    return changed


def holds_block_fp8(module: nn.Module) -> bool:
    """Whether ``module`` or a module inside it holds a float8 weight (the block-FP8 layers of
    :mod:`flotilla.cluster.models.fp8_linear` and :mod:`flotilla.cluster.models.fp8_moe`)."""
    return any(p.dtype == torch.float8_e4m3fn for p in module.parameters())


def _divide(total: int, parts: int, what: str) -> int:
    if total % parts:
        raise ValueError(f"{what}={total} is not divisible by tp_size={parts}")
    return total // parts


def default_weight_loader(param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
    """Copy a whole (unsharded) tensor into ``param``, checking the shape."""
    if param.shape != loaded.shape:
        raise ValueError(f"weight shape {tuple(loaded.shape)} does not match parameter {tuple(param.shape)}")
    param.data.copy_(loaded)


def _set_loader(param: nn.Parameter, loader: Callable) -> nn.Parameter:
    param.weight_loader = loader  # type: ignore[attr-defined]
    return param


class ColumnParallelLinear(nn.Module):
    """``y = x W^T + b`` with W's output rows split across tensor-parallel ranks."""

    # The weight's storage dtype when it is not ``dtype`` (the FP8 variants: float8_e4m3fn).
    weight_dtype: torch.dtype | None = None

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = False,
        parallel: ParallelLayout = ParallelLayout(),
        dtype: torch.dtype = torch.float32,
    ):
        super().__init__()
        self.parallel = parallel
        self.out_per_rank = _divide(out_features, parallel.tp_size, "out_features")
        self.weight = _set_loader(
            nn.Parameter(
                torch.empty(self.out_per_rank, in_features, dtype=self.weight_dtype or dtype), requires_grad=False
            ),
            self._load_rows,
        )
        self.bias = (
            _set_loader(nn.Parameter(torch.zeros(self.out_per_rank, dtype=dtype), requires_grad=False), self._load_rows)
            if bias
            else None
        )
        # NOTE: the GEMM kernel; use_linear_op swaps in a CUDA backend's (see its docstring).
        self.linear_op: LinearOp = F.linear

    def _load_rows(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        start = self.parallel.tp_rank * param.shape[0]
        default_weight_loader(param, loaded.narrow(0, start, param.shape[0]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_op(x, self.weight, self.bias)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections in one matrix (``[gate; up]``, ``[q; k; v]``).

    ``output_sizes`` are the full (unsharded) sizes of each part; the checkpoint
    tensor of part ``i`` is loaded with ``shard_id=i``.
    """

    def __init__(
        self,
        in_features: int,
        output_sizes: Sequence[int],
        bias: bool = False,
        parallel: ParallelLayout = ParallelLayout(),
        dtype: torch.dtype = torch.float32,
    ):
        self.output_sizes = [_divide(s, parallel.tp_size, "output size") for s in output_sizes]
        super().__init__(in_features, sum(output_sizes), bias, parallel, dtype)
        self.weight.weight_loader = self._load_part  # type: ignore[attr-defined]
        if self.bias is not None:
            self.bias.weight_loader = self._load_part  # type: ignore[attr-defined]

    def _load_part(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        if shard_id is None:
            raise ValueError("a merged projection needs the shard_id of the part being loaded")
        size = self.output_sizes[shard_id]
        offset = sum(self.output_sizes[:shard_id])
        part = loaded.narrow(0, self._part_rank(shard_id) * size, size)
        default_weight_loader(param.data.narrow(0, offset, size), part)  # type: ignore[arg-type]

    def _part_rank(self, shard_id: int) -> int:
        """Which slice of part ``shard_id`` this rank holds."""
        return self.parallel.tp_rank

    def split(self, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Split an output into its parts (this rank's slices)."""
        return tuple(y.split(self.output_sizes, dim=-1))


def kv_heads_per_rank(num_kv_heads: int, tp_size: int) -> int:
    """KV heads each rank holds: ``num_kv_heads / tp_size``, or 1 (replicated) when
    there are fewer KV heads than ranks; ValueError when neither divides the other."""
    if num_kv_heads >= tp_size:
        return _divide(num_kv_heads, tp_size, "num_key_value_heads")
    if tp_size % num_kv_heads:
        raise ValueError(f"tp_size={tp_size} is not a multiple of num_key_value_heads={num_kv_heads}")
    return 1


def kv_head_span(num_kv_heads: int, tp_size: int, tp_rank: int) -> tuple[int, int, int]:
    """``(start, count, total)``: the global KV heads rank ``tp_rank`` holds, as
    :class:`QKVParallelLinear` lays them out (a contiguous slice of ``num_kv_heads / tp``
    heads, or with fewer KV heads than ranks the one head ``tp_rank // (tp / num_kv_heads)``).
    The head axis of this rank's K and V cache tensors holds exactly these heads, in order."""
    if not 0 <= tp_rank < tp_size:
        raise ValueError(f"tp_rank={tp_rank} must be in [0, tp_size={tp_size})")
    count = kv_heads_per_rank(num_kv_heads, tp_size)
    if num_kv_heads >= tp_size:
        return tp_rank * count, count, num_kv_heads
    return tp_rank // (tp_size // num_kv_heads), 1, num_kv_heads


class QKVParallelLinear(MergedColumnParallelLinear):
    """The stacked ``[q; k; v]`` projection with heads split across ranks.

    Rank ``r`` holds q heads ``[r*Hq/tp, (r+1)*Hq/tp)``. With at least as many KV
    heads as ranks the KV heads are split the same way; with fewer, each KV head is
    replicated on ``tp / Hkv`` consecutive ranks (rank ``r`` holds KV head
    ``r // (tp / Hkv)``), which keeps every rank's q heads with the KV head they
    attend to in the unsharded model.
    """

    def __init__(
        self,
        in_features: int,
        head_dim: int,
        num_heads: int,
        num_kv_heads: int,
        bias: bool = False,
        parallel: ParallelLayout = ParallelLayout(),
        dtype: torch.dtype = torch.float32,
    ):
        tp = parallel.tp_size
        self.num_heads = _divide(num_heads, tp, "num_attention_heads")
        self.num_kv_heads = kv_heads_per_rank(num_kv_heads, tp)
        self.kv_replicas = max(1, tp // num_kv_heads)
        self.output_sizes = [self.num_heads * head_dim, self.num_kv_heads * head_dim, self.num_kv_heads * head_dim]
        # NOTE: skips MergedColumnParallelLinear.__init__: with replicated KV heads the
        # per-rank width is not the full width / tp.
        ColumnParallelLinear.__init__(self, in_features, sum(self.output_sizes) * tp, bias, parallel, dtype)
        self.weight.weight_loader = self._load_part  # type: ignore[attr-defined]
        if self.bias is not None:
            self.bias.weight_loader = self._load_part  # type: ignore[attr-defined]

    def _part_rank(self, shard_id: int) -> int:
        return self.parallel.tp_rank if shard_id == 0 else self.parallel.tp_rank // self.kv_replicas


class RowParallelLinear(nn.Module):
    """``y = x W^T + b`` with W's input columns split across ranks; partial outputs
    are summed across the group (a no-op on one rank)."""

    weight_dtype: torch.dtype | None = None  # as ColumnParallelLinear.weight_dtype

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = False,
        parallel: ParallelLayout = ParallelLayout(),
        dtype: torch.dtype = torch.float32,
        all_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ):
        super().__init__()
        self.parallel = parallel
        self.in_per_rank = _divide(in_features, parallel.tp_size, "in_features")
        group = parallel.group
        self.all_reduce = all_reduce if all_reduce is not None or group is None else group.all_reduce
        self.weight = _set_loader(
            nn.Parameter(
                torch.empty(out_features, self.in_per_rank, dtype=self.weight_dtype or dtype), requires_grad=False
            ),
            self._load_cols,
        )
        self.bias = (
            _set_loader(nn.Parameter(torch.zeros(out_features, dtype=dtype), requires_grad=False), default_weight_loader)
            if bias
            else None
        )
        self.linear_op: LinearOp = F.linear

    def _load_cols(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        start = self.parallel.tp_rank * param.shape[1]
        default_weight_loader(param, loaded.narrow(1, start, param.shape[1]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.reduce_partial(self.linear_op(x, self.weight))

    def reduce_partial(self, y: torch.Tensor) -> torch.Tensor:
        """This rank's ``x W^T`` (computed by the caller, e.g. a fused kernel) summed over
        the group, plus the bias: the rest of :meth:`forward`."""
        if self.all_reduce is not None and self.parallel.tp_size > 1:
            y = self.all_reduce(y)
        # NOTE: the bias is added once, after the reduction.
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    """Token embedding with the vocabulary split across ranks."""

    def __init__(self, vocab_size: int, dim: int, parallel: ParallelLayout = ParallelLayout(), dtype=torch.float32):
        super().__init__()
        self.parallel = parallel
        self.vocab_size = vocab_size
        self.per_rank = -(-vocab_size // parallel.tp_size)
        self.start = parallel.tp_rank * self.per_rank
        self.weight = _set_loader(
            nn.Parameter(torch.zeros(self.per_rank, dim, dtype=dtype), requires_grad=False), self._load_rows
        )

    def _load_rows(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        rows = loaded[self.start : self.start + self.per_rank]
        param.data.zero_()
        param.data[: rows.shape[0]].copy_(rows)

    def _group(self):
        if self.parallel.group is None:
            raise ValueError(
                f"tp_size={self.parallel.tp_size} needs a communicator: pass ParallelLayout(group=...) "
                "(see flotilla.cluster.distributed.Communicator)"
            )
        return self.parallel.group

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.parallel.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        group = self._group()
        local = input_ids - self.start
        outside = (local < 0) | (local >= self.per_rank)
        # NOTE: ids owned by another rank look up row 0 and are zeroed, so the sum over
        # ranks holds exactly one real row per token.
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        return group.all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding):
    """The output projection to vocabulary logits (optionally tied to the embedding)."""

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = F.linear(hidden, self.weight)
        if self.parallel.tp_size > 1:
            # NOTE: every rank holds per_rank rows (the last zero-padded), so the gathered
            # columns are the vocabulary in order followed by padding, cut below.
            logits = self._group().all_gather(logits, dim=-1)
        return logits[..., : self.vocab_size].float()
