"""Resolution speed: time per scenario (in-process) and `flotilla resolve` start-up.

    python benchmarks/resolve_bench.py [--repeat 20] [--cli-runs 5] [--json OUT]

Reads the reference scenarios from $FLOTILLA_SHARED/resolution-scenarios (default:
the `shared` folder beside the checkout). Reports the median of `--repeat`
in-process resolutions per scenario, and the median wall time of `--cli-runs`
fresh `flotilla resolve` processes (interpreter start included), beside a bare
`python -c pass` in the same run so the ratio is meaningful on a noisy machine.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from flotilla.deploy.bench_env import write_result
from flotilla.resolution import ModelFacts, ServerArgs, preset, resolve
from flotilla.resolution.errors import ResolutionError
from flotilla.resolution.platform import apply_flips

REPO = Path(__file__).resolve().parents[1]
SCENARIOS = Path(os.environ.get("FLOTILLA_SHARED", REPO.parent / "shared")) / "resolution-scenarios"


def time_scenario(scenario: dict, repeat: int) -> float:
    platform = preset(scenario["platform"])
    if scenario.get("platform_set"):
        platform = apply_flips(platform, {k: str(v) for k, v in scenario["platform_set"].items()})
    model = ModelFacts.from_hf_config(scenario["hf_config"])
    args = ServerArgs.from_cli(["--model-path", "/models/m", *scenario["args"]])
    samples = []
    for _ in range(repeat):
        start = time.perf_counter()
        try:
            resolve(args, model, platform)
        except ResolutionError:
            pass
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def time_process(argv: list[str], runs: int) -> float:
    samples = []
    for _ in range(runs):
        start = time.perf_counter()
        subprocess.run(argv, capture_output=True, check=False)
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--cli-runs", type=int, default=5)
    parser.add_argument("--json", default=None, help="also write the results as JSON here")
    opts = parser.parse_args()

    rows = []
    for path in sorted(SCENARIOS.glob("*.json")):
        scenario = json.loads(path.read_text())
        rows.append((path.stem, time_scenario(scenario, opts.repeat)))
    print(f"{'scenario':<36} median resolve (ms)")
    for name, seconds in rows:
        print(f"{name:<36} {seconds * 1e3:8.2f}")
    per = [s for _, s in rows]
    print(f"{'all ' + str(len(rows)) + ' scenarios':<36} median {statistics.median(per) * 1e3:.2f} ms, max {max(per) * 1e3:.2f} ms")

    with tempfile.TemporaryDirectory() as tmp:
        first = json.loads(sorted(SCENARIOS.glob("*.json"))[0].read_text())
        (Path(tmp) / "config.json").write_text(json.dumps(first["hf_config"]))
        exe = shutil.which("flotilla") or str(Path(sys.executable).with_name("flotilla"))
        cli = time_process([exe, "resolve", "--model", tmp, "--platform", "h100", "--format", "json"], opts.cli_runs)
        bare = time_process([sys.executable, "-c", "pass"], opts.cli_runs)
    print(f"`flotilla resolve` process: median {cli * 1e3:.0f} ms; bare python: {bare * 1e3:.0f} ms; ratio {cli / bare:.1f}x")

    if opts.json:
        results = {
            "resolve_ms": {name: round(s * 1e3, 3) for name, s in rows},
            "cli_ms": round(cli * 1e3, 1),
            "bare_python_ms": round(bare * 1e3, 1),
        }
        write_result(opts.json, results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
