"""``ray job submit --working-dir <repo> -- flotilla serve --config deploy/examples/cpu-demo.yaml``
against a ``ray start --head`` cluster on loopback, with Ray's token authentication on.

The way a user deploys onto a running cluster: a head node is started (its own temp dir
and ports, so it never touches the test session's Ray); the job uploads the repository as
its working directory and runs ``flotilla serve --config ... --non-blocking``, which
resolves once on the driver, deploys the Serve application and returns when ``/health``
answers; the endpoint keeps serving after the job ends. The official openai client asks
SmolLM2 the README's question over real HTTP; ``serve shutdown`` then removes the
application and the port stops answering.

Auth: Ray 2.60 turns token auth on by default. As a user would, the head and every client
share one token (``ray get-auth-token --generate`` makes one; here a fresh random token in
a file of the head's temp dir, named by ``RAY_AUTH_TOKEN_PATH`` with ``RAY_AUTH_MODE=token``
on both sides). The test checks that the job server refuses a request without it.

Upload: the command is the README's, as written: Ray packs the working directory honouring
``.gitignore`` (``.venv/``, ``build/``, ``*.egg-info/``) and the repository's ``.rayignore``
(``.git`` and wheels: a wheelhouse or a local wheel cache, which git may ignore through
``.git/info/exclude``, a file Ray does not read). The test reads what the head unpacked and
checks it is small and holds none of them.

Every wait is bounded, and the head (started with ``--block`` in its own process group) is
terminated at the end, taking its processes along.
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

BIN = Path(sys.executable).parent
REPO_ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = "deploy/examples/cpu-demo.yaml"
MAX_UPLOAD_BYTES = 20 << 20
START_TIMEOUT_S = 150
HEAD_START_ATTEMPTS = 2
# The job agent can come up well after the dashboard on a busy 2-core machine.
AGENT_TIMEOUT_S = 180
JOB_TIMEOUT_S = 240
STOP_TIMEOUT_S = 120


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _status(url: str, headers: dict | None = None) -> int | None:
    """The HTTP status of a GET (None when nothing answers)."""
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers or {}), timeout=5) as response:
            return response.status
    except urllib.error.HTTPError as exc:
        return exc.code
    except OSError:
        return None


def _wait_http(url: str, timeout_s: float, headers: dict | None = None) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if _status(url, headers) == 200:
            return
        time.sleep(1)
    raise TimeoutError(f"{url} did not answer 200 within {timeout_s}s")


def _start_head(env: dict, temp_dir: str) -> tuple[subprocess.Popen, str, Path]:
    """Start ``ray start --head --block`` on fresh loopback ports; returns (process, dashboard URL, log)."""
    dashboard_port = _free_port()
    command = [
        str(BIN / "ray"), "start", "--head", "--block", "--disable-usage-stats",
        "--node-ip-address=127.0.0.1", f"--port={_free_port()}",
        "--include-dashboard=true", "--dashboard-host=127.0.0.1", f"--dashboard-port={dashboard_port}",
        "--num-cpus=4", f"--temp-dir={temp_dir}",
        # NOTE: the agents' fixed default ports (52365, ...) may be held by the test session's
        # own Ray cluster; a head whose job agent cannot bind never accepts a job.
        f"--dashboard-agent-listen-port={_free_port()}", f"--dashboard-agent-grpc-port={_free_port()}",
        f"--metrics-export-port={_free_port()}", f"--runtime-env-agent-port={_free_port()}",
        f"--ray-client-server-port={_free_port()}",
    ]  # fmt: skip
    log_path = Path(temp_dir) / "head.log"
    with open(log_path, "wb") as log:
        head = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    return head, f"http://127.0.0.1:{dashboard_port}", log_path


def _stop_head(head: subprocess.Popen) -> None:
    try:
        os.killpg(head.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    try:
        head.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(head.pid, signal.SIGKILL)
        head.wait(timeout=30)


def _wait_head(head: subprocess.Popen, address: str, log_path: Path, token: str, timeout_s: float) -> None:
    """Wait for the dashboard to answer (its API wants the token too); fail fast (with the
    head's log) if ``ray start`` exits."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if head.poll() is not None:
            break
        try:
            remaining = min(5.0, max(deadline - time.monotonic(), 0.1))
            _wait_http(f"{address}/api/version", remaining, {"Authorization": f"Bearer {token}"})
            return
        except TimeoutError:
            continue
    log_tail = log_path.read_text(errors="replace")[-4000:] if log_path.exists() else "(no log)"
    state = f"exited with {head.returncode}" if head.poll() is not None else f"no answer within {timeout_s}s"
    raise TimeoutError(f"ray start --head at {address}: {state}; its log ends:\n{log_tail}")


@pytest.fixture
def head_cluster():
    """A ``ray start --head`` cluster on loopback with token auth on; yields (its dashboard
    (job server) address, the clients' environment, the token, the head's temp dir).

    A head that does not come up is started once more on fresh ports (the ports are picked
    free but could be taken between the pick and Ray's bind, and a busy 2-core machine is
    slow to start the dashboard); the second failure is reported with the head's log.
    """
    base = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "GLOO_SOCKET_IFNAME": "lo"}
    for name in ("RAY_ADDRESS", "RAY_AUTH_TOKEN"):
        base.pop(name, None)
    for attempt in range(HEAD_START_ATTEMPTS):
        # NOTE: a short temp dir: Ray's unix socket paths must stay under ~107 characters.
        temp_dir = tempfile.mkdtemp(prefix="fj", dir="/tmp")
        token = secrets.token_hex(32)
        token_path = Path(temp_dir) / "auth_token"
        token_path.write_text(token)
        token_path.chmod(0o600)
        env = {**base, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token_path)}
        head, address, log_path = _start_head(env, temp_dir)
        try:
            _wait_head(head, address, log_path, token, START_TIMEOUT_S)
            break
        except TimeoutError:
            _stop_head(head)
            shutil.rmtree(temp_dir, ignore_errors=True)
            if attempt == HEAD_START_ATTEMPTS - 1:
                raise
    try:
        yield address, env, token, Path(temp_dir)
    finally:
        _stop_head(head)
        shutil.rmtree(temp_dir, ignore_errors=True)


