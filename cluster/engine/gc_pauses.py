"""Keeping Python's cyclic garbage collector from pausing a step loop.

A full (generation-2) collection walks every container object the interpreter tracks. After
start-up that is millions of objects that live as long as the process (torch, transformers,
Triton and flashinfer modules, the model's ``nn.Module`` tree), and a step loop allocates
enough (request state, deltas, per-step metadata) to trigger a full collection every hundred
steps or so. On the offline benchmark (Llama-3.1-8B shape, 512 running requests, H200) those
showed as a step of a few hundred milliseconds every ~100-130 decode steps (docs/benchmarks.md,
"Eighth pass").

:func:`frozen_heap` moves every tracked object to the permanent generation (``gc.freeze``)
for the duration of a loop, so full collections only walk what the loop itself created; on
exit the objects go back (``gc.unfreeze``) and cycles among them (garbage frozen on entry
included) become collectable again. Both are list splices, cheap enough for every
``LLM.generate`` call (there is no collection on entry: that would cost a full walk each
time). Reference counting still frees frozen objects as usual: freezing only exempts them
from the cycle collector. ``gc.freeze`` is process-wide: nested or concurrent loops (two
engines in one process) share one permanent generation, and the first loop to exit
unfreezes it for all (they then run as they would without it).
"""

from __future__ import annotations

import gc
from contextlib import contextmanager
from typing import Iterator


@contextmanager
def frozen_heap() -> Iterator[None]:
    """Run the block with the heap as it is on entry frozen out of the cycle collector."""
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()
