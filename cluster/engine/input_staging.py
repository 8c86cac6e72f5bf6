"""A step's host-side inputs on their way to the device: the lists the runner builds from a
schedule become the step's device tensors and attention metadata with one host-to-device copy
(see :class:`InputStaging`)."""

from __future__ import annotations

import numpy as np
import torch

from flotilla.kernels.attention import AttentionMetadata


def device_index(ids: list[int], device: torch.device) -> torch.Tensor:
    """``ids`` as an int64 tensor on ``device``, queued without a host sync: on CUDA the list is
    staged through pinned memory (a copy from pageable memory would wait for the work already
    queued on the stream, e.g. the step in flight)."""
    pinned = torch.device(device).type == "cuda"
    return torch.tensor(ids, dtype=torch.long, pin_memory=pinned).to(device, non_blocking=True)


class InputStaging:
    """Turns a step's Python lists into its device tensors with one host-to-device copy.

    Every int64 device tensor of a step (input ids, positions, slots, query starts, sequence
    lengths, sample index, the padded block table) is a view of one buffer. On CUDA the lists
    are written into a pinned host buffer and copied with one non-blocking copy into a device
    buffer reused across steps; the planner's int32 CPU fields are small fresh tensors.

    NOTE: the pinned buffer is rewritten only after the previous step's copy has finished
    (an event, already passed in practice: every step ends with a host sync); the device
    buffer is rewritten by a copy queued after the previous step's kernels on the same stream.
    """

    def __init__(self, device: torch.device):
        self.device = device
        self._pinned: torch.Tensor | None = None
        self._pinned_np: np.ndarray | None = None
        self._device_buf: torch.Tensor | None = None
        self._copied = torch.cuda.Event() if device.type == "cuda" else None
        self._pending = False

    def _host(self, size: int) -> np.ndarray:
        """A writable int64 host array of ``size`` (pinned and reused on CUDA)."""
        if self.device.type != "cuda":
            return np.empty(size, dtype=np.int64)
        if self._pending:
            self._copied.synchronize()
            self._pending = False
        if self._pinned is None or self._pinned.numel() < size:
            capacity = max(4096, 1 << (size - 1).bit_length())
            self._pinned = torch.empty(capacity, dtype=torch.long, pin_memory=True)
            self._pinned_np = self._pinned.numpy()
            with torch.inference_mode():
                self._device_buf = torch.empty(capacity, dtype=torch.long, device=self.device)
        return self._pinned_np[:size]

    def _to_device(self, host: np.ndarray) -> torch.Tensor:
        if self.device.type != "cuda":
            return torch.from_numpy(host)
        size = host.shape[0]
        # NOTE: the device buffer is an inference tensor: written in inference mode whoever calls.
        with torch.inference_mode():
            out = self._device_buf[:size]
            out.copy_(self._pinned[:size], non_blocking=True)
        self._copied.record()
        self._pending = True
        return out

    def build(
        self,
        input_ids: list[int],
        positions: list[int],
        slots: list[int],
        query_start: list[int],
        seq_lens: list[int],
        sample_index: list[int],
        pages: list[int],
        page_indptr: list[int],
        last_page_len: list[int],
        block_size: int,
        max_query_len: int,
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]:
        """The step's ``(input_ids, positions, meta, sample_index)`` (see
        :meth:`~flotilla.cluster.engine.model_runner.ModelRunner.prepare_inputs`); ``pages`` are the sequences' blocks back to back,
        ``page_indptr`` where each sequence's run starts, ``last_page_len`` the tokens in each
        sequence's last block."""
        t, b = len(input_ids), len(seq_lens)
        # NOTE: the planner's int32 CPU fields, from one array: query_start | seq_lens |
        # page_indptr | last_page_len.
        cpu = torch.from_numpy(np.array(query_start + seq_lens + page_indptr + last_page_len, dtype=np.int32))
        query_start_cpu, seq_lens_cpu, indptr_cpu, last_cpu = cpu.split([b + 1, b, b + 1, b])
        page_array = np.array(pages, dtype=np.int32)
        counts = np.diff(indptr_cpu.numpy()) if b > 1 else None
        width = int(counts.max()) if b > 1 else len(pages) or 1
        # NOTE: ids | positions | slots | seq_lens lie back to back: a decode step's four CUDA
        # graph inputs are then one [4, n] block, copied in one launch (CudaGraphs.run).
        head = input_ids + positions + slots + seq_lens + query_start + sample_index
        end_head = len(head)
        host = self._host(end_head + b * width)
        host[:end_head] = head
        if len(pages) == b * width:
            host[end_head:] = page_array
        else:
            tables = host[end_head:].reshape(b, width)
            tables[:] = 0
            tables[np.arange(width) < counts[:, None]] = page_array
        ids, pos, slot, lens, starts, sampled, table = self._to_device(host).split(
            [t, t, t, b, b + 1, len(sample_index), b * width]
        )
        meta = AttentionMetadata(
            slot_mapping=slot,
            query_start=starts,
            seq_lens=lens,
            block_tables=table.view(b, width),
            max_query_len=max_query_len,
            max_seq_len=max(seq_lens, default=0),
            block_size=block_size,
            page_indptr=indptr_cpu,
            page_indices=torch.from_numpy(page_array),
            last_page_len=last_cpu,
            query_start_cpu=query_start_cpu,
            seq_lens_cpu=seq_lens_cpu,
        )
        return ids, pos, meta, sampled
