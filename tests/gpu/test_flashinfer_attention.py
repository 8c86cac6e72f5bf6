"""flashinfer paged attention (kernels/flashinfer_attention.py) against the torch reference
(kernels/attention.py, run in float32 on the same bf16/fp16 inputs) on a CUDA GPU:
prefill chunks after a cached prefix mixed with decodes (after them, and before them: the
leading decodes then run on the decode kernel), pure decode (last block full,
partial, one token), one long prefill and one long decode (split-KV), GQA groups 1/3/4/8,
head dims 64/128, blocks of 16 and 32, a sliding window, plans reused by two layers, and
CUDA-graph decode replays (re-planned between replays, two graph sizes sharing buffers)
against eager flashinfer and the reference. Decode steps of at most
``triton_decode_attention.MAX_BATCH`` sequences are planned on the Triton split-KV kernel by
default; every decode case runs both on it and with it turned off (flashinfer's kernels).

Float8 caches (``AttentionShape.kv_dtype``: e4m3fn over the whole bf16 grid and the graph
decodes, e5m2 on the head-dim-128 configs): the caches hold random float8 values, the new K/V
are stored rounded (``to_cache_dtype``), and the reference reads the same float8 values in
float32. flashinfer widens each float8 value to bf16 exactly before its MMAs (every e4m3 and
e5m2 value is a bf16 value), so the kernels see the same numbers as in the bf16 case and the
bf16 tolerance holds unchanged. The float8 prefill runs on FA2 (FA3 takes float8 caches only
with float8 queries), checked through the planner.

Run on a GPU machine: ``FLOTILLA_GPU_TESTS=1 pytest tests/gpu/test_flashinfer_attention.py``.
The first use of each (dtype, head dim, window) compiles flashinfer kernels (~1-1.5 min
each; cached in ~/.cache/flashinfer), so the grid keeps the variants few: bf16 for most
cases, fp16 only at head dim 128 with one KV head per query head.

Tolerances: both sides read identical bf16/fp16 inputs and accumulate q.k in float32, so
the logits agree to ~1e-6; flashinfer then rounds the probabilities to the input dtype
for the P.V product and the output to the input dtype. Outputs are convex combinations of
N(0,1) values (|out| <~ 3), so each rounding costs <= 2^-9 relative in bf16 (about 4e-3
absolute at |out| ~ 2) and 2^-11 in fp16: atol 1.5e-2 (bf16) / 3e-3 (fp16) plus rtol of
the same order leaves ~2x margin over the worst case, while a wrong mask, window or page
is off by O(0.1-1).
"""

from __future__ import annotations

import math

import pytest
import torch

from flotilla.kernels.attention import AttentionMetadata, AttentionShape
from flotilla.kernels.attention import paged_attention as torch_paged_attention
from flotilla.kernels.kv_dtype import storage_view, to_cache_dtype
from gpu.paged_steps import Step, build_step, decode_kind, planner_for, random_blocks

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.timeout(1800),  # first uses JIT-compile flashinfer kernels
]

TOLERANCE = {torch.bfloat16: (1.5e-2, 1e-2), torch.float16: (3e-3, 3e-3)}
SCRATCH_BLOCK = 0  # never handed to a sequence: padding rows of graph batches write and read it

# (cached_lens, new_lens) per sequence of one step.
BATCHES = {
    # a prefill chunk after a cached prefix, a fresh prompt, a long chunk, three decodes
    "mixed": ([37, 0, 300, 15, 100, 0], [45, 17, 129, 1, 1, 1]),
    # the scheduler's order: three decodes (to the decode kernel, kind "mixed"), prefill
    # chunks, and a decode after them (left to the prefill kernel)
    "decodes-first": ([200, 15, 1000, 37, 0, 300, 63], [1, 1, 1, 45, 17, 129, 1]),
    # decodes whose contexts end at a full block, one past it, mid-block, a 1-token prompt
    "decode": ([15, 16, 31, 200, 0, 1000, 63], [1, 1, 1, 1, 1, 1, 1]),
    "long-prefill": ([0], [1500]),
    "long-decode": ([4000], [1]),
}

