"""`flotilla.LLM` end to end, with HF transformers as the oracle.

A tiny random-weight Llama is saved as safetensors with ``save_pretrained`` and
loaded through ``LLM(model=dir)``; its greedy continuations of several prompts of
different lengths, generated in one batch, must equal HF ``generate`` token for
token, also when a tiny KV pool forces preemption and a tiny token budget forces
chunked prefill. SmolLM2 (the embedded default) answers a chat question.
"""

import subprocess
import sys

import pytest
import torch

from flotilla import LLM, SamplingParams
from helpers.margins import ENGINE_MIN_LEAD
from helpers.tiny_models import hf_greedy, save_tiny_llama
from helpers.torch_threads import one_intra_op_thread

NEW_TOKENS = 40
PROMPT_LENS = (5, 17, 33, 60)


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    with one_intra_op_thread():
        yield


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama")
    model = save_tiny_llama(path)
    generator = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 256, (n,), generator=generator).tolist() for n in PROMPT_LENS]
    expected = [hf_greedy(model, prompt, NEW_TOKENS, min_lead=ENGINE_MIN_LEAD) for prompt in prompts]
    return path, prompts, expected


GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)


def _generate(path, prompts, **flags):
    llm = LLM(str(path), **flags)
    return llm, llm.generate(prompts, GREEDY)


def test_mixed_batch_greedy_equals_hf_generate(tiny_llama):
    from flotilla.cluster.engine.weight_packing import PackedLMHead

    path, prompts, expected = tiny_llama
    llm, outs = _generate(path, prompts)
    assert isinstance(llm.engine.runner.model.lm_head, PackedLMHead)  # the packed CPU GEMM path ran
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert all(o.finished and o.outputs[0].finish_reason == "length" for o in outs)
    assert [o.prompt_token_ids for o in outs] == prompts
    assert llm.engine.scheduler.pool.num_used_blocks == 0


def test_tiny_kv_pool_preempts_and_still_equals_hf(tiny_llama):
    path, prompts, expected = tiny_llama
    # 8 blocks of 16 tokens: each request (<= 100 tokens) fits alone, all four do not.
    llm, outs = _generate(path, prompts, max_total_tokens=128)
    assert llm.engine.runner.kv_layout.num_blocks == 8
    assert llm.engine.scheduler.num_preemptions > 0
    assert [o.outputs[0].token_ids for o in outs] == expected


def test_small_token_budget_chunks_prefill_and_still_equals_hf(tiny_llama):
    path, prompts, expected = tiny_llama
    llm, outs = _generate(path, prompts, chunked_prefill_size=16)
    assert llm.engine.scheduler.config.max_num_batched_tokens == 16
    assert [o.outputs[0].token_ids for o in outs] == expected


def test_shared_prefix_is_served_from_the_prefix_cache(tiny_llama):
    path, prompts, expected = tiny_llama
    llm = LLM(str(path))
    first = llm.generate([prompts[3]], GREEDY)[0]
    again = llm.generate([prompts[3]], GREEDY)[0]
    assert first.num_cached_tokens == 0
    assert again.num_cached_tokens == 48  # the 3 full 16-token blocks of the 60-token prompt
    assert again.outputs[0].token_ids == expected[3]
    assert llm.engine.stats()["prefix_cache_hit_rate"] == pytest.approx(48 / 120)


def test_bad_inputs_raise_naming_the_parameter_and_the_engine_keeps_serving(tiny_llama):
    path, prompts, expected = tiny_llama
    llm = LLM(str(path))
    with pytest.raises(ValueError, match="prompt_token_ids: the prompt is empty"):
        llm.generate([[]], GREEDY)
    with pytest.raises(ValueError, match="prompt_token_ids: the prompt has 300 tokens, but the context length is 256"):
        llm.generate([[5] * 300], GREEDY)
    with pytest.raises(ValueError, match="max_tokens must be at least 1, got max_tokens=0"):
        llm.generate([prompts[0]], SamplingParams(max_tokens=0))
    with pytest.raises(ValueError, match="temperature must be non-negative.*temperature=-1"):
        llm.generate([prompts[0]], SamplingParams(temperature=-1))
    with pytest.raises(ValueError, match=r"top_p must be in \(0, 1\], got top_p=1.5"):
        llm.generate([prompts[0]], SamplingParams(top_p=1.5))
    with pytest.raises(ValueError, match="stop_token_ids contains 999"):
        llm.generate([prompts[0]], SamplingParams(stop_token_ids=[999]))
    # A bad prompt in a batch queues none of it.
    with pytest.raises(ValueError, match="prompt_token_ids"):
        llm.generate([prompts[0], []], GREEDY)
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.scheduler.pool.num_used_blocks == 0
    out = llm.generate([prompts[1]], GREEDY)[0]
    assert out.outputs[0].token_ids == expected[1]


