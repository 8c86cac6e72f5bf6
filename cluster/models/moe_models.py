"""Mixture-of-experts decoders with grouped-query attention: Qwen3-MoE and Mixtral.

Both are Llama-shaped (pre-norm, RoPE, GQA) with the MLP of some or all layers
replaced by routed experts (:class:`~flotilla.cluster.models.moe_layer.FusedMoE`).
The building blocks here (:class:`RMSNorm`, :class:`RotaryEmbedding`, :class:`GatedMLP`,
:func:`load_checkpoint`) are also used by the DeepSeek models.
"""

from __future__ import annotations

import re
from typing import Any, Callable, Iterable

import torch
from torch import nn

from flotilla.cluster.models.base import KVCacheSpec, ModelConfig
from flotilla.cluster.models.fp8_dequant import dequantize_on_load
from flotilla.cluster.models.fp8_linear import ParallelLinears
from flotilla.cluster.models.fp8_moe import routed_experts
from flotilla.cluster.models.layers import (
    ParallelLMHead,
    VocabParallelEmbedding,
    default_weight_loader,
    kv_head_span,
)
from flotilla.cluster.models.llama import RMSNorm, fused_qkv_prepare, uniform_sliding_window
from flotilla.cluster.models.moe_layer import FusedMoE, MoERouter
from flotilla.kernels import registry
from flotilla.kernels.attention import AttentionMetadata, AttentionShape
from flotilla.kernels.rotary import rope_cache


# --------------------------------------------------------------------------- shared building blocks


def rope_settings(cfg: ModelConfig) -> tuple[float, dict[str, Any] | None]:
    """``(rope_theta, scaling)`` from either config spelling: transformers v5's
    ``rope_parameters`` or checkpoint-style ``rope_theta`` + ``rope_scaling``.
    ``scaling`` is None for plain RoPE; scaled variants get
    ``original_max_position_embeddings`` filled in as transformers does."""
    params = dict(cfg.get("rope_parameters") or {})
    scaling = dict(cfg.get("rope_scaling") or {})
    base = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    merged = {**scaling, **params}
    rope_type = merged.get("rope_type", merged.get("type", "default")) or "default"
    if rope_type == "default":
        return base, None
    merged["rope_type"] = rope_type
    merged.setdefault("original_max_position_embeddings", cfg.get("max_position_embeddings"))
    return base, merged


class RotaryEmbedding(nn.Module):
    """A model's RoPE table (one per model, shared by its attention layers); ``backend``
    names the ``rotary_embedding`` kernel."""

    def __init__(
        self,
        rotary_dim: int,
        max_position: int,
        base: float,
        scaling: dict | None,
        is_neox: bool,
        backend: str = "torch",
    ):
        super().__init__()
        self.is_neox = is_neox
        self.register_buffer("cos_sin_cache", rope_cache(rotary_dim, max_position, base, scaling), persistent=False)
        self._op = registry.get("rotary_embedding", backend)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor | None):
        return self._op(positions, q, k, self.cos_sin_cache, is_neox=self.is_neox)


class GatedMLP(nn.Module):
    """``down(silu(gate(x)) * up(x))``; gate and up are one merged column-parallel matrix.
    Used for dense layers and for DeepSeek's shared experts. ``prefix`` is the checkpoint
    module (``model.layers.1.mlp``) whose projections may be block FP8; None: never FP8."""

    def __init__(self, cfg: ModelConfig, hidden_size: int, intermediate_size: int, prefix: str | None = None):
        super().__init__()
        act = cfg.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"hidden_act={act!r} is not supported for this model (supported: 'silu')")
        linears, parallel, dtype = ParallelLinears.of(cfg), cfg.parallel, cfg.dtype
        sizes = [intermediate_size] * 2
        self.gate_up_proj = linears.merged(prefix, ("gate_proj", "up_proj"), hidden_size, sizes, False, parallel, dtype)
        down = None if prefix is None else f"{prefix}.down_proj"
        self.down_proj = linears.row(down, intermediate_size, hidden_size, False, parallel, dtype)
        self._act = registry.get("silu_and_mul", cfg.elementwise_backend)
        # The fused activation + down projection (use_linear_op sets it; None: separate ops).
        self.silu_and_mul_linear = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if self.silu_and_mul_linear is not None:
            return self.down_proj.reduce_partial(self.silu_and_mul_linear(gate_up, self.down_proj.weight, self._act))
        return self.down_proj(self._act(gate_up))


