"""DeepSeek-V2 and V3: multi-head latent attention (MLA) and MoE with shared experts.

MLA caches one latent vector per token instead of per-head keys and values: the
RMS-normalised ``kv_c`` (``kv_lora_rank`` wide) concatenated with the shared, rotated
``k_pe`` (``qk_rope_head_dim`` wide), i.e. a cache entry of shape
``(1, kv_lora_rank + qk_rope_head_dim)``. Attention runs in the latent space
("absorbed"): ``kv_b_proj`` is split at load time into ``w_kc[H, Dn, R]`` (keys:
``q_nope`` is mapped into the latent space through it) and ``w_vc[H, R, Dv]`` (values:
the attended latent is mapped out through it), and ``mla_attention`` does the rest.

RoPE touches only the ``qk_rope_head_dim`` part. HF DeepSeek rotates interleaved pairs
(V2 always; V3 unless ``rope_interleave`` is false), i.e. ``is_neox=False``. YaRN
scaling multiplies cos/sin by its attention factor (in the rope table) and, with
``mscale_all_dim``, the softmax scale by ``mscale**2``.

Routing: V2 scores experts with softmax (``topk_method="group_limited_greedy"`` limits
the choice to the ``topk_group`` groups with the best expert); V3 scores with sigmoid
and chooses by bias-corrected scores (``e_score_correction_bias``) in the ``topk_group``
groups whose best two experts score highest. Both multiply the routing weights by
``routed_scaling_factor`` and add ``n_shared_experts`` always-on experts.
"""

from __future__ import annotations

import math
import re
from typing import Any

import torch
from torch import nn

from flotilla.cluster.models.base import KVCacheSpec, ModelConfig, ParallelLayout
from flotilla.cluster.models.layers import ColumnParallelLinear
from flotilla.cluster.models.fp8_linear import ParallelLinears
from flotilla.cluster.models.fp8_moe import routed_experts
from flotilla.cluster.models.moe_layer import MoERouter
from flotilla.cluster.models.mtp import MTPHost
from flotilla.cluster.models.moe_models import (
    DecoderLayer,
    DecoderOnlyLM,
    MLP_STACKED_PARAMS,
    GatedMLP,
    RMSNorm,
    RotaryEmbedding,
    rope_settings,
)
from flotilla.kernels import registry
from flotilla.kernels.attention import AttentionMetadata, AttentionShape
from flotilla.kernels.dcp import dcp_local_view

# NOTE: the DCP merge of partial attention states runs on the torch reference whatever the
# elementwise backend is.
_MERGE_BACKEND = "torch"
# NOTE: HF (and DeepSeek's own code) build q_a_layernorm / kv_a_layernorm with the
# RMSNorm default epsilon, not config.rms_norm_eps.
_LATENT_NORM_EPS = 1e-6
_LAYER_INDEX = re.compile(r"^(?:model\.)?layers\.(\d+)\.")


def _yarn_mscale(factor: float, mscale: float) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def mla_softmax_scale(cfg: ModelConfig) -> float:
    """``1/sqrt(qk_nope_head_dim + qk_rope_head_dim)``, times ``mscale**2`` under YaRN
    with ``mscale_all_dim`` (the long-context temperature of DeepSeek's YaRN)."""
    scale = (cfg.get("qk_nope_head_dim") + cfg.get("qk_rope_head_dim")) ** -0.5
    _, scaling = rope_settings(cfg)
    if scaling and scaling.get("mscale_all_dim"):
        mscale = _yarn_mscale(scaling["factor"], scaling["mscale_all_dim"])
        scale *= mscale * mscale
    return scale


def _replicated(in_features: int, out_features: int, bias: bool, dtype: torch.dtype) -> ColumnParallelLinear:
    """A projection every rank holds whole (the low-rank down-projections)."""
    return ColumnParallelLinear(in_features, out_features, bias=bias, parallel=ParallelLayout(), dtype=dtype)


