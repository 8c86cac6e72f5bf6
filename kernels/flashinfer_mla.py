"""flashinfer multi-head latent attention (DeepSeek MLA) over the paged latent cache:
the MLA planner and the ``mla_attention`` backend.

Same weight-absorbed form as the torch reference (``kernels/mla.py``): the queries are
projected into the latent space (``q_nope @ W_kc``), flashinfer's MLA paged wrapper
attends over the cached latents ``c`` and rotary keys ``k_pe`` (``score = q_latent . c +
q_pe . k_pe``, values ``c``), and the latent output is projected back (``@ W_vc``). The
projections run in the activation dtype (fp32 accumulation), the reference in float32.

The cache is ``[num_blocks, block_size, 1, R + Dr]``; flashinfer gets two views of it,
``ckv = cache[..., 0, :R]`` and ``kpe = cache[..., 0, R:]`` (``[num_blocks, block_size,
R]`` / ``[..., Dr]``, row stride ``R + Dr``): its FA MLA kernels read paged caches by
their strides, so no copy is made.

One wrapper serves every eager step (prefill chunks, decodes or a mix, causal), plus one
CUDA-graph wrapper per graph batch size (fixed metadata buffers, the page-index buffer
shared between sizes as for MHA). All share the planner's float workspace (per-launch
scratch, wrappers run one after another on one stream). Backend: FA3 on SM90, FA2
elsewhere, named explicitly so the kernel family (and its JIT build) never changes
between plans.

Not covered here, delegated to the torch reference: decode context parallelism
(``local``; flashinfer has no shard masking by true positions) and ``return_lse``
(only the DCP merge asks for it). The planner rejects at construction what flashinfer's
MLA cannot run: dtypes other than bf16/fp16, ``kv_lora_rank`` outside FA3's (128, 256,
512) (FA2: multiples of 128), rope dims not a multiple of 64, and head counts whose FA
query tiles (64 or 128 rows) would split a token's heads (64 % H != 0 and H % 128 != 0).
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

try:
    import flashinfer.mla
    from flashinfer.utils import is_sm90a_supported
except Exception as exc:  # NOTE: the registry expects ImportError (see flashinfer_attention)
    raise ImportError(f"flashinfer cannot be imported: {exc!r}") from exc

from flotilla.kernels.attention import AttentionMetadata, AttentionShape, StepLayout, step_layout, write_kv
from flotilla.kernels.dcp import DCPLocalView
from flotilla.kernels.flashinfer_plan import (
    SUPPORTED_DTYPES,
    WORKSPACE_BYTES,
    FlashInferStepPlan,
    check_graph_sizes,
    require_plan,
)
from flotilla.kernels.mla import mla_attention as torch_mla_attention
from flotilla.kernels.registry import register


class FlashInferMLAPlanner:
    """Plans flashinfer MLA once per step; same constructor and ``plan`` contract as
    :class:`~flotilla.kernels.flashinfer_attention.FlashInferAttentionPlanner` (the
    ``flashinfer`` attention planner returns this one for an MLA shape).

    Raises ValueError at construction for shapes flashinfer's MLA cannot run (see the
    module docstring): use the torch backend for those.
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
        self.device = torch.device(device)
        self.backend = "fa3" if is_sm90a_supported(self.device) else "fa2"
        _check_mla_shape(shape, self.backend)
        self.shape, self.block_size = shape, block_size
        self.max_num_seqs, self.max_num_pages, self.padding_page = max_num_seqs, max_num_pages, padding_page
        self.workspace = torch.zeros(workspace_bytes, dtype=torch.uint8, device=self.device)
        self._eager = flashinfer.mla.BatchMLAPagedAttentionWrapper(self.workspace, backend=self.backend)
        self.graph_batch_sizes = check_graph_sizes(graph_batch_sizes)
        self._graph_indices = None
        self._graph: dict[int, Any] = {}
        # NOTE: the next plan waits for this plan's staged copies (see FlashInferAttentionPlanner).
        self._plan_copied = torch.cuda.Event()
        if self.graph_batch_sizes:
            capacity = max_num_pages + self.graph_batch_sizes[-1]  # NOTE: one page per padding sequence
            self._graph_indices = torch.zeros(capacity, dtype=torch.int32, device=self.device)
            for size in self.graph_batch_sizes:
                self._graph[size] = flashinfer.mla.BatchMLAPagedAttentionWrapper(
                    self.workspace,
                    use_cuda_graph=True,
                    qo_indptr=_int32_zeros(size + 1, self.device),
                    kv_indptr=_int32_zeros(size + 1, self.device),
                    kv_indices=self._graph_indices,
                    kv_len_arr=_int32_zeros(size, self.device),
                    backend=self.backend,
                )

    def plan(self, meta: AttentionMetadata, graph_batch_size: int | None = None) -> None:
        """Set ``meta.plan`` for this step (None for an empty step); with
        ``graph_batch_size``, plan that size's CUDA-graph wrapper for a pure decode step,
        padding the batch to the size (outside capture and replay)."""
        if graph_batch_size is not None:
            wrapper = self._graph.get(graph_batch_size)
            if wrapper is None:
                raise ValueError(f"no CUDA-graph MLA wrapper for graph_batch_size={graph_batch_size} (have {self.graph_batch_sizes})")
            if not meta.is_decode:
                raise ValueError(f"graph_batch_size={graph_batch_size} needs a pure decode step (max_query_len={meta.max_query_len})")
            layout = step_layout(meta, pad_to=graph_batch_size, padding_page=self.padding_page)
            if layout.page_indices.shape[0] > self._graph_indices.shape[0]:
                raise ValueError(
                    f"the step references {layout.page_indices.shape[0]} cache blocks; the CUDA-graph buffers hold "
                    f"{self._graph_indices.shape[0]} (max_num_pages={self.max_num_pages} plus padding)"
                )
            self._plan(wrapper, layout)
            meta.plan = FlashInferStepPlan(wrapper, graph_batch_size, self.shape.scale, None, "graph-decode")
            return
        layout = step_layout(meta)
        if layout.num_seqs == 0:
            meta.plan = None
            return
        self._plan(self._eager, layout)
        meta.plan = FlashInferStepPlan(self._eager, layout.num_tokens, self.shape.scale, None, "mla")

    def _plan(self, wrapper, layout: StepLayout) -> None:
        self._plan_copied.synchronize()
        self._plan_wrapper(wrapper, layout)
        self._plan_copied.record()

    def _plan_wrapper(self, wrapper, layout: StepLayout) -> None:
        shape = self.shape
        # NOTE: CPU metadata: flashinfer plans on the host and copies it to the device
        # (into the fixed buffers under CUDA graphs) with non-blocking copies.
        wrapper.plan(
            metadata=flashinfer.mla.MLAPlanMetadata.csr(
                layout.query_start, layout.page_indptr, layout.page_indices, layout.seq_lens
            ),
            num_heads=shape.num_q_heads,
            head_dim_ckv=shape.kv_lora_rank,
            head_dim_kpe=shape.qk_rope_head_dim,
            page_size=self.block_size,
            causal=True,
            sm_scale=shape.scale,
            q_data_type=shape.dtype,
            kv_data_type=shape.dtype,
            query_layout="split",
            kv_cache_layout="split",
        )


