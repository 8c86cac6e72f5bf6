"""DeepSeek sparse attention (DSA) models: DeepSeek-V3.2 (``DeepseekV32ForCausalLM``) and GLM-5
(``GlmMoeDsaForCausalLM``).

Both are DeepSeek-V3 (MLA over a latent cache, sigmoid group-limited routing with shared
experts) whose attention reads only the ``index_topk`` context tokens a lightweight *lightning
indexer* selects per query (:mod:`flotilla.kernels.dsa`). The indexer has its own projections:
``wq_b`` (query heads from MLA's normalised query LoRA activation), ``wk`` + LayerNorm ``k_norm``
(one key per token, cached in the paged pool beside the latent) and ``weights_proj`` (float32,
per-head weights); RoPE rotates the first ``qk_rope_head_dim`` dims of its heads with the
model's table, rotate-half for DeepSeek-V3.2, interleaved pairs for GLM-5, as transformers 5.24
(the numerical reference) does.

GLM-5's IndexShare: a ``shared`` layer runs no indexer and attends to the previous ``full``
layer's selection (``indexer_types``, or the ``index_topk_pattern`` F/S string, as resolution
derives it: :func:`flotilla.resolution.model_derive.dsa_indexer_types`). Shared layers cache no
indexer keys.

Parallel layouts: MLA heads split over attention TP as for DeepSeek-V3, the indexer replicated
on every rank (it is small and every rank needs the whole selection); EP and DP attention as for
DeepSeek-V3; under DCP each rank scores its own token shard and the group's top-k is picked from
the ranks' candidates (all-gathered).
"""

from __future__ import annotations

import torch
from torch import nn

from flotilla.cluster.models.base import KVCacheSpec, ModelConfig
from flotilla.cluster.models.deepseek import MLAttention, _DeepseekForCausalLM, _replicated
from flotilla.cluster.models.moe_models import DecoderLayer, RotaryEmbedding
from flotilla.cluster.models.mtp import MTPHost
from flotilla.kernels import registry
from flotilla.kernels.attention import AttentionMetadata
from flotilla.kernels.dcp import dcp_local_view
from flotilla.kernels.dsa import merge_topk, topk_width
from flotilla.resolution.model_derive import dsa_indexer_types

# NOTE: HF builds the indexer's k_norm as nn.LayerNorm(index_head_dim, eps=1e-6).
_INDEX_NORM_EPS = 1e-6


