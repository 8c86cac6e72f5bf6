"""CUDA graphs for pure decode steps: captured once at start, replayed every decode step.

A decode step runs one token per sequence, so its whole forward (and the LM head of every
row) has the same kernels for a given batch size; at batch 1 on an 8B model launching them
one by one costs more host time than the GPU spends. :class:`DecodeGraphs` captures, after
the weights and the KV cache exist, one graph per batch size of the resolved
``cuda_graph_config["decode"]["bs"]`` list, largest first into one shared memory pool, and
replays the smallest captured size that holds a step's batch.

Replay rules:

- only steps where every sequence has exactly one new token (pure decode) replay; a step
  with any prefill runs eagerly, and so does a batch above the largest captured size;
- a batch of ``n`` is padded to the next captured size ``bs``: padding rows are token 0 at
  position 0, writing their K/V into slot 0 of the SCRATCH block (an extra cache block the
  block manager never hands out) and attending to that block alone (page list
  ``[scratch]``, last page length 1). Their logits are computed and ignored;
- the graph holds the static ``input_ids``/``positions``/``slot_mapping``/``seq_lens``
  buffers and the attention backend's fixed-size graph wrapper. Before each replay the
  step's values are copied into the static buffers and the planner re-plans that wrapper
  (``planner.plan(meta, graph_batch_size=bs)``, OUTSIDE capture: it writes the page lists
  into the wrapper's fixed buffers); the graph then writes every row's float32 logits into
  one static ``[max_bs, V]`` buffer, of which :meth:`DecodeGraphs.run` returns the first
  ``n`` rows (valid until the next replay).

NOTE: a CUDA-graph attention backend reads the pages from its plan, never from
``meta.block_tables``: the captured metadata's ``block_tables`` is a ``[bs, 1]`` placeholder
naming the scratch block.

When graphs are off (:func:`decode_graph_sizes` says why, and the runner reports it): not on
CUDA; decode graphs disabled by the config; the torch attention reference (its tensor shapes
follow the batch's lengths, read on the host); a multi-rank group whose collectives a graph
cannot hold (:func:`uncapturable_collectives`: gloo runs on the CPU; DP attention and
all-to-all MoE dispatch read token counts on the host; decode context parallelism runs the
torch attention reference); an elastic EP group (a rewire swaps the communicators a graph
would have baked in, even at one rank); the expert-load recorder (it counts passes on the
host); an MoE model on the torch MoE reference (it loops over experts chosen on the host).

A tensor-parallel group over NCCL (attention TP, and MoE layers whose experts are split over
EP / MoE TP and all-reduced, ``--moe-a2a-backend none``) captures its collectives: NCCL
all-reduce and all-gather of fixed shapes are graph nodes (PyTorch leaves captured work out
of its watchdog). Every rank captures the same sizes in the same order at start (the group's
ranks build their runners together), and every rank replays or runs eagerly alike, since the
decision depends only on the step, which every rank receives whole.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Sequence

import torch

from flotilla.kernels.attention import AttentionMetadata

ForwardLogits = Callable[[torch.Tensor, torch.Tensor, AttentionMetadata], torch.Tensor]

# Rows of the static token buffer.
_IDS, _POSITIONS, _SLOTS, _SEQ_LENS = range(4)


def configured_decode_sizes(config: Any) -> tuple[tuple[int, ...], int | None, bool]:
    """``(sizes, max_bs, disabled)`` of decode graphs as resolution left them: the
    ``cuda_graph_config["decode"]`` entry when resolved, else the flat fields.

    NOTE: every decode graph backend other than ``disabled`` (full, breakable, tc_piecewise)
    gets flotilla's one kind: a full graph of the forward and the LM head."""
    disabled = bool(getattr(config, "disable_cuda_graph", False) or getattr(config, "disable_decode_cuda_graph", False))
    decode = (getattr(config, "cuda_graph_config", None) or {}).get("decode") or {}
    if decode.get("backend") == "disabled":
        disabled = True
    sizes = decode.get("bs") or getattr(config, "cuda_graph_bs_decode", None) or ()
    max_bs = decode.get("max_bs") or getattr(config, "cuda_graph_max_bs_decode", None)
    return tuple(int(s) for s in sizes), (int(max_bs) if max_bs else None), disabled


