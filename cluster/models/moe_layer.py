"""Mixture-of-experts layers: the router gate and the parallel fused experts.

:class:`FusedMoE` holds its rank's expert weights stacked, as the fused-MoE kernels want
them: ``w13[S, 2*I/moe_tp, H]`` (gate rows, then up rows) and ``w2[S, H, I/moe_tp]``, one
row per *physical slot* this rank holds. A checkpoint stores one small matrix per logical
expert; :meth:`FusedMoE.checkpoint_shard` names where each lands, and the parameters'
``weight_loader`` copies it into every local slot that holds that expert. Shared experts
and dense MLP layers are the model's business (plain tensor-parallel MLPs).

Parallel layout (given by :class:`~flotilla.cluster.models.base.ParallelLayout`, never probed):

- Expert parallelism (``ep_size``, ``ep_rank``): an
  :class:`~flotilla.cluster.eplb.ExpertPlacement` maps the model's ``E`` logical experts onto
  ``E + num_redundant_experts`` physical slots, ``slots_per_rank`` per EP rank (rank-major:
  rank ``r`` owns slots ``[r*S, (r+1)*S)``); slot ``s`` loads the weights of logical expert
  ``phy2log[s]``. The router picks logical ids; each (token, k) pair is then sent to one
  replica slot (:meth:`FusedMoE.slots_for`, deterministic, the rule of
  :func:`~flotilla.cluster.eplb.choose_replica`), and ``expert_map`` (slot -> local row or
  ``-1``) tells the kernel which pairs this rank computes.
- MoE tensor parallelism (``moe_tp_size``, ``moe_tp_rank``): each rank holds a slice of every
  local expert's intermediate dimension (rows of gate/up, columns of down), so its output is
  a partial sum. NOTE: this is the MoE view of the topology, not attention TP: with
  ``tp_size=2`` and no EP, ``moe_tp_size == 2``; with ``tp_size=2, ep_size=2`` it is 1.
- How tokens meet their experts across ranks (all-reduce of partial sums, or all-to-all
  dispatch/combine), and DP-attention lockstep, are :mod:`~flotilla.cluster.models.moe_dispatch`'s job.

The maps live in buffers built from one placement object (:meth:`FusedMoE.set_placement`
swaps it, e.g. when elastic EP grows the group or EPLB rebalances).
"""

from __future__ import annotations

import re

import torch
import torch.nn.functional as F
from torch import nn

from flotilla.cluster.eplb import ExpertPlacement, trivial_placement
from flotilla.cluster.models.base import ParallelLayout
from flotilla.cluster.models.layers import default_weight_loader
from flotilla.cluster.models.moe_dispatch import make_dispatcher
from flotilla.kernels import registry

# Checkpoint spellings of each expert's three matrices: HF Qwen/DeepSeek names and Mixtral's.
_PART_OF_NAME = {"gate_proj": "w1", "w1": "w1", "up_proj": "w3", "w3": "w3", "down_proj": "w2", "w2": "w2"}
_PER_EXPERT = re.compile(r"^experts\.(\d+)\.(gate_proj|up_proj|down_proj|w1|w2|w3)\.(weight|weight_scale_inv)$")


