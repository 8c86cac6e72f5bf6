"""Mixture-of-experts: routing (which experts each token goes to, with what weight)
and the expert computation itself.

Expert weights use HF's fused layout: ``w13[E, 2I, H]`` stacks each expert's gate
projection (first ``I`` rows) over its up projection (next ``I`` rows); ``w2[E, H, I]``
is the down projection.
"""

from __future__ import annotations

import torch

from flotilla.kernels.activation import gelu_and_mul, silu_and_mul
from flotilla.kernels.registry import register

_ACTIVATIONS = {
    "silu": silu_and_mul,
    "gelu": gelu_and_mul,
    "gelu_tanh": lambda x: gelu_and_mul(x, approximate="tanh"),
}


def _group_mask(scores: torch.Tensor, num_expert_group: int, topk_group: int, sum_top2: bool) -> torch.Tensor:
    """``[T, E]`` bool: experts inside each token's ``topk_group`` best groups.

    A group's score is its best expert's score (DeepSeek-V2's ``group_limited_greedy``)
    or the sum of its best two (DeepSeek-V3's ``noaux_tc``, on bias-corrected scores).
    """
    num_tokens, num_experts = scores.shape
    if num_experts % num_expert_group:
        raise ValueError(
            f"num_expert_group={num_expert_group} must divide the number of experts ({num_experts})"
        )
    grouped = scores.view(num_tokens, num_expert_group, num_experts // num_expert_group)
    group_scores = grouped.topk(2, dim=-1)[0].sum(dim=-1) if sum_top2 else grouped.max(dim=-1).values
    group_idx = group_scores.topk(topk_group, dim=-1, sorted=False)[1]
    group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, group_idx, True)
    return group_mask.unsqueeze(-1).expand_as(grouped).reshape(num_tokens, num_experts)


@register("select_experts", "torch")
def select_experts(
    router_logits: torch.Tensor,
    top_k: int,
    renormalize: bool,
    scoring: str = "softmax",
    num_expert_group: int | None = None,
    topk_group: int | None = None,
    correction_bias: torch.Tensor | None = None,
    routed_scaling_factor: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick ``top_k`` experts per token; returns ``(topk_weights[T, k] float32, topk_ids[T, k] int64)``.

    Args:
        router_logits: ``[T, E]`` gate outputs.
        top_k: experts per token.
        renormalize: divide the chosen weights by their sum (HF ``norm_topk_prob``;
            always on for Mixtral).
        scoring: ``"softmax"`` (Mixtral, Qwen-MoE, DeepSeek-V2) or ``"sigmoid"`` (DeepSeek-V3).
        num_expert_group, topk_group: group-limited routing: only experts in each token's
            ``topk_group`` best of ``num_expert_group`` groups are eligible. Both or neither.
        correction_bias: ``[E]`` DeepSeek-V3 ``e_score_correction_bias``: added to the scores
            for choosing experts (and groups, scored by the sum of their best two); the
            weights come from the unbiased scores.
        routed_scaling_factor: multiplies the final weights (DeepSeek).

    NOTE: expert order within a token is unspecified (HF DeepSeek uses unsorted top-k);
    only the (id, weight) pairs matter.
    """
    if scoring == "softmax":
        scores = router_logits.float().softmax(dim=-1)
    elif scoring == "sigmoid":
        scores = router_logits.float().sigmoid()
    else:
        raise ValueError(f"scoring must be 'softmax' or 'sigmoid', got scoring={scoring!r}")
    if (num_expert_group is None) != (topk_group is None):
        raise ValueError(
            f"num_expert_group and topk_group go together, got num_expert_group={num_expert_group}, topk_group={topk_group}"
        )
    choice = scores if correction_bias is None else scores + correction_bias.float()
    if num_expert_group is not None and num_expert_group > 1:
        eligible = _group_mask(choice, num_expert_group, topk_group, sum_top2=correction_bias is not None)
        choice = choice.masked_fill(~eligible, float("-inf"))
    if correction_bias is None:
        topk_weights, topk_ids = choice.topk(top_k, dim=-1)
    else:
        topk_ids = choice.topk(top_k, dim=-1)[1]
        topk_weights = scores.gather(1, topk_ids)
    if renormalize:
        # NOTE: the epsilon only matters for sigmoid scores that all underflow (as HF DeepSeek-V3).
        topk_weights = topk_weights / (topk_weights.sum(dim=-1, keepdim=True) + 1e-20)
    if routed_scaling_factor != 1.0:
        topk_weights = topk_weights * routed_scaling_factor
    return topk_weights, topk_ids


@register("fused_moe", "torch")
def fused_moe(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    activation: str = "silu",
    expert_map: torch.Tensor | None = None,
) -> torch.Tensor:
    """Run each token through its chosen experts and sum the weighted outputs.

    Args:
        hidden: ``[T, H]``.
        w13: ``[E_local, 2I, H]`` gate (first ``I`` rows) and up projections.
        w2: ``[E_local, H, I]`` down projections.
        topk_weights, topk_ids: ``[T, k]`` from :func:`select_experts` (global expert ids).
        activation: ``"silu"``, ``"gelu"`` or ``"gelu_tanh"`` on the gate.
        expert_map: ``[E_global]`` int, the local index of each global expert or ``-1`` when
            this rank does not hold it (expert parallelism); such routes contribute nothing,
            another rank adds them. None means ids are local indices.

    Returns ``[T, H]`` in ``hidden.dtype``; accumulated in float32.
    """
    if activation not in _ACTIVATIONS:
        raise ValueError(f"activation must be one of {sorted(_ACTIVATIONS)}, got activation={activation!r}")
    act_and_mul = _ACTIVATIONS[activation]
    out = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
    flat_ids = topk_ids.reshape(-1)
    flat_weights = topk_weights.reshape(-1)
    token_of_route = torch.arange(hidden.shape[0], device=hidden.device).repeat_interleave(topk_ids.shape[1])
    for expert in flat_ids.unique().tolist():
        local = expert if expert_map is None else int(expert_map[expert])
        if local < 0:
            continue
        routes = (flat_ids == expert).nonzero(as_tuple=True)[0]
        tokens = token_of_route[routes]
        x = hidden[tokens]
        h = act_and_mul(x @ w13[local].t())
        y = h @ w2[local].t()
        out.index_add_(0, tokens, y.float() * flat_weights[routes, None].float())
    return out.to(hidden.dtype)
