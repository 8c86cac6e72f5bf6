"""Model-override providers for Kimi-K3: decode context parallelism (DCP)
attention backends and communication, the SM100/SM103 MLA defaults with DSPARK
verification, and the packed-MXFP4 MoE runner.

not ported: the DCP communication-backend log naming the device (logging only).
"""

from __future__ import annotations

from flotilla.resolution.engine import reject
from flotilla.resolution.rules.common import attention_backend_not_set, attention_backends
from flotilla.resolution.rules.overrides.registry import provider

_RAGGED_VERIFY_MODES = ("static", "cap-accept", "compact")


def dspark_verify_on_decode_backend(backend, q_len: int, kv_cache_dtype) -> bool:
    """Whether MLA decode backend ``backend`` can serve a ``q_len``-wide DSPARK
    target verify (so verification may run in decode mode)."""
    if backend in ("trtllm_mla", "cutedsl_mla"):
        return True
    if backend == "tokenspeed_mla":
        return kv_cache_dtype == "fp8_e4m3" and q_len <= 8
    return False


def mxfp4_pack_quantized(model) -> bool:
    """The language model's ``quantization_config`` (the text config's when the
    config nests one) has an mxfp4 config group."""
    text_config = model.get("text_config")
    qc = text_config.get("quantization_config") if hasattr(text_config, "get") else model.get("quantization_config")
    if not hasattr(qc, "get"):
        return False
    groups = qc.get("config_groups") or {}
    return any("mxfp4" in str(g.get("format", "")) for g in groups.values() if hasattr(g, "get"))


def _ragged_verify_mode(view) -> str:
    mode = view.env("SGLANG_RAGGED_VERIFY_MODE") or "static"
    if mode not in _RAGGED_VERIFY_MODES:
        reject(
            f"invalid SGLANG_RAGGED_VERIFY_MODE={mode!r}; expected one of "
            f"{', '.join(repr(m) for m in _RAGGED_VERIFY_MODES)}"
        )
    return mode


def _require_cutedsl_dcp_support(platform) -> None:
    # NOTE: a FlashInfer build counts as DCP-capable (its decode MLA kernel
    # exposes enable_dcp); only its absence fails the signature check.
    if not platform.flashinfer:
        reject(
            "Kimi-K3 DCP with decode_attention_backend='cutedsl_mla' requires "
            "FlashInfer 0.6.17 or newer with "
            "trtllm_batch_decode_with_kv_cache_mla exposing enable_dcp.",
            kind="RuntimeError",
        )


def _dcp_overrides(view, platform) -> dict:
    declared: dict = {}
    if view.enable_symm_mem:
        declared["enable_symm_mem"] = False
    if view.speculative_algorithm == "DSPARK":
        mode = _ragged_verify_mode(view)
        if mode != "static":
            reject(
                "Kimi-K3 DCP + DSPARK currently requires "
                "SGLANG_RAGGED_VERIFY_MODE=static; compact/cap-accept are "
                f"not validated under DCP (got {mode!r})."
            )
        declared["speculative_attention_mode"] = "decode"
    _, decode = attention_backends(view)
    if decode in ("cutedsl_mla", None):
        _require_cutedsl_dcp_support(platform)
        declared.update(prefill_attention_backend="trtllm_mla", decode_attention_backend="cutedsl_mla")
    elif decode == "tokenspeed_mla":
        declared.update(
            prefill_attention_backend="tokenspeed_mla",
            decode_attention_backend="tokenspeed_mla",
            kv_cache_dtype="fp8_e4m3",
        )
    else:
        reject(
            "Decode attention backend for Kimi-K3 DCP must be 'cutedsl_mla' or "
            f"'tokenspeed_mla', got {decode!r}.",
            kind="AssertionError",
        )
    if view.dcp_replicate_q_proj is None:
        declared["dcp_replicate_q_proj"] = True
    declared["dcp_comm_backend"] = "fi_a2a" if platform.is_mnnvl_fabric else "a2a"
    return declared


@provider(
    "KimiK3ForConditionalGeneration",
    overrides=(
        "enable_symm_mem",
        "speculative_attention_mode",
        "prefill_attention_backend",
        "decode_attention_backend",
        "kv_cache_dtype",
        "dcp_comm_backend",
    ),
)
def _kimi_k3_overrides(view, model, platform):
    """Kimi-K3 attention: DCP backends/communication, else trtllm_mla on SM100/SM103."""
    if view.dcp_size > 1:
        return _dcp_overrides(view, platform)
    if not (platform.is_sm100 and platform.device_sm in (100, 103)):
        return {}
    backends_unset = attention_backend_not_set(view)
    if view.speculative_algorithm != "DSPARK":
        if not backends_unset:
            return {}
        return {"decode_attention_backend": "trtllm_mla", "prefill_attention_backend": "trtllm_mla"}
    if view.speculative_num_draft_tokens:
        q_len = view.speculative_num_draft_tokens
    elif view.speculative_dspark_block_size is not None:
        q_len = view.speculative_dspark_block_size + 1
    else:
        q_len = 8  # the K3 draft's block size (7) + 1, before checkpoint inference
    declared: dict = {}
    if backends_unset:
        backend = "trtllm_mla"
        declared.update(decode_attention_backend=backend, prefill_attention_backend=backend)
    else:
        _, backend = attention_backends(view)
    if dspark_verify_on_decode_backend(backend, q_len, view.kv_cache_dtype):
        declared["speculative_attention_mode"] = "decode"
    return declared


@provider("KimiK3ForConditionalGeneration", overrides=("moe_runner_backend",))
def _kimi_k3_moe_runner_overrides(view, model, platform):
    """Kimi-K3's packed-MXFP4 experts run flashinfer_mxfp4 on SM100/SM103/SM107."""
    if view.moe_runner_backend != "auto":
        return {}
    if not (platform.is_sm100 and platform.device_sm in (100, 103, 107)):
        return {}
    if not mxfp4_pack_quantized(model):
        return {}
    return {"moe_runner_backend": "flashinfer_mxfp4"}
