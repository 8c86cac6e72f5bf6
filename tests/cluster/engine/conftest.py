"""Fixtures shared by the engine tests."""

import pytest

from helpers.margins import ENGINE_MIN_LEAD
from helpers.prompts import random_prompts
from helpers.tiny_models import hf_greedy, save_tiny_llama

# Prompt lengths of the layout tests: a short, a medium and a long prompt (the long one spans
# several KV blocks and, with a small prefill budget, several chunks).
PROMPT_LENS = (5, 17, 40)


@pytest.fixture(scope="session")
def tiny_llama_prompts(tmp_path_factory):
    """``(path, prompts)``: a saved tiny random Llama (vocabulary 256) and one seeded prompt
    per :data:`PROMPT_LENS`.

    The layout tests compare greedy tokens of two float32 computations (one rank and a
    group, colocated and handed off); every greedy choice of the first 32 tokens leads the
    runner-up by more than ``ENGINE_MIN_LEAD`` (asserted here; the smallest lead is 1.7e-4),
    so none can flip between them."""
    path = tmp_path_factory.mktemp("tiny-llama-layouts")
    model = save_tiny_llama(path)
    prompts = random_prompts(PROMPT_LENS, 256)
    for prompt in prompts:
        hf_greedy(model, prompt, 32, min_lead=ENGINE_MIN_LEAD)
    return str(path), prompts
