"""Mixture-of-experts layers: the router gate and the expert-parallel-ready fused experts.

:class:`FusedMoE` holds every local expert's weights stacked, as the fused-MoE kernels
want them: ``w13[E_local, 2*I, H]`` (gate rows, then up rows) and ``w2[E_local, H, I]``.
A checkpoint stores one small matrix per expert; :meth:`FusedMoE.checkpoint_shard`
names where each lands, and the parameters' ``weight_loader`` copies it in. Shared
experts and dense MLP layers are the model's business (plain MLPs).

Parallel layout (given, never probed):

- expert parallelism: ``ep_size`` ranks each own a contiguous range of
  ``num_experts / ep_size`` experts; ``expert_map`` (global id -> local index or -1) tells
  the kernel which routed tokens it computes here. Experts outside the range are simply
  not loaded. With ``ep_size == 1`` (today) every expert is local and there is no map.
- MoE tensor parallelism (``parallel``): each rank holds a slice of every expert's
  intermediate dimension (rows of gate/up, columns of down).

Both leave each rank with a partial sum of the output; ``all_reduce`` (if given) sums it.
"""

from __future__ import annotations

import re
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from flotilla.cluster.models.base import ParallelLayout
from flotilla.cluster.models.layers import default_weight_loader
from flotilla.kernels import registry

# Checkpoint spellings of each expert's three matrices: HF Qwen/DeepSeek names and Mixtral's.
_PART_OF_NAME = {"gate_proj": "w1", "w1": "w1", "up_proj": "w3", "w3": "w3", "down_proj": "w2", "w2": "w2"}
_PER_EXPERT = re.compile(r"^experts\.(\d+)\.(gate_proj|up_proj|down_proj|w1|w2|w3)\.weight$")


class MoERouter(nn.Module):
    """The replicated gate: ``router_logits = x W^T`` with ``W[E, H]``.

    Args:
        hidden_size: model width ``H``.
        num_experts: routed experts ``E`` (global count).
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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.to(self.weight.dtype), self.weight)


class FusedMoE(nn.Module):
    """Routed experts: select ``top_k`` experts per token and sum their gated MLPs.

    Args:
        num_experts: global number of routed experts.
        top_k: experts per token.
        hidden_size: model width ``H``.
        intermediate_size: each expert's (full, unsharded) intermediate width ``I``.
        renormalize: rescale the chosen weights to sum to one.
        scoring: ``"softmax"`` or ``"sigmoid"`` over the router logits.
        num_expert_group, topk_group: group-limited routing (DeepSeek): pick ``topk_group``
            of ``num_expert_group`` groups first, then experts inside them.
        routed_scaling_factor: multiplies the routing weights (DeepSeek).
        activation: the experts' gated activation (``"silu"``).
        ep_size, ep_rank: expert-parallel layout (this rank owns a contiguous expert range).
        parallel: MoE tensor-parallel layout (splits ``I``).
        dtype: weight dtype.
        backend: kernel backend of ``select_experts`` / ``fused_moe``.
        all_reduce: sums partial outputs across the EP/TP group when either is > 1.
    """

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
        ep_size: int = 1,
        ep_rank: int = 0,
        parallel: ParallelLayout = ParallelLayout(),
        dtype: torch.dtype = torch.float32,
        backend: str = "torch",
        all_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ):
        super().__init__()
        if top_k < 1 or top_k > num_experts:
            raise ValueError(f"num_experts_per_tok={top_k} must be between 1 and the number of experts ({num_experts})")
        if num_experts % ep_size:
            raise ValueError(f"num_experts={num_experts} is not divisible by ep_size={ep_size}")
        if intermediate_size % parallel.tp_size:
            raise ValueError(
                f"moe_intermediate_size={intermediate_size} is not divisible by tp_size={parallel.tp_size}"
            )
        self.num_experts = num_experts
        self.top_k = top_k
        self.renormalize = renormalize
        self.scoring = scoring
        self.num_expert_group = num_expert_group
        self.topk_group = topk_group
        self.routed_scaling_factor = routed_scaling_factor
        self.activation = activation
        self.parallel = parallel
        self.ep_size = ep_size
        self.all_reduce = all_reduce
        self.num_local_experts = num_experts // ep_size
        self.first_local_expert = ep_rank * self.num_local_experts
        self.intermediate_per_rank = intermediate_size // parallel.tp_size
        self._select = registry.get("select_experts", backend)
        self._experts = registry.get("fused_moe", backend)

        e, i, h = self.num_local_experts, self.intermediate_per_rank, hidden_size
        self.w13 = nn.Parameter(torch.empty(e, 2 * i, h, dtype=dtype), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(e, h, i, dtype=dtype), requires_grad=False)
        self.w13.weight_loader = self._load  # type: ignore[attr-defined]
        self.w2.weight_loader = self._load  # type: ignore[attr-defined]
        expert_map = None
        if ep_size > 1:
            expert_map = torch.full((num_experts,), -1, dtype=torch.int64)
            expert_map[self.first_local_expert : self.first_local_expert + e] = torch.arange(e)
        self.register_buffer("expert_map", expert_map, persistent=False)

    # ----------------------------------------------------------------- loading

    @staticmethod
    def checkpoint_shard(name: str) -> tuple[str, tuple[str, int] | None] | None:
        """Where a checkpoint tensor named ``name`` (relative to the MoE block, e.g.
        ``experts.3.gate_proj.weight``) lands: ``(param_name, shard_id)``, or None if the
        name is not an expert weight.

        ``shard_id`` is ``(part, expert_id)`` with part ``w1`` (gate), ``w3`` (up) or ``w2``
        (down) for per-expert checkpoint tensors, and None for transformers' in-memory
        stacked tensors ``experts.gate_up_proj[E, 2I, H]`` / ``experts.down_proj[E, H, I]``.
        """
        match = _PER_EXPERT.match(name)
        if match:
            part = _PART_OF_NAME[match.group(2)]
            return ("w2" if part == "w2" else "w13"), (part, int(match.group(1)))
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
        local = expert - self.first_local_expert
        if not 0 <= local < self.num_local_experts:
            return  # another expert-parallel rank owns this expert
        i, start = self.intermediate_per_rank, self.parallel.tp_rank * self.intermediate_per_rank
        if part == "w2":
            default_weight_loader(param.data[local], loaded.narrow(1, start, i))  # type: ignore[arg-type]
        else:
            rows = slice(0, i) if part == "w1" else slice(i, 2 * i)
            default_weight_loader(param.data[local, rows], loaded.narrow(0, start, i))  # type: ignore[arg-type]

    # ----------------------------------------------------------------- forward

    def forward(
        self, hidden: torch.Tensor, router_logits: torch.Tensor, correction_bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        """``hidden[T, H]``, ``router_logits[T, E]`` -> ``[T, H]`` (reduced across the group)."""
        weights, ids = self._select(
            router_logits,
            self.top_k,
            self.renormalize,
            scoring=self.scoring,
            num_expert_group=self.num_expert_group,
            topk_group=self.topk_group,
            correction_bias=correction_bias,
            routed_scaling_factor=self.routed_scaling_factor,
        )
        out = self._experts(
            hidden, self.w13, self.w2, weights, ids, activation=self.activation, expert_map=self.expert_map
        )
        if self.all_reduce is not None and (self.ep_size > 1 or self.parallel.tp_size > 1):
            out = self.all_reduce(out)
        return out
