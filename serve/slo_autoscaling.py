"""A latency-SLO autoscaling policy for Serve (``ttft_slo_s`` / ``itl_slo_s`` in a pool's
``--*autoscaling-config``): Dynamo's planner and Ray's TTFT policy scale the prefill pool on
time to first token and the decode pool on inter-token latency; so does this.

Each engine replica reports, to Serve's autoscaler, the p90 of the TTFTs and of the ITLs it
observed since its last report (:meth:`~flotilla.serve.engine_replica.EngineReplica.
record_autoscaling_stats`: ``ttft_p90_s``, ``itl_p90_s``, and ``ongoing`` requests), which
Serve averages per replica over ``look_back_period_s``. :class:`SLOPolicy` (Serve calls it on
its control loop, in the controller) then decides:

- one replica more while some replica's p90 is above the SLO;
- one replica less while every replica's p90 is below ``low_ratio`` x the SLO (idle replicas
  report 0, so sustained idleness scales down);
- else the current count, within ``min_replicas`` and ``max_replicas``.

Serve makes a change once it has been asked for through ``upscale_delay_s`` (or
``downscale_delay_s``): its cooldowns. Every change of ask is logged with its inputs (the
controller's log). A
pool's config names the SLOs; :func:`~flotilla.serve.types.serve_autoscaling_config` makes them
the ``policy`` Serve imports (:data:`~flotilla.serve.types.SLO_POLICY_PATH`).
"""

from __future__ import annotations

import logging
from typing import Any, Mapping

# NOTE: the policy runs in Serve's controller, whose log is Serve's logger's.
logger = logging.getLogger("ray.serve")

# The metrics a replica reports (record_autoscaling_stats) and the SLO key each is held to.
METRIC_OF_SLO = {"ttft_slo_s": "ttft_p90_s", "itl_slo_s": "itl_p90_s"}
# The policy state's record of its last ask (a change of ask is logged once).
LAST_ASK_KEY = "flotilla_slo_last_ask"
# A replica counts as calm below this share of the SLO (hysteresis between up and down).
DEFAULT_LOW_RATIO = 0.5


class SLOPolicy:
    """Serve's autoscaling policy for latency SLOs (see the module docstring).

    Args:
        ttft_slo_s: the p90 time to first token to keep (None: not held to one).
        itl_slo_s: the p90 inter-token latency to keep (None: not held to one).
        low_ratio: below this share of every SLO a replica counts as calm.
    """

    def __init__(self, ttft_slo_s: float | None = None, itl_slo_s: float | None = None, low_ratio: float = DEFAULT_LOW_RATIO):
        self.slos = {key: float(value) for key, value in (("ttft_slo_s", ttft_slo_s), ("itl_slo_s", itl_slo_s)) if value is not None}
        if not self.slos or any(not value > 0 for value in self.slos.values()):
            raise ValueError(f"SLOPolicy needs ttft_slo_s and/or itl_slo_s > 0 seconds (got {self.slos!r})")
        if not 0 < low_ratio < 1:
            raise ValueError(f"low_ratio must be in (0, 1) (got low_ratio={low_ratio!r})")
        self.low_ratio = float(low_ratio)

    def __call__(self, ctx: Any) -> tuple[int, dict[str, Any]]:
        """``(replicas wanted, the policy state)`` for Serve's :class:`AutoscalingContext`: one
        more while some replica is above an SLO, one fewer while every replica is calm, else
        the current count. NOTE: Serve (2.60) wraps a custom policy in its own delays, keeping
        their counters in the policy state: a change is made once the policy has asked for it
        for ``upscale_delay_s`` (``downscale_delay_s``), so this asks afresh at every call and
        hands the state back as it came."""
        state = dict(ctx.policy_state or {})
        current = int(ctx.current_num_replicas)
        worst = self._worst_ratios(ctx.aggregated_metrics or {})
        wanted = current
        if any(ratio > 1.0 for ratio in worst.values()):
            wanted = current + 1
        elif worst and all(ratio < self.low_ratio for ratio in worst.values()):
            wanted = current - 1
        wanted = max(int(ctx.capacity_adjusted_min_replicas), min(int(ctx.capacity_adjusted_max_replicas), wanted))
        if (current, wanted) != state.get(LAST_ASK_KEY):
            if wanted != current:
                logger.info(
                    "SLO autoscaling of %s asks %d -> %d replicas (p90 / SLO per metric, worst replica: %s; SLOs %s)",
                    ctx.deployment_name, current, wanted, {k: round(v, 3) for k, v in worst.items()}, self.slos,
                )  # fmt: skip
            state[LAST_ASK_KEY] = (current, wanted)
        return wanted, state

    def _worst_ratios(self, metrics: Mapping[str, Mapping[Any, float]]) -> dict[str, float]:
        """Per SLO'd metric, the highest replica's p90 over its SLO (metrics no replica reported yet are left out)."""
        ratios = {}
        for slo, metric in METRIC_OF_SLO.items():
            if slo in self.slos and metrics.get(metric):
                ratios[metric] = max(float(v) for v in metrics[metric].values()) / self.slos[slo]
        return ratios


