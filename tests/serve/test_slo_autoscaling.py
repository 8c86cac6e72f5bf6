"""The latency-SLO autoscaling policy (flotilla.serve.slo_autoscaling) on Serve's context, and
the pool config that selects it."""

import importlib
from types import SimpleNamespace

import pytest

from flotilla.serve.slo_autoscaling import SLOPolicy
from flotilla.serve.types import SLO_POLICY_PATH, ServeOptions

DELAYS = SimpleNamespace(upscale_delay_s=2.0, downscale_delay_s=10.0)  # NOTE: Serve's to apply


def ctx(now, replicas, state, **metrics):
    return SimpleNamespace(
        deployment_name="decode", current_time=now, current_num_replicas=replicas, policy_state=state,
        aggregated_metrics={name: dict(enumerate(values)) for name, values in metrics.items()},
        config=DELAYS, capacity_adjusted_min_replicas=1, capacity_adjusted_max_replicas=3,
    )  # fmt: skip


def run(policy, steps):
    """Feed ``(time, replicas, {metric: per-replica values})`` steps; the counts asked for.
    (Serve applies the delays between asks and changes; the policy asks afresh each call.)"""
    state, asked = {}, []
    for now, replicas, metrics in steps:
        wanted, state = policy(ctx(now, replicas, state, **metrics))
        asked.append(wanted)
    return asked


def test_a_replica_above_its_slo_asks_for_one_more_and_calm_for_one_fewer():
    policy = SLOPolicy(itl_slo_s=0.05)
    slow, fine, idle = {"itl_p90_s": [0.08, 0.01]}, {"itl_p90_s": [0.03, 0.01]}, {"itl_p90_s": [0.0, 0.0]}
    # The worst replica counts; 0.6 of the SLO is neither hot nor calm (the hysteresis band).
    assert run(policy, [(0, 2, slow), (1, 2, fine), (2, 2, idle)]) == [3, 2, 1]
    # Never beyond the capacity-adjusted bounds.
    assert run(policy, [(0, 3, slow), (1, 1, idle)]) == [3, 1]


def test_serve_s_delay_counters_in_the_state_come_back_untouched():
    policy = SLOPolicy(ttft_slo_s=1.0)
    wanted, state = policy(ctx(0, 2, {"__decision_counters": 3, "__decision_timestamp": 12.5}, ttft_p90_s=[2.0, 0.0]))
    assert wanted == 3 and state["__decision_counters"] == 3 and state["__decision_timestamp"] == 12.5


def test_metrics_not_reported_yet_decide_nothing():
    assert run(SLOPolicy(ttft_slo_s=1.0), [(0, 2, {}), (100, 2, {})]) == [2, 2]


def test_bad_slos_are_refused():
    with pytest.raises(ValueError, match="needs ttft_slo_s and/or itl_slo_s > 0"):
        SLOPolicy()
    with pytest.raises(ValueError, match="low_ratio must be in"):
        SLOPolicy(ttft_slo_s=1, low_ratio=1.5)


def test_a_pool_config_with_slos_selects_the_policy_serve_imports():
    options = ServeOptions(autoscaling={"engine": {"max_replicas": 4, "ttft_slo_s": 0.5, "itl_slo_s": 0.05}})
    config = options.autoscaling_for("engine")
    assert config["policy"] == {"policy_function": SLO_POLICY_PATH, "policy_kwargs": {"ttft_slo_s": 0.5, "itl_slo_s": 0.05}}
    assert "ttft_slo_s" not in config
    module, name = SLO_POLICY_PATH.split(":")
    assert getattr(importlib.import_module(module), name) is SLOPolicy
    with pytest.raises(ValueError, match="ttft_slo_s must be a number of seconds > 0"):
        ServeOptions(autoscaling={"engine": {"max_replicas": 4, "ttft_slo_s": -1}})
