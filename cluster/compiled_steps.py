"""A worker group's step seam over a Ray compiled graph.

A plain Ray actor call costs about a millisecond of task overhead, and a step needs one per
rank plus the step's own put: measured on 2x H200, a TP=2 batch-1 decode step spent 4.1 ms
in Ray around a 3.4 ms CUDA graph. A compiled graph (``ray.dag``, Ray's API for repeated
actor pipelines) is built once: the driver writes each step into a shared-memory channel
that every rank's actor reads on a background thread, and each rank writes its result into
a channel the driver reads, with tens of microseconds of overhead.

What it changes for the ranks: ``execute`` runs on the actor's background thread while any
other call (queries, KV transfers, an elastic commit) arrives on its main thread, so the
worker actor serialises its calls itself
(:func:`~flotilla.cluster.worker.one_call_at_a_time`).

:class:`~flotilla.cluster.group.WorkerGroup` compiles one after loading and after each change
of its ranks (elastic EP), and steps through plain actor calls when compiling fails (the
reason is kept). GPU groups use one by default, CPU groups do not
(:func:`compiled_steps_off_reason`; ``FLOTILLA_COMPILED_STEPS=0`` / ``1`` overrides).
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any, Sequence

import ray

# Bound on tearing a compiled graph down (a rank stuck in a step may never let it finish;
# the group kills its actors next in that case anyway).
TEARDOWN_TIMEOUT_S = 10.0


def compiled_steps_off_reason(on_gpu: bool, requested: bool | None = None) -> str | None:
    """Why a group's steps should go through plain actor calls (None: through a compiled graph).

    Args:
        on_gpu: the ranks run on GPUs.
        requested: the caller's choice; None: ``FLOTILLA_COMPILED_STEPS`` (``1`` on, ``0`` off)
            when set, else on for GPU groups only.

    NOTE: off by default on CPU groups: the channels' readers poll, and on a small CPU box they
    compete with the ranks' own compute (measured on 2 cores: a tiny TP=2 model's step took
    21.1 ms compiled against 16.8 ms through plain calls). A GPU rank's host mostly waits."""
    if requested is None:
        env = os.environ.get("FLOTILLA_COMPILED_STEPS")
        if env is not None:
            if env not in ("0", "1"):
                raise ValueError(f"FLOTILLA_COMPILED_STEPS={env!r} must be '0' or '1'")
            return None if env == "1" else "FLOTILLA_COMPILED_STEPS=0"
        requested = on_gpu
        if not requested:
            return "a CPU group steps through plain actor calls (the compiled graph's polling competes for cores)"
    return None if requested else "compiled steps were turned off by the caller"


class CompiledSteps:
    """One compiled graph that sends a step to every rank's ``execute`` and returns their results.

    Args:
        actors: the group's worker actors, in rank order.
        timeout_s: bound on one step (every rank's result), as the group's RPC bound.

    Raises whatever Ray raises when it cannot compile the graph (the caller falls back).
    """

    def __init__(self, actors: Sequence[Any], timeout_s: float):
        from ray.dag import InputNode, MultiOutputNode

        with InputNode() as step:
            graph = MultiOutputNode([actor.execute.bind(step) for actor in actors])
        self.timeout_s = timeout_s
        self._graph = graph.experimental_compile()

    def submit(self, step: Any) -> list[Any]:
        """Send ``step`` to every rank; returns the references to their results (rank order),
        to :meth:`collect` before the next submit but one."""
        return self._graph.execute(step)

    def collect(self, refs: Sequence[Any]) -> list[Any]:
        """Every rank's result of a submitted step, in rank order, within ``timeout_s`` in all.

        Raises the first error Ray reports: ``RayTaskError`` (a rank raised),
        ``RayChannelError`` / ``RayActorError`` (a rank died), ``RayChannelTimeoutError``
        (a subclass of ``TimeoutError``: out of time). The graph is then unusable."""
        deadline = time.monotonic() + self.timeout_s
        return [ray.get(ref, timeout=max(0.001, deadline - time.monotonic())) for ref in refs]

    def close(self) -> None:
        """Tear the graph down (best effort, bounded by :data:`TEARDOWN_TIMEOUT_S`; idempotent):
        the ranks' background loops end and their actors take plain calls only."""
        graph, self._graph = self._graph, None
        if graph is None:
            return

        def teardown() -> None:
            try:
                graph.teardown()
            except Exception:  # noqa: BLE001 - a dead rank's channel is already closed
                pass

        # NOTE: a thread: teardown waits for every rank's loop, and a stuck rank never ends its step.
        closer = threading.Thread(target=teardown, name="flotilla-compiled-steps-teardown", daemon=True)
        closer.start()
        closer.join(TEARDOWN_TIMEOUT_S)
