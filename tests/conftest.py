"""Test-session settings shared by every tier."""

import os
import re

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
    import ray
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


# The skip gate (.ci/run sets FLOTILLA_FAIL_ON_SKIP=1): a test or module skipped for any reason
# but the machine lacking a GPU or Triton fails the run, so a missing pinned dependency, data set
# or fixture cannot pass as a skip. Such skips say so: "needs a GPU", "needs a CUDA GPU",
# "needs 2 GPUs", "needs Triton ...".
ALLOWED_SKIP_REASON = re.compile(r"needs (a GPU|a CUDA GPU|\d+ GPUs|Triton)\b")


def skip_reason(report: pytest.TestReport | pytest.CollectReport) -> str:
    """The reason of a skipped test or collector, without pytest's ``Skipped: `` prefix."""
    text = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
    return text.removeprefix("Skipped: ")


class SkipGate:
    """Collects the skips whose reason :data:`ALLOWED_SKIP_REASON` does not match, lists them
    in the terminal summary and turns a passing session into a failing one."""

    def __init__(self) -> None:
        self.refused: list[tuple[str, str]] = []

    def _note(self, report) -> None:
        if report.skipped and not hasattr(report, "wasxfail"):
            reason = skip_reason(report)
            if not ALLOWED_SKIP_REASON.match(reason):
                self.refused.append((report.nodeid, reason))

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self._note(report)

    def pytest_collectreport(self, report: pytest.CollectReport) -> None:
        self._note(report)

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        if self.refused and session.exitstatus in (pytest.ExitCode.OK, pytest.ExitCode.NO_TESTS_COLLECTED):
            session.exitstatus = pytest.ExitCode.TESTS_FAILED

    def pytest_terminal_summary(self, terminalreporter) -> None:
        if not self.refused:
            return
        terminalreporter.section("skips refused by FLOTILLA_FAIL_ON_SKIP=1", red=True, bold=True)
        for nodeid, reason in self.refused:
            terminalreporter.line(f"{nodeid}: {reason}")
        terminalreporter.line(
            f"{len(self.refused)} skipped for a reason that does not match {ALLOWED_SKIP_REASON.pattern}: "
            "install what is missing, or make the test fail instead of skipping"
        )


def pytest_configure(config: pytest.Config) -> None:
    if os.environ.get("FLOTILLA_FAIL_ON_SKIP") == "1":
        config.pluginmanager.register(SkipGate(), "flotilla-skip-gate")
