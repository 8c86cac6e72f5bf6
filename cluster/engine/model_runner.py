"""The model side of one engine step: build the model and its paged KV cache once,
then turn each :class:`SchedulerOutput` into one forward pass and sampled tokens.

Per step the runner flattens the scheduled requests into a varlen batch
(``input_ids``, ``positions`` and :class:`AttentionMetadata`), runs the forward
pass, keeps the hidden state of the LAST new token of each request that samples
this step (a partial prefill chunk samples nothing), projects only those rows to
logits and hands them to the :class:`Sampler`.

On CUDA the runner also picks the kernel backends at start
(:mod:`flotilla.cluster.engine.kernel_backends`), plans attention once per step (the
backend's ``attention_planner``) and replays captured CUDA graphs for pure decode steps
(:mod:`flotilla.cluster.engine.cuda_graphs`); :meth:`ModelRunner.startup_report` says what
start-up cost.
"""

from __future__ import annotations

import gc
import time
from dataclasses import dataclass, replace
from typing import Any, Mapping, Sequence

import torch

from flotilla.cluster.engine.cuda_graphs import DecodeGraphs, decode_graph_sizes, uncapturable_collectives
from flotilla.cluster.engine.dp_scheduler import can_grow_elastic_ep
from flotilla.cluster.engine.host_kv_store import HostKVStore
from flotilla.cluster.engine.host_kv_tier import host_kv_blocks
from flotilla.cluster.engine.input_staging import InputStaging, device_index
from flotilla.cluster.engine.kernel_backends import dsa_backend_for, has_experts, kernel_backends_for, load_kernel_backends
from flotilla.cluster.engine.kv_cache_dtype import kv_cache_dtype_for
from flotilla.cluster.engine.limits import DEFAULT_BLOCK_SIZE, block_size_for, max_num_seqs_for
from flotilla.cluster.kv.port import KVPort
from flotilla.cluster.engine.request import Request
from flotilla.cluster.engine.overlap import PENDING_TOKEN, TokenFeed
from flotilla.cluster.engine.pooling import HiddenPooler, pools
from flotilla.cluster.engine.sampler import SampledBatch, SampledToken, Sampler, SamplingRow, logits_rows
from flotilla.cluster.engine.sampling_params import SamplingParams
from flotilla.cluster.engine.scheduler import ScheduledRequest, SchedulerOutput
from flotilla.cluster.engine.weight_packing import pack_linear_layers
from flotilla.cluster.eplb import ExpertPlacement
from flotilla.cluster.models.base import ParallelLayout
from flotilla.cluster.models.moe_layer import expert_placements, rewire_moe_layers
from flotilla.cluster.models.expert_load import ExpertLoadRecorder, attach_load_recorder
from flotilla.cluster.models.fp8_config import BlockFp8Config
from flotilla.cluster.models.layers import use_linear_op
from flotilla.cluster.models.sources import ModelSource, load_model, resolve_dtype
from flotilla.kernels import registry
from flotilla.kernels.attention import AttentionMetadata
from flotilla.resolution import ResolvedConfig
from flotilla.resolution.model_derive import is_deepseek_dsa

