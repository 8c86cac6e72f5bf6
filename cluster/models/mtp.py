"""Multi-token prediction (MTP) layers: the checkpoint's next-n layers as a draft module.

DeepSeek-V3/R1/V3.2, GLM-4.5/4.6/4.7 and GLM-5 checkpoints carry ``num_nextn_predict_layers``
layers after the decoder, under the next layer indices (DeepSeek-V3: ``model.layers.61.*``).
Layer ``k`` predicts the token after next from the embedding of the next token and the previous
depth's hidden state:

    h' = eh_proj(cat(enorm(embed(t_next)), hnorm(h)))      # [T, 2H] -> [T, H]
    h' = decoder_block(h')                                   # a full decoder layer (MLA/GQA + MoE)
    logits = lm_head(shared_head.norm(h'))                   # the main model's LM head

as transformers' ``MtpLayer`` computes it (HF 5.24 builds it for DeepSeek-V3 and GLM-4.x). The
checkpoint's per-layer ``embed_tokens`` and ``shared_head.head`` are copies of the main model's
embedding and LM head, which the draft shares; they are not loaded again.

:class:`MTPHost` (a mixin of the models that have MTP layers) routes those tensors, while the
checkpoint streams, into a :class:`MTPDraft` built on the first of them (registered as the model's
``mtp`` module, so it moves and loads like the rest; FP8 layers as the decoder's, other float8
weights dequantized). A checkpoint without them builds no draft. ``--speculative-algorithm
NEXTN`` drafts with it (:mod:`flotilla.cluster.engine.hidden_state_draft`); its experts take no part in
EPLB or elastic EP, and :meth:`MTPDraft.check_loaded` is what start-up verifies: every draft
parameter came from the checkpoint.
"""

from __future__ import annotations

import re
from typing import Any, Iterable

import torch
from torch import nn

from flotilla.cluster.models.base import KVCacheSpec, ModelConfig, ParallelLayout
from flotilla.cluster.models.fp8_dequant import Fp8Pairing
from flotilla.cluster.models.layers import ColumnParallelLinear, default_weight_loader
from flotilla.cluster.models.llama import RMSNorm
from flotilla.kernels.attention import AttentionMetadata

_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
# Per-layer copies of the main model's embedding and LM head (shared, not loaded again).
_SHARED_COPIES = ("embed_tokens.weight", "shared_head.head.weight")
_OWN = ("enorm.", "hnorm.", "eh_proj.")
_HEAD_NORM = "shared_head.norm."


class MTPLayer(nn.Module):
    """One next-n layer around ``block``, a decoder layer built as the main model builds layer
    ``num_hidden_layers + k`` (see the module docstring)."""

    def __init__(self, cfg: ModelConfig, block: nn.Module):
        super().__init__()
        hidden, eps, dtype = cfg.get("hidden_size"), cfg.get("rms_norm_eps", 1e-6), cfg.dtype
        self.enorm = RMSNorm(hidden, eps, dtype, cfg.elementwise_backend)
        self.hnorm = RMSNorm(hidden, eps, dtype, cfg.elementwise_backend)
        # NOTE: replicated on every rank, as the low-rank projections of MLA.
        self.eh_proj = ColumnParallelLinear(2 * hidden, hidden, bias=False, parallel=ParallelLayout(), dtype=dtype)
        self.block = block
        self.shared_head_norm = RMSNorm(hidden, eps, dtype, cfg.elementwise_backend)

    def forward(self, positions, embedded, hidden, kv_cache, meta) -> torch.Tensor:
        x = self.eh_proj(torch.cat([self.enorm(embedded), self.hnorm(hidden)], dim=-1))
        out = self.block(positions, x, None, kv_cache, meta)
        x, residual = out[0], out[1]
        normed, _ = self.shared_head_norm(x, residual)
        return normed


