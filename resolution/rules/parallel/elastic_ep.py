"""Elastic expert parallelism: join modes, runtime scale-up invariants
(SGLang's ``handle_elastic_ep``), plus flotilla's own ``ray`` backend.

not ported: the InfiniBand device probe of ``--mooncake-ib-device`` (reads
/sys/class/infiniband on the serving host; resolution cannot see the target's
devices, so the value is only normalised: stripped and de-duplicated).
"""

from __future__ import annotations

from flotilla.resolution.engine import ensure, reject, rule
from flotilla.resolution.rules.parallel import graphs
from flotilla.resolution.rules.live import Live

ELASTIC_EPLB_ALGORITHMS = ("elasticity_aware", "elasticity_aware_hierarchical")
# flotilla's Ray backend grows EP through its own communicator, so either
# plain TP MoE or the NIXL A2A works with it.
RAY_SCALE_A2A_BACKENDS = ("none", "nixl")


def _normalised_ib_devices(value):
    """``--mooncake-ib-device`` stripped and de-duplicated (the host probe is not ported)."""
    if value is None:
        return None
    text = value.strip()
    if not text:
        reject("No valid IB devices specified")
    if text.startswith("{") or "/" in text or text.endswith(".json"):
        return text  # a per-GPU JSON mapping or a file holding one: kept as given
    devices = [d.strip() for d in text.split(",") if d.strip()]
    if not devices:
        reject("No valid IB devices specified for all GPUs")
    return ",".join(dict.fromkeys(devices))


def _join_mode_checks(live: Live) -> None:
    """The deprecated rejoin flag, the join mode and the join rank offset agree."""
    if live.ep_join_mode is not None:
        ensure(
            live.elastic_ep_backend is not None,
            "--elastic-ep-join-mode requires --elastic-ep-backend to be set.",
        )
        if live.ep_join_mode == "scale":
            ensure(
                live.node_rank == 1,
                "Elastic EP scale-up requires one joining TP group at "
                f"--node-rank 1 (got {live.node_rank}).",
            )
            ensure(
                live.ep_join_rank_offset > 0,
                "Elastic EP scale joiners require "
                "--elastic-ep-join-rank-offset set to the current "
                "effective EP size.",
            )
    if live.ep_join_rank_offset != 0:
        ensure(
            live.ep_join_mode == "scale",
            "--elastic-ep-join-rank-offset is only valid with "
            "--elastic-ep-join-mode scale.",
        )
        ensure(live.ep_join_rank_offset >= 0, "elastic EP join rank offset must be >= 0.")
    if live.max_ep_size is not None:
        ensure(
            live.elastic_ep_backend is not None,
            "--max-ep-size requires --elastic-ep-backend to be set.",
        )
        ensure(live.max_ep_size > 0, "--max-ep-size must be a positive integer.")


def _initial_size_checks(live: Live) -> None:
    """A joiner names the primary's launch size; a primary defaults it to its TP size."""
    if live.ep_join_mode == "scale":
        ensure(
            live.elastic_ep_initial_size is not None,
            "Elastic EP scale joiners require --elastic-ep-initial-size "
            "set to the primary deployment's launch-time EP size.",
        )
        ensure(
            live.elastic_ep_initial_size <= live.ep_join_rank_offset,
            "--elastic-ep-initial-size cannot exceed the current EP size "
            f"(initial={live.elastic_ep_initial_size}, "
            f"current={live.ep_join_rank_offset}).",
        )
        join_target = live.ep_join_rank_offset + live.tp_size
        ensure(
            join_target <= live.max_ep_size,
            "Elastic EP joining group exceeds --max-ep-size "
            f"(join_target={join_target}, max_ep_size={live.max_ep_size}).",
        )
        if live.tp_size == 1:
            ensure(
                live.moe_dense_tp_size == 1,
                "A single-rank Elastic EP joining group requires "
                "--moe-dense-tp-size 1.",
            )
    else:
        if live.elastic_ep_initial_size is None:
            live.declare(elastic_ep_initial_size=live.tp_size)
        ensure(
            live.elastic_ep_initial_size == live.tp_size,
            "The primary --elastic-ep-initial-size must equal its "
            f"launch-time TP size ({live.tp_size}).",
        )
    ensure(live.elastic_ep_initial_size > 0, "--elastic-ep-initial-size must be positive.")


