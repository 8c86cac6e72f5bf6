"""``flotilla serve``'s flags for prefill/decode disaggregation and each pool's placement
strategy: parsing, the refusals (exit status 2, a message naming the flag and value, nothing
started), and the two configs PD resolves (one per role). No Ray here: every case is decided before Ray is touched."""

import pytest

from flotilla.deploy.serve_cmd import parse_serve_args, plan_for, run_serve, split_pd_mode
from flotilla.resolution import ArgumentError
from flotilla.serve.plan import check_pd_options, pd_server_fields
from flotilla.serve.types import ServeOptions


def test_pd_mode_is_taken_out_of_the_server_flags():
    assert split_pd_mode(["--disaggregation-mode", "pd", "--port", "1"]) == (["--port", "1"], True)
    assert split_pd_mode(["--disaggregation-mode=null"]) == ([], False)
    assert split_pd_mode(["--port", "1"]) == (["--port", "1"], False)


def test_pd_flags_parse():
    opts, given = parse_serve_args(
        ["--disaggregation-mode", "pd", "--prefill-replicas", "2", "--decode-replicas", "3", "--prefill-tp", "2",
         "--kv-transport", "ray", "--kv-load-failure-policy", "fail", "--max-total-tokens", "2048"]
    )  # fmt: skip
    assert opts.pd and (opts.prefill_replicas, opts.decode_replicas, opts.prefill_tp, opts.decode_tp) == (2, 3, 2, None)
    assert (opts.kv_transport, opts.kv_load_failure_policy) == ("ray", "fail")
    assert given == {"max_total_tokens": 2048}


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--disaggregation-mode", "prefill"], ["--disaggregation-mode prefill", "pd"]),
        (["--disaggregation-mode"], ["--disaggregation-mode", "value"]),
        (["--prefill-replicas", "2"], ["--prefill-replicas 2", "--disaggregation-mode pd"]),
        (["--disaggregation-mode", "pd", "--decode-tp", "0"], ["--decode-tp", "0"]),
        (["--disaggregation-mode", "pd", "--num-replicas", "2"], ["--num-replicas", "--prefill-replicas"]),
    ],
)
def test_bad_pd_flags_are_refused(argv, words):
    with pytest.raises(ArgumentError) as err:
        parse_serve_args(argv)
    assert all(w in str(err.value) for w in words), str(err.value)


def test_stream_batch_ms_reaches_the_options_and_bad_values_are_refused(tmp_path):
    opts, given = parse_serve_args(["--stream-batch-ms", "20", "--max-total-tokens", "2048"])
    assert plan_for(opts, given).options.stream_batch_ms == 20.0
    opts, given = parse_serve_args(["--max-total-tokens", "2048"])
    assert plan_for(opts, given).options.stream_batch_ms == 50.0  # NOTE: Ray Serve LLM's default
    for value in ("-1", "1001", "nan"):
        with pytest.raises(ArgumentError, match=f"--stream-batch-ms must be in \\[0, 1000\\] ms, got {value}"):
            parse_serve_args(["--stream-batch-ms", value])
    with pytest.raises(ValueError, match=r"stream_batch_ms must be in \[0, 1000\] ms \(got stream_batch_ms=-5.0\)"):
        ServeOptions(stream_batch_ms=-5.0)


