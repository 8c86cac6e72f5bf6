"""Expert-parallel load balancing (EPLB), replica dispatch and the expert
distribution recorder (SGLang's ``handle_eplb_and_dispatch`` and
``handle_expert_distribution_metrics``).
"""

from __future__ import annotations

from flotilla.resolution.engine import ensure, reject, rule
from flotilla.resolution.rules.live import Live

RETIRED_BALANCEDNESS_ENV = "SGLANG_ENABLE_EPLB_BALANCEDNESS_METRIC"


@rule(
    "_handle_eplb_and_dispatch",
    overrides=("expert_distribution_recorder_mode", "ep_dispatch_algorithm"),
)
def handle_eplb_and_dispatch(view, model, platform):
    """EPLB records expert statistics and picks replicas; without an A2A backend the pick must agree across ranks.

    With ``moe_a2a_backend none`` every EP rank runs the MoE on the same tokens
    and sums partial outputs, so the default dispatch is ``dynamic`` and the
    per-rank pickers (``static``, ``lp``) are rejected.
    """
    live = Live(view)
    if view.enable_eplb and view.expert_distribution_recorder_mode is None:
        live.declare(expert_distribution_recorder_mode="stat")
    rank_invariant = view.moe_a2a_backend == "none"
    if (view.enable_eplb or view.init_expert_location != "trivial") and view.ep_dispatch_algorithm is None:
        live.declare(ep_dispatch_algorithm="dynamic" if rank_invariant else "static")
    algorithm = live.ep_dispatch_algorithm
    if rank_invariant and algorithm in ("static", "lp"):
        reject(
            f"--ep-dispatch-algorithm {algorithm} picks a "
            "different physical replica per rank, which only holds up when an "
            "a2a backend routes each token to a single rank. Use "
            "--ep-dispatch-algorithm dynamic with --moe-a2a-backend none."
        )
    if view.enable_eplb and view.ep_join_mode != "scale":
        ensure(view.ep_size > 1, f"EPLB requires ep_size > 1 (got ep_size={view.ep_size})")
    return live.out


def should_report_expert_balancedness(view) -> bool:
    """Expert balancedness is reported somewhere (server log and/or Prometheus)."""
    return view.expert_balancedness_report_mode != "off"


@rule(
    "_handle_expert_distribution_metrics",
    overrides=("expert_distribution_recorder_mode", "expert_distribution_recorder_buffer_size"),
)
def handle_expert_distribution_metrics(view, model, platform):
    """Balancedness reports need the expert recorder; its buffer follows the EPLB rebalance period (else 1000)."""
    if view.env(RETIRED_BALANCEDNESS_ENV) is not None:
        reject(
            "SGLANG_ENABLE_EPLB_BALANCEDNESS_METRIC is no longer supported. Use "
            "--expert-balancedness-report-mode with one of: off, server_log, "
            "prometheus, both."
        )
    live = Live(view)
    if should_report_expert_balancedness(view) and view.expert_distribution_recorder_mode is None:
        live.declare(expert_distribution_recorder_mode="stat")
    if view.expert_distribution_recorder_buffer_size is None:
        if view.eplb_rebalance_num_iterations is not None:
            live.declare(expert_distribution_recorder_buffer_size=view.eplb_rebalance_num_iterations)
        elif live.expert_distribution_recorder_mode is not None:
            live.declare(expert_distribution_recorder_buffer_size=1000)
    return live.out