def _world_layout_checks(live: Live, ray: bool) -> None:
    """After scale-up EP, TP and the attention DP group must all be WORLD."""
    ensure(
        live.load_balance_method == "round_robin",
        "Elastic EP scale-up requires --load-balance-method round_robin; "
        "load-aware methods "
        "require global-rank load snapshots after scale "
        f"(got {live.load_balance_method}).",
    )
    if not ray:
        ensure(
            live.elastic_ep_backend == "mooncake",
            "Elastic EP runtime scale-up requires --elastic-ep-backend "
            f"mooncake (got elastic_ep_backend={live.elastic_ep_backend}).",
        )
    ensure(
        live.pp_size == 1,
        "Elastic EP scale-up requires --pp-size 1 "
        f"(got pp_size={live.pp_size}); WORLD must not span PP stages.",
    )
    ensure(
        graphs.decode_disabled(live) and graphs.prefill_disabled(live),
        "Elastic EP runtime scale-up requires decode and prefill CUDA "
        "graphs to be disabled.",
    )
    ensure(
        live.enable_dp_attention,
        "Elastic EP scale-up requires --enable-dp-attention; without it "
        "the TP group is not equivalent to WORLD and the post-scale "
        "collective path is invalid.",
    )
    ensure(
        live.enable_dp_lm_head,
        "Elastic EP scale-up requires --enable-dp-lm-head so output "
        "projection does not depend on the joining group's TP size.",
    )
    ensure(
        live.attn_cp_size == 1,
        "Elastic EP scale-up requires --attn-cp-size 1 "
        f"(got attn_cp_size={live.attn_cp_size}).",
    )
    ensure(
        live.moe_dp_size == 1,
        "Elastic EP scale-up requires --moe-dp-size 1 "
        f"(got moe_dp_size={live.moe_dp_size}).",
    )
    ensure(
        live.ep_size == live.tp_size,
        "Elastic EP scale-up requires ep_size == tp_size "
        f"(got ep_size={live.ep_size}, tp_size={live.tp_size}); EP, TP "
        "and the attention DP group must all coincide with WORLD.",
    )
    ensure(
        live.dp_size == live.tp_size,
        "Elastic EP scale-up requires dp_size == tp_size "
        f"(got dp_size={live.dp_size}, tp_size={live.tp_size}).",
    )
    if ray:
        ensure(
            live.moe_a2a_backend in RAY_SCALE_A2A_BACKENDS,
            "Elastic EP scale-up with --elastic-ep-backend ray requires "
            "--moe-a2a-backend none or nixl "
            f"(got moe_a2a_backend={live.moe_a2a_backend}).",
        )
    else:
        ensure(
            live.moe_a2a_backend == "nixl",
            "Elastic EP scale-up requires --moe-a2a-backend nixl "
            f"(got moe_a2a_backend={live.moe_a2a_backend}).",
        )


def _scale_up_checks(live: Live) -> None:
    """Runtime scale-up (``--max-ep-size`` above the local TP size) invariants."""
    ray = live.elastic_ep_backend == "ray"
    ensure(live.elastic_ep_scale_timeout > 0, "--elastic-ep-scale-timeout must be greater than zero.")
    ensure(
        live.tokenizer_worker_num == 1,
        "Elastic EP runtime scale-up currently requires "
        "--tokenizer-worker-num 1.",
    )
    if not ray:
        ensure(not live.use_ray, "Elastic EP runtime scale-up does not support --use-ray.")
    ensure(
        not live.enable_elastic_expert_backup,
        "Elastic EP runtime scale-up does not support "
        "--enable-elastic-expert-backup.",
    )
    live.declare(enable_dp_attention_local_control_broadcast=True)
    _initial_size_checks(live)
    _world_layout_checks(live, ray)


@rule(
    "_handle_elastic_ep",
    overrides=(
        "ep_join_mode",
        "eplb_algorithm",
        "mooncake_ib_device",
        "enable_dp_attention_local_control_broadcast",
        "elastic_ep_initial_size",
    ),
)
def handle_elastic_ep(view, model, platform):
    """Elastic EP needs PP 1 and elasticity-aware EPLB; runtime scale-up needs a WORLD-shaped DP-attention layout.

    FLOTILLA DEVIATION: ``--elastic-ep-backend ray`` (flotilla's own backend,
    absent from SGLang) may scale up under Ray: the ``--use-ray`` and
    ``--elastic-ep-backend mooncake`` requirements do not apply to it, and it
    accepts ``--moe-a2a-backend none`` or ``nixl`` since it grows EP through its
    own communicator. Every other scale-up invariant, and every rule and
    message for SGLang's backends, is unchanged.
    """
    live = Live(view)
    if view.elastic_ep_rejoin:
        if view.ep_join_mode is None:
            live.declare(ep_join_mode="recover")
        else:
            ensure(
                view.ep_join_mode == "recover",
                "--elastic-ep-rejoin (deprecated) conflicts with "
                f"--elastic-ep-join-mode {view.ep_join_mode}.",
            )
    if view.elastic_ep_backend is not None:
        if view.enable_eplb:
            if view.eplb_algorithm == "auto":
                live.declare(eplb_algorithm="elasticity_aware")
            ensure(
                live.eplb_algorithm in ELASTIC_EPLB_ALGORITHMS,
                "Elastic EP requires eplb_algorithm to be set to 'auto' or "
                "'elasticity_aware(_hierarchical)'.",
            )
        ensure(view.pp_size == 1, "PP size should be set to 1 under elastic EP")
        if view.elastic_ep_backend == "mooncake":
            live.declare(mooncake_ib_device=_normalised_ib_devices(view.mooncake_ib_device))
    _join_mode_checks(live)
    scaling = (
        view.elastic_ep_backend is not None
        and view.max_ep_size is not None
        and view.max_ep_size > view.tp_size
    )
    if view.elastic_ep_initial_size is not None:
        ensure(
            scaling,
            "--elastic-ep-initial-size is only valid for an Elastic EP "
            "deployment with --max-ep-size larger than its local TP size.",
        )
    if scaling:
        _scale_up_checks(live)
    return live.out

