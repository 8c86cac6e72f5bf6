"""Dense decoder-only transformers of the Llama family, one implementation for
Llama (2, 3 with ``llama3`` RoPE scaling, SmolLM2), Mistral (sliding window),
Qwen2 (q/k/v bias) and Qwen3 (per-head RMSNorm on q and k before RoPE).

The four architectures share one block: pre-norm attention with RoPE and GQA,
then a SiLU-gated MLP. What differs is read from the HF config into
:class:`DecoderSettings`, with the per-architecture defaults declared on each
``*ForCausalLM`` class. Layers are flotilla's parallel-ready ones: q/k/v and
gate/up are stacked in :class:`MergedColumnParallelLinear` projections and loaded
by shard id. Under tensor parallelism each rank holds ``num_heads / tp`` q heads
and ``num_kv_heads / tp`` KV heads (one replicated KV head when ``tp`` exceeds
``num_kv_heads``); o_proj and down_proj all-reduce through ``ParallelLayout.group``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Mapping

import torch
from torch import nn

from flotilla.cluster.models.base import KVCacheSpec, ModelConfig, ParallelLayout
from flotilla.cluster.models.fp8_linear import ParallelLinears
from flotilla.cluster.models.layers import (
    MergedColumnParallelLinear,
    ParallelLMHead,
    VocabParallelEmbedding,
    default_weight_loader,
    kv_head_span,
    kv_heads_per_rank,
)
from flotilla.kernels import registry
from flotilla.kernels.attention import AttentionMetadata, AttentionShape
from flotilla.kernels.rotary import rope_cache

# HF checkpoint parts that are stacked into one of our projections: (hf, ours, shard_id).
_STACKED_PARAMS = (
    ("q_proj", "qkv_proj", 0),
    ("k_proj", "qkv_proj", 1),
    ("v_proj", "qkv_proj", 2),
    ("gate_proj", "gate_up_proj", 0),
    ("up_proj", "gate_up_proj", 1),
)
# Buffers some checkpoints carry that are recomputed here.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")


def rope_settings(hf: Mapping[str, Any], head_dim: int) -> tuple[float, dict | None, int]:
    """``(theta, scaling, rotary_dim)`` from an HF config dict, read as transformers reads it.

    The parameters come from a legacy ``rope_scaling`` dict when present, else from
    transformers 5's ``rope_parameters``; ``rope_theta`` and ``partial_rotary_factor``
    from that dict or the top level. ``scaling`` is None for plain RoPE.
    """
    params = dict(hf.get("rope_scaling") or hf.get("rope_parameters") or {})
    if params and "full_attention" in params and isinstance(params["full_attention"], Mapping):
        params = dict(params["full_attention"])  # per-layer-type parameters: dense layers use full attention
    theta = params.get("rope_theta") or hf.get("rope_theta") or 10000.0
    rope_type = params.get("rope_type", params.get("type")) or "default"
    scaling = None
    if rope_type != "default":
        scaling = {**params, "rope_type": rope_type}
        if rope_type in ("llama3", "yarn", "longrope"):
            # NOTE: as transformers: a top-level original length wins, else max_position_embeddings.
            original = hf.get("original_max_position_embeddings")
            if original:
                scaling["original_max_position_embeddings"] = original
            scaling.setdefault("original_max_position_embeddings", hf.get("max_position_embeddings"))
    factor = params.get("partial_rotary_factor", hf.get("partial_rotary_factor")) or 1.0
    return float(theta), scaling, int(head_dim * factor)


@dataclass(frozen=True)
class DecoderSettings:
    """Everything the decoder's shape and behaviour depend on, read from one HF config.

    ``sliding_windows[i]`` is layer ``i``'s attention window (None: full causal).
    """

    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    sliding_windows: tuple[int | None, ...]
    rope_theta: float
    rope_scaling: dict | None
    rotary_dim: int
    max_position: int
    tie_word_embeddings: bool


class DenseDecoderForCausalLM(nn.Module):
    """The shared decoder; subclasses name an HF architecture and its defaults.

    Implements the :class:`flotilla.cluster.models.base.Model` interface. Loads block-FP8
    checkpoints (the projections of :mod:`~flotilla.cluster.models.fp8_linear`).
    """

    architecture = "LlamaForCausalLM"
    qk_norm = False
    loads_block_fp8 = True

    # --- per-architecture config reading (overridden by subclasses) ---------------

    @classmethod
    def attention_biases(cls, cfg: ModelConfig) -> tuple[bool, bool]:
        """``(qkv_bias, o_bias)``."""
        bias = bool(cfg.get("attention_bias", False))
        return bias, bias

    @classmethod
    def sliding_windows(cls, cfg: ModelConfig, num_layers: int) -> tuple[int | None, ...]:
        """Per-layer attention windows (Llama: none)."""
        return (None,) * num_layers

    @classmethod
    def default_head_dim(cls, cfg: ModelConfig) -> int:
        return cfg.get("hidden_size") // cfg.get("num_attention_heads")

    @classmethod
    def read_settings(cls, cfg: ModelConfig) -> DecoderSettings:
        """Read :class:`DecoderSettings` from ``cfg`` with this architecture's defaults."""
        act = cfg.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"{cls.architecture} supports hidden_act='silu' only, got hidden_act={act!r}")
        num_layers = int(cfg.get("num_hidden_layers"))
        num_heads = int(cfg.get("num_attention_heads"))
        head_dim = int(cfg.get("head_dim") or cls.default_head_dim(cfg))
        theta, scaling, rotary_dim = rope_settings(cfg.hf, head_dim)
        qkv_bias, o_bias = cls.attention_biases(cfg)
        return DecoderSettings(
            hidden_size=int(cfg.get("hidden_size")),
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=int(cfg.get("num_key_value_heads", num_heads)),
            head_dim=head_dim,
            intermediate_size=int(cfg.get("intermediate_size")),
            vocab_size=int(cfg.get("vocab_size")),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            qkv_bias=qkv_bias,
            o_bias=o_bias,
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            qk_norm=cls.qk_norm,
            sliding_windows=cls.sliding_windows(cfg, num_layers),
            rope_theta=theta,
            rope_scaling=scaling,
            rotary_dim=rotary_dim,
            max_position=int(cfg.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        )

    # --- the Model interface ------------------------------------------------------

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.settings = s = self.read_settings(config)
        self.model = DecoderModel(
            s,
            config.parallel,
            config.dtype,
            registry.get("paged_attention", config.attention_backend),
            config.elementwise_backend,
            fused_qkv_prepare(config),
            ParallelLinears.of(config),
        )
        self.lm_head = ParallelLMHead(s.vocab_size, s.hidden_size, config.parallel, config.dtype)
        if s.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list, meta: AttentionMetadata
    ) -> torch.Tensor:
        """Hidden states ``[T, H]`` of a flattened varlen batch; writes the new K/V into ``kv_caches``."""
        return self.model(input_ids, positions, kv_caches, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[N, V]`` float32 logits of the given hidden rows."""
        return self.lm_head.compute_logits(hidden)

    def kv_cache_spec(self) -> KVCacheSpec:
        """K and V per layer, each ``(num_kv_heads on this rank, head_dim)`` per token."""
        s = self.settings
        per_token = (kv_heads_per_rank(s.num_kv_heads, self.config.parallel.tp_size), s.head_dim)
        return KVCacheSpec(num_layers=s.num_layers, tensors_per_layer=(per_token, per_token), dtype=self.config.dtype)

    def attention_shape(self) -> AttentionShape:
        """What this rank's attention layers look like (heads after TP sharding; every
        layer alike). ValueError for a model whose layers use different sliding windows
        (one attention plan per step serves every layer)."""
        s = self.settings
        attn = self.model.layers[0].self_attn
        return AttentionShape(
            num_q_heads=attn.num_heads,
            num_kv_heads=attn.num_kv_heads,
            head_dim=s.head_dim,
            head_dim_v=s.head_dim,
            scale=attn.scale,
            sliding_window=uniform_sliding_window(s.sliding_windows, self.architecture),
            dtype=self.config.dtype,
        )

    def kv_head_span(self) -> tuple[int, int, int]:
        """``(start, count, total)``: the global KV heads this rank's K and V caches hold
        (axis 2 of each cache tensor), see :func:`~flotilla.cluster.models.layers.kv_head_span`."""
        parallel = self.config.parallel
        return kv_head_span(self.settings.num_kv_heads, parallel.tp_size, parallel.tp_rank)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load HF-named tensors (``model.layers.N.self_attn.q_proj.weight``, ...).

        q/k/v and gate/up go into their merged projections by shard id; with tied
        embeddings ``lm_head.weight`` is skipped. Raises ValueError for a tensor with
        no matching parameter, and for parameters the checkpoint never provided.
        """
        params = dict(self.named_parameters())  # NOTE: a tied lm_head appears once, as the embedding
        expected = self._expected_loads(params)
        loaded = set()
        for hf_name, tensor in weights:
            if hf_name.endswith(_IGNORED_SUFFIXES):
                continue
            if hf_name == "lm_head.weight" and self.settings.tie_word_embeddings:
                continue
            target, shard = _our_name(hf_name)
            param = params.get(target)
            if param is None:
                raise ValueError(
                    f"checkpoint tensor {hf_name!r} matches no parameter of {type(self).__name__} "
                    f"(is the checkpoint's architecture {self.architecture}?)"
                )
            loader = getattr(param, "weight_loader", default_weight_loader)
            loader(param, tensor, shard)
            loaded.add((target, shard))
        missing = sorted(f"{n}" + ("" if s is None else f"[shard {s}]") for n, s in expected - loaded)
        if missing:
            raise ValueError(
                f"checkpoint is missing {len(missing)} weight(s) of {type(self).__name__}, e.g. {missing[:5]}; "
                "check that the checkpoint matches config.json (tie_word_embeddings, attention_bias, layer count)"
            )

    def _expected_loads(self, params: Mapping[str, nn.Parameter]) -> set[tuple[str, int | None]]:
        """Every ``(parameter, shard_id)`` a complete checkpoint provides."""
        expected = set()
        for module_name, module in self.named_modules():
            shards = range(len(module.output_sizes)) if isinstance(module, MergedColumnParallelLinear) else (None,)
            for param_name, _ in module.named_parameters(recurse=False):
                full = f"{module_name}.{param_name}" if module_name else param_name
                if full in params:
                    expected.update((full, shard) for shard in shards)
        return expected


