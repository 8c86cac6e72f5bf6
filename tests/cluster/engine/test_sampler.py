"""The batched sampler: greedy, truncation masks, seeds, penalties and logprobs."""

import importlib.util
import math

import pytest
import torch

from flotilla.cluster.engine import sampler as sampler_module
from flotilla.cluster.engine.sampler import Sampler, SamplingRow, apply_penalties, greedy_argmax, truncated_probs
from flotilla.cluster.engine.sampling_params import SamplingParams


def _rows(params, n):
    return [SamplingRow(params) for _ in range(n)]


def test_greedy_is_argmax_per_row():
    logits = torch.randn(5, 50, generator=torch.Generator().manual_seed(0))
    out = Sampler()(logits, _rows(SamplingParams(temperature=0), 5))
    assert [t.token_id for t in out] == logits.argmax(-1).tolist()


def test_greedy_and_sampled_rows_mix_in_one_batch():
    logits = torch.randn(3, 40, generator=torch.Generator().manual_seed(1))
    rows = [SamplingRow(SamplingParams(temperature=0)), SamplingRow(SamplingParams(top_k=1)), SamplingRow(SamplingParams(temperature=0))]
    out = [t.token_id for t in Sampler()(logits, rows)]
    # top_k=1 leaves only the argmax, so every row gives the argmax.
    assert out == logits.argmax(-1).tolist()


def test_greedy_argmax_on_cpu_is_torch_argmax_and_never_loads_triton():
    """CPU logits (float32 or not) take ``torch.argmax``: the same indices on ties, NaNs and
    signed zeros, and the Triton module is never looked up (tests/gpu/test_triton_argmax.py
    covers the CUDA path)."""
    nan, inf = float("nan"), float("inf")
    logits = torch.tensor([[1.0, nan, 3.0, nan], [-0.0, 0.0, -1.0, -2.0], [-inf] * 4, [2.0, 5.0, 5.0, 1.0]])
    lookups = sampler_module._triton_argmax.cache_info()
    for x in (logits, logits.double(), logits.to(torch.bfloat16), logits[:1]):
        assert torch.equal(greedy_argmax(x), x.argmax(dim=-1))
    assert greedy_argmax(logits).tolist() == [1, 0, 0, 1]
    assert sampler_module._triton_argmax.cache_info() == lookups


def test_the_triton_argmax_loader_gives_none_exactly_when_triton_is_missing():
    """The sampler's CUDA path imports the kernel module lazily and falls back to torch (None)
    on a machine without Triton, as this CPU venv is; with Triton it gives the module."""
    module = sampler_module._triton_argmax()
    assert (module is None) == (importlib.util.find_spec("triton") is None)
    if module is not None:
        assert callable(module.greedy_argmax) and module.MAX_ROWS == 8


def test_top_k_keeps_exactly_the_k_largest():
    logits = torch.tensor([[1.0, 5.0, 3.0, 4.0, 2.0]])
    probs = truncated_probs(logits, [SamplingParams(top_k=2)])
    assert (probs[0] > 0).tolist() == [False, True, False, True, False]
    assert probs.sum().item() == pytest.approx(1.0)


def test_top_p_keeps_the_smallest_prefix_reaching_p():
    probs_in = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    logits = probs_in.log()
    kept = truncated_probs(logits, [SamplingParams(top_p=0.8)])[0] > 0
    assert kept.tolist() == [True, True, False, False]  # 0.5 + 0.3 reaches 0.8
    kept = truncated_probs(logits, [SamplingParams(top_p=0.81)])[0] > 0
    assert kept.tolist() == [True, True, True, False]
    # The most likely token always survives.
    kept = truncated_probs(logits, [SamplingParams(top_p=0.01)])[0] > 0
    assert kept.tolist() == [True, False, False, False]


def test_min_p_drops_tokens_below_a_fraction_of_the_best():
    logits = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log()
    kept = truncated_probs(logits, [SamplingParams(min_p=0.5)])[0] > 0
    assert kept.tolist() == [True, True, False, False]  # 0.15 < 0.5 * 0.5


