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
from functools import cached_property
from typing import Any, Iterable, Mapping, Protocol

import torch

from flotilla.cluster.models.fp8_config import BlockFp8Config
from flotilla.kernels.attention import AttentionMetadata


@dataclass(frozen=True)
class ParallelLayout:
    """This rank's place in every parallel group of its engine group (one rank by default).

    The sizes and ranks come from :class:`flotilla.cluster.topology.Topology`; the live
    communicators (:class:`flotilla.cluster.distributed.Communicator`, or anything with
    the same collectives) from the worker that joined them.

    Attributes:
        tp_size, tp_rank: attention tensor parallelism (``attn_tp``): the ranks that split
            attention heads, and also the dense MLPs, the vocab-parallel embedding and the
            LM head (with DP attention each DP rank is its own replica of the dense part).
        group: the attention-TP communicator (None on one rank).
        ep_size, ep_rank: expert parallelism: which slice of the (physical) experts a rank holds.
        moe_tp_size, moe_tp_rank: MoE tensor parallelism: which slice of every local
            expert's intermediate dimension a rank holds.
        dp_size, dp_rank: attention data parallelism: which scheduler and KV cache the rank
            serves (DP ranks run different batches; MoE layers run in lockstep).
        dcp_size, dcp_rank: decode context parallelism (a slice of attention TP): which token
            shard of the KV cache the rank owns (token ``i`` on DCP rank ``i % dcp_size``).
        moe_a2a_backend: ``"none"`` (every EP rank computes its experts for all tokens and the
            partial outputs are all-reduced) or any other resolved name (tokens are dispatched
            to and combined from the experts' ranks with all-to-all).
        dcp_comm_backend: ``"ag_rs"`` or ``"a2a"``: how DCP partial attention is merged.
        comms: communicators by group kind (:data:`flotilla.cluster.topology.GROUP_NAMES`:
            ``tp`` (whole engine group), ``attn_tp``, ``attn_dp``, ``dcp``, ``ep``, ``moe_tp``, ...).

    NOTE: ``group`` and ``comms`` are excluded from equality and hashing: two layouts
    describe the same shard whatever live communicators they carry.
    """

    tp_size: int = 1
    tp_rank: int = 0
    group: Any = field(default=None, compare=False, hash=False, repr=False)
    ep_size: int = 1
    ep_rank: int = 0
    moe_tp_size: int = 1
    moe_tp_rank: int = 0
    dp_size: int = 1
    dp_rank: int = 0
    dcp_size: int = 1
    dcp_rank: int = 0
    moe_a2a_backend: str = "none"
    dcp_comm_backend: str = "ag_rs"
    comms: Mapping[str, Any] = field(default_factory=dict, compare=False, hash=False, repr=False)

    @classmethod
    def for_rank(
        cls,
        topology: Any,
        rank: int,
        comms: Mapping[str, Any],
        moe_a2a_backend: str = "none",
        dcp_comm_backend: str = "ag_rs",
    ) -> "ParallelLayout":
        """``rank``'s layout in ``topology`` (a :class:`~flotilla.cluster.topology.Topology`)
        with its communicators ``comms`` (from :func:`~flotilla.cluster.distributed.init_process_groups`)."""
        c = topology.coords(rank)
        return cls(
            tp_size=topology.attn_tp_size,
            tp_rank=c.attn_tp,
            group=comms.get("attn_tp"),
            ep_size=topology.ep_size,
            ep_rank=c.ep,
            moe_tp_size=topology.moe_tp_size,
            moe_tp_rank=c.moe_tp,
            dp_size=topology.attn_dp_size,
            dp_rank=c.attn_dp,
            dcp_size=topology.dcp_size,
            dcp_rank=c.dcp,
            moe_a2a_backend=moe_a2a_backend,
            dcp_comm_backend=dcp_comm_backend,
            comms=dict(comms),
        )

    def comm(self, name: str) -> Any:
        """The communicator of group kind ``name``; ValueError when this layout has none."""
        found = self.comms.get(name)
        if found is None:
            raise ValueError(
                f"this ParallelLayout has no {name!r} communicator (has: {sorted(self.comms) or 'none'}); "
                "build it with ParallelLayout.for_rank(topology, rank, init_process_groups(...))"
            )
        return found


