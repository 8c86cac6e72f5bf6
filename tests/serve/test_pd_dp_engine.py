"""Prefill/decode disaggregation with DP attention x EP pools, engine side (no Serve): a
``prefill`` and a ``decode`` :class:`EngineReplica` over a tiny random DeepSeek-V3, each a
worker group of two ranks on the session's Ray (DP attention 2, attention TP 1, experts split
over EP 2), their KV endpoints real NIXL agents on UCX loopback; and a TP=2 decode replica
(no DP attention) fed by the same DP prefill pool (heterogeneous pools).

What this checks, for the flow the ingress runs (prefill, stream the decode, release):

- a prompt's prefill lands on one DP rank of the prefill group and its ticket names that DP
  rank alone as the KV peer (its ranks' metadata, ``f"{peer}/dp{d}"``); the decode side admits
  the request on one of its DP ranks and only that DP rank's ranks read the blocks;
- greedy tokens equal the single in-process engine's, for concurrent prompts that use both
  DP ranks on each side (exact equality: the bytes moved are the prefill ranks' MLA latents,
  and the tiny model's greedy margins are far above the sharded model's float32 noise, see
  helpers/tiny_deepseek.py);
- every block is freed on both sides afterwards (no KV block, no lease left).
"""

from __future__ import annotations

import asyncio
import dataclasses
import time

import pytest

from flotilla.cluster.engine.llm_engine import LLMEngine
from flotilla.cluster.engine.sampling_params import SamplingParams
from flotilla.cluster.models.sources import resolve_model_source
from flotilla.resolution import preset
from flotilla.serve.engine_replica import EngineReplica
from flotilla.serve.plan import pd_server_fields, resolve_pool
from flotilla.serve.types import GenerateRequest, ReplicaPin, ServeOptions
from helpers.prompts import random_prompts
from helpers.tiny_deepseek import save_tiny_deepseek_v3
from helpers.torch_threads import one_intra_op_thread

NEW_TOKENS = 12
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
WAIT_S = 20.0
# DP attention 2 x EP 2 on two ranks (attention TP 1 per DP rank), as --prefill-dp 2 --prefill-ep 2.
DP_EP = dict(tp=2, dp=2, ep=2)
BASE = {"max_total_tokens": 1024, "moe_a2a_backend": "deepep", "ep_num_redundant_experts": 0}


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    with one_intra_op_thread():
        yield


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-deepseek-v3-pd-dp")
    save_tiny_deepseek_v3(path)
    config = resolve_pool({**BASE, "model_path": str(path)}, preset("cpu"))[0]
    source = resolve_model_source(str(path))
    engine = LLMEngine(config, source)
    prompts = random_prompts((6, 19, 33, 47), 128, seed=23)

    def alone(prompt):
        request_id = engine.add_request(prompt, GREEDY)
        while engine.has_unfinished_requests():
            engine.step()
        return engine.pop_output(request_id).outputs[0].token_ids

    return str(path), prompts, [alone(p) for p in prompts]


def _pool_configs(path: str, prefill: dict, decode: dict):
    given = {**BASE, "model_path": path}
    sizes = {f"{pool}_{kind}": n for pool, shape in (("prefill", prefill), ("decode", decode)) for kind, n in shape.items()}
    prefill_fields, decode_fields = pd_server_fields(given, **sizes)
    return resolve_pool(prefill_fields, preset("cpu"))[0], resolve_pool(decode_fields, preset("cpu"))[0]


@pytest.fixture(scope="module")
def replicas(ray_cluster, tiny):
    path = tiny[0]
    prefill_config, decode_config = _pool_configs(path, DP_EP, DP_EP)
    _, tp_decode_config = _pool_configs(path, DP_EP, {"tp": 2})
    assert (prefill_config.enable_dp_attention, prefill_config.dp_size, prefill_config.ep_size) == (True, 2, 2)
    assert (tp_decode_config.enable_dp_attention, tp_decode_config.tp_size) == (False, 2)
    options = ServeOptions(model=path, kv_transport="nixl", kv_lease_s=30.0, kv_transfer_timeout_s=15.0)
    built: list[EngineReplica] = []
    try:
        for config, pool, replica_id in (
            (prefill_config, "prefill", "p-dp"), (decode_config, "decode", "d-dp"), (tp_decode_config, "decode", "d-tp"),
        ):  # fmt: skip
            built.append(EngineReplica(config, options, pool=pool, replica_id=replica_id))
        yield tuple(built)
    finally:
        for replica in reversed(built):
            replica.shutdown()


def _request(prompt, request_id):
    return GenerateRequest(request_id, list(prompt), GREEDY, time.time(), None)