def decode_graph_sizes(
    config: Any,
    *,
    device: torch.device,
    attention_backend: str,
    collectives: str | None,
    elastic: bool,
    recording: bool,
    moe_on_torch: bool,
    max_num_seqs: int,
) -> tuple[tuple[int, ...], str | None]:
    """The decode batch sizes to capture, ascending, and why none are (None when some are).

    Args:
        config: the resolved configuration (see :func:`configured_decode_sizes`).
        device: the runner's device.
        attention_backend: the attention kernel backend (``torch`` has no graph support).
        collectives: why the forward's collectives cannot be captured (see
            :func:`uncapturable_collectives`); None when it runs none, or only capturable ones.
        elastic: the group may grow by elastic EP (its communicators are rewired later).
        recording: the expert-load recorder is on.
        moe_on_torch: the model has MoE layers running on the torch MoE reference.
        max_num_seqs: the most sequences a step can hold (no larger size is captured; it is
            itself captured when the configured list skips it).
    """
    sizes, max_bs, disabled = configured_decode_sizes(config)
    reasons = (
        (device.type != "cuda", f"device={device.type!r} is not CUDA"),
        (disabled, "decode CUDA graphs are disabled by the configuration"),
        (attention_backend == "torch", "the torch attention reference is not capturable"),
        (collectives is not None, f"the forward's collectives cannot be captured: {collectives}"),
        (elastic, "an elastic EP group rewires its communicators while serving"),
        (recording, "the expert-load recorder counts forward passes on the host"),
        (moe_on_torch, "the torch MoE reference picks experts on the host"),
        (not sizes, "no decode batch sizes were resolved (cuda_graph_config['decode']['bs'])"),
    )
    for blocked, reason in reasons:
        if blocked:
            return (), reason
    cap = min(max_num_seqs, max_bs) if max_bs else max_num_seqs
    chosen = sorted({s for s in sizes if 0 < s <= cap})
    if max(sizes) > cap and cap not in chosen:
        chosen.append(cap)
    return tuple(chosen), None


def uncapturable_collectives(parallel: Any) -> str | None:
    """Why the collectives of a rank with layout ``parallel`` (a
    :class:`~flotilla.cluster.models.base.ParallelLayout`) cannot be captured in a CUDA graph,
    or None when it runs no collective or only capturable ones (NCCL all-reduce / all-gather
    of shapes fixed by the batch size: attention TP, and MoE partial sums all-reduced)."""
    comms = [c for c in getattr(parallel, "comms", {}).values() if getattr(c, "size", 1) > 1]
    sizes = (parallel.tp_size, parallel.ep_size, parallel.moe_tp_size, parallel.dp_size, parallel.dcp_size)
    if not comms and max(sizes) == 1:
        return None
    if not comms or not all(getattr(c, "on_device", False) for c in comms):
        return "the group's collectives run on the CPU (gloo), outside any CUDA stream"
    if parallel.dp_size > 1:
        return f"DP attention (dp_size={parallel.dp_size}) gathers each step's token counts on the host"
    if parallel.dcp_size > 1:
        return f"decode context parallelism (dcp_size={parallel.dcp_size}) runs the torch attention reference"
    if parallel.ep_size * parallel.moe_tp_size > 1 and parallel.moe_a2a_backend != "none":
        return f"moe_a2a_backend={parallel.moe_a2a_backend!r} dispatches tokens by counts read on the host"
    return None


