"""Placement strategies of a worker group: how Ray lays the group's placement group (one
bundle per rank) over the nodes. Pure: names, the default and the check; no Ray.

Ray's four strategies (``ray.util.placement_group``):

- ``PACK`` (the default): the bundles on as few nodes as they fit on. A group that fits one
  node stays on it, so tensor parallelism keeps the node's links (NVLink); a group larger
  than any free node spills onto the next ones instead of waiting. Ray Serve LLM moved its
  multi-node serving to PACK (ray#56980).
- ``STRICT_PACK``: every bundle on one node, or no placement at all (the group waits for a
  node with room for all of it).
- ``SPREAD``: the bundles over as many nodes as possible, best effort.
- ``STRICT_SPREAD``: every bundle on a different node, or no placement at all.

Ranks on different nodes rendezvous at rank 0's node address either way (gloo on CPU, NCCL
on GPU; :meth:`~flotilla.cluster.worker.Worker.rendezvous_point`).
"""

from __future__ import annotations

from typing import Any

PLACEMENT_STRATEGIES = ("PACK", "STRICT_PACK", "SPREAD", "STRICT_SPREAD")
DEFAULT_PLACEMENT_STRATEGY = "PACK"


def check_placement_strategy(value: Any, name: str = "placement_strategy") -> str:
    """``value`` as one of :data:`PLACEMENT_STRATEGIES` (any case: ``spread`` is ``SPREAD``).

    Raises ValueError naming ``name`` (the parameter, flag or config key the value came
    from) and the value otherwise."""
    text = value.strip().upper() if isinstance(value, str) else None
    if text not in PLACEMENT_STRATEGIES:
        raise ValueError(
            f"{name} must be one of {', '.join(PLACEMENT_STRATEGIES)} (got {name}={value!r}); "
            f"{DEFAULT_PLACEMENT_STRATEGY} keeps a group on one node when it fits"
        )
    return text
