"""Test-session settings shared by every tier."""

import os

import pytest

# Keep everything on loopback (see docs/structure.md and the notes on Ray).
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
os.environ.setdefault("UCX_NET_DEVICES", "lo")
# Never reach a model hub: everything the tests load is built in the test or
# shipped by an installed package.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

# tests/gpu/ needs NVIDIA GPUs (run on the GPU machine with FLOTILLA_GPU_TESTS=1; see
# docs/benchmarks.md); CI machines have none, so it is not collected there at all.
collect_ignore = [] if os.environ.get("FLOTILLA_GPU_TESTS") == "1" else ["gpu"]


@pytest.fixture(scope="session")
def ray_cluster():
    """One local Ray cluster on loopback for the whole session (no dashboard), shared by the
    cluster, serve and deploy tiers.

    NOTE: session-scoped and shared: two test modules must never each ``ray.init``.
    """
    ray = pytest.importorskip("ray")
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False, configure_logging=False)
    yield
    ray.shutdown()
