"""The two launch folds of the batch-1 decode step under Triton's CPU interpreter: the MoE
route sum folded into the down kernel (``triton_moe.FOLD_ROUTE_SUM``) and the decode-attention
merge folded into the split kernel (``triton_decode_attention.FOLD_MERGE``), each against the
unfolded launch it replaces and the torch reference, over several calls in a row.

The checks are tests/gpu's (``check_folded_route_sum``, ``check_fold_matches_merge``; their
tolerances are argued there), run with ``device="cpu"``. What this covers: the merge and sum
arithmetic, which program does it (the one that brings the counter to the number of
programs), routes held by another rank still counting, empty splits never counting, the
attention merge's two levels (groups of ``MERGE_GROUP`` splits, then the groups: contexts of
one group, exactly one, one past it, ragged last groups, every split, mixed in one batch), and
the counters back at zero after every call. What it cannot: the interpreter runs one program at a
time, so memory ordering between concurrent programs (the barrier, the ``acq_rel`` atomic, the
``.cg`` loads) is only exercised by the CUDA runs in tests/gpu.

Run (this venv has no Triton; /tmp/tritonsite is where this machine keeps a 3.6 copy):
``PYTHONPATH=/tmp/tritonsite TRITON_INTERPRET=1 pytest tests/kernels/test_triton_folds_interpreted.py``.
Without ``TRITON_INTERPRET=1`` (CI, or a GPU machine) this file is not collected
(tests/conftest.py): the GPU tier runs the same checks on CUDA.
"""

import os

import pytest
import torch

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="needs Triton's CPU interpreter (TRITON_INTERPRET=1)"
)
pytest.importorskip("triton", reason="needs Triton (not a CPU dependency; see the run line above)")

# MoE shapes: (hidden_size, inter, experts, top_k, local); float16, the 3.6 interpreter's
# bf16 tl.dot multiplies raw bits. Qwen3-30B-A3B's H and I with fewer experts (16 column tiles
# of the down kernel, 8 routes), tails of no block size, and an expert map with remote routes.
MOE_SHAPES = {
    "qwen3-h-i": (2048, 768, 16, 8, None),
    "odd-tails": (200, 72, 6, 3, None),
    "ep-remote-routes": (512, 256, 64, 8, 16),
}


@pytest.mark.parametrize("shape", list(MOE_SHAPES))
def test_folded_route_sum_is_bit_identical(shape):
    from gpu.test_triton_moe import check_folded_route_sum

    check_folded_route_sum("cpu", torch.float16, *MOE_SHAPES[shape], calls=3)


def test_folded_route_sum_with_every_route_remote_writes_zeros():
    """All k routes on another rank: every program stores zeros and still counts in, so the
    last one writes a zero row (and resets the counters)."""
    from flotilla.kernels import triton_moe
    from gpu.test_triton_moe import fold_case, run_with_fold, _triton_moe

    x, w13, w2, weights, ids, _ = fold_case("cpu", torch.float16, 256, 128, 8, 2, seed=1)
    expert_map = torch.full((16,), -1, dtype=torch.int64)
    expert_map[:8] = torch.arange(8)
    got = run_with_fold(True, _triton_moe(), x, w13, w2, weights, ids + 8, "silu", expert_map)
    assert torch.equal(got, torch.zeros_like(got))
    assert not triton_moe._TILE_COUNTERS[(got.device, 2)].any()


ATTENTION_CASES = {  # config name, contexts, page size
    "one-token": ("bf16-32/4-d128", [1], 16),
    "one-short": ("bf16-32/4-d128", [37], 1),
    "ragged-8": ("bf16-32/4-d128", [15, 16, 17, 200, 1, 1000, 63, 640], 16),
    "one-9000": ("bf16-32/4-d128", [9000], 16),  # 127 of 128 splits hold tokens: 16 merge chunks
    "two-long-short": ("bf16-32/4-d128", [5000, 1], 16),
    "group-3-d64": ("bf16-9/3-d64", [15, 1, 200, 3000], 1),
    "mha-group-1": ("bf16-8/8-d128", [1, 700], 16),
    "d256": ("bf16-16/2-d256", [1, 300, 2500], 16),  # merge chunks of 4 splits
    "fp16": ("fp16-32/8-d128", [64, 65, 1], 16),
}