def _our_name(hf_name: str) -> tuple[str, int | None]:
    """Our parameter name and shard id for an HF checkpoint name."""
    for hf_part, ours, shard in _STACKED_PARAMS:
        token = f".{hf_part}."
        if token in hf_name:
            return hf_name.replace(token, f".{ours}."), shard
    return hf_name, None


class LlamaForCausalLM(DenseDecoderForCausalLM):
    """Llama 2/3 (incl. ``llama3`` RoPE scaling) and SmolLM2; ``attention_bias`` / ``mlp_bias`` as configured."""

    architecture = "LlamaForCausalLM"


class MistralForCausalLM(DenseDecoderForCausalLM):
    """Mistral: no biases; ``sliding_window`` (when set) applies to every layer."""

    architecture = "MistralForCausalLM"

    @classmethod
    def attention_biases(cls, cfg: ModelConfig) -> tuple[bool, bool]:
        return False, False

    @classmethod
    def sliding_windows(cls, cfg: ModelConfig, num_layers: int) -> tuple[int | None, ...]:
        window = cfg.get("sliding_window")
        return (int(window) if window else None,) * num_layers


def _qwen_sliding_windows(cfg: ModelConfig, num_layers: int) -> tuple[int | None, ...]:
    """Qwen2/Qwen3: ``layer_types`` when given, else ``use_sliding_window`` from
    ``max_window_layers`` on (as transformers derives ``layer_types``)."""
    window = cfg.get("sliding_window") if cfg.get("use_sliding_window", False) else None
    types = cfg.get("layer_types")
    if types is None:
        first = int(cfg.get("max_window_layers", num_layers))
        types = ["sliding_attention" if window and i >= first else "full_attention" for i in range(num_layers)]
    if len(types) != num_layers:
        raise ValueError(f"layer_types has {len(types)} entries but num_hidden_layers={num_layers}")
    return tuple(int(window) if t == "sliding_attention" and window else None for t in types)


