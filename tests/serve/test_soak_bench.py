"""benchmarks/soak_bench.py without a server: reading a process's RSS, finding Serve
processes by their title under a root process, and telling growth that levels off from
growth that does not."""

import os
import subprocess
import time

from helpers.benchmark_scripts import import_benchmark

soak = import_benchmark("soak_bench")
MIB = 1 << 20


def samples(rss_mib: list[float], per_sample: int = 100, every_s: float = 10.0) -> list[dict]:
    return [
        {"t_s": i * every_s, "requests": i * per_sample, "rss": {"engine:1": {"VmRSS": int(v * MIB), "RssAnon": 0}}}
        for i, v in enumerate(rss_mib)
    ]


def test_growth_tells_levelling_off_from_steady_growth():
    levelling = soak.growth(samples([2000, 2040, 2070, 2090, 2100, 2102, 2103, 2103, 2104]), "engine:1", 0.0, 5.0)
    assert levelling["levels_off"] and levelling["rss_start_mib"] == 2000 and levelling["rss_end_mib"] == 2104
    assert levelling["mib_per_1000_requests_first_half"] == 250.0 and levelling["requests"] == 800
    steady = soak.growth(samples([2000 + 20 * i for i in range(9)]), "engine:1", 0.0, 5.0)
    assert not steady["levels_off"] and steady["mib_per_1000_requests_second_half"] == 200.0
    assert soak.growth(samples([2000, 2001]), "engine:1", 0.0, 5.0) is None  # too few samples
    # Samples before the warm-up are left out.
    warm = soak.growth(samples([1000, 2000, 2000, 2000, 2000]), "engine:1", 15.0, 5.0)
    assert warm["rss_start_mib"] == 2000 and warm["levels_off"]


def test_serve_processes_are_found_by_title_under_their_root():
    title = "ray::ServeReplica:soaktest:engine.handle_request"
    child = subprocess.Popen(["bash", "-c", f"exec -a '{title}' sleep 30"])  # NOTE: argv[0] is the title
    try:
        # NOTE: the title appears once bash has exec'd; on a loaded 2-core box (the whole suite's
        # Ray clusters beside it) that took more than 10 s once, so the bound is generous.
        deadline = time.monotonic() + 60

        def replicas_found() -> dict:
            # The test session's own Ray cluster (started under this process) may run a Serve
            # proxy, which is found too; the replicas found are the app's alone.
            found = soak.serve_processes("soaktest", root=os.getpid())
            return {label: pid for label, pid in found.items() if not label.startswith("proxy:")}

        while time.monotonic() < deadline and not replicas_found():
            time.sleep(0.05)
        replicas = replicas_found()
        assert replicas == {f"engine:{child.pid}": child.pid}
        assert soak.serve_processes("soaktest", root=1 << 22) == {}  # NOTE: not under that root
        rss = soak.proc_rss(child.pid)
        assert rss["VmRSS"] > 0 and 0 < rss["RssAnon"] <= rss["VmRSS"]
    finally:
        child.kill()
        child.wait()
    assert soak.proc_rss(child.pid) is None
