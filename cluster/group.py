"""A group of :class:`~flotilla.cluster.worker.Worker` actors, one per rank, driven
through one RPC seam.

The driver resolves the config once; :class:`WorkerGroup` puts it in the object
store once, reserves a placement group (one bundle per rank; PACK by default, see
:mod:`~flotilla.cluster.placement`), starts one actor per rank in it, has every rank
accept the config and load its shard, then drives steps: :meth:`WorkerGroup.execute`
sends the same step to every rank and waits for all of them with ONE bounded
``ray.get``; rank 0's result is returned (:meth:`WorkerGroup.execute_leaders`: every
DP-attention rank's leader's result, in DP order).

Every wait is bounded. A dead rank, a rank that raised, or a wait that ran out of
time becomes a :class:`WorkerGroupError` naming the rank and the reason; the group
is then broken (every later call raises the same error) and must be shut down and
rebuilt.

Elastic EP (:mod:`flotilla.cluster.elastic`) grows a group while it serves:
:meth:`WorkerGroup.start_joiners` reserves a placement group for the new ranks and has
them load (nothing of the running group changes), :meth:`WorkerGroup.commit_joiners`
moves every rank to the grown world at once (the caller pauses the steps around it), and
:meth:`WorkerGroup.discard_joiners` kills joiners that will not join. A failed commit puts
the running ranks back on their old world; only if that fails too is the group broken.
"""

from __future__ import annotations

import logging
import os
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Sequence

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from flotilla.cluster.compiled_steps import CompiledSteps, compiled_steps_off_reason
from flotilla.cluster.elastic import ElasticJoinError
from flotilla.cluster.models.sources import ModelSource
from flotilla.cluster.placement import DEFAULT_PLACEMENT_STRATEGY, check_placement_strategy
from flotilla.cluster.topology import Topology
from flotilla.cluster.worker import DEFAULT_COLLECTIVE_TIMEOUT_S, StepBatch, WorkerActor, WorkerInfo
from flotilla.resolution import ResolvedConfig

logger = logging.getLogger(__name__)

# Bound on a liveness ping while diagnosing a failed step.
PING_TIMEOUT_S = 10.0
# Ray actor names of joining ranks: this prefix, the rank, a tag unique to the join.
JOINER_NAME_PREFIX = "flotilla-ep-joiner-"
# CPU share of one rank's bundle on CPU nodes (small, so a 2-core box holds several ranks).
CPU_BUNDLE_SHARE = 0.5
# Network settings of the process building the group, handed to its ranks: which interface
# gloo and NCCL use (GLOO_SOCKET_IFNAME=lo keeps a one-box deployment on loopback; unset on a
# multi-node cluster, where a loopback rendezvous sets it per rank), and the Ray-on-one-box flag.
_NET_ENV = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER")
# UCX settings of the process building the group, handed to its ranks (their KV endpoints
# use NIXL over UCX; e.g. UCX_NET_DEVICES=lo keeps a one-box deployment on loopback).
_UCX_ENV = ("UCX_NET_DEVICES", "UCX_TLS")
# What an ungranted placement of each strategy needs (the end of WorkerGroupError's reason).
_PLACEMENT_HINTS = {
    "PACK": "cluster too small?",
    "STRICT_PACK": "no node with room for every rank?",
    "SPREAD": "cluster too small?",
    "STRICT_SPREAD": "fewer nodes with room than ranks?",
}


@dataclass
class Joiners:
    """Ranks started for a grown elastic EP group, loaded and not yet in it.

    Attributes:
        topology: the grown group's topology (the joiners' ranks are its last ones).
        placements: the grown expert placement of every MoE layer (decoder layer index ->
            ExpertPlacement), which the joiners were built with.
        actors: one Worker actor per joining rank, in rank order.
        placement: the joiners' own placement group.
        infos: what each joiner reported after loading (its KV layout), in rank order.
    """

    topology: Topology
    placements: dict
    actors: list[Any]
    placement: Any
    infos: list[WorkerInfo] = field(default_factory=list)