def test_text_prompts_without_a_tokenizer_say_so(tiny_llama):
    path, _, _ = tiny_llama
    llm = LLM(str(path))
    assert llm.tokenizer is None
    with pytest.raises(ValueError, match="prompts: text needs a tokenizer"):
        llm.generate("hello")


def test_config_is_resolved_once_from_server_flags(tiny_llama):
    path, _, _ = tiny_llama
    llm = LLM(str(path), max_total_tokens=512, page_size=32)
    assert llm.config.max_total_tokens == 512 and llm.config.model_path == str(path.resolve())
    assert llm.engine.runner.kv_layout.block_size == 32
    with pytest.raises(ValueError, match="unknown server field 'max_total_tokenz'"):
        LLM(str(path), max_total_tokenz=1)


def test_importing_flotilla_and_sampling_params_does_not_import_torch():
    code = (
        "import sys, flotilla; from flotilla import SamplingParams; SamplingParams(max_tokens=2);"
        "assert 'torch' not in sys.modules, 'torch imported'; print('ok')"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.stdout.strip() == "ok", out.stderr


def _architectures():
    from transformers import (
        DeepseekV2Config, DeepseekV3Config, MistralConfig, MixtralConfig, Qwen2Config, Qwen3Config, Qwen3MoeConfig,
    )

    small = dict(vocab_size=128, hidden_size=64, num_attention_heads=4, max_position_embeddings=256, initializer_range=0.2)
    mla = dict(
        small, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2, kv_lora_rank=32,
        qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12, n_routed_experts=8, num_experts_per_tok=2,
        first_k_dense_replace=1,
    )
    return {
        "mistral_sliding": MistralConfig(**small, num_key_value_heads=2, intermediate_size=96, num_hidden_layers=2, sliding_window=9),
        "qwen2": Qwen2Config(**small, num_key_value_heads=2, intermediate_size=96, num_hidden_layers=2),
        "qwen3": Qwen3Config(**small, num_key_value_heads=2, intermediate_size=96, num_hidden_layers=2, head_dim=24),
        "qwen3_moe": Qwen3MoeConfig(
            **small, num_key_value_heads=2, head_dim=16, intermediate_size=96, moe_intermediate_size=32,
            num_hidden_layers=2, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
        ),
        "mixtral": MixtralConfig(
            **small, num_key_value_heads=2, intermediate_size=48, num_hidden_layers=2, num_local_experts=4,
            num_experts_per_tok=2,
        ),
        "deepseek_v2": DeepseekV2Config(**mla, q_lora_rank=None, n_shared_experts=2),
        "deepseek_v3": DeepseekV3Config(**mla, q_lora_rank=24, n_shared_experts=1, n_group=4, topk_group=2, norm_topk_prob=True),
    }


@pytest.mark.parametrize("arch", ["mistral_sliding", "qwen2", "qwen3", "qwen3_moe", "mixtral", "deepseek_v2", "deepseek_v3"])
def test_every_architecture_greedy_equals_hf_through_the_engine(arch, tmp_path):
    """Mixed lengths in one batch, with chunked prefill and a pool small enough to preempt."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(_architectures()[arch]).eval()
    hf.save_pretrained(tmp_path)
    generator = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, 128, (n,), generator=generator).tolist() for n in (7, 20, 45)]
    expected = [hf_greedy(hf, p, 32, min_lead=ENGINE_MIN_LEAD) for p in prompts]
    llm = LLM(str(tmp_path), chunked_prefill_size=16, max_total_tokens=128)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.scheduler.pool.num_used_blocks == 0


@pytest.fixture(scope="module")
def smollm2():
    return LLM()


def test_smollm2_chat_answers_paris(smollm2):
    out = smollm2.chat(
        [{"role": "user", "content": "What is the capital of France?"}], SamplingParams(temperature=0, max_tokens=24)
    )
    completion = out[0].outputs[0]
    assert "Paris" in completion.text
    assert out[0].prompt.startswith("<|im_start|>")


def test_smollm2_text_prompts_stop_strings_and_logprobs(smollm2):
    params = SamplingParams(temperature=0, max_tokens=12, stop=[" Paris"], logprobs=2)
    (out,) = smollm2.generate("The capital of France is", params)
    completion = out.outputs[0]
    assert completion.finish_reason == "stop" and completion.stop_reason == " Paris"
    assert "Paris" not in completion.text
    assert len(completion.logprobs) == len(completion.token_ids)
    assert all(len(step) >= 2 for step in completion.logprobs)
    # Greedy: every sampled token is the most likely one.
    assert all(step[t].rank == 1 for step, t in zip(completion.logprobs, completion.token_ids))
