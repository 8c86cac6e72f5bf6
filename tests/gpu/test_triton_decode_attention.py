"""The Triton small-batch decode attention (kernels/triton_decode_attention.py) against the torch
reference (kernels/attention.py, in float32 on the same inputs), on a CUDA GPU: GQA groups 1, 3,
4 and 8, head dims 64, 128 and 256, pages of 1 and 16 tokens, batches of one short, one
long and eight ragged contexts (a one-token context, contexts ending at a full page, one past
it), a sliding window, float8 caches, re-planning between runs of one captured CUDA graph,
and the flashinfer planner handing small decode batches to it. The merge folded into the
split kernel (the default, ``FOLD_MERGE``) against the merge launch: the same inputs called
three times in a row with new queries (its counters must come back to zero), one-token and
long contexts (up to every one of the 128 splits holding tokens: 8 groups of ``MERGE_GROUP``
splits, merged in two levels), short and long contexts in one batch, group boundaries in
1-token slices (one split short of a group, a full group, one past it, a ragged last group,
every split), groups of 1 to 128 splits, sliding windows, and CUDA graph replays at batch 1
and 3 with the counters checked after each.

Run on a GPU machine: ``FLOTILLA_GPU_TESTS=1 pytest tests/gpu/test_triton_decode_attention.py``.
The check helpers take a ``device`` so that the same checks run under Triton's CPU
interpreter (``TRITON_INTERPRET=1``, bf16 only).

Tolerances: as tests/gpu/test_flashinfer_attention.py argues for flashinfer (the same
numerics): q.k accumulates in float32 from identical inputs, the probabilities are rounded to
the input dtype for the P.V product and the output once, each rounding <= 2^-9 relative in
bf16 (2^-11 in fp16) on outputs of |out| <~ 3: atol 1.5e-2 / 3e-3 with rtol of the same order,
while a wrong page, mask, window or split merge is off by O(0.1-1).

Folded against unfolded merge: identical partials, merged in float32 in another order (the
fold sums the splits' outputs in chunks and, past one group, per group and then over the
groups, each group rescaled twice), so the outputs differ by float32 rounding (~1e-6 here)
carried through the final rounding: at most one output ulp (``rtol`` 2^-7 in bf16,
2^-10 in fp16) or ``FOLD_ATOL`` absolute near zero; a missed or doubled split, a wrong head
or a stale partial is off by O(0.01-1).

The interpreter (tests/kernels/test_triton_folds_interpreted.py runs the fold checks with
``device="cpu"``) runs one program at a time: it checks the merge arithmetic and the counting
(which program merges, counters back at zero), not the memory ordering between concurrent
programs, which only the CUDA runs exercise.
"""

from __future__ import annotations

import math

import pytest
import torch

from flotilla.kernels.attention import AttentionShape, write_kv
from flotilla.kernels.attention import paged_attention as torch_paged_attention
from flotilla.kernels.kv_dtype import storage_view, to_cache_dtype
from gpu.paged_steps import build_step, random_blocks

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
pytest.importorskip("triton")

TOLERANCE = {torch.bfloat16: (1.5e-2, 1e-2), torch.float16: (3e-3, 3e-3)}
FOLD_RTOL = {torch.bfloat16: 2**-7, torch.float16: 2**-10}
FOLD_ATOL = 1e-5

# (num_q_heads, num_kv_heads, head_dim, dtype)
CONFIGS = {
    "bf16-32/8-d128": (32, 8, 128, torch.bfloat16),  # Llama-3.1-8B
    "bf16-32/4-d128": (32, 4, 128, torch.bfloat16),  # Qwen3-30B-A3B
    "bf16-8/8-d128": (8, 8, 128, torch.bfloat16),  # MHA
    "bf16-9/3-d64": (9, 3, 64, torch.bfloat16),
    "bf16-16/2-d256": (16, 2, 256, torch.bfloat16),
    "fp16-32/8-d128": (32, 8, 128, torch.float16),
}
# Context lengths (after this step) of the sequences of one decode step.
BATCHES = {
    "one-short": [37],
    "one-long": [4000],
    "ragged-8": [15, 16, 17, 200, 1, 1000, 63, 640],
}
# Contexts for the folded merge on top of BATCHES: one token, and long ones (at batch 1 a
# 4-KV-head layout has 128 splits of >= 64 tokens: 9000 tokens fill 127 of them, 8192 all).
FOLD_BATCHES = {
    **BATCHES,
    "one-token": [1],
    "one-8192": [8192],
    "one-9000": [9000],
    "two-long-short": [5000, 1],
    "four-mixed": [8192, 1, 3000, 700],  # 32 splits at 4 KV heads: two merge groups, one, two, one
}


