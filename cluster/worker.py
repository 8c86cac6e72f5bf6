"""One rank of a worker group: the model shard, its KV cache and the step RPC.

:class:`Worker` is a plain class holding the logic (testable in-process);
:data:`WorkerActor` is the Ray actor shell around it. A worker's life:

1. built with ``(rank, world_size, expected_digest)``;
2. :meth:`Worker.accept_config` receives the frozen ``ResolvedConfig`` from the
   object store (the driver ``ray.put``\\ s it once and hands the same ref to every
   rank) and refuses it when its digest is not the group's;
3. :meth:`Worker.load` joins ``torch.distributed`` (gloo on CPU, NCCL on CUDA) at rank 0's
   :meth:`Worker.rendezvous_point` and one communicator per group of the config's
   :class:`Topology`, builds this
   rank's model shard and its KV cache;
4. :meth:`Worker.execute` runs one scheduled batch; every rank runs it, rank 0
   returns the sampled tokens. Under DP attention every rank runs its DP rank's part
   of the step (an empty part too: the rank still joins every collective) and each
   DP rank's leader (attention-TP rank 0) returns that part's result.

Elastic EP (:mod:`flotilla.cluster.elastic`): a rank joining a running group is built with
:meth:`Worker.load_joiner` (the grown topology and expert placements, no communicators yet);
at the commit every rank, old and new, calls :meth:`Worker.elastic_commit` (leave the old
world, join the grown one, adopt the grown placements), and a failed commit is undone on the
running ranks with :meth:`Worker.elastic_rollback`.
"""

from __future__ import annotations

import functools
import socket
import threading
from dataclasses import dataclass
from typing import Any, Sequence

import ray
import torch

from flotilla.cluster.log_level import apply_log_level
from flotilla.cluster.engine.dp_scheduler import part_for_rank
from flotilla.cluster.engine.model_runner import KVCacheLayout, ModelRunner
from flotilla.cluster.engine.overlap import TokenFeed
from flotilla.cluster.engine.sampler import SampledToken, SamplingRow
from flotilla.cluster.engine.scheduler import SchedulerOutput
from flotilla.cluster.models.base import ParallelLayout
from flotilla.cluster.models.sources import ModelSource
from flotilla.cluster.topology import Topology
from flotilla.resolution import ResolvedConfig

# The longest any one collective may wait for its peers (a dead peer raises, never hangs).
DEFAULT_COLLECTIVE_TIMEOUT_S = 60.0


class ConfigMismatchError(RuntimeError):
    """A worker was handed a config whose digest is not its group's."""


@dataclass
class StepBatch:
    """What the driver sends to every rank for one step (picklable).

    Attributes:
        schedule: the scheduler's output for this step: a ``SchedulerOutput``, or under DP
            attention a :class:`~flotilla.cluster.engine.dp_scheduler.DPSchedulerOutput`
            (every rank gets all parts and runs its DP rank's).
        rows: one sampling row per scheduled request that samples, in schedule order
            (DP-major under DP attention; each DP rank samples its own slice).
        return_logits: when True, each DP rank's leader (rank 0 without DP attention)
            returns the float32 logits ``[N, V]`` of its part's N sampling requests
            (schedule order), with its embedding requests' pooled vectors by row, instead of
            sampled tokens, and ``rows`` is ignored: the driver samples (its seeded
            generators keep their state there).

        pipelined: launch this step and return the PREVIOUS pipelined step's tokens, once
            this one is queued on the device (overlap scheduling across the group, see
            :class:`~flotilla.cluster.engine.group_runner.GroupRunner`); the first returns
            None. A non-pipelined step may only follow a :attr:`flush`.
        feed: (pipelined) fill the step's pending input tokens from the previous pipelined
            step's sampled ids, still on the device.
        flush: launch nothing; return the previous pipelined step's tokens (``schedule``
            is None).

    NOTE: a row's ``generator`` (seeded sampling) does not survive the trip to the
    workers with its state in sync across steps; send greedy or unseeded rows until the
    sampler state lives on rank 0.
    """

    schedule: SchedulerOutput | None
    rows: Sequence[SamplingRow] = ()
    return_logits: bool = False
    pipelined: bool = False
    feed: bool = False
    flush: bool = False


