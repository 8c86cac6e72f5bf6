"""How a paged KV cache stores K and V: in the model's dtype, or in float8.

A float8 cache (``torch.float8_e4m3fn`` or ``torch.float8_e5m2``) holds each value with a
per-tensor scale of 1.0: a value is stored as itself, rounded to the nearest float8 value
(ties to even) and saturated at the format's largest finite value (448 for e4m3, 57344 for
e5m2), and read back as itself. There are no calibrated scales: values beyond the range
clip, and small values lose relative precision (e4m3 keeps 3 mantissa bits, e5m2 2).

Every write path stores through :func:`to_cache_dtype` (or, in the fused Triton
``qkv_prepare``, the same rounding done in registers), so a cache holds the same bytes
whichever path wrote it. torch has no ``index_copy_`` for float8 on CPU, so indexed writes
and reads go through :func:`storage_view` (the cache's bytes as uint8, same shape).
"""

from __future__ import annotations

import torch

# The float8 formats a KV cache may be stored in.
FP8_KV_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def is_fp8(dtype: torch.dtype) -> bool:
    """Whether ``dtype`` is one of the float8 KV-cache formats (:data:`FP8_KV_DTYPES`)."""
    return dtype in FP8_KV_DTYPES


def to_cache_dtype(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``values`` as ``dtype`` for storing in a cache of that dtype: a plain cast, except that
    float8 saturates at ``±finfo(dtype).max`` (e4m3 has no infinity and would give NaN, e5m2
    would give inf) and rounds to nearest even."""
    if not is_fp8(dtype):
        return values.to(dtype)
    limit = torch.finfo(dtype).max
    return values.clamp(-limit, limit).to(dtype)


def storage_view(cache: torch.Tensor) -> torch.Tensor:
    """The tensor to index a cache through: a float8 cache viewed as uint8 (same shape and
    strides; torch lacks ``index_copy_`` for float8 on CPU), any other cache as it is."""
    return cache.view(torch.uint8) if is_fp8(cache.dtype) else cache
