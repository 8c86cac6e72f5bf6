"""EAGLE draft heads: a small checkpoint that predicts the next token from the target's
final hidden state and the next token's embedding (Li et al., EAGLE-1; SGLang's and vLLM's
``LlamaForCausalLMEagle`` layout).

The head's config.json is a Llama config (its hidden size the target's, usually one decoder
layer); its tensors are ``fc.weight`` (and ``fc.bias`` when the config says ``bias: true``),
``[H, 2H]`` over ``cat(embed(token), feature)``, and the decoder layers ``layers.<i>.*`` (with or
without a ``model.`` prefix). Layer 0 has no input norm in EAGLE-1 checkpoints (its
``input_layernorm`` is the identity when the checkpoint has none). The output is the residual
stream after the last layer, with no final norm; the target's LM head turns it into logits.
The head shares the target's embedding (a copied ``embed_tokens.weight`` in the checkpoint is
not loaded again). Heads with their own LM head or a reduced vocabulary (EAGLE-3's ``lm_head``
and ``d2t``) are refused: not built.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterable

import torch
from torch import nn

from flotilla.cluster.models.base import KVCacheSpec, ModelConfig
from flotilla.cluster.models.fp8_linear import ParallelLinears
from flotilla.cluster.models.layers import default_weight_loader, kv_heads_per_rank
from flotilla.cluster.models.llama import DecoderLayer, DenseDecoderForCausalLM, _our_name, fused_qkv_prepare
from flotilla.cluster.models.loader import iter_hf_weights
from flotilla.kernels import registry
from flotilla.kernels.attention import AttentionMetadata
from flotilla.kernels.rotary import rope_cache

_NOT_BUILT = ("lm_head.weight", "d2t", "t2d")


class _Identity(nn.Module):
    """Layer 0's input norm in EAGLE-1: none (the fc output goes in as it is)."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden


class EagleHead(nn.Module):
    """An EAGLE-1 head over ``target`` (see the module docstring); ``config`` is the head's own
    :class:`ModelConfig` (its config.json, the target's dtype, device and backends)."""

    def __init__(self, target: nn.Module, config: ModelConfig):
        super().__init__()
        self.config = config
        self.settings = s = DenseDecoderForCausalLM.read_settings(config)
        hidden = s.hidden_size
        self.fc = nn.Linear(2 * hidden, hidden, bias=bool(config.get("bias", False)), dtype=config.dtype)
        attention = registry.get("paged_attention", config.attention_backend)
        self.layers = nn.ModuleList(
            DecoderLayer(s, i, config.parallel, config.dtype, attention, config.elementwise_backend,
                         fused_qkv_prepare(config), ParallelLinears.of(config))
            for i in range(s.num_layers)
        )  # fmt: skip
        self.register_buffer(
            "cos_sin_cache", rope_cache(s.rotary_dim, s.max_position, s.rope_theta, s.rope_scaling), persistent=False
        )
        object.__setattr__(self, "_target", target)  # NOTE: a reference, not a submodule

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor, kv_caches: list, meta: AttentionMetadata
    ) -> torch.Tensor:
        """The head over a flattened varlen batch: the embeddings of ``input_ids[T]`` (the next
        tokens) and the target's ``hidden[T, H]`` -> the predicted feature ``[T, H]``."""
        embedded = self._target.model.embed_tokens(input_ids)
        x, residual = self.fc(torch.cat([embedded, hidden.to(embedded.dtype)], dim=-1)), None
        for layer, kv_cache in zip(self.layers, kv_caches):
            x, residual = layer(positions, x, residual, kv_cache, meta, self.cos_sin_cache)
        return x + residual

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self._target.compute_logits(hidden)

    def kv_cache_spec(self) -> KVCacheSpec:
        s = self.settings
        per_token = (kv_heads_per_rank(s.num_kv_heads, self.config.parallel.tp_size), s.head_dim)
        return KVCacheSpec(num_layers=s.num_layers, tensors_per_layer=(per_token, per_token), dtype=self.config.dtype)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load the head's tensors; ValueError for one it has no place for, or one missing."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for hf_name, tensor in weights:
            name = hf_name.removeprefix("model.")
            if name == "embed_tokens.weight" or name.endswith("rotary_emb.inv_freq"):
                continue  # NOTE: the target's embedding serves the head
            if name in _NOT_BUILT:
                raise ValueError(
                    f"speculative_draft_model_path: the EAGLE head has its own {name!r} (an EAGLE-3 head or a reduced "
                    "vocabulary); flotilla's EAGLE heads use the target's LM head: EAGLE-3 is not built yet"
                )
            target, shard = _our_name(name)
            param = params.get(target)
            if param is None:
                raise ValueError(f"speculative_draft_model_path: checkpoint tensor {hf_name!r} matches no parameter of the EAGLE head")
            loader = getattr(param, "weight_loader", default_weight_loader)
            loader(param, tensor, shard)
            loaded.add(target)
        if "layers.0.input_layernorm.weight" not in loaded:
            self.layers[0].input_layernorm = _Identity()
        missing = sorted(n for n in dict(self.named_parameters()) if n not in loaded)
        if missing:
            raise ValueError(f"speculative_draft_model_path: the EAGLE head checkpoint lacks {len(missing)} tensor(s), e.g. {missing[:5]}")


def load_eagle_head(target: nn.Module, source: Any) -> EagleHead:
    """The EAGLE head at ``source`` (a :class:`ModelSource` directory) over ``target``, on the
    target's device and dtype; ValueError for a head that does not fit the target."""
    if source.kind != "hf_dir":
        raise ValueError(f"speculative_draft_model_path: an EAGLE head is an HF directory, not {source.path}")
    hf = dict(source.config_dict)
    target_config = target.config
    if int(hf.get("hidden_size", 0)) != int(target_config.get("hidden_size")):
        raise ValueError(
            f"speculative_draft_model_path: the EAGLE head's hidden_size {hf.get('hidden_size')} is not the target's "
            f"{target_config.get('hidden_size')}"
        )
    if getattr(getattr(target, "model", None), "embed_tokens", None) is None:
        raise ValueError(f"speculative_draft_model_path: EAGLE heads need a dense decoder target; {type(target).__name__} is not one")
    config = dataclasses.replace(target_config, hf=hf)
    device = target.model.embed_tokens.weight.device
    with torch.device(device):
        head = EagleHead(target, config)
    head.load_weights((name, tensor.to(device)) for name, tensor in iter_hf_weights(source.path))
    return head.eval()