# DCP merge exchanges (``dcp_comm_backend``). NOTE: ``fi_a2a`` is FlashInfer's implementation
# of the same all-to-all exchange; on the torch path it runs as ``a2a``.
_DCP_COMM_BACKENDS = {"ag_rs": "ag_rs", "a2a": "a2a", "fi_a2a": "a2a"}


def dcp_combine_ag_rs(out: torch.Tensor, lse: torch.Tensor, comm: Any) -> torch.Tensor:
    """Merge DCP partial attention by all-gather + reduce-scatter.

    ``out[T, Hg, Dv]`` / ``lse[T, Hg]`` are this rank's partial over its token shard for all
    ``Hg`` heads of the DCP group (in group rank order). The per-head LSEs are all-gathered,
    each partial is rescaled by ``exp(lse_local - lse_global)`` (0 for an empty shard) and the
    rescaled partials are summed and scattered by head: returns ``[T, Hg / dcp, Dv]`` for
    this rank's own heads (in ``out.dtype``; the sum runs in float32).
    """
    total = torch.logsumexp(comm.all_gather(lse.float().unsqueeze(0), dim=0), dim=0)  # [T, Hg]
    # NOTE: an empty shard (lse = -inf) weighs 0, also where every shard is empty (no NaN).
    weight = torch.where(torch.isneginf(lse), 0.0, torch.exp(lse.float() - total))
    return comm.reduce_scatter(out.float() * weight.unsqueeze(-1), dim=1).to(out.dtype)


def dcp_combine_a2a(out: torch.Tensor, lse: torch.Tensor, comm: Any, merge_n: Any) -> torch.Tensor:
    """Merge DCP partial attention by all-to-all: every rank sends each peer the partials
    (output and LSE) of that peer's heads and merges the ``dcp`` partials it receives for its
    own heads with ``merge_n`` (``merge_attention_states_n``). Shapes as in
    :func:`dcp_combine_ag_rs`."""
    tokens, group_heads, v_dim = out.shape
    size = comm.size
    heads = group_heads // size
    # NOTE: output and LSE travel in one float32 message, the LSE as an extra channel.
    packed = torch.cat([out.float(), lse.float().unsqueeze(-1)], dim=-1).view(tokens, size, heads, v_dim + 1)
    received, _ = comm.all_to_all(packed.transpose(0, 1).reshape(size * tokens, heads, v_dim + 1), [tokens] * size)
    received = received.view(size, tokens, heads, v_dim + 1)
    merged, _ = merge_n(received[..., :v_dim], received[..., v_dim])
    return merged.to(out.dtype)