class Qwen2ForCausalLM(DenseDecoderForCausalLM):
    """Qwen2 / Qwen2.5: bias on q/k/v (not on o)."""

    architecture = "Qwen2ForCausalLM"

    @classmethod
    def attention_biases(cls, cfg: ModelConfig) -> tuple[bool, bool]:
        return True, False

    @classmethod
    def sliding_windows(cls, cfg: ModelConfig, num_layers: int) -> tuple[int | None, ...]:
        return _qwen_sliding_windows(cfg, num_layers)


class Qwen3ForCausalLM(DenseDecoderForCausalLM):
    """Qwen3 dense: per-head RMSNorm of q and k before RoPE; ``head_dim`` defaults to 128."""

    architecture = "Qwen3ForCausalLM"
    qk_norm = True

    @classmethod
    def default_head_dim(cls, cfg: ModelConfig) -> int:
        return 128

    @classmethod
    def sliding_windows(cls, cfg: ModelConfig, num_layers: int) -> tuple[int | None, ...]:
        return _qwen_sliding_windows(cfg, num_layers)


# --- building blocks --------------------------------------------------------------


def fused_qkv_prepare(config: ModelConfig):
    """The fused ``qkv_prepare`` op (Triton: q/k norm, RoPE and the KV-cache write in one
    launch) when attention and the elementwise ops both run on flashinfer (CUDA, fp16/bf16),
    else None: the separate norm, rotary and attention-writes-KV ops, as on the torch path."""
    if config.attention_backend == "flashinfer" and config.elementwise_backend == "flashinfer":
        return registry.get("qkv_prepare", "triton")
    return None


