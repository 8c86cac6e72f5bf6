"""Fixtures of the Serve-backed tests: one Ray cluster and one Serve instance per session."""

import os
import socket

import pytest


def free_loopback_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def serve_http():
    """Ray (reused when this session already started it, e.g. tests/cluster's
    ``ray_cluster``) and Serve with its HTTP proxy on 127.0.0.1 at a free port, for the
    whole session; yields the proxy's base URL.

    NOTE: session-scoped: modules deploy their applications into this one Serve (one
    application per module, deleted at module end) and never start Ray or Serve themselves.
    """
    ray = pytest.importorskip("ray")
    from ray import serve

    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    started_ray = not ray.is_initialized()
    if started_ray:
        ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False, configure_logging=False)
    port = free_loopback_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    yield f"http://127.0.0.1:{port}"
    serve.shutdown()
    from flotilla.serve.metrics import shutdown_metrics_hub

    shutdown_metrics_hub()  # NOTE: a detached actor: it would outlive the session
    if started_ray:
        ray.shutdown()
