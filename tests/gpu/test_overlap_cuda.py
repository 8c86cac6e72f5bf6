"""Overlap scheduling on a GPU (cluster/engine/overlap.py): the engine launches step N+1
before reading step N's tokens, the placeholders filled on the device. The oracle is the same
engine with ``--disable-overlap-schedule``.

SmolLM2-135M's config with random weights (``gpu/models.py``). In bf16 (flashinfer, decode
graphs 1, 2, 4) every request has the same length, so both engines run the same batch shapes
step for step and the greedy tokens must be identical. Staggered lengths change the batch
shapes around each finish (overlap computes one dropped row for a request that just stopped,
which can pick another graph size), so they run in float32 (the torch references, no graphs),
where shape-dependent rounding cannot flip an argmax of these logits.
"""

from __future__ import annotations

import pytest
import torch

from flotilla.cluster.engine.llm import LLM
from flotilla.cluster.engine.sampling_params import SamplingParams
from gpu.models import dummy_weights_drawn_on_cpu, write_smollm2_dummy_dir
from helpers.prompts import random_prompts

pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"), pytest.mark.timeout(1800)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_smollm2_dummy_dir(tmp_path_factory.mktemp("smollm2-overlap"))


def generate(model_dir, dtype, params, prompts, stats=None, max_total_tokens=8192, **flags):
    """``(overlap on, each prompt's tokens, KV blocks still used)``; ``stats`` (a dict) gets
    the engine's stats."""
    with dummy_weights_drawn_on_cpu():
        llm = LLM(model_dir, load_format="dummy", skip_tokenizer_init=True, dtype=dtype, max_total_tokens=max_total_tokens,
                  cuda_graph_max_bs_decode=4, **flags)  # fmt: skip
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        if stats is not None:
            stats.update(llm.engine.stats())
        return llm.engine.overlap, [o.outputs[0].token_ids for o in outs], llm.engine.scheduler.pool.num_used_blocks
    finally:
        llm.shutdown()


def test_overlap_matches_the_serial_engine_in_bf16_with_graphs(model_dir):
    prompts = random_prompts([12, 25, 40, 17], 49152, seed=3)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    on, overlapped, used_on = generate(model_dir, "bfloat16", params, prompts)
    off, serial, used_off = generate(model_dir, "bfloat16", params, prompts, disable_overlap_schedule=True)
    assert (on, off) == (True, False)
    assert overlapped == serial
    assert used_on == used_off == 0


def test_overlap_with_staggered_stops_in_float32(model_dir):
    prompts = random_prompts([5, 30, 12, 8, 21], 49152, seed=4)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (3, 9, 1, 17, 12)]
    on, overlapped, used_on = generate(model_dir, "float32", params, prompts)
    off, serial, used_off = generate(model_dir, "float32", params, prompts, disable_overlap_schedule=True)
    assert (on, off) == (True, False)
    assert overlapped == serial and [len(t) for t in overlapped] == [3, 9, 1, 17, 12]
    assert used_on == used_off == 0


def test_host_tier_under_overlap_keeps_the_tokens_in_float32(model_dir):
    """``--enable-hierarchical-cache`` with a pool of 8 blocks the four requests outgrow: the
    victims' blocks go to pinned host memory by non-blocking copies queued while the step
    before still runs, and come back into fresh blocks before the forward that reads them.
    The oracle is the same engine without the tier (it recomputes the victims)."""
    prompts = random_prompts([12, 25, 40, 17], 49152, seed=5)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    stats = {}
    on, tiered, used_on = generate(model_dir, "float32", params, prompts, stats, max_total_tokens=128,
                                   enable_hierarchical_cache=True)  # fmt: skip
    _, recomputed, used_off = generate(model_dir, "float32", params, prompts, max_total_tokens=128)
    assert on and stats["num_preemptions"] > 0 and stats["host_kv_loaded_blocks"] > 0, stats
    assert tiered == recomputed and [len(t) for t in tiered] == [24] * 4
    assert used_on == used_off == 0
