"""Paged decode attention for small batches in Triton: split-KV ("flash decoding") over the
paged cache, each program serving one KV head's whole query group.

Why: at batch 1 flashinfer's decode (its tensor-core prefill kernel applied to one query row,
plus a merge kernel for the split-KV partials) takes ~8.3 + 1.7 us per layer on an H200 for a
640-token context whose K/V are 2.6 MB (0.6 us of reading): 0.32 ms of the Llama-3.1-8B
batch-1 decode step, more on the 48 layers of Qwen3-30B-A3B (``benchmarks/dev/decode_profile.py``).
The flashinfer planner (:mod:`flotilla.kernels.flashinfer_attention`) hands decode steps of at
most :data:`MAX_BATCH` sequences to :class:`TritonDecode` instead.

Two launches per layer, both programmatic dependents (:mod:`flotilla.kernels.triton_pdl`),
or one with the merge folded into the split kernel (:data:`FOLD_MERGE`, below):

1. ``_split_kernel``, grid ``(B, Hkv, S)``: program ``(b, h, s)`` takes the ``s``-th of ``S``
   equal slices of sequence ``b``'s context (the part a sliding window leaves), scores the
   ``G = Hq / Hkv`` query heads of KV head ``h`` against it in ``BLOCK_N``-token tiles (one MMA:
   the group's rows padded to 16), and keeps an online softmax: the slice's running maximum
   ``m`` and sum ``l`` (base 2) and its unnormalised output, written to float32 scratch. A
   slice with no tokens (a short context) reads and writes nothing; the merge skips it.
2. ``_merge_kernel``, grid ``(B, Hq)``: rescales the ``S`` partials to their common maximum
   and writes ``sum(acc) / sum(l)`` in the query dtype.

With the merge folded, each split program that holds tokens merges after storing its partials,
in two levels (``_fold_merge``), so that no program merges more than a bounded number of
partials: level 1 over groups of :data:`MERGE_GROUP` consecutive splits (the last program of a
group to count in on the group's int32 counter merges it), level 2 over the groups (the last
level-1 merger to count in on the (sequence, KV head) counter). A context whose tokens fill one
group stops at level 1, whose merger writes the output. The programs that merge reset the
counters, which :class:`TritonDecode` zeroes once at construction. That takes the merge launch
off each layer's critical path. A merging program reads ``rows * G * (D + 2) * 4`` bytes of
partials; Qwen3-30B-A3B's layout at batch 1 (G = 8, D = 128, 4.2 KB a row): 42 KB at 640
tokens (10 splits, one level); at 8192 tokens (128 splits) 67 KB for each group, then 33 KB for
the 8 groups, where one merger read 532 KB (21.2 us against the merge launch's 11.7 on the
H200). The GPU tests (and the attention probe, removed in 004bdbd) compare it with the merge launch
(and, in the probe, with a single level).

``S`` is fixed per batch size (the grid is baked into a CUDA graph; contexts change between
replays): ``B * Hkv * S`` is about :data:`TARGET_PROGRAMS`, four per SM, which long contexts
need to keep enough loads in flight; a short context fills only its first slices (at least
:data:`MIN_CHUNK` tokens each) and the empty programs exit at once.

Measured on an H200 (docs/benchmarks.md, "Fifth pass"): 7.2-7.4 us against flashinfer's 9.7-10.0
at batch 1 and 640 tokens, even with it at 8192 tokens and at batch 8; the batch-1 decode step of
Llama-3.1-8B 4.218 ms against 4.275, of Qwen3-30B-A3B 3.237 against 3.328.

Numerics (flashinfer's): q.k in float32 from the input dtype, the probabilities rounded to
the input dtype for the P.V product (float32 accumulation), the output rounded once. A float8
cache (scale 1.0, :mod:`flotilla.kernels.kv_dtype`) is widened to the query dtype as it loads
(every e4m3/e5m2 value is exact in bf16 and fp16).

Importing this module imports Triton (the flashinfer planner imports it only on CUDA).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from flotilla.kernels.triton_pdl import launch_options, start_dependent

# Decode steps of at most this many sequences run here; larger ones keep flashinfer's
# tensor-core kernel (batch 8 was still even or better here in the attention probe, removed in 004bdbd
# on the H200; larger batches were not measured with these settings).
MAX_BATCH = 8
# Turned off process-wide for side-by-side measurements (FLOTILLA_TRITON_DECODE=0, or
# benchmarks/dev/decode_profile.py --without triton_decode).
ENABLED = os.environ.get("FLOTILLA_TRITON_DECODE", "1") != "0"
SUPPORTED_HEAD_DIMS = (64, 128, 256)
# Split programs one launch holds (about four per SM of an H100/H200): long contexts need
# that many loads in flight; a short one fills only the first few splits (MIN_CHUNK).
TARGET_PROGRAMS = 512
MIN_CHUNK = 64
MAX_SPLITS = 128
# The split kernel merges the partials itself (the last split programs to finish, in two
# levels: MERGE_GROUP), no merge launch; False: the separate _merge_kernel, for an A/B. Read
# when a TritonDecode is built.
FOLD_MERGE = True
# The folded merge loads at most this many float32 partials per step (splits x heads x dims).
MERGE_CHUNK_ELEMENTS = 8192
# The folded merge runs in two levels: groups of this many consecutive splits, each merged by
# its last program, then the groups merged by the last of those (one level when a context
# fills one group). A merging program reads rows * G * (D + 2) * 4 bytes, 4.2 KB a row at
# Qwen3-30B-A3B's G = 8, D = 128: level 1 reads at most MERGE_GROUP rows, level 2 at most
# MAX_SPLITS / MERGE_GROUP, so 8 and 16 (either side of sqrt(128)) both bound the two merges
# in a row to 67 + 33 KB, against 532 KB for one program at 128 splits (21.2 us at 8192
# tokens, 11.7 with the merge launch). 16 keeps every context of up to 16 splits at one level
# (1024 tokens at batch 1 with 64-token slices; every batch of 8 with 4 KV heads): the
# single-merger cost measured at 640 tokens (6.2 us, the merge launch 7.3), to which a
# second level would add a store and an atomic round trip. Power of two.
MERGE_GROUP = 16
_LOG2E = 1.4426950408889634
_INTERPRETER = os.environ.get("TRITON_INTERPRET") == "1"


def num_splits(batch: int, num_kv_heads: int, target_programs: int = TARGET_PROGRAMS) -> int:
    """``S``: the power of two (1..:data:`MAX_SPLITS`) nearest below ``target_programs / (B * Hkv)``."""
    want = max(1, target_programs // max(1, batch * num_kv_heads))
    return min(MAX_SPLITS, 1 << (want.bit_length() - 1))


def merge_chunk(group: int, head_dim: int, splits: int) -> int:
    """Partials the folded merge sums per step (splits at level 1, groups at level 2): the
    power of two, at most 8 and ``splits``, that keeps ``chunk * next_pow2(group) * head_dim``
    within :data:`MERGE_CHUNK_ELEMENTS`."""
    per_split = triton.next_power_of_2(group) * head_dim
    chunk = min(8, splits, max(1, MERGE_CHUNK_ELEMENTS // per_split))
    return 1 << (chunk.bit_length() - 1)


def merge_groups(splits: int, merge_group: int = MERGE_GROUP) -> tuple[int, int]:
    """The folded merge's split groups for ``S = splits``: (splits per group, groups), that is
    ``(min(merge_group, S), S // that)``; both powers of two when ``S`` and ``merge_group`` are."""
    per_group = min(merge_group, splits)
    return per_group, splits // per_group


@triton.jit
def _dot(a, b, DOT_F32: tl.constexpr):
    """``a @ b`` accumulated in float32; ``DOT_F32`` widens the operands first (Triton's CPU
    interpreter multiplies bf16 operands as raw bits)."""
    if DOT_F32:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a, b)


