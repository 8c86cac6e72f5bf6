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


def no_spec_or_topk_one(view: Any) -> bool:
    """No EAGLE tree is drafted: ``speculative_eagle_topk`` is unset, or it is 1
    with single-token pages (SGLang's ``is_no_spec_infer_or_topk_one``)."""
    topk = view.speculative_eagle_topk
    return topk is None or (topk == 1 and view.page_size in (1, None))


def default_attention_backend(view: Any, model: Any, platform: Any) -> str:
    """The attention backend SGLang picks when nobody chose one
    (``get_default_attn_backend``).

    MHA models: FA3 on Hopper, trtllm_mha on SM100 (FA4 when K and V head dims
    differ), aiter on ROCm, torch_native on MPS, else FlashInfer unless it is
    missing or the model uses attention sinks (then Triton). Speculative EAGLE
    trees (topk > 1, or topk 1 with pages > 1) leave the Hopper/SM100 choices.
    MLA models: FA3 on Hopper, FlashInfer on SM100, aiter on ROCm when a rank
    holds 16 or 128 KV heads (else Triton), torch_native on MPS, else Triton.
    Whisper always takes FlashInfer (cross-attention CUDA graphs).
    Out-of-tree platform defaults are not modelled.
    """
    if "WhisperForConditionalGeneration" in model.architectures:
        return "flashinfer"
    simple_spec = no_spec_or_topk_one(view)
    if not model.is_mla:
        if platform.is_sm90 and simple_spec:
            return "fa3"
        if (
            platform.is_sm100
            and simple_spec
            and (view.speculative_algorithm is None or view.speculative_eagle_topk is not None)
        ):
            return "fa4" if model.has_asymmetric_kv else "trtllm_mha"
        if platform.is_hip:
            return "aiter"
        if platform.is_mps:
            return "torch_native"
        if platform.flashinfer_available and not model.has_attention_sinks:
            return "flashinfer"
        return "triton"
    if platform.is_sm90:
        return "fa3"
    if platform.is_sm100:
        return "flashinfer"
    if platform.is_hip:
        return "aiter" if model.num_kv_heads(view.tp_size) in (16, 128) else "triton"
    if platform.is_mps:
        return "torch_native"
    return "triton"


_TRUE_ENV = frozenset({"1", "true", "yes", "y", "on"})


def env_flag(view: Any, name: str, default: bool = False) -> bool:
    """``envs.NAME.get()`` for boolean environment variable ``name``: whether an
    earlier rule declared it true, else ``default``.

    Resolution assumes a clean environment, so an undeclared variable reads as
    SGLang's ``EnvBool`` default (false for every flag the rules read).
    Works on a :class:`~flotilla.resolution.engine.View` and on a
    :class:`~flotilla.resolution.rules.live.Live` overlay alike.
    """
    value = view.env(name)
    if value is None:
        return default
    return str(value).strip().lower() in _TRUE_ENV