def _int32_zeros(n: int, device: torch.device) -> torch.Tensor:
    """A fresh int32 zero buffer (a CUDA-graph wrapper's fixed metadata)."""
    return torch.zeros(n, dtype=torch.int32, device=device)


def _check_mla_shape(shape: AttentionShape, backend: str) -> None:
    rank, rope, heads = shape.kv_lora_rank, shape.qk_rope_head_dim, shape.num_q_heads
    if not shape.is_mla:
        raise ValueError("FlashInferMLAPlanner plans MLA shapes (kv_lora_rank > 0)")
    if shape.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"flashinfer MLA runs bfloat16/float16, got dtype={shape.dtype}; use the torch backend")
    if shape.cache_dtype != shape.dtype:
        raise ValueError(
            f"flashinfer MLA keeps its latent cache in the model's dtype ({shape.dtype}), got kv_dtype={shape.kv_dtype}; "
            "use --kv-cache-dtype auto"
        )
    if shape.num_kv_heads != 1 or shape.head_dim != rank + rope or shape.head_dim_v != rank:
        raise ValueError(
            f"an MLA AttentionShape has num_kv_heads=1, head_dim=kv_lora_rank+qk_rope_head_dim={rank + rope}, "
            f"head_dim_v=kv_lora_rank={rank}; got {shape.num_kv_heads}, {shape.head_dim}, {shape.head_dim_v}"
        )
    if shape.sliding_window is not None:
        raise ValueError(f"flashinfer MLA has no sliding window (got sliding_window={shape.sliding_window})")
    ranks_ok = rank in (128, 256, 512) if backend == "fa3" else rank % 128 == 0
    if not ranks_ok or rope % 64:
        raise ValueError(
            f"flashinfer {backend} MLA supports kv_lora_rank in (128, 256, 512) (fa2: multiples of 128) and "
            f"qk_rope_head_dim a multiple of 64; got {rank}, {rope}; use the torch backend"
        )
    if heads < 1 or (64 % heads and heads % 128):
        raise ValueError(
            f"flashinfer MLA needs a per-rank head count dividing 64 or a multiple of 128 (its query tiles must not "
            f"split a token's heads); got num_q_heads={heads}; use the torch backend or another TP size"
        )


