"""``flotilla serve --config FILE``: a Serve config file read as ``flotilla serve``'s flags.

The file's args take the mapping ``build()`` takes (so ``serve deploy`` and ``flotilla
serve --config`` agree on the same file), command-line flags win, values without a flag
(``placement``, ``placement_strategy``, ``max_body_bytes``) reach the ServeOptions, and every
refusal names the file, the key and the value (exit status 2, nothing started). No Ray
cluster here."""

import json
import textwrap

import pytest

from flotilla.deploy.config_file import (
    CARRIED_ARGS,
    config_argv,
    load_serve_config,
    split_config_flag,
)
from flotilla.deploy.serve_cmd import build_parser, parse_serve_args, plan_for, run_serve
from flotilla.resolution import ArgumentError
from flotilla.resolution.platform import PRESETS
from helpers.resolution_configs import LLAMA_128K

LLAMA = LLAMA_128K


def write_config(path, args, http="host: 127.0.0.1\n  port: 8100", extra_apps=""):
    """A Serve config file with one flotilla application holding ``args``."""
    body = textwrap.indent(json.dumps(args, indent=2), " " * 6)
    path.write_text(
        f"proxy_location: HeadOnly\nhttp_options:\n  {http}\napplications:\n"
        f"  - name: flotilla\n    route_prefix: /\n    import_path: flotilla.serve.app:build\n    args:\n{body}\n"
        + extra_apps
    )
    return path


@pytest.fixture
def model_dir(tmp_path):
    path = tmp_path / "llama"
    path.mkdir()
    (path / "config.json").write_text(json.dumps(LLAMA))
    return path


def test_the_config_flag_is_taken_out_of_argv():
    assert split_config_flag(["--config", "a.yaml", "--port", "1"]) == ("a.yaml", ["--port", "1"])
    assert split_config_flag(["--port", "1", "--config=b.yaml"]) == ("b.yaml", ["--port", "1"])
    assert split_config_flag(["--port", "1"]) == (None, ["--port", "1"])
    with pytest.raises(ArgumentError, match="--config expects a file"):
        split_config_flag(["--config"])
    with pytest.raises(ArgumentError, match=r"--config given twice \(a.yaml and b.yaml\)"):
        split_config_flag(["--config", "a.yaml", "--config", "b.yaml"])


def test_args_and_http_options_become_flags_and_the_command_line_wins(tmp_path, model_dir):
    file = write_config(
        tmp_path / "c.yaml",
        {"model": str(model_dir), "tp_size": 2, "max_running_requests": 64, "router": "prefix-affinity",
         "num_replicas": 2, "replica_num_cpus": 0.25, "max_body_bytes": 4096, "enable_metrics": True,
         "placement": {"engine": {"gpu_nodes": 0.001}}},
    )  # fmt: skip
    opts, given = parse_serve_args(["--config", str(file)])
    assert given == {
        "model_path": str(model_dir), "tp_size": 2, "max_running_requests": 64, "enable_metrics": True,
        "host": "127.0.0.1", "port": 8100,
    }  # fmt: skip
    assert (opts.router, opts.num_replicas, opts.replica_num_cpus) == ("prefix-affinity", 2, 0.25)
    assert (opts.config, opts.placement, opts.max_body_bytes) == (str(file), {"engine": {"gpu_nodes": 0.001}}, 4096)

    opts, given = parse_serve_args(["--config", str(file), "--tp", "4", "--port", "9000", "--router", "least-loaded"])
    assert (given["tp_size"], given["port"], given["host"], opts.router) == (4, 9000, "127.0.0.1", "least-loaded")
    assert opts.num_replicas == 2  # NOTE: what the command line does not name stays the file's

    plan = plan_for(opts, given, PRESETS["cpu"])

    config, _, options = plan.config, plan.decode_config, plan.options
    assert (config.tp_size, config.port, config.max_running_requests) == (4, 9000, 64)
    assert (options.num_replicas, options.max_body_bytes) == (2, 4096)
    assert options.placement == {"engine": {"gpu_nodes": 0.001}}


def test_the_file_means_what_build_takes(tmp_path, model_dir):
    """``serve deploy`` (build()) and ``flotilla serve --config`` read the same server fields."""
    from flotilla.serve.app import parse_build_args

    args = {"model": str(model_dir), "tp_size": 2, "context_length": "32k", "dtype": "bfloat16",
            "enable_metrics": "true", "served_model_name": "llama", "router": "prefix-affinity"}  # fmt: skip
    file = write_config(tmp_path / "c.yaml", args, http="port: 8100")
    _, given = parse_serve_args(["--config", str(file)])
    built, option_args = parse_build_args(args)
    assert given == {**built, "port": 8100}
    assert option_args == {"router": "prefix-affinity"}


