"""SamplingParams: vLLM's defaults, and a ValueError naming the parameter and value for each bad input."""

import pytest

from flotilla.cluster.engine.sampling_params import SamplingParams, as_param_list


def test_defaults_follow_vllm():
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p, p.max_tokens) == (1, 1.0, 1.0, -1, 0.0, 16)
    assert p.stop == [] and p.stop_token_ids == [] and p.logprobs is None and not p.greedy


@pytest.mark.parametrize(
    "kwargs, name",
    [
        ({"temperature": -0.5}, "temperature=-0.5"),
        ({"top_p": 0.0}, "top_p=0.0"),
        ({"top_p": 1.5}, "top_p=1.5"),
        ({"max_tokens": 0}, "max_tokens=0"),
        ({"n": 0}, "n=0"),
        ({"top_k": 0}, "top_k=0"),
        ({"seed": 2**63}, "seed=9223372036854775808"),
        ({"top_k": -2}, "top_k=-2"),
        ({"min_p": 1.1}, "min_p=1.1"),
        ({"min_p": -0.1}, "min_p=-0.1"),
        ({"repetition_penalty": 0.0}, "repetition_penalty=0.0"),
        ({"presence_penalty": 2.5}, "presence_penalty=2.5"),
        ({"frequency_penalty": -3.0}, "frequency_penalty=-3.0"),
        ({"logprobs": -1}, "logprobs=-1"),
        ({"stop": [""]}, "stop=['']"),
        ({"stop_token_ids": [-4]}, "stop_token_ids=[-4]"),
    ],
)
def test_bad_values_raise_naming_parameter_and_value(kwargs, name):
    with pytest.raises(ValueError, match=rf"^{name.split('=')[0]} .*got {__import__('re').escape(name)}"):
        SamplingParams(**kwargs)


def test_stop_string_becomes_a_list_and_temperature_zero_is_greedy():
    p = SamplingParams(stop="\n", temperature=0)
    assert p.stop == ["\n"] and p.stop_strings == ("\n",) and p.greedy


def test_unknown_stop_token_id_is_rejected_for_the_model():
    p = SamplingParams(stop_token_ids=[3, 100])
    p.verify_for_model(vocab_size=101)
    with pytest.raises(ValueError, match="stop_token_ids contains 100.*vocabulary size 100"):
        p.verify_for_model(vocab_size=100)


def test_children_of_n_get_distinct_reproducible_seeds():
    p = SamplingParams(n=3, seed=7)
    assert [p.for_child(i).seed for i in range(3)] == [7, 8, 9]
    assert all(p.for_child(i).n == 1 for i in range(3))
    assert SamplingParams(n=2).for_child(1).seed is None


def test_param_list_shares_one_or_checks_the_count():
    one = SamplingParams(max_tokens=3)
    assert as_param_list(one, 2) == [one, one]
    with pytest.raises(ValueError, match="sampling_params has 1 entries but there are 2 prompts"):
        as_param_list([one], 2)
