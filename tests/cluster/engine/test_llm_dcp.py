"""``LLM(model, tp_size=2, dcp_size=2, dcp_comm_backend=...)`` on a local Ray worker group
(loopback, CPU, gloo) against ``LLM(model)`` in process, for a tiny DeepSeek-V2 (MLA); and
the model runner's KV layout under DCP (no Ray). The model's second layer is MoE with a
shared expert, so the MoE layers' tensor parallelism runs beside DCP.

Under decode context parallelism each rank stores every other token of the latent cache
(the scheduler sees logical blocks of ``2 * 16`` tokens) and the ranks merge their partial
attention with ``ag_rs`` or ``a2a``. Greedy continuations (32 tokens) of prompts of
different lengths, one of them a single token (shorter than dcp_size: one rank's shard starts
empty), generated in one batch, must equal the single rank's token for token.
"""

import pytest

from flotilla import LLM, SamplingParams
from flotilla.cluster.distributed import Communicator
from flotilla.cluster.engine.group_runner import GroupRunner
from flotilla.cluster.engine.model_runner import ModelRunner
from flotilla.cluster.models.base import ParallelLayout
from flotilla.cluster.models.sources import resolve_model_source
from flotilla.resolution import ModelFacts, ServerArgs, preset, resolve
from helpers.tiny_deepseek import save_tiny_deepseek_v2
from helpers.tiny_models import save_tiny_llama
from helpers.prompts import random_prompts

NEW_TOKENS = 32
PROMPT_LENS = (1, 6, 19, 40)
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
BACKENDS = ("ag_rs", "a2a")


@pytest.fixture(scope="module")
def tiny_deepseek(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-deepseek-dcp")
    # NOTE: layer 0 dense, layer 1 MoE (4 routed experts split over MoE TP, a shared expert).
    save_tiny_deepseek_v2(path, q_lora_rank=24, first_k_dense_replace=1)
    prompts = random_prompts(PROMPT_LENS, 128)
    return str(path), prompts


@pytest.fixture(scope="module")
def outputs(ray_cluster, tiny_deepseek):
    """Greedy token lists: ``{"single": ..., "ag_rs": ..., "a2a": ...}`` (one engine each)."""
    path, prompts = tiny_deepseek
    results = {}
    for name, flags in [("single", {})] + [(b, dict(tp_size=2, dcp_size=2, dcp_comm_backend=b)) for b in BACKENDS]:
        llm = LLM(path, max_total_tokens=1024, **flags)
        try:
            if flags:
                assert isinstance(llm.engine.runner, GroupRunner)
                assert (llm.config.dcp_size, llm.config.dcp_comm_backend) == (2, name)
                # The scheduler sees logical blocks of dcp_size * the local block size.
                assert llm.engine.runner.kv_layout.block_size == 2 * 16
            results[name] = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]
        finally:
            llm.shutdown()
    return results


@pytest.mark.parametrize("backend", BACKENDS)
def test_dcp2_greedy_matches_single_rank(outputs, backend):
    assert all(len(t) == NEW_TOKENS for t in outputs["single"])
    assert outputs[backend] == outputs["single"]


# --- the runner's KV layout (one process; the DCP communicator is never used by __init__) ---


def _runner(path, dcp_size: int) -> ModelRunner:
    source = resolve_model_source(str(path))
    flags = dict(tp_size=2, dcp_size=2) if dcp_size > 1 else {}
    args = ServerArgs.create(model_path=str(source.path), max_total_tokens=1024, **flags)
    config = resolve(args, ModelFacts.from_hf_config(source.config_dict), preset("cpu"))
    comms = {"dcp": Communicator.single()}
    layout = ParallelLayout(tp_size=dcp_size, dcp_size=dcp_size, comms=comms)
    return ModelRunner(config, source, pack_weights=False, parallel=layout)


def test_runner_reports_logical_blocks_and_per_rank_bytes_under_dcp(tiny_deepseek):
    """max_total_tokens=1024 logical tokens: each of 2 DCP ranks holds 512 rows in blocks of
    16; the scheduler sees blocks of 32 logical tokens and half a latent row per token."""
    single, dcp = _runner(tiny_deepseek[0], 1), _runner(tiny_deepseek[0], 2)
    assert (single.kv_layout.block_size, single.kv_layout.num_blocks) == (16, 64)
    assert (dcp.kv_layout.block_size, dcp.kv_layout.num_blocks) == (32, 32)
    assert dcp.kv_layout.num_tokens == single.kv_layout.num_tokens == 1024
    assert dcp.kv_layout.bytes_per_token * 2 == single.kv_layout.bytes_per_token
    assert dcp.kv_caches[0][0].shape[:2] == (32, 16)  # [num_blocks, local block size, ...]


def test_dcp_is_rejected_for_a_model_without_mla(tmp_path):
    save_tiny_llama(tmp_path)
    with pytest.raises(NotImplementedError, match="dcp_size=2 is not supported for LlamaForCausalLM"):
        _runner(tmp_path, 2)