def test_pd_and_autoscale_args_reach_their_options(tmp_path, model_dir):
    pd = write_config(
        tmp_path / "pd.yaml",
        {"model": str(model_dir), "disaggregation_mode": "pd", "prefill_replicas": 2, "decode_tp": 2,
         "kv_transport": "ray", "kv_load_failure_policy": "fail",
         "placement": {"prefill": {"p": 0.001}, "decode": {"d": 0.001}}},
    )  # fmt: skip
    opts, given = parse_serve_args(["--config", str(pd)])
    assert opts.pd and (opts.prefill_replicas, opts.decode_tp, opts.kv_transport) == (2, 2, "ray")
    assert opts.kv_load_failure_policy == "fail" and "disaggregation_mode" not in given
    plan = plan_for(opts, given, PRESETS["h200"])
    prefill, decode, options = plan.config, plan.decode_config, plan.options
    assert (prefill.tp_size, decode.tp_size, options.prefill_replicas) == (1, 2, 2)
    assert options.placement == {"prefill": {"p": 0.001}, "decode": {"d": 0.001}}

    auto = write_config(
        tmp_path / "auto.yaml",
        {"elastic_ep_autoscale": True, "elastic_ep_autoscale_window": 20, "elastic_ep_autoscale_kv_usage": "off"},
    )
    opts, _ = parse_serve_args(["--config", str(auto)])
    assert (opts.elastic_autoscale.enabled, opts.elastic_autoscale.window_s) == (True, 20.0)
    assert opts.elastic_autoscale.kv_usage_threshold is None


def test_the_placement_strategy_key_reaches_the_options_and_the_flags_win(tmp_path, model_dir):
    every = write_config(tmp_path / "every.yaml", {"model": str(model_dir), "placement_strategy": "spread"})
    opts, given = parse_serve_args(["--config", str(every)])
    assert plan_for(opts, given, PRESETS["cpu"]).options.placement_strategy == {"engine": "SPREAD"}
    opts, given = parse_serve_args(["--config", str(every), "--placement-strategy", "STRICT_PACK"])
    assert plan_for(opts, given, PRESETS["cpu"]).options.placement_strategy == {"engine": "STRICT_PACK"}

    pd = write_config(
        tmp_path / "pd.yaml",
        {"model": str(model_dir), "disaggregation_mode": "pd", "placement_strategy": {"prefill": "STRICT_SPREAD"}},
    )
    opts, given = parse_serve_args(["--config", str(pd)])
    assert plan_for(opts, given, PRESETS["cpu"]).options.placement_strategy == {"prefill": "STRICT_SPREAD", "decode": "PACK"}
    opts, given = parse_serve_args(["--config", str(pd), "--decode-placement-strategy", "SPREAD"])
    assert opts.placement_strategies == {"prefill": "STRICT_SPREAD", "decode": "SPREAD"}
    opts, given = parse_serve_args(["--config", str(pd), "--placement-strategy", "PACK"])
    assert opts.placement_strategies == {"prefill": "PACK", "decode": "PACK"}


def test_every_build_option_has_a_flag_or_is_carried():
    """A serving option build() takes that ``flotilla serve`` has no flag for would be lost."""
    from flotilla.serve.app import OPTION_ARGS, PD_OPTION_ARGS
    from flotilla.serve.ep_autoscale_driver import AUTOSCALE_ARGS

    flags = {o for action in build_parser()._actions for o in action.option_strings}
    for name in (*OPTION_ARGS, *PD_OPTION_ARGS, *AUTOSCALE_ARGS):
        assert name in CARRIED_ARGS or "--" + name.replace("_", "-") in flags, name


def test_other_applications_and_overrides_are_noted(tmp_path):
    other = "  - name: other\n    route_prefix: /other\n    import_path: mypkg.app:app\n"
    file = write_config(tmp_path / "c.yaml", {"router": "least-loaded"}, extra_apps=other)
    config = load_serve_config(file)
    assert config.app_name == "flotilla" and len(config.notes) == 1
    assert "applications[1] ('other', mypkg.app:app) is not flotilla's" in config.notes[0]
    assert config_argv(config, build_parser()) == ["--router", "least-loaded", "--host", "127.0.0.1", "--port", "8100"]


@pytest.mark.parametrize(
    "text, words",
    [
        ("applications: [\n", ["not valid YAML"]),
        ("- a\n- b\n", ["a mapping with an 'applications' list", "list"]),
        ("applications:\n  - import_path: flotilla.serve.app:build\n    bogus_route: 1\n    route_prefix: 7\n",
         ["not a valid Serve config file", "route_prefix"]),
        ("applications:\n  - name: x\n    import_path: mypkg.app:app\n", ["found none", "flotilla.serve.app:build"]),
        ("applications:\n  - name: a\n    route_prefix: /a\n    import_path: flotilla.serve.app:build\n"
         "  - name: b\n    route_prefix: /b\n    import_path: flotilla.serve.app:build\n",
         ["expected exactly one", "applications[0] ('a')", "applications[1] ('b')"]),
    ],
)  # fmt: skip
def test_a_bad_file_is_refused_naming_it(tmp_path, capsys, text, words):
    file = tmp_path / "bad.yaml"
    file.write_text(text)
    with pytest.raises(ArgumentError) as err:
        load_serve_config(file)
    message = str(err.value)
    assert message.startswith(f"{file}: ") and all(w in message for w in words), message
    assert run_serve(["--config", str(file)]) == 2
    assert str(file) in capsys.readouterr().err


