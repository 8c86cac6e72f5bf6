"""Every benchmark result JSON carries its provenance (``flotilla.deploy.bench_env``): git
commit and dirty flag, UTC date, the exact command line, the machine, the library versions."""

import json
import re
import shlex
import subprocess
import sys
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest

from flotilla.deploy import bench_env

REPO = Path(__file__).resolve().parents[2]
# Every file that may write a benchmark result (bench_env.py is the helper itself).
WRITERS = sorted({*REPO.glob("benchmarks/**/*.py"), *REPO.glob("deploy/bench*.py"), REPO / "deploy/loadgen.py"}
                 - {REPO / "deploy/bench_env.py"})  # fmt: skip


def _git(root, *args):
    cmd = ["git", "-C", str(root), "-c", "user.name=t", "-c", "user.email=t@example.invalid", *args]
    return subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.strip()


def assert_provenance(prov, command=None):
    """The fields every result must carry, with plausible values."""
    assert set(prov) >= {"git", "date", "command", "cwd", "machine", "versions"}
    assert set(prov["git"]) - {"from_file"} == {"commit", "dirty", "dirty_paths"}
    assert prov["git"]["commit"] is None or re.fullmatch(r"[0-9a-f]{40}", prov["git"]["commit"])
    date = datetime.fromisoformat(prov["date"])
    assert date.utcoffset() == timedelta(0) and abs(datetime.now(timezone.utc) - date) < timedelta(minutes=10)
    if command is not None:
        assert shlex.split(prov["command"]) == command
    machine = prov["machine"]
    assert machine["cpu_model"] and machine["cpu_cores"] >= 1 and machine["memory_bytes"] > 0
    assert machine["gpu"] is None or machine["gpu"]["count"] >= 1
    versions = prov["versions"]
    assert set(versions) >= {"python", "torch", "ray", "transformers", "flashinfer", "triton", "nixl"}
    assert versions["python"] == ".".join(map(str, sys.version_info[:3]))
    assert versions["torch"] and versions["ray"] and versions["transformers"]


def test_a_benchmark_script_records_its_provenance_end_to_end(tmp_path):
    out = tmp_path / "resolve.json"
    command = [sys.executable, str(REPO / "benchmarks" / "resolve_bench.py"), "--repeat", "1", "--cli-runs", "1",
               "--json", str(out)]  # fmt: skip
    subprocess.run(command, check=True, capture_output=True, text=True, timeout=240)
    data = json.loads(out.read_text())
    assert list(data)[0] == "provenance" and data["cli_ms"] > 0
    prov = data["provenance"]
    assert_provenance(prov, command)
    assert prov["git"]["commit"] == _git(REPO, "rev-parse", "HEAD")
    assert prov["git"]["dirty"] == bool(_git(REPO, "status", "--porcelain", "--untracked-files=no"))


def test_git_state_reads_commit_and_dirty_flag(tmp_path):
    root = tmp_path.resolve()
    _git(root, "init", "-q")
    (root / "a.txt").write_text("one\n")
    _git(root, "add", "a.txt")
    _git(root, "commit", "-q", "-m", "first")
    head = _git(root, "rev-parse", "HEAD")
    (root / "untracked.txt").write_text("not part of the commit\n")
    assert bench_env.git_state.__wrapped__(root) == {"commit": head, "dirty": False, "dirty_paths": []}
    (root / "a.txt").write_text("two\n")
    assert bench_env.git_state.__wrapped__(root) == {"commit": head, "dirty": True, "dirty_paths": ["a.txt"]}


def test_git_state_outside_a_checkout_says_so(tmp_path):
    # NOTE: a folder inside some other repository (an installed wheel's) is not flotilla's checkout.
    inner = tmp_path.resolve() / "site-packages" / "flotilla"
    inner.mkdir(parents=True)
    _git(tmp_path, "init", "-q")
    assert bench_env.git_state.__wrapped__(inner) == {"commit": None, "dirty": None, "dirty_paths": []}
    assert bench_env.git_state.__wrapped__(tmp_path.resolve() / "missing") == {
        "commit": None, "dirty": None, "dirty_paths": [],
    }  # fmt: skip


def test_a_copy_of_the_checkout_reads_the_state_saved_in_it(tmp_path, monkeypatch):
    # The device machines get a copy of the working tree: the checkout saves its state first.
    saved = tmp_path / "git-state.json"
    subprocess.run([sys.executable, "-m", "flotilla.deploy.bench_env", str(saved)], check=True, cwd=REPO, timeout=60)
    state = json.loads(saved.read_text())
    assert state["commit"] == _git(REPO, "rev-parse", "HEAD")
    assert state["dirty"] == bool(_git(REPO, "status", "--porcelain", "--untracked-files=no"))
    copy = tmp_path / "copy"
    copy.mkdir()
    monkeypatch.delenv(bench_env.GIT_STATE_ENV, raising=False)
    assert bench_env.git_state.__wrapped__(copy) == {"commit": None, "dirty": None, "dirty_paths": []}
    monkeypatch.setenv(bench_env.GIT_STATE_ENV, str(saved))
    assert bench_env.git_state.__wrapped__(copy) == {**state, "from_file": str(saved)}
    # The file wins over a copy's own git (the device machines' .git can be older than the tree);
    # a file that holds no commit is ignored.
    assert bench_env.git_state.__wrapped__(REPO) == {**state, "from_file": str(saved)}
    saved.write_text(json.dumps({"commit": "HEAD", "dirty": False}))
    assert bench_env.git_state.__wrapped__(copy)["commit"] is None
    monkeypatch.setenv(bench_env.GIT_STATE_ENV, str(tmp_path / "missing.json"))
    assert bench_env.git_state.__wrapped__(copy)["commit"] is None


def test_machine_records_the_cuda_devices_and_driver(monkeypatch):
    import torch

    names = {0: "NVIDIA H200", 1: "NVIDIA H200"}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=0: names[i])
    monkeypatch.setattr(bench_env, "_run", lambda cmd: "570.86.15\n570.86.15\n" if cmd[0] == "nvidia-smi" else None)
    gpu = bench_env.machine()["gpu"]
    assert gpu["name"] == "NVIDIA H200" and gpu["names"] == ["NVIDIA H200"] and gpu["count"] == 2
    assert gpu["driver"] == "570.86.15"


def test_write_result_puts_provenance_first_and_wraps_lists(tmp_path):
    out = bench_env.write_result(tmp_path / "deep" / "r.json", {"tok_s": 1.5})
    data = json.loads(out.read_text())
    assert list(data) == ["provenance", "tok_s"] and data["tok_s"] == 1.5
    assert_provenance(data["provenance"], list(sys.orig_argv))
    rows = json.loads(bench_env.write_result(tmp_path / "rows.json", [{"m": 1}]).read_text())
    assert rows["results"] == [{"m": 1}] and "provenance" in rows
    with pytest.raises(ValueError, match="provenance"):
        bench_env.write_result(tmp_path / "x.json", {"provenance": "mine"})


@pytest.mark.parametrize("path", WRITERS, ids=lambda p: str(p.relative_to(REPO)))
def test_every_benchmark_writes_its_json_through_write_result(path):
    # Writing a model's config.json is setup, not a result; any other JSON write must go
    # through bench_env.write_result so that it carries the provenance.
    raw = [
        line.strip()
        for line in path.read_text().splitlines()
        if re.search(r"json\.dump\(|\.write(_text)?\(json\.dumps", line) and "config.json" not in line
    ]
    assert raw == [], f"{path.name} writes JSON without write_result: {raw}"