def test_temperature_sharpens_the_distribution():
    logits = torch.tensor([[2.0, 1.0, 0.0]])
    cold = truncated_probs(logits, [SamplingParams(temperature=0.5)])[0]
    hot = truncated_probs(logits, [SamplingParams(temperature=2.0)])[0]
    assert cold[0] > torch.softmax(logits, -1)[0, 0] > hot[0]
    assert cold[0].item() == pytest.approx(torch.softmax(logits[0] / 0.5, -1)[0].item())


def test_sampled_tokens_follow_the_distribution_and_respect_masks():
    logits = torch.tensor([0.6, 0.3, 0.1, 0.0]).clamp(min=1e-9).log().repeat(4000, 1)
    out = Sampler(torch.Generator().manual_seed(3))(logits, _rows(SamplingParams(temperature=1.0), 4000))
    counts = torch.bincount(torch.tensor([t.token_id for t in out]), minlength=4).float() / 4000
    assert counts[3] == 0
    assert torch.allclose(counts[:3], torch.tensor([0.6, 0.3, 0.1]), atol=0.03)


def test_a_seed_reproduces_the_same_tokens_whatever_the_batch():
    vocab = 100
    logits = torch.randn(1, vocab, generator=torch.Generator().manual_seed(5))
    params = SamplingParams(temperature=1.0, seed=1234)

    def run(batch_noise_rows):
        gen = torch.Generator().manual_seed(params.seed)
        others = torch.randn(batch_noise_rows, vocab)
        tokens = []
        for _ in range(20):
            batch = torch.cat([others, logits]) if batch_noise_rows else logits
            rows = _rows(SamplingParams(), batch_noise_rows) + [SamplingRow(params, generator=gen)]
            tokens.append(Sampler()(batch, rows)[-1].token_id)
        return tokens

    alone, crowded = run(0), run(7)
    assert alone == crowded
    assert len(set(alone)) > 1  # it really samples


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits():
    logits = torch.tensor([[2.0, -2.0, 1.0, -1.0]])
    row = SamplingRow(SamplingParams(repetition_penalty=2.0), token_ids=[0, 1], num_prompt_tokens=2)
    out = apply_penalties(logits.clone(), [row])
    assert out.tolist() == [[1.0, -4.0, 1.0, -1.0]]


def test_presence_and_frequency_penalties_count_output_tokens_only():
    logits = torch.zeros(1, 4)
    params = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25)
    # prompt [3], output [1, 1, 2]
    row = SamplingRow(params, token_ids=[3, 1, 1, 2], num_prompt_tokens=1)
    out = apply_penalties(logits.clone(), [row])
    assert out.tolist() == [[0.0, -(0.5 + 2 * 0.25), -(0.5 + 0.25), 0.0]]


def test_penalties_change_the_greedy_choice():
    logits = torch.tensor([[3.0, 2.9, 0.0]])
    row = SamplingRow(SamplingParams(temperature=0, frequency_penalty=1.0), token_ids=[5, 0], num_prompt_tokens=1)
    assert Sampler()(logits, [row])[0].token_id == 1


def test_logprobs_are_raw_log_softmax_with_rank_and_top_candidates():
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0]])
    params = SamplingParams(temperature=0, logprobs=2, repetition_penalty=2.0)
    row = SamplingRow(params, token_ids=[1], num_prompt_tokens=1)
    (tok,) = Sampler()(logits, [row])
    raw = torch.log_softmax(logits, -1)[0]
    # The penalty moves the choice from token 1 to token 2, but logprobs stay raw.
    assert tok.token_id == 2 and tok.rank == 2
    assert tok.logprob == pytest.approx(raw[2].item())
    assert [t for t, _ in tok.top_logprobs] == [1, 2]
    assert tok.top_logprobs[0][1] == pytest.approx(raw[1].item())
    assert math.exp(tok.top_logprobs[0][1]) < 1


def test_rows_without_logprobs_get_none_and_zero_gives_only_the_sampled_token():
    logits = torch.randn(2, 10)
    rows = [SamplingRow(SamplingParams(temperature=0)), SamplingRow(SamplingParams(temperature=0, logprobs=0))]
    a, b = Sampler()(logits, rows)
    assert a.logprob is None and a.top_logprobs is None
    assert b.top_logprobs == [] and b.logprob is not None and b.rank == 1
