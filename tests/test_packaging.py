"""The distribution installs one import root, ``flotilla``, and nothing bare."""

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def test_editable_install_exposes_the_subpackages_under_flotilla():
    code = (
        "import importlib.util as u, flotilla.resolution, flotilla.deploy.cli;"
        "print(all(u.find_spec(n) is None for n in ('resolution', 'kernels', 'serve', 'cluster', 'deploy')))"
    )
    # Run from a neutral directory so the checkout itself is not on sys.path.
    out = subprocess.run([sys.executable, "-c", code], cwd="/", capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "True"


@pytest.mark.timeout(300)
def test_built_wheel_holds_only_the_flotilla_package(tmp_path):
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", str(tmp_path), str(REPO)],
        check=True,
        capture_output=True,
    )
    (wheel,) = tmp_path.glob("flotilla-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    roots = {n.split("/")[0] for n in names if not n.startswith("flotilla-")}
    assert roots == {"flotilla"}, roots
    assert "flotilla/resolution/engine.py" in names
    assert "flotilla/deploy/cli.py" in names
    assert not any(n.startswith("flotilla/tests/") for n in names)
