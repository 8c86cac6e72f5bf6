"""The model side of one engine step: build the model and its paged KV cache once,
then turn each :class:`SchedulerOutput` into one forward pass and sampled tokens.

Per step the runner flattens the scheduled requests into a varlen batch
(``input_ids``, ``positions`` and :class:`AttentionMetadata`), runs the forward
pass, keeps the hidden state of the LAST new token of each request that samples
this step (a partial prefill chunk samples nothing), projects only those rows to
logits and hands them to the :class:`Sampler`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

import torch

from flotilla.cluster.engine.kv_ports import KVEndpointFactory, KVPort, check_kv_attachable
from flotilla.cluster.engine.sampler import SampledToken, Sampler, SamplingRow
from flotilla.cluster.engine.scheduler import SchedulerOutput
from flotilla.cluster.engine.weight_packing import pack_linear_layers
from flotilla.cluster.eplb import ExpertPlacement
from flotilla.cluster.models.base import ParallelLayout
from flotilla.cluster.models.moe_layer import expert_placements, rewire_moe_layers
from flotilla.cluster.models.expert_load import ExpertLoadRecorder, attach_load_recorder
from flotilla.cluster.models.sources import ModelSource, load_model
from flotilla.kernels import registry
from flotilla.kernels.attention import AttentionMetadata
from flotilla.resolution import ResolvedConfig

# KV cache capacity on CPU when --max-total-tokens is not given.
DEFAULT_CPU_KV_TOKENS = 8192
# Block size when the resolved page_size is 1 (a token-granular pool, which the
# torch backend does not need): 16 tokens, vLLM's default.
DEFAULT_BLOCK_SIZE = 16

# Resolution names SGLang's attention backends; these run on the torch reference.
_TORCH_ATTENTION_BACKENDS = {"torch_native", "torch", "intel_amx", "triton", "flex_attention"}


@dataclass(frozen=True)
class KVCacheLayout:
    """What the KV pool looks like (a runtime fact, not part of the resolved config).

    Attributes:
        num_blocks: blocks in the pool.
        block_size: token slots per block.
        bytes_per_token: cache bytes one token takes across all layers.

    Under decode context parallelism (``dcp_size > 1``) this is the scheduler's LOGICAL view:
    ``block_size = dcp_size * local_block_size`` (each rank's cache blocks hold
    ``local_block_size`` rows, one logical block id naming the same block on every rank, see
    :mod:`flotilla.kernels.dcp`), ``num_blocks`` is the local pool's count, and
    ``bytes_per_token`` is what one rank stores per logical token: one cache row's bytes
    divided by ``dcp_size`` (rounded up).
    """

    num_blocks: int
    block_size: int
    bytes_per_token: int

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.block_size


def block_size_for(config: ResolvedConfig) -> int:
    """The resolved ``page_size`` when it is above 1, else :data:`DEFAULT_BLOCK_SIZE`."""
    page_size = config.page_size or 1
    return page_size if page_size > 1 else DEFAULT_BLOCK_SIZE


def kernel_backend_for(config: ResolvedConfig) -> str:
    """The kernel-registry backend for the resolved ``attention_backend``: the same name when a
    backend of that name is registered, the torch reference for SGLang's CPU/torch backends."""
    name = config.attention_backend or "torch_native"
    if name in registry.backends("paged_attention"):
        return name
    if name in _TORCH_ATTENTION_BACKENDS or config.device == "cpu":
        return "torch"
    registry.get("paged_attention", name)  # raises the registry's "not available here" error
    return name