@register("mla_attention", "flashinfer")
def mla_attention(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    kv_c: torch.Tensor,
    k_pe: torch.Tensor,
    cache: torch.Tensor,
    meta: AttentionMetadata,
    w_kc: torch.Tensor,
    w_vc: torch.Tensor,
    scale: float,
    return_lse: bool = False,
    local: DCPLocalView | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """The torch reference's contract (``kernels.mla.mla_attention``) on flashinfer: writes
    the new ``[c, k_pe]`` rows at ``meta.slot_mapping``, then runs the step's plan
    (``meta.plan``). Returns ``[T, H, Dv]`` in ``q_nope.dtype``. ``return_lse`` or ``local``
    (DCP) run the torch reference instead. CUDA-graph capturable for decode."""
    if return_lse or local is not None:
        return torch_mla_attention(q_nope, q_pe, kv_c, k_pe, cache, meta, w_kc, w_vc, scale, return_lse, local)
    rank = kv_c.shape[-1]
    if cache.shape[-1] != rank + k_pe.shape[-1] or cache.shape[2] != 1:
        raise ValueError(
            f"MLA cache is {tuple(cache.shape)}, expected [num_blocks, block_size, 1, kv_lora_rank + rope dim = "
            f"{rank} + {k_pe.shape[-1]}]"
        )
    if q_nope.shape[0] == 0:
        return q_nope.new_zeros(0, q_nope.shape[1], w_vc.shape[-1])
    plan = require_plan(meta)
    plan.check(q_nope.shape[0], scale, None)
    write_kv(cache, meta.slot_mapping, torch.cat([kv_c, k_pe], dim=-1).unsqueeze(1))
    dtype = q_nope.dtype
    # [H, T, Dn] @ [H, Dn, R] -> latent queries [T, H, R]
    q_latent = torch.bmm(q_nope.transpose(0, 1), w_kc.to(dtype)).transpose(0, 1).contiguous()
    latents = cache.squeeze(2)  # [num_blocks, block_size, R + Dr]
    out_latent = plan.wrapper.run(
        query=(q_latent, q_pe.contiguous()),
        kv_cache=(latents[..., :rank], latents[..., rank:]),
    )  # [T, H, R]
    return torch.bmm(out_latent.transpose(0, 1), w_vc.to(dtype)).transpose(0, 1).contiguous()