# KV cache capacity on CPU when --max-total-tokens is not given.
DEFAULT_CPU_KV_TOKENS = 8192


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

    ``scratch_block`` (CUDA kernel backends only, else None) is one more cache block, past the
    ``num_blocks`` the scheduler hands out: padding rows of a CUDA-graph batch and the
    start-up warm-up write and read there, never a request.

    ``host_blocks`` is the host tier's size in blocks (``--enable-hierarchical-cache``; 0 when
    off): :class:`~flotilla.cluster.engine.host_kv_store.HostKVStore` slots on every rank.
    """

    num_blocks: int
    block_size: int
    bytes_per_token: int
    scratch_block: int | None = None
    host_blocks: int = 0

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.block_size


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
        started = time.perf_counter()
        self.config = config
        self.parallel = parallel or ParallelLayout()
        self.device = torch.device(config.device or "cpu")
        dtype = resolve_dtype(config.dtype or "auto", source, self.device)
        # NOTE: a backend this machine lacks, an FP8 quantization_config flotilla cannot
        # load, or a kv_cache_dtype it cannot store fails here, before any weight is loaded.
        kv_dtype = kv_cache_dtype_for(config, dtype, source.config_dict)
        fp8_model = BlockFp8Config.from_hf(source.config_dict) is not None
        self.backends = kernel_backends_for(
            config, dtype, moe_model=has_experts(source.config_dict), fp8_model=fp8_model
        )
        load_kernel_backends(self.backends, registry)
        # NOTE: a DSA model's sparse attention ops (DeepSeek-V3.2, GLM-5): the torch reference.
        self.dsa_backend = dsa_backend_for(config, self.backends) if is_deepseek_dsa(source.config_dict) else None
        self.model = load_model(
            source,
            dtype,
            device=self.device,
            attention_backend=self.backends.attention,
            elementwise_backend=self.backends.elementwise,
            moe_backend=self.backends.moe,
            parallel=self.parallel,
            load_format=config.load_format or "auto",
            num_redundant_experts=int(config.ep_num_redundant_experts or 0),
            expert_placements=expert_placements,
            fp8_backend=self.backends.fp8,
            dsa_backend=self.dsa_backend or "torch",
        )
        if pack_weights and self.device.type == "cpu":
            pack_linear_layers(self.model)
        if self.backends.linear != "torch":
            use_linear_op(
                self.model,
                registry.get("linear", self.backends.linear),
                silu_and_mul_linear=registry.get("silu_and_mul_linear", self.backends.linear),
                rms_norm_linear=registry.get("rms_norm_linear", self.backends.linear),
            )
        self.load_recorder = self._make_load_recorder(config)
        # Speculative decoding with a hidden-state drafter (MTP): every step runs eagerly and
        # leaves its final hidden states [T, H] (schedule order) in last_hidden.
        self.keep_hidden = False
        self.last_hidden: torch.Tensor | None = None
        # Embedding requests' pooling, and the last step's pooled rows (row -> vector).
        self.pooler = HiddenPooler()
        self.last_pooled: dict[int, list[float] | None] = {}
        self.vocab_size = int(source.config_dict["vocab_size"])
        self._synchronize()
        loaded = time.perf_counter()
        spec = replace(self.model.kv_cache_spec(), dtype=kv_dtype)
        dcp_size = self.parallel.dcp_size
        if dcp_size > 1 and not any(getattr(m, "supports_dcp", False) for m in self.model.modules()):
            raise NotImplementedError(
                f"dcp_size={dcp_size} is not supported for {type(self.model).__name__}: decode context "
                f"parallelism shards the MLA latent cache (DeepSeek-V2/V3/V3.2, GLM-5) only; use dcp_size=1"
            )
        block_size = block_size_for(config)  # per rank: the local block size under DCP
        row_bytes = spec.bytes_per_token()
        num_rows = self._kv_cache_tokens(row_bytes, dcp_size)
        max_num_seqs = max_num_seqs_for(config)
        multi_rank = _multi_rank(self.parallel)
        graph_sizes, self.graphs_off_reason = decode_graph_sizes(
            config,
            device=self.device,
            attention_backend=self.backends.attention,
            collectives=uncapturable_collectives(self.parallel),
            elastic=can_grow_elastic_ep(config),
            recording=self.load_recorder is not None,
            moe_on_torch=self.backends.moe == "torch" and bool(self.expert_placements()),
            max_num_seqs=max_num_seqs,
        )
        num_blocks = max(1, num_rows // block_size)
        # NOTE: the scratch block lies past the scheduler's num_blocks (one block above the budget).
        scratch = num_blocks if self.device.type == "cuda" and self.backends.attention != "torch" else None
        with torch.inference_mode():
            self.kv_caches = spec.allocate(num_blocks + (scratch is not None), block_size, self.device)
        block_bytes = sum(t[0].numel() * t.element_size() for layer in self.kv_caches for t in layer)
        host_blocks = host_kv_blocks(config, block_bytes, num_blocks)
        self.kv_layout = KVCacheLayout(num_blocks, block_size * dcp_size, -(-row_bytes // dcp_size), scratch, host_blocks)
        self._synchronize()
        allocated = time.perf_counter()
        # The host tier's bytes (--enable-hierarchical-cache): pinned on CUDA, seconds for tens of GB.
        self.host_kv = HostKVStore(self.kv_caches, host_blocks, self.device) if host_blocks else None
        host_allocated = time.perf_counter()
        context = int(config.context_length or 0) or self.kv_layout.num_tokens
        pages_per_seq = -(-min(context, self.kv_layout.num_tokens) // self.kv_layout.block_size)
        # NOTE: a planner's padding rows read the scratch block (only graph planners pad).
        padding = {"padding_page": scratch} if graph_sizes else {}
        self.planner = registry.get("attention_planner", self.backends.attention)(
            replace(self.model.attention_shape(), kv_dtype=kv_dtype),
            self.device,
            block_size=block_size,
            max_num_seqs=max_num_seqs,
            # NOTE: shared prefix blocks repeat across sequences, so a step's page lists can
            # name more pages than the pool has: bound by sequences x pages per sequence.
            max_num_pages=max_num_seqs * pages_per_seq,
            graph_batch_sizes=graph_sizes,
            **padding,
        )
        generator = None
        if config.random_seed is not None:
            generator = torch.Generator(device=self.device).manual_seed(int(config.random_seed))
        self.sampler = Sampler(generator, backend=self.backends.sampling)
        self._staging = InputStaging(self.device)
        # This rank's KV handle for prefill/decode disaggregation: its port, bound to the
        # cache and head span (runner.kv.attach(factory) builds the endpoint).
        # NOTE: named by the rank's place in the engine group (DP-major), unique across DP ranks.
        self.kv = KVPort(
            self.parallel.dp_rank * self.parallel.tp_size + self.parallel.tp_rank, self.kv_caches, self.kv_head_span,
            dp_rank=self.parallel.dp_rank, token_shard=(self.parallel.dcp_rank, self.parallel.dcp_size),
        )  # fmt: skip
        self.graphs: DecodeGraphs | None = None
        # NOTE: no warm-up across ranks: its collectives would need every rank (an elastic EP
        # joiner has no communicators yet); a group's kernels compile on its first step.
        warmup_s = self._warm_up() if scratch is not None and not multi_rank else 0.0
        if graph_sizes:
            self.graphs = DecodeGraphs(
                self._forward_logits,
                self.planner,
                batch_sizes=graph_sizes,
                device=self.device,
                block_size=block_size,
                scratch_block=scratch,
                max_seq_len=min(context, self.kv_layout.num_tokens),
            )
            self.graphs.capture()
        self._startup = {
            "load_s": loaded - started,
            "kv_alloc_s": allocated - loaded,
            "host_kv_alloc_s": host_allocated - allocated,
            "host_kv_blocks": host_blocks,
            "warmup_s": warmup_s,
            "graph_capture_s": self.graphs.capture_s if self.graphs is not None else 0.0,
            "graph_batch_sizes": list(graph_sizes),
            "graphs_off_reason": self.graphs_off_reason,
            "kernel_backends": self.backends.as_dict(),
            "dsa_backend": self.dsa_backend,
            "kv_blocks": num_blocks,
            "kv_cache_dtype": str(kv_dtype).removeprefix("torch."),
        }

    def startup_report(self) -> dict[str, Any]:
        """What start-up cost and chose: ``load_s`` (weights, backends), ``kv_alloc_s``,
        ``warmup_s`` (one eager prefill and a sample on the scratch block: kernel JIT and
        library set-up land here, not in the first request), ``graph_capture_s``,
        ``graph_batch_sizes`` (captured decode sizes; empty when off), ``graphs_off_reason``
        (None when on), ``kernel_backends``, ``dsa_backend`` (a DSA model's sparse attention ops;
        None for other models), ``kv_blocks``, ``kv_cache_dtype`` (what the
        cache stores, e.g. ``float8_e4m3fn``), ``host_kv_blocks`` and ``host_kv_alloc_s`` (the
        host tier of ``--enable-hierarchical-cache``: 0 blocks when off)."""
        return dict(self._startup)

    def _synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _warm_up(self) -> float:
        """One eager prefill of a few tokens on the scratch block, a sample of two rows (greedy,
        and top-k/top-p/min-p through the sampling backend's kernels) and the greedy argmax at
        every small batch (:meth:`Sampler.warm_up`); returns the seconds it took.

        NOTE: the sampled row draws from the engine's generator: with --random-seed the stream
        is offset by the same draw at every start, so runs stay reproducible."""
        started = time.perf_counter()
        count = min(8, self.kv_layout.block_size)
        request = Request("warm-up", [0] * count, max_tokens=1)
        request.block_ids = [self.kv_layout.scratch_block]
        logits = self.step_logits(SchedulerOutput([ScheduledRequest(request, count, 0)], [], count))
        rows = [
            SamplingRow(SamplingParams(temperature=0.0)),
            SamplingRow(SamplingParams(temperature=1.0, top_k=8, top_p=0.9, min_p=0.01)),
        ]
        with torch.inference_mode():
            self.sampler(logits.expand(2, -1).contiguous(), rows)
            self.sampler.warm_up(logits.shape[1], logits.device)
        if self.load_recorder is not None:
            self.load_recorder.reset()  # NOTE: the warm-up pass is no traffic
        self._synchronize()
        return time.perf_counter() - started

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
        # NOTE: blocks the caching allocator still holds from loading (temporaries of dummy
        # init, weight fusion) would otherwise count as in use and come off the KV budget, and
        # so would an earlier runner of this process that only the cycle collector can free
        # (a runner and its CUDA graphs reference each other): collect it first. Full
        # collections are rare while step loops run (gc_pauses.frozen_heap), so such a runner
        # can outlive its LLM by minutes.
        gc.collect()
        torch.cuda.empty_cache()
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
        batch = self.launch(step, rows)
        return [] if batch is None else batch.resolve()

    @torch.inference_mode()
    def launch(
        self, step: SchedulerOutput, rows: Sequence[SamplingRow], feed: TokenFeed | None = None
    ) -> SampledBatch | None:
        """:meth:`execute` without waiting for the tokens (overlap scheduling, see
        :mod:`~flotilla.cluster.engine.overlap`): queues the step and its sampling on the
        device and returns the :class:`SampledBatch` (None when no request samples).
        ``feed`` fills the step's pending input tokens from a previous step's device ids."""
        logits = self.step_logits(step, feed)
        if not rows:
            return None
        if logits_rows(rows) != logits.shape[0]:
            raise ValueError(f"{len(rows)} sampling rows (with drafts: {logits_rows(rows)}) for {logits.shape[0]} logits rows")
        batch = self.sampler.launch(logits, rows)
        batch.embeddings = self.last_pooled
        return batch

    @torch.inference_mode()
    def step_logits(self, step: SchedulerOutput, feed: TokenFeed | None = None) -> torch.Tensor:
        """Run one step's forward; returns the float32 logits ``[N, V]`` of its ``N`` sampling
        requests (schedule order; ``[0, V]`` when none samples, without running the LM head).

        A pure decode step that fits a captured CUDA graph replays it (every row's logits,
        valid until the next step); any other step runs eagerly (attention planned once, then
        the forward). ``feed``: see :meth:`launch`. A step with an embedding request runs
        eagerly and leaves its pooled rows in :attr:`last_pooled`; with :attr:`keep_hidden` every
        step runs eagerly and leaves its final hidden states in :attr:`last_hidden`."""
        self._move_host_kv(step)
        input_ids, positions, meta, sample_index = self.prepare_inputs(step, allow_pending=feed is not None)
        if feed is not None:
            _feed_pending_tokens(input_ids, step, feed)
        pooling = pools(step)
        self.last_pooled = {}
        if self.graphs is not None and not pooling and not self.keep_hidden:
            logits = self.graphs.run(input_ids, positions, meta)
            if logits is not None:
                # NOTE: in a decode step the sampling rows are the first rows in order, so
                # equal counts mean every row samples.
                return logits if sample_index.shape[0] == logits.shape[0] else logits.index_select(0, sample_index)
        hidden = self.forward(input_ids, positions, meta)
        if self.keep_hidden:
            self.last_hidden = hidden
        if pooling:
            self.last_pooled = self.pooler.pool(step, hidden)
        if sample_index.shape[0] == 0:
            return hidden.new_empty(0, self.vocab_size, dtype=torch.float32)
        return self.model.compute_logits(hidden.index_select(0, sample_index))

    def _move_host_kv(self, step: SchedulerOutput) -> None:
        """Queue the step's copies between the KV cache and the host tier (offloads first),
        ahead of its forward on the same stream (see :mod:`~flotilla.cluster.engine.host_kv_store`)."""
        offload, load = getattr(step, "kv_offload", None), getattr(step, "kv_load", None)
        if not (offload or load):
            return
        if self.host_kv is None:
            raise RuntimeError("the step moves KV blocks to or from the host tier, but this runner has none")
        if offload:
            self.host_kv.offload(offload)
        if load:
            self.host_kv.load(load)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """One eager forward pass over the paged KV cache (counted as one pass by the load
        recorder); plans the step's attention first unless ``meta`` already carries a plan.

        NOTE: under DCP the step is not planned: ``meta``'s page layout is the logical one
        (blocks of ``dcp_size * local`` tokens) and DCP attention runs the torch reference
        on each rank's shard (the flashinfer MLA backend delegates it)."""
        if meta.plan is None and meta.num_seqs > 0 and self.parallel.dcp_size == 1:
            self.planner.plan(meta)
        hidden = self.model(input_ids, positions, self.kv_caches, meta)
        if self.load_recorder is not None:
            self.load_recorder.end_pass()
        return hidden

    def _forward_logits(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """The forward and every row's logits (what a decode graph captures; no planning)."""
        return self.model.compute_logits(self.model(input_ids, positions, self.kv_caches, meta))

    def prepare_inputs(
        self, step: SchedulerOutput, allow_pending: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]:
        """``(input_ids[T], positions[T], meta, sample_index[N])`` of a step, where
        ``sample_index`` holds the flat index of the last new token of each sampling request
        (and, before it, of the positions its drafts are verified at: ``1 + k`` indexes for a
        request verifying ``k`` drafts).
        A pending token (overlap scheduling) is a ValueError unless ``allow_pending``: the
        caller then fills those ids on the device.

        ``meta`` also carries the planner's CPU int32 fields (``page_indptr``, ``page_indices``,
        ``last_page_len``, ``query_start_cpu``, ``seq_lens_cpu``); see :class:`InputStaging`
        for how the device tensors get there.

        An empty step (an idle DP-attention rank) gives zero-length tensors and a zero-sequence
        ``meta`` (``block_tables`` ``[0, 1]``, max lengths 0): the forward still runs, so the
        rank joins every collective of the step."""
        block_size = self.kv_layout.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_start = [0]
        seq_lens: list[int] = []
        sample_index: list[int] = []
        pages: list[int] = []
        page_indptr = [0]
        last_page_len: list[int] = []
        max_query_len = 0
        for item in step.scheduled:
            request, start, count = item.request, item.start_position, item.num_new_tokens
            end = start + count
            blocks = request.block_ids
            if count == 1:
                # NOTE: the decode fast path: one token in one slot.
                input_ids.append(request.all_token_ids[start])
                positions.append(start)
                slots.append(blocks[start // block_size] * block_size + start % block_size)
            else:
                input_ids.extend(item.token_ids if item.draft_token_ids else request.all_token_ids[start:end])
                positions.extend(range(start, end))
                # NOTE: slots of the new tokens, one block run at a time.
                for block_index in range(start // block_size, (end - 1) // block_size + 1):
                    base = blocks[block_index] * block_size
                    lo = max(start, block_index * block_size) - block_index * block_size
                    hi = min(end, (block_index + 1) * block_size) - block_index * block_size
                    slots.extend(range(base + lo, base + hi))
                max_query_len = max(max_query_len, count)
            query_start.append(query_start[-1] + count)
            seq_lens.append(end)
            num_pages = (end + block_size - 1) // block_size
            pages.extend(blocks[:num_pages])
            page_indptr.append(page_indptr[-1] + num_pages)
            last_page_len.append(end - (num_pages - 1) * block_size)
            if item.samples:
                # NOTE: a request verifying k drafts samples at each of its last 1 + k positions.
                sample_index.extend(range(query_start[-1] - 1 - len(item.draft_token_ids), query_start[-1]))
        if seq_lens and max_query_len == 0:
            max_query_len = 1
        if not allow_pending and input_ids and min(input_ids) == PENDING_TOKEN:
            raise ValueError("the step holds a pending token (overlap scheduling): launch it with the previous step's feed")
        return self._staging.build(
            input_ids, positions, slots, query_start, seq_lens, sample_index,
            pages, page_indptr, last_page_len, block_size, max_query_len,
        )

    # -- KV transfer (prefill/decode disaggregation): ``self.kv``, this rank's port ----------

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

    def shutdown(self) -> None:
        """Release what outlives a step: the KV endpoint and its thread (idempotent)."""
        self.kv.detach()


def _multi_rank(parallel: ParallelLayout) -> bool:
    """Whether this rank shares its forward with other ranks (any group above one rank)."""
    sizes = (parallel.tp_size, parallel.ep_size, parallel.moe_tp_size, parallel.dp_size, parallel.dcp_size)
    return max(sizes) > 1 or any(getattr(c, "size", 1) > 1 for c in parallel.comms.values())


def _feed_pending_tokens(input_ids: torch.Tensor, step: SchedulerOutput, feed: TokenFeed) -> None:
    """Write ``feed``'s device ids over the step's pending input tokens (queued on the
    device: no host sync). The usual decode step, where every row is pending and in the
    previous step's row order, is one copy."""
    dst, src = feed.gather_plan(step)
    if not dst:
        return
    n = len(dst)
    if dst == src == list(range(n)):
        input_ids[:n].copy_(feed.token_ids[:n])
        return
    dst_t, src_t = device_index(dst, input_ids.device), device_index(src, input_ids.device)
    input_ids.index_copy_(0, dst_t, feed.token_ids.index_select(0, src_t))