@dataclass(frozen=True)
class ModelConfig:
    """What a model is built from.

    Attributes:
        hf: the HF config.json dict (``text_config`` already merged for VLMs is not assumed).
        dtype: parameter and activation dtype.
        parallel: tensor-parallel layout of this rank.
        attention_backend: name of the kernel backend for attention ops.
        elementwise_backend: name of the kernel backend for ``rms_norm``,
            ``rotary_embedding`` and ``silu_and_mul`` (``"torch"`` or ``"flashinfer"``; the
            flashinfer ops fall back to torch per call for inputs their kernels do not take,
            e.g. float32 or CPU tensors).
        moe_backend: name of the kernel backend of the routed experts' ``fused_moe``
            (``"torch"``, ``"triton"``, ...), passed to every
            :class:`~flotilla.cluster.models.moe_layer.FusedMoE` as its ``backend``.
        num_redundant_experts: extra physical expert slots of every MoE layer
            (``--ep-num-redundant-experts``), holding copies of logical experts.
        expert_placements: an explicit :class:`~flotilla.cluster.eplb.ExpertPlacement` per MoE
            layer, keyed by decoder layer index (a rank joining a grown elastic EP group is built
            with the group's grown placements); layers not listed get the trivial placement.
        fp8_backend: name of the kernel backend of op ``fp8_block_linear``, which the block-FP8
            linear layers of an FP8 checkpoint run on (``"torch"``, ``"triton"``); the FP8
            routed experts run op ``fp8_grouped_moe`` of ``moe_backend``.
        dsa_backend: name of the kernel backend of the DeepSeek sparse attention ops
            (``dsa_indexer``, ``dsa_sparse_mla``) of DeepSeek-V3.2 / GLM-5 (``"torch"``).
    """

    hf: Mapping[str, Any]
    dtype: torch.dtype = torch.float32
    parallel: ParallelLayout = field(default_factory=ParallelLayout)
    attention_backend: str = "torch"
    elementwise_backend: str = "torch"
    moe_backend: str = "torch"
    num_redundant_experts: int = 0
    expert_placements: Mapping[int, Any] = field(default_factory=dict)
    fp8_backend: str = "torch"
    dsa_backend: str = "torch"

    def get(self, key: str, default: Any = None) -> Any:
        value = self.hf.get(key, default)
        return default if value is None else value

    @cached_property
    def fp8(self) -> BlockFp8Config | None:
        """The checkpoint's block-FP8 quantization (read from ``hf``), or None when it has none."""
        return BlockFp8Config.from_hf(self.hf)


@dataclass(frozen=True)
class KVCacheSpec:
    """Per-layer cache layout: each layer holds ``len(tensors_per_layer)`` tensors of
    shape ``[num_blocks, block_size, *shape]`` (e.g. K and V of ``(num_kv_heads, head_dim)``;
    MLA: one latent tensor of ``(1, kv_lora_rank + rope_dim)``) in ``dtype``.

    ``layer_tensors``, when given, is each layer's own tuple of shapes instead (``num_layers``
    of them; ``tensors_per_layer`` is then layer 0's): DeepSeek sparse attention keeps its
    indexer keys ``(1, index_head_dim)`` beside the latent in the layers that run an indexer
    only.

    A model reports its own dtype; the runner allocates in the dtype ``--kv-cache-dtype``
    resolves to (``dataclasses.replace(spec, dtype=...)``; float8 for MHA/GQA, see
    :mod:`flotilla.cluster.engine.kv_cache_dtype`), and ``bytes_per_token`` follows it."""

    num_layers: int
    tensors_per_layer: tuple[tuple[int, ...], ...]
    dtype: torch.dtype
    layer_tensors: tuple[tuple[tuple[int, ...], ...], ...] | None = None

    def __post_init__(self) -> None:
        if self.layer_tensors is not None and len(self.layer_tensors) != self.num_layers:
            raise ValueError(f"layer_tensors lists {len(self.layer_tensors)} layers, expected num_layers={self.num_layers}")

    def shapes(self) -> tuple[tuple[tuple[int, ...], ...], ...]:
        """Every layer's tensor shapes (per token), in layer order."""
        return self.layer_tensors if self.layer_tensors is not None else (self.tensors_per_layer,) * self.num_layers

    def bytes_per_token(self) -> int:
        elems = sum(int(torch.Size(shape).numel()) for layer in self.shapes() for shape in layer)
        return elems * torch.tensor([], dtype=self.dtype).element_size()

    def allocate(self, num_blocks: int, block_size: int, device: str | torch.device = "cpu") -> list[tuple[torch.Tensor, ...]]:
        return [
            tuple(torch.zeros(num_blocks, block_size, *shape, dtype=self.dtype, device=device) for shape in layer)
            for layer in self.shapes()
        ]


class Model(Protocol):
    """What the engine needs from a model (see the module docstring)."""

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list, meta: AttentionMetadata
    ) -> torch.Tensor: ...

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor: ...

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None: ...

    def kv_cache_spec(self) -> KVCacheSpec: ...