def test_placement_strategy_flags_reach_each_pool_s_options():
    opts, given = parse_serve_args(["--max-total-tokens", "2048"])
    assert plan_for(opts, given).options.placement_strategy == {"engine": "PACK"}  # NOTE: the default
    opts, given = parse_serve_args(["--placement-strategy", "spread", "--max-total-tokens", "2048"])
    assert plan_for(opts, given).options.placement_strategy == {"engine": "SPREAD"}
    opts, given = parse_serve_args(["--disaggregation-mode", "pd", "--max-total-tokens", "2048"])
    assert plan_for(opts, given).options.placement_strategy == {"prefill": "PACK", "decode": "PACK"}
    opts, given = parse_serve_args(
        ["--disaggregation-mode", "pd", "--placement-strategy", "STRICT_PACK", "--decode-placement-strategy", "strict_spread",
         "--max-total-tokens", "2048"]
    )  # fmt: skip
    options = plan_for(opts, given).options
    assert options.placement_strategy == {"prefill": "STRICT_PACK", "decode": "STRICT_SPREAD"}
    assert (options.placement_strategy_for("prefill"), options.placement_strategy_for("decode")) == ("STRICT_PACK", "STRICT_SPREAD")


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--placement-strategy", "tight"], ["--placement-strategy='tight'", "PACK, STRICT_PACK, SPREAD, STRICT_SPREAD"]),
        (["--placement-strategy", ""], ["--placement-strategy=''", "must be one of"]),
        (["--prefill-placement-strategy", "SPREAD"], ["--prefill-placement-strategy SPREAD", "--disaggregation-mode pd"]),
        (["--decode-placement-strategy", "PACK"], ["--decode-placement-strategy PACK", "--disaggregation-mode pd"]),
        (["--disaggregation-mode", "pd", "--decode-placement-strategy", "x"], ["--decode-placement-strategy='x'", "must be one of"]),
    ],
)
def test_bad_placement_strategy_flags_are_refused(argv, words, capsys):
    with pytest.raises(ArgumentError) as err:
        parse_serve_args(argv)
    assert all(w in str(err.value) for w in words), str(err.value)
    assert run_serve(argv) == 2
    assert words[0] in capsys.readouterr().err


def test_run_serve_exits_2_on_a_bad_pd_flag(capsys):
    assert run_serve(["--disaggregation-mode", "decode"]) == 2
    assert "--disaggregation-mode decode" in capsys.readouterr().err


def test_each_pool_resolves_for_its_role():
    opts, given = parse_serve_args(
        ["--disaggregation-mode", "pd", "--prefill-tp", "3", "--decode-tp", "1", "--max-total-tokens", "2048"]
    )
    plan = plan_for(opts, given)
    prefill, decode, options = plan.config, plan.decode_config, plan.options
    assert (prefill.disaggregation_mode, prefill.tp_size) == ("prefill", 3)
    assert (decode.disaggregation_mode, decode.tp_size) == ("decode", 1)
    assert prefill.disaggregation_transfer_backend == decode.disaggregation_transfer_backend == "nixl"
    assert decode.disable_radix_cache is False  # NOTE: the decode pool keeps its prefix cache
    assert (options.disaggregation_mode, options.prefill_replicas, options.decode_replicas) == ("pd", 1, 1)
    assert options.kv_transport in ("nixl", "ray")
    check_pd_options(prefill, decode, options)  # a valid setup passes


def test_a_transfer_backend_flotilla_lacks_is_refused():
    with pytest.raises(ValueError, match="--disaggregation-transfer-backend mooncake"):
        pd_server_fields({"disaggregation_transfer_backend": "mooncake"})
    with pytest.raises(ValueError, match="--prefill-tp must be an integer >= 1"):
        pd_server_fields({}, prefill_tp=0)


def test_pools_that_disagree_on_the_kv_layout_are_refused():
    opts, given = parse_serve_args(["--disaggregation-mode", "pd", "--max-total-tokens", "2048"])
    plan = plan_for(opts, given)
    prefill, decode, options = plan.config, plan.decode_config, plan.options
    _, decode_16 = pd_server_fields({"max_total_tokens": 2048, "page_size": 32})
    from flotilla.cluster.platform import probe
    from flotilla.serve.plan import resolve_pool

    other, _ = resolve_pool(decode_16, probe())
    with pytest.raises(ValueError, match="page_size"):
        check_pd_options(prefill, other, options)
    # NOTE: KV blocks move as bytes, so a float8 pool cannot feed a bf16 one (nor the reverse).
    _, decode_fp8 = pd_server_fields({"max_total_tokens": 2048, "kv_cache_dtype": "fp8_e4m3"})
    fp8, _ = resolve_pool(decode_fp8, probe())
    with pytest.raises(ValueError, match="must agree on kv_cache_dtype: prefill 'auto', decode 'fp8_e4m3'"):
        check_pd_options(prefill, fp8, options)
    import dataclasses

    with pytest.raises(ValueError, match="--decode-replicas must be an integer >= 1"):
        check_pd_options(prefill, decode, dataclasses.replace(options, decode_replicas=0))
    with pytest.raises(ValueError, match="--kv-transport"):
        check_pd_options(prefill, decode, dataclasses.replace(options, kv_transport="tcp"))