def _uploaded_dir(temp_dir: Path) -> Path:
    """The working directory the head unpacked for the job."""
    found = [p for p in temp_dir.glob("session_latest/runtime_resources/working_dir_files/_ray_pkg_*") if p.is_dir()]
    assert len(found) == 1, f"expected one unpacked working dir under {temp_dir}, found {found}"
    return found[0]


@pytest.mark.timeout(900)  # two head starts at most, the job agent, the job, a model load, the stop: all bounded above
def test_ray_job_submit_deploys_a_config_file_and_stops_cleanly(head_cluster):
    from openai import OpenAI

    address, env, token, temp_dir = head_cluster
    # The job server refuses a client without the cluster's token, and serves one with it.
    assert _status(f"{address}/api/jobs/") == 401
    assert _status(f"{address}/api/jobs/", {"Authorization": f"Bearer {'0' * 64}"}) == 403
    assert _status(f"{address}/api/jobs/", {"Authorization": f"Bearer {token}"}) == 200

    port = _free_port()
    command = [
        str(BIN / "ray"), "job", "submit", f"--address={address}", f"--working-dir={REPO_ROOT}", "--",
        str(BIN / "flotilla"), "serve", "--config", EXAMPLE, "--non-blocking", f"--port={port}",
    ]  # fmt: skip
    deadline = time.monotonic() + AGENT_TIMEOUT_S
    while True:
        job = subprocess.run(command, env=env, capture_output=True, text=True, timeout=JOB_TIMEOUT_S)
        # NOTE: the dashboard answers before its job agent is up; submission is refused
        # (nothing runs) until then.
        if "No available agent" not in job.stderr or time.monotonic() > deadline:
            break
        time.sleep(2)
    assert job.returncode == 0, job.stdout[-3000:] + job.stderr[-3000:]
    url = f"http://127.0.0.1:{port}"  # the file's host, the command line's port
    assert url in job.stdout  # the job's log shows the URL and the curl line
    assert "curl" in job.stdout

    uploaded = _uploaded_dir(temp_dir)
    files = [p for p in uploaded.rglob("*") if p.is_file()]
    assert (uploaded / EXAMPLE).is_file()
    assert not [p for p in files if p.suffix == ".whl"]
    assert not any((uploaded / name).exists() for name in (".venv", "build", ".git"))
    size = sum(p.stat().st_size for p in files)
    assert size < MAX_UPLOAD_BYTES, f"the working dir upload is {size / 2**20:.1f} MiB"

    client = OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=120, max_retries=0)
    reply = client.chat.completions.create(
        model="smollm2",
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=12,
        temperature=0,
    )
    assert "Paris" in reply.choices[0].message.content

    stop = subprocess.run(
        [str(BIN / "serve"), "shutdown", f"--address={address}", "--yes"],
        env=env, capture_output=True, text=True, timeout=STOP_TIMEOUT_S,
    )  # fmt: skip
    assert stop.returncode == 0, stop.stdout[-2000:] + stop.stderr[-2000:]
    deadline = time.monotonic() + STOP_TIMEOUT_S
    while _status(f"{url}/health") is not None and time.monotonic() < deadline:
        time.sleep(1)
    assert _status(f"{url}/health") is None, f"{url} still answers after serve shutdown"
