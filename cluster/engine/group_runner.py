"""``GroupRunner``: the :class:`ModelRunner` face of a tensor-parallel Ray worker group.

:class:`~flotilla.cluster.engine.llm_engine.LLMEngine` drives one runner through
``execute(step, rows)``, ``kv_layout``, ``vocab_size`` and ``generator_for(seed)``.
When the resolved ``tp_size`` is above 1 the model is sharded over ``tp_size`` Ray
actors (:class:`~flotilla.cluster.group.WorkerGroup`); this adapter sends each step to
the group, gets back rank 0's logits of the sampling rows, and samples them HERE with
the driver's :class:`Sampler`. Under DP attention the step is a
:class:`~flotilla.cluster.engine.dp_scheduler.DPSchedulerOutput`; every DP rank's leader
returns the logits of its part, and they are concatenated in DP order, which is the
order of the step's sampling rows (``scheduled`` is DP-major).

NOTE: sampling stays on the driver so a seeded request's ``torch.Generator`` (held by
the engine, advanced once per step) keeps its state across steps; shipping it to the
ranks would sample from a fresh copy every step.

Elastic EP (``--elastic-ep-backend ray``, :mod:`flotilla.cluster.elastic`): a group in the
elastic layout grows while serving. :meth:`GroupRunner.prepare_join` plans the grown layout
and expert placements and has the joiners load (from any thread: the running ranks only
answer two short queries between steps); :meth:`GroupRunner.commit_join` moves every rank
to the grown world (on the engine's thread, between steps); :meth:`GroupRunner.abort_join`
drops joiners that will not join.

For prefill/decode disaggregation each rank holds its own KV port in its actor, and
``GroupRunner.kv`` (a :class:`GroupKV`) fans every call out to them: a read has every rank
pull the KV heads it holds from the peer engine's ranks that hold them (so prefill and decode
may differ in TP size), each on its port's thread; the ranks answer at once and the driver
polls them for the outcome between steps (a :class:`GroupKVRead`), so no call to a rank waits
for a transfer while a step could be waiting behind it (a rank serves one call at a time). A
group of one rank (``tp_size == 1``) works too: the Ray-object fallback transport needs the
rank in an actor.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import os
import time
from concurrent.futures import CancelledError
from typing import Any, Sequence

import torch

from flotilla.cluster.elastic import (
    ElasticJoinError,
    check_elastic_growth,
    elastic_topology,
    grow_placements,
    summed_expert_load,
)
from flotilla.cluster.engine.dp_scheduler import DPSchedulerOutput, can_grow_elastic_ep
from flotilla.cluster.kv.port import check_kv_attachable
from flotilla.cluster.engine.sampler import SampledToken, Sampler, SamplingRow, logits_rows
from flotilla.cluster.engine.scheduler import SchedulerOutput
from flotilla.cluster.models.sources import ModelSource
from flotilla.cluster.placement import DEFAULT_PLACEMENT_STRATEGY
from flotilla.resolution import ResolvedConfig


def _shipped(row: SamplingRow) -> SamplingRow:
    """``row`` as it travels to the ranks: the prompt-and-output ids only when a penalty
    reads them (they grow with every token and would be pickled every step)."""
    if row.token_ids and not row.params.has_penalties:
        return dataclasses.replace(row, token_ids=(), num_prompt_tokens=0)
    return row


# Bound on a step (and on startup) when --watchdog-timeout is not set: SGLang's default.
DEFAULT_STEP_TIMEOUT_S = 300.0
# Bound on closing the ranks' KV endpoints at shutdown (they are killed right after).
KV_DETACH_TIMEOUT_S = 10.0
# A group's KV reads are polled on its ranks at most this often (one call for all of them).
KV_POLL_INTERVAL_S = 0.002


def ensure_ray(num_ranks: int) -> None:
    """Start a local Ray cluster on loopback unless this process is already connected to one."""
    import ray

    if ray.is_initialized():
        return
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    # NOTE: address="local": a new cluster even when `ray start` runs one on this machine.
    ray.init(address="local", include_dashboard=False, num_cpus=max(4, num_ranks), log_to_driver=False, configure_logging=False)


# GroupBatch.token_ids of a pipelined step: its ids stay on the ranks' devices (the driver
# only passes the feed back to launch, which tells the ranks to use them).
ON_RANKS = "sampled ids on the ranks"


class GroupBatch:
    """One launched step of a group (:meth:`GroupRunner.launch`), the group's
    :class:`~flotilla.cluster.engine.sampler.SampledBatch`.

    Attributes:
        token_ids: :data:`ON_RANKS` for a pipelined step (the ranks feed its ids to the
            next one), None for a step sampled here (nothing can feed from it).
        result_refs: the references of the launch (or flush) whose result carries this
            step's tokens; set by the next launch."""

    def __init__(self, runner: "GroupRunner", tokens: list[SampledToken] | None = None):
        self.runner = runner
        self.token_ids = ON_RANKS if tokens is None else None
        self.result_refs: list[Any] | None = None
        self._tokens = tokens

    def can_feed_rows(self, rows: Sequence[SamplingRow]) -> bool:
        """Whether a step with ``rows`` may launch before this one resolves: its ids must be
        on the ranks, and no row may be seeded (seeded rows sample here, from logits)."""
        return self.token_ids is ON_RANKS and not any(row.generator is not None for row in rows)

    def resolve(self) -> list[SampledToken]:
        """The step's tokens, in row order (waits for them; flushes the ranks when no later
        launch carries them)."""
        if self._tokens is None:
            refs = self.result_refs if self.result_refs is not None else self.runner._take_flush(self)
            parts = self.runner.group.collect(refs)
            self._tokens = [token for part in parts for token in (part or [])]
        return self._tokens


