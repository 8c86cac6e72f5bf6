"""Test-session settings shared by every tier."""

import os

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
