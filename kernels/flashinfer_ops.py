"""flashinfer backends of the elementwise ops (``rms_norm``, ``rotary_embedding``,
``silu_and_mul``) and of token sampling (``sample_tokens``).

Importing this module imports flashinfer (registry: backend ``"flashinfer"``); a machine
without it cannot load the backend, which the registry reports as "not available".

Each elementwise op has the torch reference's exact signature and falls back to that
reference for inputs its kernel does not take: CPU tensors, float32 (flashinfer's kernels
are fp16/bf16 only), zero tokens (a zero-size grid is a launch error), odd head dims,
misaligned views. The choice reads only shapes, dtypes, strides and pointers, never tensor
values, so every op here except ``sample_tokens`` is CUDA-graph capturable: no host sync,
no allocation whose size depends on values.

Numerics against the torch references (float32 math inside the kernels in both):

- ``rms_norm``: flashinfer multiplies by the weight before rounding to the model dtype, the
  reference after; with ``residual`` the kernel normalises the float32 sum where the
  reference normalises the sum rounded to the dtype. Differences are a few bf16 ulps.
- ``rotary_embedding``: same cos/sin cache layout and pair conventions (``is_neox`` halves,
  else adjacent pairs kept interleaved); cos/sin stay float32 in the kernel, the reference
  casts them to the activation dtype first.
- ``silu_and_mul``: one rounding instead of two.

NOTE: ``rms_norm`` with ``residual`` is IN PLACE (flashinfer's fused add): it overwrites
``x`` with the normalised output and ``residual`` with ``x + residual``, and returns those
two tensors. Callers pass tensors they no longer need (the decoder layers' running
``hidden, residual = norm(hidden, residual)``); the returned values equal the reference's.
"""

from __future__ import annotations

import os

import torch

# NOTE: flashinfer's norm package prefers CuTe-DSL kernels when nvidia-cutlass-dsl imports
# and falls back to its CUDA JIT kernels otherwise; this switch (read once, when flashinfer
# is first imported) pins the CUDA JIT kernels, whose JIT cache we pre-build and ship.
os.environ.setdefault("FLASHINFER_USE_CUDA_NORM", "1")

import flashinfer.activation as _fi_activation  # noqa: E402
import flashinfer.norm as _fi_norm  # noqa: E402
import flashinfer.rope as _fi_rope  # noqa: E402
import flashinfer.sampling as _fi_sampling  # noqa: E402

from flotilla.kernels.activation import silu_and_mul as _torch_silu_and_mul  # noqa: E402
from flotilla.kernels.norm import rms_norm as _torch_rms_norm  # noqa: E402
from flotilla.kernels.registry import register  # noqa: E402
from flotilla.kernels.rotary import rotary_embedding as _torch_rotary_embedding  # noqa: E402

_HALF_DTYPES = (torch.float16, torch.bfloat16)
# Head dims flashinfer's RoPE kernels are compiled for (DISPATCH_HEAD_DIM).
_ROPE_HEAD_DIMS = (64, 128, 256)
# flashinfer's vectorised loads are 16 bytes wide.
_VECTOR_BYTES = 16


def _is_aligned(t: torch.Tensor) -> bool:
    """16-byte aligned start and row strides, unit stride in the last dim (what the
    vectorised kernels load)."""
    if t.stride(-1) != 1 or t.data_ptr() % _VECTOR_BYTES:
        return False
    size = t.element_size()
    return all((stride * size) % _VECTOR_BYTES == 0 for dim, stride in enumerate(t.stride()[:-1]) if t.shape[dim] > 1)


def _on_cuda(t: torch.Tensor) -> bool:
    return t.is_cuda


def _takes_half(*tensors: torch.Tensor) -> bool:
    """All on one CUDA device, all fp16/bf16 of one dtype, none empty."""
    first = tensors[0]
    return (
        _on_cuda(first)
        and first.dtype in _HALF_DTYPES
        and first.numel() > 0
        and all(t.device == first.device and t.dtype == first.dtype for t in tensors[1:])
    )


# --------------------------------------------------------------------------- RMSNorm


