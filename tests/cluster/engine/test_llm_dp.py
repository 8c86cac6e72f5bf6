"""``LLM(model, tp_size=4, dp_size=2, enable_dp_attention=True)``: two DP-attention ranks of
two attention-TP ranks each, on a local Ray worker group (loopback, CPU, gloo), against
``LLM(model)`` in process.

Three prompts of different lengths go to the two DP ranks (2 + 1), and a small per-rank
prefill budget (``chunked_prefill_size=16``, i.e. 8 tokens per DP rank) makes the DP
rank with the 40-token prompt finish later, so the other DP rank runs empty batches for
its last steps; a single seeded request leaves one DP rank idle for every step. Greedy
continuations must match token for token, and the seeded request must draw the same
tokens (sampling stays on the driver). Tolerance: exact tokens; the tiny model's logit
margins (see ``save_tiny_llama``) are far above the reduction-order noise of sharding.
"""

import pytest
import ray
import torch

from flotilla import LLM, SamplingParams
from flotilla.cluster.engine.dp_scheduler import DPScheduler
from flotilla.cluster.engine.group_runner import GroupRunner
from flotilla.cluster.engine.model_runner import ModelRunner
from flotilla.cluster.engine.scheduler import SchedulerOutput
from flotilla.cluster.models.sources import resolve_model_source
from flotilla.resolution import ModelFacts, ServerArgs, preset, resolve

NEW_TOKENS = 32
FLAGS = {"max_total_tokens": 1024, "chunked_prefill_size": 16}
DP_FLAGS = {"tp_size": 4, "dp_size": 2, "enable_dp_attention": True}
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
SEEDED = SamplingParams(temperature=0.8, top_p=0.9, seed=1234, max_tokens=NEW_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def outputs(ray_cluster, tiny_llama_prompts):
    """Single-rank and DP-attention runs of the same requests, plus what the DP run saw."""
    path, prompts = tiny_llama_prompts
    results = {}
    for name, flags in (("single", {}), ("dp", DP_FLAGS)):
        llm = LLM(path, **FLAGS, **flags)
        try:
            greedy = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]
            greedy_steps = getattr(llm.engine.scheduler, "num_steps_with_idle_rank", None)
            seeded = llm.generate([prompts[1]], SEEDED)[0].outputs[0].token_ids
            results[name] = {"greedy": greedy, "seeded": seeded, "greedy_idle_steps": greedy_steps}
            if flags:
                scheduler, runner = llm.engine.scheduler, llm.engine.runner
                assert isinstance(scheduler, DPScheduler) and isinstance(runner, GroupRunner)
                results[name]["scheduler"] = scheduler
                results[name]["engine_stats"] = llm.engine.stats()
                results[name]["rank_stats"] = ray.get([a.step_stats.remote() for a in runner.group.actors], timeout=30)
        finally:
            llm.shutdown()
    return results


def resolve_cpu(path: str, **flags):
    facts = ModelFacts.from_hf_config(resolve_model_source(path).config_dict)
    return resolve(ServerArgs.create(model_path=path, **flags), facts, preset("cpu"))


def test_resolver_accepts_dp_attention_on_cpu(tiny_llama_prompts):
    config = resolve_cpu(tiny_llama_prompts[0], **FLAGS, **DP_FLAGS)
    assert (config.tp_size, config.dp_size, config.enable_dp_attention) == (4, 2, True)
    assert config.chunked_prefill_size == 8  # the step budget is per DP rank


def test_empty_step_runs_the_forward_on_one_rank(tiny_llama_prompts):
    """An empty part gives zero-length inputs and a zero-sequence batch; the forward runs
    (embedding, RMSNorm, RoPE, packed linears, attention) and nothing is sampled."""
    path, _ = tiny_llama_prompts
    runner = ModelRunner(resolve_cpu(path, max_total_tokens=64), resolve_model_source(path))
    input_ids, positions, meta, sample_index = runner.prepare_inputs(SchedulerOutput())
    assert input_ids.shape == positions.shape == sample_index.shape == (0,)
    assert meta.num_seqs == 0 and meta.block_tables.shape == (0, 1) and meta.query_start.tolist() == [0]
    with torch.inference_mode():
        hidden = runner.model(input_ids, positions, runner.kv_caches, meta)
    assert hidden.shape == (0, 64)
    assert runner.execute(SchedulerOutput(), []) == []


def test_dp_greedy_matches_single_rank(outputs):
    single, dp = outputs["single"], outputs["dp"]
    assert all(len(t) == NEW_TOKENS for t in single["greedy"])
    assert dp["greedy"] == single["greedy"]


def test_dp_ranks_ran_in_lockstep_with_idle_steps(outputs):
    """Some greedy steps had an idle DP rank, and every rank ran every step (the idle
    DP rank's two ranks ran empty forwards rather than skipping the step)."""
    dp = outputs["dp"]
    scheduler, stats = dp["scheduler"], dp["rank_stats"]
    assert dp["greedy_idle_steps"] > 0
    assert scheduler.num_steps_with_idle_rank > dp["greedy_idle_steps"]  # the seeded run idles rank 1 throughout
    assert {s["steps"] for s in stats} == {scheduler.num_steps}
    # NOTE: the two ranks of a DP rank run the same part, so they count the same empty steps.
    assert stats[0]["empty_steps"] == stats[1]["empty_steps"] and stats[2]["empty_steps"] == stats[3]["empty_steps"]
    assert stats[0]["empty_steps"] + stats[2]["empty_steps"] == scheduler.num_steps_with_idle_rank
    assert scheduler.pool.num_used_blocks == 0 and all(s.num_preemptions == 0 for s in scheduler.schedulers)
    assert dp["engine_stats"]["kv_cache_usage"] == 0.0 and dp["engine_stats"]["num_running"] == 0


def test_dp_seeded_sampling_matches_single_rank(outputs):
    assert len(outputs["single"]["seeded"]) == NEW_TOKENS
    assert outputs["dp"]["seeded"] == outputs["single"]["seeded"]