@triton.jit
def _context_slices(indptr_ptr, last_len_ptr, seq, window, PAGE_SIZE: tl.constexpr, SPLITS: tl.constexpr,
                    MIN_CHUNK: tl.constexpr):  # fmt: skip
    """Sequence ``seq``'s first page, the first position it attends to (after the window), its
    context length, the tokens per split and the number of splits that hold any."""
    first_page = tl.load(indptr_ptr + seq)
    pages = tl.load(indptr_ptr + seq + 1) - first_page
    seq_len = (pages - 1) * PAGE_SIZE + tl.load(last_len_ptr + seq)
    lo = 0
    if window > 0:
        lo = tl.maximum(seq_len - window, 0)
    # NOTE: slices of at least MIN_CHUNK tokens: a short context leaves the last splits empty
    # (they exit at once and the merge skips them) rather than spreading a few tokens thin.
    chunk = tl.maximum(tl.cdiv(seq_len - lo, SPLITS), MIN_CHUNK)
    return first_page, lo, seq_len, chunk, tl.cdiv(seq_len - lo, chunk)


@triton.jit
def _split_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, indptr_ptr, last_len_ptr, indices_ptr, acc_ptr, ml_ptr,
    out_ptr, count_ptr, group_count_ptr, scale_log2, window,
    stride_qt, stride_qh, stride_kb, stride_ko, stride_kh, stride_vb, stride_vo, stride_vh, stride_ot, stride_oh,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr, SPLITS: tl.constexpr, MIN_CHUNK: tl.constexpr, DOT_F32: tl.constexpr,
    FOLD_MERGE: tl.constexpr, MERGE_G: tl.constexpr, MERGE_GROUP: tl.constexpr, NUM_GROUPS: tl.constexpr,
    GROUP_CHUNK: tl.constexpr, TOP_CHUNK: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    # NOTE: the page layout was copied before the step's first kernel (a plain memcpy, which
    # every later kernel waits for), so it may be read before waiting on the kernel before.
    first_page, lo, seq_len, chunk, active = _context_slices(
        indptr_ptr, last_len_ptr, seq, window, PAGE_SIZE, SPLITS, MIN_CHUNK
    )
    if split < active:  # NOTE: an empty split reads and writes nothing (so it need not wait)
        start = lo + split * chunk
        end = tl.minimum(start + chunk, seq_len)
        start_dependent(PDL)  # q and the new token's K/V come from the kernel before
        group = tl.arange(0, BLOCK_G)
        dims = tl.arange(0, HEAD_DIM)
        heads = kv_head * GROUP + group
        q = tl.load(
            q_ptr + seq.to(tl.int64) * stride_qt + heads[:, None] * stride_qh + dims[None, :],
            mask=(group < GROUP)[:, None],
            other=0.0,
        )
        DTYPE: tl.constexpr = q_ptr.dtype.element_ty
        m = tl.full((BLOCK_G,), float("-inf"), tl.float32)
        l = tl.zeros((BLOCK_G,), tl.float32)
        acc = tl.zeros((BLOCK_G, HEAD_DIM), tl.float32)
        tokens = tl.arange(0, BLOCK_N)
        for tile in range(start, end, BLOCK_N):
            position = tile + tokens
            ok = position < end
            page = tl.load(indices_ptr + first_page + position // PAGE_SIZE, mask=ok, other=0).to(tl.int64)
            offset = position % PAGE_SIZE
            k_rows = k_cache_ptr + page * stride_kb + offset * stride_ko + kv_head * stride_kh
            k = tl.load(k_rows[:, None] + dims[None, :], mask=ok[:, None], other=0.0).to(DTYPE)
            scores = _dot(q, tl.trans(k), DOT_F32) * scale_log2
            scores = tl.where(ok[None, :], scores, float("-inf"))
            m_new = tl.maximum(m, tl.max(scores, axis=1))
            alpha = tl.exp2(m - m_new)
            p = tl.exp2(scores - m_new[:, None])
            l = l * alpha + tl.sum(p, axis=1)
            v_rows = v_cache_ptr + page * stride_vb + offset * stride_vo + kv_head * stride_vh
            v = tl.load(v_rows[:, None] + dims[None, :], mask=ok[:, None], other=0.0).to(DTYPE)
            acc = acc * alpha[:, None] + _dot(p.to(DTYPE), v, DOT_F32)
            m = m_new
        # Partials of (seq, head, split): acc[..., HEAD_DIM] and (m, l), float32.
        row = (seq * (GROUP * tl.num_programs(1)) + heads).to(tl.int64) * SPLITS + split
        _store_partial(acc_ptr, ml_ptr, row, group < GROUP, m, l, acc, HEAD_DIM)
        if FOLD_MERGE:
            _fold_merge(
                acc_ptr, ml_ptr, out_ptr, count_ptr, group_count_ptr, seq, kv_head, split, active,
                stride_ot, stride_oh, GROUP, HEAD_DIM, SPLITS, MERGE_G, MERGE_GROUP, NUM_GROUPS,
                GROUP_CHUNK, TOP_CHUNK,
            )  # fmt: skip


@triton.jit
def _fold_merge(
    acc_ptr, ml_ptr, out_ptr, count_ptr, group_count_ptr, seq, kv_head, split, active, stride_ot, stride_oh,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, SPLITS: tl.constexpr, MERGE_G: tl.constexpr,
    MERGE_GROUP: tl.constexpr, NUM_GROUPS: tl.constexpr, GROUP_CHUNK: tl.constexpr, TOP_CHUNK: tl.constexpr,
):  # fmt: skip
    """The folded merge of (seq, kv_head), run by every split program that holds tokens after
    storing its partials; two levels, so no program merges more than ``MERGE_GROUP`` partials
    of each head (or ``NUM_GROUPS``, the groups of ``MERGE_GROUP`` consecutive splits).

    Level 1: the program counts in on its group's counter; the one that brings it to the
    group's splits holding tokens (``min(MERGE_GROUP, active - first split of the group)``)
    merges them for the ``GROUP`` query heads (``_merge_rows``) and sets that counter back to 0.
    If the sequence's tokens fill one group, it writes the output: one level, the cost of a
    single merger. Otherwise (level 2) it stores the group's partial (max, sum, unnormalised
    output) over the partials of the group's first split (every member has counted in, so
    none is read again but by this program, and only before the barrier in front of the
    store), then counts in on (seq, kv_head)'s counter; the one that brings it to the active
    groups merges the group partials (rows ``MERGE_GROUP`` apart), writes the output and sets
    that counter to 0. Both levels use ``_merge_kernel``'s math in float32 but add in another
    order (in chunks, then per group), so the output rounds like the merge kernel's up to
    float32 rounding.

    Memory ordering (the invariant, the same at both levels; Triton's interpreter runs
    programs one at a time, so CPU tests check the merging and counting, not this):
    - every thread stored its part of what the next merger reads (the split's partials, or
      the group partial) before the barrier in ``_count_in``; one thread then runs the scalar
      ``acq_rel`` atomic at GPU scope, whose release is cumulative over what the barrier
      ordered before it;
    - the merger's atomic acquires every earlier release on that counter (one release
      sequence of read-modify-writes); Triton broadcasts its result through shared memory
      behind a barrier, so every thread's loads come after the acquire, and they are ``.cg``
      (L2, the coherence point), so no stale L1 line is read. A group partial overwrites its
      first split's partials after the level-1 merger acquired them, so the level-2 merger,
      acquiring the level-1 merger's release, reads the group partial;
    - the resets are plain stores: no program of this launch touches a counter after its
      last increment, and the next launch's increments come after its ``griddepcontrol.wait``
      (or stream order without PDL), i.e. after this launch completes. Empty splits never
      touch a counter, so each counter is 0 after every run (and graph replay) given that it
      was 0 before: :class:`TritonDecode` zeroes them once.
    """
    pair = seq * tl.num_programs(1) + kv_head
    group_start = (split // MERGE_GROUP) * MERGE_GROUP
    group_counter = group_count_ptr + pair * NUM_GROUPS + split // MERGE_GROUP
    if _count_in(group_counter, tl.minimum(active - group_start, MERGE_GROUP)):
        tl.store(group_counter, 0)
        heads = tl.arange(0, MERGE_G)
        valid = heads < GROUP
        first = (pair * GROUP + heads).to(tl.int64) * SPLITS  # row of each head's split 0
        members = tl.minimum(active - group_start, MERGE_GROUP)
        m, l, acc = _merge_rows(acc_ptr, ml_ptr, first + group_start, valid, 1, members,
                                HEAD_DIM, MERGE_G, MERGE_GROUP, GROUP_CHUNK)  # fmt: skip
        # NOTE: two branches with one body on purpose: NUM_GROUPS is a constexpr, so a launch
        # with a single group compiles level 2 out; `active` decides at run time otherwise.
        if NUM_GROUPS == 1:
            _store_output(out_ptr, seq, kv_head, acc, l, valid, stride_ot, stride_oh, GROUP, MERGE_G, HEAD_DIM)
        elif active <= MERGE_GROUP:
            _store_output(out_ptr, seq, kv_head, acc, l, valid, stride_ot, stride_oh, GROUP, MERGE_G, HEAD_DIM)
        else:
            # NOTE: every thread's loads of the first split's partials come before they are overwritten.
            tl.debug_barrier()
            _store_partial(acc_ptr, ml_ptr, first + group_start, valid, m, l, acc, HEAD_DIM)
            groups = tl.cdiv(active, MERGE_GROUP)
            if _count_in(count_ptr + pair, groups):
                tl.store(count_ptr + pair, 0)
                m, l, acc = _merge_rows(acc_ptr, ml_ptr, first, valid, MERGE_GROUP, groups,
                                        HEAD_DIM, MERGE_G, NUM_GROUPS, TOP_CHUNK)  # fmt: skip
                _store_output(out_ptr, seq, kv_head, acc, l, valid, stride_ot, stride_oh, GROUP, MERGE_G, HEAD_DIM)


@triton.jit
def _count_in(counter_ptr, expected):
    """Count this program in on an int32 counter (after a barrier: what every thread stored
    before is released with it); True for the program that brings it to ``expected``."""
    tl.debug_barrier()
    arrived = tl.atomic_add(counter_ptr, 1, sem="acq_rel", scope="gpu")
    return arrived == expected - 1


@triton.jit
def _store_partial(acc_ptr, ml_ptr, rows, valid, m, l, acc, HEAD_DIM: tl.constexpr):
    """Store one partial per head: ``acc[rows, HEAD_DIM]`` and ``(m, l)`` at ``ml[rows, 2]``
    (float32), heads where ``valid``."""
    dims = tl.arange(0, HEAD_DIM)
    tl.store(acc_ptr + rows[:, None] * HEAD_DIM + dims[None, :], acc, mask=valid[:, None])
    tl.store(ml_ptr + rows * 2, m, mask=valid)
    tl.store(ml_ptr + rows * 2 + 1, l, mask=valid)


@triton.jit
def _merge_rows(
    acc_ptr, ml_ptr, base, valid, stride, count,
    HEAD_DIM: tl.constexpr, MERGE_G: tl.constexpr, ROWS: tl.constexpr, CHUNK: tl.constexpr,
):  # fmt: skip
    """Merge ``count`` (<= ``ROWS``) partials of each head, rows ``base + i * stride``:
    returns their common maximum ``m``, ``sum(l * w)`` and ``sum(acc * w)`` with weights
    ``w = exp2(m_i - m)``, float32, the output unnormalised (a partial itself). The acc sum
    runs in chunks of ``CHUNK`` rows to bound registers. Loads are ``.cg`` (other programs
    wrote these rows; see ``_fold_merge``)."""
    index = tl.arange(0, ROWS)
    used = valid[:, None] & (index < count)[None, :]
    ml = ml_ptr + (base[:, None] + index[None, :] * stride) * 2
    m = tl.load(ml, mask=used, other=float("-inf"), cache_modifier=".cg")
    l = tl.load(ml + 1, mask=used, other=0.0, cache_modifier=".cg")
    # NOTE: padding heads (not valid) see no row; 0 keeps them finite (never stored).
    m_max = tl.where(valid, tl.max(m, axis=1), 0.0)
    l_sum = tl.where(valid, tl.sum(l * tl.exp2(m - m_max[:, None]), axis=1), 1.0)
    dims = tl.arange(0, HEAD_DIM)
    acc = tl.zeros((MERGE_G, HEAD_DIM), tl.float32)
    for c0 in range(0, count, CHUNK):
        chunk = c0 + tl.arange(0, CHUNK)
        in_chunk = valid[:, None] & (chunk < count)[None, :]
        rows = base[:, None] + chunk[None, :] * stride
        m_c = tl.load(ml_ptr + rows * 2, mask=in_chunk, other=float("-inf"), cache_modifier=".cg")
        weight = tl.exp2(m_c - m_max[:, None])
        part = tl.load(acc_ptr + rows[:, :, None] * HEAD_DIM + dims[None, None, :], mask=in_chunk[:, :, None],
                       other=0.0, cache_modifier=".cg")  # fmt: skip
        acc += tl.sum(part * weight[:, :, None], axis=1)
    return m_max, l_sum, acc


@triton.jit
def _store_output(
    out_ptr, seq, kv_head, acc, l, valid, stride_ot, stride_oh,
    GROUP: tl.constexpr, MERGE_G: tl.constexpr, HEAD_DIM: tl.constexpr,
):  # fmt: skip
    """Write ``acc / l`` of KV head ``kv_head``'s query heads in the output dtype."""
    heads = kv_head * GROUP + tl.arange(0, MERGE_G)
    dims = tl.arange(0, HEAD_DIM)
    dst = out_ptr + seq.to(tl.int64) * stride_ot + heads[:, None] * stride_oh + dims[None, :]
    tl.store(dst, (acc / l[:, None]).to(out_ptr.dtype.element_ty), mask=valid[:, None])


@triton.jit
def _merge_kernel(
    acc_ptr, ml_ptr, out_ptr, indptr_ptr, last_len_ptr, window, stride_ot, stride_oh,
    HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr, SPLITS: tl.constexpr, MIN_CHUNK: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    seq = tl.program_id(0)
    head = tl.program_id(1)
    active = _context_slices(indptr_ptr, last_len_ptr, seq, window, PAGE_SIZE, SPLITS, MIN_CHUNK)[4]
    start_dependent(PDL)  # the partials come from the split kernel
    splits = tl.arange(0, SPLITS)
    used = splits < active  # NOTE: at least one: the newest token's split is never empty
    rows = (seq * tl.num_programs(1) + head).to(tl.int64) * SPLITS + splits
    m = tl.load(ml_ptr + rows * 2, mask=used, other=float("-inf"))
    l = tl.load(ml_ptr + rows * 2 + 1, mask=used, other=0.0)
    weight = tl.exp2(m - tl.max(m, axis=0))
    dims = tl.arange(0, HEAD_DIM)
    acc = tl.load(acc_ptr + rows[:, None] * HEAD_DIM + dims[None, :], mask=used[:, None], other=0.0)
    out = tl.sum(acc * weight[:, None], axis=0) / tl.sum(l * weight, axis=0)
    dst = out_ptr + seq.to(tl.int64) * stride_ot + head * stride_oh + dims
    tl.store(dst, out.to(out_ptr.dtype.element_ty))


class TritonDecode:
    """Decode attention for up to ``max_batch`` sequences, planned once per step and run by
    every layer; a stand-in for a planned flashinfer decode wrapper (``run(q, (k, v))``).

    The page layout of the planned step lives in one int32 device buffer at offsets that
    depend only on the batch size (``indptr[B+1] | last_page_len[B] | indices``), so a CUDA
    graph captured at size ``B`` reads every later plan of that size. ``plan`` stages the
    layout through a pinned host buffer: the caller must not re-plan before the previous
    plan's copy has run (the flashinfer planner waits on an event for its own plans; the same
    wait covers this one).

    Args:
        num_q_heads, num_kv_heads, head_dim: the rank's attention shape (``head_dim`` in
            :data:`SUPPORTED_HEAD_DIMS`, ``num_q_heads`` a multiple of ``num_kv_heads``).
        page_size: tokens per cache block.
        scale: the softmax scale.
        sliding_window: tokens a query sees, itself included (None: the whole context).
        max_batch: the largest batch a plan may have (padding sequences included).
        max_num_pages: the most cache blocks one plan references.
        device: the CUDA device.
        target_programs, block_n, min_chunk, num_warps, num_stages: launch tuning (split
            programs one launch has, tokens per tile, the fewest tokens a split takes, the split
            kernel's warps and pipeline stages);
            the defaults are the measured best on the H200 (the attention probe, removed in 004bdbd).
        fold_merge: whether the split kernel merges the partials itself (no merge launch);
            None: :data:`FOLD_MERGE`.
        merge_group: splits per level-1 group of the folded merge (a power of two; default
            :data:`MERGE_GROUP`; :data:`MAX_SPLITS` or more: one level, a single merger).

    NOTE: the scratch partials and the folded merge's counters are the instance's own: one
    instance's runs must not overlap (on two streams); a model runs its layers in order.
    """

    def __init__(
        self,
        num_q_heads: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        page_size: int,
        scale: float,
        sliding_window: int | None,
        max_batch: int,
        max_num_pages: int,
        device: torch.device | str,
        target_programs: int = TARGET_PROGRAMS,
        block_n: int | None = None,
        min_chunk: int = MIN_CHUNK,
        num_warps: int = 4,
        num_stages: int = 2,
        fold_merge: bool | None = None,
        merge_group: int = MERGE_GROUP,
    ) -> None:
        if head_dim not in SUPPORTED_HEAD_DIMS:
            raise ValueError(f"TritonDecode supports head_dim in {SUPPORTED_HEAD_DIMS}, got head_dim={head_dim}")
        if num_kv_heads < 1 or num_q_heads % num_kv_heads:
            raise ValueError(f"num_q_heads={num_q_heads} must be a multiple of num_kv_heads={num_kv_heads}")
        if max_batch < 1 or max_num_pages < 1 or page_size < 1:
            raise ValueError(
                f"max_batch={max_batch}, max_num_pages={max_num_pages} and page_size={page_size} must be positive"
            )
        if merge_group < 1 or merge_group & (merge_group - 1):
            raise ValueError(f"merge_group must be a power of two (splits per merge group), got merge_group={merge_group}")
        self.num_q_heads, self.num_kv_heads, self.head_dim = num_q_heads, num_kv_heads, head_dim
        self.page_size, self.scale = page_size, float(scale)
        self.window = 0 if sliding_window is None else int(sliding_window)
        self.max_batch, self.device = max_batch, torch.device(device)
        # NOTE: one plan's indices hold at most max_num_pages real blocks plus one per padding sequence.
        capacity = 2 * max_batch + 1 + max_num_pages + max_batch
        self._layout = torch.zeros(capacity, dtype=torch.int32, device=self.device)
        self._staging = torch.zeros(capacity, dtype=torch.int32, pin_memory=self.device.type == "cuda")
        self.target_programs, self.num_warps, self.num_stages = target_programs, num_warps, num_stages
        self.block_n = block_n or _block_n(head_dim)
        self.min_chunk = min_chunk
        splits = num_splits(1, num_kv_heads, target_programs)
        rows = max_batch * num_q_heads * splits
        self._acc = torch.empty(rows * head_dim, dtype=torch.float32, device=self.device)
        self._ml = torch.empty(rows * 2, dtype=torch.float32, device=self.device)
        self.fold_merge = FOLD_MERGE if fold_merge is None else bool(fold_merge)
        self.merge_group = merge_group
        # NOTE: the folded merge's counters, zeroed once: one per (seq, KV head), then one per
        # (seq, KV head, split group); the program that brings a counter to its count resets
        # it, so every run (and graph replay) starts from zeros. Sized for batch 1's splits, the
        # most groups per KV head (a larger batch has no more splits, so no more groups).
        pairs = max_batch * num_kv_heads
        groups = merge_groups(splits, merge_group)[1]
        self._merge_counts = torch.zeros(pairs * (1 + groups), dtype=torch.int32, device=self.device)
        self._head_counts, self._group_counts = self._merge_counts[:pairs], self._merge_counts[pairs:]
        self.batch = 0

    def plan(self, page_indptr: torch.Tensor, page_indices: torch.Tensor, last_page_len: torch.Tensor) -> None:
        """Stage one step's CPU page layout (int32: ``[B+1]``, ``[page_indptr[-1]]``, ``[B]``)
        for the next ``run`` calls; asynchronous (no host sync)."""
        batch = int(last_page_len.shape[0])
        pages = int(page_indices.shape[0])
        if not 1 <= batch <= self.max_batch:
            raise ValueError(f"TritonDecode plans 1..{self.max_batch} sequences, got {batch}")
        size = 2 * batch + 1 + pages
        if size > self._layout.shape[0]:
            raise ValueError(
                f"the step references {pages} cache blocks; TritonDecode's buffer holds "
                f"{self._layout.shape[0] - 2 * batch - 1} for a batch of {batch}"
            )
        staging = self._staging
        staging[: batch + 1] = page_indptr
        staging[batch + 1 : 2 * batch + 1] = last_page_len
        staging[2 * batch + 1 : size] = page_indices
        self._layout[:size].copy_(staging[:size], non_blocking=True)
        self.batch = batch

    def run(self, q: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """Attention of ``q[B, Hq, D]`` (one query per planned sequence, the newest token of
        its context, whose K/V are already in the caches) over the caches
        ``[num_blocks, page_size, Hkv, D]``; returns ``[B, Hq, D]`` in ``q``'s dtype.
        CUDA-graph capturable (no sync, the output is the only allocation)."""
        k_cache, v_cache = kv_cache
        batch = self.batch
        if q.shape != (batch, self.num_q_heads, self.head_dim):
            raise ValueError(
                f"TritonDecode was planned for {batch} sequences of {self.num_q_heads} heads x {self.head_dim}; "
                f"got q of shape {tuple(q.shape)}"
            )
        if q.stride(-1) != 1 or k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
            raise ValueError("TritonDecode needs a unit last stride on q and the caches")
        if k_cache.shape[1] != self.page_size or k_cache.shape[2] != self.num_kv_heads:
            raise ValueError(
                f"caches of shape {tuple(k_cache.shape)} do not match page_size={self.page_size}, "
                f"num_kv_heads={self.num_kv_heads}"
            )
        group = self.num_q_heads // self.num_kv_heads
        splits = num_splits(batch, self.num_kv_heads, self.target_programs)
        per_group, groups = merge_groups(splits, self.merge_group)
        out = torch.empty_like(q)
        layout = self._layout
        options = launch_options(q.device)
        _split_kernel[(batch, self.num_kv_heads, splits)](
            q, k_cache, v_cache, layout, layout[batch + 1 :], layout[2 * batch + 1 :], self._acc, self._ml,
            out, self._head_counts, self._group_counts, self.scale * _LOG2E, self.window,
            q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), out.stride(0), out.stride(1),
            GROUP=group, BLOCK_G=max(16, triton.next_power_of_2(group)), HEAD_DIM=self.head_dim,
            PAGE_SIZE=self.page_size, BLOCK_N=self.block_n, SPLITS=splits, MIN_CHUNK=self.min_chunk,
            DOT_F32=_INTERPRETER, FOLD_MERGE=self.fold_merge, MERGE_G=triton.next_power_of_2(group),
            MERGE_GROUP=per_group, NUM_GROUPS=groups, GROUP_CHUNK=merge_chunk(group, self.head_dim, per_group),
            TOP_CHUNK=merge_chunk(group, self.head_dim, groups),
            num_warps=self.num_warps, num_stages=self.num_stages, **options,
        )  # fmt: skip
        if self.fold_merge:
            return out
        _merge_kernel[(batch, self.num_q_heads)](
            self._acc, self._ml, out, layout, layout[batch + 1 :], self.window, out.stride(0), out.stride(1),
            HEAD_DIM=self.head_dim, PAGE_SIZE=self.page_size, SPLITS=splits, MIN_CHUNK=self.min_chunk, num_warps=min(8, max(2, self.head_dim * splits // 1024)), **options,
        )  # fmt: skip
        return out


def _block_n(head_dim: int) -> int:
    """Tokens per tile: 64 (32 at head dim 256, where a K tile is already 16 KB)."""
    return 32 if head_dim > 128 else 64
