"""What the parallel exchange fields change inside a rank's model: the layout a worker rank
builds from the resolved config (``Worker._layout``, as every rank of a worker group does)
picks the collectives its layers run.

- ``--dcp-comm-backend``: how a DCP rank merges partial MLA attention: ``ag_rs`` all-gathers
  the log-sum-exps and reduce-scatters the rescaled partials; ``a2a`` sends each peer its
  heads' partials in one all-to-all. Shown on one rank whose DCP peer is
  a recording stand-in (the merged values are checked against the single rank in
  ``tests/cluster/models/test_dcp.py`` and ``tests/cluster/engine/test_llm_dcp.py``).
- ``--moe-a2a-backend``: ``none`` all-reduces partial expert outputs; any other name
  dispatches tokens to their experts' ranks and combines them back (all-to-all).

No process groups are joined. The runtime-support table names these tests as evidence
(``tests/helpers/support_evidence.py``).
"""

from __future__ import annotations

import json

import pytest
import torch

from flotilla.cluster.models.base import ModelConfig
from flotilla.cluster.models.deepseek import MLAttention
from flotilla.cluster.models.moe_dispatch import AllReduceDispatch, AllToAllDispatch, make_dispatcher
from flotilla.cluster.models.moe_models import RotaryEmbedding
from flotilla.cluster.models.sources import resolve_model_source
from flotilla.cluster.topology import Topology
from flotilla.cluster.worker import Worker
from flotilla.resolution import ModelFacts, ServerArgs, preset, resolve
from helpers.paged import build_meta
from helpers.tiny_deepseek import TINY_DEEPSEEK_V2

DCP = 2
LOGICAL_BLOCK = 4


class RecordingDCPComm:
    """Rank 0's DCP group of two ranks, the peer mirroring this rank; records every collective."""

    size, rank = DCP, 0

    def __init__(self):
        self.calls: list[str] = []

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        self.calls.append("all_gather")
        return torch.cat([x] * self.size, dim=dim)

    def reduce_scatter(self, x: torch.Tensor, dim: int = 0) -> torch.Tensor:
        self.calls.append("reduce_scatter")
        return (x * self.size).chunk(self.size, dim=dim)[self.rank]

    def all_to_all(self, x: torch.Tensor, send_counts):
        self.calls.append("all_to_all")
        return x, list(send_counts)


def rank_layout(model_dir, comms, **flags):
    """Rank 0's ParallelLayout as its worker builds it from the config resolved for ``flags``."""
    source = resolve_model_source(str(model_dir))
    args = ServerArgs.create(model_path=str(source.path), **flags)
    config = resolve(args, ModelFacts.from_hf_config(source.config_dict), preset("cpu"))
    worker = Worker(0, int(config.tp_size), config.digest)
    worker.accept_config(config)
    return config, worker._layout(Topology.from_config(config), comms)


@pytest.fixture(scope="module")
def deepseek_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-deepseek-config")
    hf = {**TINY_DEEPSEEK_V2, "architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2", "q_lora_rank": None}
    (path / "config.json").write_text(json.dumps(hf))
    return path


