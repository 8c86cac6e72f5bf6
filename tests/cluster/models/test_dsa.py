"""DeepSeek sparse attention models, DeepSeek-V3.2 (``DeepseekV32ForCausalLM``) and GLM-5 with
IndexShare (``GlmMoeDsaForCausalLM``, layers 1 and 3 shared), against HF transformers 5.24 (the
oracle), tiny random weights, float32, prompts longer than ``index_topk`` (8): every query past
position 8 attends to 8 of its tokens.

Tolerance: atol 1e-4 on logits of magnitude ~5. Where both models attend to the same tokens they
differ in float32 summation order only (absorbed against expanded MLA, fused experts, paged
gathers): ~3e-6, whatever the CPU's SIMD width. The selections are the same when no query's top-k
boundary is closer than float32 noise: :class:`~helpers.tiny_dsa.SelectionMargins` recomputes every
indexer call's scores and the test requires the smallest gap between a kept and a dropped score to
be at least 1e-3, a thousand times the ~1e-6 by which HF's scores and ours can differ. A selection
that ignores the indexer (dense attention) moves these logits by 1e-1 or more (checked below), a
wrong indexer rotary layout or a shared layer running its own top-k by 1e-2 or more.
"""

from __future__ import annotations

import pytest
import torch

from flotilla import LLM, SamplingParams
from flotilla.cluster.models.base import ModelConfig
from flotilla.cluster.models.dsa import DeepseekV32ForCausalLM, GlmMoeDsaForCausalLM
from flotilla.cluster.models.registry import model_class
from flotilla.resolution import ModelFacts
from helpers.paged import PagedRunner
from helpers.prompts import random_prompts
from helpers.tiny_dsa import ENGINE_PROMPT_LENS, SelectionMargins, save_tiny_dsa, tiny_dsa
from helpers.tiny_models import hf_greedy
from helpers.torch_threads import one_intra_op_thread

ATOL = 1e-4
MIN_MARGIN = 1e-4
NEW_TOKENS = 32
OURS = {"deepseek_v32": DeepseekV32ForCausalLM, "glm5": GlmMoeDsaForCausalLM}
ARCHS = sorted(OURS)


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    with one_intra_op_thread():
        yield


def _pair(arch: str, **overrides):
    hf = tiny_dsa(arch, **overrides)
    ours = OURS[arch](ModelConfig(hf=hf.config.to_dict()))
    loaded = ours.load_weights(hf.state_dict().items())
    assert loaded == set(dict(ours.named_parameters())), "every parameter must come from the checkpoint"
    return hf, ours


def test_architectures_are_registered():
    assert model_class("DeepseekV32ForCausalLM") is DeepseekV32ForCausalLM
    assert model_class("GlmMoeDsaForCausalLM") is GlmMoeDsaForCausalLM


def test_glm5_shared_layers_have_no_indexer_and_cache_no_indexer_keys():
    _, ours = _pair("glm5")
    assert [layer.self_attn.indexer is not None for layer in ours.layers] == [True, False, True, False]
    latent, keys = (1, 32 + 8), (1, 16)
    spec = ours.kv_cache_spec()
    assert spec.shapes() == ((latent, keys), (latent,), (latent, keys), (latent,))
    assert spec.bytes_per_token() == 4 * (4 * 40 + 2 * 16)
    _, v32 = _pair("deepseek_v32")
    assert v32.kv_cache_spec().shapes() == ((latent, keys),) * 4


@pytest.mark.parametrize("arch", ARCHS)
def test_ragged_prefill_logits_and_greedy_decode_match_hf(arch):
    hf, ours = _pair(arch)
    margins = SelectionMargins().attach(ours)
    prompts = random_prompts((21, 13), 128)
    runner = PagedRunner(ours, len(prompts), max(map(len, prompts)) + NEW_TOKENS)
    prefill = runner.step(dict(enumerate(prompts)))  # both prompts in one varlen step
    outputs = [[int(prefill[b][-1].argmax())] for b in range(len(prompts))]
    for _ in range(NEW_TOKENS - 1):
        logits = runner.step({b: out[-1:] for b, out in enumerate(outputs)})
        for b, out in enumerate(outputs):
            out.append(int(logits[b][-1].argmax()))
    assert margins.smallest >= MIN_MARGIN, f"a top-k boundary is {margins.smallest:.2e} wide: reseed the fixture"
    for b, prompt in enumerate(prompts):
        with torch.no_grad():
            expected = hf(torch.tensor([prompt])).logits[0]
        torch.testing.assert_close(prefill[b], expected, atol=ATOL, rtol=0)
        assert outputs[b] == hf_greedy(hf, prompt, NEW_TOKENS)