# HF projection name fragment -> (our merged parameter's fragment, shard id).
MLP_STACKED_PARAMS = ((".gate_proj.", ".gate_up_proj.", 0), (".up_proj.", ".gate_up_proj.", 1))
GQA_STACKED_PARAMS = (
    (".self_attn.q_proj.", ".self_attn.qkv_proj.", 0),
    (".self_attn.k_proj.", ".self_attn.qkv_proj.", 1),
    (".self_attn.v_proj.", ".self_attn.qkv_proj.", 2),
    *MLP_STACKED_PARAMS,
)
_EXPERTS = re.compile(r"^(.*\.mlp)\.(experts\..+)$")


def hf_param_target(name: str, stacked: tuple = GQA_STACKED_PARAMS) -> tuple[str, Any]:
    """Our ``(parameter name, shard_id)`` for an HF tensor name: routed experts, the
    ``stacked`` projections (q/k/v, gate/up), everything else by its own name."""
    match = _EXPERTS.match(name)
    if match:
        shard = FusedMoE.checkpoint_shard(match.group(2))
        if shard is not None:
            return f"{match.group(1)}.experts.{shard[0]}", shard[1]
    for old, new, shard_id in stacked:
        if old in name:
            return name.replace(old, new), shard_id
    return name, None


def load_checkpoint(
    model: nn.Module,
    weights: Iterable[tuple[str, torch.Tensor]],
    target: Callable[[str], Any],
) -> set[str]:
    """Load ``(hf_name, tensor)`` pairs through each parameter's ``weight_loader``.

    ``target(hf_name)`` gives ``(param_name, shard_id)``, a list of them (one tensor
    feeding several parameters, e.g. MLA's ``kv_b_proj``), or None to skip the tensor.
    Returns the names of the parameters that received data; raises ValueError for a
    tensor with no matching parameter (a wrong checkpoint or a naming bug).
    """
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    for hf_name, tensor in weights:
        where = target(hf_name)
        if where is None:
            continue
        for name, shard_id in where if isinstance(where, list) else [where]:
            param = params.get(name)
            if param is None:
                raise ValueError(
                    f"checkpoint tensor {hf_name!r} matches no parameter of {type(model).__name__} "
                    f"(looked for {name!r})"
                )
            loader = getattr(param, "weight_loader", default_weight_loader)
            if shard_id is None:
                loader(param, tensor)
            else:
                loader(param, tensor, shard_id)
            loaded.add(name)
    return loaded


# --------------------------------------------------------------------------- GQA attention


