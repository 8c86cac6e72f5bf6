"""Fixtures shared by the engine tests."""

import pytest

from helpers.prompts import random_prompts
from helpers.tiny_models import save_tiny_llama

# Prompt lengths of the layout tests: a short, a medium and a long prompt (the long one spans
# several KV blocks and, with a small prefill budget, several chunks).
PROMPT_LENS = (5, 17, 40)


@pytest.fixture(scope="session")
def tiny_llama_prompts(tmp_path_factory):
    """``(path, prompts)``: a saved tiny random Llama (vocabulary 256) and one seeded prompt
    per :data:`PROMPT_LENS`."""
    path = tmp_path_factory.mktemp("tiny-llama-layouts")
    save_tiny_llama(path)
    return str(path), random_prompts(PROMPT_LENS, 256)
