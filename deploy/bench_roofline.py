"""The memory roofline of decode: bytes a decode step reads, and the copy bandwidth to divide by.

Model bandwidth utilisation (MBU) of a decode step is

    (weight bytes read + KV bytes read) / step time / peak bandwidth

where the peak is MEASURED in the same run by a device-to-device copy
(:func:`measure_copy_bandwidth`: read + write bytes over the copy time), not a datasheet.

Weight bytes read per decode step (:class:`WeightBytes`, from the checkpoint's tensor shapes):

- every tensor that is not a routed expert or the input embedding table is read once
  (attention, norms, dense MLPs, shared experts, routers, the LM head);
- the input embedding table: only the rows of the step's tokens (a tied table is read
  whole by the LM head, so it counts as dense then);
- routed experts: each MoE layer reads the experts its tokens were routed to. With
  ``B`` tokens, ``E`` experts and top-``k`` routing, the expected number of distinct
  experts under uniform routing is ``E * (1 - (1 - k/E) ** B)`` (each token picks
  ``k`` distinct experts, so an expert escapes one token with probability ``1 - k/E``):
  ``k`` at batch 1, approaching ``E`` as ``B`` grows. Real routers are not uniform
  (they concentrate on fewer experts), so this estimate errs towards more bytes.

``mbu_embedding_counted`` variants count the whole input embedding table as read every
step (the convention of gpt-fast and of the HF peer figures in the H200 notes); the
plain ``mbu`` counts only the rows gathered.

A block-FP8 checkpoint (``quantization_config.quant_method: fp8``) stores each projection it
quantizes in one byte an element plus a float32 scale per 128x128 block; those tensors count
at that size, everything else at the engine's element size.

KV bytes read per decode step: the sum over the step's sequences of their context
length times the cache bytes per token (``KVCacheLayout.bytes_per_token``, at the cache's
own dtype: one byte an element with ``--kv-cache-dtype fp8_e4m3`` or ``fp8_e5m2``).

Under tensor parallelism every figure is the whole model's and the bandwidth is
``tp_size`` devices' (replicated tensors, read by every rank, are not counted again).
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass
from typing import Any, Mapping

# Copy sizes for the bandwidth probe: large enough to leave every cache behind.
DEFAULT_COPY_BYTES = {"cuda": 2 * 2**30, "cpu": 256 * 2**20}
DEFAULT_COPY_ITERS = {"cuda": 20, "cpu": 5}

_EXPERT_COUNT_KEYS = ("num_experts", "n_routed_experts", "num_local_experts")


def expected_distinct_experts(num_experts: int, top_k: int, num_tokens: int) -> float:
    """Expected distinct experts ``num_tokens`` tokens touch in one MoE layer under uniform
    top-``top_k`` routing over ``num_experts`` experts: ``E * (1 - (1 - k/E) ** B)``."""
    if num_experts <= 0 or num_tokens <= 0:
        return 0.0
    k = min(top_k, num_experts)
    return num_experts * (1.0 - (1.0 - k / num_experts) ** num_tokens)


def _is_routed_expert(name: str) -> bool:
    # HF 5 fuses a layer's experts (``mlp.experts.gate_up_proj``); HF 4 names each
    # (``mlp.experts.3.up_proj.weight``). Shared experts are dense: read every step.
    return ".experts." in name and "shared_expert" not in name


def _layer_of(name: str) -> str:
    return name.split(".experts.", 1)[0]


def _stored_bytes(name: str, shape: tuple[int, ...], element_size: int, fp8: Any) -> int:
    """Bytes the running model holds for checkpoint tensor ``name``: ``element_size`` an
    element, or, where the block-FP8 checkpoint ``fp8`` quantizes it, one byte an element plus
    a float32 scale per 128x128 block (transformers' stacked experts: per expert)."""
    from flotilla.cluster.models.dummy_weights import STACKED_EXPERTS
    from flotilla.cluster.models.fp8_config import FP8_BLOCK

    count = math.prod(shape)
    if fp8 is None:
        return count * element_size
    stacked = STACKED_EXPERTS.match(name)
    quantized = fp8.quantizes(f"{stacked.group(1)}.0.gate_proj") if stacked else fp8.quantizes_tensor(name, shape)
    if not quantized:
        return count * element_size
    rows, cols = shape[-2], shape[-1]
    blocks = (count // (rows * cols)) * math.ceil(rows / FP8_BLOCK) * math.ceil(cols / FP8_BLOCK)
    return count + 4 * blocks


@dataclass(frozen=True)
class WeightBytes:
    """Bytes of a model's weights, split by how a decode step reads them.

    Attributes:
        element_size: bytes per weight element (the dtype the engine runs; a block-FP8
            checkpoint's quantized projections count one byte an element plus their scales).
        total: every parameter, once.
        dense: what every decode step reads whole (all but routed experts and an untied
            input embedding table).
        embedding: the untied input embedding table (0 when tied to the LM head).
        embedding_row: one row of that table (hidden size x element size).
        expert: one routed expert of one MoE layer (0 for a dense model).
        moe_layers: layers with routed experts.
        num_experts: routed experts per MoE layer.
        top_k: experts each token is routed to.
    """

    element_size: int
    total: int
    dense: int
    embedding: int
    embedding_row: int
    expert: int
    moe_layers: int
    num_experts: int
    top_k: int

    @classmethod
    def from_config(cls, config_dict: Mapping[str, Any], element_size: int) -> "WeightBytes":
        """From an HF config.json dict (tensor shapes from transformers' model class on the
        meta device, see :func:`~flotilla.cluster.models.dummy_weights.hf_tensor_shapes`)."""
        from flotilla.cluster.models.dummy_weights import hf_tensor_shapes
        from flotilla.cluster.models.fp8_config import BlockFp8Config

        shapes = hf_tensor_shapes(config_dict)
        fp8 = BlockFp8Config.from_hf(config_dict)
        tied = bool(config_dict.get("tie_word_embeddings", False))
        dense = embedding = embedding_row = experts = 0  # bytes
        moe_layers = set()
        for name, shape in shapes.items():
            stored = _stored_bytes(name, shape, element_size, fp8)
            if _is_routed_expert(name):
                experts += stored
                moe_layers.add(_layer_of(name))
            elif name.endswith("embed_tokens.weight") and not tied:
                embedding += stored
                embedding_row = shape[-1] * element_size
            else:
                dense += stored
        num_experts = next((int(config_dict[k]) for k in _EXPERT_COUNT_KEYS if config_dict.get(k)), 0)
        if experts and not num_experts:
            raise ValueError(f"config.json has routed expert tensors but none of {_EXPERT_COUNT_KEYS}")
        per_expert = experts // (len(moe_layers) * num_experts) if experts else 0
        return cls(
            element_size=element_size,
            total=dense + embedding + experts,
            dense=dense,
            embedding=embedding,
            embedding_row=embedding_row,
            expert=per_expert,
            moe_layers=len(moe_layers),
            num_experts=num_experts if experts else 0,
            top_k=int(config_dict.get("num_experts_per_tok") or 0) if experts else 0,
        )

    def experts_read(self, num_tokens: int) -> float:
        """Expected distinct routed experts one MoE layer reads for ``num_tokens`` tokens."""
        return expected_distinct_experts(self.num_experts, self.top_k, num_tokens)

    def per_step(self, num_tokens: int, count_embedding: bool = False) -> float:
        """Expected weight bytes a decode step over ``num_tokens`` tokens (one per sequence)
        reads; ``count_embedding`` counts the whole input embedding table instead of its rows."""
        rows = self.embedding if count_embedding else min(self.embedding, num_tokens * self.embedding_row)
        return self.dense + rows + self.moe_layers * self.experts_read(num_tokens) * self.expert

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["routing_estimate"] = "uniform: E * (1 - (1 - k/E) ** B) distinct experts per MoE layer"
        out["per_step_batch_1"] = self.per_step(1)
        return out


def mbu(bytes_read: float, seconds: float, peak_bytes_per_s: float) -> float | None:
    """``bytes_read / seconds / peak``; None when a term is missing or not positive."""
    if not seconds or seconds <= 0 or not peak_bytes_per_s or peak_bytes_per_s <= 0:
        return None
    return bytes_read / seconds / peak_bytes_per_s


def measure_copy_bandwidth(device: Any, nbytes: int | None = None, iters: int | None = None) -> dict[str, Any]:
    """Peak memory bandwidth of ``device`` as a same-device copy sees it: ``dst.copy_(src)``
    of an ``nbytes`` buffer ``iters`` times after warm-up, counting read + write bytes.

    CUDA is timed with events; CPU with the wall clock (a multi-threaded memcpy). The
    buffers are freed (and the CUDA cache emptied) before returning, so run this before
    the engine sizes its KV cache from free memory."""
    import torch

    device = torch.device(device)
    kind = "cuda" if device.type == "cuda" else "cpu"
    nbytes = int(nbytes or DEFAULT_COPY_BYTES[kind])
    iters = int(iters or DEFAULT_COPY_ITERS[kind])
    if nbytes <= 0 or iters <= 0:
        raise ValueError(f"copy bandwidth: nbytes and iters must be positive (got nbytes={nbytes}, iters={iters})")
    src = torch.ones(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    if kind == "cuda":
        torch.cuda.synchronize(device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            dst.copy_(src)
        end.record()
        end.synchronize()
        seconds = start.elapsed_time(end) / 1e3
    else:
        started = time.perf_counter()
        for _ in range(iters):
            dst.copy_(src)
        seconds = time.perf_counter() - started
    del src, dst
    if kind == "cuda":
        torch.cuda.empty_cache()
    return {
        "method": f"{kind} same-device copy_ of a {nbytes / 2**30:.2f} GiB buffer, read + write bytes",
        "buffer_bytes": nbytes,
        "iters": iters,
        "seconds": seconds,
        "peak_bytes_per_s": 2 * nbytes * iters / seconds,
    }
