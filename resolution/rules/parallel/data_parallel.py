"""Data parallelism: DP-attention defaults and adjustments, the LM-head paths,
and the load-balancing default (SGLang's ``handle_data_parallelism`` and
``handle_load_balance_method``).

not ported: the ``--mm-enable-dp-encoder`` messages (logging only).
"""

from __future__ import annotations

from flotilla.resolution.engine import ensure, reject, rule
from flotilla.resolution.rules.parallel import graphs


@rule("_data_parallelism_defaults", overrides=("enable_dp_attention", "enable_dp_lm_head"), whitelist=True)
def data_parallelism_defaults(view, model, platform):
    """Without data parallelism (dp_size 1, not an elastic scale joiner) DP attention and the DP LM head are off.

    NOTE: runs after the model providers, so it also resets a DP-attention
    declaration a context-parallel provider made.

    FLOTILLA DEVIATION: a ``--elastic-ep-backend ray`` deployment that may
    scale up (``--max-ep-size`` above its TP size) keeps the DP attention the
    user asked for, and the DP LM head as given, at dp_size 1: it starts at one
    rank and grows to ``--max-ep-size`` DP ranks, and the elastic layout
    (ep == dp == tp inside the group, ``_handle_elastic_ep``) needs DP attention
    from the start. Every other backend, and every run without the ray
    backend, is reset as in SGLang.
    """
    if view.dp_size == 1 and view.ep_join_mode != "scale" and not _ray_elastic_keeps_dp_attention(view):
        return {"enable_dp_attention": False, "enable_dp_lm_head": False}
    return None


def _ray_elastic_keeps_dp_attention(view):
    """Whether a scaling ``ray`` elastic-EP deployment asked for DP attention itself."""
    return (
        view.elastic_ep_backend == "ray"
        and view.max_ep_size is not None
        and view.max_ep_size > view.tp_size
        and view.explicit("enable_dp_attention")
        and view.enable_dp_attention
    )


def _clamped_prefill_graph(view, chunked_prefill_size):
    """The prefill CUDA graph settings clamped to the per-DP-rank chunk, or None."""
    settings = graphs.phase_settings(view, graphs.PREFILL)
    max_bs = settings.get("max_bs")
    if (
        graphs.prefill_disabled(view)
        or max_bs is None
        or chunked_prefill_size is None
        or max_bs <= chunked_prefill_size
        or graphs.is_locked(view, graphs.PREFILL, "max_bs")
    ):
        return None
    clamped = {"max_bs": chunked_prefill_size}
    if not graphs.is_locked(view, graphs.PREFILL, "bs"):
        clamped["bs"] = graphs.prefill_batch_sizes(chunked_prefill_size)
    return graphs.with_phase(view.cuda_graph_config, graphs.PREFILL, **clamped)


@rule(
    "_handle_data_parallelism",
    overrides=("schedule_conservativeness", "chunked_prefill_size", "cuda_graph_config"),
)
def handle_data_parallelism(view, model, platform):
    """DP attention splits the prefill chunk across DP ranks and schedules more conservatively.

    The prefill CUDA graph max batch was sized from the undivided chunk, so it
    is clamped to the per-rank chunk too (unless the user pinned it).
    """
    if not view.enable_dp_attention:
        return None
    declared = {"schedule_conservativeness": view.schedule_conservativeness * 0.3}
    ensure(
        view.tp_size % view.dp_size == 0,
        f"tp_size ({view.tp_size}) must be divisible by dp_size ({view.dp_size}) with DP attention",
    )
    chunk = view.chunked_prefill_size
    if chunk is not None:
        # NOTE: a negative size (chunking off) floors like SGLang's ``//``.
        chunk = chunk // view.dp_size
        declared["chunked_prefill_size"] = chunk
    clamped = _clamped_prefill_graph(view, chunk)
    if clamped is not None:
        declared["cuda_graph_config"] = clamped
    return declared


@rule("_tp_lm_head_all_to_all_default", whitelist=True)
def tp_lm_head_all_to_all_default(view, model, platform):
    """The TP LM-head all-to-all path defaults on only for pure-DP decode nodes (an explicit value wins)."""
    if view.enable_tp_lm_head_all_to_all is not None:
        return None
    enable = (
        view.disaggregation_mode == "decode"
        and view.enable_dp_attention
        and view.dp_size > 1
        and view.tp_size == view.dp_size
        and view.attn_cp_size == 1
        and not view.enable_dp_lm_head
    )
    return {"enable_tp_lm_head_all_to_all": bool(enable)}


@rule("_dp_lm_head_validation", whitelist=True)
def dp_lm_head_validation(view, model, platform):
    """The DP LM head and the TP LM-head all-to-all path both need DP attention; they exclude each other."""
    if view.enable_dp_lm_head:
        ensure(
            view.enable_dp_attention,
            "Please enable dp attention when setting enable_dp_lm_head. ",
        )
    if view.enable_tp_lm_head_all_to_all:
        ensure(
            view.enable_dp_attention,
            "Please enable dp attention when setting enable_tp_lm_head_all_to_all.",
        )
        ensure(
            not view.enable_dp_lm_head,
            "--enable-tp-lm-head-all-to-all uses a TP-sharded LM head and is "
            "incompatible with --enable-dp-lm-head.",
        )
        ensure(
            view.tp_size == view.dp_size,
            "--enable-tp-lm-head-all-to-all currently requires tp_size == "
            f"dp_size, got tp_size={view.tp_size}, dp_size={view.dp_size}.",
        )
        ensure(
            view.attn_cp_size == 1,
            "--enable-tp-lm-head-all-to-all currently requires "
            f"attn_cp_size == 1, got {view.attn_cp_size}.",
        )
    return None


@rule("_handle_load_balance_method", overrides=("load_balance_method",))
def handle_load_balance_method(view, model, platform):
    """Load balancing ``auto`` follows the bootstrap room on PD prefill nodes and is round robin elsewhere."""
    if view.disaggregation_mode not in ("null", "prefill", "decode"):
        reject(f"Invalid disaggregation_mode={view.disaggregation_mode!r}")
    if view.load_balance_method != "auto":
        return None
    method = "follow_bootstrap_room" if view.disaggregation_mode == "prefill" else "round_robin"
    return {"load_balance_method": method}


STEPS = [
    data_parallelism_defaults,
    handle_data_parallelism,
    tp_lm_head_all_to_all_default,
    dp_lm_head_validation,
]
