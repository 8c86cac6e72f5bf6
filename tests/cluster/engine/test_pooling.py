"""Embedding requests (``SamplingParams.pooling``) in the engine, on the tiny random Llama:
the ``last`` and ``mean`` vectors equal HF transformers' final hidden states (normalised),
whole or prefilled in chunks, with a prefix-cache hit, batched beside generation requests,
and on a tp_size=2 worker group (including a step whose logits come back to the driver for a
seeded row).

Tolerance: both sides compute the same float32 model; the hidden states differ by summation
order only (<= ~6e-6 on the tiny Llama's logits of magnitude ~5, ``helpers.margins``), and a
unit vector's components are ~1/sqrt(64) = 0.125, so 1e-5 per component leaves room while a
wrong position, a missed chunk or an unnormalised vector is off by more than 1e-2."""

import pytest
import torch

from flotilla import LLM, SamplingParams
from flotilla.cluster.engine.group_runner import GroupRunner

ATOL = 1e-5


@pytest.fixture(scope="module")
def reference(tiny_llama_prompts):
    """HF's normalised last-token and mean final hidden state of each prompt."""
    from transformers import AutoModelForCausalLM

    path, prompts = tiny_llama_prompts
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for prompt in prompts:
            hidden = model.model(torch.tensor([prompt])).last_hidden_state[0]
            last, mean = hidden[-1], hidden.mean(dim=0)
            out.append({"last": last / last.norm(), "mean": mean / mean.norm()})
    return out


def embeddings(llm, prompts, pooling, extra=()):
    params = [SamplingParams(pooling=pooling)] * len(prompts) + [p for _, p in extra]
    items = [{"prompt_token_ids": p} for p in prompts] + [{"prompt_token_ids": p} for p, _ in extra]
    outputs = llm.generate(items, params)
    for o in outputs[: len(prompts)]:
        assert o.outputs[0].finish_reason == "stop" and o.outputs[0].token_ids == []
    return [torch.tensor(o.outputs[0].embedding) for o in outputs[: len(prompts)]], outputs[len(prompts) :]


@pytest.mark.parametrize("flags", [{}, {"chunked_prefill_size": 16}], ids=["whole", "chunked"])
def test_pooled_vectors_equal_hf_hidden_states(tiny_llama_prompts, reference, flags):
    path, prompts = tiny_llama_prompts
    llm = LLM(path, max_total_tokens=1024, **flags)
    try:
        for pooling in ("last", "mean"):
            got, _ = embeddings(llm, prompts, pooling)
            for vector, want in zip(got, reference):
                assert vector.norm().item() == pytest.approx(1.0, abs=1e-6)
                torch.testing.assert_close(vector, want[pooling], atol=ATOL, rtol=0)
        # NOTE: the prompts' blocks are in the prefix cache now: a hit keeps both exact.
        again_last, _ = embeddings(llm, prompts, "last")
        again_mean, _ = embeddings(llm, prompts, "mean")
        assert llm.engine.scheduler.pool.num_used_blocks == 0
        for last, mean, want in zip(again_last, again_mean, reference):
            torch.testing.assert_close(last, want["last"], atol=ATOL, rtol=0)
            torch.testing.assert_close(mean, want["mean"], atol=ATOL, rtol=0)
        generate = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
        mixed, generated = embeddings(llm, prompts[:2], "mean", extra=[(prompts[2], generate)])
        assert len(generated[0].outputs[0].token_ids) == 4
        for vector, want in zip(mixed, reference):
            torch.testing.assert_close(vector, want["mean"], atol=ATOL, rtol=0)
        with pytest.raises(ValueError, match=r"pooling='last' \(an embedding request\) takes n=1"):
            llm.generate([{"prompt_token_ids": prompts[0]}], SamplingParams(pooling="last", n=2))
    finally:
        llm.shutdown()


def test_a_tp2_group_pools_on_its_ranks(ray_cluster, tiny_llama_prompts, reference):
    """The ranks pool next to their hidden states; a step with a seeded row brings its logits
    back to the driver, and the vectors come with them."""
    path, prompts = tiny_llama_prompts
    llm = LLM(path, max_total_tokens=1024, tp_size=2, chunked_prefill_size=16)
    try:
        assert isinstance(llm.engine.runner, GroupRunner)
        seeded = SamplingParams(temperature=0.8, seed=3, max_tokens=2, ignore_eos=True)
        for pooling, extra in (("last", ()), ("mean", [(prompts[0], seeded)])):
            got, generated = embeddings(llm, prompts, pooling, extra)
            assert all(len(g.outputs[0].token_ids) == 2 for g in generated)
            for vector, want in zip(got, reference):
                torch.testing.assert_close(vector, want[pooling], atol=ATOL, rtol=0)
    finally:
        llm.shutdown()
