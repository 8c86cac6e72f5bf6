"""`flotilla resolve`: the command contract other tools rely on."""

import json
import subprocess
import sys

import pytest

from helpers.scenarios import run_cli

LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 512,
    "intermediate_size": 1024,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "num_hidden_layers": 2,
    "vocab_size": 1000,
    "max_position_embeddings": 2048,
}


@pytest.fixture
def model_dir(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(LLAMA))
    return tmp_path


def test_json_format_prints_config_env_and_provenance(model_dir):
    code, out, err = run_cli(["--model", str(model_dir), "--platform", "h100", "--tp", "2", "--format", "json"])
    assert code == 0, err
    data = json.loads(out)
    assert set(data) == {"config", "env", "provenance"}
    assert data["config"]["tp_size"] == 2
    assert data["config"]["model_path"] == str(model_dir)
    changed = {c["field"] for c in data["provenance"]}
    assert "attention_backend" in changed


def test_model_may_be_the_config_file_itself(model_dir):
    code, out, _ = run_cli(["--model", str(model_dir / "config.json"), "--format", "json"])
    assert code == 0 and json.loads(out)["config"]["device"] == "cpu"


def test_table_format_and_explain(model_dir):
    code, out, _ = run_cli(["--model", str(model_dir), "--platform", "b200", "--explain"])
    assert code == 0
    assert "[parallelism]" in out and "tp_size" in out
    assert "explanation" in out and "attention_backend:" in out and " by " in out


def test_unknown_flag_exits_2_naming_the_closest(model_dir):
    code, _, err = run_cli(["--model", str(model_dir), "--moe-runner-backnd", "auto"])
    assert code == 2
    assert "--moe-runner-backnd" in err and "did you mean --moe-runner-backend" in err


def test_bad_choice_exits_2_listing_choices(model_dir):
    code, _, err = run_cli(["--model", str(model_dir), "--kv-cache-dtype", "fp7"])
    assert code == 2 and "invalid choice: 'fp7'" in err and "fp8_e4m3" in err


def test_unreadable_and_invalid_config_name_the_file(tmp_path):
    code, _, err = run_cli(["--model", str(tmp_path / "missing")])
    assert code == 2 and "missing" in err and "config.json" in err
    bad = tmp_path / "config.json"
    bad.write_text("{not json")
    code, _, err = run_cli(["--model", str(tmp_path)])
    assert code == 2 and str(bad) in err and "not valid JSON" in err
    bad.write_text("[1, 2]")
    code, _, err = run_cli(["--model", str(tmp_path)])
    assert code == 2 and "JSON object" in err


def test_unknown_architecture_resolves_with_generic_rules_and_says_so(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({**LLAMA, "architectures": ["TotallyNewForCausalLM"]}))
    code, out, err = run_cli(["--model", str(tmp_path), "--platform", "h100", "--format", "json"])
    assert code == 0
    assert "TotallyNewForCausalLM is not a known model" in err
    assert json.loads(out)["config"]["attention_backend"] is not None


def test_platform_flags(model_dir, tmp_path):
    code, _, err = run_cli(["--model", str(model_dir), "--platform", "tpu9"])
    assert code == 2 and "unknown platform 'tpu9'" in err
    code, _, err = run_cli(["--model", str(model_dir), "--platform-set", "flashinfer"])
    assert code == 2 and "KEY=VALUE" in err
    facts = tmp_path / "facts.json"
    facts.write_text(json.dumps({"preset": "h100", "flashinfer": False}))
    code, out, _ = run_cli(["--model", str(model_dir), "--platform-file", str(facts), "--format", "json"])
    assert code == 0


def test_missing_model_is_a_clear_error():
    code, _, err = run_cli(["--platform", "h100"])
    assert code == 2 and "--model PATH is required" in err


def test_the_installed_command_runs_without_torch_or_ray(model_dir):
    code = (
        "import sys; from flotilla.deploy.cli import main; rc = main(sys.argv[1:]);"
        "assert 'torch' not in sys.modules and 'ray' not in sys.modules, 'heavy import';"
        "raise SystemExit(rc)"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, "resolve", "--model", str(model_dir), "--format", "json"],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["config"]["tp_size"] == 1


def test_cli_entry_point_exit_codes():
    proc = subprocess.run([sys.executable, "-m", "flotilla.deploy.cli", "frobnicate"], capture_output=True, text=True)
    assert proc.returncode == 2 and "unknown command 'frobnicate'" in proc.stderr