@dataclass(frozen=True)
class WorkerInfo:
    """What a loaded rank reports back.

    Attributes:
        rank: the rank.
        digest: the digest of the config it runs.
        kv_layout: its KV pool (the scheduler is sized from rank 0's).
        vocab_size: the model's vocabulary size.
        node_id: the Ray node it runs on (None outside Ray).
    """

    rank: int
    digest: str
    kv_layout: KVCacheLayout
    vocab_size: int
    node_id: str | None = None


class Worker:
    """One rank (see the module docstring).

    Args:
        rank: this rank, in ``[0, world_size)``.
        world_size: ranks in the group (it grows at an elastic EP commit).
        expected_digest: the group's ``ResolvedConfig.digest``.
        collective_timeout_s: bound on every collective of this rank.
    """

    def __init__(
        self,
        rank: int,
        world_size: int,
        expected_digest: str,
        collective_timeout_s: float = DEFAULT_COLLECTIVE_TIMEOUT_S,
    ):
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"rank={rank} must be in [0, world_size={world_size})")
        self.rank, self.world_size = rank, world_size
        self.expected_digest = expected_digest
        self.collective_timeout_s = collective_timeout_s
        self.config: ResolvedConfig | None = None
        self.runner: ModelRunner | None = None
        self.layout: ParallelLayout | None = None
        # The layout this rank runs (the config's, until an elastic EP commit grows it).
        self.topology: Topology | None = None
        # (topology, expert placements) before the last elastic commit, for a rollback.
        self._before_commit: tuple[Topology, dict] | None = None
        self.num_steps = 0
        self.num_empty_steps = 0
        self._is_dp_leader: bool | None = None
        # The pipelined step launched last and not yet returned: (its sampled batch or None,
        # request id -> its row), see StepBatch.pipelined.
        self._pipelined: tuple[Any, dict[str, int]] | None = None

    def accept_config(self, config: ResolvedConfig) -> str:
        """Keep ``config`` when its digest is the group's; returns the digest.

        Raises ConfigMismatchError naming both digests otherwise.
        """
        digest = config.digest
        if digest != self.expected_digest:
            raise ConfigMismatchError(
                f"rank {self.rank} refuses to start: it received a config with digest {digest}, "
                f"but its group expects digest {self.expected_digest} (the driver must resolve once "
                f"and broadcast the same frozen ResolvedConfig to every rank)"
            )
        self.config = config
        apply_log_level(config)
        return digest

    def rendezvous_point(self) -> tuple[str, int]:
        """Where a world whose rank 0 is this rank meets: this node's address (as Ray knows it:
        loopback on a one-box cluster) and a TCP port free on it right now."""
        host = ray.util.get_node_ip_address()
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((host, 0))
            return host, s.getsockname()[1]

    def load(self, source: ModelSource, rendezvous: tuple[str, int]) -> WorkerInfo:
        """Join the process groups at ``rendezvous`` (rank 0's :meth:`rendezvous_point`),
        build this rank's model shard and KV cache."""
        if self.config is None:
            raise RuntimeError(f"rank {self.rank}: load() before accept_config()")
        topology = Topology.from_config(self.config)
        if topology.world_size != self.world_size:
            raise ValueError(
                f"rank {self.rank}: the config's tp_size={topology.world_size} is not this group's "
                f"world_size={self.world_size}"
            )
        self.topology = topology
        self.layout = self._layout(topology, self._init_distributed(topology, rendezvous))
        self.runner = shard_runner(self.config, source, self.layout)
        self.runner.kv.rank = self.rank  # NOTE: the rank's KV errors and agent name its group rank
        return self._info()

    def load_joiner(self, source: ModelSource, topology: Topology, placements: dict) -> WorkerInfo:
        """Build this JOINING rank's shard for the grown elastic EP group ``topology`` (its
        ``world_size`` is this worker's): the non-expert weights and the expert slots that
        ``placements`` (decoder layer index -> ExpertPlacement) give this rank, and its KV
        cache. No communicator yet: the rank joins the group's at :meth:`elastic_commit`."""
        if self.config is None:
            raise RuntimeError(f"rank {self.rank}: load_joiner() before accept_config()")
        if topology.world_size != self.world_size:
            raise ValueError(
                f"rank {self.rank}: the grown topology has world_size={topology.world_size}, this joiner "
                f"was started for world_size={self.world_size}"
            )
        self.topology = topology
        self.layout = self._layout(topology, {})
        self.runner = ModelRunner(self.config, source, parallel=self.layout, expert_placements=placements)
        self.runner.kv.rank = self.rank
        return self._info()

    def expert_placements(self) -> dict:
        """The expert placement of every MoE layer this rank runs (decoder layer index ->
        ExpertPlacement; every rank of a group holds the same maps)."""
        if self.runner is None:
            raise RuntimeError(f"rank {self.rank}: expert_placements() before load()")
        return self.runner.expert_placements()

    def elastic_commit(self, topology: Topology, rendezvous: tuple[str, int], placements: dict) -> int:
        """Join the grown group ``topology`` (at ``rendezvous``, old rank 0's) and adopt
        ``placements``; returns this rank. Every rank of the grown group, old and joining,
        calls it at once (the rendezvous waits for all of them, bounded by the collective
        timeout). A running rank keeps its weights (the placements keep its slots)."""
        if self.runner is None or self.topology is None:
            raise RuntimeError(f"rank {self.rank}: elastic_commit() before load()")
        self._before_commit = (self.topology, self.runner.expert_placements())
        self._rejoin(topology, rendezvous, placements)
        return self.rank

    def elastic_rollback(self, rendezvous: tuple[str, int]) -> int:
        """Undo the last :meth:`elastic_commit` (which failed somewhere in the group): rejoin the
        old group's ranks at ``rendezvous`` and restore the old placements; returns this rank."""
        if self._before_commit is None:
            raise RuntimeError(f"rank {self.rank}: elastic_rollback() without an elastic_commit() to undo")
        topology, placements = self._before_commit
        self._rejoin(topology, rendezvous, placements)
        self._before_commit = None
        return self.rank

    def _rejoin(self, topology: Topology, rendezvous: tuple[str, int], placements: dict) -> None:
        from flotilla.cluster.distributed import destroy

        # NOTE: leave the old world first (a no-op at one rank); from here on this rank's
        # communicators are the new world's, or none if the rendezvous fails (then only a
        # rollback or a kill follows, never a step).
        destroy()
        self.world_size = topology.world_size
        layout = self._layout(topology, self._init_distributed(topology, rendezvous))
        self.runner.rewire(layout, placements)
        self.layout, self.topology = layout, topology
        self._is_dp_leader = None

    def _layout(self, topology: Topology, comms: dict[str, Any]) -> ParallelLayout:
        return ParallelLayout.for_rank(
            topology,
            self.rank,
            comms,
            moe_a2a_backend=self.config.moe_a2a_backend or "none",
            dcp_comm_backend=self.config.dcp_comm_backend or "ag_rs",
        )

    def _info(self) -> WorkerInfo:
        node = self.node_id() if ray.is_initialized() else None
        return WorkerInfo(self.rank, self.config.digest, self.runner.kv_layout, self.runner.vocab_size, node)

    def _init_distributed(self, topology: Topology, rendezvous: tuple[str, int]) -> dict[str, Any]:
        """This rank's communicators in ``topology`` (rank 0 hosts the rendezvous at
        ``(host, port)``): gloo on
        CPU, NCCL on CUDA (one GPU per rank: Ray sets ``CUDA_VISIBLE_DEVICES`` to the rank's
        GPU, so it is ``cuda:0`` here)."""
        from flotilla.cluster.distributed import init_process_groups

        on_cuda = (self.config.device or "cpu") == "cuda"
        device = None
        if on_cuda and topology.world_size > 1:
            device = torch.device("cuda", 0)
            torch.cuda.set_device(device)
        host, port = rendezvous
        return init_process_groups(
            topology,
            self.rank,
            port,
            self.collective_timeout_s,
            backend="nccl" if on_cuda else "gloo",
            host=host,
            device=device,
        )

    def execute(self, step: StepBatch) -> list[SampledToken] | torch.Tensor | None:
        """Run this rank's part of one step (the whole step without DP attention); the
        leader of each DP rank (attention-TP rank 0; rank 0 without DP attention) returns
        the part's sampled tokens (or, with ``step.return_logits``, the logits of its
        sampling rows), the others None.

        NOTE: every rank of a DP rank runs the same part, sampling included: the
        vocab-parallel logits are all-gathered inside ``compute_logits`` over attention TP,
        a collective every rank of the DP rank joins or skips alike (it samples or not).
        """
        if self.runner is None or self.layout is None:
            raise RuntimeError(f"rank {self.rank}: execute() before load()")
        if step.flush:
            result = self._take_pipelined()
            return result if self._leads_dp_rank() else None
        if self._pipelined is not None and not step.pipelined:
            raise RuntimeError(f"rank {self.rank}: a step arrived while a pipelined step is unresolved; flush first")
        part, rows = part_for_rank(step.schedule, self.layout.dp_rank, self.layout.dp_size)
        self.num_steps += 1
        self.num_empty_steps += part.is_empty
        if step.pipelined:
            result = self._launch_pipelined(part, list(step.rows)[rows], step.feed)
        elif step.return_logits:
            result = self._step_logits(part)
        else:
            result = self.runner.execute(part, list(step.rows)[rows])
        return result if self._leads_dp_rank() else None

    def _launch_pipelined(self, part: SchedulerOutput, rows: list[SamplingRow], feed: bool) -> list[SampledToken] | None:
        """Queue ``part`` (its pending ids fed on the device from the previous pipelined step
        when ``feed``), then wait for the previous pipelined step's tokens and return them
        (None when there was none): the host work of this step overlaps the device's work
        on the previous one."""
        previous = self._pipelined
        token_feed = None
        if feed and previous is not None and previous[0] is not None:
            token_feed = TokenFeed(previous[0].token_ids, previous[1])
        batch = self.runner.launch(part, rows, token_feed)
        sampling = [item.request.request_id for item in part.scheduled if item.samples]
        tokens = self._take_pipelined()
        self._pipelined = (batch, {rid: i for i, rid in enumerate(sampling)})
        return tokens if previous is not None else None

    def _take_pipelined(self) -> list[SampledToken]:
        """The unresolved pipelined step's tokens (waits for them; ``[]`` when it sampled nothing
        or there is none); the rank then holds no pipelined step."""
        previous, self._pipelined = self._pipelined, None
        if previous is None or previous[0] is None:
            return []
        return previous[0].resolve()

    def _leads_dp_rank(self) -> bool:
        """Whether this rank returns its DP rank's results (Topology.attn_dp_leaders)."""
        if self._is_dp_leader is None:
            self._is_dp_leader = self.rank in self.topology.attn_dp_leaders
        return self._is_dp_leader

    def step_stats(self) -> dict[str, int]:
        """Steps this rank ran, how many of them were empty (an idle DP rank's), and how many
        replayed a decode CUDA graph."""
        graphs = self.runner.graphs if self.runner is not None else None
        return {
            "steps": self.num_steps,
            "empty_steps": self.num_empty_steps,
            "graph_replays": graphs.num_replays if graphs is not None else 0,
        }

    def startup_report(self) -> dict[str, Any]:
        """This rank's runner start-up report (:meth:`ModelRunner.startup_report`: what
        loading, the KV cache and the decode graph capture cost, and why graphs are off)."""
        if self.runner is None:
            raise RuntimeError(f"rank {self.rank}: startup_report() before load()")
        return self.runner.startup_report()

    def time_decode_graph(self, num_seqs: int, iters: int) -> float:
        """Milliseconds of one replay of the decode graph a batch of ``num_seqs`` replays at
        (``DecodeGraphs.time_replay``). Every rank of the group must be called together: the
        graph's collectives need all of them. ValueError when this rank captured none."""
        graphs = self.runner.graphs if self.runner is not None else None
        if graphs is None:
            raise ValueError(f"rank {self.rank} captured no decode CUDA graphs ({self.runner and self.runner.graphs_off_reason})")
        return graphs.time_replay(num_seqs, iters)

    def expert_load(self) -> dict | None:
        """This rank's routed-pair counts per logical expert (``ModelRunner.expert_load``): the
        tokens its own router saw (attention-TP ranks of one DP rank see the same tokens)."""
        if self.runner is None:
            raise RuntimeError(f"rank {self.rank}: expert_load() before load()")
        return self.runner.expert_load()

    def _step_logits(self, schedule: SchedulerOutput) -> tuple[torch.Tensor, dict]:
        """Forward one step; the float32 logits ``[N, V]`` of its N sampling requests (on CPU),
        and the pooled vectors of its embedding requests' rows (``ModelRunner.last_pooled``).

        A pure decode step replays this rank's decode CUDA graph when it has one (every rank
        of the group decides alike from the same step); an empty part (an idle DP rank) still
        runs the forward, so the rank joins the step's collectives.

        NOTE: compute_logits all-gathers the vocab shards over attention TP: every rank of
        this DP rank runs the same part, so all of them reach that collective."""
        with torch.inference_mode():
            return self.runner.step_logits(schedule).float().cpu(), dict(self.runner.last_pooled)

    # -- KV transfer (prefill/decode disaggregation): this rank's port ------------------
    # NOTE: per-rank calls, no collectives: a rank's failure leaves its peers in step.

    def kv(self, method: str, *args: Any) -> Any:
        """Call this rank's KV port (``runner.kv``): ``method`` is one of :data:`KV_METHODS`
        (the group's fan-out, and the Ray fallback's source side: ``kv("export", block_ids,
        heads)``). Reads start under an id and return at once (``submit_read``); the group
        polls them (``poll_reads``), so no call waits for a transfer."""
        if method not in KV_METHODS:
            raise ValueError(f"rank {self.rank}: kv method must be one of {sorted(KV_METHODS)} (got {method!r})")
        if self.runner is None:
            if method == "detach":
                return None
            raise RuntimeError(f"rank {self.rank}: KV calls before load()")
        return getattr(self.runner.kv, method)(*args)

    def node_id(self) -> str:
        """The Ray node this rank runs on."""
        return ray.get_runtime_context().get_node_id()

    def ping(self) -> int:
        """This rank (a liveness check before a rendezvous)."""
        return self.rank

    def shutdown(self) -> None:
        """Close the KV endpoint and leave the process group."""
        self.kv("detach")
        from flotilla.cluster.distributed import destroy

        destroy()


