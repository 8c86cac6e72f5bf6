"""Fixtures of the Serve-backed tests: one Serve instance per session (on the session's Ray
cluster, tests/conftest.py)."""

import socket

import pytest


def free_loopback_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def serve_http(ray_cluster):
    """Serve with its HTTP proxy on 127.0.0.1 at a free port, on the session's Ray cluster,
    for the whole session; yields the proxy's base URL.

    NOTE: session-scoped: modules deploy their applications into this one Serve (one
    application per module, deleted at module end) and never start Ray or Serve themselves.
    """
    from ray import serve

    from flotilla.serve.metrics import shutdown_metrics_hub

    port = free_loopback_port()
    # NOTE: one proxy: the session's second simulated node shares this machine's loopback.
    serve.start(http_options={"host": "127.0.0.1", "port": port}, proxy_location="HeadOnly")
    yield f"http://127.0.0.1:{port}"
    serve.shutdown()
    shutdown_metrics_hub()  # NOTE: a detached actor: it would outlive the session
