"""Fixtures shared by the Ray-backed cluster tests (worker group, tensor-parallel LLM)."""

import os

import pytest


@pytest.fixture(scope="session")
def ray_cluster():
    """One local Ray cluster on loopback for the whole session (no dashboard).

    NOTE: session-scoped and shared: two test modules must never each ``ray.init``.
    """
    ray = pytest.importorskip("ray")
    if ray.is_initialized():  # NOTE: another tier's session fixture (tests/serve) started it
        yield
        return
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False, configure_logging=False)
    yield
    ray.shutdown()