class RankGraphs:
    """The decode CUDA graphs the ranks of a group captured (every rank the same sizes), as
    far as the driver needs them: which size a batch replays at, and timing a replay.

    Args:
        group: the worker group.
        batch_sizes: the captured sizes (rank 0's start-up report)."""

    def __init__(self, group: Any, batch_sizes: Sequence[int]):
        self.group = group
        self.batch_sizes = tuple(sorted(int(b) for b in batch_sizes))
        self.max_bs = self.batch_sizes[-1]

    def padded_size(self, num_seqs: int) -> int | None:
        """The captured size a batch of ``num_seqs`` replays at (None: it runs eagerly)."""
        return next((bs for bs in self.batch_sizes if bs >= num_seqs), None) if num_seqs >= 1 else None

    def time_replay(self, num_seqs: int, iters: int = 50) -> float:
        """Milliseconds one replay takes on the slowest rank: every rank replays its graph
        ``iters`` times together (their collectives pair up); see
        ``DecodeGraphs.time_replay``. Call between steps."""
        return max(self.group.call("time_decode_graph", int(num_seqs), int(iters)))


class GroupRunner:
    """Runs the model on a ``config.tp_size``-rank worker group; samples on the driver.

    Args:
        config: the resolved configuration (broadcast once to every rank).
        source: the model (every rank loads its own shard).
        rank_resources: Ray resources each rank's bundle needs besides its CPU or GPU (custom
            resources that pin the group to a node group).
        joiner_resources: the same for ranks that join later (elastic EP), which may land on
            other nodes.
        placement_strategy: how the ranks lie over the nodes (``WorkerGroup``'s
            ``placement_strategy``: ``PACK`` by default, one node when the group fits one).

    The bounds come from the config, with SGLang's meanings: ``--watchdog-timeout`` bounds
    every wait for the ranks (startup and each step; default 300 s) and ``--dist-timeout``
    every collective inside them (default: the smaller of the step bound and 60 s). A dead
    rank therefore surfaces as a ``WorkerGroupError`` within one step bound.
    """

    def __init__(
        self,
        config: ResolvedConfig,
        source: ModelSource,
        rank_resources: dict[str, float] | None = None,
        joiner_resources: dict[str, float] | None = None,
        placement_strategy: str = DEFAULT_PLACEMENT_STRATEGY,
    ):
        from flotilla.cluster.group import WorkerGroup

        world_size = int(config.tp_size or 1)
        ensure_ray(world_size)
        self.config = config
        self.source = source
        self.joiner_resources = dict(joiner_resources or {})
        # NOTE: logits come back to the driver on CPU; the driver samples there.
        self.device = torch.device("cpu")
        self.group = WorkerGroup(
            config,
            source,
            rpc_timeout_s=float(config.watchdog_timeout or DEFAULT_STEP_TIMEOUT_S),
            collective_timeout_s=float(config.dist_timeout) if config.dist_timeout else None,
            bundle_resources=rank_resources,
            placement_strategy=placement_strategy,
        )
        # NOTE: every rank must hold every block the scheduler hands out (each DP rank's
        # scheduler is sized alike), so the pool is the smallest any rank allocated.
        self.kv_layout = min((info.kv_layout for info in self.group.infos), key=lambda kv: kv.num_blocks)
        self.vocab_size = int(self.group.vocab_size)
        generator = None
        if config.random_seed is not None:
            generator = torch.Generator(device=self.device).manual_seed(int(config.random_seed))
        self.sampler = Sampler(generator)
        # The ranks' KV ports, as one handle (prefill/decode disaggregation).
        self.kv = GroupKV(self.group)
        # The last pipelined step launched whose tokens are still on the ranks (see launch).
        self._open: GroupBatch | None = None
        self._startup = self.group.call("startup_report")
        sizes = self._startup[0]["graph_batch_sizes"]
        # The ranks' decode CUDA graphs, seen from here (for timing them between steps).
        self.graphs = RankGraphs(self.group, sizes) if sizes else None
        self.graphs_off_reason = self._startup[0]["graphs_off_reason"]

    def startup_report(self) -> dict[str, Any]:
        """Rank 0's start-up report (see ``ModelRunner.startup_report``), with
        ``graph_capture_s`` the slowest rank's (the ranks capture together)."""
        report = dict(self._startup[0])
        report["graph_capture_s"] = max(r["graph_capture_s"] for r in self._startup)
        return report

    def generator_for(self, seed: int) -> torch.Generator:
        """A fresh generator on the driver, for a request with ``seed``."""
        return torch.Generator(device=self.device).manual_seed(seed)

    @property
    def supports_overlap(self) -> bool:
        """Whether the engine may pipeline steps through :meth:`launch` (overlap scheduling
        across the group): not under DP attention or elastic EP (their steps stay one at a
        time). The engine turns it on for GPU groups (see ``LLMEngine``)."""
        return self.group.topology.attn_dp_size == 1 and not can_grow_elastic_ep(self.config)

    def launch(
        self, step: SchedulerOutput | DPSchedulerOutput, rows: Sequence[SamplingRow], feed: Any = None
    ) -> "GroupBatch":
        """Queue ``step`` on the ranks without waiting for its tokens (overlap scheduling;
        see :mod:`~flotilla.cluster.engine.overlap`). ``feed`` (the previous launch's feed):
        the ranks fill the step's pending ids from their previous step's device ids.

        Each rank launches the step, then waits for the previous pipelined step's tokens and
        returns those, so the result of this launch arrives with the next one (or a flush,
        when the engine resolves before launching more). A step with a seeded row runs at
        once and samples here (the engine resolves the step before it: see
        :meth:`GroupBatch.can_feed_rows`)."""
        from flotilla.cluster.worker import StepBatch

        if any(row.generator is not None for row in rows):
            return GroupBatch(self, tokens=self.execute(step, rows))  # NOTE: execute flushes first
        refs = self.group.submit(StepBatch(step, [_shipped(row) for row in rows], pipelined=True, feed=feed is not None))
        if self._open is not None:
            self._open.result_refs = refs
        else:
            self.group.collect(refs)  # NOTE: the ranks held no step: nothing comes back but the launch
        self._open = GroupBatch(self)
        return self._open

    def _flush_open(self) -> None:
        """Have the ranks hand back the open pipelined step's tokens (kept in its batch)."""
        if self._open is not None:
            self._open.resolve()

    def _take_flush(self, batch: "GroupBatch") -> list[Any]:
        """The references of a flush that returns ``batch``'s tokens (``batch`` is the open one)."""
        if batch is not self._open:
            raise RuntimeError("a pipelined step resolved out of order: only the last launched one flushes")
        from flotilla.cluster.worker import StepBatch

        self._open = None
        return self.group.submit(StepBatch(None, (), flush=True))

    def execute(self, step: SchedulerOutput | DPSchedulerOutput, rows: Sequence[SamplingRow]) -> list[SampledToken]:
        """Run one step on every rank; returns one token per sampling request (schedule
        order, DP-major under DP attention), sampled with ``rows`` (one per such request,
        same order).

        Without a seeded row, each DP rank's leader samples its rows next to its logits (on
        its GPU) and only the tokens come back; a step with a seeded row brings the float32
        logits back and samples them here, where the seeded generators keep their state."""
        self._flush_open()
        if not any(row.generator is not None for row in rows):
            parts = self.group.execute_sampled(step, [_shipped(row) for row in rows])
            tokens = [token for part in parts for token in part]
            if len(tokens) != len(rows):
                raise ValueError(f"{len(rows)} sampling rows for {len(tokens)} sampled tokens")
            return tokens
        parts = self.group.execute_logits(step)
        logits = parts[0][0] if len(parts) == 1 else torch.cat([p[0] for p in parts], dim=0)
        if logits_rows(rows) != logits.shape[0]:
            raise ValueError(f"{len(rows)} sampling rows (with drafts: {logits_rows(rows)}) for {logits.shape[0]} logits rows")
        tokens = self.sampler(logits, rows)
        offset = 0
        for part_logits, pooled in parts:  # NOTE: embedding requests' vectors, by DP part
            for row, vector in pooled.items():
                tokens[offset + row].embedding = vector
            offset += part_logits.shape[0]
        return tokens

    # -- elastic EP: growing the group ---------------------------------------------------

    @property
    def ep_size(self) -> int:
        """The group's current EP size (grows with each committed join)."""
        return self.group.topology.ep_size

    @property
    def dp_size(self) -> int:
        """The group's current number of DP-attention ranks."""
        return self.group.topology.attn_dp_size

    def prepare_join(self, joiner_config: ResolvedConfig, new_size: int, timeout_s: float) -> Any:
        """Plan a grown group of ``new_size`` ranks and start its joining ranks (resolved as
        ``joiner_config``); returns the loaded :class:`~flotilla.cluster.group.Joiners` for
        :meth:`commit_join` or :meth:`abort_join`.

        The new ranks' expert slots hold copies chosen from the expert load the ranks measured
        (``--expert-distribution-recorder-mode stat``; without it every expert counts alike).
        Safe to call from a thread other than the engine's: the running ranks only answer two
        queries, queued between their steps. ElasticJoinError when the growth is not allowed or
        the joiners do not come up within ``timeout_s``.
        """
        check_elastic_growth(self.config, self.ep_size, new_size)
        try:
            topology = elastic_topology(self.group.topology, new_size)
        except ValueError as exc:
            raise ElasticJoinError(str(exc)) from None
        placements = self.group.call("expert_placements")[0]
        if not placements:
            raise ElasticJoinError(f"{self.source.architecture} has no MoE layer: there is no expert parallelism to grow")
        num_experts = next(iter(placements.values())).num_logical
        loads = summed_expert_load(self.group.call("expert_load"), list(placements), num_experts)
        grown = grow_placements(placements, new_size, loads)
        joiners = self.group.start_joiners(joiner_config, self.source, topology, grown, timeout_s, self.joiner_resources)
        small = [info for info in joiners.infos if info.kv_layout.num_blocks < self.kv_layout.num_blocks]
        if small or any(info.kv_layout.block_size != self.kv_layout.block_size for info in joiners.infos):
            self.group.discard_joiners(joiners)
            got = [(i.rank, i.kv_layout.num_blocks, i.kv_layout.block_size) for i in joiners.infos]
            raise ElasticJoinError(
                f"the joining ranks' KV pools (rank, blocks, block size) {got} are smaller than or unlike the "
                f"running ranks' ({self.kv_layout.num_blocks} blocks of {self.kv_layout.block_size}); every DP "
                "rank's scheduler is sized alike: give the joiners the same --max-total-tokens and page size"
            )
        return joiners

    def commit_join(self, joiners: Any) -> None:
        """Move every rank to the grown world (call between steps, on the engine's thread).
        ElasticJoinError when it failed: the group then runs at its old size (see
        :meth:`~flotilla.cluster.group.WorkerGroup.commit_joiners`)."""
        self.group.commit_joiners(joiners)

    def abort_join(self, joiners: Any) -> None:
        """Kill prepared joiners that will not join (idempotent)."""
        self.group.discard_joiners(joiners)

    def shutdown(self) -> None:
        """Close the KV endpoints (best effort: a broken group is killed as it is), then stop
        every rank (idempotent); the Ray cluster itself stays up."""
        self.kv.close()
        self.group.shutdown()


