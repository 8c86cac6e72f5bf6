"""GLM-4.5 / 4.6 / 4.7 (``Glm4MoeForCausalLM``): grouped-query attention with partial rotary and
optional q/k RMSNorm, DeepSeek-V3-style MoE.

- Attention: GQA over the paged K/V cache; q/k/v carry a bias when ``attention_bias`` (``o_proj``
  never does); ``use_qk_norm`` adds a per-head RMSNorm of q and k before RoPE; RoPE is the neox
  (rotate-half) layout on the first ``head_dim * partial_rotary_factor`` dims of each head
  (``partial_rotary_factor`` 0.5 by default, as transformers reads GLM-4.x configs).
- MLP: the first ``first_k_dense_replace`` layers are dense; the rest route with sigmoid scores,
  ``e_score_correction_bias`` for the choice, group-limited over ``n_group`` / ``topk_group``,
  renormalised (``norm_topk_prob``), scaled by ``routed_scaling_factor``, plus
  ``n_shared_experts`` always-on experts (:class:`~flotilla.cluster.models.deepseek.DeepseekMoE`).
- Loads block-FP8 checkpoints (GLM-4.5-FP8: projections, shared and routed experts in FP8).
- The ``num_nextn_predict_layers`` MTP layers after the decoder load into the draft module
  (:mod:`~flotilla.cluster.models.mtp`).
"""

from __future__ import annotations

import re

from flotilla.cluster.models.base import ModelConfig
from flotilla.cluster.models.deepseek import DeepseekMoE
from flotilla.cluster.models.llama import rope_settings as dense_rope_settings
from flotilla.cluster.models.mtp import MTPHost
from flotilla.cluster.models.moe_models import (
    GQA_STACKED_PARAMS,
    DecoderLayer,
    GatedMLP,
    GQAttention,
    RotaryEmbedding,
    _GQAMoELM,
)

# transformers' default for GLM-4.x configs that do not say (``Glm4MoeConfig.__post_init__``).
DEFAULT_PARTIAL_ROTARY_FACTOR = 0.5
_LAYER_INDEX = re.compile(r"^(?:model\.)?layers\.(\d+)\.")


def glm4_rotary(cfg: ModelConfig) -> RotaryEmbedding:
    """GLM-4.x's neox RoPE table over the rotated part of a head (``head_dim * partial_rotary_factor``)."""
    head_dim = int(cfg.get("head_dim") or cfg.get("hidden_size") // cfg.get("num_attention_heads"))
    hf = dict(cfg.hf)
    params = dict(hf.get("rope_parameters") or {})
    if "partial_rotary_factor" not in params and hf.get("partial_rotary_factor") is None:
        hf["partial_rotary_factor"] = DEFAULT_PARTIAL_ROTARY_FACTOR
    theta, scaling, rotary_dim = dense_rope_settings(hf, head_dim)
    return RotaryEmbedding(
        rotary_dim, cfg.get("max_position_embeddings"), theta, scaling, is_neox=True, backend=cfg.elementwise_backend
    )


class Glm4MoeForCausalLM(MTPHost, _GQAMoELM):
    """GLM-4.5/4.6/4.7 (see the module docstring)."""

    loads_block_fp8 = True
    stacked_params = GQA_STACKED_PARAMS

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        self.rotary = glm4_rotary(cfg)
        self.num_layers = int(cfg.get("num_hidden_layers"))
        for i in range(self.num_layers):
            self.layers.append(self.build_layer(cfg, i))

    def build_layer(self, cfg: ModelConfig, index: int) -> DecoderLayer:
        """Decoder layer ``index`` (a checkpoint index: past the last decoder layer, an MTP
        layer's block)."""
        prefix = f"model.layers.{index}"
        if cfg.get("n_routed_experts") and index >= int(cfg.get("first_k_dense_replace", 1)):
            mlp = DeepseekMoE(cfg, "sigmoid", correction_bias=True, grouped=True, layer_index=index, prefix=f"{prefix}.mlp")
        else:
            mlp = GatedMLP(cfg, cfg.get("hidden_size"), cfg.get("intermediate_size"), prefix=f"{prefix}.mlp")
        qk_norm = bool(cfg.get("use_qk_norm", False))
        attn = GQAttention(cfg, self.rotary, qk_norm=qk_norm, sliding_window=None, prefix=f"{prefix}.self_attn", o_bias=False)
        return DecoderLayer(cfg, attn, mlp)

    def hf_target(self, name: str):
        layer = _LAYER_INDEX.match(name)
        if layer and int(layer.group(1)) >= self.num_layers:
            return None  # MTP layers the config does not count (MTPHost loads those it does)
        return self.layer_target(name)

    def layer_target(self, name: str):
        """:meth:`hf_target` for a tensor of any decoder layer index (MTP blocks included)."""
        return super().hf_target(name)
