"""One rank's bytes of the KV host tier (:mod:`~flotilla.cluster.engine.host_kv_tier` keeps
the index): a ``[num_slots, block_bytes]`` uint8 buffer in host memory (pinned on CUDA), a
slot holding one KV block of every layer and cache tensor, and the copies between it and the
paged KV cache.

The scheduler names the copies of a step (``SchedulerOutput.kv_offload``, ``kv_load``) and the
runner queues them on its stream before the step's forward: an offload reads a block the
previous step may still be writing (stream order puts the copy after it) and that this step
may hand to another request (stream order puts its new K/V after the copy); a load fills
fresh blocks before the forward reads them. Host slots are only ever touched by copies on the
same stream, so a slot reused by a later offload cannot overwrite a load still queued.

Copies go through a device staging buffer of at most :data:`CHUNK_BLOCKS` blocks: one gather
(or scatter) launch per cache tensor and one host copy per run of consecutive slots.
"""

from __future__ import annotations

from typing import Sequence

import torch

from flotilla.cluster.engine.input_staging import device_index

# Blocks a copy stages on the device at once (Llama-3.1-8B: 2 MB a block, 64 MB a chunk).
CHUNK_BLOCKS = 32


class HostKVStore:
    """The host copy of up to ``num_slots`` KV blocks of ``kv_caches``.

    Args:
        kv_caches: the runner's paged caches: per layer, tensors ``[num_blocks, block_size,
            ...]``, contiguous (``KVCacheSpec.allocate``).
        num_slots: blocks the host buffer holds.
        device: the caches' device; the buffer is pinned when it is CUDA.
    """

    def __init__(self, kv_caches: Sequence[Sequence[torch.Tensor]], num_slots: int, device: torch.device) -> None:
        # NOTE: byte views of the caches (a float8 or bf16 block copies as its bytes).
        self.regions = [t.view(torch.uint8).view(t.shape[0], -1) for layer in kv_caches for t in layer]
        self.widths = [region.shape[1] for region in self.regions]
        self.block_bytes = sum(self.widths)
        self.device = torch.device(device)
        self.host = torch.empty(num_slots, self.block_bytes, dtype=torch.uint8, pin_memory=self.device.type == "cuda")

    @property
    def num_slots(self) -> int:
        return self.host.shape[0]

    def offload(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Queue copies of GPU blocks to host slots: ``pairs`` of ``(block_id, slot)``."""
        for chunk in _chunks(pairs):
            blocks = device_index([block for block, _ in chunk], self.device)
            staging = torch.cat([region.index_select(0, blocks) for region in self.regions], dim=1)
            for start, stop, slot in _runs([slot for _, slot in chunk]):
                self.host[slot : slot + stop - start].copy_(staging[start:stop], non_blocking=True)

    def load(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Queue copies of host slots into GPU blocks: ``pairs`` of ``(slot, block_id)``."""
        for chunk in _chunks(pairs):
            staging = torch.empty(len(chunk), self.block_bytes, dtype=torch.uint8, device=self.device)
            for start, stop, slot in _runs([slot for slot, _ in chunk]):
                staging[start:stop].copy_(self.host[slot : slot + stop - start], non_blocking=True)
            blocks = device_index([block for _, block in chunk], self.device)
            offset = 0
            for region, width in zip(self.regions, self.widths):
                region.index_copy_(0, blocks, staging[:, offset : offset + width])
                offset += width



def _chunks(pairs: Sequence[tuple[int, int]]) -> list[Sequence[tuple[int, int]]]:
    return [pairs[i : i + CHUNK_BLOCKS] for i in range(0, len(pairs), CHUNK_BLOCKS)]


def _runs(slots: Sequence[int]) -> list[tuple[int, int, int]]:
    """``(start, stop, first_slot)`` for each run of positions whose slots count up by one."""
    runs = []
    start = 0
    for i in range(1, len(slots) + 1):
        if i == len(slots) or slots[i] != slots[i - 1] + 1:
            runs.append((start, i, slots[start]))
            start = i
    return runs
