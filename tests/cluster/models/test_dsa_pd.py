"""Prefill/decode handoff of a DSA model's KV (GLM-5 with IndexShare): the blocks a transfer
moves hold the indexer keys beside the MLA latents (full layers only), so a decode engine that
reads a prefilled prompt over NIXL (in this process, UCX on loopback) selects the same top-k
tokens and gives the colocated engine's greedy tokens. Negative control: a copy of the latents
alone (the indexer keys left at zero) changes the continuation.

Exact token equality needs no tolerance: the copied bytes are what the colocated engine computed
(the same model and kernels), and the tiny model's margins are checked in test_dsa.py.
"""

from __future__ import annotations

import uuid

import pytest
import torch

from flotilla.cluster.engine.kv_handoff import handoff, transport_block_copier
from flotilla.cluster.engine.llm_engine import LLMEngine
from flotilla.cluster.engine.sampling_params import SamplingParams
from flotilla.cluster.models.sources import resolve_model_source
from flotilla.resolution import ModelFacts, ServerArgs, preset, resolve
from flotilla.cluster.kv.transport import NixlTransport
from helpers.prompts import random_prompts
from helpers.tiny_dsa import ENGINE_PROMPT_LENS, save_tiny_dsa
from helpers.torch_threads import one_intra_op_thread

GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    with one_intra_op_thread():
        yield


def _engine(path) -> LLMEngine:
    source = resolve_model_source(str(path))
    args = ServerArgs.create(model_path=str(source.path), max_total_tokens=512)
    return LLMEngine(resolve(args, ModelFacts.from_hf_config(source.config_dict), preset("cpu")), source)


def _finish(engine: LLMEngine, request_id: str) -> list[int]:
    while not engine.get_output(request_id).finished:
        engine.step()
    return engine.pop_output(request_id).outputs[0].token_ids


@pytest.fixture(scope="module")
def glm5(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-glm5-pd")
    save_tiny_dsa(path, "glm5")
    prompts = random_prompts(ENGINE_PROMPT_LENS, 128, seed=2)
    colocated = _engine(path)
    expected = [_finish(colocated, colocated.add_request(p, GREEDY)) for p in prompts]
    return path, prompts, expected


def _nixl(engine: LLMEngine, caches) -> NixlTransport:
    transport = NixlTransport(f"dsa-{uuid.uuid4().hex[:8]}")
    transport.register(caches, engine.runner.kv_head_span())
    return transport


def test_a_nixl_read_moves_latents_and_indexer_keys(glm5):
    path, prompts, expected = glm5
    prefiller, decoder = _engine(path), _engine(path)
    caches = prefiller.runner.kv_caches
    assert [len(layer) for layer in caches] == [2, 1, 2, 1]  # latent (+ indexer keys in full layers)
    src, dst = _nixl(prefiller, caches), _nixl(decoder, decoder.runner.kv_caches)
    try:
        dst.connect("prefill", src.metadata())
        for prompt, want in zip(prompts, expected):
            _, decode_id = handoff(prefiller, decoder, prompt, transport_block_copier(dst, "prefill"), GREEDY)
            assert _finish(decoder, decode_id) == want
    finally:
        src.close()
        dst.close()


def test_without_the_indexer_keys_the_decode_selects_other_tokens(glm5):
    path, prompts, expected = glm5
    prefiller, decoder = _engine(path), _engine(path)

    def latents_only(src: list[int], dst: list[int]) -> None:
        with torch.inference_mode():
            for source, sink in zip(prefiller.runner.kv_caches, decoder.runner.kv_caches):
                sink[0][dst] = source[0][src]

    _, decode_id = handoff(prefiller, decoder, prompts[2], latents_only, GREEDY)
    assert _finish(decoder, decode_id) != expected[2]
