"""A stopping prefill engine gives back the KV blocks it holds for decode replicas: Serve calls
the replica's ``__del__`` once its graceful drain ends (``EngineReplica.shutdown`` ->
``AsyncEngine.shutdown``), and every lease must be released then, not left to expire (the
tiny random Llama in this process, no Serve)."""

from __future__ import annotations

import asyncio
import time

from flotilla.cluster.engine.llm_engine import LLMEngine
from flotilla.cluster.engine.sampling_params import SamplingParams
from flotilla.cluster.models.sources import resolve_model_source
from flotilla.resolution import ModelFacts, ServerArgs, preset, resolve
from flotilla.serve.async_engine import AsyncEngine
from flotilla.serve.types import GenerateRequest
from helpers.prompts import random_prompts
from helpers.tiny_models import save_tiny_llama
from helpers.torch_threads import one_intra_op_thread

VOCAB = 256
# Far beyond the test: a lease that is gone at the end was released, not expired.
LEASE_S = 600.0


def test_shutdown_releases_every_lease_a_prefill_engine_holds(tmp_path):
    save_tiny_llama(tmp_path, vocab_size=VOCAB)
    source = resolve_model_source(str(tmp_path))
    args = ServerArgs.create(model_path=str(source.path), max_total_tokens=2048)
    config = resolve(args, ModelFacts.from_hf_config(source.config_dict), preset("cpu"))
    with one_intra_op_thread():
        engine = AsyncEngine(LLMEngine(config, source), 8, replica_id="stopping", pool="prefill")
        try:
            params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
            prompts = random_prompts([20, 40], VOCAB, seed=5)

            async def held():
                requests = [GenerateRequest(f"p{i}", list(p), params, time.time()) for i, p in enumerate(prompts)]
                return [await engine.prefill(r, lease_s=LEASE_S) for r in requests]

            tickets = asyncio.run(held())
            scheduler = engine.engine.scheduler
            assert scheduler.num_held_blocks == sum(len(t.block_ids) for t in tickets) > 0
        finally:
            engine.shutdown()
        assert scheduler.num_held_blocks == 0 and scheduler.pool.num_used_blocks == 0
        labels = {"replica": "stopping", "pool": "prefill"}
        assert engine.metrics.registry.get_sample_value("flotilla:kv_transfer_leased_blocks", labels) == 0
