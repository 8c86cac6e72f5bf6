"""DeepSeek-V2/V3 (MLA + MoE with shared experts) against HF transformers (the oracle).

Tiny random-weight models (HF's init, std 0.02), float32, seeded. Logit tolerance: atol
1e-5. Our attention is the absorbed form (queries mapped into the latent space through
``w_kc``, the attended latent mapped out through ``w_vc``) where HF expands per-head keys
and values: equal in exact arithmetic, different float32 rounding order (<= 2.1e-7 on
logits of magnitude ~0.6, measured with MKL_CBWR, ATEN_CPU_CAPABILITY and 1-3 threads).
1e-5 leaves 50x headroom; a wrong rope layout or mscale moves these logits by ~1e-3, a
wrong routing group, bias or scaling by ~1e-2.

Greedy tokens are compared with HF's ``generate``: every token chosen here leads the
runner-up by more than 2 * ATOL (``helpers.margins.greedy_token``; the smallest lead is
1.3e-4). Routing: the closest last-chosen / first-unchosen experts are 1.2e-5 apart in
probability (group scores: 1.3e-4), far above their rounding (below 1e-7 at this init).
"""

from __future__ import annotations

import pytest
import torch
from transformers import DeepseekV2Config, DeepseekV3Config
from transformers import DeepseekV2ForCausalLM as HFDeepseekV2
from transformers import DeepseekV3ForCausalLM as HFDeepseekV3

from flotilla.cluster.models.base import ModelConfig
from flotilla.cluster.models.deepseek import DeepseekV2ForCausalLM, DeepseekV3ForCausalLM
from flotilla.cluster.models.loader import iter_hf_weights
from helpers.margins import greedy_token
from helpers.paged import PagedRunner
from helpers.torch_threads import one_intra_op_thread

ATOL = 1e-5
BLOCK_SIZE = 4
NEW_TOKENS = 32
PROMPT_LENS = (11, 6)

_SMALL = dict(
    vocab_size=128, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
    num_attention_heads=4, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12,
    n_routed_experts=8, num_experts_per_tok=2, first_k_dense_replace=1, max_position_embeddings=256,
)
# mscale != mscale_all_dim, so YaRN scales both cos/sin (attention factor) and the softmax scale.
_YARN = {
    "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64,
    "mscale": 1.0, "mscale_all_dim": 0.8, "beta_fast": 32, "beta_slow": 1,
}
CASES = {
    # V2-Lite shape: no q LoRA, plain greedy softmax routing, two shared experts.
    "v2_lite": (HFDeepseekV2, DeepseekV2ForCausalLM, DeepseekV2Config(**_SMALL, q_lora_rank=None, n_shared_experts=2)),
    # V2 shape: q LoRA, group-limited routing (top_k > topk_group, so the limit bites), routed scaling, YaRN.
    "v2_grouped_yarn": (
        HFDeepseekV2,
        DeepseekV2ForCausalLM,
        DeepseekV2Config(
            **_SMALL, q_lora_rank=24, n_shared_experts=1, topk_method="group_limited_greedy", n_group=4, topk_group=1,
            routed_scaling_factor=1.5, rope_parameters=_YARN,
        ),
    ),
    # V3 shape: sigmoid + correction bias over groups, renormalised, scaled, YaRN, interleaved rope.
    "v3": (
        HFDeepseekV3,
        DeepseekV3ForCausalLM,
        DeepseekV3Config(
            **_SMALL, q_lora_rank=24, n_shared_experts=1, n_group=4, topk_group=2, norm_topk_prob=True,
            routed_scaling_factor=2.5, rope_parameters=_YARN,
        ),
    ),
    # rope_interleave=False: HF's rotate-half layout (is_neox), one expert group.
    "v3_neox_rope": (
        HFDeepseekV3,
        DeepseekV3ForCausalLM,
        DeepseekV3Config(
            **_SMALL, q_lora_rank=None, n_shared_experts=1, n_group=1, topk_group=1, rope_interleave=False,
        ),
    ),
}


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    with one_intra_op_thread():
        yield


# --------------------------------------------------------------------------- paged-step helper


