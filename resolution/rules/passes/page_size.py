"""The page-size default (SGLang's ``_page_size_default`` pass)."""

from __future__ import annotations

from flotilla.resolution.engine import rule


@rule("_page_size_default", whitelist=True)
def _page_size_default(view, model, platform):
    """Single-token KV pages unless a backend or the user chose a size; MUSA
    takes 64, and so does ROCm's vectorized-5D aiter KV layout.

    Runs after every backend page-size snap, so it only fills what is still unset.
    """
    if view.page_size is not None:
        return None
    layout = (view.env("SGLANG_AITER_KV_CACHE_LAYOUT") or "nhd").lower()
    if platform.is_hip and layout == "vectorized_5d":
        return {"page_size": 64}
    return {"page_size": 64 if platform.is_musa else 1}
