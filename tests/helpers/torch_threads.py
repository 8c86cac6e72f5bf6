"""Intra-op threads for tiny-model tests."""

from contextlib import contextmanager

import torch


@contextmanager
def one_intra_op_thread():
    """Run the block on one torch intra-op thread. Tiny models are bound by per-op overhead;
    on a busy 2-core machine two intra-op threads spin against each other (steps
    measured 50x slower)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(previous)