@register("rms_norm", "flashinfer")
def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm with the torch reference's signature (see ``kernels/norm.py``).

    Without ``residual``: ``flashinfer.norm.rmsnorm`` into a new tensor (``x`` untouched);
    2-D ``[T, H]`` and 3-D ``[T, heads, D]`` inputs (q/k norm) keep their strides.

    With ``residual``: ``flashinfer.norm.fused_add_rmsnorm``, IN PLACE: ``x`` becomes the
    normalised output and ``residual`` becomes ``x + residual``; returns ``(x, residual)``
    (see the module docstring). Inputs the kernel does not take go to the reference.
    """
    hidden = x.shape[-1]
    usable = _takes_half(x, weight) and weight.shape == (hidden,) and weight.is_contiguous()
    if residual is None:
        if not usable or x.dim() not in (2, 3) or not _is_aligned(x):
            return _torch_rms_norm(x, weight, eps)
        return _fi_norm.rmsnorm(x, weight, eps, out=torch.empty(x.shape, dtype=x.dtype, device=x.device))
    if (
        not usable
        or not _takes_half(x, residual)
        or residual.shape != x.shape
        or x.dim() != 2
        or not (_is_aligned(x) and _is_aligned(residual))
        or x.data_ptr() == residual.data_ptr()
    ):
        return _torch_rms_norm(x, weight, eps, residual)
    _fi_norm.fused_add_rmsnorm(x, residual, weight, eps)
    return x, residual


# --------------------------------------------------------------------------- RoPE


def _rope_fits(q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor, rotary_dim: int) -> bool:
    """Whether flashinfer's cos/sin-cache RoPE kernel takes these inputs as they are."""
    head_dim = q.shape[-1]
    return (
        _takes_half(q, k)
        and q.dim() == 3
        and k.dim() in (2, 3)
        and k.shape[0] == q.shape[0]
        and k.shape[-1] == head_dim
        and head_dim in _ROPE_HEAD_DIMS
        # NOTE: each thread rotates 8 contiguous elements (16 bytes) that must lie in one
        # half of the rotated block, so the rotated width is a multiple of 16.
        and rotary_dim % 16 == 0
        and rotary_dim <= head_dim
        and cos_sin_cache.dtype == torch.float32
        and cos_sin_cache.device == q.device
        and cos_sin_cache.is_contiguous()
        and _is_aligned(q)
        and _is_aligned(k)
    )


