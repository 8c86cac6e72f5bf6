"""Greedy argmax of a small batch of float32 logits in one Triton launch.

Why: outside the decode CUDA graph, ``torch.argmax`` over ``[B, V]`` float32 logits runs as a
memset plus a reduce kernel (Qwen3-30B-A3B batch 1 on the H200, V = 151936: 7.9 us of reduce,
each launch with an idle gap before it; ``benchmarks/dev/step_timeline.py``). :func:`greedy_argmax`
does the same in one launch and no memset; the sampler's greedy rows use it for CUDA float32
logits of at most :data:`MAX_ROWS` rows while :data:`ENABLED`
(:mod:`flotilla.cluster.engine.sampler`).

How: grid ``(B, P)``; program ``(b, p)`` reads the ``p``-th chunk of row ``b`` and reduces it to
one int64 key with one integer max:

- the high 32 bits are the float's order-preserving bits (as a signed int32: a non-negative
  float keeps its bits, a negative one flips its magnitude bits, so integer order is float
  order), with ``-0.0`` mapped to ``+0.0``'s key (torch treats them equal) and every NaN to
  the largest key (``torch.argmax`` returns the first NaN);
- the low 32 bits are ``V - 1 - index``, so among equal values the lowest index has the
  largest key (torch's tie rule; an all ``-inf`` row gives index 0).

The program stores its key in a scratch row of ``P`` keys and counts in on the row's int32
counter; the last of the row's ``P`` programs to count in reduces the ``P`` keys, writes
``V - 1 - low bits`` as the row's int64 index and sets the counter back to 0. The counters
are zeroed once per (device, batch, parts) (:func:`_scratch`), as ``triton_moe``'s tile
counters, and are back at zero after every call; calls run in stream order.

Memory ordering (the invariant; Triton's interpreter runs programs one at a time, so CPU tests
check the keys and the counting, not this):

- the program's key is stored before the barrier; one thread then runs the scalar ``acq_rel``
  atomic at GPU scope, whose release is cumulative over what the barrier ordered before it;
- the last program's atomic acquires every earlier release on that counter (one release
  sequence of read-modify-writes); Triton broadcasts the atomic's result to the other threads
  through shared memory behind a barrier, so their loads come after the acquire, and they
  are ``.cg`` (L2, the coherence point), so no stale L1 line is read;
- the reset is a plain store: no program of this launch touches the counter after the
  ``P``-th increment, and the next launch that does runs after this one completes (stream
  order: this kernel is not a programmatic dependent launch).

Importing this module imports Triton: the sampler imports it only for CUDA logits.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

ENABLED = True
"""Whether the sampler's greedy rows use :func:`greedy_argmax` (False: ``torch.argmax``, for a
side-by-side measurement)."""

MAX_ROWS = 8
"""The most rows the sampler hands to :func:`greedy_argmax` (its launch shape is chosen for
small decode batches; larger batches keep ``torch.argmax``)."""

# NOTE: launch shape. One program reduces ITERS * BLOCK values (BLOCK = 1024 floats: 4 warps,
# two 16-byte loads a thread per block, the ITERS blocks unrolled so their loads go out
# together). ITERS is the smallest count giving each row at most TARGET_PROGRAMS // B programs,
# so a call runs ~130-190 programs for B <= 8 at V ~ 150k (B = 1: 149 programs of one block;
# B = 8: 22 a row of 7 blocks, 176 in all): about one program per SM of an H200 (132 SMs), all
# resident at once, each with a few 4-28 KB of loads in flight. Many more programs would
# only add atomics on the row counter and keys for the last program to read; far fewer leave
# SMs idle and make each program's loads longer. Small V gets fewer programs (V = 32000,
# B = 1: 32); ITERS stops at MAX_ITERS, so large B * V gets more (B = 8, V = 262144: 256).
# Measured on an H200 (the argmax probe, removed in 004bdbd, V = 151936, one call inside a CUDA graph):
# 2.7 / 3.1 / 3.6 / 5.1 us at B = 1 / 2 / 4 / 8, against torch.argmax's 8.3-10.3 us.
BLOCK = 1024
TARGET_PROGRAMS = 192
MAX_ITERS = 8
NUM_WARPS = 4

_INTERPRETER = os.environ.get("TRITON_INTERPRET") == "1"
_MAX_VOCAB = 2**31 - 1  # indices live in the key's low 32 bits as a non-negative int32


@triton.jit
def _chunk_key(row_ptr, V, start, ITERS: tl.constexpr, BLOCK: tl.constexpr):
    """The largest key over ``row[start : start + ITERS * BLOCK]`` (positions past ``V`` give
    the smallest int64, below any real key)."""
    offs = tl.arange(0, BLOCK)
    best = tl.full((BLOCK,), -2147483648, tl.int32).to(tl.int64) << 32
    for i in tl.static_range(ITERS):  # NOTE: unrolled: the ITERS loads go out together
        idx = start + i * BLOCK + offs
        ok = idx < V
        bits = tl.load(row_ptr + idx, mask=ok, other=0.0).to(tl.int32, bitcast=True)
        bits = tl.where(bits == -2147483648, 0, bits)  # -0.0 -> +0.0: torch treats them equal
        high = bits ^ ((bits >> 31) & 0x7FFFFFFF)  # negative floats: flip the magnitude bits
        high = tl.where((bits & 0x7FFFFFFF) > 0x7F800000, 0x7FFFFFFF, high)  # NaN: the largest key
        high = tl.where(ok, high, -2147483648)
        low = tl.where(ok, V - 1 - idx, 0)
        best = tl.maximum(best, (high.to(tl.int64) << 32) | low.to(tl.int64))
    return tl.max(best, axis=0)


@triton.jit
def _argmax_kernel(
    logits_ptr, out_ptr, keys_ptr, count_ptr, V, stride_b,
    ITERS: tl.constexpr, BLOCK: tl.constexpr, P_POW2: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    part = tl.program_id(1)
    parts = tl.num_programs(1)
    row_ptr = logits_ptr + row.to(tl.int64) * stride_b
    key = _chunk_key(row_ptr, V, part * (ITERS * BLOCK), ITERS, BLOCK)
    keys_row = keys_ptr + row * parts
    tl.store(keys_row + part, key)
    tl.debug_barrier()
    arrived = tl.atomic_add(count_ptr + row, 1, sem="acq_rel", scope="gpu")
    if arrived == parts - 1:
        # NOTE: lanes past the row's P keys re-read its last key (no mask, no sentinel).
        slots = tl.minimum(tl.arange(0, P_POW2), parts - 1)
        top = tl.max(tl.load(keys_row + slots, cache_modifier=".cg"), axis=0)
        tl.store(out_ptr + row, (V - 1 - top.to(tl.int32)).to(tl.int64))  # the low 32 bits
        tl.store(count_ptr + row, 0)


# --------------------------------------------------------------------------- host side

# The key scratch and per-row counters, by (device, rows, parts): counters zeroed once here and
# back at zero after every call (the last program of each row resets its counter).
# NOTE: one pair serves every call of that size on a device: two calls must not run at the
# same time on two streams; the sampler runs on one stream.
_SCRATCH: dict[tuple[torch.device, int, int], tuple[torch.Tensor, torch.Tensor]] = {}


def _scratch(device: torch.device, rows: int, parts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(keys[rows * parts] int64, counters[rows] int32 zeroed)`` on ``device``."""
    key = (device, rows, parts)
    pair = _SCRATCH.get(key)
    if pair is None:
        pair = (
            torch.empty(rows * parts, dtype=torch.int64, device=device),
            torch.zeros(rows, dtype=torch.int32, device=device),
        )
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return pair  # NOTE: made inside a capture: the graph owns these (and the zeroing)
        _SCRATCH[key] = pair
    return pair


