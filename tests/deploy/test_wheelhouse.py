"""``flotilla deploy wheelhouse``, offline: a tiny project whose dependency (and whose
extra's dependency) come from a local find-links folder goes through the builder's three
pip steps with ``--no-index``; the wheelhouse it produces then installs with ``--no-index``
into a ``--target`` folder and imports. Plus the command's argument errors. pip runs with
no config file and no PIP_* locations, so nothing but the test's folders is seen."""

import os
import subprocess
import sys
import textwrap
import zipfile

import pytest

from flotilla.deploy.cli import main
from flotilla.deploy.wheelhouse import (
    WheelhouseError,
    WheelhouseOptions,
    build_project_wheel,
    build_wheelhouse,
    default_project,
    parse_wheelhouse_args,
    wheel_metadata,
)
from flotilla.resolution import ArgumentError


@pytest.fixture(autouse=True)
def hermetic_pip(monkeypatch):
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    for name in ("PIP_FIND_LINKS", "PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL", "PIP_CONSTRAINT", "PIP_REQUIREMENT"):
        monkeypatch.delenv(name, raising=False)


def make_wheel(folder, name, version, body):
    """A minimal pure-Python wheel: one module ``name`` whose source is ``body``."""
    info = f"{name}-{version}.dist-info"
    files = {
        f"{name}/__init__.py": body,
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
        f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    path = folder / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as archive:
        for member, text in files.items():
            archive.writestr(member, text)
        archive.writestr(f"{info}/RECORD", "".join(f"{m},,\n" for m in [*files, f"{info}/RECORD"]))
    return path


def make_project(folder):
    """``tinyapp`` 0.3 (setuptools): needs ``tinydep==1.0``; its extra ``fast`` needs ``tinyfast``."""
    (folder / "tinyapp").mkdir(parents=True)
    (folder / "tinyapp" / "__init__.py").write_text("import tinydep\n\nANSWER = tinydep.VALUE + 1\n")
    (folder / "pyproject.toml").write_text(
        textwrap.dedent(
            """\
            [build-system]
            requires = ["setuptools>=61"]
            build-backend = "setuptools.build_meta"

            [project]
            name = "tinyapp"
            version = "0.3"
            dependencies = ["tinydep==1.0"]

            [project.optional-dependencies]
            fast = ["tinyfast>=2"]

            [tool.setuptools]
            packages = ["tinyapp"]
            """
        )
    )
    return folder


@pytest.fixture()
def links(tmp_path):
    folder = tmp_path / "links"
    folder.mkdir()
    make_wheel(folder, "tinydep", "1.0", "VALUE = 41\n")
    make_wheel(folder, "tinydep", "0.9", "VALUE = 0\n")  # NOTE: the pin must pick 1.0
    make_wheel(folder, "tinyfast", "2.0", "FAST = True\n")
    return folder


def test_the_wheelhouse_installs_offline_and_imports(tmp_path, links):
    project = make_project(tmp_path / "src")
    house_dir = tmp_path / "house"
    options = WheelhouseOptions(extras=("fast",), find_links=(str(links),), no_index=True)

    house = build_wheelhouse(house_dir, project, options)

    assert house.requirement == "tinyapp[fast]==0.3"
    assert house.pins == ("tinyapp[fast]==0.3", "tinydep==1.0", "tinyfast==2.0")
    assert sorted(p.name for p in house_dir.glob("*.whl")) == [
        "tinyapp-0.3-py3-none-any.whl", "tinydep-1.0-py3-none-any.whl", "tinyfast-2.0-py3-none-any.whl",
    ]  # fmt: skip
    lines = house.requirements_file.read_text().splitlines()
    assert [line for line in lines if not line.startswith("#")] == list(house.pins)
    assert any("pip install --no-index --find-links" in line for line in lines)

    target = tmp_path / "site"
    install = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-index", "--find-links", str(house_dir), "--target", str(target),
         "-r", str(house.requirements_file), "--disable-pip-version-check", "--quiet"],
        capture_output=True, text=True,
    )  # fmt: skip
    assert install.returncode == 0, install.stdout + install.stderr
    probe = subprocess.run(
        [sys.executable, "-c", "import tinyapp, tinyfast; print(tinyapp.ANSWER, tinyfast.FAST)"],
        capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(target)},
    )  # fmt: skip
    assert probe.stdout.split() == ["42", "True"], probe.stderr


def test_a_missing_dependency_names_the_step_and_the_package(tmp_path, links):
    (links / "tinyfast-2.0-py3-none-any.whl").unlink()
    project = make_project(tmp_path / "src")
    options = WheelhouseOptions(extras=("fast",), find_links=(str(links),), no_index=True)
    with pytest.raises(WheelhouseError) as err:
        build_wheelhouse(tmp_path / "house", project, options)
    message = str(err.value)
    assert "downloading the dependencies of tinyapp[fast]" in message and "tinyfast" in message, message
    assert "--find-links" in message  # the hint says what to do


def test_an_extra_the_project_lacks_is_named(tmp_path, links):
    project = make_project(tmp_path / "src")
    options = WheelhouseOptions(extras=("gpu",), find_links=(str(links),), no_index=True)
    with pytest.raises(WheelhouseError, match=r"tinyapp 0\.3 has no extra gpu \(it provides: fast\)"):
        build_wheelhouse(tmp_path / "house", project, options)


def test_flotillas_own_wheel_builds_offline_and_offers_the_gpu_extra(tmp_path):
    options = WheelhouseOptions(find_links=(str(tmp_path),), no_index=True)
    wheel = build_project_wheel(default_project(), tmp_path, options)
    name, version, extras = wheel_metadata(wheel)
    assert (name, "gpu" in extras) == ("flotilla", True)
    assert wheel.name == f"flotilla-{version}-py3-none-any.whl"


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--extra", "gpu"], ["DIR"]),
        (["d", "--python-version", "311"], ["--python-version", "'311'", "3.N"]),
        (["d", "--platform", "Linux x86"], ["--platform", "'Linux x86'", "manylinux_2_28_x86_64"]),
        (["d", "--no-index"], ["--no-index", "--find-links"]),
        (["d", "--find-links", "/no/such/dir"], ["--find-links /no/such/dir", "no such folder"]),
        (["d", "--constraint", "/no/such/file.txt"], ["--constraint /no/such/file.txt"]),
        (["d", "--extra", "g p u"], ["--extra", "'g p u'"]),
        (["d", "--project", "/"], ["--project /", "pyproject.toml"]),
        (["d", "--bogus"], ["--bogus"]),
    ],
)
def test_bad_arguments_are_refused(argv, words):
    with pytest.raises(ArgumentError) as err:
        parse_wheelhouse_args(argv)
    assert all(w in str(err.value) for w in words), str(err.value)


def test_the_defaults_target_this_python_on_manylinux():
    dest, project, options = parse_wheelhouse_args(["out", "--extra", "gpu"])
    assert (project / "pyproject.toml").is_file() and str(dest) == "out"
    assert options.extras == ("gpu",) and options.platform == "manylinux_2_28_x86_64"
    assert options.python_version == f"{sys.version_info.major}.{sys.version_info.minor}"


def test_the_cli_exits_2_with_the_reason(capsys):
    assert main(["deploy", "wheelhouse", "d", "--no-index"]) == 2
    assert "--no-index needs at least one --find-links" in capsys.readouterr().err
    assert main(["deploy", "nothing"]) == 2
    assert "unknown tool 'nothing'" in capsys.readouterr().err
    assert main(["deploy", "--help"]) == 0
    assert "wheelhouse" in capsys.readouterr().out