@register("rotary_embedding", "flashinfer")
def rotary_embedding(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor | None,
    cos_sin_cache: torch.Tensor,
    rotary_dim: int | None = None,
    is_neox: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """RoPE with the torch reference's signature (see ``kernels/rotary.py``); returns new
    ``(q, k)`` and leaves the inputs untouched.

    ``flashinfer.rope.apply_rope_with_cos_sin_cache``: its cache is ours (``[max_position,
    rotary_dim]`` float32, cos half then sin half), the rotated width is the cache width, the
    dims past it are copied through (partial rotary), ``is_neox=False`` rotates adjacent
    pairs and keeps them interleaved (as the reference does). ``q`` is ``[T, Hq, D]``; ``k`` ``[T, Hk, D]`` or MLA's
    shared ``[T, D]``. Other inputs (``k=None``, head dims other than 64/128/256, a rotated
    width not a multiple of 16, a non-float32 cache, CPU or float32 tensors) go to the
    reference.
    """
    cache_dim = cos_sin_cache.shape[-1]
    rotary_dim = cache_dim if rotary_dim is None else rotary_dim
    if rotary_dim != cache_dim:
        raise ValueError(f"rotary_dim={rotary_dim} does not match the cos_sin_cache width {cache_dim}")
    if k is None or not _rope_fits(q, k, cos_sin_cache, rotary_dim):
        return _torch_rotary_embedding(positions, q, k, cos_sin_cache, rotary_dim, is_neox)
    # NOTE: the kernel reads positions as a contiguous int32/int64 vector; .contiguous() is a
    # no-op for the runner's (and a CUDA graph's static) position buffers.
    return _fi_rope.apply_rope_with_cos_sin_cache(
        positions.contiguous(), q, k, q.shape[-1], cos_sin_cache, is_neox=is_neox
    )


# --------------------------------------------------------------------------- SiLU-and-mul


@register("silu_and_mul", "flashinfer")
def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``silu(x[..., :d]) * x[..., d:]`` with the torch reference's signature:
    ``flashinfer.activation.silu_and_mul`` into a new tensor (the kernel reads rows
    contiguously, so a strided ``x`` is copied first). ``d`` must be a multiple of 8;
    other inputs go to the reference."""
    if x.shape[-1] % 2:
        raise ValueError(f"gated activation needs an even last dimension, got x.shape={tuple(x.shape)}")
    if not _takes_half(x) or (x.shape[-1] // 2) % 8:
        return _torch_silu_and_mul(x)
    x = x.contiguous()
    if x.data_ptr() % _VECTOR_BYTES:
        return _torch_silu_and_mul(x)
    return _fi_activation.silu_and_mul(x)


# --------------------------------------------------------------------------- sampling


@register("sample_tokens", "flashinfer")
def sample_tokens(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Draw one token per row of ``logits[B, V]`` (CUDA) from the distribution the torch
    ``sampling_probs`` op describes: temperature, top-k, top-p over the renormalised top-k
    set, then min-p relative to the most likely token. Returns ``[B]`` int64 token ids on
    the logits' device.

    Args:
        logits: ``[B, V]`` raw (or penalised) logits; float32 is used inside.
        temperature: ``[B]`` > 0 (greedy rows are the caller's argmax, not this op's).
        top_k: ``[B]`` int; ``>= V`` (or ``<= 0``) keeps every token.
        top_p: ``[B]`` in ``(0, 1]``; 1 keeps every token.
        min_p: ``[B]`` in ``[0, 1]``; 0 keeps every token.
        generator: a CUDA generator whose Philox state the kernel advances (None: the
            device's default generator); a CPU generator instead supplies one 62-bit seed
            per call (reproducible, no device sync).

    Pass the four parameter vectors on the CPU: which kernels run is decided from them on
    the host, which costs a device sync when they live on the GPU. This op is not
    CUDA-graph capturable (that decision, and flashinfer's generator bookkeeping, run on the
    host).

    Kernels (``flashinfer.sampling``, rejection sampling without a sort): ``softmax`` of
    ``logits / temperature`` in torch, then ``top_k_renorm_probs`` when a row truncates by
    k, then ``min_p_sampling_from_probs`` (after ``top_p_renorm_probs`` when a row also
    truncates by p) when a row asks for min-p, else ``top_p_sampling_from_probs`` when a row
    truncates by p, else ``sampling_from_probs``. Rows that do not truncate pass through
    each kernel unchanged (k = V, p = 1, min-p = 0).
    """
    if logits.dim() != 2:
        raise ValueError(f"logits must be [B, V], got logits.shape={tuple(logits.shape)}")
    batch, vocab = logits.shape
    if batch == 0:
        return torch.empty(0, dtype=torch.long, device=logits.device)
    if not _on_cuda(logits):
        raise ValueError(f"the flashinfer sample_tokens op needs CUDA logits, got device={logits.device}")
    top_k = torch.where((top_k <= 0) | (top_k > vocab), vocab, top_k)
    needs_k, needs_p, needs_min_p = bool((top_k < vocab).any()), bool((top_p < 1.0).any()), bool((min_p > 0.0).any())
    device = logits.device
    temperature = temperature.to(device=device, dtype=torch.float32)
    probs = torch.softmax(logits.float() / temperature.unsqueeze(1), dim=-1)
    if needs_k:
        probs = _fi_sampling.top_k_renorm_probs(probs, top_k.to(device=device, dtype=torch.int32))
    top_p = top_p.to(device=device, dtype=torch.float32)
    rng = _rng_arguments(generator)
    if needs_min_p:
        if needs_p:
            probs = _fi_sampling.top_p_renorm_probs(probs, top_p)
        tokens = _fi_sampling.min_p_sampling_from_probs(probs, min_p.to(device=device, dtype=torch.float32), **rng)
    elif needs_p:
        tokens = _fi_sampling.top_p_sampling_from_probs(probs, top_p, **rng)
    else:
        tokens = _fi_sampling.sampling_from_probs(probs, **rng)
    return tokens.long()


def _rng_arguments(generator: torch.Generator | None) -> dict:
    """flashinfer's randomness arguments for ``generator`` (see :func:`sample_tokens`)."""
    if generator is None or generator.device.type == "cuda":
        return {"generator": generator}
    # NOTE: flashinfer reads a CUDA generator's (seed, offset) state; a CPU generator's state is
    # an MT19937 table, so it seeds the kernel's Philox stream instead (offset 0, new seed per call).
    seed = int(torch.randint(0, 2**62, (1,), generator=generator, dtype=torch.int64))
    return {"seed": seed, "offset": 0}
