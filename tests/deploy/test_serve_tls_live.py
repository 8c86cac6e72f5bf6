"""``flotilla serve`` with ``--ssl-certfile/--ssl-keyfile``, ``--api-key`` and ``--admin-api-key``,
live: the command starts its own local Ray cluster on loopback (not the test session's), and
the official openai client talks HTTPS to it with a self-signed certificate (verification
off); the same port refuses plain HTTP; the admin route needs the admin key (no key and the
user key get 401; the admin key gets the route's own answer, a 404 on this non-elastic
deployment); Ctrl-C shuts it down."""

from __future__ import annotations

import os
import selectors
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
START_TIMEOUT_S = 240
USER, ADMIN = "user-secret", "admin-secret"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def certificate(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tls")
    key, cert = folder / "key.pem", folder / "cert.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(cert),
         "-days", "1", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
        check=True, capture_output=True, timeout=60,
    )  # fmt: skip
    return cert, key


@pytest.fixture(scope="module")
def tls_server(certificate):
    cert, key = certificate
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # NOTE: its own cluster
    env.update(RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0", GLOO_SOCKET_IFNAME="lo", PYTHONUNBUFFERED="1")
    process = subprocess.Popen(
        [sys.executable, "-m", "flotilla.deploy.cli", "serve", "--port", str(port), "--ssl-certfile", str(cert),
         "--ssl-keyfile", str(key), "--api-key", USER, "--admin-api-key", ADMIN, "--max-total-tokens", "2048"],
        cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )  # fmt: skip
    output = _wait_for_ready(process)
    try:
        yield port, output
    finally:
        _stop(process)


def _wait_for_ready(process: subprocess.Popen) -> list[str]:
    lines: list[str] = []
    selector = selectors.DefaultSelector()
    selector.register(process.stdout, selectors.EVENT_READ)
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if not selector.select(timeout=1.0):
            if process.poll() is not None:
                break
            continue
        line = process.stdout.readline()
        if not line and process.poll() is not None:
            break
        lines.append(line.rstrip())
        if line.startswith("flotilla serve:") and " is ready at https://" in line:
            return lines
    _stop(process)
    raise AssertionError("flotilla serve did not get ready over HTTPS:\n" + "\n".join(lines[-40:]))


def _stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGINT)
        try:
            process.wait(timeout=90)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=30)


def test_the_openai_client_gets_answers_over_https(tls_server):
    port, output = tls_server
    ready = next(line for line in output if line.startswith("flotilla serve:") and " is ready at " in line)
    assert f"https://127.0.0.1:{port}/v1" in ready
    client = openai.OpenAI(
        base_url=f"https://127.0.0.1:{port}/v1", api_key=USER, max_retries=0, timeout=60,
        http_client=httpx.Client(verify=False),
    )  # fmt: skip
    reply = client.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": "What is the capital of France?"}], max_tokens=8, temperature=0
    )
    assert reply.choices[0].message.content and reply.usage.completion_tokens > 0


def test_the_port_refuses_plain_http(tls_server):
    port, _ = tls_server
    with pytest.raises(httpx.TransportError):
        httpx.get(f"http://127.0.0.1:{port}/health", timeout=10)


def test_admin_route_needs_the_admin_key(tls_server):
    port, _ = tls_server
    with httpx.Client(base_url=f"https://127.0.0.1:{port}", verify=False, timeout=30) as http:
        body = {"new_ep_size": 2}
        assert http.post("/scale_elastic_ep", json=body).status_code == 401
        denied = http.post("/scale_elastic_ep", json=body, headers={"Authorization": f"Bearer {USER}"})
        assert denied.status_code == 401 and "--admin-api-key" in denied.json()["error"]["message"]
        answer = http.post("/scale_elastic_ep", json=body, headers={"Authorization": f"Bearer {ADMIN}"})
        # NOTE: past the key check: the route's own answer (this deployment is not elastic).
        assert answer.status_code == 404 and "elastic" in answer.json()["error"]["message"], answer.text
        assert http.get("/health").status_code == 200
        assert http.get("/v1/models").status_code == 401
        assert http.get("/v1/models", headers={"Authorization": f"Bearer {USER}"}).status_code == 200
