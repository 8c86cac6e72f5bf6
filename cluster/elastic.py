"""Elastic expert parallelism on Ray: what a join of new ranks to a running EP group is made of.

The elastic layout (SGLang's, ``--elastic-ep-backend ray``): one engine group of ``N`` ranks
with ``tp == dp == ep == N`` (DP attention, each rank its own DP rank with its own scheduler
and KV pool; MoE layers across all ranks). Growing to ``M`` ranks adds ``M - N`` DP ranks and
``M - N`` EP ranks; ``--max-ep-size`` bounds ``M``.

A join, driven by :class:`~flotilla.cluster.engine.group_runner.GroupRunner`:

1. **Plan** (pure, here): the grown :class:`~flotilla.cluster.topology.Topology`
   (:func:`elastic_topology`) and one grown :class:`~flotilla.cluster.eplb.ExpertPlacement`
   per MoE layer (:func:`grow_placements`: running ranks keep every slot, the joiners' slots
   hold redundant copies chosen from the measured expert load).
2. **Prepare** (while the group keeps serving): a placement group for the joiners (on a real
   cluster a pending placement group is what makes the Ray autoscaler add nodes), one
   ``Worker`` actor per joining rank, each loading the non-expert weights and its expert slots
   (:meth:`~flotilla.cluster.group.WorkerGroup.start_joiners`). Bounded by
   ``--elastic-ep-scale-timeout``.
3. **Commit** (at a step boundary, the engine paused): every rank, old and new, leaves its
   communicators and joins the grown world's (a fresh rendezvous), and the running ranks
   adopt the grown placements; the engine's scheduler then gains the new DP ranks, and only
   from then on are requests routed to them.

A join that fails (placement not granted in time, a joiner that died or raised, a rendezvous
that timed out) raises :class:`ElasticJoinError`: the joiners are killed, the running ranks
go back to their old world, and the group keeps serving at its old size.

Pure Python (no torch, no ray) apart from the types it names.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from flotilla.cluster.engine.dp_scheduler import can_grow_elastic_ep
from flotilla.cluster.eplb import ExpertPlacement, grow_placement
from flotilla.cluster.topology import Topology


class ElasticJoinError(RuntimeError):
    """A join of new ranks to an elastic EP group failed; the group kept its old size
    (unless the message says the group itself broke). Picklable: a plain message."""


@dataclass(frozen=True)
class JoinReport:
    """How a successful join went.

    Attributes:
        old_size: EP size before the join.
        new_size: EP size after it.
        prepare_s: seconds from the request to the joiners being loaded and ready (placement
            group granted, actors started, weights loaded); the group served meanwhile.
        commit_pause_s: seconds the engine was paused for the commit (no step ran).
        total_s: seconds from the request to serving at the new size.
    """

    old_size: int
    new_size: int
    prepare_s: float
    commit_pause_s: float
    total_s: float


def check_elastic_growth(config: Any, current: int, new_size: int) -> None:
    """Raise ElasticJoinError unless ``config`` is an elastic EP deployment on flotilla's
    ``ray`` backend that may grow from ``current`` to ``new_size`` ranks."""
    backend, max_ep = getattr(config, "elastic_ep_backend", None), getattr(config, "max_ep_size", None)
    if not can_grow_elastic_ep(config):
        raise ElasticJoinError(
            f"this deployment is not elastic (elastic_ep_backend={backend!r}, max_ep_size={max_ep!r}, "
            f"tp_size={getattr(config, 'tp_size', None)!r}); start it with --elastic-ep-backend ray and "
            "--max-ep-size above its size"
        )
    if isinstance(new_size, bool) or not isinstance(new_size, int) or new_size <= current:
        raise ElasticJoinError(f"new_ep_size={new_size!r} must be an integer above the current EP size {current}")
    if new_size > int(max_ep):
        raise ElasticJoinError(f"new_ep_size={new_size} exceeds max_ep_size={max_ep}")


def elastic_topology(current: Topology, new_size: int) -> Topology:
    """The grown group's topology: ``new_size`` ranks, each its own DP rank and EP rank.

    ``current`` must be the elastic layout (``world == attn_dp == ep``, no CP, DCP or MoE DP);
    ValueError otherwise (resolution already refuses any other layout for a scale-up).
    """
    world = current.world_size
    if (current.attn_dp_size, current.ep_size) != (world, world) or (
        current.attn_cp_size,
        current.dcp_size,
        current.moe_dp_size,
    ) != (1, 1, 1):
        raise ValueError(
            f"elastic EP grows the layout tp == dp == ep (DP attention, no CP/DCP/MoE DP); this group has "
            f"{current}"
        )
    return Topology(new_size, attn_dp_size=new_size, ep_size=new_size)


def summed_expert_load(snapshots: Sequence[Mapping[str, Any] | None], layer_ids: Sequence[int], num_experts: int) -> dict[int, list[float]]:
    """Each MoE layer's routed pairs per logical expert, summed over ranks' recorder snapshots
    (``ExpertLoadRecorder.snapshot``; DP ranks see different tokens). Ranks without a recorder
    (None) add nothing; layers nobody measured get all-zero load (the placement then spreads
    the copies over experts by id)."""
    totals = {layer: [0.0] * num_experts for layer in layer_ids}
    for snap in snapshots:
        if snap is None:
            continue
        for layer, counts in zip(snap["layer_ids"], snap["per_layer"]):
            if layer in totals:
                totals[layer] = [a + float(b) for a, b in zip(totals[layer], counts)]
    return totals


def grow_placements(
    placements: Mapping[int, ExpertPlacement], new_size: int, loads: Mapping[int, Sequence[float]]
) -> dict[int, ExpertPlacement]:
    """Every MoE layer's placement grown to ``new_size`` EP ranks with
    :func:`~flotilla.cluster.eplb.grow_placement` from that layer's measured load."""
    return {layer: grow_placement(p, new_size, loads[layer]) for layer, p in placements.items()}