def uniform_sliding_window(windows: Iterable[int | None], architecture: str) -> int | None:
    """The one sliding window every layer uses (None: full attention); ValueError when
    the layers differ, which one per-step attention plan cannot serve."""
    distinct = set(windows)
    if len(distinct) > 1:
        raise ValueError(
            f"{architecture} uses different attention windows per layer ({sorted(distinct, key=str)}); "
            "the attention planner needs one window for every layer: use the torch attention backend"
        )
    return next(iter(distinct), None)


class RMSNorm(nn.Module):
    """RMSNorm over the last dimension; ``forward(x, residual)`` fuses the residual add
    and returns ``(normed, new_residual)`` (see ``kernels/norm.py``).

    NOTE: with ``residual`` the ``flashinfer`` backend writes its outputs into ``x`` and
    ``residual`` (see ``kernels/flashinfer_ops.py``): callers pass tensors they replace with
    the returned pair and never read again.
    """

    def __init__(self, dim: int, eps: float, dtype: torch.dtype = torch.float32, backend: str = "torch"):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype), requires_grad=False)
        self.weight.weight_loader = default_weight_loader  # type: ignore[attr-defined]
        self._op = registry.get("rms_norm", backend)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        return self._op(x, self.weight, self.eps, residual)


class DecoderAttention(nn.Module):
    """Self-attention of one layer: merged q/k/v projection, optional q/k norm, RoPE,
    paged attention (optionally windowed), output projection.

    With ``qkv_prepare_op`` (see :func:`fused_qkv_prepare`) the norm, RoPE and KV-cache
    write run as that one op and attention is called with ``k=v=None`` (already cached).
    """

    def __init__(
        self,
        s: DecoderSettings,
        layer: int,
        parallel: ParallelLayout,
        dtype: torch.dtype,
        attention_op,
        backend: str,
        qkv_prepare_op=None,
        linears: ParallelLinears = ParallelLinears(),
    ):
        super().__init__()
        prefix = f"model.layers.{layer}.self_attn"
        self.qkv_proj = linears.qkv(
            prefix, s.hidden_size, s.head_dim, s.num_heads, s.num_kv_heads, s.qkv_bias, parallel, dtype
        )
        self.num_heads, self.num_kv_heads, self.head_dim = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads, s.head_dim
        self.rotary_dim = s.rotary_dim
        self.scale = s.head_dim**-0.5
        self.sliding_window = s.sliding_windows[layer]
        self.o_proj = linears.row(f"{prefix}.o_proj", s.num_heads * s.head_dim, s.hidden_size, s.o_bias, parallel, dtype)
        self.q_norm = RMSNorm(s.head_dim, s.rms_norm_eps, dtype, backend) if s.qk_norm else None
        self.k_norm = RMSNorm(s.head_dim, s.rms_norm_eps, dtype, backend) if s.qk_norm else None
        self._attention = attention_op
        self._rotary = registry.get("rotary_embedding", backend)
        self._qkv_prepare = qkv_prepare_op

    def forward(
        self,
        positions: torch.Tensor,
        x: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
        cos_sin_cache: torch.Tensor,
    ) -> torch.Tensor:
        return self.attend(positions, self.qkv_proj(x), kv_cache, meta, cos_sin_cache)

    def attend(
        self,
        positions: torch.Tensor,
        qkv: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
        cos_sin_cache: torch.Tensor,
    ) -> torch.Tensor:
        """The layer from its q/k/v projection's output on (for a caller that fused the
        projection with the norm before it)."""
        tokens = qkv.shape[0]
        k_cache, v_cache = kv_cache
        if self._qkv_prepare is not None:
            norms = {}
            if self.q_norm is not None:
                norms = dict(q_norm_weight=self.q_norm.weight, k_norm_weight=self.k_norm.weight, eps=self.q_norm.eps)
            q = self._qkv_prepare(
                qkv, positions, cos_sin_cache, self.rotary_dim, True, k_cache, v_cache, meta.slot_mapping,
                self.num_heads, self.num_kv_heads, **norms,
            )
            out = self._attention(q, None, None, k_cache, v_cache, meta, self.scale, self.sliding_window)
            return self.o_proj(out.reshape(tokens, self.num_heads * self.head_dim))
        q, k, v = self.qkv_proj.split(qkv)
        q = q.view(tokens, self.num_heads, self.head_dim)
        k = k.view(tokens, self.num_kv_heads, self.head_dim)
        v = v.view(tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self._rotary(positions, q, k, cos_sin_cache, self.rotary_dim, True)
        out = self._attention(q, k, v, k_cache, v_cache, meta, self.scale, self.sliding_window)
        return self.o_proj(out.reshape(tokens, self.num_heads * self.head_dim))


class GatedMLP(nn.Module):
    """``down(silu(gate(x)) * up(x))`` with gate and up stacked; ``prefix`` is the checkpoint
    module (``model.layers.0.mlp``) whose projections ``linears`` may build in FP8."""

    def __init__(
        self,
        hidden: int,
        intermediate: int,
        bias: bool,
        parallel: ParallelLayout,
        dtype: torch.dtype,
        backend: str,
        linears: ParallelLinears = ParallelLinears(),
        prefix: str | None = None,
    ):
        super().__init__()
        parts = ("gate_proj", "up_proj")
        self.gate_up_proj = linears.merged(prefix, parts, hidden, [intermediate, intermediate], bias, parallel, dtype)
        down = None if prefix is None else f"{prefix}.down_proj"
        self.down_proj = linears.row(down, intermediate, hidden, bias, parallel, dtype)
        self._act = registry.get("silu_and_mul", backend)
        # The fused activation + down projection (use_linear_op sets it; None: separate ops).
        self.silu_and_mul_linear = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.gate_up_proj(x))

    def down(self, gate_up: torch.Tensor) -> torch.Tensor:
        """The block from the gate/up projection's output on."""
        if self.silu_and_mul_linear is not None:
            return self.down_proj.reduce_partial(self.silu_and_mul_linear(gate_up, self.down_proj.weight, self._act))
        return self.down_proj(self._act(gate_up))