async def _handoff(prefill: EngineReplica, decode: EngineReplica, prompt, request_id):
    request = _request(prompt, request_id)
    ticket = await prefill.prefill(request)
    try:
        chunks = [c async for c in decode.generate_prefilled(request, ticket)]
    finally:
        assert await prefill.release_kv(ReplicaPin(ticket.replica_id), ticket.prefill_request_id)
    return ticket, [t for chunk in chunks for c in chunk.completions for t in c.token_ids]


def _scheduler(replica: EngineReplica):
    return replica.engine.engine.scheduler


async def _all_freed(*replicas: EngineReplica) -> None:
    deadline = time.monotonic() + WAIT_S
    while any(_scheduler(r).pool.num_used_blocks or _scheduler(r).num_held_blocks for r in replicas):
        assert time.monotonic() < deadline, "KV blocks still referenced after every request ended"
        await asyncio.sleep(0.01)


def _run_all(prefill, decode, prompts, tag):
    async def main():
        results = await asyncio.gather(*(_handoff(prefill, decode, p, f"{tag}{i}") for i, p in enumerate(prompts)))
        await _all_freed(prefill, decode)
        return results

    return asyncio.run(main())


def test_dp_prefill_and_dp_decode_give_the_single_engines_tokens(replicas, tiny):
    prefill, decode, _ = replicas
    _, prompts, expected = tiny
    reads_before = decode.engine.metrics.registry.get_sample_value(
        "flotilla:kv_transfer_seconds_count", {"replica": "d-dp", "pool": "decode"}
    ) or 0.0
    results = _run_all(prefill, decode, prompts, "dp")
    assert [tokens for _, tokens in results] == expected
    tickets = [ticket for ticket, _ in results]
    # Concurrent prompts spread over both prefill DP ranks; each ticket names its DP rank's
    # ranks alone (one rank each: attention TP 1), as a peer of its own.
    assert {t.dp_rank for t in tickets} == {0, 1}
    for ticket in tickets:
        assert ticket.peer_id.endswith(f"/dp{ticket.dp_rank}") and len(ticket.peer_metadata) == 1
    # Both decode DP ranks admitted requests, and each read moved bytes (counted once per read).
    assert all(s.pool.prefix_query_tokens > 0 for s in _scheduler(decode).schedulers)
    reads = decode.engine.metrics.registry.get_sample_value(
        "flotilla:kv_transfer_seconds_count", {"replica": "d-dp", "pool": "decode"}
    )
    assert reads - reads_before == len(prompts)
    assert decode.engine.metrics.registry.get_sample_value(
        "flotilla:kv_transfer_bytes_total", {"replica": "d-dp", "pool": "decode"}
    ) > 0


def test_a_dp_prefill_pool_feeds_a_tp_decode_pool(replicas, tiny):
    """Heterogeneous pools: DP 2 x EP 2 prefill, TP 2 decode (each decode rank holds the
    whole MLA latent, replicated, and reads it from the one prefill rank of the ticket's DP rank)."""
    prefill, _, tp_decode = replicas
    _, prompts, expected = tiny
    results = _run_all(prefill, tp_decode, prompts, "tp")
    assert [tokens for _, tokens in results] == expected


def test_a_dcp_decode_pool_reads_each_ranks_token_shard(ray_cluster, tiny):
    """A TP 1 prefill replica (its rank in this process) feeding a decode replica of TP 2 with
    decode context parallelism 2 (the MLA latent sharded by token over both ranks): the
    prefill pool's page size follows the decode pool's logical block (2 x 16 tokens), and each
    decode rank reads its token shard of every prefilled block. Greedy tokens equal the single
    engine's, and every block is freed afterwards."""
    from flotilla.serve.plan import check_pd_options, prefill_page_fields

    path, prompts, expected = tiny
    prefill_fields, decode_fields = pd_server_fields({**BASE, "model_path": path}, decode_tp=2, decode_dcp=2)
    decode_config = resolve_pool(decode_fields, preset("cpu"))[0]
    prefill_config = resolve_pool(prefill_page_fields(prefill_fields, decode_config), preset("cpu"))[0]
    assert (decode_config.dcp_size, prefill_config.dcp_size, prefill_config.page_size) == (2, 1, 32)
    options = ServeOptions(model=path, kv_transport="nixl", kv_lease_s=30.0, kv_transfer_timeout_s=15.0)
    check_pd_options(prefill_config, decode_config, dataclasses.replace(options, disaggregation_mode="pd"))
    built: list[EngineReplica] = []
    try:
        built.append(EngineReplica(prefill_config, options, pool="prefill", replica_id="p-tp1"))
        built.append(EngineReplica(decode_config, options, pool="decode", replica_id="d-dcp"))
        assert _scheduler(built[1]).pool.block_size == 32  # the decode scheduler's logical blocks
        results = _run_all(*built, prompts, "dcp")
        assert [tokens for _, tokens in results] == expected
    finally:
        for replica in reversed(built):
            replica.shutdown()
