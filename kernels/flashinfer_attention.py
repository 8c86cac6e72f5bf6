"""flashinfer paged attention (MHA/GQA/MQA): the per-step planner and the
``paged_attention`` backend.

Plans are built once per step from the metadata's CPU page layout (no host sync) and
reused by every layer:

- a step with any ``query_len > 1`` (prefill chunks, possibly mixed with decodes) runs
  flashinfer's paged prefill wrapper, causal, with the FA3 (Hopper) kernels on SM90 for
  head dims FA3 instantiates (64/128/256) and flashinfer's own choice elsewhere; the
  step's leading one-token sequences (the running decodes, which the scheduler puts first)
  run on the paged decode wrapper instead (kind ``"mixed"``): the prefill kernels give each
  sequence whole 128-row query tiles, which made a decode among prefills cost as much as a
  128-token prefill over its context (the prefill attention probe, removed in 004bdbd);
- a pure decode step runs the paged decode wrapper; with ``graph_batch_size`` it runs that
  size's CUDA-graph decode wrapper, whose index buffers are fixed (``plan`` rewrites them,
  OUTSIDE capture/replay, before each replay);
- except that a decode step of at most ``triton_decode_attention.MAX_BATCH`` sequences (graph
  padding included) runs :class:`~flotilla.kernels.triton_decode_attention.TritonDecode`, a
  split-KV Triton kernel launched as a programmatic dependent: at batch 1 flashinfer's decode
  and merge kernels cost ~10 us per layer for a few hundred tokens of context (see that
  module). ``FLOTILLA_TRITON_DECODE=0`` keeps every decode on flashinfer.

Decode uses tensor cores (flashinfer's prefill kernels applied to one query row per
sequence) when a KV head serves at least 4 query heads: the group's rows then fill an
MMA tile, which beats the CUDA-core decode kernel; below that the CUDA-core kernel wins
and compiles faster.

One float workspace per planner is shared by all its wrappers: it is per-launch scratch
(split-KV partial outputs and their merge), holds nothing between ``plan`` and ``run``,
and the wrappers run one after another on one stream. Each wrapper keeps its own integer
workspace (the plan itself). The CUDA-graph wrappers also share one page-index buffer:
only the size about to be replayed is planned into it.

Caches are ``[num_blocks, block_size, num_kv_heads, head_dim]`` ("NHD"), K and V in
separate tensors of identical strides, in the model's dtype or in float8
(``AttentionShape.kv_dtype``, scale 1.0; see :mod:`flotilla.kernels.kv_dtype`). Every plan
names the cache's dtype (``kv_data_type``) next to the query's. NOTE: flashinfer 0.7.2's FA3
(SM90) prefill kernels take a float8 cache only with float8 queries
(``flashinfer.utils.is_fa3_backend_supported``), so a float8 cache with bf16/fp16 queries
prefills on the FA2 kernels, which widen the float8 K/V tiles as they load them; decode
(CUDA-core or tensor-core, both FA2) takes it as it is.

Sliding windows use flashinfer's inclusive ``window_left = sliding_window - 1``: a query at
position p sees keys in ``[p - sliding_window + 1, p]``, as the torch reference's
``k > p - sliding_window``.

This module imports flashinfer at import time: the kernel registry imports it only when
the ``flashinfer`` backend is asked for, and turns an ImportError into its clear
"not available on this machine" error.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

try:
    import flashinfer
    from flashinfer.utils import is_fa3_prefill_head_dim_supported, is_sm90a_supported
except Exception as exc:  # NOTE: CUDA library failures surface as OSError/RuntimeError; the registry expects ImportError
    raise ImportError(f"flashinfer cannot be imported: {exc!r}") from exc

from flotilla.kernels.attention import AttentionMetadata, AttentionShape, StepLayout, step_layout, write_kv
from flotilla.kernels.kv_dtype import FP8_KV_DTYPES, is_fp8
from flotilla.kernels.flashinfer_plan import (
    SUPPORTED_DTYPES,
    WORKSPACE_BYTES,
    FlashInferStepPlan,
    check_graph_sizes,
    require_plan,
)
from flotilla.kernels.registry import register

# A KV head serving this many query heads or more decodes on tensor cores.
TENSOR_CORE_MIN_GROUP = 4
SUPPORTED_HEAD_DIMS = (64, 128, 256)


class DecodesThenPrefills:
    """A mixed step's attention as two planned wrappers: the first ``num_decode_tokens``
    query rows (one per decoding sequence) on the decode wrapper, the rest on the prefill
    wrapper, both writing into one output. Quacks like a wrapper (``run``)."""

    def __init__(self, decode, prefill, num_decode_tokens: int) -> None:
        self.decode, self.prefill, self.num_decode_tokens = decode, prefill, num_decode_tokens

    def run(self, q: torch.Tensor, paged_kv_cache: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        split = self.num_decode_tokens
        out = q.new_empty(q.shape[0], q.shape[1], paged_kv_cache[1].shape[-1])
        self.decode.run(q[:split], paged_kv_cache, out=out[:split])
        self.prefill.run(q[split:], paged_kv_cache, out=out[split:])
        return out


class FlashInferAttentionPlanner:
    """Plans flashinfer paged attention once per step (see the module docstring).

    Args:
        shape: the rank's attention shape (not MLA).
        device: the CUDA device.
        block_size: tokens per cache block (flashinfer's page size).
        max_num_seqs: the most sequences in one step.
        max_num_pages: the most cache blocks one step references in total (summed over
            its sequences; a block shared through the prefix cache counts per sequence):
            sizes the CUDA-graph page-index buffer.
        graph_batch_sizes: decode batch sizes that get a CUDA-graph wrapper.
        workspace_bytes: the shared float workspace.
        padding_page: the block that padding sequences of a graph batch read (read only).
    """

    def __init__(
        self,
        shape: AttentionShape,
        device: torch.device | str,
        *,
        block_size: int,
        max_num_seqs: int,
        max_num_pages: int,
        graph_batch_sizes: Sequence[int] = (),
        workspace_bytes: int = WORKSPACE_BYTES,
        padding_page: int = 0,
    ) -> None:
        _check_shape(shape)
        self.shape, self.device = shape, torch.device(device)
        self.block_size, self.max_num_seqs, self.max_num_pages = block_size, max_num_seqs, max_num_pages
        self.padding_page = padding_page
        self.window_left = -1 if shape.sliding_window is None else shape.sliding_window - 1
        self.use_tensor_cores = shape.num_q_heads // shape.num_kv_heads >= TENSOR_CORE_MIN_GROUP
        fa3 = is_sm90a_supported(self.device) and is_fa3_prefill_head_dim_supported(shape.head_dim, shape.head_dim_v)
        if is_fp8(shape.cache_dtype):
            self.prefill_backend = "fa2"  # NOTE: FA3 takes a float8 cache only with float8 queries
        else:
            self.prefill_backend = "fa3" if fa3 else "auto"
        # NOTE: flashinfer requires the float workspace zeroed before its first use.
        self.workspace = torch.zeros(workspace_bytes, dtype=torch.uint8, device=self.device)
        self._prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self.workspace, "NHD", backend=self.prefill_backend)
        # NOTE: decode pins fa2 (its CUDA-core kernel, or fa2 prefill kernels on tensor cores) so
        # "auto" never reroutes a plan (e.g. to cuDNN on other GPUs) between capture and replay.
        self._decode = self._decode_wrapper()
        self.graph_batch_sizes = check_graph_sizes(graph_batch_sizes)
        self._graph_indices = None
        self._graph_decode: dict[int, Any] = {}
        # NOTE: a wrapper's plan is staged through its pinned host buffer and copied to the
        # device asynchronously; the next plan waits for that copy (overlap scheduling plans a
        # step while the one before may still be queued).
        self._plan_copied = torch.cuda.Event()
        self._triton_decode = _triton_decode(shape, self.device, block_size, max_num_pages)
        flashinfer_graph_sizes = [size for size in self.graph_batch_sizes if not self._on_triton(size)]
        if flashinfer_graph_sizes:
            # NOTE: padding sequences add one page each, beyond the real batch's max_num_pages.
            capacity = max_num_pages + self.graph_batch_sizes[-1]
            self._graph_indices = torch.zeros(capacity, dtype=torch.int32, device=self.device)
            for size in flashinfer_graph_sizes:
                self._graph_decode[size] = self._decode_wrapper(
                    paged_kv_indptr_buffer=torch.zeros(size + 1, dtype=torch.int32, device=self.device),
                    paged_kv_indices_buffer=self._graph_indices,
                    paged_kv_last_page_len_buffer=torch.ones(size, dtype=torch.int32, device=self.device),
                )

    def _decode_wrapper(self, **graph_buffers: torch.Tensor):
        return flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            self.workspace,
            "NHD",
            use_cuda_graph=bool(graph_buffers),
            use_tensor_cores=self.use_tensor_cores,
            backend="fa2",
            **graph_buffers,
        )

    def _on_triton(self, batch: int) -> bool:
        """Whether a decode step of ``batch`` sequences (padding included) runs on TritonDecode."""
        return self._triton_decode is not None and batch <= self._triton_decode.max_batch

    def plan(self, meta: AttentionMetadata, graph_batch_size: int | None = None) -> None:
        """Set ``meta.plan`` for this step (None for an empty step).

        With ``graph_batch_size`` (a pure decode step about to replay that size's graph),
        plans the size's CUDA-graph wrapper, padding the batch to the size. Call outside
        graph capture and replay. NOTE: flashinfer stages each plan through a pinned host
        buffer per wrapper; a plan first waits for the previous plan's copy to the device.
        """
        self._plan_copied.synchronize()
        self._plan(meta, graph_batch_size)
        self._plan_copied.record()

    def _plan(self, meta: AttentionMetadata, graph_batch_size: int | None) -> None:
        shape = self.shape
        common = dict(q_data_type=shape.dtype, kv_data_type=shape.cache_dtype, o_data_type=shape.dtype)
        if graph_batch_size is not None:
            if graph_batch_size not in self.graph_batch_sizes:
                raise ValueError(f"no CUDA-graph decode wrapper for graph_batch_size={graph_batch_size} (have {self.graph_batch_sizes})")
            if not meta.is_decode:
                raise ValueError(f"graph_batch_size={graph_batch_size} needs a pure decode step (max_query_len={meta.max_query_len})")
            layout = step_layout(meta, pad_to=graph_batch_size, padding_page=self.padding_page)
            if self._on_triton(graph_batch_size):
                self._plan_triton(meta, layout, "triton-graph-decode")
                return
            wrapper = self._graph_decode[graph_batch_size]
            if layout.page_indices.shape[0] > self._graph_indices.shape[0]:
                raise ValueError(
                    f"the step references {layout.page_indices.shape[0]} cache blocks; the CUDA-graph buffers hold "
                    f"{self._graph_indices.shape[0]} (max_num_pages={self.max_num_pages} plus padding)"
                )
            # NOTE: a device-side source lets flashinfer copy the indices into its fixed buffer
            # without the host sync a blocking CPU->GPU copy makes.
            indices = layout.page_indices.to(self.device, non_blocking=True)
            self._plan_decode(wrapper, layout, indices, common)
            meta.plan = FlashInferStepPlan(wrapper, graph_batch_size, shape.scale, shape.sliding_window, "graph-decode")
            return
        layout = step_layout(meta)
        if layout.num_seqs == 0:
            meta.plan = None
            return
        if meta.is_decode and self._on_triton(layout.num_seqs):
            self._plan_triton(meta, layout, "triton-decode")
            return
        if meta.is_decode:
            self._plan_decode(self._decode, layout, layout.page_indices, common)
            meta.plan = FlashInferStepPlan(self._decode, layout.num_tokens, shape.scale, shape.sliding_window, "decode")
            return
        num_decodes = layout.num_leading_decodes()
        # NOTE: a step whose CPU layout is all one-token rows but whose max_query_len says
        # otherwise is planned whole on the prefill wrapper (correct, only slower).
        if 0 < num_decodes < layout.num_seqs:
            # NOTE: the prefill kernels give every sequence whole query tiles (FA3: 128 rows),
            # so a decode among prefills costs a 128-token prefill over its context: mixed
            # steps send their leading decodes to the decode kernel instead.
            decodes, prefills = layout.split(num_decodes)
            self._plan_decode(self._decode, decodes, decodes.page_indices, common)
            self._plan_prefill(prefills, common)
            mixed = DecodesThenPrefills(self._decode, self._prefill, decodes.num_tokens)
            meta.plan = FlashInferStepPlan(mixed, layout.num_tokens, shape.scale, shape.sliding_window, "mixed")
            return
        self._plan_prefill(layout, common)
        meta.plan = FlashInferStepPlan(self._prefill, layout.num_tokens, shape.scale, shape.sliding_window, "prefill")

    def _plan_prefill(self, layout: StepLayout, common: dict) -> None:
        shape = self.shape
        self._prefill.plan(
            layout.query_start,
            layout.page_indptr,
            layout.page_indices,
            layout.last_page_len,
            shape.num_q_heads,
            shape.num_kv_heads,
            shape.head_dim,
            self.block_size,
            head_dim_vo=shape.head_dim_v,
            causal=True,
            sm_scale=shape.scale,
            window_left=self.window_left,
            **common,
        )

    def _plan_triton(self, meta: AttentionMetadata, layout: StepLayout, kind: str) -> None:
        decode = self._triton_decode
        decode.plan(layout.page_indptr, layout.page_indices, layout.last_page_len)
        meta.plan = FlashInferStepPlan(decode, layout.num_seqs, self.shape.scale, self.shape.sliding_window, kind)

    def _plan_decode(self, wrapper, layout: StepLayout, indices: torch.Tensor, common: dict) -> None:
        shape = self.shape
        wrapper.plan(
            layout.page_indptr,
            indices,
            layout.last_page_len,
            shape.num_q_heads,
            shape.num_kv_heads,
            shape.head_dim,
            self.block_size,
            window_left=self.window_left,
            sm_scale=shape.scale,
            **common,
        )


def _triton_decode(shape: AttentionShape, device: torch.device, block_size: int, max_num_pages: int):
    """The :class:`~flotilla.kernels.triton_decode_attention.TritonDecode` that takes this
    planner's small decode steps, or None where it does not apply (turned off, no Triton, a
    head dim it does not instantiate)."""
    if device.type != "cuda":
        return None
    try:
        from flotilla.kernels import triton_decode_attention as triton_decode
    except ImportError:
        return None  # NOTE: an optimization no flag names: without Triton every decode stays on flashinfer
    if not triton_decode.ENABLED or shape.head_dim not in triton_decode.SUPPORTED_HEAD_DIMS:
        return None
    return triton_decode.TritonDecode(
        shape.num_q_heads,
        shape.num_kv_heads,
        shape.head_dim,
        page_size=block_size,
        scale=shape.scale,
        sliding_window=shape.sliding_window,
        max_batch=triton_decode.MAX_BATCH,
        max_num_pages=max_num_pages,
        device=device,
    )


def _check_shape(shape: AttentionShape) -> None:
    if shape.is_mla:
        raise ValueError("FlashInferAttentionPlanner plans MHA/GQA; an MLA shape (kv_lora_rank > 0) needs FlashInferMLAPlanner")
    if shape.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"flashinfer attention runs bfloat16/float16, got dtype={shape.dtype}; use the torch backend")
    if shape.cache_dtype != shape.dtype and shape.cache_dtype not in FP8_KV_DTYPES:
        raise ValueError(
            f"flashinfer attention reads a KV cache in the model's dtype ({shape.dtype}) or in float8 "
            f"{FP8_KV_DTYPES}, got kv_dtype={shape.kv_dtype}; use --kv-cache-dtype auto"
        )
    if shape.num_kv_heads < 1 or shape.num_q_heads % shape.num_kv_heads:
        raise ValueError(f"num_q_heads={shape.num_q_heads} must be a multiple of num_kv_heads={shape.num_kv_heads}")
    if shape.head_dim != shape.head_dim_v or shape.head_dim not in SUPPORTED_HEAD_DIMS:
        raise ValueError(
            f"flashinfer attention here supports head_dim == head_dim_v in {SUPPORTED_HEAD_DIMS}, "
            f"got head_dim={shape.head_dim}, head_dim_v={shape.head_dim_v}; use the torch backend"
        )
    if shape.sliding_window is not None and shape.sliding_window < 1:
        raise ValueError(f"sliding_window must be >= 1 or None, got {shape.sliding_window}")


@register("paged_attention", "flashinfer")
def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor | None,
    v: torch.Tensor | None,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """The torch reference's contract (``kernels.attention.paged_attention``) on flashinfer:
    writes the new K/V at ``meta.slot_mapping``, then runs the step's plan (``meta.plan``,
    whose ``scale``/``sliding_window`` must match). ``q[T, Hq, D]``, ``k``/``v[T, Hkv, D]``;
    returns ``[T, Hq, D]``, ``[0, Hq, D]`` for an empty batch. CUDA-graph capturable for
    decode: no host sync, no value-dependent allocation (every slot must be a real cache
    slot, padding rows included).

    ``k=None`` and ``v=None`` (both) mean the new K/V are already in the caches at
    ``meta.slot_mapping`` (written by the fused ``qkv_prepare`` op): attention only.
    """
    if (k is None) != (v is None):
        raise ValueError("pass both k and v (written here) or neither (already in the caches), got one of them")
    if q.shape[0] == 0:
        return q.new_empty(0, q.shape[1], v_cache.shape[-1])
    plan = require_plan(meta)
    plan.check(q.shape[0], scale, sliding_window)
    if k is not None:
        write_kv(k_cache, meta.slot_mapping, k)
        write_kv(v_cache, meta.slot_mapping, v)
    return plan.wrapper.run(q if q.is_contiguous() else q.contiguous(), (k_cache, v_cache))