class DecoderLayer(nn.Module):
    """Pre-norm attention and MLP blocks with the residual stream carried separately."""

    def __init__(
        self,
        s: DecoderSettings,
        layer: int,
        parallel: ParallelLayout,
        dtype: torch.dtype,
        attention_op,
        backend: str,
        qkv_prepare_op=None,
        linears: ParallelLinears = ParallelLinears(),
    ):
        super().__init__()
        self.self_attn = DecoderAttention(s, layer, parallel, dtype, attention_op, backend, qkv_prepare_op, linears)
        mlp = (s.hidden_size, s.intermediate_size, s.mlp_bias, parallel, dtype, backend)
        self.mlp = GatedMLP(*mlp, linears, prefix=f"model.layers.{layer}.mlp")
        self.input_layernorm = RMSNorm(s.hidden_size, s.rms_norm_eps, dtype, backend)
        self.post_attention_layernorm = RMSNorm(s.hidden_size, s.rms_norm_eps, dtype, backend)
        # A norm fused into the projection after it (use_linear_op sets it; None: separate ops).
        self.rms_norm_linear = None

    def forward(self, positions, hidden, residual, kv_cache, meta, cos_sin_cache):
        if self.rms_norm_linear is not None:
            fused = self._forward_fused(positions, hidden, residual, kv_cache, meta, cos_sin_cache)
            if fused is not None:
                return fused
        # NOTE: each fused norm may overwrite the hidden/residual it is given (flashinfer);
        # both are rebound to its outputs and the old tensors are never read again.
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden, kv_cache, meta, cos_sin_cache)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual

    def _forward_fused(self, positions, hidden, residual, kv_cache, meta, cos_sin_cache):
        """The layer with each norm fused into the projection after it (q/k/v; gate/up), for
        the inputs the fused op takes (one row); None for the others."""
        norm, attn = self.input_layernorm, self.self_attn
        out = self.rms_norm_linear(hidden, residual, norm.weight, norm.eps, attn.qkv_proj.weight, attn.qkv_proj.bias)
        if out is None:
            return None
        qkv, residual = out
        hidden = attn.attend(positions, qkv, kv_cache, meta, cos_sin_cache)
        # NOTE: hidden is o_proj's fresh one-row output, so this call takes it too.
        norm, gate_up = self.post_attention_layernorm, self.mlp.gate_up_proj
        gate_up_out, residual = self.rms_norm_linear(hidden, residual, norm.weight, norm.eps, gate_up.weight, gate_up.bias)
        return self.mlp.down(gate_up_out), residual