class MLAttention(nn.Module):
    """Multi-head latent attention over a latent paged cache.

    Heads are split over attention TP. Under decode context parallelism
    (``parallel.dcp_size > 1``, a slice of attention TP) the latent cache is sharded by
    token (position ``p`` on DCP rank ``p % dcp_size``, see :mod:`flotilla.kernels.dcp`):

    1. every rank computes every new token's latent (``kv_a_proj`` is replicated) and writes
       only the tokens it owns;
    2. the DCP group's queries are all-gathered by head, so each rank attends for all the
       group's heads over its own shard (``w_kc``/``w_vc`` are held for the group's heads);
    3. the partial outputs are merged with their LSEs back to the rank's own heads:
       ``ag_rs`` (:func:`dcp_combine_ag_rs`) or ``a2a`` (:func:`dcp_combine_a2a`).

    NOTE: the merge runs AFTER ``w_vc`` (in value space, ``v_head_dim`` per head) rather than
    on the attended latent (``kv_lora_rank`` per head): merging is linear, so both are exact,
    and value space sends 4x fewer bytes for DeepSeek (128 vs 512) at the cost of each rank
    applying ``w_vc`` for the group's heads.
    """

    # The engine may shard this layer's cache by token over DCP ranks (ModelRunner checks it).
    supports_dcp = True

    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding, prefix: str | None = None):
        super().__init__()
        hidden, heads = cfg.get("hidden_size"), cfg.get("num_attention_heads")
        tp = cfg.parallel
        if heads % tp.tp_size:
            raise ValueError(f"num_attention_heads={heads} is not divisible by tp_size={tp.tp_size}")
        if tp.tp_size % tp.dcp_size:
            raise ValueError(f"dcp_size={tp.dcp_size} must divide the attention TP size tp_size={tp.tp_size}")
        if tp.dcp_comm_backend not in _DCP_COMM_BACKENDS:
            raise ValueError(
                f"dcp_comm_backend={tp.dcp_comm_backend!r} is not supported; use one of {sorted(_DCP_COMM_BACKENDS)}"
            )
        self.num_heads = heads // tp.tp_size
        self.tp_rank = tp.tp_rank
        self.dcp_size, self.dcp_rank = tp.dcp_size, tp.dcp_rank
        self.dcp_exchange = _DCP_COMM_BACKENDS[tp.dcp_comm_backend]
        self.dcp_comm = tp.comm("dcp") if self.dcp_size > 1 else None
        # Heads this rank attends for: its own, or under DCP its whole DCP group's (the group is
        # consecutive attention-TP ranks, so its heads are contiguous).
        self.attn_heads = self.num_heads * self.dcp_size
        self.attn_head_start = (tp.tp_rank - tp.dcp_rank) * self.num_heads
        self.nope_dim, self.rope_dim = cfg.get("qk_nope_head_dim"), cfg.get("qk_rope_head_dim")
        self.v_dim, self.kv_lora_rank = cfg.get("v_head_dim"), cfg.get("kv_lora_rank")
        self.q_lora_rank = cfg.get("q_lora_rank")
        bias, dtype = bool(cfg.get("attention_bias", False)), cfg.dtype
        q_width = heads * (self.nope_dim + self.rope_dim)
        if self.q_lora_rank is None:
            self.q_proj = ColumnParallelLinear(hidden, q_width, parallel=tp, dtype=dtype)
        else:
            self.q_a_proj = _replicated(hidden, self.q_lora_rank, bias, dtype)
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, _LATENT_NORM_EPS, dtype, cfg.elementwise_backend)
            self.q_b_proj = ColumnParallelLinear(self.q_lora_rank, q_width, parallel=tp, dtype=dtype)
        self.kv_a_proj_with_mqa = _replicated(hidden, self.kv_lora_rank + self.rope_dim, bias, dtype)
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, _LATENT_NORM_EPS, dtype, cfg.elementwise_backend)
        # kv_b_proj, split per head: keys' up-projection and values' up-projection (transposed).
        w_kc = torch.empty(self.attn_heads, self.nope_dim, self.kv_lora_rank, dtype=dtype)
        w_vc = torch.empty(self.attn_heads, self.kv_lora_rank, self.v_dim, dtype=dtype)
        self.w_kc = nn.Parameter(w_kc, requires_grad=False)
        self.w_vc = nn.Parameter(w_vc, requires_grad=False)
        self.w_kc.weight_loader = self._load_kv_b  # type: ignore[attr-defined]
        self.w_vc.weight_loader = self._load_kv_b  # type: ignore[attr-defined]
        o_name = None if prefix is None else f"{prefix}.o_proj"
        self.o_proj = ParallelLinears.of(cfg).row(o_name, heads * self.v_dim, hidden, bias, tp, dtype)
        self.rotary = rotary
        self.scale = mla_softmax_scale(cfg)
        self._attend = registry.get("mla_attention", cfg.attention_backend)
        self._merge_n = registry.get("merge_attention_states_n", _MERGE_BACKEND)

    def _load_kv_b(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        """Fill ``w_kc`` or ``w_vc`` from the whole ``kv_b_proj.weight[H*(Dn+Dv), R]`` (the heads
        this rank attends for)."""
        expected = (-1, self.nope_dim + self.v_dim, self.kv_lora_rank)
        per_head = loaded.view(expected).narrow(0, self.attn_head_start, self.attn_heads)
        if param is self.w_kc:
            param.data.copy_(per_head[:, : self.nope_dim])
        else:
            param.data.copy_(per_head[:, self.nope_dim :].transpose(1, 2))

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor, kv_cache: tuple, meta: AttentionMetadata
    ) -> torch.Tensor:
        q_nope, q_pe, kv_c, k_pe, _ = self.project(positions, x)
        (latent_cache,) = kv_cache
        return self.attend(q_nope, q_pe, kv_c, k_pe, latent_cache, meta)

    def project(self, positions: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """``(q_nope[T, H, Dn], q_pe[T, H, Dr], kv_c[T, R], k_pe[T, Dr], q_resid)``: this rank's
        query heads, the new tokens' normalised latent and rotated shared key, and the normalised
        query LoRA activation ``q_a_layernorm(q_a_proj(x))`` (None without a query LoRA; the DSA
        indexer reads it)."""
        q_resid = None
        if self.q_lora_rank is None:
            q = self.q_proj(x)
        else:
            q_resid = self.q_a_layernorm(self.q_a_proj(x))
            q = self.q_b_proj(q_resid)
        q = q.view(-1, self.num_heads, self.nope_dim + self.rope_dim)
        q_nope, q_pe = q.split([self.nope_dim, self.rope_dim], dim=-1)
        kv_c, k_pe = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.rope_dim], dim=-1)
        kv_c = self.kv_a_layernorm(kv_c)
        q_pe, k_pe = self.rotary(positions, q_pe, k_pe)
        return q_nope, q_pe, kv_c, k_pe, q_resid

    def attend(
        self,
        q_nope: torch.Tensor,
        q_pe: torch.Tensor,
        kv_c: torch.Tensor,
        k_pe: torch.Tensor,
        latent_cache: torch.Tensor,
        meta: AttentionMetadata,
        **sparse,
    ) -> torch.Tensor:
        """Attention of the projected tokens and ``o_proj``: ``[T, hidden]`` (``sparse``: the
        extra arguments of a sparse attention op, passed on)."""
        if self.dcp_size == 1:
            out = self._attend(q_nope, q_pe, kv_c, k_pe, latent_cache, meta, self.w_kc, self.w_vc, self.scale, **sparse)
        else:
            out = self._attend_dcp(q_nope, q_pe, kv_c, k_pe, latent_cache, meta, **sparse)
        # NOTE: explicit width: an idle DP-attention rank runs zero tokens, where -1 is ambiguous.
        return self.o_proj(out.reshape(out.shape[0], self.num_heads * self.v_dim))

    def _attend_dcp(
        self,
        q_nope: torch.Tensor,
        q_pe: torch.Tensor,
        kv_c: torch.Tensor,
        k_pe: torch.Tensor,
        cache: torch.Tensor,
        meta: AttentionMetadata,
        **sparse,
    ) -> torch.Tensor:
        """DCP attention for this rank's own heads ``[T, num_heads, Dv]`` (see the class docstring)."""
        if q_nope.shape[0] == 0:
            # NOTE: the DCP group is one attention-TP batch, so every member skips together.
            return q_nope.new_zeros(0, self.num_heads, self.v_dim)
        q = self.dcp_comm.all_gather(torch.cat([q_nope, q_pe], dim=-1), dim=1)  # [T, group heads, Dn + Dr]
        q_nope, q_pe = q.split([self.nope_dim, self.rope_dim], dim=-1)
        local = dcp_local_view(meta, self.dcp_size, self.dcp_rank)
        out, lse = self._attend(
            q_nope, q_pe, kv_c, k_pe, cache, meta, self.w_kc, self.w_vc, self.scale, return_lse=True, local=local,
            **sparse,
        )  # fmt: skip
        if self.dcp_exchange == "ag_rs":
            return dcp_combine_ag_rs(out, lse, self.dcp_comm)
        return dcp_combine_a2a(out, lse, self.dcp_comm, self._merge_n)