# -- elastic EP -----------------------------------------------------------------------------

ELASTIC_FLAGS = [
    "--tp", "1", "--dp", "1", "--ep", "1", "--enable-dp-attention", "--enable-dp-lm-head",
    "--elastic-ep-backend", "ray", "--max-ep-size", "2", "--disable-cuda-graph",
]  # fmt: skip


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    from helpers.tiny_moe import save_tiny_qwen3_moe

    path = tmp_path_factory.mktemp("tiny-qwen3-moe-serve-cmd")
    save_tiny_qwen3_moe(path)
    return str(path)


def test_the_issue_invocation_resolves_the_primary_and_its_joiner(moe_dir):
    opts, given = parse_serve_args(["--model", moe_dir, *ELASTIC_FLAGS])
    assert not opts.elastic_autoscale.enabled
    plan = plan_for(opts, given)
    config, decode, options = plan.config, plan.decode_config, plan.options
    plan = options.elastic_plan
    assert decode is None and options.num_replicas == 1 and (config.tp_size, config.max_ep_size) == (1, 2)
    assert (plan.initial_size, plan.max_ep_size, sorted(plan.joiner_configs)) == (1, 2, [(1, 2)])
    joiner = plan.joiner_config(1, 2)
    assert (joiner.ep_join_mode, joiner.ep_join_rank_offset, joiner.model_path) == ("scale", 1, config.model_path)
    from flotilla.deploy.serve_cmd import ready_message

    assert "elastic EP 1 to 2 ranks" in ready_message("http://127.0.0.1:1", options, config)


def test_autoscale_flags_parse_and_pass_through(moe_dir):
    opts, given = parse_serve_args(
        ["--model", moe_dir, *ELASTIC_FLAGS, "--elastic-ep-autoscale", "--elastic-ep-autoscale-interval", "1",
         "--elastic-ep-autoscale-ttft-p90", "off", "--elastic-ep-autoscale-window", "20",
         "--elastic-ep-autoscale-cooldown", "40", "--elastic-ep-autoscale-waiting-per-rank", "2"]
    )  # fmt: skip
    auto = opts.elastic_autoscale
    assert (auto.enabled, auto.interval_s, auto.ttft_p90_threshold_s, auto.window_s, auto.cooldown_s) == (
        True, 1.0, None, 20.0, 40.0,
    )  # fmt: skip
    assert auto.waiting_per_rank_threshold == 2.0 and "elastic_ep_autoscale" not in given
    plan = plan_for(opts, given)
    _, _, options = plan.config, plan.decode_config, plan.options
    assert options.elastic_autoscale == auto


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--elastic-ep-autoscale-window", "30"], ["--elastic-ep-autoscale-window", "need --elastic-ep-autoscale"]),
        (["--elastic-ep-autoscale", "--elastic-ep-autoscale-kv-usage", "lots"],
         ["--elastic-ep-autoscale-kv-usage expects a number or off", "'lots'"]),
        (["--elastic-ep-autoscale", "--elastic-ep-autoscale-cooldown", "-1"], ["--elastic-ep-autoscale-cooldown", "-1"]),
    ],
)  # fmt: skip
def test_bad_autoscale_flags_are_refused(argv, words, capsys):
    with pytest.raises(ArgumentError) as err:
        parse_serve_args(argv)
    assert all(w in str(err.value) for w in words), str(err.value)
    assert run_serve(argv) == 2
    assert words[0] in capsys.readouterr().err


def test_what_an_elastic_deployment_cannot_do_exits_2(moe_dir, capsys):
    assert run_serve(["--model", moe_dir, *ELASTIC_FLAGS, "--num-replicas", "2"]) == 2
    assert "--num-replicas 2: an elastic EP deployment runs one engine replica" in capsys.readouterr().err
    assert run_serve(["--model", moe_dir, "--elastic-ep-autoscale"]) == 2
    assert "--elastic-ep-autoscale needs an elastic EP deployment" in capsys.readouterr().err
    assert run_serve(["--model", moe_dir, *ELASTIC_FLAGS, "--node-rank", "1"]) == 2
    # NOTE: refused by the runtime-support table, before anything is resolved.
    assert "--node-rank 1 is not supported by flotilla's runtime: flotilla places ranks through Ray" in capsys.readouterr().err


# -- wide-EP PD pools -------------------------------------------------------------------------