def launch_shape(rows: int, vocab: int) -> tuple[int, int]:
    """``(iters, parts)`` for ``rows`` rows of ``vocab`` values: each program reduces
    ``iters * BLOCK`` values, each row takes ``parts`` programs (see the note on BLOCK)."""
    per_row = max(1, TARGET_PROGRAMS // rows)
    iters = min(MAX_ITERS, max(1, triton.cdiv(triton.cdiv(vocab, per_row), BLOCK)))
    return iters, triton.cdiv(vocab, iters * BLOCK)


def _check(logits: torch.Tensor) -> None:
    if not isinstance(logits, torch.Tensor):
        raise ValueError(f"logits must be a torch.Tensor, got logits={type(logits).__name__}")
    if logits.dim() != 2:
        raise ValueError(f"logits must be 2-D [B, V], got logits.shape={tuple(logits.shape)}")
    if logits.dtype != torch.float32:
        raise ValueError(f"greedy_argmax takes float32 logits, got logits.dtype={logits.dtype}; use torch.argmax")
    if logits.device.type != "cuda" and not _INTERPRETER:
        raise ValueError(f"greedy_argmax runs on CUDA, got logits.device={logits.device}; use torch.argmax")
    if not 1 <= logits.shape[1] <= _MAX_VOCAB:
        raise ValueError(f"logits.shape[1] (the vocabulary) must be in [1, {_MAX_VOCAB}], got {logits.shape[1]}")


def warm_up(vocab: int, device: torch.device | str) -> list[tuple[int, int]]:
    """Run :func:`greedy_argmax` once at every batch of 1 to :data:`MAX_ROWS` rows of ``vocab``
    values, so that no serving step compiles a variant or allocates scratch; returns the
    distinct launch shapes ``(iters, parts)`` that were compiled (or loaded from Triton's cache).

    Why: ``ITERS`` and the key count are compile-time constants that change with the batch
    (V = 128256: six variants over B = 1..8), and Triton compiles each the first time it runs:
    ~0.1-0.2 s apiece on an H200 box, which an offline run met as one 0.74 s stall when its
    last few requests dropped the batch below 9 rows (docs/benchmarks.md, ninth pass)."""
    shapes = []
    logits = torch.zeros(MAX_ROWS, vocab, dtype=torch.float32, device=device)
    for rows in range(1, MAX_ROWS + 1):
        greedy_argmax(logits[:rows])
        if launch_shape(rows, vocab) not in shapes:
            shapes.append(launch_shape(rows, vocab))
    return shapes


def greedy_argmax(logits: torch.Tensor) -> torch.Tensor:
    """``torch.argmax(logits, dim=-1)`` in one launch, exactly: ties to the lowest index, the
    first NaN of a row wins, ``-0.0`` equals ``+0.0``, an all ``-inf`` row gives 0.

    Args:
        logits: ``[B, V]`` float32 on a CUDA device (any row stride; a row that is not
            contiguous is copied first). Launch shapes are chosen for ``B <= MAX_ROWS``;
            larger batches are correct but not tuned.

    Returns:
        ``[B]`` int64 indices on ``logits``' device, queued on the current stream.

    Raises:
        ValueError: ``logits`` not a 2-D float32 CUDA tensor, or an empty vocabulary.
    """
    _check(logits)
    rows, vocab = logits.shape
    out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    if rows == 0:
        return out
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    iters, parts = launch_shape(rows, vocab)
    keys, counters = _scratch(logits.device, rows, parts)
    _argmax_kernel[(rows, parts)](
        logits, out, keys, counters, vocab, logits.stride(0),
        ITERS=iters, BLOCK=BLOCK, P_POW2=triton.next_power_of_2(parts), num_warps=NUM_WARPS,
    )  # fmt: skip
    return out