class WorkerGroupError(RuntimeError):
    """A rank of a worker group failed (picklable: plain message plus ``rank``).

    Attributes:
        rank: the failed rank, or None when the failure is not one rank's (e.g. no placement).
        reason: what happened.
    """

    def __init__(self, rank: int | None, reason: str):
        where = f"rank {rank}" if rank is not None else "worker group"
        super().__init__(f"{where} failed: {reason}")
        self.rank, self.reason = rank, reason

    def __reduce__(self):
        return (WorkerGroupError, (self.rank, self.reason))


class WorkerGroup:
    """One worker actor per rank of the config's :class:`~flotilla.cluster.topology.Topology`
    (``tp_size`` ranks, read through its TP, EP, DP-attention and DCP views).

    Args:
        config: the frozen resolved config (broadcast once through the object store).
        source: where the model is (every rank reads its own shard from it).
        rpc_timeout_s: bound on every wait for the ranks (startup phases and each step).
        collective_timeout_s: bound on every collective inside the ranks; defaults to
            ``rpc_timeout_s`` (keep it below to see a peer's death as the collective's error).
        bundle_resources: Ray resources each rank's bundle needs besides its CPU share or GPU
            (custom resources that pin the group to a node group).
        compiled_steps: send steps through a Ray compiled graph
            (:mod:`~flotilla.cluster.compiled_steps`); None: on for GPU groups, off for CPU
            groups, unless ``FLOTILLA_COMPILED_STEPS`` says otherwise.
        placement_strategy: how the ranks' bundles lie over the nodes, one of
            :data:`~flotilla.cluster.placement.PLACEMENT_STRATEGIES` (any case):
            ``PACK`` (default: on one node when the group fits one, so tensor parallelism
            stays inside a node, else over as few nodes as it fits), ``STRICT_PACK`` (one
            node or no placement), ``SPREAD`` (over as many nodes as possible) or
            ``STRICT_SPREAD`` (every rank on its own node). ValueError for another value.

    Rank 0 hosts the rendezvous at its node's address, so ranks on other nodes (and a group
    away from the driver's node) meet it there; :meth:`rank_nodes` says where each rank runs.
    Elastic EP joiners get their own placement group (PACK), which may land on other nodes.
    """

    def __init__(
        self,
        config: ResolvedConfig,
        source: ModelSource,
        rpc_timeout_s: float = 60.0,
        collective_timeout_s: float | None = None,
        bundle_resources: dict[str, float] | None = None,
        compiled_steps: bool | None = None,
        placement_strategy: str = DEFAULT_PLACEMENT_STRATEGY,
    ):
        self.placement_strategy = check_placement_strategy(placement_strategy)
        self.topology = Topology.from_config(config)
        self._compiled_requested = compiled_steps
        world_size = self.topology.world_size
        if rpc_timeout_s <= 0:
            raise ValueError(f"rpc_timeout_s must be positive (got rpc_timeout_s={rpc_timeout_s!r})")
        self.world_size = world_size
        self.rpc_timeout_s = rpc_timeout_s
        self.digest = config.digest
        self._error: WorkerGroupError | None = None
        self.actors: list[Any] = []
        # The compiled step seam (None: steps go through plain actor calls, for compiled_off).
        self._steps: CompiledSteps | None = None
        self.compiled_off: str | None = None
        bundle = _rank_bundle(config, bundle_resources)
        self.config = config
        self.collective_timeout_s = collective_timeout_s or min(rpc_timeout_s, DEFAULT_COLLECTIVE_TIMEOUT_S)
        # Placement groups of ranks that joined later (elastic EP), released at shutdown.
        self._join_placements: list[Any] = []
        strategy = self.placement_strategy
        self.placement = placement_group([dict(bundle) for _ in range(world_size)], strategy=strategy)
        try:
            ray.get(self.placement.ready(), timeout=rpc_timeout_s)
        except GetTimeoutError:
            self.shutdown()
            raise WorkerGroupError(
                None,
                f"no {strategy} placement for {world_size} bundles of {bundle} within {rpc_timeout_s}s "
                f"({_PLACEMENT_HINTS[strategy]})",
            ) from None
        for rank in range(world_size):
            self.actors.append(self._start_actor(self.placement, rank, rank, world_size, self.digest))
        try:
            # NOTE: ONE put; every rank receives the same object (Ray resolves a
            # top-level ObjectRef argument to its value before the method runs).
            config_ref = ray.put(config)
            self._gather([a.accept_config.remote(config_ref) for a in self.actors], "accept the config")
            # NOTE: rank 0 hosts the rendezvous on its own node (the group may not be on the driver's).
            rendezvous = self._gather([self.actors[0].rendezvous_point.remote()], "name a rendezvous point")[0]
            refs = [a.load.remote(source, rendezvous) for a in self.actors]
            infos: list[WorkerInfo] = self._gather(refs, "load the model")
        except WorkerGroupError:
            self.shutdown()
            raise
        self.infos = infos
        self.kv_layout = infos[0].kv_layout
        self.vocab_size = infos[0].vocab_size
        self._compile_steps()

    def rank_nodes(self) -> list[str | None]:
        """The Ray node id each rank runs on, in rank order (what each rank reported after
        loading; joined elastic EP ranks included)."""
        return [info.node_id for info in self.infos]

    def _start_actor(
        self, placement: Any, bundle: int, rank: int, world_size: int, digest: str, name: str | None = None
    ) -> Any:
        """One Worker actor for ``rank`` in bundle ``bundle`` of ``placement`` (``name``: a Ray
        actor name, so operators can find it)."""
        on_gpu = (self.config.device or "cpu") == "cuda"
        resources = {"num_gpus": 1, "num_cpus": 0} if on_gpu else {"num_cpus": CPU_BUNDLE_SHARE}
        env = {k: os.environ[k] for k in (*_NET_ENV, *_UCX_ENV) if k in os.environ}
        strategy = PlacementGroupSchedulingStrategy(placement, placement_group_bundle_index=bundle)
        named = {"name": name} if name else {}
        return WorkerActor.options(scheduling_strategy=strategy, runtime_env={"env_vars": env}, **resources, **named).remote(
            rank, world_size, digest, self.collective_timeout_s
        )

    # -- the step seam --------------------------------------------------------

    def execute(self, step: StepBatch) -> Any:
        """Run ``step`` on every rank; returns rank 0's result (the sampled tokens; under
        DP attention, DP rank 0's part of them).

        Raises WorkerGroupError (naming the rank) when a rank died, raised, or did not
        answer within ``rpc_timeout_s``.
        """
        return self.execute_leaders(step)[0]

    def execute_leaders(self, step: StepBatch) -> list[Any]:
        """Run ``step`` on every rank; returns the result of each DP-attention rank's leader
        (:attr:`Topology.attn_dp_leaders`), in DP order: ``[rank 0's]`` without DP attention.

        Through the compiled step graph when there is one (:mod:`~flotilla.cluster.compiled_steps`),
        else one actor call per rank."""
        return self.collect(self.submit(step))

    def submit(self, step: StepBatch) -> list[Any]:
        """Send ``step`` to every rank without waiting; returns the references :meth:`collect`
        takes (collect each before submitting the step after next)."""
        if self._error is not None:
            raise self._error
        if self._steps is not None:
            try:
                return self._steps.submit(step)
            except Exception as exc:  # noqa: BLE001 - every failure breaks the group, named below
                self._break_compiled(exc)
        step_ref = ray.put(step)
        return [a.execute.remote(step_ref) for a in self.actors]

    def collect(self, refs: list[Any]) -> list[Any]:
        """The DP leaders' results of a step handed to :meth:`submit` (see :meth:`execute_leaders`)."""
        if self._error is not None:
            raise self._error
        if self._steps is not None:
            try:
                results = self._steps.collect(refs)
            except Exception as exc:  # noqa: BLE001 - every failure breaks the group, named below
                self._break_compiled(exc)
        else:
            results = self._gather(refs, "execute a step")
        return [results[rank] for rank in self.topology.attn_dp_leaders]

    def _break_compiled(self, exc: BaseException) -> None:
        """A compiled step failed: the group is broken; raise its WorkerGroupError."""
        self._error = self._diagnose_compiled(exc, "execute a step")
        self._close_steps()
        raise self._error from None

    @property
    def compiled(self) -> bool:
        """Whether steps go through the compiled step graph (see :attr:`compiled_off`)."""
        return self._steps is not None

    def _compile_steps(self) -> None:
        """Build the compiled step graph over the current ranks (or note why steps stay plain calls)."""
        self.compiled_off = compiled_steps_off_reason((self.config.device or "cpu") == "cuda", self._compiled_requested)
        if self.compiled_off is not None:
            return
        try:
            self._steps = CompiledSteps(self.actors, self.rpc_timeout_s)
        except Exception as exc:  # noqa: BLE001 - plain actor calls still work
            self.compiled_off = f"compiling the step graph failed: {_first_line(exc)}"
            logger.warning("flotilla: steps go through plain actor calls: %s", self.compiled_off)

    def _close_steps(self) -> None:
        """Tear the compiled step graph down (before the ranks change or go away)."""
        steps, self._steps = self._steps, None
        if steps is not None:
            steps.close()

    def _diagnose_compiled(self, first: BaseException, what: str) -> WorkerGroupError:
        """Which rank to blame after a compiled step failed: a dead rank first (a ping tells
        it; the main thread answers even while a step runs), then the error itself (a
        compiled graph does not say which rank raised: the message does, when the rank's
        error names it)."""
        pings = _settle([a.ping.remote() for a in self.actors], min(self.rpc_timeout_s, PING_TIMEOUT_S))
        for rank, outcome in enumerate(pings):
            if isinstance(outcome, RayActorError):
                return WorkerGroupError(rank, f"its actor died while trying to {what}: {_first_line(outcome)}")
        if isinstance(first, RayTaskError):
            cause = first.cause if first.cause is not None else first
            return WorkerGroupError(None, f"a rank raised while trying to {what}: {type(cause).__name__}: {cause}")
        if isinstance(first, TimeoutError):
            return WorkerGroupError(None, f"the ranks did not {what} within {self.rpc_timeout_s}s")
        return WorkerGroupError(None, f"failed to {what}: {_first_line(first)}")

    def execute_sampled(self, schedule: Any, rows: Sequence[Any]) -> list[Any]:
        """Run one scheduled step on every rank, each DP rank's leader sampling its part's
        rows (``rows``: one :class:`SamplingRow` per sampling request, DP-major; none may
        carry a seeded generator, whose state would not come back); returns each DP rank's
        list of sampled tokens, in DP order."""
        return self.execute_leaders(StepBatch(schedule, tuple(rows)))

    def execute_logits(self, schedule: Any) -> list[Any]:
        """Run one scheduled step on every rank; returns each DP rank's ``(logits, pooled)``:
        the float32 logits ``[N_d, V]`` of its part's sampling requests and its embedding
        requests' vectors by row, in DP order (one entry without DP attention); the driver
        concatenates and samples them."""
        return self.execute_leaders(StepBatch(schedule, (), return_logits=True))

    def call(self, method: str, *args: Any, timeout_s: float | None = None) -> list[Any]:
        """Call Worker ``method(*args)`` on every rank (per-rank work, no collectives); returns
        every rank's result in rank order, after ONE bounded wait for all of them.

        A rank that RAISED leaves the group intact: the lowest such rank's own exception is
        re-raised (it names its rank; every rank has finished by then). A dead rank, or ranks
        that did not answer within ``timeout_s`` (default ``rpc_timeout_s``), break the group
        as :meth:`execute` does (WorkerGroupError naming the rank).
        """
        if self._error is not None:
            raise self._error
        refs = [getattr(actor, method).remote(*args) for actor in self.actors]
        bound = self.rpc_timeout_s if timeout_s is None else timeout_s
        what = f"answer {method}()"
        _, pending = ray.wait(refs, num_returns=len(refs), timeout=bound)
        if pending:
            self._error = self._diagnose(refs, what, GetTimeoutError(f"{len(pending)} ranks pending"))
            raise self._error
        results: list[Any] = []
        raised: list[BaseException] = []
        for ref in refs:
            try:
                results.append(ray.get(ref, timeout=0))
            except RayTaskError as exc:
                raised.append(exc.cause if exc.cause is not None else exc)
            except (RayActorError, GetTimeoutError) as exc:
                self._error = self._diagnose(refs, what, exc)
                raise self._error from None
        if raised:
            raise raised[0]
        return results

    # -- elastic EP: joining ranks ----------------------------------------------------

    def start_joiners(
        self,
        config: ResolvedConfig,
        source: ModelSource,
        topology: Topology,
        placements: dict,
        timeout_s: float,
        resources: dict[str, float] | None = None,
    ) -> Joiners:
        """Start and load the ranks ``[world_size, topology.world_size)`` of a grown group.

        ``config`` is the joiners' own resolved config (broadcast to them with one put and
        checked against its digest, as at start); each joiner builds its shard with
        ``topology`` and ``placements``. Their placement group (one bundle per joiner, plus
        ``resources`` in each bundle; PACK: joiners may land on other nodes) is separate from
        the group's. Nothing of the running
        ranks is touched, so the group keeps serving meanwhile.

        Everything is bounded by ``timeout_s``; ElasticJoinError (joiners killed, placement
        released) when the placement is not granted, a joiner dies or raises, or time runs out.
        """
        if self._error is not None:
            raise ElasticJoinError(f"the running group is broken: {self._error}")
        deadline = time.monotonic() + timeout_s
        first, count = self.world_size, topology.world_size - self.world_size
        if count < 1:
            raise ElasticJoinError(f"the grown topology has {topology.world_size} ranks, the group already {first}")
        bundle = _rank_bundle(self.config, resources)
        placement = placement_group([dict(bundle) for _ in range(count)], strategy="PACK")
        joiners = Joiners(topology, placements, [], placement)
        try:
            try:
                ray.get(placement.ready(), timeout=max(0.0, deadline - time.monotonic()))
            except GetTimeoutError:
                raise ElasticJoinError(
                    f"no placement for {count} joining ranks ({bundle} each) within --elastic-ep-scale-timeout "
                    f"({timeout_s:g}s): the cluster has no room for them and did not grow"
                ) from None
            tag = uuid.uuid4().hex[:8]
            for i in range(count):
                name = f"{JOINER_NAME_PREFIX}{first + i}-{tag}"
                joiners.actors.append(self._start_actor(placement, i, first + i, topology.world_size, config.digest, name))
            config_ref = ray.put(config)
            self._settle_joiners(joiners, [a.accept_config.remote(config_ref) for a in joiners.actors], "accept the config", deadline)
            refs = [a.load_joiner.remote(source, topology, placements) for a in joiners.actors]
            joiners.infos = self._settle_joiners(joiners, refs, "load its shard", deadline)
        except BaseException:
            self.discard_joiners(joiners)
            raise
        return joiners

    def commit_joiners(self, joiners: Joiners) -> None:
        """Move every rank, old and joining, to the grown world at once; the joiners become
        ranks of this group. Call it between steps (no step may run meanwhile).

        Bounded by the collective timeout (the rendezvous) plus the RPC bound. On failure the
        joiners are killed, the running ranks rejoin their old world with their old placements
        and ElasticJoinError is raised; if even that fails the group is broken
        (WorkerGroupError on every later call) and the error says so.
        """
        if self._error is not None:
            self.discard_joiners(joiners)
            raise ElasticJoinError(f"the running group is broken: {self._error}")
        bound = self.collective_timeout_s + self.rpc_timeout_s
        # NOTE: a joiner that died while waiting would leave the others in the rendezvous
        # until the collective timeout: check they are alive first.
        try:
            self._settle_joiners(joiners, [a.ping.remote() for a in joiners.actors], "answer before the commit", time.monotonic() + self.rpc_timeout_s)
        except ElasticJoinError:
            self.discard_joiners(joiners)
            raise
        everyone = self.actors + joiners.actors
        try:
            rendezvous = self._rendezvous_point()
        except ElasticJoinError:
            self.discard_joiners(joiners)
            raise
        # NOTE: the ranks leave the compiled step graph first: it is built over the old ranks.
        self._close_steps()
        refs = [a.elastic_commit.remote(joiners.topology, rendezvous, joiners.placements) for a in everyone]
        outcomes = _settle(refs, bound)
        failed = [(rank, out) for rank, out in enumerate(outcomes) if isinstance(out, BaseException)]
        if not failed:
            self.actors = everyone
            self.infos = self.infos + joiners.infos
            self.topology = joiners.topology
            self.world_size = joiners.topology.world_size
            self._join_placements.append(joiners.placement)
            self._compile_steps()
            return
        # NOTE: a dead rank first: the others' rendezvous timeouts are its consequence.
        rank, exc = min(failed, key=lambda f: (not isinstance(f[1], RayActorError), f[0]))
        reason = f"rank {rank} failed to join the grown world of {len(everyone)} ranks: {_first_line(exc)}"
        self.discard_joiners(joiners)
        self._roll_back(reason, bound)
        raise ElasticJoinError(f"{reason}; the group kept its {self.world_size} ranks")

    def _roll_back(self, reason: str, bound: float) -> None:
        """Put the running ranks back on their old world after a failed commit (or break the group)."""
        try:
            rendezvous = self._rendezvous_point()
        except ElasticJoinError as exc:
            self._error = WorkerGroupError(0, f"could not return to the old world after a failed join ({reason}): {exc}")
            raise ElasticJoinError(f"{reason}; and the group broke going back: {self._error}") from None
        outcomes = _settle([a.elastic_rollback.remote(rendezvous) for a in self.actors], bound)
        failed = [(rank, out) for rank, out in enumerate(outcomes) if isinstance(out, BaseException)]
        if failed:
            rank, exc = failed[0]
            self._error = WorkerGroupError(rank, f"could not return to the old world after a failed join ({reason}): {_first_line(exc)}")
            raise ElasticJoinError(f"{reason}; and the group broke going back: {self._error}")
        self._compile_steps()

    def _rendezvous_point(self) -> tuple[str, int]:
        """Rank 0's rendezvous point for a new world (ElasticJoinError when it does not answer)."""
        outcome = _settle([self.actors[0].rendezvous_point.remote()], self.rpc_timeout_s)[0]
        if isinstance(outcome, BaseException):
            raise ElasticJoinError(f"rank 0 did not name a rendezvous point: {_first_line(outcome)}")
        return outcome

    def discard_joiners(self, joiners: Joiners) -> None:
        """Kill joiners that will not join and release their placement group (idempotent)."""
        for actor in joiners.actors:
            try:
                ray.kill(actor, no_restart=True)
            except Exception:  # noqa: BLE001 - already gone
                pass
        joiners.actors = []
        if joiners.placement is not None:
            try:
                remove_placement_group(joiners.placement)
            except Exception:  # noqa: BLE001 - already removed
                pass
            joiners.placement = None

    def _settle_joiners(self, joiners: Joiners, refs: list, what: str, deadline: float) -> list[Any]:
        """Every joiner's result by ``deadline``; ElasticJoinError naming the joiner otherwise."""
        outcomes = _settle(refs, max(0.0, deadline - time.monotonic()))
        for index, out in enumerate(outcomes):
            if isinstance(out, BaseException):
                rank = self.world_size + index
                raise ElasticJoinError(f"joining rank {rank} did not {what}: {_first_line(out)}")
        return outcomes

    def _gather(self, refs: Sequence[ray.ObjectRef], what: str) -> list[Any]:
        """Every rank's result, with ONE bounded ``ray.get`` over all of them."""
        try:
            return ray.get(list(refs), timeout=self.rpc_timeout_s)
        except (RayActorError, RayTaskError, GetTimeoutError) as exc:
            self._error = self._diagnose(refs, what, exc)
            raise self._error from None

    def _diagnose(self, refs: Sequence[ray.ObjectRef], what: str, first: BaseException) -> WorkerGroupError:
        """Which rank to blame (error path only): a dead rank first (its peers' errors are
        consequences), then one that raised, then one that has not answered."""
        done, _ = ray.wait(list(refs), num_returns=len(refs), timeout=0)
        done_ids = {r.hex() for r in done}
        raised: list[tuple[int, BaseException]] = []
        for rank, ref in enumerate(refs):
            if ref.hex() not in done_ids:
                continue
            try:
                ray.get(ref, timeout=0)
            except RayActorError as exc:
                return WorkerGroupError(rank, f"its actor died while trying to {what}: {_first_line(exc)}")
            except Exception as exc:  # noqa: BLE001 - any error the rank raised is reported
                raised.append((rank, exc))
        if raised:
            rank, exc = raised[0]
            cause = exc.cause if isinstance(exc, RayTaskError) and exc.cause is not None else exc
            return WorkerGroupError(rank, f"raised while trying to {what}: {type(cause).__name__}: {cause}")
        pending = [rank for rank, ref in enumerate(refs) if ref.hex() not in done_ids]
        if pending:
            return WorkerGroupError(pending[0], f"did not {what} within {self.rpc_timeout_s}s (ranks {pending} pending)")
        return WorkerGroupError(None, f"failed to {what}: {_first_line(first)}")

    # -- teardown ---------------------------------------------------------------

    def shutdown(self) -> None:
        """Kill every rank and release the placement group (idempotent)."""
        self._close_steps()
        for actor in self.actors:
            try:
                ray.kill(actor, no_restart=True)
            except Exception:  # noqa: BLE001 - already gone
                pass
        self.actors = []
        for placement in [self.placement, *self._join_placements]:
            if placement is None:
                continue
            try:
                remove_placement_group(placement)
            except Exception:  # noqa: BLE001 - already removed
                pass
        self.placement, self._join_placements = None, []
        if self._error is None:
            self._error = WorkerGroupError(None, "the group was shut down")


