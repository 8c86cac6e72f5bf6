"""The tensor-parallel communicator the model layers talk to.

:class:`TPGroup` wraps one ``torch.distributed`` process group (or none, on a
single rank) behind the two collectives tensor parallelism needs: ``all_reduce``
(row-parallel outputs, vocab-parallel embedding) and ``all_gather`` (vocab-parallel
logits). Every collective is bounded by a timeout, so a dead or stuck peer raises
instead of hanging the step.

:func:`init_gloo` joins a CPU (gloo) group over loopback; the Ray worker group
calls it (or its NCCL twin) on every rank before building the model.
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist


class TPGroup:
    """This rank's tensor-parallel group.

    Args:
        group: the process group, or None when ``size == 1``.
        size: number of ranks in the group.
        rank: this rank's index in the group.
        timeout_s: the longest any one collective may wait for its peers.
    """

    def __init__(self, group: dist.ProcessGroup | None, size: int, rank: int, timeout_s: float):
        if size < 1 or not 0 <= rank < size:
            raise ValueError(f"rank={rank} must be in [0, size={size})")
        if size > 1 and group is None:
            raise ValueError(f"a group of size={size} needs a process group")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s={timeout_s} must be positive")
        self.group, self.size, self.rank = group, size, rank
        self.timeout = timedelta(seconds=timeout_s)

    @classmethod
    def single(cls) -> "TPGroup":
        """The trivial group of one rank: both collectives return their input."""
        return cls(None, 1, 0, 1.0)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The element-wise sum of ``x`` over the group (in place; returns ``x``)."""
        if self.size == 1:
            return x
        work = dist.all_reduce(x, group=self.group, async_op=True)
        work.wait(self.timeout)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Every rank's ``x`` concatenated along ``dim`` in rank order (all ranks' shapes must match)."""
        if self.size == 1:
            return x
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)]
        work = dist.all_gather(parts, x, group=self.group, async_op=True)
        work.wait(self.timeout)
        return torch.cat(parts, dim=dim)

    def __repr__(self) -> str:
        return f"TPGroup(rank={self.rank}, size={self.size})"


def init_gloo(rank: int, world_size: int, port: int, timeout_s: float = 60.0, host: str = "127.0.0.1") -> TPGroup:
    """Join a gloo process group of ``world_size`` ranks rendezvousing at ``host:port``
    and return the :class:`TPGroup` spanning all of them.

    NOTE: gloo takes its collective timeout when a group is created, so the group
    is made with ``new_group(..., timeout=...)``; :meth:`TPGroup.all_reduce` also
    waits with the same bound.
    """
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank={rank} must be in [0, world_size={world_size})")
    if host in ("127.0.0.1", "localhost"):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    timeout = timedelta(seconds=timeout_s)
    dist.init_process_group(
        "gloo", init_method=f"tcp://{host}:{port}", rank=rank, world_size=world_size, timeout=timeout
    )
    group = dist.new_group(list(range(world_size)), timeout=timeout, backend="gloo")
    return TPGroup(group, world_size, rank, timeout_s)


def destroy() -> None:
    """Leave the default process group (a no-op when none was joined)."""
    if dist.is_initialized():
        dist.destroy_process_group()
