"""Graceful drain, live: ``flotilla serve --shutdown-timeout 30`` gets SIGTERM while 8 long
streams run; all 8 finish whole, and requests sent during the drain get 503.

The real thing, as a user runs it: ``flotilla serve`` is a subprocess with its own local Ray
cluster on loopback (not the test session's; its HTTP port is a free one, Ray picks its own),
serving the embedded SmolLM2 with one ingress replica and one engine replica. Eight greedy
``/v1/completions`` streams of ``MAX_TOKENS`` tokens (``ignore_eos``: each must run to its
length) start; once every one has its first token the process gets SIGTERM (what ``kill``,
systemd or a container runtime sends). During the drain ``/health`` and a new completion get
503 with ``Retry-After`` and an OpenAI error naming the shutdown, while streams are still
running; every stream then ends with ``finish_reason: length``, its ``MAX_TOKENS`` tokens
and ``[DONE]``; the process exits 0 and says it drained.

Without the drain (``--shutdown-timeout 0``, or the SIGTERM path going straight to
``serve.shutdown()``) Serve kills its proxy at once and every stream is cut: the stream
checks fail.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

REPO_ROOT = Path(__file__).resolve().parents[2]
STREAMS = 8
# Long enough that the streams outlast the drain's first moments on a fast machine (a 135M
# model on CPU, 8 in a batch: ~3 s on a 2-core box), short enough for CI.
MAX_TOKENS = 64
SHUTDOWN_TIMEOUT_S = 30
START_TIMEOUT_S = 240
# Bounds on the waits below; all far above what they take (seconds).
FIRST_TOKEN_TIMEOUT_S = 90
DRAIN_SEEN_TIMEOUT_S = 10
EXIT_TIMEOUT_S = SHUTDOWN_TIMEOUT_S + 60
PROMPT = "Once upon a time, in a small village by the sea,"


@dataclass
class _Stream:
    text: str = ""
    finish_reason: str | None = None
    completion_tokens: int | None = None
    done: bool = False
    errors: list = field(default_factory=list)
    failure: str | None = None
    first: threading.Event = field(default_factory=threading.Event)
    ended_at: float | None = None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_server(port: int, shutdown_timeout_s: float) -> tuple[subprocess.Popen, list[str]]:
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # NOTE: its own cluster
    env.update(RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0", GLOO_SOCKET_IFNAME="lo", PYTHONUNBUFFERED="1")
    process = subprocess.Popen(
        [sys.executable, "-m", "flotilla.deploy.cli", "serve", "--port", str(port), "--max-total-tokens", "2048",
         "--num-ingress-replicas", "1", "--shutdown-timeout", str(shutdown_timeout_s)],
        cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )  # fmt: skip
    lines: list[str] = []
    ready = threading.Event()

    def read() -> None:
        for line in process.stdout:
            lines.append(line.rstrip())
            if line.startswith("flotilla serve:") and " is ready at http://" in line:
                ready.set()

    threading.Thread(target=read, daemon=True).start()
    deadline = time.monotonic() + START_TIMEOUT_S
    while not ready.wait(1.0):
        if process.poll() is not None or time.monotonic() > deadline:
            _kill(process)
            raise AssertionError("flotilla serve did not get ready:\n" + "\n".join(lines[-40:]))
    return process, lines


def _kill(process: subprocess.Popen) -> None:
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=30)


def _stream(url: str, out: _Stream) -> None:
    body = {
        "model": "smollm2", "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
        "stream": True, "stream_options": {"include_usage": True},
    }  # fmt: skip
    try:
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=EXIT_TIMEOUT_S) as response:
            if response.status_code != 200:
                out.failure = f"status {response.status_code}: {response.read()[:500]!r}"
                return
            for line in response.iter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[len("data: ") :]
                if data == "[DONE]":
                    out.done = True
                    continue
                frame = json.loads(data)
                if "error" in frame:
                    out.errors.append(frame["error"])
                    continue
                for choice in frame.get("choices", []):
                    out.text += choice.get("text", "")
                    out.first.set()
                    out.finish_reason = choice.get("finish_reason") or out.finish_reason
                if frame.get("usage"):
                    out.completion_tokens = frame["usage"]["completion_tokens"]
    except Exception as exc:  # noqa: BLE001 - a cut stream is what the test reports
        out.failure = f"{type(exc).__name__}: {exc}"
    finally:
        out.ended_at = time.monotonic()
        out.first.set()


def _request(method: str, url: str, **kwargs) -> httpx.Response | str:
    """The response, or what went wrong when none came (the server is gone)."""
    try:
        return httpx.request(method, url, timeout=10, **kwargs)
    except httpx.TransportError as exc:
        return f"no answer: {type(exc).__name__}: {exc}"


def _wait_for_drain(url: str) -> tuple[httpx.Response | str, float]:
    """The first /health answer that is not 200 (bounded), and when it came."""
    deadline = time.monotonic() + DRAIN_SEEN_TIMEOUT_S
    while True:
        health = _request("GET", f"{url}/health")
        if not isinstance(health, httpx.Response) or health.status_code != 200 or time.monotonic() > deadline:
            return health, time.monotonic()
        time.sleep(0.05)


def test_sigterm_drains_in_flight_streams_and_refuses_new_requests():
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    process, output = _start_server(port, SHUTDOWN_TIMEOUT_S)
    try:
        streams = [_Stream() for _ in range(STREAMS)]
        threads = [threading.Thread(target=_stream, args=(url, s), daemon=True) for s in streams]
        for thread in threads:
            thread.start()
        for s in streams:
            assert s.first.wait(FIRST_TOKEN_TIMEOUT_S), "a stream got no first token"
        assert not any(s.failure for s in streams), [s.failure for s in streams]

        process.send_signal(signal.SIGTERM)
        health, drain_seen = _wait_for_drain(url)
        late = _request("POST", f"{url}/v1/completions", json={"model": "smollm2", "prompt": "Hi", "max_tokens": 4})
        running_at_drain = sum(1 for s in streams if s.ended_at is None or s.ended_at > drain_seen)

        for thread in threads:
            thread.join(EXIT_TIMEOUT_S)
        code = process.wait(timeout=EXIT_TIMEOUT_S)
    finally:
        _kill(process)
    log = "\n".join(output[-40:])

    # During the drain: /health and a new request get 503, Retry-After and the reason.
    for refused in (health, late):
        assert isinstance(refused, httpx.Response), (refused, log)
        assert refused.status_code == 503, (refused.status_code, refused.text, log)
        assert int(refused.headers["retry-after"]) >= 1
        error = refused.json()["error"]
        assert error["code"] == "server_shutting_down" and "shutting down" in error["message"], error
        assert "SIGTERM" in error["message"]
    # NOTE: the drain overlapped the streams (else this test would not show a drain at all).
    assert running_at_drain >= 1, "every stream ended before the drain was seen"

    # Every stream ran to its length and ended normally.
    for i, s in enumerate(streams):
        assert s.failure is None and not s.errors, (i, s.failure, s.errors, log)
        assert s.done and s.finish_reason == "length", (i, s.done, s.finish_reason)
        assert s.completion_tokens == MAX_TOKENS and s.text.strip(), (i, s.completion_tokens, s.text)
    assert code == 0, log
    assert any("drained in" in line for line in output), log
