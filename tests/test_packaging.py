"""The distribution installs one import root, ``flotilla``, and nothing bare; a CPU install gets a CPU torch."""

import json
import os
import platform
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def test_editable_install_exposes_the_subpackages_under_flotilla():
    # NOTE: a bare name may be another distribution's (transformers brings Hugging Face's
    # `kernels`, installed in site-packages, which may sit inside the checkout's .venv); none
    # may resolve to one of the checkout's own folders.
    names = ("resolution", "kernels", "serve", "cluster", "deploy")
    code = (
        "import importlib.util as u, json, flotilla.resolution, flotilla.deploy.cli;"
        f"print(json.dumps([str(s.origin) for s in map(u.find_spec, {names!r}) if s is not None]))"
    )
    # Run from a neutral directory so the checkout itself is not on sys.path.
    out = subprocess.run([sys.executable, "-c", code], cwd="/", capture_output=True, text=True, check=True)
    found = json.loads(out.stdout)
    ours = [origin for origin in found if any(origin.startswith(str(REPO / name)) for name in names)]
    assert ours == [], ours


@pytest.fixture(scope="module")
def wheel_names(tmp_path_factory):
    """The file names inside the wheel built from this checkout (offline: no index, no build isolation)."""
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", str(out), str(REPO)],
        check=True,
        capture_output=True,
        env={**os.environ, "PIP_NO_INDEX": "1"},
        timeout=120,
    )
    (wheel,) = out.glob("flotilla-*.whl")
    return zipfile.ZipFile(wheel).namelist()


def test_built_wheel_holds_only_the_flotilla_package(wheel_names):
    roots = {n.split("/")[0] for n in wheel_names if not n.startswith("flotilla-")}
    assert roots == {"flotilla"}, roots
    assert "flotilla/resolution/engine.py" in wheel_names
    assert "flotilla/deploy/cli.py" in wheel_names
    assert not any(n.startswith("flotilla/tests/") for n in wheel_names)


def test_built_wheel_ships_no_benchmark_or_profiler_script(wheel_names):
    # NOTE: benchmarks/ (scenario scripts) and benchmarks/dev/ (profilers) run from a checkout;
    # `flotilla bench` itself (deploy/bench*.py) ships.
    scripts = {p.name for p in (REPO / "benchmarks").rglob("*") if p.suffix in {".py", ".sh"}}
    assert {"serve_bench.py", "run_h200.sh", "decode_profile.py"} <= scripts
    shipped = {n.rsplit("/", 1)[-1] for n in wheel_names}
    assert not scripts & shipped, sorted(scripts & shipped)
    assert not [n for n in wheel_names if "benchmarks" in n.split("/")[:-1]]
    assert "flotilla/deploy/bench.py" in wheel_names


# --- The CPU install (constraints/cpu.txt) ---------------------------------------------------

CPU_CONSTRAINTS = REPO / "constraints" / "cpu.txt"
PLATFORMS = {
    "linux-x86_64": {"platform_system": "Linux", "sys_platform": "linux", "platform_machine": "x86_64"},
    "linux-aarch64": {"platform_system": "Linux", "sys_platform": "linux", "platform_machine": "aarch64"},
    "macos-arm64": {"platform_system": "Darwin", "sys_platform": "darwin", "platform_machine": "arm64"},
    "windows-amd64": {"platform_system": "Windows", "sys_platform": "win32", "platform_machine": "AMD64"},
}


def _torch_pins(environment):
    from packaging.requirements import Requirement

    lines = [line.strip() for line in CPU_CONSTRAINTS.read_text().splitlines()]
    reqs = [Requirement(line) for line in lines if line and not line.startswith("#")]
    return [str(r.specifier) for r in reqs if r.name == "torch" and (r.marker is None or r.marker.evaluate(environment))]


@pytest.mark.parametrize("name", sorted(PLATFORMS))
def test_cpu_constraints_pin_one_cpu_torch_per_platform(name):
    # NOTE: PyPI's Linux torch 2.13.0 (x86_64 and aarch64) is the CUDA 13 build; only the
    # local version +cpu (PyTorch's CPU index, or a local wheel) is the CPU one.
    expected = "==2.13.0+cpu" if name.startswith("linux") else "==2.13.0"
    assert _torch_pins(PLATFORMS[name]) == [expected]


def _fake_torch_wheel(folder, version, requires=()):
    """A metadata-only wheel named torch, enough for pip's resolver."""
    info = f"torch-{version}.dist-info"
    files = {
        "torch/__init__.py": "",
        f"{info}/METADATA": "\n".join(
            ["Metadata-Version: 2.1", "Name: torch", f"Version: {version}", *(f"Requires-Dist: {r}" for r in requires)]
        )
        + "\n",
        f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    files[f"{info}/RECORD"] = "".join(f"{n},,\n" for n in files) + f"{info}/RECORD,,\n"
    with zipfile.ZipFile(folder / f"torch-{version}-py3-none-any.whl", "w") as whl:
        for n, text in files.items():
            whl.writestr(n, text)


def _resolve_torch_offline(links, constraints):
    """pip's choice of torch from `links` alone (no index, no pip config), or None when it finds none."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env["PIP_CONFIG_FILE"] = os.devnull  # NOTE: skips the global config too, where --isolated does not
    cmd = [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--no-deps", "--quiet"]
    cmd += ["--no-index", "--find-links", str(links), "--report", "-", *constraints, "torch"]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    if out.returncode != 0:
        return None
    (item,) = json.loads(out.stdout)["install"]
    return item["metadata"]["version"]


@pytest.mark.skipif(platform.system() != "Linux", reason="the +cpu pin applies on Linux")
def test_cpu_constraints_refuse_the_cuda_torch_rather_than_fall_back(tmp_path):
    cuda = tmp_path / "cuda"
    both = tmp_path / "both"
    cuda.mkdir()
    both.mkdir()
    nvidia = ['nvidia-cudnn-cu13==9.20.0.48; platform_system == "Linux"']
    _fake_torch_wheel(cuda, "2.13.0", nvidia)
    _fake_torch_wheel(both, "2.13.0", nvidia)
    _fake_torch_wheel(both, "2.13.0+cpu")
    pinned = ["-c", str(CPU_CONSTRAINTS)]
    # Without the pins pip takes PyPI's (CUDA) wheel; with them it takes only the CPU one, or none.
    assert _resolve_torch_offline(cuda, []) == "2.13.0"
    assert _resolve_torch_offline(cuda, pinned) is None
    assert _resolve_torch_offline(both, pinned) == "2.13.0+cpu"
