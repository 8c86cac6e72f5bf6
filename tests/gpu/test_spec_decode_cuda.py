"""Speculative decoding on a GPU (cluster/engine/speculative.py): the verify step's logits, the
sampler's verification and a seeded row's generator rewind on CUDA tensors. The oracle is the
same engine without speculation.

float32, so the runners take the torch references (no flashinfer, no decode graphs) and the
two engines differ only by the summation order of a 1 + k-position forward against a
one-position one: on these random models the greedy leads are far above that (the CPU tests
assert the same comparisons with their margins), and a seeded draw is an exponential race
decided by far more.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from flotilla.cluster.engine.llm import LLM
from flotilla.cluster.engine.sampling_params import SamplingParams
from gpu.models import dummy_weights_drawn_on_cpu, write_smollm2_dummy_dir
from helpers.prompts import random_prompts
from helpers.tiny_models import save_tiny_llama

pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"), pytest.mark.timeout(1800)]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama-spec")
    save_tiny_llama(path)
    return path


def run(path, prompts, params, **flags):
    """``(each prompt's tokens, the engine's stats, KV blocks still used)``."""
    llm = LLM(str(path), device="cuda", dtype="float32", max_total_tokens=4096, skip_tokenizer_init=True, **flags)
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        return [o.outputs[0].token_ids for o in outs], llm.engine.stats(), llm.engine.scheduler.pool.num_used_blocks
    finally:
        llm.shutdown()


def test_ngram_on_cuda_gives_the_plain_tokens_greedy_and_seeded(tiny_dir):
    prompts = [p * 3 for p in random_prompts([6, 9, 13], 256, seed=2)]
    greedy = SamplingParams(temperature=0, max_tokens=96, ignore_eos=True)
    seeded = SamplingParams(temperature=0.8, top_p=0.95, seed=11, max_tokens=64, ignore_eos=True)
    ngram = {"speculative_algorithm": "NGRAM", "speculative_num_draft_tokens": 6}
    for params in (greedy, seeded):
        plain, _, _ = run(tiny_dir, prompts, params)
        spec, stats, used = run(tiny_dir, prompts, params, **ngram)
        assert spec == plain
        assert stats["spec_decode_num_draft_tokens"] > stats["spec_decode_num_accepted_tokens"] > 0
        assert used == 0


def test_eagle_head_on_cuda_gives_the_plain_tokens(tiny_dir, tmp_path):
    from safetensors.torch import save_file
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    config = {**json.loads((Path(tiny_dir) / "config.json").read_text()), "num_hidden_layers": 1, "bias": True}
    head = tmp_path / "eagle"
    head.mkdir()
    (head / "config.json").write_text(json.dumps(config))
    torch.manual_seed(5)
    layer = LlamaDecoderLayer(LlamaConfig(**{k: v for k, v in config.items() if k != "architectures"}), 0)
    fc = torch.nn.Linear(128, 64, bias=True)
    for param in [*layer.parameters(), *fc.parameters()]:
        torch.nn.init.normal_(param, std=0.2)
    tensors = {f"layers.0.{k}": v.contiguous() for k, v in layer.state_dict().items() if "input_layernorm" not in k}
    tensors.update({"fc.weight": fc.weight.detach().contiguous(), "fc.bias": fc.bias.detach().contiguous()})
    save_file(tensors, str(head / "model.safetensors"), metadata={"format": "pt"})
    prompts = random_prompts([6, 9, 13], 256, seed=4)
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    plain, _, _ = run(tiny_dir, prompts, params)
    spec, stats, used = run(tiny_dir, prompts, params, speculative_algorithm="EAGLE", speculative_draft_model_path=str(head))
    assert spec == plain and stats["spec_decode_num_draft_tokens"] > 0 and used == 0


def test_standalone_self_draft_on_cuda_accepts_every_draft(tmp_path):
    """SmolLM2's shape with random weights as target and as its own draft (the same dummy
    tensors, drawn on the CPU for both loads): every greedy draft is accepted."""
    path = write_smollm2_dummy_dir(tmp_path / "smollm2")
    prompts = random_prompts([12, 30], 49152, seed=3)
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    with dummy_weights_drawn_on_cpu():
        plain, _, _ = run(path, prompts, params, load_format="dummy")
        spec, stats, used = run(
            path, prompts, params, load_format="dummy", speculative_algorithm="STANDALONE",
            speculative_draft_model_path=path,
        )  # fmt: skip
    assert spec == plain and used == 0
    assert stats["spec_decode_num_draft_tokens"] > 0 and stats["spec_decode_acceptance_rate"] == 1.0


def test_nextn_on_cuda_gives_the_plain_tokens(tmp_path):
    """A tiny random DeepSeek-V3 with one MTP layer (its block a transformers decoder layer,
    saved in DeepSeek's checkpoint layout as tests/cluster/models/test_mtp.py saves it) on
    CUDA: the tokens with NEXTN drafting are the plain engine's."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3DecoderLayer

    from helpers.tiny_deepseek import TINY_DEEPSEEK_V3_MTP
    from helpers.tiny_dsa import add_checkpoint_tensors, mtp_checkpoint_tensors
    from helpers.tiny_fp8 import randomize
    from helpers.tiny_glm import randomize_correction_bias

    settings = {k: v for k, v in TINY_DEEPSEEK_V3_MTP.items() if k != "num_nextn_predict_layers"}
    torch.manual_seed(0)
    config = DeepseekV3Config(**settings)
    main = DeepseekV3ForCausalLM(config).eval()
    randomize(main, 0)
    randomize_correction_bias(main, 0)
    block = DeepseekV3DecoderLayer(config, 2).eval()
    randomize(block, 7)
    randomize_correction_bias(block, 7)
    hidden = settings["hidden_size"]
    state = {f"layers.0.mtp_block.{k}": v for k, v in block.state_dict().items()}
    state.update({
        "layers.0.enorm.weight": 1 + 0.1 * torch.randn(hidden), "layers.0.hnorm.weight": 1 + 0.1 * torch.randn(hidden),
        "layers.0.eh_proj.weight": 0.2 * torch.randn(hidden, 2 * hidden), "layers.0.post_norm.weight": 1 + 0.1 * torch.randn(hidden),
    })  # fmt: skip
    path = tmp_path / "tiny-v3-mtp"
    main.save_pretrained(path)
    add_checkpoint_tensors(path, mtp_checkpoint_tensors(main, state, settings["num_hidden_layers"]))
    written = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**written, "num_nextn_predict_layers": 1}))
    prompts = random_prompts([8, 15, 26], 128, seed=6)
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    plain, _, _ = run(path, prompts, params)
    spec, stats, used = run(path, prompts, params, speculative_algorithm="NEXTN")
    assert spec == plain and stats["spec_decode_num_draft_tokens"] > 0 and used == 0
