"""Paged attention: the batch layout every attention backend consumes, and the
torch reference implementation.

A step processes ``T`` new tokens belonging to ``B`` sequences, flattened in
sequence order (a varlen batch). Sequence ``b`` owns new tokens
``query_start[b]:query_start[b+1]``; after this step its context (cached plus
new tokens) is ``seq_lens[b]`` long, and its new tokens sit at the last
positions of that context. KV caches are paged: ``k_cache[num_blocks,
block_size, num_kv_heads, head_dim]``; ``block_tables[b, i]`` is the cache block
holding context tokens ``i*block_size .. (i+1)*block_size-1`` of sequence ``b``;
``slot_mapping[t] = block * block_size + offset`` is where new token ``t``'s K/V
is written.

Planning: a backend's attention planner (op ``attention_planner``, built from an
:class:`AttentionShape`) turns a step's metadata into ``meta.plan`` once per step, before
the forward, from the metadata's CPU page layout (:func:`page_layout`,
:func:`step_layout`); every layer then reuses it. The torch planner here is a no-op.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.nn.functional as F

from flotilla.kernels.kv_dtype import storage_view, to_cache_dtype
from flotilla.kernels.registry import register


@dataclass(frozen=True)
class AttentionShape:
    """What one rank's attention layers look like (every layer alike); attention
    planners size their kernels and buffers from it.

    Attributes:
        num_q_heads: query heads on this rank.
        num_kv_heads: KV heads on this rank (MLA: 1, the shared latent).
        head_dim: query/key head dim (MLA: ``kv_lora_rank + qk_rope_head_dim``).
        head_dim_v: value/output head dim (MLA: ``kv_lora_rank``, the latent output).
        scale: the softmax scale the model passes to attention.
        sliding_window: tokens a query sees, itself included (None: the whole context).
        dtype: activation dtype (queries, outputs).
        kv_lora_rank: > 0 for multi-head latent attention (DeepSeek MLA).
        qk_rope_head_dim: MLA's rotary key dim (0 otherwise).
        kv_dtype: the KV cache's storage dtype when it differs from ``dtype`` (a float8
            cache, see :mod:`flotilla.kernels.kv_dtype`); None: the cache is in ``dtype``.
    """

    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    head_dim_v: int
    scale: float
    sliding_window: int | None
    dtype: torch.dtype
    kv_lora_rank: int = 0
    qk_rope_head_dim: int = 0
    kv_dtype: torch.dtype | None = None

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def cache_dtype(self) -> torch.dtype:
        """The dtype the KV cache stores: ``kv_dtype``, else ``dtype``."""
        return self.kv_dtype or self.dtype


@dataclass
class AttentionMetadata:
    """Where a step's new tokens go and what each sequence attends to.

    Attributes:
        slot_mapping: ``[T]`` int64 cache slot of each new token.
        query_start: ``[B+1]`` int64 cumulative new-token counts (``query_start[0] == 0``).
        seq_lens: ``[B]`` int64 context length of each sequence after this step.
        block_tables: ``[B, max_blocks]`` int64 cache blocks per sequence (padding is 0).
        max_query_len: the largest new-token count in the batch.
        max_seq_len: the largest ``seq_lens`` entry.
        block_size: tokens per cache block.
        page_indptr: optional ``[B+1]`` int32 CPU cumulative cache-block counts per sequence
            (the CSR form of ``block_tables``; see :func:`page_layout`).
        page_indices: optional ``[page_indptr[-1]]`` int32 CPU blocks of every sequence in order.
        last_page_len: optional ``[B]`` int32 CPU tokens in each sequence's last block
            (``1..block_size``).
        query_start_cpu: optional ``[B+1]`` int32 CPU copy of ``query_start``.
        seq_lens_cpu: optional ``[B]`` int32 CPU copy of ``seq_lens``.
        plan: the attention backend's per-step state, set by its planner's ``plan(meta)``
            once per step and read by every layer (None for the torch backend).

    The CPU fields let a planner build kernel plans without reading the device tensors
    back (no host sync); the torch backend ignores them.
    """

    slot_mapping: torch.Tensor
    query_start: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    max_query_len: int
    max_seq_len: int
    block_size: int
    page_indptr: torch.Tensor | None = None
    page_indices: torch.Tensor | None = None
    last_page_len: torch.Tensor | None = None
    query_start_cpu: torch.Tensor | None = None
    seq_lens_cpu: torch.Tensor | None = None
    plan: Any = None

    @property
    def num_seqs(self) -> int:
        return int(self.seq_lens.shape[0])

    @property
    def is_decode(self) -> bool:
        """Every sequence contributes exactly one new token."""
        return self.max_query_len == 1

    @property
    def query_lens(self) -> torch.Tensor:
        return self.query_start[1:] - self.query_start[:-1]


@register("write_kv", "torch")
def write_kv(cache: torch.Tensor, slot_mapping: torch.Tensor, values: torch.Tensor) -> None:
    """Store ``values[T, ...]`` at ``slot_mapping`` in ``cache[num_blocks, block_size, ...]``,
    converted to the cache's dtype (:func:`~flotilla.kernels.kv_dtype.to_cache_dtype`: a float8
    cache rounds to nearest even and saturates)."""
    flat = storage_view(cache).view(-1, *cache.shape[2:])
    flat.index_copy_(0, slot_mapping, storage_view(to_cache_dtype(values, cache.dtype)))


def context_slots(meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
    """``(slots[B, max_seq_len], valid[B, max_seq_len])``: the cache slot of every
    context position of every sequence, and which positions exist."""
    positions = torch.arange(meta.max_seq_len, device=meta.block_tables.device)
    blocks = meta.block_tables.gather(
        1, (positions // meta.block_size).clamp(max=meta.block_tables.shape[1] - 1).expand(meta.num_seqs, -1)
    )
    slots = blocks * meta.block_size + positions % meta.block_size
    valid = positions.unsqueeze(0) < meta.seq_lens.unsqueeze(1)
    return slots, valid


@register("gather_kv", "torch")
def gather_kv(cache: torch.Tensor, meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
    """Each sequence's whole context from the paged cache: ``([B, max_seq_len, ...], valid[B, max_seq_len])``,
    in the cache's dtype. Invalid (padding) positions hold arbitrary values."""
    blocks_needed = -(-meta.max_seq_len // meta.block_size)
    stored = storage_view(cache)
    if meta.block_tables.shape[1] < blocks_needed:
        slots, valid = context_slots(meta)
        flat = stored.view(-1, *cache.shape[2:])
        return flat[slots.masked_fill(~valid, 0)].view(cache.dtype), valid
    # NOTE: gathering whole blocks (one index per block, not per token) is several times
    # faster on CPU; the tail past each sequence's length is padding.
    tables = meta.block_tables[:, :blocks_needed]
    blocks = stored.flatten(1).index_select(0, tables.flatten()).view(cache.dtype)  # ~10x faster than cache[tables]
    context = blocks.view(meta.num_seqs, blocks_needed * meta.block_size, *cache.shape[2:])[:, : meta.max_seq_len]
    positions = torch.arange(meta.max_seq_len, device=meta.seq_lens.device)
    return context, positions.unsqueeze(0) < meta.seq_lens.unsqueeze(1)


def causal_context_mask(meta: AttentionMetadata) -> torch.Tensor:
    """``[B, max_query_len, max_seq_len]`` bool: new token ``i`` of sequence ``b``
    (at context position ``seq_lens[b] - query_len[b] + i``) sees positions ``<=`` its own."""
    query_lens = meta.query_lens
    q_index = torch.arange(meta.max_query_len, device=query_lens.device)
    q_pos = (meta.seq_lens - query_lens).unsqueeze(1) + q_index.unsqueeze(0)  # [B, Q]
    k_pos = torch.arange(meta.max_seq_len, device=query_lens.device)
    mask = k_pos.view(1, 1, -1) <= q_pos.unsqueeze(2)
    mask &= (k_pos.view(1, 1, -1) < meta.seq_lens.view(-1, 1, 1))
    return mask & (q_index.view(1, -1, 1) < query_lens.view(-1, 1, 1))


def pad_queries(x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
    """Scatter varlen rows ``x[T, ...]`` into ``[B, max_query_len, ...]`` (zeros as padding)."""
    if meta.is_decode:
        return x.unsqueeze(1)
    out = x.new_zeros(meta.num_seqs, meta.max_query_len, *x.shape[1:])
    index = _query_index(meta)
    out.view(-1, *x.shape[1:])[index] = x
    return out


def unpad_queries(x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
    """The inverse of :func:`pad_queries`: ``[B, max_query_len, ...] -> [T, ...]``."""
    if meta.is_decode:
        return x.squeeze(1)
    return x.reshape(-1, *x.shape[2:])[_query_index(meta)]


def _query_index(meta: AttentionMetadata) -> torch.Tensor:
    lens = meta.query_lens
    seq = torch.repeat_interleave(torch.arange(meta.num_seqs, device=lens.device), lens)
    within = torch.arange(int(lens.sum()), device=lens.device) - meta.query_start[:-1].repeat_interleave(lens)
    return seq * meta.max_query_len + within


@register("paged_attention", "torch")
def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Causal attention of the new tokens over their whole paged context.

    ``q[T, Hq, D]``, ``k``/``v[T, Hkv, D]`` (GQA when ``Hq > Hkv``). Writes the new
    K/V into the caches first, then attends. Returns ``[T, Hq, Dv]``; an empty batch
    (``T == 0``, zero sequences: an idle DP-attention rank) gives ``[0, Hq, Dv]`` and
    leaves the caches untouched.
    """
    if q.shape[0] == 0:
        # NOTE: nothing to write or attend to; return before building zero-size masks and
        # calling SDPA on an empty batch (the CPU path copes, not every SDPA backend is known to).
        return q.new_empty(0, q.shape[1], v.shape[-1])
    write_kv(k_cache, meta.slot_mapping, k)
    write_kv(v_cache, meta.slot_mapping, v)
    keys, valid = gather_kv(k_cache, meta)  # [B, L, Hkv, D]
    values, _ = gather_kv(v_cache, meta)
    # NOTE: a decode's one new token is the last of its context, so causality is just validity.
    mask = valid.unsqueeze(1) if meta.is_decode else causal_context_mask(meta)  # [B, Q, L]
    if sliding_window is not None:
        device = meta.seq_lens.device
        q_pos = (meta.seq_lens - meta.query_lens).unsqueeze(1) + torch.arange(meta.max_query_len, device=device).unsqueeze(0)
        k_pos = torch.arange(meta.max_seq_len, device=device)
        mask &= k_pos.view(1, 1, -1) > (q_pos.unsqueeze(2) - sliding_window)
    queries = pad_queries(q, meta).transpose(1, 2)  # [B, Hq, Q, D]
    keys = keys.transpose(1, 2).to(q.dtype)  # [B, Hkv, L, D]
    values = values.transpose(1, 2).to(q.dtype)
    # NOTE: enable_gqa shares each K/V head among its Hq/Hkv query heads without copying them.
    out = F.scaled_dot_product_attention(
        queries, keys, values, attn_mask=mask.unsqueeze(1), scale=scale, enable_gqa=q.shape[1] != k.shape[1]
    )
    return unpad_queries(out.transpose(1, 2), meta)


def page_layout(
    seq_lens: Sequence[int], block_tables: Sequence[Sequence[int]], block_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The CSR page layout of a step, as int32 CPU tensors ``(page_indptr[B+1],
    page_indices[sum], last_page_len[B])``, from plain lists: sequence ``b`` spans its
    first ``ceil(seq_lens[b] / block_size)`` blocks of ``block_tables[b]`` (extra entries,
    e.g. padding, are ignored). Fills :class:`AttentionMetadata`'s optional CPU fields."""
    indptr, indices, last = [0], [], []
    for b, (seq_len, blocks) in enumerate(zip(seq_lens, block_tables, strict=True)):
        if seq_len < 1:
            raise ValueError(f"sequence {b} has seq_len={seq_len}; every scheduled sequence holds >= 1 token")
        pages = -(-seq_len // block_size)
        if len(blocks) < pages:
            raise ValueError(
                f"sequence {b} (seq_len={seq_len}, block_size={block_size}) needs {pages} blocks, "
                f"its block table has {len(blocks)}"
            )
        indices.extend(blocks[:pages])
        indptr.append(indptr[-1] + pages)
        last.append(seq_len - (pages - 1) * block_size)
    return tuple(torch.tensor(xs, dtype=torch.int32) for xs in (indptr, indices, last))


@dataclass(frozen=True)
class StepLayout:
    """A step's CSR page layout as int32 CPU tensors (possibly padded to a graph batch).

    Attributes:
        query_start: ``[B+1]`` cumulative new-token counts.
        page_indptr: ``[B+1]`` cumulative cache-block counts.
        page_indices: ``[page_indptr[-1]]`` blocks of every sequence in order.
        last_page_len: ``[B]`` tokens in each sequence's last block.
        seq_lens: ``[B]`` context lengths.
    """

    query_start: torch.Tensor
    page_indptr: torch.Tensor
    page_indices: torch.Tensor
    last_page_len: torch.Tensor
    seq_lens: torch.Tensor

    @property
    def num_seqs(self) -> int:
        return int(self.last_page_len.shape[0])

    @property
    def num_tokens(self) -> int:
        return int(self.query_start[-1])

    def num_leading_decodes(self) -> int:
        """How many sequences at the front of the step have exactly one new token (the
        scheduler puts running decodes first, in arrival order)."""
        single = (self.query_start[1:] - self.query_start[:-1]) == 1
        return self.num_seqs if bool(single.all()) else int(single.int().argmin())

    def split(self, num_seqs: int) -> tuple["StepLayout", "StepLayout"]:
        """The first ``num_seqs`` sequences and the rest, as two layouts of their own
        (query, page and index offsets rebased to 0). ValueError unless 0 < num_seqs < B."""
        if not 0 < num_seqs < self.num_seqs:
            raise ValueError(f"split needs 0 < num_seqs < {self.num_seqs}, got num_seqs={num_seqs}")
        pages = int(self.page_indptr[num_seqs])
        head = StepLayout(
            self.query_start[: num_seqs + 1],
            self.page_indptr[: num_seqs + 1],
            self.page_indices[:pages],
            self.last_page_len[:num_seqs],
            self.seq_lens[:num_seqs],
        )
        tail = StepLayout(
            self.query_start[num_seqs:] - self.query_start[num_seqs],
            self.page_indptr[num_seqs:] - pages,
            self.page_indices[pages:],
            self.last_page_len[num_seqs:],
            self.seq_lens[num_seqs:],
        )
        return head, tail


def step_layout(meta: AttentionMetadata, pad_to: int | None = None, padding_page: int = 0) -> StepLayout:
    """The CPU page layout of ``meta`` (its optional CPU fields, which the runner fills).

    With ``pad_to``, sequences are appended up to ``pad_to``, each one token long in the
    single block ``padding_page`` (read only; the padded rows' outputs are discarded).
    Raises ValueError when a CPU field is missing or the batch exceeds ``pad_to``.
    """
    fields = ("query_start_cpu", "page_indptr", "page_indices", "last_page_len", "seq_lens_cpu")
    missing = [name for name in fields if getattr(meta, name) is None]
    if missing:
        raise ValueError(
            f"this attention planner needs AttentionMetadata's CPU page layout; missing {missing} "
            "(fill them in prepare_inputs, e.g. with page_layout)"
        )
    on_device = [name for name in fields if getattr(meta, name).device.type != "cpu"]
    if on_device:
        raise ValueError(f"AttentionMetadata fields {on_device} must be CPU tensors (planning must not read the GPU back)")
    layout = StepLayout(
        meta.query_start_cpu.to(torch.int32),
        meta.page_indptr.to(torch.int32),
        meta.page_indices.to(torch.int32),
        meta.last_page_len.to(torch.int32),
        meta.seq_lens_cpu.to(torch.int32),
    )
    if layout.num_seqs != meta.num_seqs or layout.page_indptr.shape[0] != meta.num_seqs + 1:
        raise ValueError(
            f"AttentionMetadata describes {meta.num_seqs} sequences but its CPU page layout "
            f"{layout.num_seqs} (last_page_len) / {layout.page_indptr.shape[0] - 1} (page_indptr)"
        )
    if pad_to is None or pad_to == layout.num_seqs:
        return layout
    extra = pad_to - layout.num_seqs
    if extra < 0:
        raise ValueError(f"a batch of {layout.num_seqs} sequences does not fit graph_batch_size={pad_to}")
    steps = torch.arange(1, extra + 1, dtype=torch.int32)
    ones = torch.ones(extra, dtype=torch.int32)
    return StepLayout(
        torch.cat([layout.query_start, layout.query_start[-1] + steps]),
        torch.cat([layout.page_indptr, layout.page_indptr[-1] + steps]),
        torch.cat([layout.page_indices, torch.full((extra,), padding_page, dtype=torch.int32)]),
        torch.cat([layout.last_page_len, ones]),
        torch.cat([layout.seq_lens, ones]),
    )


@register("attention_planner", "torch")
class TorchAttentionPlanner:
    """The torch backend's attention planner: a no-op (the reference recomputes its
    masks from the device metadata every call), so ``meta.plan`` stays None.

    Same constructor as every attention planner: ``(shape, device, *, block_size,
    max_num_seqs, max_num_pages, graph_batch_sizes=())``.
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
    ) -> None:
        self.shape, self.device, self.block_size = shape, torch.device(device), block_size
        self.graph_batch_sizes = tuple(sorted(set(graph_batch_sizes)))

    def plan(self, meta: AttentionMetadata, graph_batch_size: int | None = None) -> None:
        """Set ``meta.plan`` for this step: None (nothing to plan)."""
        meta.plan = None
