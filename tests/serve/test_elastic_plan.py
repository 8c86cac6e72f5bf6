"""Elastic EP's plan, without Ray: every joining group's config resolved for real (a tiny
Qwen3-MoE config, the CPU platform), its refusals, and the autoscaler's options. (The scaler,
the driver and the admin routes: test_elastic_scaler.py; live: test_elastic_ep_live.py.)

Oracle: the joiner resolved directly from SGLang's joiner flags (the contract's example
command)."""

from __future__ import annotations

import pickle

import pytest

from flotilla.cluster.engine.dp_scheduler import can_grow_elastic_ep
from flotilla.resolution import ArgumentError, ModelFacts, ResolutionError, ServerArgs, preset, resolve
from flotilla.serve.plan import elastic_plan_for
from flotilla.serve.types import ElasticEPPlan
from flotilla.serve.ep_autoscale_driver import elastic_autoscale_options
from flotilla.serve.types import ElasticAutoscaleOptions, ServeOptions

from helpers.tiny_moe import save_tiny_qwen3_moe

ELASTIC = dict(
    tp_size=1, dp_size=1, ep_size=1, enable_dp_attention=True, enable_dp_lm_head=True,
    elastic_ep_backend="ray", disable_cuda_graph=True,
)  # fmt: skip


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-qwen3-moe-elastic")
    save_tiny_qwen3_moe(path)
    return str(path)


@pytest.fixture(scope="module")
def cpu():
    return preset("cpu")


def primary(moe_dir, cpu, **fields):
    from flotilla.serve.plan import resolve_pool

    given = {"model_path": moe_dir, **ELASTIC, **fields}
    return given, resolve_pool(given, cpu)[0]


# -- the plan, resolved for real -------------------------------------------------------------


def test_every_join_of_the_range_is_resolved_as_the_joiner_flags_say(moe_dir, cpu):
    given, config = primary(moe_dir, cpu, max_ep_size=3)
    plan = elastic_plan_for(given, config, cpu)
    assert (plan.initial_size, plan.max_ep_size, plan.scale_timeout_s) == (1, 3, 600.0)
    assert sorted(plan.joiner_configs) == [(1, 2), (1, 3), (2, 3)]
    for (current, new), joiner in plan.joiner_configs.items():
        k = new - current
        assert (joiner.tp_size, joiner.dp_size, joiner.ep_size) == (k, k, k)
        assert (joiner.ep_join_mode, joiner.node_rank, joiner.ep_join_rank_offset) == ("scale", 1, current)
        assert joiner.elastic_ep_initial_size == 1 and joiner.max_ep_size == 3
        # The oracle: SGLang's joiner flags on top of the user's, resolved directly.
        flags = dict(ELASTIC, max_ep_size=3, tp_size=k, dp_size=k, ep_size=k, ep_join_mode="scale", node_rank=1,
                     ep_join_rank_offset=current, elastic_ep_initial_size=1)  # fmt: skip
        if k == 1:
            flags["moe_dense_tp_size"] = 1
        from flotilla.cluster.models.sources import resolve_model_source

        facts = ModelFacts.from_hf_config(resolve_model_source(moe_dir).config_dict)
        assert joiner == resolve(ServerArgs.create(model_path=moe_dir, **flags), facts, cpu), (current, new)
    assert plan.joiner_configs[(1, 2)].moe_dense_tp_size == 1  # a one-rank joiner
    assert plan.joiner_config(2, 3) is plan.joiner_configs[(2, 3)]
    assert pickle.loads(pickle.dumps(plan)) == plan  # NOTE: it travels to the replica in ServeOptions


def test_the_platform_is_probed_once_for_every_joiner(moe_dir, cpu, monkeypatch):
    import flotilla.serve.plan as plan_module

    calls = []
    monkeypatch.setattr(plan_module, "probe_for_workers", lambda: calls.append(1) or cpu)
    given, config = primary(moe_dir, cpu, max_ep_size=3)
    assert len(elastic_plan_for(given, config).joiner_configs) == 3
    assert calls == [1]


def test_a_deployment_that_cannot_grow_has_no_plan(moe_dir, cpu):
    from flotilla.serve.plan import resolve_pool

    plain = resolve_pool({"model_path": moe_dir}, cpu)[0]
    assert not can_grow_elastic_ep(plain) and elastic_plan_for({"model_path": moe_dir}, plain, cpu) is None
    given, fixed = primary(moe_dir, cpu, max_ep_size=1)  # NOTE: max == tp: nothing to grow into
    assert not can_grow_elastic_ep(fixed) and elastic_plan_for(given, fixed, cpu) is None