class DecoderModel(nn.Module):
    """Embedding, decoder layers and the final norm (HF's ``model.*`` prefix);
    ``elementwise_backend`` names the kernels of the norms, RoPE and activations;
    ``qkv_prepare_op`` (None: separate ops) fuses each layer's q/k norm, RoPE and KV write;
    ``linears`` builds the projections (block FP8 where the checkpoint quantizes them)."""

    def __init__(
        self,
        s: DecoderSettings,
        parallel: ParallelLayout,
        dtype: torch.dtype,
        attention_op,
        elementwise_backend: str = "torch",
        qkv_prepare_op=None,
        linears: ParallelLinears = ParallelLinears(),
    ):
        super().__init__()
        backend = elementwise_backend
        self.embed_tokens = VocabParallelEmbedding(s.vocab_size, s.hidden_size, parallel, dtype)
        self.layers = nn.ModuleList(
            DecoderLayer(s, i, parallel, dtype, attention_op, backend, qkv_prepare_op, linears)
            for i in range(s.num_layers)
        )
        self.norm = RMSNorm(s.hidden_size, s.rms_norm_eps, dtype, backend)
        # NOTE: float32 and shared by every layer; the rotary op casts cos/sin to the
        # activation dtype, as HF does.
        self.register_buffer(
            "cos_sin_cache", rope_cache(s.rotary_dim, s.max_position, s.rope_theta, s.rope_scaling), persistent=False
        )

    def forward(self, input_ids, positions, kv_caches, meta):
        if len(kv_caches) != len(self.layers):
            raise ValueError(f"got {len(kv_caches)} KV caches for {len(self.layers)} layers")
        hidden, residual = self.embed_tokens(input_ids), None
        for layer, kv_cache in zip(self.layers, kv_caches):
            hidden, residual = layer(positions, hidden, residual, kv_cache, meta, self.cos_sin_cache)
        hidden, _ = self.norm(hidden, residual)
        return hidden