# What Worker.kv dispatches to the rank's KVPort (never a call that waits for a transfer).
KV_METHODS = frozenset(
    {"attach", "metadata", "connect", "submit_read", "poll_reads", "drop_reads", "export", "forget",
     "set_fail_next_reads", "set_delay_next_reads", "detach"}
)  # fmt: skip

# Calls that never touch the rank's state, answered even while a step runs (liveness).
UNLOCKED_METHODS = frozenset({"ping", "node_id"})


def one_call_at_a_time(cls: type) -> type:
    """A subclass of ``cls`` whose public methods (but :data:`UNLOCKED_METHODS`) run one at a
    time under one lock.

    NOTE: the group's compiled step loop (:class:`~flotilla.cluster.group.WorkerGroup`) runs
    ``execute`` on a background thread of the actor, while every other call arrives on its
    main thread: the lock keeps a query, a KV transfer or an elastic commit from running
    inside a step, as plain actor calls never did."""

    def locked(method):
        @functools.wraps(method)
        def call(self, *args, **kwargs):
            with self._call_lock:
                return method(self, *args, **kwargs)

        return call

    def init(self, *args, **kwargs):
        self._call_lock = threading.RLock()
        cls.__init__(self, *args, **kwargs)

    name = f"Serial{cls.__name__}"
    members = {"__init__": functools.wraps(cls.__init__)(init), "__doc__": cls.__doc__, "__module__": cls.__module__,
               "__qualname__": name}
    for name, member in vars(cls).items():
        if callable(member) and not name.startswith("_") and name not in UNLOCKED_METHODS:
            members[name] = locked(member)
    return type(name, (cls,), members)


def shard_runner(config: ResolvedConfig, source: ModelSource, layout: ParallelLayout) -> ModelRunner:
    """This rank's :class:`ModelRunner`: the model's shard of ``layout`` and its KV cache."""
    return ModelRunner(config, source, parallel=layout)


# The Ray actor shell: all logic stays in Worker. A crashed rank is not restarted by
# Ray (the group reports it and the replica restarts the whole group).
SerialWorker = one_call_at_a_time(Worker)
WorkerActor = ray.remote(max_restarts=0, max_task_retries=0)(SerialWorker)