class DSAIndexer(nn.Module):
    """The lightning indexer of one DSA layer: scores every context token for each new token and
    keeps the ``index_topk`` best (see the module docstring). ``is_neox``: rotate-half RoPE
    (DeepSeek-V3.2) or interleaved pairs (GLM-5).

    ``observer`` (None by default): called after each selection as ``observer(indexer, q, weights,
    index_cache, meta, local)`` with the op's inputs (a test seam: the tests recompute the scores
    there and check that no selection hinges on a near-tie).
    """

    observer = None

    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding, is_neox: bool):
        super().__init__()
        hidden, q_lora = cfg.get("hidden_size"), cfg.get("q_lora_rank")
        if q_lora is None:
            raise ValueError("DeepSeek sparse attention needs a query LoRA (q_lora_rank): the indexer reads its activation")
        self.n_heads, self.head_dim = int(cfg.get("index_n_heads")), int(cfg.get("index_head_dim"))
        self.topk = int(cfg.get("index_topk"))
        if self.head_dim < cfg.get("qk_rope_head_dim"):
            raise ValueError(
                f"index_head_dim={self.head_dim} is narrower than qk_rope_head_dim={cfg.get('qk_rope_head_dim')}, "
                "the part of each indexer head RoPE rotates"
            )
        dtype = cfg.dtype
        self.wq_b = _replicated(q_lora, self.n_heads * self.head_dim, False, dtype)
        self.wk = _replicated(hidden, self.head_dim, False, dtype)
        self.k_norm = nn.LayerNorm(self.head_dim, eps=_INDEX_NORM_EPS, dtype=dtype)
        # NOTE: transformers keeps weights_proj in float32 whatever the model dtype.
        self.weights_proj = _replicated(hidden, self.n_heads, False, torch.float32)
        self.rotary, self.is_neox = rotary, is_neox
        self.scale = self.head_dim**-0.5
        self._rope = registry.get("rotary_embedding", cfg.elementwise_backend)
        self._select = registry.get("dsa_indexer", cfg.dsa_backend)

    def forward(
        self,
        positions: torch.Tensor,
        x: torch.Tensor,
        q_resid: torch.Tensor,
        index_cache: torch.Tensor,
        meta: AttentionMetadata,
        local=None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store the new tokens' keys; ``(values[T, W], positions[T, W])`` of each new token's
        selection (``dsa_indexer``'s contract; ``local``: a DCP rank's shard)."""
        tokens = x.shape[0]
        q = self.wq_b(q_resid).view(tokens, self.n_heads, self.head_dim)
        k = self.k_norm(self.wk(x))
        q, k = self._rope(positions, q, k, self.rotary.cos_sin_cache, is_neox=self.is_neox)
        weights = self.weights_proj(x.to(torch.float32)) * self.n_heads**-0.5
        values, selected = self._select(q, weights, k, index_cache, meta, self.topk, self.scale, local=local)
        if self.observer is not None:
            self.observer(self, q, weights, index_cache, meta, local)
        return values, selected


class DSAttention(MLAttention):
    """MLA restricted to the indexer's selection (op ``dsa_sparse_mla``). A ``shared`` layer has no
    indexer and takes the selection of the previous full layer."""

    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding, prefix: str, shared: bool, indexer_neox: bool):
        super().__init__(cfg, rotary, prefix=prefix)
        self._attend = registry.get("dsa_sparse_mla", cfg.dsa_backend)
        self.indexer = None if shared else DSAIndexer(cfg, rotary, indexer_neox)

    def forward(
        self,
        positions: torch.Tensor,
        x: torch.Tensor,
        kv_cache: tuple,
        meta: AttentionMetadata,
        selected: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(out[T, hidden], selected[T, W])``: the layer's output and the selection it attended
        to (its own, or the ``selected`` it was handed when shared)."""
        q_nope, q_pe, kv_c, k_pe, q_resid = self.project(positions, x)
        if self.indexer is not None:
            selected = self._select(positions, x, q_resid, kv_cache[1], meta)
        elif selected is None:
            raise ValueError("a shared DSA layer needs the top-k of a previous full layer")
        return self.attend(q_nope, q_pe, kv_c, k_pe, kv_cache[0], meta, selected=selected), selected

    def _select(
        self, positions: torch.Tensor, x: torch.Tensor, q_resid: torch.Tensor, index_cache: torch.Tensor, meta
    ) -> torch.Tensor:
        if self.dcp_size == 1:
            return self.indexer(positions, x, q_resid, index_cache, meta)[1]
        width = topk_width(meta, self.indexer.topk)
        if x.shape[0] == 0:
            return torch.empty(0, width, dtype=torch.int64, device=x.device)
        local = dcp_local_view(meta, self.dcp_size, self.dcp_rank)
        values, candidates = self.indexer(positions, x, q_resid, index_cache, meta, local=local)
        # NOTE: each rank's top-W of its shard holds its share of the group's top-W.
        all_values = self.dcp_comm.all_gather(values.unsqueeze(0), dim=0)
        all_candidates = self.dcp_comm.all_gather(candidates.unsqueeze(0), dim=0)
        return merge_topk(all_values, all_candidates, width)


class DSADecoderLayer(DecoderLayer):
    """:class:`~flotilla.cluster.models.moe_models.DecoderLayer` that passes the DSA selection on
    to the next layer (IndexShare)."""

    def forward(self, positions, x, residual, kv_cache, meta, selected=None):
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x, selected = self.self_attn(positions, x, kv_cache, meta, selected)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual, selected


class _DSAForCausalLM(MTPHost, _DeepseekForCausalLM):
    """The DSA decoder (see the module docstring); subclasses choose the indexer's RoPE layout.
    The checkpoint's MTP layers (each a full DSA layer) load into the draft module
    (:mod:`~flotilla.cluster.models.mtp`)."""

    indexer_neox = True

    def __init__(self, cfg: ModelConfig):
        super().__init__(
            cfg,
            is_neox=not cfg.get("rope_interleave", True),
            scoring="sigmoid",
            correction_bias=True,
            grouped=True,
        )

    def indexer_types(self) -> tuple[str, ...]:
        """Each layer's indexer mode (``full`` / ``shared``; see the module docstring)."""
        return dsa_indexer_types(self.config.hf, int(self.config.get("num_hidden_layers")))

    def decoder_layer(self, cfg: ModelConfig, index: int, mlp: nn.Module) -> nn.Module:
        types = self.indexer_types()
        # NOTE: an MTP layer's block (past the decoder) runs its own indexer.
        shared = index < len(types) and types[index] == "shared"
        attn = DSAttention(cfg, self.rotary, f"model.layers.{index}.self_attn", shared, self.indexer_neox)
        return DSADecoderLayer(cfg, attn, mlp)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list, meta: AttentionMetadata
    ) -> torch.Tensor:
        x, residual, selected = self.embed_tokens(input_ids), None, None
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            x, residual, selected = layer(positions, x, residual, kv_cache, meta, selected)
        x, _ = self.norm(x, residual)
        return x

    def kv_cache_spec(self) -> KVCacheSpec:
        """Per layer the MLA latent ``(1, kv_lora_rank + qk_rope_head_dim)``, and in the layers
        that run an indexer its keys ``(1, index_head_dim)``: both count in the KV budget and
        travel in a prefill/decode transfer."""
        latent = (1, self.config.get("kv_lora_rank") + self.config.get("qk_rope_head_dim"))
        keys = (1, int(self.config.get("index_head_dim")))
        layers = tuple((latent, keys) if layer.self_attn.indexer is not None else (latent,) for layer in self.layers)
        return KVCacheSpec(
            num_layers=len(self.layers), tensors_per_layer=layers[0], dtype=self.config.dtype, layer_tensors=layers
        )


class DeepseekV32ForCausalLM(_DSAForCausalLM):
    """DeepSeek-V3.2: every layer runs its indexer (unless the config gives a sharing pattern);
    the indexer rotates halves (rotate-half RoPE), MLA interleaved pairs."""

    indexer_neox = True


class GlmMoeDsaForCausalLM(_DSAForCausalLM):
    """GLM-5: IndexShare (``indexer_types``: full or shared per layer); the indexer rotates
    interleaved pairs, like MLA."""

    indexer_neox = False