class GroupKV:
    """``GroupRunner.kv``: the group's ranks' KV ports as one handle, every call fanned out
    to every rank (``Worker.kv(method, ...)`` through ``WorkerGroup.call``).

    NOTE: a rank's KVRankError (or ValueError) is re-raised naming the rank and leaves the
    group usable; a dead or silent rank breaks it (WorkerGroupError), so the engine fails at
    its next step.
    """

    def __init__(self, group: Any):
        self.group = group
        self.peer_id: str | None = None
        self._metadata: list[bytes] | None = None
        self._ids = itertools.count()
        # Reads in flight: id -> {rank: its outcome so far}.
        self._reads: dict[int, dict[int, Any]] = {}
        self._polled_at = 0.0

    @property
    def attached(self) -> bool:
        return self.peer_id is not None

    def attach(self, factory: Any) -> None:
        """Build every rank's KV endpoint in its actor: ``factory(rank, kv_caches, head_span,
        token_shard)`` (``factory`` is pickled to the ranks; once until :meth:`detach`).
        NotImplementedError under attention context parallelism."""
        topology = self.group.topology
        check_kv_attachable(topology.attn_cp_size)
        if self.attached:
            raise RuntimeError("KV endpoints are already attached to this group's ranks; detach them (kv.detach()) first")
        try:
            self.group.call("kv", "attach", factory)
        except Exception:
            # NOTE: ranks that attached before another failed close again, so a retry starts clean.
            with contextlib.suppress(Exception):
                self.group.call("kv", "detach")
            raise
        self.peer_id = getattr(factory, "name", None) or "kv"

    def metadata(self) -> list[bytes]:
        """Every rank's endpoint metadata, in rank order (fixed until :meth:`detach`)."""
        if self._metadata is None:
            self._metadata = [entry for rank in self.group.call("kv", "metadata") for entry in rank]
        return list(self._metadata)

    def dp_peer(self, dp_rank: int) -> tuple[str, list[bytes]]:
        """``(peer id, metadata)`` of DP-attention rank ``dp_rank``'s ranks, as a ticket of
        its blocks names them: the ranks of that DP rank only (rank order), under a peer id of
        its own (``f"{peer_id}/dp{dp_rank}"``). Without DP attention: the whole group."""
        topology = self.group.topology
        metadata = self.metadata()
        if topology.attn_dp_size == 1:
            return self.peer_id or "", metadata
        if not 0 <= dp_rank < topology.attn_dp_size:
            raise ValueError(f"dp_rank must be in [0, {topology.attn_dp_size}) (got dp_rank={dp_rank!r})")
        width = topology.world_size // topology.attn_dp_size
        return f"{self.peer_id}/dp{dp_rank}", metadata[dp_rank * width : (dp_rank + 1) * width]

    def connect(self, peer_id: str, peer_metadata: Sequence[bytes]) -> None:
        """Every rank connects peer engine ``peer_id`` (its ``metadata()``; idempotent).
        NOTE: waits for reads in flight on the ranks; the engine connects through
        :meth:`start_read`'s ``connect_with`` instead."""
        self.group.call("kv", "connect", peer_id, list(peer_metadata))

    def start_read(
        self,
        peer_id: str,
        src: Sequence[int],
        dst: Sequence[int],
        timeout_s: float,
        connect_with: Sequence[bytes] | None = None,
        dp_rank: int | None = None,
    ) -> "GroupKVRead":
        """Have every rank start reading its KV heads of ``peer_id``'s blocks ``src`` into
        blocks ``dst`` (each on its port's thread, bounded by ``timeout_s``; connecting the
        peer first with ``connect_with`` when a rank has not); returns at once with a handle
        the driver polls. ``dp_rank``: the blocks are that DP-attention rank's, and only its
        ranks read (the others answer 0 bytes at once). Its result is the bytes moved, all
        ranks summed, or the lowest failing rank's KVRankError; WorkerGroupError when a rank
        died."""
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive (got timeout_s={timeout_s!r})")
        dp_size = self.group.topology.attn_dp_size
        if dp_rank is not None and not 0 <= int(dp_rank) < dp_size:
            raise ValueError(f"dp_rank must be in [0, {dp_size}) (got dp_rank={dp_rank!r})")
        if dp_rank is None and dp_size > 1:
            raise ValueError(f"a DP-attention group (dp_size={dp_size}) reads into one DP rank's pool: pass dp_rank")
        read_id = next(self._ids)
        args = (peer_id, [int(b) for b in src], [int(b) for b in dst], float(timeout_s))
        connect = None if connect_with is None else list(connect_with)
        self.group.call("kv", "submit_read", read_id, *args, connect, None if dp_rank is None else int(dp_rank))
        self._reads[read_id] = {}
        # NOTE: each rank bounds its read by timeout_s; past that plus the group's RPC bound a
        # silent rank counts as a failed read.
        return GroupKVRead(self, read_id, time.monotonic() + float(timeout_s) + self.group.rpc_timeout_s)

    def read(self, peer_id: str, src: Sequence[int], dst: Sequence[int], timeout_s: float) -> int:
        """:meth:`start_read` and wait for it (polling the ranks): the bytes moved."""
        return self.start_read(peer_id, src, dst, timeout_s).result()

    def export(self, block_ids: Sequence[int], heads: tuple[int, int] | None = None) -> list[Any]:
        """Every rank's Ray-fallback export of the blocks (rank order)."""
        return self.group.call("kv", "export", [int(b) for b in block_ids], heads)

    def forget(self, peer_id: str) -> None:
        """Every rank drops peer engine ``peer_id`` (after its reads queued before)."""
        self.group.call("kv", "forget", peer_id)

    def set_fail_next_reads(self, n: int) -> None:
        """Test seam: every rank's next ``n`` reads fail without moving anything."""
        self.group.call("kv", "set_fail_next_reads", n)

    def set_delay_next_reads(self, seconds: float, n: int = 1) -> None:
        """Test seam: every rank's next ``n`` reads wait ``seconds`` first (a slow link)."""
        self.group.call("kv", "set_delay_next_reads", seconds, n)

    def detach(self) -> None:
        """Close every rank's KV endpoint (idempotent)."""
        self.group.call("kv", "detach")
        self._forget_all()

    def close(self) -> None:
        """:meth:`detach`, best effort and bounded (shutdown: a broken group is killed next)."""
        if not self.attached:
            return
        self._forget_all()
        try:
            self.group.call("kv", "detach", timeout_s=min(self.group.rpc_timeout_s, KV_DETACH_TIMEOUT_S))
        except Exception:  # noqa: BLE001 - the ranks are killed next anyway
            pass

    def _forget_all(self) -> None:
        self.peer_id, self._metadata = None, None
        self._reads.clear()

    # -- the reads in flight (GroupKVRead) --------------------------------------------------

    def _outcome(self, read_id: int) -> Any:
        """The read's outcome once every rank has one (None while any rank reads): the bytes
        summed, or the lowest rank's exception."""
        ranks = self._reads.get(read_id)
        if ranks is None or len(ranks) < self.group.world_size:
            return None
        del self._reads[read_id]
        failed = [ranks[r] for r in sorted(ranks) if isinstance(ranks[r], BaseException)]
        return failed[0] if failed else sum(int(ranks[r]) for r in ranks)

    def _poll(self) -> None:
        """Ask every rank for its reads in flight that ended (one call for all of them)."""
        if not self._reads or time.monotonic() - self._polled_at < KV_POLL_INTERVAL_S:
            return
        ids = list(self._reads)
        try:
            answers = self.group.call("kv", "poll_reads", ids)
        except Exception as exc:  # noqa: BLE001 - a broken group fails every read in flight
            for ranks in self._reads.values():
                for rank in range(self.group.world_size):
                    ranks.setdefault(rank, exc)
            return
        finally:
            self._polled_at = time.monotonic()
        for rank, ended in enumerate(answers):
            for read_id, outcome in ended.items():
                if read_id in self._reads:
                    self._reads[read_id][rank] = outcome

    def _drop(self, read_id: int) -> None:
        if self._reads.pop(read_id, None) is not None:
            with contextlib.suppress(Exception):
                self.group.call("kv", "drop_reads", [read_id])