@pytest.mark.parametrize("case", list(ATTENTION_CASES))
def test_folded_merge_matches_the_merge_launch(case):
    from gpu.test_triton_decode_attention import CONFIGS, check_fold_matches_merge

    config, seq_lens, page_size = ATTENTION_CASES[case]
    check_fold_matches_merge(CONFIGS[config], seq_lens, page_size, "cpu", calls=3)


@pytest.mark.parametrize("sliding_window", [1, 7, 256])
def test_folded_merge_sliding_window(sliding_window):
    from gpu.test_triton_decode_attention import CONFIGS, check_fold_matches_merge

    check_fold_matches_merge(CONFIGS["bf16-32/4-d128"], [9000, 1, 300, 17], 16, "cpu", sliding_window=sliding_window)


def test_merge_chunk_bounds_the_registers():
    from flotilla.kernels.triton_decode_attention import MERGE_CHUNK_ELEMENTS, merge_chunk

    assert merge_chunk(8, 128, 128) == 8  # Qwen3-30B-A3B: 8 heads x 128 dims x 8 splits
    assert merge_chunk(4, 128, 64) == 8  # capped at 8
    assert merge_chunk(8, 256, 32) == 4
    assert merge_chunk(3, 64, 2) == 2  # no more than the splits
    assert merge_chunk(64, 256, 128) == 1
    for group, dim in [(1, 64), (3, 64), (8, 128), (16, 256)]:
        chunk = merge_chunk(group, dim, 128)
        loaded = chunk * 2 ** (group - 1).bit_length() * dim  # float32 partials per chunk (heads padded)
        assert chunk & (chunk - 1) == 0 and (chunk == 1 or loaded <= MERGE_CHUNK_ELEMENTS), (group, dim, chunk)


# The folded merge's groups under the module's MERGE_GROUP, in small shapes (the interpreter
# takes ~0.04 s a program): 8 query heads on 2 KV heads of 64 dims, 1-token slices
# (min_chunk=1) and ``splits`` (MAX_SPLITS unless said) splits per (sequence, KV head) at any
# batch, so a context of n <= splits tokens fills exactly n splits.
SMALL = (8, 2, 64, torch.bfloat16)


def _many_splits(batch, splits=None):
    from flotilla.kernels.triton_decode_attention import MAX_SPLITS

    return dict(target_programs=batch * SMALL[1] * (splits or MAX_SPLITS), min_chunk=1)