def _rank_bundle(config: ResolvedConfig, extra: dict[str, float] | None = None) -> dict[str, float]:
    """One rank's placement-group bundle: a GPU on GPU nodes, a CPU share on CPU nodes, plus
    ``extra`` (custom resources that pin it to a node group)."""
    bundle: dict[str, float] = {"GPU": 1} if (config.device or "cpu") == "cuda" else {"CPU": CPU_BUNDLE_SHARE}
    return {**bundle, **(extra or {})}


def _settle(refs: Sequence[ray.ObjectRef], timeout_s: float) -> list[Any]:
    """Each ref's result, or the exception it ended with (``GetTimeoutError`` for one still
    pending after ONE bounded wait for all of them); never raises."""
    _, pending = ray.wait(list(refs), num_returns=len(refs), timeout=timeout_s)
    pending_ids = {r.hex() for r in pending}
    outcomes: list[Any] = []
    for ref in refs:
        if ref.hex() in pending_ids:
            outcomes.append(GetTimeoutError(f"no answer within {timeout_s:g}s"))
            continue
        try:
            outcomes.append(ray.get(ref, timeout=0))
        except RayTaskError as exc:
            outcomes.append(exc.cause if exc.cause is not None else exc)
        except Exception as exc:  # noqa: BLE001 - a dead actor, or anything else: reported
            outcomes.append(exc)
    return outcomes


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