def is_moe_layer(cfg: ModelConfig, index: int) -> bool:
    """Whether decoder layer ``index`` routes experts: ``mlp_layer_types[index] == "sparse"`` when
    the config lists them (transformers 5's DeepSeek-V3.2 / GLM-5 configs), else from
    ``first_k_dense_replace`` and ``moe_layer_freq`` (also for MTP layers, past the list)."""
    if cfg.get("n_routed_experts") is None:
        return False
    types = cfg.get("mlp_layer_types")
    if types and index < len(types):
        return types[index] == "sparse"
    return index >= cfg.get("first_k_dense_replace", 0) and index % cfg.get("moe_layer_freq", 1) == 0


class DeepseekMoE(nn.Module):
    """Routed experts plus ``n_shared_experts`` shared ones (one MLP of
    ``n_shared_experts * moe_intermediate_size``). ``prefix`` is the checkpoint module
    (``model.layers.3.mlp``) whose routed and shared experts may be block FP8 (the router stays
    in float32); None: never FP8. Also GLM-4.x's MoE block (the same routing)."""

    def __init__(
        self,
        cfg: ModelConfig,
        scoring: str,
        correction_bias: bool,
        grouped: bool,
        layer_index: int,
        prefix: str | None = None,
    ):
        super().__init__()
        hidden, num_experts = cfg.get("hidden_size"), cfg.get("n_routed_experts")
        inter = cfg.get("moe_intermediate_size")
        top_k = cfg.get("num_experts_per_tok")
        self.gate = MoERouter(
            hidden, num_experts, with_correction_bias=correction_bias, float32_logits=True, dtype=cfg.dtype
        )
        self.experts = routed_experts(
            cfg,
            None if prefix is None else f"{prefix}.experts",
            num_experts,
            top_k,
            hidden,
            inter,
            # NOTE: as vLLM/SGLang and DeepSeek's code for the shipped checkpoints (HF's V2 class ignores
            # norm_topk_prob, which is false in every V2 checkpoint).
            renormalize=bool(cfg.get("norm_topk_prob", False)) and top_k > 1,
            scoring=scoring,
            num_expert_group=cfg.get("n_group") if grouped else None,
            topk_group=cfg.get("topk_group") if grouped else None,
            routed_scaling_factor=float(cfg.get("routed_scaling_factor", 1.0)),
            num_redundant_experts=cfg.num_redundant_experts,
            placement=cfg.expert_placements.get(layer_index),
            parallel=cfg.parallel,
            dtype=cfg.dtype,
            backend=cfg.moe_backend,
        )
        shared = cfg.get("n_shared_experts", 0)
        shared_prefix = None if prefix is None else f"{prefix}.shared_experts"
        self.shared_experts = GatedMLP(cfg, hidden, inter * shared, prefix=shared_prefix) if shared else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.experts(x, self.gate(x), self.gate.e_score_correction_bias)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out