class GQAttention(nn.Module):
    """Grouped-query attention over the paged KV cache, with optional per-head q/k RMSNorm
    (Qwen3) and an optional sliding window (Mixtral/Mistral).

    When :func:`~flotilla.cluster.models.llama.fused_qkv_prepare` gives the fused op (flashinfer
    attention and elementwise ops), q/k norm, RoPE and the KV-cache write run as that one op and
    attention is called with ``k=v=None`` (already cached). ``prefix`` is the checkpoint module
    (``model.layers.0.self_attn``) whose projections may be block FP8; None: never FP8.
    ``o_bias``: whether ``o_proj`` has a bias (None: as q/k/v, ``attention_bias``; GLM-4.5 biases
    q/k/v only). The rotary table may rotate fewer dims than a head (partial rotary, GLM-4.x)."""

    def __init__(
        self,
        cfg: ModelConfig,
        rotary: RotaryEmbedding,
        qk_norm: bool,
        sliding_window: int | None,
        prefix: str | None = None,
        o_bias: bool | None = None,
    ):
        super().__init__()
        hidden = cfg.get("hidden_size")
        num_heads = cfg.get("num_attention_heads")
        num_kv_heads = cfg.get("num_key_value_heads", num_heads)
        self.head_dim = cfg.get("head_dim", hidden // num_heads)
        tp = cfg.parallel.tp_size
        if num_heads % tp or num_kv_heads % tp:
            raise ValueError(
                f"num_attention_heads={num_heads} and num_key_value_heads={num_kv_heads} "
                f"must be divisible by tp_size={tp}"
            )
        self.num_heads, self.num_kv_heads = num_heads // tp, num_kv_heads // tp
        bias = bool(cfg.get("attention_bias", False))
        d = self.head_dim
        sizes = [num_heads * d, num_kv_heads * d, num_kv_heads * d]
        linears, parallel, dtype = ParallelLinears.of(cfg), cfg.parallel, cfg.dtype
        self.qkv_proj = linears.merged(prefix, ("q_proj", "k_proj", "v_proj"), hidden, sizes, bias, parallel, dtype)
        o_name = None if prefix is None else f"{prefix}.o_proj"
        o_bias = bias if o_bias is None else o_bias
        self.o_proj = linears.row(o_name, num_heads * d, hidden, o_bias, parallel, dtype)
        eps = cfg.get("rms_norm_eps", 1e-6)
        self.q_norm = RMSNorm(d, eps, cfg.dtype, cfg.elementwise_backend) if qk_norm else None
        self.k_norm = RMSNorm(d, eps, cfg.dtype, cfg.elementwise_backend) if qk_norm else None
        self.rotary = rotary
        self.sliding_window = sliding_window
        self.scale = d**-0.5
        self._attend = registry.get("paged_attention", cfg.attention_backend)
        self._qkv_prepare = fused_qkv_prepare(cfg)

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor, kv_cache: tuple, meta: AttentionMetadata
    ) -> torch.Tensor:
        return self.attend(positions, self.qkv_proj(x), kv_cache, meta)

    def attend(self, positions: torch.Tensor, qkv: torch.Tensor, kv_cache: tuple, meta: AttentionMetadata) -> torch.Tensor:
        """The layer from its q/k/v projection's output on (for a caller that fused the
        projection with the norm before it)."""
        k_cache, v_cache = kv_cache
        if self._qkv_prepare is not None:
            norms = {}
            if self.q_norm is not None:
                norms = dict(q_norm_weight=self.q_norm.weight, k_norm_weight=self.k_norm.weight, eps=self.q_norm.eps)
            cos_sin_cache = self.rotary.cos_sin_cache
            q = self._qkv_prepare(
                qkv, positions, cos_sin_cache, cos_sin_cache.shape[-1], self.rotary.is_neox, k_cache, v_cache,
                meta.slot_mapping, self.num_heads, self.num_kv_heads, **norms,
            )
            out = self._attend(q, None, None, k_cache, v_cache, meta, self.scale, sliding_window=self.sliding_window)
            return self.o_proj(out.reshape(out.shape[0], self.num_heads * self.head_dim))
        q, k, v = self.qkv_proj.split(qkv)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary(positions, q, k)
        out = self._attend(q, k, v, k_cache, v_cache, meta, self.scale, sliding_window=self.sliding_window)
        # NOTE: explicit width: an idle DP-attention rank has 0 tokens, and -1 is ambiguous then.
        return self.o_proj(out.reshape(out.shape[0], self.num_heads * self.head_dim))


# --------------------------------------------------------------------------- decoder


