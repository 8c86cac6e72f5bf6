"""``EngineReplica``: one engine replica of the Serve application (a plain class).

:mod:`flotilla.serve.app` turns it into a deployment with
``serve.deployment(EngineReplica).options(...)``; the class itself needs no Serve, so tests
construct it directly. Inside Serve:

- ``generate`` is an async generator: callers stream it with ``handle.options(stream=True)``;
  a caller that stops reading (client disconnect) cancels it, which aborts the request
  and frees its KV blocks.
- ``record_routing_stats`` is polled by Serve; the dict (a :class:`ReplicaLoad`'s fields)
  reaches the request router as ``RunningReplica.routing_stats``.
- ``check_health`` raises once the engine died, so Serve replaces the replica; ``health``
  answers the same state at once (with the reason) for the ingress's pool watches.
- Every :data:`~flotilla.serve.metrics.PUSH_INTERVAL_S` a background task pushes the
  replica's metrics to the namespace's :class:`~flotilla.serve.metrics.MetricsHub`, where
  the ingress collects them (:func:`~flotilla.serve.metrics.collect_metrics_text`).

Under prefill/decode disaggregation (:mod:`flotilla.serve.pd`) a replica has a role, its
``pool``: ``prefill`` replicas answer :meth:`EngineReplica.prefill` with a
:class:`~flotilla.cluster.engine.kv_contract.PrefillTicket` and free the blocks on
:meth:`EngineReplica.release_kv`; ``decode`` replicas stream
:meth:`EngineReplica.generate_prefilled`. Both have their runner built with a KV endpoint on
every rank (:func:`~flotilla.cluster.engine.runner_factory.build_runner` with a
:class:`~flotilla.cluster.kv.endpoint.KVEndpointFactory`; named uniquely per runner
incarnation: a restarted replica is a new KV peer).

An elastic EP deployment (``options.elastic_plan`` set; one replica holds the whole group)
grows through :meth:`EngineReplica.scale_elastic_ep` (an
:class:`~flotilla.serve.elastic_ep.ElasticEPScaler`), reports
:meth:`EngineReplica.is_scaling_elastic_ep` and :meth:`EngineReplica.elastic_ep_state`,
exports the elastic EP metrics and, with ``options.elastic_autoscale.enabled``, runs the
autoscaler's driver (:mod:`flotilla.serve.ep_autoscale_driver`) on its event loop.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import logging
import os
import sys
import time
from typing import Any, AsyncIterator

from flotilla.cluster.engine.kv_contract import PrefillTicket
from flotilla.cluster.engine.runner_factory import RunnerSpec
from flotilla.cluster.kv.endpoint import KVEndpointFactory
from flotilla.cluster.log_level import apply_log_level
from flotilla.cluster.models.sources import ModelSource, served_model_source
from flotilla.cluster.models.tokenizer import load_tokenizer_or_none
from flotilla.resolution import ResolvedConfig
from flotilla.serve.async_engine import AsyncEngine
from flotilla.serve.elastic_ep import (
    ElasticEPDisabledError,
    ElasticEPPlan,
    ElasticEPScaler,
    configure_elastic_log,
    not_elastic_message,
)
from flotilla.serve.ep_autoscale_driver import p90
from flotilla.serve.metrics import POOLS, push_metrics_forever
from flotilla.serve.plan import ranks_in_replica
from flotilla.serve.types import GenerateChunk, GenerateRequest, ReplicaPin, ServeOptions, placement_group_of

logger = logging.getLogger(__name__)

# The latencies a replica reports to Serve's autoscaler are those of this many last seconds:
# a first token is rare while long streams run, and a window without one must not read as calm.
AUTOSCALING_STATS_WINDOW_S = 10.0
# How often a colocated replica rebuilds its worker group after a rank failed (with back-off,
# AsyncEngine.RESTART_BACKOFF_S) before its engine is dead and Serve replaces the replica.
GANG_RESTART_ATTEMPTS = 3


def gang_restart_attempts(pool: str, options: ServeOptions) -> int:
    """``AsyncEngine.restart_attempts`` of a replica: a colocated replica rebuilds its own
    worker group; a PD replica is a KV peer by its runner's incarnation and an elastic EP
    group's size is its scaler's, so those leave the rebuild to Serve (a new replica)."""
    return GANG_RESTART_ATTEMPTS if pool == "colocated" and options.elastic_plan is None else 0


class EngineReplica:
    """An :class:`AsyncEngine` over the model named by ``options.model``.

    Args:
        config: the resolved configuration (resolved once by the driver).
        options: serving options (``model``, ``max_queued_requests``; in PD roles also
            ``kv_transport``, ``kv_lease_s``, ``kv_load_failure_policy``,
            ``kv_transfer_timeout_s``; elastic EP: ``elastic_plan``, ``elastic_autoscale``).
        pool: the replica's role, one of :data:`~flotilla.serve.metrics.POOLS`:
            ``"colocated"`` (default), ``"prefill"`` or ``"decode"``. PD roles run the
            model's one rank in this process with NIXL at ``tp_size`` 1, else on a worker
            group (``tp_size`` > 1, or ``kv_transport="ray"``, whose source ranks must be
            actors the reader can call), and attach a KV endpoint to every rank.
        replica_id: the metrics' ``replica`` label and the ticket's ``replica_id``
            (default: Serve's replica tag inside a Serve replica, else ``local-<pid>``).
        push_metrics: push metrics to the hub (default: only inside a Serve replica).
    """

    def __init__(
        self,
        config: ResolvedConfig,
        options: ServeOptions,
        *,
        pool: str = "colocated",
        replica_id: str | None = None,
        push_metrics: bool | None = None,
    ):
        if pool not in POOLS:
            raise ValueError(f"pool must be one of {POOLS} (got pool={pool!r})")
        if options.elastic_plan is not None and pool != "colocated":
            raise ValueError(
                f"pool={pool!r} with an elastic EP plan: elastic EP grows a colocated deployment; "
                "drop --disaggregation-mode pd or --max-ep-size"
            )
        serve_id = _serve_replica_id()
        self.replica_id = replica_id or serve_id or f"local-{os.getpid()}"
        self.config, self.options, self.pool = config, options, pool
        apply_log_level(config)
        self.source: ModelSource = served_model_source(options.model, config)
        tokenizer = None
        if not config.skip_tokenizer_init:
            tokenizer = load_tokenizer_or_none(self.source, config.tokenizer_path)[0]
        self.engine = AsyncEngine.from_config(
            config, self.source, tokenizer, options.max_queued_requests,
            replica_id=self.replica_id, pool=pool, runner_spec=self._runner_spec(),
            stream_batch_s=options.stream_batch_ms / 1000.0, restart_attempts=gang_restart_attempts(pool, options),
        )  # fmt: skip
        # The KV peer this replica is to decode replicas (PD roles only).
        kv = self.engine.engine.runner.kv
        self.kv_peer_id: str | None = kv.peer_id if kv.attached else None
        self._push_task: asyncio.Task | None = None
        # Where record_autoscaling_stats's last read of the recent TTFTs and ITLs ended, and
        # the (time, seconds) of those within its window.
        self._ttft_cursor = self._itl_cursor = 0
        self._recent_ttfts: collections.deque[tuple[float, float]] = collections.deque()
        self._recent_itls: collections.deque[tuple[float, float]] = collections.deque()
        self.elastic: ElasticEPScaler | None = None
        self._autoscale: Any = None
        if hasattr(self.engine.engine.scheduler, "schedulers"):
            # NOTE: a DPScheduler (DP attention, or an elastic EP group): requests per DP rank.
            self.engine.metrics.enable_dp_rank_requests(self.engine.dp_rank_requests)
        if options.elastic_plan is not None:
            if serve_id is not None:
                configure_elastic_log()
            self._start_elastic_ep(options.elastic_plan)
        if push_metrics if push_metrics is not None else serve_id is not None:
            self._start_pushing_metrics()
        logger.info("engine replica %s (pool %s) serves %s", self.replica_id, pool, self.source.path)

    def _runner_spec(self) -> RunnerSpec:
        """How this replica's runner is built: where its ranks run (``ranks_in_replica``), their
        Ray resources (its placement group's and the elastic EP joiners'), its pool's placement
        strategy, and in a PD role a KV endpoint on every rank (named after this replica, plus
        a tag per incarnation)."""
        options, pool = self.options, self.pool
        kv_endpoint = None if pool == "colocated" else KVEndpointFactory(kind=options.kv_transport, name=self.replica_id)
        return RunnerSpec(
            ranks_in_actors=not ranks_in_replica(self.config, options, pool),
            rank_resources=options.resources_for(placement_group_of(pool)),
            joiner_resources=options.resources_for("joiners"),
            placement_strategy=options.placement_strategy_for(placement_group_of(pool)),
            kv_endpoint=kv_endpoint,
        )

    def _start_elastic_ep(self, plan: ElasticEPPlan) -> None:
        """The scaler, its metrics and (when enabled) the autoscaler's driver."""
        engine = self.engine
        metrics = engine.metrics.enable_elastic_ep(lambda: engine.ep_size)
        self.elastic = ElasticEPScaler(engine, plan, metrics)
        autoscale = self.options.elastic_autoscale
        if not autoscale.enabled:
            return
        from flotilla.serve.ep_autoscale_driver import ElasticEPAutoscaleDriver

        driver = ElasticEPAutoscaleDriver(engine, self.elastic, autoscale.policy(plan.max_ep_size), autoscale.interval_s)
        try:
            # NOTE: Serve runs the constructor on the replica's event loop.
            asyncio.get_running_loop()
        except RuntimeError:
            logger.warning("engine replica %s: no running event loop; the elastic EP autoscaler is off", self.replica_id)
            return
        self._autoscale = driver
        driver.start()

    def _require_elastic(self, method: str) -> ElasticEPScaler:
        if self.elastic is None:
            raise ElasticEPDisabledError(not_elastic_message(f"engine replica {self.replica_id}: {method}()"))
        return self.elastic

    async def scale_elastic_ep(self, new_ep_size: Any) -> dict[str, Any]:
        """Grow the group to ``new_ep_size`` ranks (see :meth:`ElasticEPScaler.scale_to` for
        the answer and the errors); :class:`ElasticEPDisabledError` when not elastic."""
        return await self._require_elastic("scale_elastic_ep").scale_to(new_ep_size)

    async def is_scaling_elastic_ep(self) -> bool:
        """Whether a scale is running; :class:`ElasticEPDisabledError` when not elastic."""
        return self._require_elastic("is_scaling_elastic_ep").is_scaling

    async def elastic_ep_state(self) -> dict[str, Any]:
        """``ep_size``, ``max_ep_size``, ``initial``, ``scaling``, ``last_error``;
        :class:`ElasticEPDisabledError` when not elastic."""
        return self._require_elastic("elastic_ep_state").state()

    def _start_pushing_metrics(self) -> None:
        try:
            # NOTE: Serve runs the constructor on the replica's event loop.
            loop = asyncio.get_running_loop()
        except RuntimeError:
            logger.warning("engine replica %s: no running event loop; its metrics are not pushed", self.replica_id)
            return
        self._push_task = loop.create_task(push_metrics_forever(self.replica_id, self.engine.metrics.exposition))

    async def generate(self, request: GenerateRequest) -> AsyncIterator[GenerateChunk]:
        """Stream the request's chunks (see :meth:`AsyncEngine.generate` for the errors)."""
        # NOTE: aclosing: when our caller stops, the engine stream is closed now (aborting
        # the request), not whenever the garbage collector finalizes it.
        async with contextlib.aclosing(self.engine.generate(request)) as stream:
            async for chunk in stream:
                yield chunk

    async def prefill(self, request: GenerateRequest) -> PrefillTicket:
        """Compute the prompt's KV and first token and hold the blocks under a lease of
        ``options.kv_lease_s`` (see :meth:`AsyncEngine.prefill` for the errors); the
        ticket names this replica and its KV peer."""
        self._require_kv_peer("prefill")
        return await self.engine.prefill(request, self.options.kv_lease_s)

    async def release_kv(self, pin: ReplicaPin, prefill_request_id: str) -> bool:
        """Free the blocks a :meth:`prefill` holds; False when ``pin`` names another
        replica (the pinned one died and the router sent the call elsewhere) or nothing
        is held under ``prefill_request_id`` (released already, or the lease expired)."""
        if pin.replica_id != self.replica_id:
            logger.info(
                "engine replica %s: release of %s pinned to replica %s; its lease frees the blocks",
                self.replica_id, prefill_request_id, pin.replica_id,
            )
            return False
        return await self.engine.release_kv(prefill_request_id)

    async def generate_prefilled(self, request: GenerateRequest, ticket: PrefillTicket) -> AsyncIterator[GenerateChunk]:
        """Stream a request prefilled by ``ticket``'s replica, reading its KV blocks under
        ``options.kv_load_failure_policy`` and ``options.kv_transfer_timeout_s`` (see
        :meth:`AsyncEngine.generate_prefilled`; ``n`` > 1 and logprobs run whole here)."""
        self._require_kv_peer("generate_prefilled")
        stream = self.engine.generate_prefilled(
            request, ticket, self.options.kv_load_failure_policy, self.options.kv_transfer_timeout_s
        )
        async with contextlib.aclosing(stream) as chunks:
            async for chunk in chunks:
                yield chunk

    async def kv_set_fail_next_reads(self, n: int) -> None:
        """Test seam: the next ``n`` KV reads of this (decode) replica fail."""
        self._require_kv_peer("kv_set_fail_next_reads")
        await self.engine.kv_set_fail_next_reads(n)

    def _require_kv_peer(self, method: str) -> str:
        if self.kv_peer_id is None:
            raise RuntimeError(
                f"engine replica {self.replica_id} is in pool {self.pool!r}: {method}() needs a replica built with "
                "pool='prefill' or pool='decode' (--disaggregation-mode pd)"
            )
        return self.kv_peer_id

    def record_routing_stats(self) -> dict[str, Any]:
        """The replica's :class:`ReplicaLoad` as a plain dict (for the request router)."""
        return dataclasses.asdict(self.engine.load())

    async def record_autoscaling_stats(self) -> dict[str, float]:
        """What Serve's autoscaler gets from this replica (custom metrics; Serve calls it every
        ``metrics_interval_s`` when the pool autoscales): the p90 TTFT and ITL, in seconds, of
        what the replica observed in the last :data:`AUTOSCALING_STATS_WINDOW_S` (0.0 when
        nothing: an idle replica meets any SLO), and its ongoing requests. :class:`~flotilla.serve.slo_autoscaling.SLOPolicy`
        reads them."""
        metrics, now = self.engine.metrics, time.monotonic()
        ttfts, self._ttft_cursor = metrics.ttfts_since(self._ttft_cursor)
        itls, self._itl_cursor = metrics.itls_since(self._itl_cursor)
        stats = {}
        for name, window, new in (("ttft_p90_s", self._recent_ttfts, ttfts), ("itl_p90_s", self._recent_itls, itls)):
            window.extend((now, value) for value in new)
            while window and window[0][0] < now - AUTOSCALING_STATS_WINDOW_S:
                window.popleft()
            stats[name] = p90([value for _, value in window]) or 0.0
        load = self.engine.load()
        return {**stats, "ongoing": float(load.running + load.waiting)}

    async def check_health(self) -> None:
        """Raise when the engine is dead (Serve then restarts this replica); not while the
        engine rebuilds its worker group (bounded: ``GANG_RESTART_ATTEMPTS``), when ``health``
        and ``is_healthy`` already say it is not serving."""
        if self.engine.restarting is not None:
            return
        if not self.engine.healthy:
            reason = self.engine.dead_reason or "the engine was shut down"
            raise RuntimeError(f"engine replica {self.replica_id} is unhealthy: {reason}")

    async def is_healthy(self) -> bool:
        """False when the engine is dead (for ``/health``)."""
        return self.engine.healthy

    async def health(self) -> dict[str, Any]:
        """``healthy``, ``reason`` (why not: the engine's death, restart or shutdown; None when healthy),
        ``replica_id`` and ``pool``: what the ingress's pool watches probe. Answers at once
        (it reads the engine's state; nothing waits on the engine thread)."""
        healthy, restarting = self.engine.healthy, self.engine.restarting
        if restarting is not None:
            reason = f"restarting its worker group: {restarting}"
        else:
            reason = None if healthy else (self.engine.dead_reason or "the engine was shut down")
        return {"healthy": healthy, "reason": reason, "replica_id": self.replica_id, "pool": self.pool}

    async def describe(self) -> dict[str, Any]:
        """What this replica is, for operators and tests: ``replica_id``, ``pool``, ``tp_size``,
        ``dp_size`` (DP-attention ranks of its engine group; 1 without DP attention), ``ep_size``,
        ``kv_peer_id`` (PD roles), ``rank_actors`` (the worker actors running its ranks,
        rank order; empty when its one rank runs in this process), ``rank_nodes`` (the Ray node
        of each of those ranks, rank order), ``placement_strategy`` (its worker group's; None
        without one) and ``node_id`` (the Ray node of this replica; None outside Ray)."""
        group = getattr(self.engine.engine.runner, "group", None)
        return {
            "replica_id": self.replica_id,
            "pool": self.pool,
            "tp_size": int(self.config.tp_size or 1),
            "dp_size": int(getattr(self.engine.engine.scheduler, "dp_size", 1)),
            "ep_size": self.engine.ep_size,
            "kv_peer_id": self.kv_peer_id,
            "rank_actors": list(group.actors) if group is not None else [],
            "rank_nodes": group.rank_nodes() if group is not None else [],
            "placement_strategy": group.placement_strategy if group is not None else None,
            "node_id": _ray_node_id(),
        }

    async def metrics_text(self) -> str:
        """This replica's ``flotilla:`` metrics (Prometheus text format)."""
        return await self.engine.metrics_text()

    def shutdown(self) -> None:
        """Stop the autoscaler and the metrics pushes, stop the engine and release its
        workers; idempotent."""
        if self._autoscale is not None:
            self._autoscale.stop()
            self._autoscale = None
        if self._push_task is not None:
            self._push_task.cancel()
            self._push_task = None
            _forget_in_hub(self.replica_id)
        self.engine.shutdown()

    def __del__(self) -> None:
        # NOTE: Serve calls __del__ when it stops a replica gracefully.
        engine = getattr(self, "engine", None)
        if engine is not None:
            try:
                self.shutdown()
            except Exception:  # noqa: BLE001 - best effort at teardown
                logger.debug("engine replica %s: shutdown at teardown failed", self.replica_id, exc_info=True)


def _ray_node_id() -> str | None:
    """The Ray node this process runs on (None when it is not connected to Ray)."""
    ray = sys.modules.get("ray")
    if ray is None or not ray.is_initialized():
        return None
    return ray.get_runtime_context().get_node_id()


def _serve_replica_id() -> str | None:
    """Serve's replica tag when running inside a Serve replica, else None."""
    ray = sys.modules.get("ray")
    if ray is None or not ray.is_initialized():
        return None  # NOTE: a Serve replica has Ray imported and connected; skip importing Serve
    try:
        from ray import serve

        return str(serve.get_replica_context().replica_tag)
    except Exception:  # noqa: BLE001 - not inside a Serve replica: a plain object
        return None


def _forget_in_hub(replica_id: str) -> None:
    try:
        from flotilla.serve.metrics import get_metrics_hub

        get_metrics_hub().remove.remote(replica_id)
    except Exception:  # noqa: BLE001 - the hub or Ray may be gone already
        pass