class _DeepseekForCausalLM(DecoderOnlyLM):
    """The shared V2/V3 decoder; subclasses choose the rope layout and the routing.

    Loads block-FP8 checkpoints (DeepSeek-V3/R1 as published): ``o_proj``, the dense MLPs and the
    shared and routed experts run as FP8 layers; MLA's other projections are dequantized at load
    (:mod:`~flotilla.cluster.models.fp8_dequant`; ``kv_b_proj`` must be, for the absorbed
    ``w_kc`` / ``w_vc``)."""

    stacked_params = MLP_STACKED_PARAMS
    loads_block_fp8 = True

    def __init__(self, cfg: ModelConfig, is_neox: bool, scoring: str, correction_bias: bool, grouped: bool):
        super().__init__(cfg)
        base, scaling = rope_settings(cfg)
        max_position = cfg.get("max_position_embeddings")
        rotary = RotaryEmbedding(
            cfg.get("qk_rope_head_dim"), max_position, base, scaling, is_neox, backend=cfg.elementwise_backend
        )
        self.rotary = rotary
        self.routing = (scoring, correction_bias, grouped)
        self.num_layers = cfg.get("num_hidden_layers")
        for i in range(self.num_layers):
            self.layers.append(self.build_layer(cfg, i))

    def build_layer(self, cfg: ModelConfig, index: int) -> nn.Module:
        """Decoder layer ``index`` (a checkpoint index: past the last decoder layer, an MTP
        layer's block)."""
        prefix = f"model.layers.{index}.mlp"
        if is_moe_layer(cfg, index):
            mlp: nn.Module = DeepseekMoE(cfg, *self.routing, layer_index=index, prefix=prefix)
        else:
            mlp = GatedMLP(cfg, cfg.get("hidden_size"), cfg.get("intermediate_size"), prefix=prefix)
        return self.decoder_layer(cfg, index, mlp)

    def decoder_layer(self, cfg: ModelConfig, index: int, mlp: nn.Module) -> nn.Module:
        """Decoder layer ``index`` around ``mlp`` (MLA here; the DSA models override it)."""
        return DecoderLayer(cfg, MLAttention(cfg, self.rotary, prefix=f"model.layers.{index}.self_attn"), mlp)

    def kv_cache_spec(self) -> KVCacheSpec:
        width = self.config.get("kv_lora_rank") + self.config.get("qk_rope_head_dim")
        return KVCacheSpec(num_layers=len(self.layers), tensors_per_layer=((1, width),), dtype=self.config.dtype)

    def kv_head_span(self) -> tuple[int, int, int]:
        """``(0, 1, 1)``: the MLA latent cache has one "head", replicated on every TP rank."""
        return 0, 1, 1

    def attention_shape(self) -> AttentionShape:
        """What this rank's MLA layers look like, in the absorbed (latent) form that
        ``mla_attention`` runs: one shared KV "head" of ``kv_lora_rank + qk_rope_head_dim``
        (values: the ``kv_lora_rank`` latent), the query heads this rank attends for (its own
        ``num_attention_heads / tp``; under DCP its whole DCP group's), and the softmax scale
        the layers pass (``1/sqrt(qk_nope_head_dim + qk_rope_head_dim)``, times YaRN's
        ``mscale**2`` when the rope scaling sets ``mscale_all_dim``)."""
        attn = self.layers[0].self_attn
        latent = attn.kv_lora_rank
        return AttentionShape(
            num_q_heads=attn.attn_heads,
            num_kv_heads=1,
            head_dim=latent + attn.rope_dim,
            head_dim_v=latent,
            scale=attn.scale,
            sliding_window=None,
            dtype=self.config.dtype,
            kv_lora_rank=latent,
            qk_rope_head_dim=attn.rope_dim,
        )

    def hf_target(self, name: str) -> Any:
        layer = _LAYER_INDEX.match(name)
        if layer and int(layer.group(1)) >= self.num_layers:
            return None  # MTP layers the config does not count (MTPHost loads those it does)
        return self.layer_target(name)

    def layer_target(self, name: str) -> Any:
        """:meth:`hf_target` for a tensor of any decoder layer index (MTP blocks included)."""
        if name.endswith(".self_attn.kv_b_proj.weight"):
            prefix = name.removeprefix("model.")[: -len("kv_b_proj.weight")]
            return [(prefix + "w_kc", None), (prefix + "w_vc", None)]
        return super().hf_target(name)


class DeepseekV2ForCausalLM(_DeepseekForCausalLM):
    """DeepSeek-V2 / V2-Lite: interleaved RoPE, softmax routing, group-limited when
    ``topk_method == "group_limited_greedy"``."""

    def __init__(self, cfg: ModelConfig):
        grouped = cfg.get("topk_method", "greedy") == "group_limited_greedy"
        scoring = cfg.get("scoring_func", "softmax")
        super().__init__(cfg, is_neox=False, scoring=scoring, correction_bias=False, grouped=grouped)


class DeepseekV3ForCausalLM(MTPHost, _DeepseekForCausalLM):
    """DeepSeek-V3 / R1: RoPE interleaved unless ``rope_interleave`` is false; sigmoid
    routing with ``e_score_correction_bias`` (``topk_method="noaux_tc"``) over expert groups;
    the checkpoint's MTP layers load into the draft module (:mod:`~flotilla.cluster.models.mtp`)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__(
            cfg,
            is_neox=not cfg.get("rope_interleave", True),
            scoring=cfg.get("scoring_func", "sigmoid"),
            correction_bias=cfg.get("topk_method", "noaux_tc") == "noaux_tc",
            grouped=True,
        )