# (num_q_heads, num_kv_heads, head_dim, dtype): groups 4 and 8 decode on tensor cores.
CONFIGS = {
    "bf16-32/8-d128": (32, 8, 128, torch.bfloat16),
    "bf16-32/4-d128": (32, 4, 128, torch.bfloat16),
    "bf16-8/8-d128": (8, 8, 128, torch.bfloat16),
    "bf16-9/3-d64": (9, 3, 64, torch.bfloat16),
}


def blocks_needed(batch, block_size) -> int:
    return sum(-(-(c + n) // block_size) for c, n in zip(*batch))


def flashinfer_paged_attention():
    from flotilla.kernels.registry import get

    return get("paged_attention", "flashinfer")


def make_shape(num_q_heads, num_kv_heads, head_dim, dtype, sliding_window=None, kv_dtype=None) -> AttentionShape:
    return AttentionShape(
        num_q_heads, num_kv_heads, head_dim, head_dim, 1 / math.sqrt(head_dim), sliding_window, dtype, kv_dtype=kv_dtype
    )


def random_caches(shape: AttentionShape, num_blocks, block_size, generator):
    """K/V caches of N(0,1) values everywhere, in the shape's cache dtype: unwritten slots (a
    cached prefix's context, or garbage never to be read) are random too."""
    size = (num_blocks, block_size, shape.num_kv_heads, shape.head_dim)
    return tuple(
        to_cache_dtype(torch.randn(size, generator=generator, device="cuda").to(shape.dtype), shape.cache_dtype)
        for _ in range(2)
    )


def stored(x: torch.Tensor, shape: AttentionShape) -> torch.Tensor:
    """New keys or values as the cache holds them (float8: rounded and saturated)."""
    return to_cache_dtype(x, shape.cache_dtype)


def written_at(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """The bytes of the cache rows at ``slots`` (float8 as uint8)."""
    return storage_view(cache).view(-1, *cache.shape[2:]).index_select(0, slots)


def random_qkv(shape: AttentionShape, num_tokens, generator):
    q = torch.randn(num_tokens, shape.num_q_heads, shape.head_dim, generator=generator, device="cuda")
    k = torch.randn(num_tokens, shape.num_kv_heads, shape.head_dim, generator=generator, device="cuda")
    v = torch.randn(num_tokens, shape.num_kv_heads, shape.head_dim, generator=generator, device="cuda")
    return q.to(shape.dtype), k.to(shape.dtype), v.to(shape.dtype)


def reference(q, k, v, k_cache, v_cache, meta, shape) -> torch.Tensor:
    """The torch reference in float32 on copies of the caches (same inputs; the new K/V as
    the cache stores them)."""
    k, v = stored(k, shape).float(), stored(v, shape).float()
    return torch_paged_attention(q.float(), k, v, k_cache.float(), v_cache.float(), meta, shape.scale, shape.sliding_window)


def assert_matches(out: torch.Tensor, expected: torch.Tensor, dtype, step: Step | None, what: str) -> None:
    """Elementwise ``|out - expected| <= atol + rtol |expected|``, failing with where and how much."""
    atol, rtol = TOLERANCE[dtype]
    assert out.shape == expected.shape, f"{what}: shape {tuple(out.shape)} != {tuple(expected.shape)}"
    assert torch.isfinite(out).all(), f"{what}: non-finite outputs at {torch.nonzero(~torch.isfinite(out))[:5].tolist()}"
    err = (out.float() - expected).abs()
    bad = err > atol + rtol * expected.abs()
    if bad.any():
        flat = int(err.argmax())
        token, head = divmod(flat // err.shape[-1], err.shape[1])
        where = ""
        if step is not None:
            starts = step.meta.query_start_cpu.tolist()
            seq = max(b for b in range(len(starts) - 1) if starts[b] <= token)
            where = (
                f" (sequence {seq}: cached {step.cached_lens[seq]}, new {step.new_lens[seq]}, "
                f"token {token - starts[seq]} of its chunk)"
            )
        pytest.fail(
            f"{what}: {int(bad.sum())}/{bad.numel()} elements off (atol={atol}, rtol={rtol}); worst "
            f"|err|={err.max().item():.4g} at token {token}, head {head}{where}: got "
            f"{out.flatten()[flat].item():.5g}, expected {expected.flatten()[flat].item():.5g}; "
            f"mean |err|={err.mean().item():.3g}"
        )


def run_case(shape: AttentionShape, batch, block_size, seed=0, layers=1) -> None:
    generator = torch.Generator(device="cuda").manual_seed(seed)
    cpu_generator = torch.Generator().manual_seed(seed)
    cached, new = batch
    num_blocks = blocks_needed(batch, block_size) + 8
    seq_lens = [c + n for c, n in zip(cached, new)]
    step = build_step(cached, new, block_size, random_blocks(seq_lens, block_size, num_blocks, cpu_generator))
    # NOTE: a small decode batch runs the Triton split-KV kernel by default; both kernels are checked.
    for triton_decode in (True, False) if max(new) == 1 else (True,):
        planner = planner_for(shape, block_size, triton_decode=triton_decode)
        planner.plan(step.meta)
        if max(new) == 1:
            expected_kind = decode_kind(len(new), triton_decode)
        else:
            expected_kind = "mixed" if new[0] == 1 else "prefill"
        assert step.meta.plan.kind == expected_kind, f"planned {step.meta.plan.kind}, expected {expected_kind}"
        run_layers(shape, step, num_blocks, block_size, generator, layers)


def run_layers(shape, step, num_blocks, block_size, generator, layers) -> None:
    """Run the planned step on ``layers`` layers' random caches and inputs, each checked."""
    attention = flashinfer_paged_attention()
    # NOTE: one plan, several layers (each its own caches and inputs), as in a forward pass.
    for layer in range(layers):
        k_cache, v_cache = random_caches(shape, num_blocks, block_size, generator)
        q, k, v = random_qkv(shape, step.num_tokens, generator)
        expected = reference(q, k, v, k_cache, v_cache, step.meta, shape)
        out = attention(q, k, v, k_cache, v_cache, step.meta, shape.scale, shape.sliding_window)
        assert out.dtype == shape.dtype
        assert_matches(out, expected, shape.dtype, step, f"layer {layer}")
        written = written_at(k_cache, step.meta.slot_mapping)
        assert torch.equal(written, storage_view(stored(k, shape))), "the new keys were not written at slot_mapping"


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("batch", list(BATCHES))
@pytest.mark.parametrize("config", list(CONFIGS))
def test_bf16_grid_matches_torch_reference(config, batch, block_size):
    shape = make_shape(*CONFIGS[config])
    run_case(shape, BATCHES[batch], block_size, layers=2 if batch in ("mixed", "decodes-first") else 1)


@pytest.mark.parametrize("batch", list(BATCHES))
@pytest.mark.parametrize("config", list(CONFIGS))
def test_fp8_e4m3_cache_matches_torch_reference(config, batch):
    shape = make_shape(*CONFIGS[config], kv_dtype=torch.float8_e4m3fn)
    run_case(shape, BATCHES[batch], 16, layers=2 if batch in ("mixed", "decodes-first") else 1)


@pytest.mark.parametrize("batch", ["mixed", "decodes-first", "decode", "long-decode"])
@pytest.mark.parametrize("config", ["bf16-32/8-d128", "bf16-8/8-d128"])
def test_fp8_e5m2_cache_matches_torch_reference(config, batch):
    run_case(make_shape(*CONFIGS[config], kv_dtype=torch.float8_e5m2), BATCHES[batch], 16)


def test_fp8_cache_planner_prefills_on_fa2_and_other_cache_dtypes_are_refused():
    from flotilla.kernels.registry import get

    planner = get("attention_planner", "flashinfer")
    fp8 = planner(make_shape(32, 8, 128, torch.bfloat16, kv_dtype=torch.float8_e4m3fn), "cuda", block_size=16,
                  max_num_seqs=4, max_num_pages=64)  # fmt: skip
    assert fp8.prefill_backend == "fa2"
    plain = planner(make_shape(32, 8, 128, torch.bfloat16), "cuda", block_size=16, max_num_seqs=4, max_num_pages=64)
    if torch.cuda.get_device_capability()[0] == 9:
        assert plain.prefill_backend == "fa3"
    with pytest.raises(ValueError, match="kv_dtype=torch.bfloat16"):
        planner(make_shape(32, 8, 128, torch.float16, kv_dtype=torch.bfloat16), "cuda", block_size=16, max_num_seqs=4,
                max_num_pages=64)  # fmt: skip
    mla = AttentionShape(16, 1, 576, 512, 0.1, None, torch.bfloat16, kv_lora_rank=512, qk_rope_head_dim=64,
                         kv_dtype=torch.float8_e4m3fn)  # fmt: skip
    with pytest.raises(ValueError, match="latent cache in the model's dtype"):
        planner(mla, "cuda", block_size=16, max_num_seqs=4, max_num_pages=64)


@pytest.mark.parametrize("batch", ["mixed", "decodes-first", "decode"])
def test_fp16_matches_torch_reference(batch):
    run_case(make_shape(8, 8, 128, torch.float16), BATCHES[batch], 16)


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("batch", ["mixed", "decodes-first", "decode", "long-prefill"])
def test_sliding_window_matches_torch_reference(batch, block_size):
    # 37: not a multiple of the block size; most contexts here are longer than the window.
    run_case(make_shape(8, 8, 128, torch.bfloat16, sliding_window=37), BATCHES[batch], block_size)


def test_empty_step_returns_empty_output():
    shape = make_shape(*CONFIGS["bf16-32/8-d128"])
    meta = build_step([3], [1], 16, [[1]]).meta
    empty = AttentionMetadata(
        slot_mapping=meta.slot_mapping[:0],
        query_start=meta.query_start[:1],
        seq_lens=meta.seq_lens[:0],
        block_tables=meta.block_tables[:0],
        max_query_len=0,
        max_seq_len=0,
        block_size=16,
        page_indptr=torch.zeros(1, dtype=torch.int32),
        page_indices=torch.zeros(0, dtype=torch.int32),
        last_page_len=torch.zeros(0, dtype=torch.int32),
        query_start_cpu=torch.zeros(1, dtype=torch.int32),
        seq_lens_cpu=torch.zeros(0, dtype=torch.int32),
    )
    planner_for(shape, 16).plan(empty)
    assert empty.plan is None
    q = torch.zeros(0, 32, 128, dtype=shape.dtype, device="cuda")
    kv = torch.zeros(0, 8, 128, dtype=shape.dtype, device="cuda")
    caches = random_caches(shape, 2, 16, torch.Generator(device="cuda").manual_seed(0))
    out = flashinfer_paged_attention()(q, kv, kv, *caches, empty, shape.scale)
    assert out.shape == (0, 32, 128)


def test_misuse_raises_clear_errors():
    shape = make_shape(*CONFIGS["bf16-32/8-d128"])
    planner = planner_for(shape, 16, graph_batch_sizes=(4,))
    prefill = build_step([0], [5], 16, [[1]]).meta
    with pytest.raises(ValueError, match="pure decode"):
        planner.plan(prefill, graph_batch_size=4)
    with pytest.raises(ValueError, match="graph_batch_size=2"):
        planner.plan(build_step([3], [1], 16, [[1]]).meta, graph_batch_size=2)
    caches = random_caches(shape, 2, 16, torch.Generator(device="cuda").manual_seed(0))
    q, k, v = random_qkv(shape, 5, torch.Generator(device="cuda").manual_seed(0))
    with pytest.raises(ValueError, match="planner.plan"):
        flashinfer_paged_attention()(q, k, v, *caches, prefill, shape.scale)
    planner.plan(prefill)
    with pytest.raises(ValueError, match="sliding_window"):
        flashinfer_paged_attention()(q, k, v, *caches, prefill, shape.scale, sliding_window=8)
    from flotilla.kernels.registry import get

    with pytest.raises(ValueError, match="float32"):
        get("attention_planner", "flashinfer")(
            make_shape(32, 8, 128, torch.float32), "cuda", block_size=16, max_num_seqs=4, max_num_pages=64
        )


# -- CUDA graphs ------------------------------------------------------------------------

GRAPH_SIZES = (4, 8)


def decode_step(num_real: int, size: int, runner_pads: bool, block_size, num_blocks, cpu_generator) -> Step:
    """A decode step of ``num_real`` random-length sequences for a graph of ``size``; with
    ``runner_pads`` the metadata itself holds the padding sequences (one token each, in the
    scratch block), else the planner pads."""
    lens = torch.randint(1, 700, (num_real,), generator=cpu_generator).tolist()
    blocks = random_blocks(lens, block_size, num_blocks, cpu_generator)
    cached, new = [n - 1 for n in lens], [1] * num_real
    if runner_pads:
        pad = size - num_real
        cached, new, blocks = cached + [0] * pad, new + [1] * pad, blocks + [[SCRATCH_BLOCK]] * pad
    return build_step(cached, new, block_size, blocks)


@pytest.mark.parametrize("triton_decode", [True, False], ids=["triton-decode", "flashinfer-decode"])
@pytest.mark.parametrize("kv_dtype", [None, torch.float8_e4m3fn], ids=["bf16-cache", "fp8-cache"])
@pytest.mark.parametrize("runner_pads", [True, False], ids=["runner-pads", "planner-pads"])
@pytest.mark.parametrize("config", ["bf16-32/8-d128", "bf16-9/3-d64"])
def test_cuda_graph_decode_replays_match_eager_and_reference(config, runner_pads, kv_dtype, triton_decode):
    block_size, num_blocks = 16, 8 * 44 + 8
    shape = make_shape(*CONFIGS[config], kv_dtype=kv_dtype)
    planner = planner_for(shape, block_size, graph_batch_sizes=GRAPH_SIZES, max_num_pages=8 * 44, triton_decode=triton_decode)
    attention = flashinfer_paged_attention()
    generator = torch.Generator(device="cuda").manual_seed(1)
    cpu_generator = torch.Generator().manual_seed(1)
    k_cache, v_cache = random_caches(shape, num_blocks, block_size, generator)

    graphs = {}
    for size in GRAPH_SIZES:
        static_q, static_k, static_v = random_qkv(shape, size, generator)
        static_slots = torch.zeros(size, dtype=torch.long, device="cuda")
        step = decode_step(size - 1, size, runner_pads, block_size, num_blocks, cpu_generator)
        step.meta.slot_mapping = static_slots
        planner.plan(step.meta, graph_batch_size=size)
        assert step.meta.plan.kind == decode_kind(size, triton_decode, graph=True)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up outside capture (flashinfer's first-call setup)
            attention(static_q, static_k, static_v, k_cache, v_cache, step.meta, shape.scale)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_out = attention(static_q, static_k, static_v, k_cache, v_cache, step.meta, shape.scale)
        graphs[size] = (graph, static_q, static_k, static_v, static_slots, static_out)

    # NOTE: alternate the sizes: both graphs share the page-index buffer, so each replay
    # must see only what its own plan wrote.
    for replay, size in enumerate([4, 8, 4, 8, 4]):
        graph, static_q, static_k, static_v, static_slots, static_out = graphs[size]
        num_real = [size - 1, size, 1][replay % 3]
        step = decode_step(num_real, size, runner_pads, block_size, num_blocks, cpu_generator)
        q, k, v = random_qkv(shape, size, generator)
        slots = torch.zeros(size, dtype=torch.long, device="cuda")  # padding rows: the scratch block's slot 0
        slots[: step.meta.slot_mapping.shape[0]] = step.meta.slot_mapping
        for static, value in ((static_q, q), (static_k, k), (static_v, v), (static_slots, slots)):
            static.copy_(value)
        planner.plan(step.meta, graph_batch_size=size)
        graph.replay()
        torch.cuda.synchronize()
        graph_out = static_out[:num_real].clone()
        real_slots = slots[:num_real]
        written = written_at(k_cache, real_slots)
        assert torch.equal(written, storage_view(stored(k[:num_real], shape))), f"replay {replay}: the graph did not write the new keys"

        # eager flashinfer on the same step (its own non-graph plan), then the reference
        eager_meta = build_step(step.cached_lens[:num_real], step.new_lens[:num_real], block_size, _tables(step, num_real)).meta
        planner.plan(eager_meta)
        eager_out = attention(q[:num_real], k[:num_real], v[:num_real], k_cache, v_cache, eager_meta, shape.scale)
        real = Step(eager_meta, step.cached_lens[:num_real], step.new_lens[:num_real])
        expected = reference(q[:num_real], k[:num_real], v[:num_real], k_cache, v_cache, eager_meta, shape)
        assert_matches(graph_out, expected, shape.dtype, real, f"replay {replay} (size {size}) vs reference")
        assert_matches(graph_out, eager_out.float(), shape.dtype, real, f"replay {replay} (size {size}) vs eager")


def _tables(step: Step, num_real: int) -> list[list[int]]:
    """The first ``num_real`` sequences' block lists, from the step's CPU page layout."""
    indptr, indices = step.meta.page_indptr.tolist(), step.meta.page_indices.tolist()
    return [indices[indptr[b] : indptr[b + 1]] for b in range(num_real)]