class GroupKVRead:
    """One KV read of a worker group (:meth:`GroupKV.start_read`), a
    :class:`~flotilla.cluster.engine.kv_contract.KVRead`: :meth:`done` polls the ranks
    (never waits for a transfer), :meth:`result` waits, polling."""

    def __init__(self, kv: GroupKV, read_id: int, deadline: float):
        self._kv, self.read_id, self._deadline = kv, read_id, deadline
        self._ended = False
        self._outcome: Any = None

    def done(self) -> bool:
        if not self._ended:
            self._kv._poll()
            outcome = self._kv._outcome(self.read_id)
            if outcome is None and time.monotonic() > self._deadline:
                self._kv._drop(self.read_id)
                outcome = TimeoutError(f"the worker group's ranks did not end KV read {self.read_id} within its bound")
            if outcome is not None:
                self._ended, self._outcome = True, outcome
        return self._ended

    def result(self) -> int:
        while not self.done():
            time.sleep(KV_POLL_INTERVAL_S)
        if isinstance(self._outcome, BaseException):
            raise self._outcome
        return int(self._outcome)

    def cancel(self) -> bool:
        if not self._ended:
            self._kv._drop(self.read_id)
            self._ended, self._outcome = True, CancelledError(f"KV read {self.read_id} was given up")
        return True