class MoERouter(nn.Module):
    """The replicated gate: ``router_logits = x W^T`` with ``W[E, H]``.

    Args:
        hidden_size: model width ``H``.
        num_experts: routed experts ``E`` (logical count).
        with_correction_bias: keep DeepSeek-V3's ``e_score_correction_bias[E]`` (added to
            the scores for expert choice only).
        float32_logits: compute the logits in float32 whatever the model dtype (DeepSeek
            keeps its gate in float32); otherwise in ``dtype``.
        dtype: model dtype.
    """

    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        with_correction_bias: bool = False,
        float32_logits: bool = False,
        dtype: torch.dtype = torch.float32,
    ):
        super().__init__()
        weight_dtype = torch.float32 if float32_logits else dtype
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size, dtype=weight_dtype), requires_grad=False)
        self.weight.weight_loader = default_weight_loader  # type: ignore[attr-defined]
        self.e_score_correction_bias: nn.Parameter | None = None
        if with_correction_bias:
            bias = torch.zeros(num_experts, dtype=torch.float32)
            self.e_score_correction_bias = nn.Parameter(bias, requires_grad=False)
            self.e_score_correction_bias.weight_loader = default_weight_loader  # type: ignore[attr-defined]
        # NOTE: the GEMM kernel; use_linear_op swaps in a CUDA backend's (a batch-1 GEMV).
        self.linear_op = F.linear

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_op(x.to(self.weight.dtype), self.weight)