def build_pair(case: str):
    hf_cls, our_cls, hf_config = CASES[case]
    torch.manual_seed(0)
    hf_model = hf_cls(hf_config).eval()
    for module in hf_model.modules():  # HF starts the bias at zero; make it matter
        if hasattr(module, "e_score_correction_bias"):
            module.e_score_correction_bias.normal_(0.0, 0.05)
    ours = our_cls(ModelConfig(hf=hf_config.to_dict()))
    loaded = ours.load_weights(hf_model.state_dict().items())
    assert loaded == set(dict(ours.named_parameters())), "every parameter must come from the checkpoint"
    return hf_model, ours


def prompts_for(vocab: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(1)
    return [torch.randint(0, vocab, (n,), generator=generator).tolist() for n in PROMPT_LENS]


# --------------------------------------------------------------------------- tests


@pytest.mark.parametrize("case", sorted(CASES))
def test_ragged_prefill_logits_and_greedy_decode_match_hf(case):
    hf_model, ours = build_pair(case)
    prompts = prompts_for(hf_model.config.vocab_size)
    runner = PagedRunner(ours, len(prompts), max(PROMPT_LENS) + NEW_TOKENS, BLOCK_SIZE)
    prefill = runner.step(dict(enumerate(prompts)))  # both prompts in one varlen step
    outputs = [[greedy_token(prefill[b][-1], 2 * ATOL)] for b in range(len(prompts))]
    for _ in range(NEW_TOKENS - 1):
        logits = runner.step({b: out[-1:] for b, out in enumerate(outputs)})
        for b, out in enumerate(outputs):
            out.append(greedy_token(logits[b][-1], 2 * ATOL))

    for b, prompt in enumerate(prompts):
        with torch.no_grad():
            expected = hf_model(torch.tensor([prompt])).logits[0]
        torch.testing.assert_close(prefill[b], expected, atol=ATOL, rtol=0)
        hf_model.generation_config.eos_token_id = None  # run all NEW_TOKENS steps, EOS allowed
        generated = hf_model.generate(
            torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0
        )
        hf_tokens = generated[0, len(prompt) :].tolist()
        assert outputs[b] == hf_tokens


def test_chunked_prefill_attends_to_cached_latents():
    """The second chunk of a prompt reads the first chunk's latents from the cache."""
    hf_model, ours = build_pair("v3")
    prompt = prompts_for(hf_model.config.vocab_size)[0]
    runner = PagedRunner(ours, 1, len(prompt))
    chunks = [runner.step({0: prompt[:5]})[0], runner.step({0: prompt[5:]})[0]]
    with torch.no_grad():
        expected = hf_model(torch.tensor([prompt])).logits[0]
    torch.testing.assert_close(torch.cat(chunks), expected, atol=ATOL, rtol=0)


def test_checkpoint_names_load_like_the_in_memory_state(tmp_path):
    """A saved checkpoint has per-expert tensors and the whole kv_b_proj; both must land
    where transformers' in-memory state does (kv_b_proj split into w_kc / w_vc)."""
    hf_model, from_memory = build_pair("v3")
    hf_model.save_pretrained(tmp_path)
    _, our_cls, hf_config = CASES["v3"]
    from_disk = our_cls(ModelConfig(hf=hf_config.to_dict()))
    assert from_disk.load_weights(iter_hf_weights(tmp_path)) == set(dict(from_disk.named_parameters()))
    disk_params = dict(from_disk.named_parameters())
    for name, param in from_memory.named_parameters():
        assert torch.equal(param, disk_params[name]), name


def test_latent_cache_spec_and_layer_kinds():
    _, ours = build_pair("v3")
    spec = ours.kv_cache_spec()
    assert spec.num_layers == 3 and spec.tensors_per_layer == ((1, 32 + 8),)
    assert [type(layer.mlp).__name__ for layer in ours.layers] == ["GatedMLP", "DeepseekMoE", "DeepseekMoE"]
    assert ours.layers[1].mlp.gate.e_score_correction_bias is not None


def test_multi_token_prediction_layers_are_skipped():
    """V3 checkpoints carry MTP layers after the last decoder layer; they are not served."""
    _, ours = build_pair("v3")
    ours.load_weights([("model.layers.3.eh_proj.weight", torch.zeros(64, 128))])
    with pytest.raises(ValueError, match="layers.2.eh_proj"):
        ours.load_weights([("model.layers.2.eh_proj.weight", torch.zeros(64, 128))])