def decode_case(config, seq_lens, page_size, device, generator, kv_dtype=None, sliding_window=None, fold_merge=None,
                tuning=None):  # fmt: skip
    """Caches with random contexts, the step's metadata, the queries, the new K/V written, and
    the float32 reference output; the TritonDecode planned for the step (``fold_merge``: its
    argument, None for the module default; ``tuning``: more keyword arguments, e.g.
    ``target_programs``, ``min_chunk``, ``merge_group``)."""
    from flotilla.kernels.triton_decode_attention import TritonDecode

    hq, hkv, d, dtype = config
    num_blocks = sum(-(-n // page_size) for n in seq_lens) + 4
    cache_dtype = kv_dtype or dtype
    shape = (num_blocks, page_size, hkv, d)
    k_cache = to_cache_dtype(torch.randn(shape, generator=generator).to(dtype), cache_dtype).to(device)
    v_cache = to_cache_dtype(torch.randn(shape, generator=generator).to(dtype), cache_dtype).to(device)
    blocks = random_blocks(seq_lens, page_size, num_blocks, generator)
    step = build_step([n - 1 for n in seq_lens], [1] * len(seq_lens), page_size, blocks, device=device)
    batch = len(seq_lens)
    q = torch.randn(batch, hq, d, generator=generator).to(dtype).to(device)
    k_new = torch.randn(batch, hkv, d, generator=generator).to(dtype).to(device)
    v_new = torch.randn(batch, hkv, d, generator=generator).to(dtype).to(device)
    write_kv(k_cache, step.meta.slot_mapping, k_new)
    write_kv(v_cache, step.meta.slot_mapping, v_new)
    scale = 1 / math.sqrt(d)
    reference = reference_output(q, k_cache, v_cache, step.meta, scale, sliding_window)
    decode = TritonDecode(
        hq, hkv, d, page_size=page_size, scale=scale, sliding_window=sliding_window, max_batch=max(8, batch),
        max_num_pages=num_blocks, device=device, fold_merge=fold_merge, **(tuning or {}),
    )  # fmt: skip
    decode.plan(step.meta.page_indptr, step.meta.page_indices, step.meta.last_page_len)
    return decode, q, (k_cache, v_cache), reference, step


def reference_output(q, k_cache, v_cache, meta, scale, sliding_window):
    """The torch reference in float32 on the same (stored) values; the caches are not changed."""
    widen = lambda cache: storage_view(cache).clone().view(cache.dtype).float()  # noqa: E731
    k32, v32 = widen(k_cache), widen(v_cache)
    flat_k = k32.view(-1, *k32.shape[2:])[meta.slot_mapping]
    flat_v = v32.view(-1, *v32.shape[2:])[meta.slot_mapping]
    return torch_paged_attention(q.float(), flat_k, flat_v, k32, v32, meta, scale, sliding_window)


def check_case(config, seq_lens, page_size, device, seed=0, kv_dtype=None, sliding_window=None):
    generator = torch.Generator().manual_seed(seed)
    decode, q, caches, reference, _ = decode_case(config, seq_lens, page_size, device, generator, kv_dtype, sliding_window)
    out = decode.run(q, caches)
    assert out.dtype == q.dtype and out.shape == q.shape
    atol, rtol = TOLERANCE[config[3]]
    torch.testing.assert_close(out.float().cpu(), reference.cpu(), atol=atol, rtol=rtol)


def check_fold_matches_merge(config, seq_lens, page_size, device, seed=0, kv_dtype=None, sliding_window=None, calls=3,
                             tuning=None):  # fmt: skip
    """One step run ``calls`` times, each with new queries, by a TritonDecode that folds the
    merge and by one that launches it (both with ``tuning``, see ``decode_case``): the folded
    output matches the merge kernel's (see the module docstring) and the float32 reference,
    and every counter is 0 after each call."""
    case = (config, seq_lens, page_size, device)
    folded, q, caches, reference, step = decode_case(*case, torch.Generator().manual_seed(seed), kv_dtype,
                                                     sliding_window, fold_merge=True, tuning=tuning)  # fmt: skip
    unfolded = decode_case(*case, torch.Generator().manual_seed(seed), kv_dtype, sliding_window, fold_merge=False,
                           tuning=tuning)[0]  # fmt: skip
    assert folded.fold_merge and not unfolded.fold_merge
    dtype = config[3]
    generator = torch.Generator().manual_seed(seed + 1)
    for call in range(calls):
        if call:
            q = torch.randn(q.shape, generator=generator).to(dtype).to(device)
            reference = reference_output(q, *caches, step.meta, folded.scale, sliding_window)
        got = folded.run(q, caches)
        label = f"call {call}, contexts {seq_lens}, page {page_size}, window {sliding_window}"
        assert not folded._merge_counts.any(), f"{label}: counters left at {folded._merge_counts.tolist()}"
        explain = lambda m: f"{label}: {m}"  # noqa: E731
        torch.testing.assert_close(got, unfolded.run(q, caches), atol=FOLD_ATOL, rtol=FOLD_RTOL[dtype], msg=explain)
        atol, rtol = TOLERANCE[dtype]
        torch.testing.assert_close(got.float().cpu(), reference.cpu(), atol=atol, rtol=rtol, msg=explain)


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("batch", list(BATCHES))
@pytest.mark.parametrize("config", list(CONFIGS))
def test_decode_matches_reference(config, batch, page_size):
    check_case(CONFIGS[config], BATCHES[batch], page_size, "cuda")


@pytest.mark.parametrize("sliding_window", [1, 7, 256])
def test_sliding_window(sliding_window):
    check_case(CONFIGS["bf16-32/8-d128"], BATCHES["ragged-8"], 16, "cuda", sliding_window=sliding_window)


@pytest.mark.parametrize("kv_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("config", ["bf16-32/8-d128", "bf16-32/4-d128"])
def test_float8_cache(config, kv_dtype):
    check_case(CONFIGS[config], BATCHES["ragged-8"], 1, "cuda", kv_dtype=kv_dtype)


@pytest.mark.parametrize("batch", list(FOLD_BATCHES))
@pytest.mark.parametrize("config", list(CONFIGS))
def test_folded_merge_matches_the_merge_launch(config, batch):
    check_fold_matches_merge(CONFIGS[config], FOLD_BATCHES[batch], 16, "cuda")


def many_splits(batch, num_kv_heads):
    """Tuning for 1-token slices and MAX_SPLITS splits per (sequence, KV head): a context of
    n <= MAX_SPLITS tokens fills exactly n splits."""
    from flotilla.kernels.triton_decode_attention import MAX_SPLITS

    return dict(target_programs=batch * num_kv_heads * MAX_SPLITS, min_chunk=1)


def group_boundaries():
    """Contexts at the folded merge's group boundaries under 1-token slices."""
    from flotilla.kernels.triton_decode_attention import MAX_SPLITS, MERGE_GROUP

    return {
        "one-short-of-a-group": [MERGE_GROUP - 1],
        "one-group": [MERGE_GROUP],
        "one-past-a-group": [MERGE_GROUP + 1],
        "ragged-last-group": [3 * MERGE_GROUP + 5],
        "every-split": [MAX_SPLITS],
        "mixed": [2, 200, MERGE_GROUP + 1, MAX_SPLITS],
    }


@pytest.mark.parametrize("case", list(group_boundaries()))
@pytest.mark.parametrize("config", ["bf16-32/4-d128", "bf16-9/3-d64", "bf16-16/2-d256"])
def test_folded_merge_group_boundaries(config, case):
    seq_lens = group_boundaries()[case]
    tuning = many_splits(len(seq_lens), CONFIGS[config][1])
    check_fold_matches_merge(CONFIGS[config], seq_lens, 16, "cuda", tuning=tuning)


@pytest.mark.parametrize("merge_group", [1, 2, 4, 8, 32, 128])
@pytest.mark.parametrize("seq_lens", [[8192], [9000, 1, 300, 4000, 17]], ids=["one-8192", "five-mixed"])
def test_folded_merge_group_sizes(seq_lens, merge_group):
    """Groups of one split (level 2 merges every partial), of a few, and of every split (one
    level: the single merger)."""
    check_fold_matches_merge(CONFIGS["bf16-32/4-d128"], seq_lens, 16, "cuda", tuning={"merge_group": merge_group})


@pytest.mark.parametrize("sliding_window", [1, 7, 256, 5000])
@pytest.mark.parametrize("page_size", [1, 16])
def test_folded_merge_sliding_window(page_size, sliding_window):
    check_fold_matches_merge(CONFIGS["bf16-32/4-d128"], [9000, 1, 300, 4000, 17], page_size, "cuda",
                             sliding_window=sliding_window)  # fmt: skip


def test_folded_merge_float8_cache():
    check_fold_matches_merge(CONFIGS["bf16-32/8-d128"], BATCHES["ragged-8"], 16, "cuda", kv_dtype=torch.float8_e4m3fn)


GRAPH_STEPS = {  # contexts of the steps one graph replays
    "batch-3": ([5, 300, 2000], [2100, 1, 17], [64, 64, 65], [9000, 8192, 1]),
    "batch-1": ([9000], [1], [8192], [700], [2100]),
}
GRAPH_MERGES = {  # TritonDecode arguments
    "fold": dict(fold_merge=True),
    "fold-groups-of-2": dict(fold_merge=True, merge_group=2),
    "merge-launch": dict(fold_merge=False),
}


@pytest.mark.parametrize("merge", list(GRAPH_MERGES))
@pytest.mark.parametrize("steps", list(GRAPH_STEPS))
def test_graph_replays_follow_each_plan(steps, merge):
    """One graph captured at batch 3 (or 1) replays different steps of that batch (up to 9000
    tokens: every split in use, at batch 1 eight groups of the folded merge, 64 of 2-split
    groups), re-planned (outside the graph) before each, each step twice into a zeroed output:
    each replay matches its own reference, and every counter of the folded merge is back at 0
    after each replay."""
    generator = torch.Generator().manual_seed(7)
    config = CONFIGS["bf16-32/4-d128"]
    cases = [decode_case(config, lens, 1, "cuda", generator) for lens in GRAPH_STEPS[steps]]
    decode, q, caches, _, _ = cases[0]
    q_static = q.clone()
    k_all = torch.cat([c[2][0] for c in cases])  # one cache holding every case's blocks, offset per case
    v_all = torch.cat([c[2][1] for c in cases])
    offsets = [0]
    for c in cases[:-1]:
        offsets.append(offsets[-1] + c[2][0].shape[0])
    decode = type(decode)(32, 4, 128, page_size=1, scale=1 / math.sqrt(128), sliding_window=None, max_batch=8,
                          max_num_pages=k_all.shape[0], device="cuda", **GRAPH_MERGES[merge])  # fmt: skip
    meta = cases[0][4].meta
    decode.plan(meta.page_indptr, meta.page_indices + offsets[0], meta.last_page_len)
    decode.run(q_static, (k_all, v_all))  # compile outside capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out_static = decode.run(q_static, (k_all, v_all))
    for (_, q, _, reference, step), offset in zip(cases, offsets):
        decode.plan(step.meta.page_indptr, step.meta.page_indices + offset, step.meta.last_page_len)
        q_static.copy_(q)
        for _ in range(2):
            out_static.zero_()
            graph.replay()
            torch.cuda.synchronize()
            assert not decode._merge_counts.any(), f"counters left at {decode._merge_counts.tolist()}"
            torch.testing.assert_close(out_static.float().cpu(), reference.cpu(), atol=1.5e-2, rtol=1e-2)


def test_flashinfer_planner_hands_small_decodes_to_triton():
    """The flashinfer planner plans a decode of <= MAX_BATCH sequences (eager and graph-padded)
    on TritonDecode and a larger one, or a prefill, on flashinfer; outputs match the reference."""
    from flotilla.kernels import triton_decode_attention
    from flotilla.kernels.registry import get

    hq, hkv, d, dtype = CONFIGS["bf16-32/8-d128"]
    shape = AttentionShape(hq, hkv, d, d, 1 / math.sqrt(d), None, dtype)
    limit = triton_decode_attention.MAX_BATCH
    planner = get("attention_planner", "flashinfer")(
        shape, "cuda", block_size=16, max_num_seqs=64, max_num_pages=4096, graph_batch_sizes=(limit, limit * 2)
    )
    generator = torch.Generator().manual_seed(3)
    attention = get("paged_attention", "flashinfer")
    for batch, graph_size, kind in ((limit, None, "triton-decode"), (limit - 1, limit, "triton-graph-decode"),
                                    (limit + 1, None, "decode"), (limit + 1, limit * 2, "graph-decode")):  # fmt: skip
        seq_lens = [int(x) for x in torch.randint(1, 3000, (batch,), generator=generator)]
        _, q, caches, reference, step = decode_case((hq, hkv, d, dtype), seq_lens, 16, "cuda", generator)
        planner.plan(step.meta, graph_batch_size=graph_size)
        assert step.meta.plan.kind == kind
        if graph_size is not None:
            q = torch.cat([q, q.new_zeros(graph_size - batch, hq, d)])
            step.meta.slot_mapping = torch.cat([step.meta.slot_mapping, step.meta.slot_mapping.new_zeros(graph_size - batch)])
        out = attention(q, None, None, *caches, step.meta, shape.scale)[:batch]
        torch.testing.assert_close(out.float().cpu(), reference.cpu(), atol=1.5e-2, rtol=1e-2)
