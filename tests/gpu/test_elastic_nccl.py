"""Elastic EP over NCCL: a one-GPU elastic engine grows to two GPUs between steps.

The CPU suite (tests/cluster/engine/test_elastic_join.py) grows the same layout over gloo; here
rank 0 leaves its (one-rank) world and joins a two-rank NCCL world with a joiner on the second
GPU, and the running rank's MoE layers switch to the grown placement without moving weights.
Float32 tiny Qwen3-MoE: greedy tokens must equal those of the engine before it grew, for
requests in flight across the commit and requests after it (routed to the new DP rank).
Run on a 2-GPU machine: ``FLOTILLA_GPU_TESTS=1 pytest tests/gpu``.
"""

from flotilla import SamplingParams
from flotilla.cluster.engine.llm_engine import LLMEngine
from flotilla.cluster.models.sources import resolve_model_source
from flotilla.cluster.platform import probe
from flotilla.resolution import ModelFacts, ServerArgs, resolve
from flotilla.serve.plan import joiner_fields
from helpers.elastic_live import ELASTIC
from helpers.prompts import random_prompts
from helpers.tiny_moe import save_tiny_qwen3_moe

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
FLAGS = dict(
    ELASTIC, max_total_tokens=2048, dtype="float32", attention_backend="torch_native", disable_radix_cache=True
)


def _resolve(path: str, **flags):
    source = resolve_model_source(path)
    args = ServerArgs.create(model_path=path, **{**FLAGS, **flags})
    return resolve(args, ModelFacts.from_hf_config(source.config_dict), probe()), source


def _finish(engine, ids):
    while engine.has_unfinished_requests():
        engine.step()
    return {rid: engine.get_output(rid).outputs[0].token_ids for rid in ids}


def test_grow_from_one_gpu_to_two_over_nccl_keeps_greedy_tokens(gpu_ray_cluster, tmp_path):
    save_tiny_qwen3_moe(tmp_path)
    config, source = _resolve(str(tmp_path))
    joiner, _ = _resolve(str(tmp_path), **joiner_fields({}, current=1, new=2, initial=1))
    assert config.device == "cuda"
    prompts = random_prompts((5, 17, 40, 9), 256)
    engine = LLMEngine(config, source)
    try:
        for i, prompt in enumerate(prompts):
            engine.add_request(prompt, GREEDY, request_id=f"oracle-{i}")
        oracle = _finish(engine, [f"oracle-{i}" for i in range(len(prompts))])
        for i, prompt in enumerate(prompts[:2]):
            engine.add_request(prompt, GREEDY, request_id=f"inflight-{i}")
        for _ in range(4):
            engine.step()
        engine.commit_elastic_join(engine.runner.prepare_join(joiner, 2, 300))
        assert (engine.runner.ep_size, engine.scheduler.dp_size) == (2, 2)
        for i, prompt in enumerate(prompts[2:], start=2):
            engine.add_request(prompt, GREEDY, request_id=f"after-{i}")
        ids = ["inflight-0", "inflight-1", "after-2", "after-3"]
        assert 1 in {engine.dp_rank_of(rid) for rid in ids[2:]}
        got = _finish(engine, ids)
        assert got == {rid: oracle[f"oracle-{rid.split('-')[1]}"] for rid in ids}
        stats = engine.runner.group.call("step_stats")
        assert stats[1]["steps"] > stats[1]["empty_steps"]
    finally:
        engine.runner.shutdown()