class SparseMoeBlock(nn.Module):
    """Router + routed experts (no shared experts): Qwen3-MoE and Mixtral. ``prefix`` is the
    checkpoint module (``model.layers.0.mlp``) whose experts may be block FP8; None: never FP8
    (the router always stays in the model dtype)."""

    def __init__(
        self,
        cfg: ModelConfig,
        num_experts: int,
        intermediate_size: int,
        renormalize: bool,
        layer_index: int,
        prefix: str | None = None,
    ):
        super().__init__()
        hidden = cfg.get("hidden_size")
        self.gate = MoERouter(hidden, num_experts, dtype=cfg.dtype)
        self.experts = routed_experts(
            cfg,
            None if prefix is None else f"{prefix}.experts",
            num_experts,
            cfg.get("num_experts_per_tok"),
            hidden,
            intermediate_size,
            renormalize=renormalize,
            parallel=cfg.parallel,
            dtype=cfg.dtype,
            backend=cfg.moe_backend,
            num_redundant_experts=cfg.num_redundant_experts,
            placement=cfg.expert_placements.get(layer_index),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.experts(x, self.gate(x))


class DecoderLayer(nn.Module):
    """Pre-norm block: ``x + attn(norm(x))`` then ``x + mlp(norm(x))``, the residual
    stream carried un-normalised between layers (fused into the next RMSNorm)."""

    def __init__(self, cfg: ModelConfig, attn: nn.Module, mlp: nn.Module):
        super().__init__()
        hidden, eps = cfg.get("hidden_size"), cfg.get("rms_norm_eps", 1e-6)
        self.self_attn = attn
        self.mlp = mlp
        self.input_layernorm = RMSNorm(hidden, eps, cfg.dtype, cfg.elementwise_backend)
        self.post_attention_layernorm = RMSNorm(hidden, eps, cfg.dtype, cfg.elementwise_backend)
        # The input norm fused into the q/k/v projection (GQA layers; use_linear_op sets it).
        self.rms_norm_linear = None

    def forward(self, positions, x, residual, kv_cache, meta):
        fused = None
        if self.rms_norm_linear is not None and isinstance(self.self_attn, GQAttention):
            norm, qkv_proj = self.input_layernorm, self.self_attn.qkv_proj
            fused = self.rms_norm_linear(x, residual, norm.weight, norm.eps, qkv_proj.weight, qkv_proj.bias)
        if fused is not None:
            qkv, residual = fused
            x = self.self_attn.attend(positions, qkv, kv_cache, meta)
        else:
            # NOTE: each fused norm may overwrite the x/residual it is given (flashinfer); both
            # are rebound to its outputs and the old tensors are never read again.
            if residual is None:
                residual, x = x, self.input_layernorm(x)
            else:
                x, residual = self.input_layernorm(x, residual)
            x = self.self_attn(positions, x, kv_cache, meta)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class DecoderOnlyLM(nn.Module):
    """Embedding, decoder layers, final norm and LM head: the engine-facing
    :class:`~flotilla.cluster.models.base.Model` shared by the MoE architectures.
    Subclasses build ``self.layers`` and define :meth:`kv_cache_spec`."""

    # Which HF projections are merged into one of our parameters (see hf_param_target).
    stacked_params: tuple = GQA_STACKED_PARAMS

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        vocab, hidden = cfg.get("vocab_size"), cfg.get("hidden_size")
        self.embed_tokens = VocabParallelEmbedding(vocab, hidden, cfg.parallel, cfg.dtype)
        self.norm = RMSNorm(hidden, cfg.get("rms_norm_eps", 1e-6), cfg.dtype, cfg.elementwise_backend)
        self.tie_word_embeddings = bool(cfg.get("tie_word_embeddings", False))
        self.lm_head = ParallelLMHead(vocab, hidden, cfg.parallel, cfg.dtype)
        if self.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.layers = nn.ModuleList()

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list, meta: AttentionMetadata
    ) -> torch.Tensor:
        x, residual = self.embed_tokens(input_ids), None
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            x, residual = layer(positions, x, residual, kv_cache, meta)
        x, _ = self.norm(x, residual)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head.compute_logits(hidden)

    def hf_target(self, name: str) -> tuple[str, Any] | None:
        """Our ``(param, shard_id)`` for HF tensor ``name``, or None to skip it."""
        if name.endswith("rotary_emb.inv_freq") or (self.tie_word_embeddings and name == "lm_head.weight"):
            return None
        return hf_param_target(name.removeprefix("model."), self.stacked_params)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load HF-named tensors (checkpoint per-expert names or transformers' stacked
        in-memory experts); returns the parameter names that were loaded. In a block-FP8
        checkpoint, the float8 weights of modules this model does not keep in FP8 are
        dequantized on the way (:func:`~flotilla.cluster.models.fp8_dequant.dequantize_on_load`)."""
        if self.config.fp8 is not None:
            params = {name for name, _ in self.named_parameters()}
            weights = dequantize_on_load(weights, lambda module: self.keeps_fp8(module, params))
        return load_checkpoint(self, weights, self.hf_target)

    def keeps_fp8(self, module: str, params: set[str]) -> bool:
        """Whether checkpoint module ``module`` (``model.layers.0.mlp.down_proj``) loads into an
        FP8 layer of this model: one whose ``weight_scale_inv`` is among ``params`` (the
        model's parameter names)."""
        where = self.hf_target(f"{module}.weight_scale_inv")
        if where is None:
            return True  # NOTE: a tensor the model skips passes as it is (nothing to dequantize)
        targets = where if isinstance(where, list) else [where]
        return any(name in params for name, _ in targets)


class _GQAMoELM(DecoderOnlyLM):
    def kv_cache_spec(self) -> KVCacheSpec:
        attn = self.layers[0].self_attn
        shape = (attn.num_kv_heads, attn.head_dim)
        return KVCacheSpec(num_layers=len(self.layers), tensors_per_layer=(shape, shape), dtype=self.config.dtype)

    def attention_shape(self) -> AttentionShape:
        """What this rank's attention layers look like (heads after TP sharding; every
        layer alike): see :meth:`flotilla.cluster.models.llama.DenseDecoderForCausalLM.attention_shape`."""
        attn = self.layers[0].self_attn
        windows = [layer.self_attn.sliding_window for layer in self.layers]
        return AttentionShape(
            num_q_heads=attn.num_heads,
            num_kv_heads=attn.num_kv_heads,
            head_dim=attn.head_dim,
            head_dim_v=attn.head_dim,
            scale=attn.scale,
            sliding_window=uniform_sliding_window(windows, type(self).__name__),
            dtype=self.config.dtype,
        )

    def kv_head_span(self) -> tuple[int, int, int]:
        """``(start, count, total)``: the global KV heads this rank's K and V caches hold
        (a contiguous ``num_kv_heads / tp`` slice; :class:`GQAttention` splits them evenly)."""
        cfg = self.config
        total = int(cfg.get("num_key_value_heads", cfg.get("num_attention_heads")))
        return kv_head_span(total, cfg.parallel.tp_size, cfg.parallel.tp_rank)


def _neox_rotary(cfg: ModelConfig) -> "RotaryEmbedding":
    """The neox-style RoPE table of a GQA MoE model (head_dim from the config, or hidden / heads)."""
    base, scaling = rope_settings(cfg)
    head_dim = cfg.get("head_dim", cfg.get("hidden_size") // cfg.get("num_attention_heads"))
    return RotaryEmbedding(
        head_dim, cfg.get("max_position_embeddings"), base, scaling, is_neox=True, backend=cfg.elementwise_backend
    )


class Qwen3MoeForCausalLM(_GQAMoELM):
    """Qwen3-MoE: q/k RMSNorm per head; layer ``i`` is sparse unless it is in
    ``mlp_only_layers`` or ``(i + 1) % decoder_sparse_step != 0``; ``norm_topk_prob``
    renormalises the routing weights. Loads block-FP8 checkpoints (attention, dense MLPs and
    routed experts in FP8; routers in the model dtype)."""

    loads_block_fp8 = True

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        rotary = _neox_rotary(cfg)
        hidden = cfg.get("hidden_size")
        window = cfg.get("sliding_window") if cfg.get("use_sliding_window", False) else None
        num_experts = cfg.get("num_experts", cfg.get("num_local_experts", 0))
        step = cfg.get("decoder_sparse_step", 1)
        dense_only = set(cfg.get("mlp_only_layers", []))
        for i in range(cfg.get("num_hidden_layers")):
            prefix = f"model.layers.{i}"
            if i not in dense_only and num_experts > 0 and (i + 1) % step == 0:
                renormalize = bool(cfg.get("norm_topk_prob", False))
                mlp = SparseMoeBlock(
                    cfg, num_experts, cfg.get("moe_intermediate_size"), renormalize, layer_index=i, prefix=f"{prefix}.mlp"
                )
            else:
                mlp = GatedMLP(cfg, hidden, cfg.get("intermediate_size"), prefix=f"{prefix}.mlp")
            attn = GQAttention(cfg, rotary, qk_norm=True, sliding_window=window, prefix=f"{prefix}.self_attn")
            self.layers.append(DecoderLayer(cfg, attn, mlp))


class MixtralForCausalLM(_GQAMoELM):
    """Mixtral: every layer sparse (``num_local_experts``, weights always renormalised),
    no q/k norm, sliding-window attention when ``sliding_window`` is set."""

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        rotary = _neox_rotary(cfg)
        for i in range(cfg.get("num_hidden_layers")):
            attn = GQAttention(cfg, rotary, qk_norm=False, sliding_window=cfg.get("sliding_window"))
            experts = cfg.get("num_local_experts")
            mlp = SparseMoeBlock(cfg, experts, cfg.get("intermediate_size"), renormalize=True, layer_index=i)
            self.layers.append(DecoderLayer(cfg, attn, mlp))

    def hf_target(self, name: str) -> tuple[str, Any] | None:
        # NOTE: Mixtral checkpoints call the MoE block ``block_sparse_moe``; transformers' module is ``mlp``.
        return super().hf_target(name.replace(".block_sparse_moe.", ".mlp."))
