"""A local deployment listens on loopback only: the environment ``flotilla serve`` sets for
its local cluster (``serve.loopback``) keeps NIXL's UCX listeners (the PD KV reads) off the
machine's other interfaces (without it UCX also listened on this machine's eth0 address).
Checked in a fresh process, whose listening sockets psutil lists."""

import json
import os
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
PROBE = """
import json, sys, time, psutil
if sys.argv[1] == "flotilla":
    from flotilla.serve.loopback import use_loopback_only
    use_loopback_only()
from flotilla.cluster.kv.transport import NixlTransport
transport = NixlTransport("loopback-probe")
time.sleep(0.5)
print(json.dumps(sorted({c.laddr.ip for c in psutil.Process().net_connections(kind="inet") if c.status == "LISTEN"})))
"""


def listening_addresses(mode: str) -> list[str]:
    """The addresses a fresh process listens on once it made a NIXL agent (``mode``
    ``flotilla``: after ``use_loopback_only()``)."""
    env = {k: v for k, v in os.environ.items() if k not in ("UCX_NET_DEVICES", "GLOO_SOCKET_IFNAME")}
    done = subprocess.run(
        [sys.executable, "-c", PROBE, mode], capture_output=True, text=True, timeout=120, cwd=REPO_ROOT, env=env
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_the_local_environment_keeps_ucx_listeners_on_loopback():
    addresses = listening_addresses("flotilla")
    assert addresses and all(a.startswith("127.") or a == "::1" for a in addresses), addresses

