"""DeepEP v2 checks that need the final batch sizes (SGLang's
``validate_deepep_v2_speculative_draft`` and
``validate_deepep_v2_dispatch_token_budget``).

The per-rank dispatch capacity is SGLANG_DEEPEP_V2_NUM_MAX_DISPATCH_TOKENS_PER_RANK
(128 unless a rule declared otherwise).
"""

from __future__ import annotations

import math

from flotilla.resolution.engine import reject, rule
from flotilla.resolution.rules.normalise.cuda_graph import DECODE, DISABLED, phase_settings

DEEPEP_V2_CAPACITY_ENV = "SGLANG_DEEPEP_V2_NUM_MAX_DISPATCH_TOKENS_PER_RANK"
_DEFAULT_CAPACITY = 128
# Candidate draft steps of the built-in adaptive speculation table (its widest is 7).
_ADAPTIVE_MAX_STEPS = 7


def dispatch_capacity(view) -> int:
    """Tokens one rank's DeepEP v2 dispatch buffer holds."""
    value = view.env(DEEPEP_V2_CAPACITY_ENV)
    return int(value) if value is not None else _DEFAULT_CAPACITY


def max_prefill_buffer_tokens(view) -> int:
    """The prefill-buffer ceiling: the chunk size, which PP dynamic chunking may
    grow toward ``max_prefill_tokens`` (probing at 1.25x)."""
    chunked = view.chunked_prefill_size if view.chunked_prefill_size and view.chunked_prefill_size > 0 else 0
    tokens = chunked
    if view.enable_dynamic_chunking and view.pp_size > 1 and chunked:
        tokens = max(tokens, view.max_prefill_tokens or 0, math.ceil(chunked * 1.25))
    return tokens


def max_draft_tokens(view) -> int | None:
    """The widest draft-token count speculative decoding may use."""
    if view.speculative_num_draft_tokens is None:
        return None
    if view.speculative_adaptive and view.speculative_adaptive_config is None:
        return _ADAPTIVE_MAX_STEPS + 1
    return view.speculative_num_draft_tokens


@rule("validate_deepep_v2_speculative_draft")
def validate_deepep_v2_speculative_draft(view, model, platform):
    """The speculative draft model cannot dispatch through DeepEP v2 (set or inherited)."""
    draft = view.speculative_moe_a2a_backend
    if draft is None and view.speculative_algorithm and str(view.speculative_algorithm).upper() != "NGRAM":
        draft = view.moe_a2a_backend
    if draft == "deepep_v2":
        reject(
            "DeepEP v2 MoE is not validated as a speculative draft backend. "
            "Select another --speculative-moe-a2a-backend."
        )


@rule("validate_deepep_v2_dispatch_token_budget")
def validate_deepep_v2_dispatch_token_budget(view, model, platform):
    """DeepEP v2's per-rank buffer must hold a prefill chunk and a decode graph batch."""
    if view.moe_a2a_backend != "deepep_v2":
        return None
    capacity = dispatch_capacity(view)
    if view.disaggregation_mode != "decode":
        prefill_tokens = max_prefill_buffer_tokens(view) or (view.max_prefill_tokens or 0)
        if prefill_tokens > capacity:
            reject(
                "DeepEP v2 per-rank prefill budget exceeds "
                "SGLANG_DEEPEP_V2_NUM_MAX_DISPATCH_TOKENS_PER_RANK: "
                f"required={prefill_tokens}, capacity={capacity}. Raise the "
                "environment value or lower --chunked-prefill-size/"
                "--max-prefill-tokens."
            )
    if view.disaggregation_mode == "prefill":
        return None
    decode = phase_settings(view.cuda_graph_config, DECODE)
    if not decode or decode.get("backend") == DISABLED:
        return None
    graph_bs = decode.get("max_bs") or 0
    if view.max_running_requests is not None:
        attn_dp_size = view.dp_size if view.enable_dp_attention else 1
        graph_bs = min(graph_bs, max(1, view.max_running_requests // attn_dp_size))
    # NOTE: SGLang's conditional binds to the fallback only, so the draft width
    # counts whenever one is configured, speculative algorithm or not.
    tokens_per_req = max_draft_tokens(view) or 1
    graph_tokens = graph_bs * tokens_per_req
    if graph_tokens > capacity:
        reject(
            "DeepEP v2 per-rank decode CUDA graph exceeds "
            "SGLANG_DEEPEP_V2_NUM_MAX_DISPATCH_TOKENS_PER_RANK: "
            f"required={graph_tokens}, capacity={capacity} "
            f"(requests={graph_bs}, tokens/request={tokens_per_req}). Raise "
            "the environment value or lower --cuda-graph-max-bs."
        )
    return None
