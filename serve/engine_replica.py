"""``EngineReplica``: one engine replica of the Serve application (a plain class).

:mod:`flotilla.serve.app` turns it into a deployment with
``serve.deployment(EngineReplica).options(...)``; the class itself needs no Serve, so tests
construct it directly. Inside Serve:

- ``generate`` is an async generator: callers stream it with ``handle.options(stream=True)``;
  a caller that stops reading (client disconnect) cancels it, which aborts the request
  and frees its KV blocks.
- ``record_routing_stats`` is polled by Serve; the dict (a :class:`ReplicaLoad`'s fields)
  reaches the request router as ``RunningReplica.routing_stats``.
- ``check_health`` raises once the engine died, so Serve replaces the replica.
- Every :data:`~flotilla.serve.metrics.PUSH_INTERVAL_S` a background task pushes the
  replica's metrics to the namespace's :class:`~flotilla.serve.metrics.MetricsHub`, where
  the ingress collects them (:func:`~flotilla.serve.metrics.collect_metrics_text`).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import sys
from typing import Any, AsyncIterator

from flotilla.cluster.models.sources import ModelSource, resolve_model_source
from flotilla.cluster.models.tokenizer import load_tokenizer_or_none
from flotilla.resolution import ResolvedConfig
from flotilla.serve.async_engine import AsyncEngine
from flotilla.serve.metrics import push_metrics_forever
from flotilla.serve.types import GenerateChunk, GenerateRequest, ServeOptions

logger = logging.getLogger(__name__)


class EngineReplica:
    """An :class:`AsyncEngine` over the model named by ``options.model``.

    Args:
        config: the resolved configuration (resolved once by the driver).
        options: serving options (``model``, ``max_queued_requests``).
        replica_id: the metrics' ``replica`` label (default: Serve's replica tag inside a
            Serve replica, else ``local-<pid>``).
        push_metrics: push metrics to the hub (default: only inside a Serve replica).
    """

    def __init__(
        self,
        config: ResolvedConfig,
        options: ServeOptions,
        *,
        replica_id: str | None = None,
        push_metrics: bool | None = None,
    ):
        serve_id = _serve_replica_id()
        self.replica_id = replica_id or serve_id or f"local-{os.getpid()}"
        self.config, self.options = config, options
        model = options.model if options.model is not None else config.model_path
        self.source: ModelSource = resolve_model_source(model)
        tokenizer = None if config.skip_tokenizer_init else load_tokenizer_or_none(self.source, config.tokenizer_path)[0]
        self.engine = AsyncEngine.from_config(
            config, self.source, tokenizer, options.max_queued_requests, replica_id=self.replica_id
        )
        self._push_task: asyncio.Task | None = None
        if push_metrics if push_metrics is not None else serve_id is not None:
            self._start_pushing_metrics()
        logger.info("engine replica %s serves %s", self.replica_id, self.source.path)

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

    def record_routing_stats(self) -> dict[str, Any]:
        """The replica's :class:`ReplicaLoad` as a plain dict (for the request router)."""
        return dataclasses.asdict(self.engine.load())

    async def check_health(self) -> None:
        """Raise when the engine is dead (Serve then restarts this replica)."""
        if not self.engine.healthy:
            reason = self.engine.dead_reason or "the engine was shut down"
            raise RuntimeError(f"engine replica {self.replica_id} is unhealthy: {reason}")

    async def is_healthy(self) -> bool:
        """False when the engine is dead (for ``/health``)."""
        return self.engine.healthy

    async def metrics_text(self) -> str:
        """This replica's ``flotilla:`` metrics (Prometheus text format)."""
        return await self.engine.metrics_text()

    def shutdown(self) -> None:
        """Stop pushing metrics, stop the engine and release its workers; idempotent."""
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
