"""The first normalise rules: flag aliases and defaults SGLang settles before it
looks at the model path.

not ported: ``_handle_media_url_security`` (media URL policy: network plumbing,
no bearing on the engine configuration).
not ported: ``handle_hardware_runtime_validation`` (fails only when
SGLANG_USE_MLX is set, which a clean environment never is).
"""

from __future__ import annotations

from flotilla.resolution.engine import reject, rule


@rule("handle_moe_runner_backend_alias", overrides=("moe_runner_backend", "moe_a2a_backend"))
def handle_moe_runner_backend_alias(view, model, platform):
    """--moe-runner-backend megamoe is an alias: it means --moe-a2a-backend megamoe
    with the runner back on auto (overriding any other A2A backend)."""
    if view.moe_runner_backend != "megamoe":
        return None
    return {"moe_runner_backend": "auto", "moe_a2a_backend": "megamoe"}


@rule("_handle_return_hidden_states_mode")
def handle_return_hidden_states_mode(view, model, platform):
    """--enable-return-hidden-states means mode 'full'; choosing a mode enables the
    hidden-state output."""
    mode = view.return_hidden_states_mode
    if mode not in (None, "last", "full"):
        reject("return_hidden_states_mode must be one of: None, 'last', or 'full'.")
    if mode is None:
        if view.enable_return_hidden_states:
            return {"return_hidden_states_mode": "full"}
        return None
    return {"enable_return_hidden_states": True}


@rule("_handle_hicache_ratio_default")
def handle_hicache_ratio_default(view, model, platform):
    """The host/device KV ratio defaults to 2.0 (1.2 in buffer_only host mode); a PD
    decode server leaves it unset for its KV cache builder."""
    if view.hicache_ratio is None and view.disaggregation_mode != "decode":
        ratio = 1.2 if view.hicache_host_memory_mode == "buffer_only" else 2.0
        return {"hicache_ratio": ratio}
    return None


@rule("validate_prefill_decode_interval")
def validate_prefill_decode_interval(view, model, platform):
    """--prefill-decode-interval cannot be negative."""
    if view.prefill_decode_interval < 0:
        reject("--prefill-decode-interval must be non-negative.")
    return None


STEPS = (
    handle_moe_runner_backend_alias,
    handle_return_hidden_states_mode,
    handle_hicache_ratio_default,
    validate_prefill_decode_interval,
)
