"""flashinfer MLA (kernels/flashinfer_mla.py) against the torch reference (kernels/mla.py,
float32 on the same bf16 inputs and weights) on a CUDA GPU: DeepSeek-V2-Lite's shape
(16 heads, kv_lora_rank 512, rope 64, qk_nope 128, v_head 128) and 8 heads (its TP=2
slice), prefill chunks after a cached prefix mixed with decodes, pure decode, one long
prefill and one long decode, blocks of 16 and 32, a plan reused by two layers, CUDA-graph
decode replays, and the torch fallbacks (return_lse, DCP).

Run on a GPU machine: ``FLOTILLA_GPU_TESTS=1 pytest tests/gpu/test_flashinfer_mla.py``
(one flashinfer MLA kernel build, ~1-1.5 min on first use; bf16 only).

Tolerances (bf16): the reference absorbs the weights in float32, flashinfer's path in
bf16 (fp32 accumulation), so the latent queries differ by bf16 rounding (2^-9 relative):
with logits of std ~1.7 that moves each logit by ~3e-3 and each probability by ~0.3%.
The kernel then rounds probabilities and the latent output to bf16 (<= 2^-9 relative of
|c| ~ 1-3), and the output projection rounds once more: a few 1e-3 in all, against
atol = rtol = 2e-2; a wrong mask, page or scale is off by O(0.1-1).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch

from flotilla.kernels.attention import AttentionShape
from flotilla.kernels.mla import mla_attention as torch_mla_attention
from gpu.paged_steps import Step, build_step, planner_for, random_blocks

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.timeout(1800),  # the first use JIT-compiles flashinfer's MLA kernels
]

RANK, ROPE, NOPE, V_HEAD = 512, 64, 128, 128
DTYPE = torch.bfloat16
ATOL = RTOL = 2e-2
SCRATCH_BLOCK = 0

BATCHES = {
    "mixed": ([37, 0, 300, 15, 100, 0], [45, 17, 129, 1, 1, 1]),
    "decode": ([15, 16, 31, 200, 0, 1000, 63], [1, 1, 1, 1, 1, 1, 1]),
    "long-prefill": ([0], [1200]),
    "long-decode": ([3000], [1]),
}


def mla_shape(heads: int) -> AttentionShape:
    # DeepSeek's softmax scale over the full q/k head dim (no YaRN mscale here).
    return AttentionShape(heads, 1, RANK + ROPE, RANK, 1 / math.sqrt(NOPE + ROPE), None, DTYPE, RANK, ROPE)


def flashinfer_mla():
    from flotilla.kernels.registry import get

    return get("mla_attention", "flashinfer")


@dataclass
class Inputs:
    q_nope: torch.Tensor
    q_pe: torch.Tensor
    kv_c: torch.Tensor
    k_pe: torch.Tensor
    w_kc: torch.Tensor
    w_vc: torch.Tensor

    def as_float(self) -> "Inputs":
        return Inputs(*(t.float() for t in vars(self).values()))


def random_inputs(heads: int, num_tokens: int, generator) -> Inputs:
    def randn(*size, std=1.0):
        return (torch.randn(size, generator=generator, device="cuda") * std).to(DTYPE)

    return Inputs(
        q_nope=randn(num_tokens, heads, NOPE),
        q_pe=randn(num_tokens, heads, ROPE),
        kv_c=randn(num_tokens, RANK),
        k_pe=randn(num_tokens, ROPE),
        w_kc=randn(heads, NOPE, RANK, std=NOPE**-0.5),  # latent queries ~ N(0, 1)
        w_vc=randn(heads, RANK, V_HEAD, std=RANK**-0.5),
    )


def random_cache(num_blocks, block_size, generator) -> torch.Tensor:
    """A latent cache of N(0,1) rows everywhere (cached prefixes and never-read garbage)."""
    return torch.randn(num_blocks, block_size, 1, RANK + ROPE, generator=generator, device="cuda").to(DTYPE)


def call(fn, x: Inputs, cache, meta, scale, **kwargs):
    return fn(x.q_nope, x.q_pe, x.kv_c, x.k_pe, cache, meta, x.w_kc, x.w_vc, scale, **kwargs)


def assert_matches(out, expected, step: Step, what: str) -> None:
    """Elementwise ``|out - expected| <= ATOL + RTOL |expected|``, failing with where and how much."""
    assert out.shape == expected.shape, f"{what}: shape {tuple(out.shape)} != {tuple(expected.shape)}"
    assert torch.isfinite(out).all(), f"{what}: non-finite outputs"
    err = (out.float() - expected.float()).abs()
    bad = err > ATOL + RTOL * expected.float().abs()
    if bad.any():
        flat = int(err.argmax())
        token, head = divmod(flat // err.shape[-1], err.shape[1])
        starts = step.meta.query_start_cpu.tolist()
        seq = max(b for b in range(len(starts) - 1) if starts[b] <= token)
        pytest.fail(
            f"{what}: {int(bad.sum())}/{bad.numel()} elements off (atol={ATOL}, rtol={RTOL}); worst "
            f"|err|={err.max().item():.4g} at token {token} (sequence {seq}: cached {step.cached_lens[seq]}, new "
            f"{step.new_lens[seq]}), head {head}: got {out.flatten()[flat].item():.5g}, expected "
            f"{expected.flatten()[flat].item():.5g}; mean |err|={err.mean().item():.3g}"
        )


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("batch", list(BATCHES))
@pytest.mark.parametrize("heads", [16, 8])
def test_mla_matches_torch_reference(heads, batch, block_size):
    shape = mla_shape(heads)
    generator = torch.Generator(device="cuda").manual_seed(0)
    cpu_generator = torch.Generator().manual_seed(0)
    cached, new = BATCHES[batch]
    seq_lens = [c + n for c, n in zip(cached, new)]
    num_blocks = sum(-(-s // block_size) for s in seq_lens) + 8
    step = build_step(cached, new, block_size, random_blocks(seq_lens, block_size, num_blocks, cpu_generator))
    planner_for(shape, block_size).plan(step.meta)
    for layer in range(2 if batch == "mixed" else 1):  # NOTE: one plan serves every layer
        x = random_inputs(heads, step.num_tokens, generator)
        cache = random_cache(num_blocks, block_size, generator)
        expected = call(torch_mla_attention, x.as_float(), cache.float(), step.meta, shape.scale)
        out = call(flashinfer_mla(), x, cache, step.meta, shape.scale)
        assert out.dtype == DTYPE
        assert_matches(out, expected, step, f"layer {layer}")
        rows = cache.view(-1, RANK + ROPE).index_select(0, step.meta.slot_mapping)
        assert torch.equal(rows, torch.cat([x.kv_c, x.k_pe], dim=-1)), "the new latent rows were not written"


def test_return_lse_and_empty_steps_use_the_reference_contract():
    shape, block_size = mla_shape(16), 16
    generator = torch.Generator(device="cuda").manual_seed(2)
    step = build_step([20, 0], [3, 5], block_size, [[1, 2], [3]])
    x = random_inputs(16, step.num_tokens, generator)
    cache = random_cache(4, block_size, generator)
    # return_lse runs the torch reference (no plan needed) with its (out, lse) result.
    out, lse = call(flashinfer_mla(), x, cache.clone(), step.meta, shape.scale, return_lse=True)
    ref_out, ref_lse = call(torch_mla_attention, x, cache.clone(), step.meta, shape.scale, return_lse=True)
    assert torch.equal(out, ref_out) and torch.equal(lse, ref_lse)
    empty = Inputs(*(t[:0] if i < 4 else t for i, t in enumerate(vars(x).values())))
    assert call(flashinfer_mla(), empty, cache, step.meta, shape.scale).shape == (0, 16, V_HEAD)


def test_unsupported_mla_shapes_fail_at_construction():
    from flotilla.kernels.registry import get

    bad = AttentionShape(12, 1, RANK + ROPE, RANK, 0.07, None, DTYPE, RANK, ROPE)  # 64 % 12 != 0
    with pytest.raises(ValueError, match="num_q_heads=12"):
        get("attention_planner", "flashinfer")(bad, "cuda", block_size=16, max_num_seqs=4, max_num_pages=64)


# -- CUDA graphs ------------------------------------------------------------------------

GRAPH_SIZES = (4, 8)


@pytest.mark.parametrize("runner_pads", [True, False], ids=["runner-pads", "planner-pads"])
def test_cuda_graph_decode_replays_match_eager_and_reference(runner_pads):
    heads, block_size = 16, 16
    shape = mla_shape(heads)
    num_blocks = 8 * 44 + 8
    planner = planner_for(shape, block_size, graph_batch_sizes=GRAPH_SIZES, max_num_pages=8 * 44)
    attention = flashinfer_mla()
    generator = torch.Generator(device="cuda").manual_seed(3)
    cpu_generator = torch.Generator().manual_seed(3)
    cache = random_cache(num_blocks, block_size, generator)

    def decode_step(num_real, size):
        lens = torch.randint(1, 700, (num_real,), generator=cpu_generator).tolist()
        blocks = random_blocks(lens, block_size, num_blocks, cpu_generator)
        cached, new = [n - 1 for n in lens], [1] * num_real
        if runner_pads:  # padding sequences: one token each in the scratch block
            pad = size - num_real
            cached, new, blocks = cached + [0] * pad, new + [1] * pad, blocks + [[SCRATCH_BLOCK]] * pad
        return build_step(cached, new, block_size, blocks)

    graphs = {}
    for size in GRAPH_SIZES:
        static = random_inputs(heads, size, generator)
        static_slots = torch.zeros(size, dtype=torch.long, device="cuda")
        step = decode_step(size - 1, size)
        step.meta.slot_mapping = static_slots
        planner.plan(step.meta, graph_batch_size=size)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            call(attention, static, cache, step.meta, shape.scale)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_out = call(attention, static, cache, step.meta, shape.scale)
        graphs[size] = (graph, static, static_slots, static_out)

    for replay, size in enumerate([4, 8, 4, 8, 4]):  # NOTE: the sizes share the page-index buffer
        graph, static, static_slots, static_out = graphs[size]
        num_real = [size - 1, size, 1][replay % 3]
        step = decode_step(num_real, size)
        x = random_inputs(heads, size, generator)
        slots = torch.zeros(size, dtype=torch.long, device="cuda")
        slots[: step.meta.slot_mapping.shape[0]] = step.meta.slot_mapping
        for name, value in vars(x).items():
            getattr(static, name).copy_(value)
        static_slots.copy_(slots)
        planner.plan(step.meta, graph_batch_size=size)
        graph.replay()
        torch.cuda.synchronize()
        graph_out = static_out[:num_real].clone()
        rows = cache.view(-1, RANK + ROPE).index_select(0, slots[:num_real])
        assert torch.equal(rows, torch.cat([x.kv_c, x.k_pe], -1)[:num_real]), f"replay {replay}: rows not written"

        indptr, indices = step.meta.page_indptr.tolist(), step.meta.page_indices.tolist()
        tables = [indices[indptr[b] : indptr[b + 1]] for b in range(num_real)]
        real = build_step(step.cached_lens[:num_real], step.new_lens[:num_real], block_size, tables)
        head = Inputs(*(t[:num_real] if i < 4 else t for i, t in enumerate(vars(x).values())))
        planner.plan(real.meta)
        eager_out = call(attention, head, cache, real.meta, shape.scale)
        expected = call(torch_mla_attention, head.as_float(), cache.float(), real.meta, shape.scale)
        assert_matches(graph_out, expected, real, f"replay {replay} (size {size}) vs reference")
        assert_matches(graph_out, eager_out, real, f"replay {replay} (size {size}) vs eager")
