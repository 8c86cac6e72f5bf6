"""Reading and checking the reference resolution scenarios in ../shared.

The scenario files are reference data kept outside the repository; tests read
them at test time from ``$FLOTILLA_SHARED/resolution-scenarios`` (default: the
``shared`` folder beside the checkout).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
SHARED = Path(os.environ.get("FLOTILLA_SHARED", REPO.parent / "shared"))
SCENARIO_DIR = SHARED / "resolution-scenarios"


def scenario_files() -> list[Path]:
    return sorted(SCENARIO_DIR.glob("*.json"))


def run_cli(argv: list[str]) -> tuple[int, str, str]:
    """Run ``flotilla resolve`` in-process; return (exit code, stdout, stderr)."""
    from flotilla.deploy.resolve_cmd import run_resolve

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = run_resolve(argv)
    return code, out.getvalue(), err.getvalue()


def scenario_argv(scenario: dict, model_dir: Path) -> list[str]:
    argv = ["--model", str(model_dir), "--platform", scenario["platform"]]
    for key, value in (scenario.get("platform_set") or {}).items():
        argv += ["--platform-set", f"{key}={value}"]
    return argv + list(scenario["args"]) + ["--format", "json"]


_TRUE = {"true", "1"}
_FALSE = {"false", "0"}


def _norm_env(value: Any) -> Any:
    text = str(value).strip().lower()
    if text in _TRUE:
        return True
    if text in _FALSE:
        return False
    return str(value)


def values_match(expected: Any, actual: Any, present: bool) -> bool:
    """The README's comparison: null matches null or absent; numbers numerically;
    booleans strictly; strings and lists exactly."""
    if expected is None:
        return actual is None or not present
    if not present:
        return False
    if isinstance(expected, bool) or isinstance(actual, bool):
        return type(expected) is type(actual) and expected == actual
    if isinstance(expected, (int, float)) and isinstance(actual, (int, float)):
        return float(expected) == float(actual)
    return expected == actual


def check(scenario: dict, tmp: Path) -> list[str]:
    """Problems found resolving ``scenario`` (empty when it matches)."""
    model_dir = tmp / scenario["name"]
    model_dir.mkdir(parents=True, exist_ok=True)
    (model_dir / "config.json").write_text(json.dumps(scenario["hf_config"]))
    code, out, err = run_cli(scenario_argv(scenario, model_dir))
    if scenario.get("error") is not None:
        problems = []
        if code == 0:
            problems.append("expected a rejection, but it resolved")
        if scenario["error"].lower() not in err.lower():
            problems.append(f"stderr lacks {scenario['error']!r}; got: {err.strip()[:400]!r}")
        return problems
    if code != 0:
        return [f"exit {code}: {err.strip()[:600]}"]
    result = json.loads(out)
    config, env = result["config"], result["env"]
    problems = []
    for field, expected in scenario["expect"].items():
        present = field in config
        actual = config.get(field)
        if not values_match(expected, actual, present):
            problems.append(f"{field}: expected {expected!r}, got {actual!r}")
    for key, expected in (scenario.get("env") or {}).items():
        if key not in env or _norm_env(env[key]) != _norm_env(expected):
            problems.append(f"env {key}: expected {expected!r}, got {env.get(key)!r}")
    return problems
