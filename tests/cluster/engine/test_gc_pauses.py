"""frozen_heap: the heap on entry is out of the cycle collector for the block and back after
it (cycles among those objects collectable again), also when the block raises."""

import gc
import weakref

import pytest


@pytest.fixture(autouse=True)
def no_automatic_collections():
    """Only the tests' own gc.collect() calls collect (an automatic one could take the entry
    cycle before the freeze)."""
    gc.disable()
    try:
        yield
    finally:
        gc.enable()

from flotilla.cluster.engine.gc_pauses import frozen_heap


class Node:
    """A weak-referenceable object to build reference cycles from."""


def _cycle() -> weakref.ref:
    a, b = Node(), Node()
    a.other, b.other = b, a
    return weakref.ref(a)


def test_the_entry_heap_is_frozen_for_the_block_and_collectable_after():
    gc.collect()
    before = _cycle()  # garbage (an unreachable cycle) already on entry
    with frozen_heap():
        assert gc.get_freeze_count() > 0
        gc.collect()
        assert before() is not None, "a cycle frozen on entry was collected inside the block"
        during = _cycle()
        gc.collect()
        assert during() is None, "a cycle made inside the block must stay collectable"
    assert gc.get_freeze_count() == 0
    gc.collect()
    assert before() is None


def test_the_heap_is_unfrozen_when_the_block_raises():
    with pytest.raises(RuntimeError, match="boom"):
        with frozen_heap():
            raise RuntimeError("boom")
    assert gc.get_freeze_count() == 0