def _groups(context, tuning, batch, window=None):
    """Split groups that hold tokens for one context of a batch under ``tuning`` (the host
    mirror of ``_context_slices``)."""
    from flotilla.kernels.triton_decode_attention import MERGE_GROUP, num_splits

    splits = num_splits(batch, SMALL[1], tuning["target_programs"])
    tokens = min(context, window or context)
    active = -(-tokens // -(-tokens // splits))
    return -(-active // tuning.get("merge_group", MERGE_GROUP))


def _group_cases():
    from flotilla.kernels.triton_decode_attention import MAX_SPLITS, MERGE_GROUP

    return {  # name: contexts, split groups holding tokens per sequence
        "one-group": ([MERGE_GROUP - 1], [1]),
        "exactly-one-group": ([MERGE_GROUP], [1]),
        "one-past-a-group": ([MERGE_GROUP + 1], [2]),  # the second group holds one split
        "ragged-last-group": ([3 * MERGE_GROUP + 5], [4]),
        "every-split": ([MAX_SPLITS], [MAX_SPLITS // MERGE_GROUP]),
        # one level and two in one launch: 200 tokens in 2-token slices fill 100 splits
        "mixed-batch": ([2, 200, MERGE_GROUP + 1], [1, -(-100 // MERGE_GROUP), 2]),
    }


@pytest.mark.parametrize("case", ["one-group", "exactly-one-group", "one-past-a-group", "ragged-last-group",
                                  "every-split", "mixed-batch"])  # fmt: skip
def test_folded_merge_groups(case):
    from gpu.test_triton_decode_attention import check_fold_matches_merge

    contexts, groups = _group_cases()[case]
    tuning = _many_splits(len(contexts))
    assert [_groups(n, tuning, len(contexts)) for n in contexts] == groups
    check_fold_matches_merge(SMALL, contexts, 16, "cpu", calls=3, tuning=tuning)


@pytest.mark.parametrize("merge_group", [1, 4, 128])
def test_folded_merge_group_sizes(merge_group):
    """Groups of one split (level 2 merges every split's partial as a group), of a few (the
    last ragged), and of every split (one level, one merger per KV head), over 32 splits."""
    from gpu.test_triton_decode_attention import check_fold_matches_merge

    contexts = [2, 30, 17]
    tuning = {**_many_splits(3, splits=32), "merge_group": merge_group}
    assert [_groups(n, tuning, 3) for n in contexts] == [-(-n // merge_group) for n in contexts]
    check_fold_matches_merge(SMALL, contexts, 16, "cpu", calls=2, tuning=tuning)


@pytest.mark.parametrize("sliding_window", [17, 40])
def test_folded_merge_groups_sliding_window(sliding_window):
    """The window leaves 17 or 40 tokens of the long contexts, in 1-token splits (with
    MERGE_GROUP 16: two groups, the second of one split, or three, the last ragged); the short
    one stays at one level."""
    from flotilla.kernels.triton_decode_attention import MERGE_GROUP
    from gpu.test_triton_decode_attention import check_fold_matches_merge

    contexts, tuning = [1000, 5, 300], _many_splits(3)
    long = -(-sliding_window // MERGE_GROUP)
    assert [_groups(n, tuning, 3, sliding_window) for n in contexts] == [long, 1, long]
    check_fold_matches_merge(SMALL, contexts, 16, "cpu", sliding_window=sliding_window, calls=2, tuning=tuning)


def test_folded_merge_groups_float8_cache():
    from gpu.test_triton_decode_attention import check_fold_matches_merge

    check_fold_matches_merge(SMALL, [2, 40, 17], 16, "cpu", kv_dtype=torch.float8_e4m3fn, calls=2,
                             tuning=_many_splits(3))  # fmt: skip


def test_merge_groups_and_counters_fit_every_batch():
    """The group split is (min(merge_group, S), S // that); the counters sized at construction
    (for batch 1's splits) hold every batch's (seq, KV head) and (seq, KV head, group) counters."""
    from flotilla.kernels.triton_decode_attention import TritonDecode, merge_groups, num_splits

    assert merge_groups(128, 16) == (16, 8)
    assert merge_groups(8, 16) == (8, 1)
    assert merge_groups(128, 1) == (1, 128)
    for heads, kv_heads, max_batch, merge_group in [(32, 4, 8, 16), (32, 8, 8, 4), (8, 8, 3, 1), (9, 3, 2, 256)]:
        decode = TritonDecode(heads, kv_heads, 64, page_size=16, scale=0.125, sliding_window=None,
                              max_batch=max_batch, max_num_pages=4, device="cpu", merge_group=merge_group)  # fmt: skip
        assert decode._head_counts.numel() == max_batch * kv_heads
        for batch in range(1, max_batch + 1):
            groups = merge_groups(num_splits(batch, kv_heads), merge_group)[1]
            assert batch * kv_heads * groups <= decode._group_counts.numel(), (heads, kv_heads, batch)


@pytest.mark.parametrize("merge_group", [0, 3, 12])
def test_merge_group_must_be_a_power_of_two(merge_group):
    from flotilla.kernels.triton_decode_attention import TritonDecode

    with pytest.raises(ValueError, match=f"merge_group={merge_group}"):
        TritonDecode(32, 4, 128, page_size=16, scale=0.1, sliding_window=None, max_batch=1, max_num_pages=4,
                     device="cpu", merge_group=merge_group)  # fmt: skip
