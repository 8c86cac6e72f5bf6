"""Elastic EP (:mod:`flotilla.cluster.elastic`) on one :class:`~flotilla.serve.async_engine.AsyncEngine`.

:meth:`AsyncEngine.grow_elastic_ep` has the runner's joiners load on a helper thread while
the engine thread keeps stepping, then runs the commit as a ``_Call``: between two steps,
so the pause is the commit alone.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from flotilla.cluster.elastic import ElasticJoinError, JoinReport


class ElasticEPCommands:
    """The elastic EP commands, mixed into :class:`~flotilla.serve.async_engine.AsyncEngine`:
    they read its engine and its per-DP-rank request counts (``_dp_rank_requests``, under
    ``_cond``) and run the commit through its ``_call``.
    """

    @property
    def ep_size(self) -> int:
        """The engine group's current EP size (1 for an engine that is not expert-parallel)."""
        return int(getattr(self.engine.runner, "ep_size", 1))

    def dp_rank_requests(self) -> list[int]:
        """Requests admitted to each DP rank so far (index: DP rank; one entry without DP attention)."""
        with self._cond:
            return list(self._dp_rank_requests)

    async def grow_elastic_ep(self, joiner_config: Any, new_size: int, timeout_s: float) -> JoinReport:
        """Grow the engine group to ``new_size`` EP ranks while it serves (elastic EP).

        The joining ranks (resolved as ``joiner_config``) get a placement group and load on a
        helper thread, bounded by ``timeout_s``, while this engine keeps stepping; then the
        commit runs on the engine thread between two steps (the only pause). Raises
        ElasticJoinError when the join failed (the engine serves on at its old size, joiners
        gone) and EngineUnavailableError when the engine is down. A caller that leaves early
        does not leak joiners: they are dropped once loaded.
        """
        prepare = getattr(self.engine.runner, "prepare_join", None)
        if prepare is None:
            raise ElasticJoinError(
                "this engine cannot grow: start it with --elastic-ep-backend ray and --max-ep-size above its size"
            )
        with self._cond:
            self._raise_if_unavailable()
        runner, old_size, started = self.engine.runner, self.ep_size, time.monotonic()
        future = asyncio.get_running_loop().run_in_executor(None, prepare, joiner_config, new_size, timeout_s)
        try:
            joiners = await asyncio.shield(future)
        except asyncio.CancelledError:
            future.add_done_callback(lambda f: f.exception() is None and runner.abort_join(f.result()))
            raise
        prepared = time.monotonic()
        try:
            pause = await self._call(lambda: self._commit_join(joiners))
        finally:
            # NOTE: idempotent; after a commit the joiners belong to the group and this is a no-op
            # (a failed commit already dropped them).
            if self.ep_size != new_size:
                runner.abort_join(joiners)
        return JoinReport(old_size, new_size, prepared - started, pause, time.monotonic() - started)

    def _commit_join(self, joiners: Any) -> float:
        """Engine thread, between steps: grow the engine; returns the pause in seconds."""
        started = time.perf_counter()
        self.engine.commit_elastic_join(joiners)
        with self._cond:
            self._dp_rank_requests += [0] * (self.engine.runner.dp_size - len(self._dp_rank_requests))
        return time.perf_counter() - started