@pytest.mark.parametrize("arch", ARCHS)
def test_the_selection_matters_at_these_lengths(arch):
    """The same weights with a top-k above the prompt length (dense attention) give other logits:
    the comparison above checks the sparse selection, not dense MLA."""
    prompt = random_prompts((21,), 128)[0]
    with torch.no_grad():
        sparse = tiny_dsa(arch)(torch.tensor([prompt])).logits[0]
        dense = tiny_dsa(arch, index_topk=64)(torch.tensor([prompt])).logits[0]
    assert float((sparse - dense).abs().max()) > 1e-1


GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)


@pytest.mark.parametrize("arch", ARCHS)
def test_engine_greedy_equals_hf_through_chunks_preemption_and_the_prefix_cache(arch, tmp_path):
    """A mixed batch through chunked prefill (16-token chunks) and a pool small enough to preempt
    (3 of DSA's 64-token pages for requests needing 4), then the long prompt again from the prefix
    cache: its cached page carries the indexer keys as well as the latents."""
    hf = save_tiny_dsa(tmp_path, arch)
    prompts = random_prompts(ENGINE_PROMPT_LENS, 128, seed=2)
    expected = [hf_greedy(hf, p, NEW_TOKENS) for p in prompts]
    llm = LLM(str(tmp_path), chunked_prefill_size=16, max_total_tokens=192)
    assert llm.engine.runner.kv_layout.block_size == 64  # the seeds' DSA page size
    assert (llm.config.dsa_prefill_backend, llm.config.dsa_decode_backend) == ("torch", "torch")
    assert llm.engine.runner.startup_report()["dsa_backend"] == "torch"
    # NOTE: the KV budget counts the indexer keys: 4 latents of 40 and the full layers' 16-wide keys.
    spec_bytes = llm.engine.runner.model.kv_cache_spec().bytes_per_token()
    assert llm.engine.runner.kv_layout.bytes_per_token == spec_bytes > 4 * 4 * 40
    margins = SelectionMargins().attach(llm.engine.runner.model)
    outs = llm.generate(prompts, GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert llm.engine.scheduler.num_preemptions > 0
    again = llm.generate([prompts[2]], GREEDY)[0]
    assert again.num_cached_tokens == 64 and again.outputs[0].token_ids == expected[2]
    assert margins.smallest >= MIN_MARGIN, f"a top-k boundary is {margins.smallest:.2e} wide: reseed the fixture"


def test_the_runtime_builds_the_resolved_pattern():
    """The model's layers follow the pattern resolution derives (ModelFacts.index_topk_pattern)
    from GLM-5.2's indexer_types, with index_topk_pattern null as that checkpoint ships it."""
    tiny = dict(
        vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=6,
        num_attention_heads=2, num_key_value_heads=2, kv_lora_rank=16, q_lora_rank=12, qk_nope_head_dim=8,
        qk_rope_head_dim=4, v_head_dim=8, n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1,
        first_k_dense_replace=1, max_position_embeddings=64, index_topk=4, index_head_dim=8, index_n_heads=2,
        architectures=["GlmMoeDsaForCausalLM"], model_type="glm_moe_dsa", index_topk_pattern=None,
        indexer_types=["full", "full", "shared", "full", "shared", "shared"],
    )  # fmt: skip
    facts = ModelFacts.from_hf_config(tiny)
    with torch.device("meta"):
        model = GlmMoeDsaForCausalLM(ModelConfig(hf=tiny))
    built = "".join("F" if layer.self_attn.indexer is not None else "S" for layer in model.layers)
    assert built == facts.index_topk_pattern == "FFSFSS"
