"""Run a test file as rank processes over gloo on loopback, with bounded waits.

Multi-rank layer and model tests start ``world_size`` copies of a script (usually the test
module itself, whose ``__main__`` block is the rank entry point); each joins a gloo group on
127.0.0.1 and writes its results to a file the parent reads. A rank that fails or hangs is
reported with its output instead of hanging the test.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Sequence

# tests/, so the rank processes can import ``helpers`` like pytest's rootdir config does.
_TESTS_DIR = Path(__file__).resolve().parents[1]


def free_port() -> int:
    """A TCP port that was free on 127.0.0.1 a moment ago (for a gloo rendezvous)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(script: str | Path, world_size: int, args: Sequence[str], timeout_s: float = 90.0) -> list[str]:
    """Run ``python script RANK WORLD_SIZE *args`` for every rank and wait for all, bounded.

    Each process runs single-threaded (``OMP_NUM_THREADS=1``) with gloo on loopback and
    ``tests/`` on ``PYTHONPATH``. Returns each rank's combined stdout/stderr; raises
    AssertionError naming the failed ranks (with the tail of their output) when any rank
    exits non-zero or does not finish within ``timeout_s`` (stragglers are killed).
    """
    path = os.pathsep.join(p for p in (str(_TESTS_DIR), os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1", "PYTHONPATH": path}
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), str(rank), str(world_size), *map(str, args)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in range(world_size)
    ]
    outputs: list[str] = []
    try:
        for proc in procs:
            out, _ = proc.communicate(timeout=timeout_s)
            outputs.append(out)
    except subprocess.TimeoutExpired:
        outputs.append(f"rank {len(outputs)} did not finish within {timeout_s}s")
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=10)
    failed = [(r, p.returncode) for r, p in enumerate(procs) if p.returncode != 0]
    assert not failed, f"rank(s) failed {failed}:\n" + "\n".join(o[-3000:] for o in outputs)
    return outputs