class ModelRunner:
    """Owns the model, its KV caches and the sampler of one rank.

    Args:
        config: the resolved configuration (dtype, device, page size, max_total_tokens,
            mem_fraction_static, random_seed).
        source: where the model's config and weights are.
        pack_weights: on CPU, pre-pack linear weights for oneDNN (about 2x faster decode
            GEMMs; see :mod:`flotilla.cluster.engine.weight_packing`).
        parallel: this rank's tensor-parallel layout (one rank when omitted).
        expert_placements: an explicit expert placement per MoE layer (decoder layer index ->
            :class:`~flotilla.cluster.eplb.ExpertPlacement`; a rank joining a grown elastic EP
            group); the trivial placement when omitted.
    """

    def __init__(
        self,
        config: ResolvedConfig,
        source: ModelSource,
        pack_weights: bool = True,
        parallel: ParallelLayout | None = None,
        expert_placements: Mapping[int, ExpertPlacement] | None = None,
    ):
        self.config = config
        self.parallel = parallel or ParallelLayout()
        self.device = torch.device(config.device or "cpu")
        self.model = load_model(
            source,
            config.dtype or "auto",
            device=self.device,
            attention_backend=kernel_backend_for(config),
            parallel=self.parallel,
            load_format=config.load_format or "auto",
            num_redundant_experts=int(config.ep_num_redundant_experts or 0),
            expert_placements=expert_placements,
        )
        if pack_weights and self.device.type == "cpu":
            pack_linear_layers(self.model)
        self.load_recorder = self._make_load_recorder(config)
        self.vocab_size = int(source.config_dict["vocab_size"])
        spec = self.model.kv_cache_spec()
        dcp_size = self.parallel.dcp_size
        if dcp_size > 1 and not any(getattr(m, "supports_dcp", False) for m in self.model.modules()):
            raise NotImplementedError(
                f"dcp_size={dcp_size} is not supported for {type(self.model).__name__}: decode context "
                f"parallelism shards the MLA latent cache (DeepSeek-V2/V3) only; use dcp_size=1"
            )
        block_size = block_size_for(config)  # per rank: the local block size under DCP
        row_bytes = spec.bytes_per_token()
        num_rows = self._kv_cache_tokens(row_bytes, dcp_size)
        self.kv_layout = KVCacheLayout(
            max(1, num_rows // block_size), block_size * dcp_size, -(-row_bytes // dcp_size)
        )
        with torch.inference_mode():
            self.kv_caches = spec.allocate(self.kv_layout.num_blocks, block_size, self.device)
        generator = None
        if config.random_seed is not None:
            generator = torch.Generator(device=self.device).manual_seed(int(config.random_seed))
        self.sampler = Sampler(generator)
        # This rank's KV endpoint for prefill/decode disaggregation (see kv_attach).
        self.kv_port = KVPort(self.parallel.tp_rank)

    def _make_load_recorder(self, config: ResolvedConfig) -> ExpertLoadRecorder | None:
        """One recorder on every MoE layer when the resolved recorder mode is ``stat``."""
        mode = config.expert_distribution_recorder_mode
        if mode is None:
            return None
        if mode != "stat":
            raise NotImplementedError(
                f"expert_distribution_recorder_mode={mode!r} is not supported; flotilla records per-expert "
                f"counts only: use --expert-distribution-recorder-mode stat"
            )
        return attach_load_recorder(self.model, config.expert_distribution_recorder_buffer_size)

    def expert_load(self) -> dict | None:
        """The recorder's snapshot (see ``ExpertLoadRecorder.snapshot``): routed pairs per logical
        expert of each MoE layer, in its window; None when recording is off or the model has no
        MoE layer."""
        return None if self.load_recorder is None else self.load_recorder.snapshot()

    def expert_placements(self) -> dict[int, ExpertPlacement]:
        """The expert placement of every MoE layer (decoder layer index -> placement)."""
        return expert_placements(self.model)

    def rewire(self, parallel: ParallelLayout, placements: Mapping[int, ExpertPlacement]) -> None:
        """Adopt a grown (or restored) elastic EP layout: every MoE layer takes ``parallel``'s
        communicators and its layer's placement from ``placements``; no weight moves (see
        :func:`~flotilla.cluster.models.moe_layer.rewire_moe_layers`). Only the MoE view may
        change: attention TP and DCP must stay as they are (ValueError otherwise)."""
        old = self.parallel
        if (parallel.tp_size, parallel.tp_rank, parallel.dcp_size) != (old.tp_size, old.tp_rank, old.dcp_size):
            raise ValueError(
                f"an elastic EP layout change keeps attention TP and DCP (attention TP {old.tp_size} -> "
                f"{parallel.tp_size}, DCP {old.dcp_size} -> {parallel.dcp_size})"
            )
        rewire_moe_layers(self.model, parallel, dict(placements))
        self.parallel = parallel

    def _kv_cache_tokens(self, bytes_per_token: int, dcp_size: int = 1) -> int:
        """Cache rows this rank holds. ``--max-total-tokens`` counts the engine's (logical)
        tokens, of which one DCP rank stores ``1 / dcp_size``; the memory budget counts rows."""
        if self.config.max_total_tokens:
            return -(-int(self.config.max_total_tokens) // dcp_size)
        if self.device.type != "cuda":
            return DEFAULT_CPU_KV_TOKENS
        free, total = torch.cuda.mem_get_info(self.device)
        fraction = self.config.mem_fraction_static or 0.88
        # NOTE: what is already in use (weights, other processes) comes off the static share.
        budget = int(total * fraction) - (total - free)
        if budget < bytes_per_token * DEFAULT_BLOCK_SIZE:
            raise ValueError(
                f"mem_fraction_static={fraction} leaves no room for the KV cache on {self.device} "
                f"({free / 2**30:.1f} GiB free of {total / 2**30:.1f} GiB); raise --mem-fraction-static"
            )
        return budget // bytes_per_token

    def generator_for(self, seed: int) -> torch.Generator:
        """A fresh generator on this runner's device, for a request with ``seed``."""
        return torch.Generator(device=self.device).manual_seed(seed)

    # -- the step ---------------------------------------------------------------

    @torch.inference_mode()
    def execute(self, step: SchedulerOutput, rows: Sequence[SamplingRow]) -> list[SampledToken]:
        """Run one step; returns one token per scheduled request that samples (in schedule
        order), sampled with ``rows`` (one per such request, same order)."""
        input_ids, positions, meta, sample_index = self.prepare_inputs(step)
        hidden = self.forward(input_ids, positions, meta)
        if not rows:
            return []
        if len(rows) != sample_index.shape[0]:
            raise ValueError(f"{len(rows)} sampling rows for {sample_index.shape[0]} sampling requests")
        logits = self.model.compute_logits(hidden.index_select(0, sample_index))
        return self.sampler(logits, rows)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """One forward pass over the paged KV cache (counted as one pass by the load recorder)."""
        hidden = self.model(input_ids, positions, self.kv_caches, meta)
        if self.load_recorder is not None:
            self.load_recorder.end_pass()
        return hidden

    def prepare_inputs(self, step: SchedulerOutput) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]:
        """``(input_ids[T], positions[T], meta, sample_index[N])`` of a step, where
        ``sample_index`` holds the flat index of the last new token of each sampling request.

        An empty step (an idle DP-attention rank) gives zero-length tensors and a zero-sequence
        ``meta`` (``block_tables`` ``[0, 1]``, max lengths 0): the forward still runs, so the
        rank joins every collective of the step."""
        block_size = self.kv_layout.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_start = [0]
        seq_lens: list[int] = []
        tables: list[list[int]] = []
        sample_index: list[int] = []
        for item in step.scheduled:
            request, start, count = item.request, item.start_position, item.num_new_tokens
            end = start + count
            input_ids.extend(request.all_token_ids[start:end])
            positions.extend(range(start, end))
            blocks = request.block_ids
            # NOTE: slots of the new tokens, one block run at a time (a decode touches one block).
            for block_index in range(start // block_size, (end - 1) // block_size + 1):
                base = blocks[block_index] * block_size
                lo = max(start, block_index * block_size) - block_index * block_size
                hi = min(end, (block_index + 1) * block_size) - block_index * block_size
                slots.extend(range(base + lo, base + hi))
            query_start.append(query_start[-1] + count)
            seq_lens.append(end)
            tables.append(blocks[: (end + block_size - 1) // block_size])
            if item.samples:
                sample_index.append(query_start[-1] - 1)
        width = max((len(t) for t in tables), default=1)
        padded = [t + [0] * (width - len(t)) for t in tables]
        device = self.device
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=device),
            query_start=torch.tensor(query_start, dtype=torch.long, device=device),
            seq_lens=torch.tensor(seq_lens, dtype=torch.long, device=device),
            block_tables=torch.tensor(padded, dtype=torch.long, device=device).view(len(padded), width),
            max_query_len=max((item.num_new_tokens for item in step.scheduled), default=0),
            max_seq_len=max(seq_lens, default=0),
            block_size=block_size,
        )
        return (
            torch.tensor(input_ids, dtype=torch.long, device=device),
            torch.tensor(positions, dtype=torch.long, device=device),
            meta,
            torch.tensor(sample_index, dtype=torch.long, device=device),
        )

    # -- KV transfer (prefill/decode disaggregation; one rank, the endpoint in this process) --

    def kv_head_span(self) -> tuple[int, int, int]:
        """``(start, count, total)``: the global KV heads this rank's cache holds on axis 2 of
        each cache tensor (the model's layout; MLA: ``(0, 1, 1)``, replicated)."""
        span = getattr(self.model, "kv_head_span", None)
        if span is None:
            raise NotImplementedError(
                f"{type(self.model).__name__} does not report which KV heads a rank holds, which prefill/decode "
                "disaggregation needs: give the model a kv_head_span() (see cluster/models/layers.kv_head_span), "
                "or serve it colocated"
            )
        return tuple(int(x) for x in span())

    def kv_attach(self, factory: KVEndpointFactory, rank: int | None = None) -> None:
        """Build this rank's KV endpoint: ``factory(rank, kv_caches, kv_head_span())`` (once,
        until :meth:`kv_detach`). ``rank`` names the endpoint (a worker's group rank; this
        runner's TP rank when None). NotImplementedError under DCP or DP attention."""
        check_kv_attachable(self.parallel.dcp_size, self.parallel.dp_size)
        if rank is not None and not self.kv_port.attached:
            self.kv_port.rank = rank
        self.kv_port.attach(factory, self.kv_caches, self.kv_head_span())

    def kv_metadata(self) -> list[bytes]:
        """The endpoint's metadata, one entry per rank (one here)."""
        return [self.kv_port.metadata()]

    def kv_connect(self, peer_id: str, peer_metadata: Sequence[bytes]) -> None:
        """Connect the peer engine ``peer_id`` (its ``kv_metadata()``; idempotent per peer)."""
        self.kv_port.connect(peer_id, peer_metadata)

    def kv_read(self, peer_id: str, src: Sequence[int], dst: Sequence[int], timeout_s: float) -> int:
        """Pull this rank's KV heads of ``peer_id``'s blocks ``src`` into blocks ``dst``
        (pairwise); returns the bytes moved. KVRankError (naming the rank) on a transfer
        failure, ValueError on misuse."""
        # NOTE: the cache tensors are inference tensors; a CPU copy into them needs inference mode.
        with torch.inference_mode():
            return self.kv_port.read(peer_id, src, dst, timeout_s)

    def kv_export(self, block_ids: Sequence[int], heads: tuple[int, int] | None = None):
        """Source side of the Ray fallback: the blocks' bytes (``heads``: global ``[lo, hi)``)."""
        return self.kv_port.export(block_ids, heads)

    def kv_forget(self, peer_id: str) -> None:
        self.kv_port.forget(peer_id)

    def kv_set_fail_next_reads(self, n: int) -> None:
        """Test seam: the next ``n`` reads fail without moving anything."""
        self.kv_port.set_fail_next_reads(n)

    def kv_detach(self) -> None:
        """Close the KV endpoint (idempotent)."""
        self.kv_port.detach()

    def shutdown(self) -> None:
        """Release what outlives a step: the KV endpoint (idempotent)."""
        self.kv_detach()
