"""Deterministic inputs shared by the engine and cluster tests."""

from __future__ import annotations

from typing import Sequence

import torch

# The token-id oracle's vocabulary (see next_token).
ORACLE_VOCAB = 50


def random_prompts(lengths: Sequence[int], vocab_size: int, seed: int = 1, low: int = 3) -> list[list[int]]:
    """One prompt of token ids in ``[low, vocab_size)`` per length, seeded (ids below ``low``
    are left out: tiny test models reserve them for special tokens)."""
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(low, vocab_size, (n,), generator=generator).tolist() for n in lengths]


def next_token(sequence: Sequence[int]) -> int:
    """A deterministic stand-in for a model: the next token is a function of the whole
    sequence, so a scheduler bug that feeds a request the wrong context changes it."""
    return (sum((i + 1) * t for i, t in enumerate(sequence)) + 7 * len(sequence)) % ORACLE_VOCAB


def reference_outputs(prompt: Sequence[int], count: int) -> list[int]:
    """The ``count`` tokens :func:`next_token` generates after ``prompt``."""
    sequence = list(prompt)
    for _ in range(count):
        sequence.append(next_token(sequence))
    return sequence[len(prompt) :]