def test_a_joiner_flag_on_the_primary_is_refused_by_name(moe_dir, cpu):
    given, config = primary(moe_dir, cpu, max_ep_size=2)
    with pytest.raises(ValueError, match="--node-rank 1 describes a joining group"):
        elastic_plan_for({**given, "node_rank": 1}, config, cpu)


def test_a_joining_group_that_does_not_resolve_names_the_flag_and_the_reason(moe_dir, cpu, monkeypatch):
    import flotilla.serve.plan as plan_module

    real = plan_module.joiner_fields

    def broken(given, current, new, initial):
        fields = real(given, current, new, initial)
        return {**fields, "dp_size": fields["tp_size"] + 1} if new == 3 else fields  # NOTE: dp != tp

    monkeypatch.setattr(plan_module, "joiner_fields", broken)
    given, config = primary(moe_dir, cpu, max_ep_size=3)
    with pytest.raises(ValueError) as err:
        elastic_plan_for(given, config, cpu)
    message = str(err.value)
    assert "--max-ep-size 3" in message and "from 1 to 3 ranks" in message and "dp_size" in message, message
    assert not isinstance(err.value, ResolutionError)


def test_the_plan_names_the_range_it_covers():
    plan = ElasticEPPlan(initial_size=1, max_ep_size=2, scale_timeout_s=5.0, joiner_configs={})
    with pytest.raises(ValueError, match="from 2 to 3 ranks.*max_ep_size=2"):
        plan.joiner_config(2, 3)


def test_serving_options_refuse_what_an_elastic_deployment_cannot_do(moe_dir, cpu):
    from flotilla.serve.app import build_app, engine_capacity
    from flotilla.serve.plan import serve_options

    given, config = primary(moe_dir, cpu, max_ep_size=2, max_running_requests=8)
    plan = elastic_plan_for(given, config, cpu)
    options = serve_options(config, model=moe_dir, elastic_plan=plan)
    assert options.num_replicas == 1 and options.elastic_plan is plan
    # Serve's bound leaves room for the grown group (a joined DP rank runs 8 more).
    queued = options.max_queued_requests
    assert engine_capacity(config, options) == 16 + queued
    assert engine_capacity(config, serve_options(config, model=moe_dir)) == 8 + queued
    with pytest.raises(ValueError, match="--num-replicas 2: an elastic EP deployment runs one engine replica"):
        serve_options(config, model=moe_dir, elastic_plan=plan, num_replicas=2)
    with pytest.raises(ValueError, match="--num-replicas 3"):
        build_app(config, ServeOptions(num_replicas=3, elastic_plan=plan))
    with pytest.raises(ValueError, match="--elastic-ep-autoscale needs an elastic EP deployment"):
        serve_options(config, model=moe_dir, elastic_autoscale=ElasticAutoscaleOptions(enabled=True))


def test_autoscale_options_parse_with_off_and_refuse_by_flag():
    options = elastic_autoscale_options(
        {"elastic_ep_autoscale": "true", "elastic_ep_autoscale_kv_usage": "off", "elastic_ep_autoscale_window": "12",
         "elastic_ep_autoscale_step": 2, "elastic_ep_autoscale_interval": None}
    )  # fmt: skip
    assert (options.enabled, options.kv_usage_threshold, options.window_s, options.step) == (True, None, 12.0, 2)
    assert options.interval_s == ElasticAutoscaleOptions().interval_s
    policy = options.policy(4)
    assert (policy.max_ep_size, policy.window_s, policy.kv_usage_threshold) == (4, 12.0, None)
    assert elastic_autoscale_options({}) == ElasticAutoscaleOptions()
    for args, words in (
        ({"elastic_ep_autoscale_window": "5"}, "--elastic-ep-autoscale-window need --elastic-ep-autoscale"),
        ({"elastic_ep_autoscale": "true", "elastic_ep_autoscale_ttft_p90": "soon"},
         "--elastic-ep-autoscale-ttft-p90 expects a number or off, got 'soon'"),
        ({"elastic_ep_autoscale": "true", "elastic_ep_autoscale_kv_usage": "1.5"}, "--elastic-ep-autoscale-kv-usage"),
        ({"elastic_ep_autoscale": "true", "elastic_ep_autoscale_interval": "0"}, "--elastic-ep-autoscale-interval"),
    ):  # fmt: skip
        with pytest.raises(ArgumentError) as err:
            elastic_autoscale_options(args)
        assert words in str(err.value), str(err.value)
