"""The one place that builds an engine's model runner: in this process
(:class:`~flotilla.cluster.engine.model_runner.ModelRunner`) or on a Ray worker group
(:class:`~flotilla.cluster.engine.group_runner.GroupRunner`), with a KV endpoint attached to
every rank when the engine serves a prefill/decode pool.

:class:`RunnerSpec` says where the ranks run and what they need; ``LLMEngine`` keeps it, so
:meth:`~flotilla.cluster.engine.llm_engine.LLMEngine.restart` builds the same kind of runner
again (its KV endpoint included, under a new name: a restarted engine is a new KV peer).
The serving side (``EngineReplica``) decides the spec from its pool (``serve.plan.ranks_in_replica``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import uuid
from dataclasses import dataclass, field
from typing import Any, Mapping

from flotilla.cluster.engine.dp_scheduler import can_grow_elastic_ep
from flotilla.cluster.engine.model_runner import ModelRunner
from flotilla.cluster.kv.endpoint import KVEndpointFactory
from flotilla.cluster.models.sources import ModelSource
from flotilla.cluster.placement import DEFAULT_PLACEMENT_STRATEGY, check_placement_strategy
from flotilla.resolution import ResolvedConfig


@dataclass(frozen=True)
class RunnerSpec:
    """How to build an engine's runner.

    The ranks run in a Ray worker group when ``tp_size > 1``, when the group may grow
    (elastic EP: joining ranks need the running ones in a Ray group) or when the spec asks for
    actors; else the one rank runs in this process.

    Attributes:
        ranks_in_actors: run the ranks in a worker group even where the config alone would
            run its one rank in this process (a PD replica on the Ray-object KV fallback: the
            peer's reads call its ranks' actors).
        rank_resources: Ray resources each rank's bundle needs besides its CPU or GPU (custom
            resources that pin the group to a node group); an in-process rank runs where its
            caller does.
        joiner_resources: the same for ranks that join later (elastic EP).
        placement_strategy: how a worker group's ranks lie over the nodes, one of
            :data:`~flotilla.cluster.placement.PLACEMENT_STRATEGIES` (default ``PACK``: one
            node when the group fits one); checked here, so a bad value fails before any
            runner is built. Elastic EP joiners always PACK.
        kv_endpoint: attach a KV endpoint built by this factory to every rank (a prefill or
            decode pool); each runner built gets it under the name
            ``f"{kv_endpoint.name}-{8 hex digits}"``, unique per incarnation. None: no endpoint.
    """

    ranks_in_actors: bool = False
    rank_resources: Mapping[str, float] = field(default_factory=dict)
    joiner_resources: Mapping[str, float] = field(default_factory=dict)
    placement_strategy: str = DEFAULT_PLACEMENT_STRATEGY
    kv_endpoint: KVEndpointFactory | None = None

    def __post_init__(self) -> None:
        check_placement_strategy(self.placement_strategy, "RunnerSpec.placement_strategy")

    @classmethod
    def from_placement(cls, placement: Mapping[str, Mapping[str, float]] | None) -> "RunnerSpec":
        """The spec of ``{"ranks": {...}, "joiners": {...}}`` placement resources."""
        placement = placement or {}
        return cls(rank_resources=dict(placement.get("ranks", {})), joiner_resources=dict(placement.get("joiners", {})))

    def in_worker_group(self, config: ResolvedConfig) -> bool:
        """Whether the runner built for ``config`` runs its ranks in a Ray worker group."""
        return self.ranks_in_actors or int(config.tp_size or 1) > 1 or can_grow_elastic_ep(config)


def build_runner(config: ResolvedConfig, source: ModelSource, spec: RunnerSpec | None = None) -> Any:
    """The runner ``spec`` asks for (default: :class:`RunnerSpec`'s choices), its KV endpoint
    attached when the spec has one (the runner is shut down again when attaching fails)."""
    spec = spec or RunnerSpec()
    if spec.in_worker_group(config):
        # NOTE: imported here so a single-rank engine never imports Ray (no cycle: group_runner
        # does not import this module).
        from flotilla.cluster.engine.group_runner import GroupRunner

        runner = GroupRunner(
            config,
            source,
            rank_resources=dict(spec.rank_resources),
            joiner_resources=dict(spec.joiner_resources),
            placement_strategy=spec.placement_strategy,
        )
    else:
        runner = ModelRunner(config, source)
    if spec.kv_endpoint is not None:
        factory = dataclasses.replace(spec.kv_endpoint, name=f"{spec.kv_endpoint.name}-{uuid.uuid4().hex[:8]}")
        try:
            runner.kv.attach(factory)
        except BaseException:
            with contextlib.suppress(Exception):
                runner.shutdown()  # NOTE: closes the endpoints and stops the workers
            raise
    return runner
