"""Small read helpers shared by rules (pure functions of a view)."""

from __future__ import annotations

from typing import Any


def attention_backends(view: Any) -> tuple[Any, Any]:
    """(prefill, decode) attention backends; an unset split side falls back to
    ``attention_backend``."""
    prefill = view.prefill_attention_backend or view.attention_backend
    decode = view.decode_attention_backend or view.attention_backend
    return prefill, decode


def attention_backend_not_set(view: Any) -> bool:
    """None of the three attention-backend fields has been decided yet."""
    return (
        view.attention_backend is None
        and view.prefill_attention_backend is None
        and view.decode_attention_backend is None
    )
