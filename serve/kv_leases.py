"""The prefill side's leases on the KV blocks it handed to a reader (prefill/decode
disaggregation): held until the reader releases them or the lease expires, so a reader that
never comes back cannot leak them. Pure Python."""

from __future__ import annotations

import time
from typing import Callable, Sequence


class BlockLeases:
    """Blocks a source handed to a reader, held until released or expired.

    Pure Python. ``clock`` gives seconds (``time.monotonic`` by default; tests pass a
    fake). The owner frees the block ids that ``release`` and ``expire`` return.
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._leases: dict[str, tuple[float, list[int]]] = {}

    def grant(self, request_id: str, block_ids: Sequence[int], ttl_s: float) -> None:
        """Hold ``block_ids`` for ``request_id`` until ``ttl_s`` seconds from now."""
        if ttl_s <= 0:
            raise ValueError(f"ttl_s must be positive (got {ttl_s})")
        if request_id in self._leases:
            raise ValueError(f"request {request_id!r} already holds a lease; release it before granting another")
        self._leases[request_id] = (self._clock() + ttl_s, [int(b) for b in block_ids])

    def release(self, request_id: str) -> list[int] | None:
        """End the lease; returns its block ids, or None when there is none (never
        granted, already released, or expired)."""
        lease = self._leases.pop(request_id, None)
        return None if lease is None else lease[1]

    def expire(self, now: float | None = None) -> dict[str, list[int]]:
        """End every lease whose deadline is at or before ``now`` (default: the clock);
        returns their request ids -> block ids."""
        now = self._clock() if now is None else now
        expired = [rid for rid, (deadline, _) in self._leases.items() if deadline <= now]
        return {rid: self._leases.pop(rid)[1] for rid in expired}

    def next_deadline(self) -> float | None:
        """The earliest deadline of a lease held (the clock's time), or None."""
        return min((deadline for deadline, _ in self._leases.values()), default=None)

    @property
    def num_blocks(self) -> int:
        """Blocks held under all leases."""
        return sum(len(ids) for _, ids in self._leases.values())

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._leases

    def held(self) -> dict[str, list[int]]:
        """Request id -> block ids currently leased."""
        return {rid: list(ids) for rid, (_, ids) in self._leases.items()}

    def __len__(self) -> int:
        return len(self._leases)