def test_each_pd_pool_takes_its_own_dp_attention_and_ep_sizes(moe_dir):
    """--prefill-dp/--prefill-ep beside --prefill-tp: the prefill pool DP attention 2 x EP 2,
    the decode pool plain TP 2 (heterogeneous pools); each resolves for its role."""
    opts, given = parse_serve_args(
        ["--model", moe_dir, "--disaggregation-mode", "pd", "--prefill-tp", "2", "--prefill-dp", "2",
         "--prefill-ep", "2", "--decode-tp", "2", "--max-total-tokens", "2048"]
    )  # fmt: skip
    assert (opts.prefill_dp, opts.prefill_ep, opts.decode_dp, opts.decode_ep) == (2, 2, None, None)
    plan = plan_for(opts, given)
    prefill, decode = plan.config, plan.decode_config
    assert (prefill.tp_size, prefill.dp_size, prefill.enable_dp_attention, prefill.ep_size) == (2, 2, True, 2)
    assert (decode.tp_size, decode.enable_dp_attention, decode.ep_size) == (2, False, 1)
    check_pd_options(prefill, decode, plan.options)
    # --decode-dp 1 turns a shared --enable-dp-attention off for that pool alone.
    prefill_fields, decode_fields = pd_server_fields(
        {"tp_size": 2, "dp_size": 2, "enable_dp_attention": True}, decode_dp=1
    )  # fmt: skip
    assert (prefill_fields["dp_size"], prefill_fields["enable_dp_attention"]) == (2, True)
    assert (decode_fields["dp_size"], decode_fields["enable_dp_attention"]) == (1, False)


def test_bad_pool_sizes_and_token_sharded_pools_are_refused(moe_dir):
    import json

    from flotilla.resolution import ResolvedConfig

    with pytest.raises(ArgumentError, match="--decode-ep 2 needs --disaggregation-mode pd"):
        parse_serve_args(["--decode-ep", "2"])
    with pytest.raises(ValueError, match=r"--prefill-dp 3 must divide the prefill pool's TP size 2 \(--prefill-tp"):
        pd_server_fields({}, prefill_tp=2, prefill_dp=3)
    with pytest.raises(ValueError, match="--decode-ep must be an integer >= 1 \\(got 0\\)"):
        pd_server_fields({}, decode_ep=0)
    opts, given = parse_serve_args(["--model", moe_dir, "--disaggregation-mode", "pd", "--max-total-tokens", "2048"])
    plan = plan_for(opts, given)
    # NOTE: DCP ranks read their token shards of whole blocks: only the decode pool may run it.
    with pytest.raises(ValueError, match=r"the prefill pool: decode context parallelism \(dcp_size=2\) is the decode pool's"):
        values = json.loads(plan.config.to_json())
        values["config"]["dcp_size"] = 2
        check_pd_options(ResolvedConfig.from_json(json.dumps(values)), plan.decode_config, plan.options)
    prefill_fields, decode_fields = pd_server_fields({"dcp_size": 2, "tp_size": 2})
    assert "dcp_size" not in prefill_fields and decode_fields["dcp_size"] == 2


def test_a_dcp_decode_pool_sets_the_prefill_page_to_its_logical_block(tmp_path):
    """--decode-dcp 2: the decode pool shards the MLA latent by token over 2 ranks (16-token
    local blocks, 32-token logical blocks); the prefill pool runs whole 32-token blocks, so
    the two pools' blocks pair up one to one; the decode pool keeps the chunk cache (the
    seeds allow PD decode DCP only with it)."""
    import json

    from helpers.resolution_configs import DEEPSEEK_V3_BF16

    (tmp_path / "config.json").write_text(json.dumps(DEEPSEEK_V3_BF16))
    opts, given = parse_serve_args(
        ["--model", str(tmp_path), "--disaggregation-mode", "pd", "--decode-tp", "2", "--decode-dcp", "2",
         "--max-total-tokens", "2048"]
    )  # fmt: skip
    plan = plan_for(opts, given)
    prefill, decode = plan.config, plan.decode_config
    assert (decode.tp_size, decode.dcp_size, prefill.dcp_size) == (2, 2, 1)
    from flotilla.cluster.engine.limits import block_size_for

    assert prefill.page_size == 2 * block_size_for(decode) == 32
    assert not decode.disaggregation_decode_enable_radix_cache
    check_pd_options(prefill, decode, plan.options)