def test_a_missing_file_is_refused(tmp_path):
    with pytest.raises(ArgumentError, match=r"--config .*nope.yaml: the file does not exist"):
        parse_serve_args(["--config", str(tmp_path / "nope.yaml")])
    with pytest.raises(ArgumentError, match="the file is a directory"):
        parse_serve_args(["--config", str(tmp_path)])


@pytest.mark.parametrize(
    "args, words",
    [
        ({"tp_szie": 2}, ["args.tp_szie=2", "unknown argument 'tp_szie'", "tp_size"]),
        ({"tp_size": "two"}, ["args.tp_size='two'", "--tp-size", "'two'"]),
        ({"router": "random"}, ["args.router='random'", "invalid choice"]),
        ({"enable_metrics": "maybe"}, ["args.enable_metrics='maybe'", "true or false"]),
        ({"port": 9000}, ["args.port=9000", "http_options.port"]),
        ({"disaggregation_mode": "prefill"}, ["args.disaggregation_mode='prefill'", "use pd"]),
        ({"placement": {"prefil": {"x": 1}}}, ["args.placement=", "unknown group 'prefil'"]),
        ({"placement": {"decode": {"x": 0}}}, ["placement.decode.x must be a positive number"]),
        ({"placement_strategy": "tight"}, ["args.placement_strategy='tight'", "PACK, STRICT_PACK, SPREAD, STRICT_SPREAD"]),
        ({"placement_strategy": {"prefil": "PACK"}}, ["args.placement_strategy=", "unknown pool 'prefil'"]),
        ({"placement_strategy": {"decode": "loose"}}, ["args.placement_strategy=", "placement_strategy.decode='loose'"]),
        ({"placement_strategy": {"prefill": "SPREAD"}}, ["args.placement_strategy=", "only with disaggregation_mode pd"]),
        ({"placement_strategy": 2}, ["args.placement_strategy=2", "a mapping of pools"]),
        ({"max_body_bytes": -1}, ["args.max_body_bytes=-1", "positive integer"]),
        ({"elastic_ep_autoscale_kv_usage": "lots"}, ["args.elastic_ep_autoscale_kv_usage='lots'", "a number or off"]),
    ],
)  # fmt: skip
def test_a_bad_argument_names_the_file_key_and_value(tmp_path, capsys, args, words):
    file = write_config(tmp_path / "c.yaml", args)
    with pytest.raises(ArgumentError) as err:
        parse_serve_args(["--config", str(file)])
    message = str(err.value)
    assert message.startswith(f"{file}: ") and all(w in message for w in words), message
    assert run_serve(["--config", str(file)]) == 2
    assert f"flotilla serve: error: {file}: " in capsys.readouterr().err


def test_a_bad_http_port_names_http_options(tmp_path):
    file = write_config(tmp_path / "c.yaml", {}, http="port: -5")
    with pytest.raises(ArgumentError) as err:
        parse_serve_args(["--config", str(file)])
    assert str(err.value) == f"{file}: http_options.port=-5: a TCP port is between 1 and 65535"


def test_a_check_across_flags_names_the_file(tmp_path):
    file = write_config(tmp_path / "c.yaml", {"prefill_replicas": 2})
    with pytest.raises(ArgumentError) as err:
        parse_serve_args(["--config", str(file)])
    assert str(err.value) == f"{file} (its args as flags) with the command line: --prefill-replicas 2 needs --disaggregation-mode pd"
    opts, _ = parse_serve_args(["--config", str(file), "--disaggregation-mode", "pd"])  # the command line completes it
    assert opts.pd and opts.prefill_replicas == 2


def test_a_field_set_only_by_a_deprecated_switch_is_taken_by_its_field_name():
    """``disable_cuda_graph`` (the CLI's ``--disable-cuda-graph``) works in args as on the command line."""
    from flotilla.serve.app import parse_build_args

    assert parse_build_args({"disable_cuda_graph": True})[0] == {"disable_cuda_graph": True}
    assert parse_build_args({"disable_cuda_graph": "false"})[0] == {}
    with pytest.raises(ArgumentError, match="disable_cuda_graph expects true or false, got 'maybe'"):
        parse_build_args({"disable_cuda_graph": "maybe"})