class FusedMoE(nn.Module):
    """Routed experts: select ``top_k`` experts per token and sum their gated MLPs.

    Args:
        num_experts: number of logical routed experts ``E`` (the ids the router emits).
        top_k: experts per token.
        hidden_size: model width ``H``.
        intermediate_size: each expert's (full, unsharded) intermediate width ``I``.
        renormalize: rescale the chosen weights to sum to one.
        scoring: ``"softmax"`` or ``"sigmoid"`` over the router logits.
        num_expert_group, topk_group: group-limited routing (DeepSeek): pick ``topk_group``
            of ``num_expert_group`` groups first, then experts inside them.
        routed_scaling_factor: multiplies the routing weights (DeepSeek).
        activation: the experts' gated activation (``"silu"``).
        parallel: this rank's layout: ``ep_size``/``ep_rank`` (which slots), ``moe_tp_size``/
            ``moe_tp_rank`` (which slice of ``I``), ``dp_size`` and ``moe_a2a_backend`` (how
            tokens are exchanged) and the communicators (see the module docstring).
        num_redundant_experts: extra physical slots holding copies of experts; used only
            when ``placement`` is None (then the placement is
            ``trivial_placement(E, ep_size, num_redundant_experts)``).
        placement: the logical -> physical map; its ``ep_size`` must be ``parallel.ep_size``.
        dtype: weight dtype.
        backend: kernel backend of ``fused_moe`` (and of ``select_experts`` when it has one;
            otherwise routing uses the torch reference).

    ``load_recorder`` (None by default): an
    :class:`~flotilla.cluster.models.expert_load.ExpertLoadRecorder` that each forward hands the
    router's logical ``topk_ids`` (as layer ``load_layer_index``); set by
    :func:`~flotilla.cluster.models.expert_load.attach_load_recorder`.
    """

    load_recorder = None
    load_layer_index = 0
    # The kernel op of the experts (the block-FP8 subclass: fp8_grouped_moe).
    experts_op = "fused_moe"

    def __init__(
        self,
        num_experts: int,
        top_k: int,
        hidden_size: int,
        intermediate_size: int,
        *,
        renormalize: bool,
        scoring: str = "softmax",
        num_expert_group: int | None = None,
        topk_group: int | None = None,
        routed_scaling_factor: float = 1.0,
        activation: str = "silu",
        parallel: ParallelLayout = ParallelLayout(),
        num_redundant_experts: int = 0,
        placement: ExpertPlacement | None = None,
        dtype: torch.dtype = torch.float32,
        backend: str = "torch",
    ):
        super().__init__()
        if top_k < 1 or top_k > num_experts:
            raise ValueError(f"num_experts_per_tok={top_k} must be between 1 and the number of experts ({num_experts})")
        if intermediate_size % parallel.moe_tp_size:
            raise ValueError(
                f"moe_intermediate_size={intermediate_size} is not divisible by moe_tp_size={parallel.moe_tp_size} "
                f"(the MoE tensor-parallel width tp_size / (ep_size * moe_dp_size)); choose an ep_size that leaves "
                f"a MoE-TP width dividing it"
            )
        self.num_experts = num_experts
        self.top_k = top_k
        self.hidden_size = hidden_size
        self.renormalize = renormalize
        self.scoring = scoring
        self.num_expert_group = num_expert_group
        self.topk_group = topk_group
        self.routed_scaling_factor = routed_scaling_factor
        self.activation = activation
        self.parallel = parallel
        self.dtype = dtype
        self.intermediate_per_rank = intermediate_size // parallel.moe_tp_size
        # NOTE: the experts' op first: it imports the backend's modules, which register whatever
        # routing op the backend has (triton: one-launch select_experts, registered by
        # kernels/triton_routing via triton_moe); a backend without select_experts routes with
        # the torch reference, which runs on any device without host synchronisation.
        self._experts = registry.get(self.experts_op, backend)
        select_backend = backend if backend in registry.backends("select_experts") else "torch"
        self._select = registry.get("select_experts", select_backend)
        self.dispatcher = make_dispatcher(parallel)
        self.set_placement(
            placement or trivial_placement(num_experts, parallel.ep_size, num_redundant_experts)
        )

    # ----------------------------------------------------------------- placement

    def set_placement(self, placement: ExpertPlacement) -> list[int]:
        """Adopt ``placement``: rebuild the slot maps and return the local rows whose logical
        expert changed, which the caller must (re)load (e.g. ``model.load_weights`` again, or
        copies from a peer).

        Rows whose expert is unchanged keep their weights; when ``slots_per_rank`` changes the
        weight tensors are reallocated and every row must be loaded. This is the seam for EPLB
        rebalancing and elastic EP growth (which also hands the layer a grown ``parallel``
        layout first); every rank of the group must adopt the same placement before the next
        forward, or the ranks would disagree on which slot serves a pair.
        """
        ep = self.parallel
        if placement.num_logical != self.num_experts:
            raise ValueError(
                f"placement has num_logical={placement.num_logical} experts, this layer has {self.num_experts}"
            )
        if placement.ep_size != ep.ep_size:
            raise ValueError(
                f"placement.ep_size={placement.ep_size} does not match the layout's ep_size={ep.ep_size}"
            )
        old = getattr(self, "local_logical_experts", None)
        new = placement.local_logical_experts(ep.ep_rank)
        if old is None or len(old) != len(new):
            self._allocate(len(new))
            changed = list(range(len(new)))
        else:
            changed = [row for row, (a, b) in enumerate(zip(old, new)) if a != b]
        self.placement = placement
        self.local_logical_experts: list[int] = new
        self.slots_per_rank = placement.slots_per_rank
        # NOTE: buffers, so they follow the module's device; rebuilt whole from one placement.
        max_copies = max(len(slots) for slots in placement.log2phy)
        table = torch.full((self.num_experts, max_copies), -1, dtype=torch.int64)
        for expert, slots in enumerate(placement.log2phy):
            table[expert, : len(slots)] = torch.tensor(slots)
        device = self.w13.device
        self.register_buffer("log2phy", table.to(device), persistent=False)
        copies = torch.tensor([len(s) for s in placement.log2phy], dtype=torch.int64)
        self.register_buffer("replica_counts", copies.to(device), persistent=False)
        # NOTE: one copy of each expert at the slot of its own id: slots_for is the identity
        # (and launches nothing, which counts in a batch-1 decode step).
        self.identity_slots = all(list(slots) == [expert] for expert, slots in enumerate(placement.log2phy))
        expert_map = torch.tensor(placement.local_expert_map(ep.ep_rank), dtype=torch.int64)
        self.register_buffer("expert_map", expert_map.to(device), persistent=False)
        return changed

    def _allocate(self, slots: int) -> None:
        """Fresh, unloaded expert weights for ``slots`` local slots."""
        i, h = self.intermediate_per_rank, self.hidden_size
        self.w13 = nn.Parameter(torch.empty(slots, 2 * i, h, dtype=self.dtype), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(slots, h, i, dtype=self.dtype), requires_grad=False)
        self.w13.weight_loader = self._load  # type: ignore[attr-defined]
        self.w2.weight_loader = self._load  # type: ignore[attr-defined]

    def slots_for(self, topk_ids: torch.Tensor, first_row: int = 0) -> torch.Tensor:
        """Physical slot of each (token, k) pair of ``topk_ids[T, k]`` (logical ids).

        Row ``t`` (numbered from ``first_row``) takes replica ``t % copies`` of its expert, as
        :func:`~flotilla.cluster.eplb.choose_replica`: deterministic, so ranks that route the
        same rows agree on the slot.
        """
        if self.identity_slots:
            return topk_ids
        rows = torch.arange(first_row, first_row + topk_ids.shape[0], device=topk_ids.device).unsqueeze(1)
        return self.log2phy[topk_ids, rows % self.replica_counts[topk_ids]]

    # ----------------------------------------------------------------- loading

    @staticmethod
    def checkpoint_shard(name: str) -> tuple[str, tuple[str, int] | None] | None:
        """Where a checkpoint tensor named ``name`` (relative to the MoE block, e.g.
        ``experts.3.gate_proj.weight``) lands: ``(param_name, shard_id)``, or None if the
        name is not an expert weight.

        ``shard_id`` is ``(part, expert_id)`` with part ``w1`` (gate), ``w3`` (up) or ``w2``
        (down) for per-expert checkpoint tensors (``expert_id`` is the logical id), and None
        for transformers' in-memory stacked tensors ``experts.gate_up_proj[E, 2I, H]`` /
        ``experts.down_proj[E, H, I]``. A block-FP8 checkpoint's ``weight_scale_inv`` of an
        expert lands in ``w13_scale_inv`` / ``w2_scale_inv`` (see
        :class:`~flotilla.cluster.models.fp8_moe.Fp8FusedMoE`).
        """
        match = _PER_EXPERT.match(name)
        if match:
            part = _PART_OF_NAME[match.group(2)]
            suffix = "_scale_inv" if match.group(3) == "weight_scale_inv" else ""
            return ("w2" if part == "w2" else "w13") + suffix, (part, int(match.group(1)))
        if name == "experts.gate_up_proj":
            return "w13", None
        if name == "experts.down_proj":
            return "w2", None
        return None

    def _load(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: tuple[str, int] | None = None) -> None:
        if shard_id is None:  # every expert stacked, as transformers keeps them in memory
            if loaded.shape[0] != self.num_experts:
                raise ValueError(f"stacked expert tensor has {loaded.shape[0]} experts, expected {self.num_experts}")
            full_i = loaded.shape[-1] if param is self.w2 else loaded.shape[1] // 2
            for expert in range(self.num_experts):
                if param is self.w2:
                    self._load(param, loaded[expert], ("w2", expert))
                else:
                    self._load(param, loaded[expert, :full_i], ("w1", expert))
                    self._load(param, loaded[expert, full_i:], ("w3", expert))
            return
        part, expert = shard_id
        i, start = self.intermediate_per_rank, self.parallel.moe_tp_rank * self.intermediate_per_rank
        # NOTE: a logical expert may sit in several local slots (redundant copies) or in none
        # (another EP rank holds it): copy into each.
        for row, held in enumerate(self.local_logical_experts):
            if held != expert:
                continue
            if part == "w2":
                default_weight_loader(param.data[row], loaded.narrow(1, start, i))  # type: ignore[arg-type]
            else:
                rows = slice(0, i) if part == "w1" else slice(i, 2 * i)
                default_weight_loader(param.data[row, rows], loaded.narrow(0, start, i))  # type: ignore[arg-type]

    # ----------------------------------------------------------------- forward

    def route(
        self, router_logits: torch.Tensor, correction_bias: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``router_logits[T, E]`` -> ``(topk_weights[T, k] float32, topk_ids[T, k])`` (logical ids)."""
        return self._select(
            router_logits,
            self.top_k,
            self.renormalize,
            scoring=self.scoring,
            num_expert_group=self.num_expert_group,
            topk_group=self.topk_group,
            correction_bias=correction_bias,
            routed_scaling_factor=self.routed_scaling_factor,
        )

    def compute(self, hidden: torch.Tensor, weights: torch.Tensor, slot_ids: torch.Tensor) -> torch.Tensor:
        """This rank's experts on ``hidden[T, H]``: ``sum_k weights[t, k] * expert(slot_ids[t, k])``
        over the pairs whose slot is local (others add nothing); a partial sum under MoE TP."""
        return self._experts(
            hidden, self.w13, self.w2, weights, slot_ids, activation=self.activation, expert_map=self.expert_map
        )

    def forward(
        self, hidden: torch.Tensor, router_logits: torch.Tensor, correction_bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        """``hidden[T, H]``, ``router_logits[T, E]`` -> ``[T, H]``, complete (summed over every
        expert and every MoE-TP slice). ``T`` may be 0 (an idle DP-attention rank), and every
        rank of the engine group must call it, since it may run collectives."""
        weights, ids = self.route(router_logits, correction_bias)
        if self.load_recorder is not None:
            self.load_recorder.record(self.load_layer_index, ids)
        return self.dispatcher(self, hidden, weights, ids)


# --------------------------------------------------------------------- a model's MoE layers

_LAYER_INDEX = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def moe_layers(model: nn.Module) -> list[tuple[int, FusedMoE]]:
    """Every :class:`FusedMoE` of ``model`` in module order, with its decoder layer index (read
    from the module name ``...layers.<i>....``; the ordinal among MoE layers when absent). The
    experts of an MTP draft module (``mtp.*``: NEXTN drafts with it, outside EPLB) are left out."""
    found = []
    experts = [(n, m) for n, m in model.named_modules() if isinstance(m, FusedMoE) and not n.startswith("mtp.")]
    for ordinal, (name, module) in enumerate(experts):
        match = _LAYER_INDEX.search(name)
        found.append((int(match.group(1)) if match else ordinal, module))
    return found


def expert_placements(model: nn.Module) -> dict[int, ExpertPlacement]:
    """The placement each MoE layer of ``model`` runs, keyed by decoder layer index."""
    return {layer: module.placement for layer, module in moe_layers(model)}


def rewire_moe_layers(model: nn.Module, parallel: ParallelLayout, placements: dict[int, ExpertPlacement]) -> None:
    """Point every MoE layer of a LOADED model at a new layout (its communicators and EP size)
    and adopt ``placements`` (one per layer, keyed by decoder layer index): how a running rank
    joins a grown elastic EP group, or goes back to its old one.

    Only placements that keep this rank's slots are accepted (ValueError otherwise, naming the
    layer): no weights are loaded here, so a rank's rows must hold the same experts before and
    after (what :func:`~flotilla.cluster.eplb.grow_placement` guarantees for running ranks).
    The check runs for every layer before any layer changes.
    """
    layers = moe_layers(model)
    missing = sorted({layer for layer, _ in layers} - set(placements))
    if missing:
        raise ValueError(f"no expert placement given for MoE layers {missing}")
    for layer, module in layers:
        placement = placements[layer]
        keeps = placement.local_logical_experts(parallel.ep_rank) if parallel.ep_rank < placement.ep_size else None
        if keeps != module.local_logical_experts:
            raise ValueError(
                f"MoE layer {layer}: the new placement moves the experts of EP rank {parallel.ep_rank} "
                f"({module.local_logical_experts} -> {keeps}); a running rank keeps its slots (use grow_placement)"
            )
    for _, module in layers:
        module.parallel = parallel
        module.dispatcher = make_dispatcher(parallel)
    for layer, module in layers:
        module.set_placement(placements[layer])
