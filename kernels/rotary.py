"""Rotary position embedding: the cos/sin cache for HF's RoPE variants and the op
that rotates query and key heads.

The cache is ``[max_position, rotary_dim]``: the first half holds ``cos(pos * inv_freq)``,
the second half ``sin(pos * inv_freq)``, one column per frequency, already multiplied
by the variant's attention factor (YaRN), as HF's rotary modules multiply cos/sin.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

import torch

from flotilla.kernels.registry import register

_ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn")


def _base_inv_freq(rotary_dim: int, base: float) -> torch.Tensor:
    # NOTE: integer arange then float division, exactly as HF, so the frequencies match bit for bit.
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64).to(torch.float32) / rotary_dim
    return 1.0 / (base**exponents)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def _yarn_inv_freq(rotary_dim: int, base: float, params: Mapping[str, Any], max_position: int) -> tuple[torch.Tensor, float]:
    """YaRN frequencies and attention factor, as transformers' ``_compute_yarn_parameters``
    (which covers DeepSeek's ``mscale`` / ``mscale_all_dim`` variant)."""
    original_max = params.get("original_max_position_embeddings")
    if original_max is None:
        raise ValueError(f"yarn rope scaling needs original_max_position_embeddings, got scaling={dict(params)}")
    factor = params.get("factor")
    if factor is None:
        factor = max_position / original_max
    attention_factor = params.get("attention_factor")
    mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
    if attention_factor is None:
        if mscale and mscale_all_dim:
            attention_factor = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
        else:
            attention_factor = _yarn_mscale(factor)
    beta_fast = params.get("beta_fast") or 32
    beta_slow = params.get("beta_slow") or 1

    def correction_dim(num_rotations: float) -> float:
        return (rotary_dim * math.log(original_max / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = ((torch.arange(rotary_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation_weight = 1 - ramp  # 1 for high frequencies (kept), 0 for low ones (interpolated)

    pos_freqs = base ** (torch.arange(0, rotary_dim, 2).to(torch.float32) / rotary_dim)
    extrapolated = 1.0 / pos_freqs
    interpolated = 1.0 / (factor * pos_freqs)
    inv_freq = interpolated * (1 - extrapolation_weight) + extrapolated * extrapolation_weight
    return inv_freq, float(attention_factor)


def _llama3_inv_freq(rotary_dim: int, base: float, params: Mapping[str, Any]) -> torch.Tensor:
    inv_freq = _base_inv_freq(rotary_dim, base)
    factor = params["factor"]
    low_freq_factor = params["low_freq_factor"]
    high_freq_factor = params["high_freq_factor"]
    old_context_len = params["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def rope_type_of(scaling: Mapping[str, Any] | None) -> str:
    """The RoPE variant named by an HF ``rope_scaling`` / ``rope_parameters`` dict
    (``rope_type``, or the legacy ``type`` key; ``"default"`` when absent)."""
    if not scaling:
        return "default"
    return scaling.get("rope_type", scaling.get("type", "default")) or "default"


def rope_cache(
    rotary_dim: int,
    max_position: int,
    base: float,
    scaling: Mapping[str, Any] | None = None,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """The ``[max_position, rotary_dim]`` cos/sin cache (first half cos, second half sin).

    Args:
        rotary_dim: how many leading head dimensions rotate (even).
        max_position: positions ``0 .. max_position-1`` are cached.
        base: the RoPE theta.
        scaling: an HF ``rope_scaling`` / ``rope_parameters`` dict or None. Supported
            ``rope_type`` values: ``default``, ``linear`` (``factor``), ``dynamic`` (NTK;
            equal to default for positions below ``max_position``, which is all we cache),
            ``llama3`` (``factor``, ``low_freq_factor``, ``high_freq_factor``,
            ``original_max_position_embeddings``) and ``yarn`` (``factor``,
            ``original_max_position_embeddings``, optional ``beta_fast``, ``beta_slow``,
            ``mscale``, ``mscale_all_dim``, ``attention_factor``, ``truncate``). Other keys
            (``rope_theta``, ``partial_rotary_factor``) are ignored: pass them as ``base`` and
            ``rotary_dim``.
        dtype: the cache dtype; cos/sin are computed in float32 first.

    NOTE: YaRN's attention factor multiplies cos and sin here (as HF does). DeepSeek's extra
    ``mscale_all_dim**2`` factor on the softmax scale is the model's job.
    """
    if rotary_dim <= 0 or rotary_dim % 2:
        raise ValueError(f"rotary_dim must be a positive even number, got rotary_dim={rotary_dim}")
    rope_type = rope_type_of(scaling)
    attention_factor = 1.0
    if rope_type in ("default", "dynamic"):
        inv_freq = _base_inv_freq(rotary_dim, base)
    elif rope_type == "linear":
        inv_freq = _base_inv_freq(rotary_dim, base) / scaling["factor"]
    elif rope_type == "llama3":
        inv_freq = _llama3_inv_freq(rotary_dim, base, scaling)
    elif rope_type == "yarn":
        inv_freq, attention_factor = _yarn_inv_freq(rotary_dim, base, scaling, max_position)
    else:
        raise ValueError(f"unsupported rope_type {rope_type!r} in rope scaling (supported: {', '.join(_ROPE_TYPES)})")
    positions = torch.arange(max_position, dtype=torch.float32)
    freqs = torch.outer(positions, inv_freq)
    cos, sin = freqs.cos() * attention_factor, freqs.sin() * attention_factor
    return torch.cat([cos, sin], dim=-1).to(dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotary_dim: int, is_neox: bool) -> torch.Tensor:
    """Rotate the first ``rotary_dim`` dims of ``x[T, ..., D]``; ``cos``/``sin`` are ``[T, rotary_dim/2]``."""
    shape = (cos.shape[0],) + (1,) * (x.dim() - 2) + (cos.shape[1],)
    cos, sin = cos.view(shape).to(x.dtype), sin.view(shape).to(x.dtype)
    rot, rest = x[..., :rotary_dim], x[..., rotary_dim:]
    if is_neox:
        x1, x2 = rot.chunk(2, dim=-1)
        rotated = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    else:
        x1, x2 = rot[..., 0::2], rot[..., 1::2]
        rotated = torch.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).flatten(-2)
    return torch.cat([rotated, rest], dim=-1) if rest.shape[-1] else rotated


@register("rotary_embedding", "torch")
def rotary_embedding(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor | None,
    cos_sin_cache: torch.Tensor,
    rotary_dim: int | None = None,
    is_neox: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Rotate query and key heads by their positions; returns new ``(q, k)``.

    Args:
        positions: ``[T]`` int64 position of each token.
        q: ``[T, Hq, D]`` (any ``[T, ..., D]`` works).
        k: ``[T, Hk, D]`` or ``[T, D]`` (MLA's shared ``k_pe``), or None.
        cos_sin_cache: from :func:`rope_cache`; its width is ``rotary_dim``.
        rotary_dim: leading dims to rotate (default: the cache width); the rest pass through.
        is_neox: True rotates halves (``rotate_half``, HF Llama); False rotates adjacent
            pairs ``(x0, x1), (x2, x3), ...`` (GPT-J style, DeepSeek's ``rope_interleave``).

    NOTE: with ``is_neox=False`` the output keeps the interleaved layout (as vLLM and
    flashinfer do), whereas HF's ``apply_rotary_pos_emb_interleave`` returns the rotated
    pairs de-interleaved (evens then odds). Both apply the same permutation to q and k, so
    every ``q . k`` and thus attention is identical.
    """
    cache_dim = cos_sin_cache.shape[-1]
    rotary_dim = cache_dim if rotary_dim is None else rotary_dim
    if rotary_dim != cache_dim:
        raise ValueError(f"rotary_dim={rotary_dim} does not match the cos_sin_cache width {cache_dim}")
    if rotary_dim > q.shape[-1]:
        raise ValueError(f"rotary_dim={rotary_dim} exceeds the head dim {q.shape[-1]}")
    cos, sin = cos_sin_cache[positions].chunk(2, dim=-1)
    q_out = _rotate(q, cos, sin, rotary_dim, is_neox)
    k_out = None if k is None else _rotate(k, cos, sin, rotary_dim, is_neox)
    return q_out, k_out
