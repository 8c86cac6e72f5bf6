"""The host-memory tier of the prefix cache (``--enable-hierarchical-cache``): which full KV
blocks are kept in host memory, under their prefix-cache keys. Pure Python, no torch: the
runner's :class:`~flotilla.cluster.engine.host_kv_store.HostKVStore` holds the bytes.

What flotilla writes to it: the committed full blocks of a request the scheduler preempts.
Without the tier a preempted request is recomputed from its prompt and outputs once it is
admitted again (the GPU prefix cache rarely still holds its blocks: they were freed because
the pool ran short, and the next allocations take them). With it, re-admission finds the
blocks here after the GPU prefix cache's match and loads them back into fresh GPU blocks
instead of recomputing them; only what follows the last full block is computed. Any request whose
prompt starts with a stored prefix loads it the same way. SGLang's HiCache also writes a
block to the host as the GPU cache computes or evicts it (``--hicache-write-policy``) and
adds a storage tier; flotilla writes on preemption only and has no storage tier (see
docs/configuration.md, "Host tier of the prefix cache").

Slots are taken from a free list, then by evicting the least recently used key. A key that
is stored again (the same request preempted twice) only moves to the back of the LRU
order: no copy.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from typing import Any, Hashable

# Bytes of a "GB" in --hicache-size (SGLang's unit).
GB = 10**9


class HostKVTier:
    """``num_slots`` host block slots indexed by prefix-cache key, LRU-evicted.

    Args:
        num_slots: blocks the host memory holds (>= 1).
    """

    def __init__(self, num_slots: int) -> None:
        if isinstance(num_slots, bool) or not isinstance(num_slots, int) or num_slots < 1:
            raise ValueError(f"num_slots must be an integer >= 1 (got num_slots={num_slots!r})")
        self.num_slots = num_slots
        self._slots: OrderedDict[Hashable, int] = OrderedDict()  # front: least recently used
        self._free = list(range(num_slots - 1, -1, -1))
        self.stored_blocks = 0
        self.loaded_blocks = 0

    def __len__(self) -> int:
        return len(self._slots)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._slots

    def store(self, key: Hashable) -> int | None:
        """Make room for ``key``'s block: the slot its bytes must be copied to, or None when
        the key is already stored (it becomes the most recently used; nothing to copy)."""
        if key in self._slots:
            self._slots.move_to_end(key)
            return None
        slot = self._free.pop() if self._free else self._slots.popitem(last=False)[1]
        self._slots[key] = slot
        self.stored_blocks += 1
        return slot

    def lookup(self, key: Hashable) -> int | None:
        """The slot holding ``key``'s block, or None (no change to the LRU order)."""
        return self._slots.get(key)

    def take(self, keys: list[Hashable]) -> list[int]:
        """The slots of ``keys`` (all stored: :meth:`lookup` them first), which become the
        most recently used, counted as loaded."""
        slots = []
        for key in keys:
            self._slots.move_to_end(key)
            slots.append(self._slots[key])
        self.loaded_blocks += len(slots)
        return slots

    def clear(self) -> None:
        """Forget every stored block (a new runner's host memory holds none of them)."""
        self._slots.clear()
        self._free = list(range(self.num_slots - 1, -1, -1))

    def check_invariants(self) -> None:
        """Raise AssertionError unless every slot is either free or holds exactly one key."""
        held = list(self._slots.values())
        assert len(set(held)) == len(held), "a slot holds two keys"
        assert not set(held) & set(self._free), "a slot is both free and held"
        assert sorted(held + self._free) == list(range(self.num_slots)), "slots were lost"


def host_kv_blocks(config: Any, block_bytes: int, device_blocks: int) -> int:
    """How many blocks of ``block_bytes`` (one rank's bytes for one KV block, all layers) the
    host tier holds: 0 unless ``enable_hierarchical_cache``; ``hicache_size`` GB when set,
    else ``hicache_ratio`` times the ``device_blocks`` of the GPU pool.

    Raises:
        ValueError: prefix caching is off (``disable_radix_cache``: the tier is indexed by its
            keys), the size gives no block, or it exceeds the host memory available now.
        NotImplementedError: a storage tier or the buffer-only host mode is asked for.
    """
    if not getattr(config, "enable_hierarchical_cache", False):
        return 0
    if getattr(config, "disable_radix_cache", False):
        raise ValueError(
            "enable_hierarchical_cache=True keeps prefix-cache blocks in host memory and needs the prefix cache; "
            "drop --disable-radix-cache (disable_radix_cache=True) or --enable-hierarchical-cache"
        )
    backend = getattr(config, "hicache_storage_backend", None)
    if backend is not None:
        raise NotImplementedError(
            f"hicache_storage_backend={backend!r}: flotilla's hierarchical cache has a host tier only, no storage tier"
        )
    mode = getattr(config, "hicache_host_memory_mode", "cache")
    if mode != "cache":
        raise NotImplementedError(f"hicache_host_memory_mode={mode!r}: flotilla's host tier is a cache ('cache' mode) only")
    size_gb = getattr(config, "hicache_size", 0) or 0
    if size_gb > 0:
        blocks, asked = int(size_gb * GB // block_bytes), f"hicache_size={size_gb} GB"
    else:
        # NOTE: resolution sets 2.0 unless the flag is given, except on a PD decode server,
        # where it leaves the ratio unset: the same default then.
        ratio = getattr(config, "hicache_ratio", None) or 2.0
        blocks, asked = int(ratio * device_blocks), f"hicache_ratio={ratio} x {device_blocks} GPU blocks"
    if blocks < 1:
        raise ValueError(f"{asked} holds no KV block of {block_bytes} bytes; raise --hicache-size")
    available = _available_host_bytes()
    if available is not None and blocks * block_bytes > available:
        raise ValueError(
            f"{asked} asks for {blocks * block_bytes / GB:.1f} GB of host memory for the KV host tier, "
            f"but {available / GB:.1f} GB are available; lower --hicache-size (or --hicache-ratio)"
        )
    return blocks


def _available_host_bytes() -> int | None:
    """Host memory available to allocate now: ``MemAvailable`` of /proc/meminfo (free memory
    plus what the page cache would give back), else the OS's free pages, else None."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None
