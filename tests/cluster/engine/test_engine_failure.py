"""A worker rank dying mid-generation fails the in-flight requests within a bounded time.

A tensor-parallel engine (two Ray worker actors on the session's local cluster, gloo on
loopback) is generating two requests when rank 1's actor is killed. The next step must
come back within the step bound (``--watchdog-timeout``; the surviving rank's collective
gives up after ``--dist-timeout``) with an ``"error"`` finish for every in-flight
completion naming the dead rank, free every KV block, refuse new requests with
EngineDeadError, and serve again after ``restart()``.
"""

import time

import pytest
import ray
import torch

from flotilla.cluster.engine.llm_engine import EngineDeadError, LLMEngine
from flotilla.cluster.engine.sampling_params import SamplingParams
from flotilla.cluster.models.sources import resolve_model_source
from flotilla.resolution import ModelFacts, ServerArgs, preset, resolve
from helpers.tiny_models import save_tiny_llama

STEP_BOUND_S = 20
COLLECTIVE_BOUND_S = 5
# Slack over the step bound for Ray to notice the death and for the driver to unwind.
SLACK_S = 10


def test_killed_rank_fails_in_flight_requests_then_the_engine_restarts(ray_cluster, tmp_path):
    save_tiny_llama(tmp_path)
    source = resolve_model_source(str(tmp_path))
    args = ServerArgs.create(
        model_path=str(tmp_path),
        tp_size=2,
        max_total_tokens=512,
        dist_timeout=COLLECTIVE_BOUND_S,
        watchdog_timeout=STEP_BOUND_S,
    )
    config = resolve(args, ModelFacts.from_hf_config(source.config_dict), preset("cpu"))
    engine = LLMEngine(config, source)
    try:
        params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
        prompt = torch.arange(3, 20).tolist()
        ids = [engine.add_request(prompt, params), engine.add_request(prompt[:7], params)]
        for _ in range(3):  # prefill and two decodes: both requests are mid-generation
            engine.step()
        assert not any(engine.get_output(i).finished for i in ids)

        ray.kill(engine.runner.group.actors[1], no_restart=True)
        start = time.monotonic()
        deltas = engine.step()
        elapsed = time.monotonic() - start

        assert elapsed < STEP_BOUND_S + SLACK_S
        assert sorted(d.request_id for d in deltas) == sorted(ids)
        assert all(d.finish_reason == "error" and "rank 1" in d.error for d in deltas)
        for request_id in ids:
            output = engine.get_output(request_id)
            assert output.finished and "rank 1" in output.error
            assert output.outputs[0].finish_reason == "error"
            assert len(output.outputs[0].token_ids) == 3  # what was generated before the failure stays
        assert engine.scheduler.pool.num_used_blocks == 0
        assert not engine.has_unfinished_requests()
        with pytest.raises(EngineDeadError, match="restart"):
            engine.add_request(prompt, params)

        engine.restart()
        again = engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
        while engine.has_unfinished_requests():
            engine.step()
        output = engine.get_output(again)
        assert output.error is None and output.outputs[0].finish_reason == "length"
        assert len(output.outputs[0].token_ids) == 8
    finally:
        engine.runner.shutdown()
