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
# Tests that run Triton kernels under Triton's CPU interpreter are a developer's tool (minutes
# on 2 cores, and the CI venv has no Triton): collected only with TRITON_INTERPRET=1.
if os.environ.get("TRITON_INTERPRET") != "1":
    collect_ignore += ["kernels/test_triton_folds_interpreted.py", "kernels/test_triton_argmax_interpreted.py"]


@pytest.fixture(scope="session")
def ray_cluster():
    """One local Ray cluster on loopback for the whole session (no dashboard), shared by the
    cluster, serve and deploy tiers: a head node (4 CPUs, custom resource ``NODE_A``) and a
    second simulated node (``NODE_B_CPUS`` CPUs, ``NODE_B``), both raylets on this machine, so
    multi-node placement is tested here (Ray's ``cluster_utils.Cluster``; see
    ``helpers.nodes``). Work without custom resources may land on either node; yields the
    ``Cluster``.

    NOTE: session-scoped and shared: two test modules must never each ``ray.init``.
    """
    ray = pytest.importorskip("ray")
    from ray.cluster_utils import Cluster

    from helpers.nodes import NODE_A, NODE_B, NODE_B_CPUS

    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 4, "resources": {NODE_A: 100}, "include_dashboard": False})
    try:
        cluster.add_node(num_cpus=NODE_B_CPUS, resources={NODE_B: 100})
        ray.init(address=cluster.address, log_to_driver=False, configure_logging=False)
        cluster.wait_for_nodes()
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()
