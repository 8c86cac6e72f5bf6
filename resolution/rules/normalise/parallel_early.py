"""Parallelism rules that must run before the CUDA-graph config is built (seed 002).

``_handle_dcp_validation`` checks the decode-context-parallel flags;
``_handle_dwdp`` turns ``--dwdp-size`` into the DP-attention / EP layout it
requires and switches CUDA graphs off, which is why it precedes
``_parse_cuda_graph_config`` and the data-parallelism handler.
"""

from __future__ import annotations

from flotilla.resolution.engine import Env, ensure, reject, rule


@rule("_handle_dcp_validation")
def handle_dcp_validation(view, model, platform):
    """Decode context parallelism needs dcp_size >= 1; the a2a/fi_a2a exchange and
    --dcp-replicate-q-proj only make sense with dcp_size > 1 (fi_a2a on CUDA only)."""
    if view.dcp_size < 1:
        reject(
            "Decode context parallel size (--dcp-size / "
            "--decode-context-parallel-size) must be >= 1, but got "
            f"dcp_size={view.dcp_size}."
        )
    if view.dcp_comm_backend in ("a2a", "fi_a2a") and view.dcp_size <= 1:
        reject(
            f"--dcp-comm-backend {view.dcp_comm_backend} only affects the "
            "decode context-parallel attention reduction and therefore "
            "requires --dcp-size / --decode-context-parallel-size > 1, but "
            f"got dcp_size={view.dcp_size}."
        )
    if view.dcp_comm_backend == "fi_a2a" and not platform.is_cuda:
        reject(
            "--dcp-comm-backend fi_a2a delegates the exchange to FlashInfer's "
            "MNNVL All-to-All kernel, which requires an NVIDIA CUDA platform "
            "with SM90+ and MNNVL fabric memory (e.g. GB200 NVL72). The "
            "authoritative fabric probe runs at model-runner init; use 'a2a' "
            "or 'ag_rs' on clusters without MNNVL."
        )
    if view.dcp_replicate_q_proj:
        if view.dcp_size <= 1:
            reject("--dcp-replicate-q-proj requires --dcp-size > 1.")
        if view.dcp_comm_backend not in ("a2a", "fi_a2a"):
            reject(
                "--dcp-replicate-q-proj only applies to the a2a/fi_a2a DCP "
                "communication backend (it removes the head-dim Q all-gather); "
                f"got --dcp-comm-backend={view.dcp_comm_backend}."
            )
    return None


_DWDP_FORCED = (
    "dp_size",
    "enable_dp_attention",
    "enable_dp_attention_local_control_broadcast",
    "enable_dp_lm_head",
    "moe_dense_tp_size",
    "ep_size",
    "moe_dp_size",
    "moe_a2a_backend",
    "disable_cuda_graph",
)


@rule("_handle_dwdp", overrides=_DWDP_FORCED)
def handle_dwdp(view, model, platform):
    """DWDP (dwdp_size > 1) statically partitions experts over the TP group: it forces
    DP attention with dp_size = ep_size = dwdp_size, local-control broadcast, DP LM
    head, dense TP 1, no A2A backend, the scheduler all-gather skip and no CUDA graphs."""
    size = view.dwdp_size
    if size <= 1:
        return None
    ensure(size >= 2, f"dwdp_size must be >= 2 when enabled, got {size}")
    ensure(size == view.tp_size, f"dwdp_size ({size}) must equal tp_size ({view.tp_size})")
    ensure(
        view.disaggregation_mode in ("null", "prefill"),
        "DWDP requires --disaggregation-mode null or prefill",
    )
    ensure(not view.enable_eplb, "EPLB dynamic migration conflicts with static DWDP partitioning")
    ensure(
        view.speculative_algorithm is None,
        "DWDP does not support speculative decoding (MTP/draft workers)",
    )
    ensure(view.pp_size == 1, "DWDP requires pp_size == 1")
    ensure(
        not view.enable_two_batch_overlap,
        "DWDP's prefetch event protocol does not support two-batch overlap",
    )
    return {
        "dp_size": size,
        "enable_dp_attention": True,
        "enable_dp_attention_local_control_broadcast": True,
        "enable_dp_lm_head": True,
        "moe_dense_tp_size": 1,
        "ep_size": size,
        "moe_dp_size": 1,
        "moe_a2a_backend": "none",
        Env("SGLANG_SCHEDULER_SKIP_ALL_GATHER"): "True",
        "disable_cuda_graph": True,
    }