class DecodeGraphs:
    """Captured decode graphs over one model and KV cache (see the module docstring).

    Args:
        forward_logits: ``(input_ids[bs], positions[bs], meta) -> logits[bs, V]`` float32: the
            model's forward over the KV cache and ``compute_logits`` of every row.
        planner: the attention planner (``plan(meta, graph_batch_size=bs)``); it was built
            with ``graph_batch_sizes=batch_sizes``.
        batch_sizes: the sizes to capture (any order; captured largest first).
        device: the CUDA device.
        block_size: token slots per cache block.
        scratch_block: the cache block padding rows write and read (never handed out).
        max_seq_len: an upper bound of any sequence's length (the captured metadata's
            ``max_seq_len``; graph attention reads lengths from its plan).

    Attributes:
        capture_s: seconds :meth:`capture` took (warm-up passes included).
        num_replays: decode steps replayed so far.
    """

    def __init__(
        self,
        forward_logits: ForwardLogits,
        planner: Any,
        *,
        batch_sizes: Sequence[int],
        device: torch.device,
        block_size: int,
        scratch_block: int,
        max_seq_len: int,
    ):
        if not batch_sizes or min(batch_sizes) < 1:
            raise ValueError(f"batch_sizes must be positive sizes (got batch_sizes={list(batch_sizes)})")
        self.batch_sizes = tuple(sorted(set(int(b) for b in batch_sizes)))
        self.max_bs = self.batch_sizes[-1]
        self.forward_logits = forward_logits
        self.planner = planner
        self.device = device
        self.block_size = block_size
        self.scratch_block = scratch_block
        self.max_seq_len = max(1, int(max_seq_len))
        self.capture_s = 0.0
        self.num_replays = 0
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._metas: dict[int, AttentionMetadata] = {}
        max_bs = self.max_bs
        with torch.inference_mode():
            self._tokens = torch.zeros(4, max_bs, dtype=torch.long, device=device)
            self._padding = torch.zeros(4, max_bs, dtype=torch.long, device=device)
            self._padding[_SLOTS].fill_(scratch_block * block_size)
            self._padding[_SEQ_LENS].fill_(1)
            self._query_start = torch.arange(max_bs + 1, dtype=torch.long, device=device)
            self._block_tables = torch.full((max_bs, 1), scratch_block, dtype=torch.long, device=device)
        # [max_bs, V] float32, allocated (outside the graph pool) from the first warm-up's logits.
        self._logits: torch.Tensor | None = None
        # Host-side padding pieces of the planner's int32 fields.
        self._cpu_arange = torch.arange(max_bs + 1, dtype=torch.int32)
        self._cpu_ones = torch.ones(max_bs, dtype=torch.int32)
        self._cpu_scratch = torch.full((max_bs,), scratch_block, dtype=torch.int32)

    # -- capture ------------------------------------------------------------------

    @torch.inference_mode()
    def capture(self) -> float:
        """Capture every size (largest first, one memory pool); returns the seconds it took."""
        start = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        self._tokens.copy_(self._padding)
        for bs in reversed(self.batch_sizes):
            meta = self._static_meta(bs)
            self._metas[bs] = meta
            self.planner.plan(meta, graph_batch_size=bs)
            self._warm_up(bs, meta)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self._logits[:bs].copy_(self._forward(bs, meta))
            self._graphs[bs] = graph
        torch.cuda.synchronize(self.device)
        self.capture_s = time.perf_counter() - start
        return self.capture_s

    def _forward(self, bs: int, meta: AttentionMetadata) -> torch.Tensor:
        return self.forward_logits(self._tokens[_IDS, :bs], self._tokens[_POSITIONS, :bs], meta)

    def _warm_up(self, bs: int, meta: AttentionMetadata) -> None:
        """One eager pass on a side stream before capture (lazy library set-up, kernel
        loading and autotuning must not happen inside the capture)."""
        current = torch.cuda.current_stream(self.device)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(current)
        with torch.cuda.stream(side):
            logits = self._forward(bs, meta)
        current.wait_stream(side)
        if self._logits is None:
            self._logits = torch.empty(self.max_bs, logits.shape[1], dtype=torch.float32, device=self.device)

    def _static_meta(self, bs: int) -> AttentionMetadata:
        """The metadata a size's graph is captured with: views of the static buffers, every
        row a padding row (one token in the scratch block)."""
        return AttentionMetadata(
            slot_mapping=self._tokens[_SLOTS, :bs],
            query_start=self._query_start[: bs + 1],
            seq_lens=self._tokens[_SEQ_LENS, :bs],
            block_tables=self._block_tables[:bs],
            max_query_len=1,
            max_seq_len=self.max_seq_len,
            block_size=self.block_size,
            page_indptr=self._cpu_arange[: bs + 1],
            page_indices=self._cpu_scratch[:bs],
            last_page_len=self._cpu_ones[:bs],
            query_start_cpu=self._cpu_arange[: bs + 1],
            seq_lens_cpu=self._cpu_ones[:bs],
        )

    # -- replay -------------------------------------------------------------------

    def padded_size(self, num_seqs: int) -> int | None:
        """The captured size a batch of ``num_seqs`` replays at (None: run eagerly)."""
        if num_seqs < 1 or num_seqs > self.max_bs:
            return None
        for bs in self.batch_sizes:
            if bs >= num_seqs:
                return bs
        return None

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor | None:
        """Replay the step when it is a pure decode step that fits; returns the float32 logits
        ``[n, V]`` of its ``n`` rows (a view of the static buffer, valid until the next
        replay), or None when the step must run eagerly (a prefill, an empty step, a batch
        above the largest captured size)."""
        n = int(input_ids.shape[0])
        if meta.max_query_len != 1 or meta.num_seqs != n or meta.page_indptr is None:
            return None
        bs = self.padded_size(n)
        if bs is None or bs not in self._graphs:
            return None
        tokens = self._tokens
        block = _row_block(input_ids, positions, meta.slot_mapping, meta.seq_lens)
        if block is not None:
            tokens[:, :n].copy_(block)  # NOTE: one launch instead of four, outside the graph
        else:
            tokens[_IDS, :n].copy_(input_ids)
            tokens[_POSITIONS, :n].copy_(positions)
            tokens[_SLOTS, :n].copy_(meta.slot_mapping)
            tokens[_SEQ_LENS, :n].copy_(meta.seq_lens)
        if bs > n:
            tokens[:, n:bs].copy_(self._padding[:, n:bs])
        static = self.padded_meta(meta, bs)
        self.planner.plan(static, graph_batch_size=bs)
        self._graphs[bs].replay()
        self.num_replays += 1
        return self._logits[:n]

    @torch.inference_mode()
    def time_replay(self, num_seqs: int, iters: int = 50) -> float:
        """Milliseconds of GPU time one replay of the graph a batch of ``num_seqs`` replays at
        takes: ``iters`` back-to-back replays timed with CUDA events (after one untimed replay),
        averaged. Call between steps (it waits for the device first); ValueError when no
        captured size holds ``num_seqs`` or ``iters < 1``.

        Every row replays as a padding row (token 0 at position 0, one token of context in the
        scratch block), as at capture: nothing outside the scratch block is written, and the
        time covers the weights and kernel launches, not a real batch's KV reads (nor its MoE
        routing: identical rows pick the same experts). Not counted in :attr:`num_replays`;
        the next :meth:`run` re-plans and refills the static buffers."""
        bs = self.padded_size(num_seqs)
        if bs is None or bs not in self._graphs:
            raise ValueError(
                f"no captured decode graph holds a batch of {num_seqs} (captured sizes {list(self.batch_sizes)})"
            )
        if iters < 1:
            raise ValueError(f"iters must be at least 1, got {iters}")
        torch.cuda.synchronize(self.device)  # NOTE: re-planning assumes the last step's plan copy has run
        self._tokens[:, :bs].copy_(self._padding[:, :bs])
        self.planner.plan(self._static_meta(bs), graph_batch_size=bs)
        graph = self._graphs[bs]
        graph.replay()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            graph.replay()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / iters

    def padded_meta(self, meta: AttentionMetadata, bs: int) -> AttentionMetadata:
        """Size ``bs``'s static metadata (the captured device views) carrying ``meta``'s CPU
        page layout padded to ``bs`` rows: what the planner plans before a replay. Each
        padding row is one token in the scratch block.

        NOTE: a captured size's metadata object is reused, its CPU fields overwritten per step
        (the graph reads only its device views and the plan's buffers)."""
        static = self._metas.get(bs) or self._static_meta(bs)
        pad = bs - meta.num_seqs
        if pad == 0:
            static.page_indptr, static.page_indices = meta.page_indptr, meta.page_indices
            static.last_page_len, static.seq_lens_cpu = meta.last_page_len, meta.seq_lens_cpu
        else:
            # NOTE: one scratch page per padding row: indptr grows by 1 per row.
            indptr = meta.page_indptr
            static.page_indptr = torch.cat([indptr, indptr[-1:] + self._cpu_arange[1 : pad + 1]])
            static.page_indices = torch.cat([meta.page_indices, self._cpu_scratch[:pad]])
            static.last_page_len = torch.cat([meta.last_page_len, self._cpu_ones[:pad]])
            static.seq_lens_cpu = torch.cat([meta.seq_lens_cpu, self._cpu_ones[:pad]])
        static.query_start_cpu = self._cpu_arange[: bs + 1]
        static.max_seq_len = max(meta.max_seq_len, 1)
        return static


def _row_block(*rows: torch.Tensor) -> torch.Tensor | None:
    """``rows`` (equal-length 1-D int64 tensors) as one ``[len(rows), n]`` view when they lie
    back to back in one buffer, in order (as :class:`~flotilla.cluster.engine.input_staging.InputStaging`
    lays out a decode step's ids, positions, slots and sequence lengths); None otherwise."""
    first = rows[0]
    n = first.shape[0]
    for i, row in enumerate(rows):
        if (
            row.dim() != 1
            or row.shape[0] != n
            or row.dtype != torch.long
            or row.stride(0) != 1
            or row.untyped_storage().data_ptr() != first.untyped_storage().data_ptr()
            or row.storage_offset() != first.storage_offset() + i * n
        ):
            return None
    return first.as_strided((len(rows), n), (n, 1))
