"""Keeping a local deployment on loopback: the environment a local Ray cluster's processes
inherit (no Ray import here: Ray reads part of it when it is imported)."""

from __future__ import annotations

import os

# What keeps a local deployment's listeners on loopback, set for the processes a local Ray
# cluster starts (they inherit this process's environment): Ray 2.60 binds the non-loopback
# interface without the first; gloo's rendezvous and UCX's TCP listeners (NIXL, the PD KV
# reads) pick every interface without the others. NOTE: Serve's per-replica inter-deployment
# gRPC servers bind [::] whatever is set (ray/serve/_private/replica.py); see docs/deployment.md.
LOOPBACK_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "GLOO_SOCKET_IFNAME": "lo", "UCX_NET_DEVICES": "lo"}


def use_loopback_only() -> None:
    """Keep what a local cluster starts on loopback (:data:`LOOPBACK_ENV`; values the user
    exported stay, but Ray's must be 0)."""
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    for name, value in LOOPBACK_ENV.items():
        os.environ.setdefault(name, value)
