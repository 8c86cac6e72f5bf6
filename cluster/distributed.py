"""The communicators the model layers talk to, and how a rank joins them.

:class:`Communicator` wraps one ``torch.distributed`` process group (or none, on a
single rank) behind the collectives the parallel layers need: ``all_reduce``
(row-parallel outputs, vocab-parallel embedding, expert partial sums),
``all_gather`` (vocab-parallel logits, DCP queries), ``all_gather_varlen`` (tokens of
DP-attention ranks with different batch sizes), ``reduce_scatter`` (DCP ``ag_rs``) and
``all_to_all`` (expert dispatch/combine, DCP ``a2a``). Every collective is bounded by a
timeout, so a dead or stuck peer raises instead of hanging the step.

:func:`init_process_groups` joins the world (gloo over loopback on CPU, NCCL on CUDA)
and creates one communicator per group kind of a :class:`~flotilla.cluster.topology.Topology`
(``tp``, ``attn_tp``, ``dcp``, ``ep``, ...). The Ray worker group calls it on every rank
before building the model.
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Sequence

import torch
import torch.distributed as dist

from flotilla.cluster.topology import GROUP_NAMES, Topology


class Communicator:
    """This rank's view of one process group.

    Args:
        group: the process group, or None when ``size == 1``.
        size: number of ranks in the group.
        rank: this rank's index in the group.
        timeout_s: the longest any one collective may wait for its peers.
        ranks: the global ranks of the group, in group-rank order (for messages).
    """

    def __init__(
        self,
        group: dist.ProcessGroup | None,
        size: int,
        rank: int,
        timeout_s: float,
        ranks: Sequence[int] | None = None,
    ):
        if size < 1 or not 0 <= rank < size:
            raise ValueError(f"rank={rank} must be in [0, size={size})")
        if size > 1 and group is None:
            raise ValueError(f"a group of size={size} needs a process group")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s={timeout_s} must be positive")
        self.group, self.size, self.rank = group, size, rank
        self.ranks = tuple(ranks) if ranks is not None else tuple(range(size))
        self.timeout = timedelta(seconds=timeout_s)
        # gloo collectives run on the CPU: wait for them with the bound. NCCL: see _wait.
        self._cpu_wait = group is None or dist.get_backend(group) != "nccl"

    @property
    def on_device(self) -> bool:
        """Whether the collectives run on the GPU's streams (NCCL): only those can be captured
        in a CUDA graph. False for gloo (CPU-side) and for a group of one rank."""
        return self.size > 1 and not self._cpu_wait

    @classmethod
    def single(cls) -> "Communicator":
        """The trivial group of one rank: every collective returns its input."""
        return cls(None, 1, 0, 1.0)

    def _wait(self, work) -> None:
        if self._cpu_wait:
            work.wait(self.timeout)
        else:
            # NOTE: NCCL: wait() only orders the current CUDA stream after the collective, so
            # the CPU keeps launching kernels; the group's timeout is enforced by NCCL's watchdog,
            # which aborts the communicator (and the rank) when a collective overruns it.
            work.wait()

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The element-wise sum of ``x`` over the group (in place; returns ``x``)."""
        if self.size == 1:
            return x
        self._wait(dist.all_reduce(x, group=self.group, async_op=True))
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Every rank's ``x`` concatenated along ``dim`` in rank order (all ranks' shapes must match)."""
        if self.size == 1:
            return x
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)]
        self._wait(dist.all_gather(parts, x, group=self.group, async_op=True))
        return torch.cat(parts, dim=dim)

    def all_gather_varlen(self, x: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
        """Every rank's ``x[n_r, ...]`` concatenated along dim 0 in rank order, where the
        ``n_r`` may differ (0 included); returns ``(gathered, [n_0, ..., n_{size-1}])``."""
        if self.size == 1:
            return x, [int(x.shape[0])]
        counts = self.all_gather(torch.tensor([x.shape[0]], dtype=torch.long, device=x.device), dim=0).tolist()
        width = max(counts)
        # NOTE: collectives need equal shapes: pad every rank's rows to the longest, cut after.
        padded = x.new_zeros(width, *x.shape[1:])
        padded[: x.shape[0]] = x
        parts = self.all_gather(padded.unsqueeze(0), dim=0)
        return torch.cat([parts[r, :n] for r, n in enumerate(counts)], dim=0), counts

    def reduce_scatter(self, x: torch.Tensor, dim: int = 0) -> torch.Tensor:
        """Sum ``x`` over the group and keep this rank's ``1/size`` chunk along ``dim``.

        NOTE: gloo has no reduce-scatter, so on CPU this is an all-reduce followed by the
        local chunk (the same result; more bytes on the wire).
        """
        if self.size == 1:
            return x
        if x.shape[dim] % self.size:
            raise ValueError(f"reduce_scatter: dim {dim} of size {x.shape[dim]} is not divisible by {self.size} ranks")
        chunk = x.shape[dim] // self.size
        if dist.get_backend(self.group) == "gloo":
            return self.all_reduce(x.contiguous()).narrow(dim, self.rank * chunk, chunk).contiguous()
        parts = [p.contiguous() for p in x.chunk(self.size, dim=dim)]
        out = torch.empty_like(parts[0])
        self._wait(dist.reduce_scatter(out, parts, group=self.group, async_op=True))
        return out

    def all_to_all(self, x: torch.Tensor, send_counts: Sequence[int]) -> tuple[torch.Tensor, list[int]]:
        """Send rows ``x[sum(send_counts[:r]) : ...+send_counts[r]]`` to rank ``r``; returns
        the rows received (from rank 0 first) and how many came from each rank."""
        send_counts = [int(c) for c in send_counts]
        if len(send_counts) != self.size or sum(send_counts) != x.shape[0]:
            raise ValueError(f"all_to_all: send_counts={send_counts} do not split {x.shape[0]} rows over {self.size} ranks")
        if self.size == 1:
            return x, send_counts
        sent = torch.tensor(send_counts, dtype=torch.long, device=x.device)
        received = torch.empty_like(sent)
        self._wait(dist.all_to_all_single(received, sent, group=self.group, async_op=True))
        recv_counts = received.tolist()
        out = x.new_empty(sum(recv_counts), *x.shape[1:])
        self._wait(
            dist.all_to_all_single(
                out, x.contiguous(), recv_counts, send_counts, group=self.group, async_op=True
            )
        )
        return out, recv_counts

    def __repr__(self) -> str:
        return f"Communicator(rank={self.rank}, size={self.size}, ranks={self.ranks})"


def init_gloo(rank: int, world_size: int, port: int, timeout_s: float = 60.0, host: str = "127.0.0.1") -> Communicator:
    """Join a gloo world of ``world_size`` ranks rendezvousing at ``host:port``; returns the
    :class:`Communicator` spanning all of them (a one-group topology)."""
    return init_process_groups(Topology(world_size), rank, port, timeout_s, host=host)["tp"]


def init_process_groups(
    topology: Topology,
    rank: int,
    port: int,
    timeout_s: float = 60.0,
    backend: str = "gloo",
    host: str = "127.0.0.1",
    device: torch.device | None = None,
) -> dict[str, Communicator]:
    """Join the world of ``topology.world_size`` ranks and return this rank's communicator of
    every group kind in :data:`~flotilla.cluster.topology.GROUP_NAMES`.

    Args:
        topology: the rank layout (every rank passes the same one).
        rank: this rank.
        port: rank 0's rendezvous port on ``host``.
        timeout_s: bound on the rendezvous and on every collective.
        backend: ``"gloo"`` (CPU) or ``"nccl"`` (CUDA).
        host: the rendezvous host (loopback: every rank on one node).
        device: this rank's CUDA device (NCCL only).

    NOTE: ``dist.new_group`` must be called by EVERY rank for every group, in the same
    order, even for groups it is not in; identical rank lists of different kinds share one
    process group. Groups of one rank need no process group.
    """
    world = topology.world_size
    if not 0 <= rank < world:
        raise ValueError(f"rank={rank} must be in [0, world_size={world})")
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend={backend!r} must be 'gloo' or 'nccl'")
    if host in ("127.0.0.1", "localhost") and backend == "gloo":
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    timeout = timedelta(seconds=timeout_s)
    if world == 1:
        return {name: Communicator.single() for name in GROUP_NAMES}
    extra = {"device_id": device} if backend == "nccl" and device is not None else {}
    dist.init_process_group(
        backend, init_method=f"tcp://{host}:{port}", rank=rank, world_size=world, timeout=timeout, **extra
    )
    made: dict[tuple[int, ...], dist.ProcessGroup | None] = {}
    mine: dict[str, Communicator] = {}
    for name in GROUP_NAMES:
        for ranks in topology.groups(name):
            if len(ranks) > 1 and ranks not in made:
                made[ranks] = dist.new_group(list(ranks), timeout=timeout, backend=backend)
            if rank in ranks:
                if len(ranks) == 1:
                    mine[name] = Communicator.single()
                else:
                    mine[name] = Communicator(made[ranks], len(ranks), ranks.index(rank), timeout_s, ranks)
    return mine


def destroy() -> None:
    """Leave the default process group (a no-op when none was joined)."""
    if dist.is_initialized():
        dist.destroy_process_group()