# -- faults and autoscaling options ------------------------------------------------------------


def test_migration_and_shutdown_flags_reach_the_options():
    opts, given = parse_serve_args(["--migration-limit", "0", "--shutdown-timeout", "30", "--max-total-tokens", "2048"])
    options = plan_for(opts, given).options
    assert (options.migration_limit, options.shutdown_timeout_s) == (0, 30.0)
    opts, given = parse_serve_args(["--max-total-tokens", "2048"])
    assert (plan_for(opts, given).options.migration_limit, plan_for(opts, given).options.shutdown_timeout_s) == (1, 10.0)
    with pytest.raises(ArgumentError, match="--migration-limit must be at least 0, got -1"):
        parse_serve_args(["--migration-limit", "-1"])
    with pytest.raises(ValueError, match=r"shutdown_timeout_s must be a number of seconds in \[0, 3600\] \(got shutdown_timeout_s=4000"):
        ServeOptions(shutdown_timeout_s=4000.0)


def test_autoscaling_config_sets_the_engine_deployment_s_count():
    from flotilla.serve.app import engine_deployment_options, ingress_deployment_options, total_engine_replicas

    scaling = '{"min_replicas": 1, "max_replicas": 3, "target_ongoing_requests": 4}'
    opts, given = parse_serve_args(["--autoscaling-config", scaling, "--max-total-tokens", "2048"])
    plan = plan_for(opts, given)
    engine = engine_deployment_options(plan.config, plan.options)
    assert "num_replicas" not in engine and engine["autoscaling_config"]["max_replicas"] == 3
    # Queue bounds are sized for the most replicas the pool may run.
    fixed = plan_for(*parse_serve_args(["--num-replicas", "3", "--max-total-tokens", "2048"]))
    assert engine["max_queued_requests"] == engine_deployment_options(fixed.config, fixed.options)["max_queued_requests"]
    assert ingress_deployment_options(plan.config, plan.options)["max_ongoing_requests"] == (
        ingress_deployment_options(fixed.config, fixed.options)["max_ongoing_requests"]
    )
    assert total_engine_replicas(plan.options) == 3


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--autoscaling-config", "{nope"], ["--autoscaling-config must be a JSON object"]),
        (["--autoscaling-config", "[1]"], ["--autoscaling-config must be a JSON object"]),
        (["--autoscaling-config", '{"min_replicas": 1}'], ["--autoscaling-config", "with max_replicas"]),
        (["--autoscaling-config", '{"max_replicas": 2, "target": 1}'], ["'target' are not Serve autoscaling_config fields"]),
        (["--autoscaling-config", '{"min_replicas": 0, "max_replicas": 2}'], ["min_replicas must be at least 1 (got 0)"]),
        (["--autoscaling-config", '{"min_replicas": 3, "max_replicas": 2}'], ["is not a Serve autoscaling_config", "min_replicas"]),
        (["--autoscaling-config", '{"max_replicas": 2}', "--num-replicas", "2"], ["--num-replicas fixes the count"]),
        (["--decode-autoscaling-config", '{"max_replicas": 2}'], ["--decode-autoscaling-config needs --disaggregation-mode pd"]),
        (["--disaggregation-mode", "pd", "--autoscaling-config", '{"max_replicas": 2}'], ["--autoscaling-config scales the colocated pool"]),
    ],
)  # fmt: skip
def test_bad_autoscaling_configs_are_refused_naming_the_flag(argv, words, capsys):
    assert run_serve([*argv, "--max-total-tokens", "2048"]) == 2
    err = capsys.readouterr().err
    assert all(w in err for w in words), err


def test_each_pd_pool_takes_its_own_autoscaling_config():
    from flotilla.serve.app import engine_deployment_options

    argv = ["--disaggregation-mode", "pd", "--max-total-tokens", "2048", "--decode-autoscaling-config", '{"max_replicas": 2}']
    plan = plan_for(*parse_serve_args(argv))
    assert engine_deployment_options(plan.config, plan.options, "prefill")["num_replicas"] == 1
    assert engine_deployment_options(plan.decode_config, plan.options, "decode")["autoscaling_config"] == {"max_replicas": 2}