def dcp_exchange(deepseek_dir, backend: str | None) -> tuple[list[str], torch.Size]:
    """The collectives rank 0's MLA attention runs for a 3-token prefill under tp=2 dcp=2."""
    comm = RecordingDCPComm()
    flags = dict(tp_size=2, dcp_size=DCP) | ({"dcp_comm_backend": backend} if backend else {})
    config, layout = rank_layout(deepseek_dir, {"dcp": comm}, **flags)
    assert (layout.dcp_size, layout.dcp_rank, layout.dcp_comm_backend) == (DCP, 0, config.dcp_comm_backend)
    hf = {**TINY_DEEPSEEK_V2, "q_lora_rank": None}
    rotary = RotaryEmbedding(hf["qk_rope_head_dim"], 64, 10000.0, None, False)
    attn = MLAttention(ModelConfig(hf=hf, parallel=layout), rotary)
    tokens, generator = 3, torch.Generator().manual_seed(0)
    q_nope = torch.randn(tokens, attn.num_heads, attn.nope_dim, generator=generator)
    q_pe = torch.randn(tokens, attn.num_heads, attn.rope_dim, generator=generator)
    kv_c = torch.randn(tokens, attn.kv_lora_rank, generator=generator)
    k_pe = torch.randn(tokens, attn.rope_dim, generator=generator)
    cache = torch.zeros(2, LOGICAL_BLOCK // DCP, 1, attn.kv_lora_rank + attn.rope_dim)
    meta = build_meta([(0, tokens)], [[1]], LOGICAL_BLOCK)
    with torch.no_grad():
        out = attn._attend_dcp(q_nope, q_pe, kv_c, k_pe, cache, meta)
    return comm.calls, out.shape


def test_dcp_comm_backend_picks_the_merge_of_partial_attention(deepseek_dir):
    default_calls, shape = dcp_exchange(deepseek_dir, None)
    assert default_calls == ["all_gather", "all_gather", "reduce_scatter"]  # queries; LSEs; partials (ag_rs)
    assert shape == (3, TINY_DEEPSEEK_V2["num_attention_heads"] // 2, TINY_DEEPSEEK_V2["v_head_dim"])
    calls, a2a_shape = dcp_exchange(deepseek_dir, "a2a")
    assert calls == ["all_gather", "all_to_all"]  # queries; partials and LSEs in one message
    assert a2a_shape == shape


class _World:
    """A stand-in for the engine group's communicator (only its size is read here)."""

    def __init__(self, size: int):
        self.size = size


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    from helpers.tiny_moe import save_tiny_qwen3_moe

    path = tmp_path_factory.mktemp("tiny-qwen3-moe")
    save_tiny_qwen3_moe(path)
    return path


def test_moe_a2a_backend_picks_the_token_exchange_of_expert_parallel_layers(moe_dir):
    """tp=2 ep=2: ``none`` (the default) all-reduces partial expert outputs over the group;
    ``deepep`` (flotilla's all-to-all over torch.distributed, whatever the name) dispatches
    each token to its experts' rank."""
    for flags, dispatcher in (({}, AllReduceDispatch), ({"moe_a2a_backend": "deepep"}, AllToAllDispatch)):
        _, layout = rank_layout(moe_dir, {"tp": _World(2)}, tp_size=2, ep_size=2, **flags)
        assert (layout.ep_size, layout.moe_tp_size) == (2, 1)
        assert type(make_dispatcher(layout)) is dispatcher, flags


# -- --quantization fp8 -----------------------------------------------------------------------


def test_quantization_fp8_serves_a_block_fp8_checkpoint_and_is_refused_for_another(tmp_path):
    """``--quantization fp8`` on a block-FP8 checkpoint: its projections load as float8 with
    their scales and the greedy tokens are those of its dequantized twin. The runtime runs a
    checkpoint's own quantization only, so the flag on the plain twin stops the start."""
    from flotilla import LLM, SamplingParams
    from flotilla.resolution.runtime_support import UnsupportedSettingsError
    from helpers.tiny_fp8 import save_fp8_case

    fp8_dir, dequant_dir = save_fp8_case("qwen3", tmp_path)
    prompts = [[5, 17, 300, 2, 41], [99, 3]]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    fp8 = LLM(str(fp8_dir), platform=preset("cpu"), quantization="fp8")
    assert fp8.config.quantization == "fp8"
    projection = fp8.engine.runner.model.model.layers[0].self_attn.o_proj
    assert projection.weight.dtype == torch.float8_e4m3fn and projection.weight_scale_inv.dtype == torch.float32
    want = [o.outputs[0].token_ids for o in LLM(str(dequant_dir), platform=preset("cpu")).generate(prompts, params)]
    assert [o.outputs[0].token_ids for o in fp8.generate(prompts, params)] == want
    with pytest.raises(UnsupportedSettingsError, match="--quantization fp8 is not supported by flotilla's runtime"):
        LLM(str(dequant_dir), platform=preset("cpu"), quantization="fp8")