class MTPDraft(nn.Module):
    """The ``count`` MTP layers of ``main`` (checkpoint layers ``first, first + 1, ...``); the
    embedding and LM head are ``main``'s (held as a plain reference, not a submodule)."""

    def __init__(self, main: nn.Module, first: int, count: int):
        super().__init__()
        cfg: ModelConfig = main.config
        self.first, self.count = first, count
        self.layers = nn.ModuleList(MTPLayer(cfg, main.build_layer(cfg, first + k)) for k in range(count))
        object.__setattr__(self, "_main", main)
        self._loaded: set[str] = set()

    # -- loading ---------------------------------------------------------------------------

    def hf_target(self, name: str) -> Any:
        """Our ``(param, shard_id)`` (or a list, or None to skip) for a checkpoint tensor of an
        MTP layer (``model.layers.<first + k>.<rest>``)."""
        match = _LAYER.match(name)
        if match is None or not self.first <= int(match.group(1)) < self.first + self.count:
            raise ValueError(f"{name!r} is not a tensor of MTP layers {self.first}..{self.first + self.count - 1}")
        index, rest = int(match.group(1)), match.group(2)
        k = index - self.first
        if rest in _SHARED_COPIES:
            return None
        if rest.startswith(_OWN):
            return f"layers.{k}.{rest}", None
        if rest.startswith(_HEAD_NORM):
            return f"layers.{k}.shared_head_norm.{rest[len(_HEAD_NORM):]}", None
        where = self._main.layer_target(name)
        block = f"layers.{k}.block."
        found = where if isinstance(where, list) else [where]
        renamed = [(block + target.removeprefix(f"layers.{index}."), shard) for target, shard in found if target]
        return renamed if isinstance(where, list) else renamed[0]

    def loader(self) -> "MTPLoader":
        """A loader for one pass over the checkpoint (see :class:`MTPLoader`)."""
        return MTPLoader(self)

    def check_loaded(self) -> None:
        """ValueError naming the draft parameters no checkpoint tensor filled (an incomplete MTP
        layer: the config's ``num_nextn_predict_layers`` says there are more)."""
        missing = sorted(set(dict(self.named_parameters())) - self._loaded)
        if missing:
            raise ValueError(
                f"the checkpoint's MTP layers are incomplete: {len(missing)} parameter(s) of the draft module got no "
                f"tensor, e.g. {missing[:5]} (config.json says num_nextn_predict_layers={self.count}; checkpoint layers "
                f"{self.first}..{self.first + self.count - 1})"
            )

    # -- the draft's forward ---------------------------------------------------------------

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        kv_caches: list,
        meta: AttentionMetadata,
        layer: int = 0,
    ) -> torch.Tensor:
        """MTP layer ``layer`` over a flattened varlen batch: the embeddings of ``input_ids[T]``
        (the next tokens) and the previous depth's ``hidden[T, H]`` -> the normalised hidden
        state ``[T, H]`` whose logits (:meth:`compute_logits`) predict the token after;
        ``kv_caches[layer]`` is the layer's own paged cache (:meth:`kv_cache_spec`)."""
        embedded = self._main.embed_tokens(input_ids)
        return self.layers[layer](positions, embedded, hidden, kv_caches[layer], meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self._main.compute_logits(hidden)

    def kv_cache_spec(self) -> KVCacheSpec:
        """The draft layers' own cache: per layer what the main model's first layer holds (every
        MTP block is a full attention layer: MLA latent, with indexer keys under DSA; GQA K/V)."""
        main = self._main.kv_cache_spec()
        return KVCacheSpec(num_layers=self.count, tensors_per_layer=main.shapes()[0], dtype=main.dtype)


class MTPLoader:
    """Loads the MTP tensors of one pass over a checkpoint into ``draft`` as they arrive
    (float8 weights of non-FP8 layers paired with their scales and dequantized)."""

    def __init__(self, draft: MTPDraft):
        self.draft = draft
        self.params = dict(draft.named_parameters())
        self.pairing = Fp8Pairing(self._keeps_fp8)

    def _keeps_fp8(self, module: str) -> bool:
        where = self.draft.hf_target(f"{module}.weight_scale_inv")
        if where is None:
            return True
        return any(name in self.params for name, _ in (where if isinstance(where, list) else [where]))

    def push(self, name: str, tensor: torch.Tensor) -> None:
        for hf_name, loaded in self.pairing.push(name, tensor):
            where = self.draft.hf_target(hf_name)
            for target, shard in [] if where is None else where if isinstance(where, list) else [where]:
                param = self.params.get(target)
                if param is None:
                    raise ValueError(f"checkpoint tensor {hf_name!r} matches no parameter of the MTP draft (looked for {target!r})")
                loader = getattr(param, "weight_loader", default_weight_loader)
                loader(param, loaded) if shard is None else loader(param, loaded, shard)
                self.draft._loaded.add(target)

    def finish(self) -> set[str]:
        """The draft parameters loaded (named as the host model's ``mtp.*``)."""
        self.pairing.finish()
        return {f"mtp.{name}" for name in self.draft._loaded}


class MTPHost:
    """Mixin for a model with MTP layers (see the module docstring): its ``load_weights`` sends
    the tensors of layers ``num_hidden_layers ..`` to the draft module ``self.mtp``, built on the
    first of them. Needs ``build_layer(cfg, index)`` (a decoder layer at checkpoint index
    ``index``) and ``layer_target(name)`` (a decoder layer tensor's target, any index). The draft,
    once built, is the submodule ``mtp`` (absent otherwise)."""

    def mtp_layers(self) -> int:
        """``num_nextn_predict_layers`` (0 when the config has none)."""
        return int(self.config.get("num_nextn_predict_layers", 0) or 0)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        first, count = int(self.config.get("num_hidden_layers")), self.mtp_layers()
        loader: MTPLoader | None = None

        def decoder_tensors():
            nonlocal loader
            for name, tensor in weights:
                match = _LAYER.match(name)
                if match is None or int(match.group(1)) < first or count == 0:
                    yield name, tensor
                    continue
                if int(match.group(1)) >= first + count:
                    raise ValueError(
                        f"checkpoint tensor {name!r} belongs to MTP layer {match.group(1)}, but config.json says "
                        f"num_nextn_predict_layers={count} (layers {first}..{first + count - 1})"
                    )
                if loader is None:
                    device = self.embed_tokens.weight.device
                    with torch.device(device):
                        self.mtp = MTPDraft(self, first, count)
                    loader = self.mtp.loader()
                loader.push(name, tensor)

        loaded = super().load_weights(decoder_tensors())
        return loaded if loader is None else loaded | loader.finish()
