"""``ray job submit -- flotilla serve ...`` against a ``ray start --head`` cluster on loopback.

The way a user deploys onto a running cluster: a head node is started (its own temp dir
and ports, so it never touches the test session's Ray), the job runs ``flotilla serve
--non-blocking``, which resolves once on the driver, deploys the Serve application and
returns when ``/health`` answers; the endpoint then keeps serving after the job ends. The
official openai client asks SmolLM2 the README's question over real HTTP.

Ray 2.60 turns token auth on by default; both sides run with ``RAY_AUTH_MODE=disabled``
(see the notes on Ray on one box). Every wait is bounded, and the head (started with
``--block`` in its own process group) is terminated at the end, taking its processes along.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest

BIN = Path(sys.executable).parent
START_TIMEOUT_S = 150
HEAD_START_ATTEMPTS = 2
# The job agent can come up well after the dashboard on a busy 2-core machine.
AGENT_TIMEOUT_S = 180
JOB_TIMEOUT_S = 240


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_http(url: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=5) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
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


def _wait_head(head: subprocess.Popen, address: str, log_path: Path, timeout_s: float) -> None:
    """Wait for the dashboard to answer; fail fast (with the head's log) if ``ray start`` exits."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if head.poll() is not None:
            break
        try:
            _wait_http(f"{address}/api/version", min(5.0, max(deadline - time.monotonic(), 0.1)))
            return
        except TimeoutError:
            continue
    log_tail = log_path.read_text(errors="replace")[-4000:] if log_path.exists() else "(no log)"
    state = f"exited with {head.returncode}" if head.poll() is not None else f"no answer within {timeout_s}s"
    raise TimeoutError(f"ray start --head at {address}: {state}; its log ends:\n{log_tail}")


@pytest.fixture
def head_cluster():
    """A ``ray start --head`` cluster on loopback; yields its dashboard (job server) address.

    A head that does not come up is started once more on fresh ports (the ports are picked
    free but could be taken between the pick and Ray's bind, and a busy 2-core machine is
    slow to start the dashboard); the second failure is reported with the head's log.
    """
    env = {
        **os.environ,
        "RAY_AUTH_MODE": "disabled",
        "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
        "GLOO_SOCKET_IFNAME": "lo",
    }
    env.pop("RAY_ADDRESS", None)
    for attempt in range(HEAD_START_ATTEMPTS):
        # NOTE: a short temp dir: Ray's unix socket paths must stay under ~107 characters.
        temp_dir = tempfile.mkdtemp(prefix="fj", dir="/tmp")
        head, address, log_path = _start_head(env, temp_dir)
        try:
            _wait_head(head, address, log_path, START_TIMEOUT_S)
            break
        except TimeoutError:
            _stop_head(head)
            shutil.rmtree(temp_dir, ignore_errors=True)
            if attempt == HEAD_START_ATTEMPTS - 1:
                raise
    try:
        yield address, env
    finally:
        _stop_head(head)
        shutil.rmtree(temp_dir, ignore_errors=True)


@pytest.mark.timeout(900)  # two head starts at most, the job agent, the job, a model load: all bounded above
def test_ray_job_submit_deploys_a_serving_endpoint(head_cluster):
    from openai import OpenAI

    address, env = head_cluster
    port = _free_port()
    command = [
        str(BIN / "ray"), "job", "submit", f"--address={address}", "--",
        str(BIN / "flotilla"), "serve", "--non-blocking", f"--port={port}", "--max-total-tokens=2048",
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
    url = f"http://127.0.0.1:{port}"
    assert url in job.stdout  # the job's log shows the URL and the curl line
    assert "curl" in job.stdout

    client = OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=120, max_retries=0)
    reply = client.chat.completions.create(
        model="smollm2",
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=12,
        temperature=0,
    )
    assert "Paris" in reply.choices[0].message.content
