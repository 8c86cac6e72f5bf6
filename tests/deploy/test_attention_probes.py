"""The GPU probes behind docs/benchmarks.md's eighth and ninth passes, on CPU: the case syntax and FLOP
count of ``benchmarks/prefill_attention_probe.py`` (against a brute-force count of the causal
query-key pairs) and the layer shapes of ``benchmarks/overlap_probe.py`` and ``gemm_probe.py`` (against the bundled
Llama-3.1-8B config). Their timings need CUDA and flashinfer and run on the device only."""

import pytest
from helpers.benchmark_scripts import import_benchmark

from flotilla.deploy.bench import shape_config

prefill = import_benchmark("prefill_attention_probe")
overlap = import_benchmark("overlap_probe")


@pytest.mark.parametrize("text,expected", [("8x1000", (8, 1000, 0)), ("4x1000+1000", (4, 1000, 1000)), ("1x1", (1, 1, 0))])
def test_case_syntax(text, expected):
    assert prefill.parse_case(text) == expected


@pytest.mark.parametrize("batch,new,cached", [(1, 1, 0), (2, 5, 0), (3, 4, 7), (1, 16, 16)])
def test_causal_flops_count_the_pairs_each_query_sees(batch, new, cached):
    # query i (0-based among the new tokens) sees the cached keys and new keys 0..i
    pairs = sum(1 for i in range(new) for key in range(cached + new) if key <= cached + i)
    per_pair = 4 * prefill.HEAD_DIM * prefill.HEADS
    assert prefill.causal_flops(batch, new, cached) == batch * pairs * per_pair


def test_overlap_probe_layer_is_the_llama_layer():
    config = shape_config("llama-3.1-8b")
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    head_dim = hidden // config["num_attention_heads"]
    qkv = (config["num_attention_heads"] + 2 * config["num_key_value_heads"]) * head_dim
    assert overlap.PROJECTIONS == ((qkv, hidden), (hidden, hidden), (2 * inter, hidden), (hidden, inter))
    assert (overlap.HEADS, overlap.KV_HEADS, overlap.HEAD_DIM) == (
        config["num_attention_heads"], config["num_key_value_heads"], head_dim)  # fmt: skip
    assert (prefill.HEADS, prefill.KV_HEADS, prefill.HEAD_DIM) == (overlap.HEADS, overlap.KV_HEADS, overlap.HEAD_DIM)


def test_gemm_probe_shapes_are_the_llama_projections_and_lm_head():
    gemm = import_benchmark("gemm_probe")
    config = shape_config("llama-3.1-8b")
    projections = {name: (n, k) for name, n, k in gemm.SHAPES}
    assert tuple(projections[name] for name in ("qkv", "o", "gate_up", "down")) == overlap.PROJECTIONS
    assert projections["lm_head"] == (config["vocab_size"], config["hidden_size"])
