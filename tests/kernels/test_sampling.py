"""The ``sampling_probs`` op: temperature, top-k, top-p and min-p truncation."""

import torch

from flotilla.kernels.registry import get

probs_of = get("sampling_probs")


def _run(logits, temperature=1.0, top_k=None, top_p=1.0, min_p=0.0):
    b, v = logits.shape
    full = lambda x, dt: torch.full((b,), x, dtype=dt)  # noqa: E731
    return probs_of(logits, full(temperature, torch.float32), full(top_k or v, torch.long), full(top_p, torch.float32), full(min_p, torch.float32))


def test_no_truncation_is_the_temperature_softmax():
    logits = torch.randn(3, 11, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(_run(logits, temperature=0.7), torch.softmax(logits / 0.7, dim=-1))


def test_top_k_keeps_exactly_k_most_likely_tokens():
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0, -1.0]])
    probs = _run(logits, top_k=2)
    assert (probs > 0).nonzero()[:, 1].tolist() == [1, 3]
    torch.testing.assert_close(probs.sum(), torch.tensor(1.0))


def test_top_p_keeps_the_smallest_set_reaching_the_mass_and_always_the_top_token():
    probs_in = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    probs = _run(probs_in.log(), top_p=0.8)
    assert (probs > 0).nonzero()[:, 1].tolist() == [0, 1]
    assert (_run(probs_in.log(), top_p=1e-6) > 0).nonzero()[:, 1].tolist() == [0]


def test_min_p_drops_tokens_below_a_fraction_of_the_top_one():
    probs_in = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    probs = _run(probs_in.log(), min_p=0.5)
    assert (probs > 0).nonzero()[:, 1].tolist() == [0, 1]


def test_rows_are_truncated_independently():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.2], [0.5, 0.3, 0.2]]))
    probs = probs_of(logits, torch.ones(2), torch.tensor([1, 3]), torch.ones(2), torch.zeros(2))
    assert (probs[0] > 0).sum() == 1 and (probs[1] > 0).sum() == 3
