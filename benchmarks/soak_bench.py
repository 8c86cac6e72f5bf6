"""Soak: does an engine replica's memory level off under a long run of short requests?

    python benchmarks/soak_bench.py [--url URL | --serve-arg=--max-total-tokens --serve-arg=4096 ...]
                                    [--duration-s 300] [--concurrency 8] [--prompt-len 24]
                                    [--max-tokens 8] [--sample-s 10] [--app flotilla]
                                    [--pause-every-s S --pause-s P]
                                    [--json benchmarks/results/soak-smollm2-cpu.json]

Without ``--url`` it starts ``flotilla serve --port P`` (the embedded SmolLM2 unless a
``--serve-arg=--model --serve-arg=M`` says otherwise; each ``--serve-arg`` is one argument
passed on) and stops it at the end; with ``--url`` it targets a running one. It keeps
``--concurrency`` non-streaming ``/v1/completions`` requests in flight for ``--duration-s``
(each a fresh seeded random token-id prompt of ``--prompt-len`` tokens, greedy,
``--max-tokens`` tokens, ``ignore_eos``; ``--pause-every-s`` S: the load pauses for
``--pause-s`` after every S seconds, so the engine goes idle), and every ``--sample-s``
seconds records the RSS (``/proc/<pid>/status`` ``VmRSS`` and ``RssAnon``) of every Serve
replica process of the application on this machine (process title ``ray::ServeReplica:<app>:<deployment>``; the
engine replicas are ``engine``, ``prefill`` or ``decode``), the proxy's, and the requests
answered so far.

The JSON (written by ``flotilla.deploy.bench_env.write_result``, with its provenance) holds
every sample and, per process, :func:`growth`: RSS at the first sample after warm-up, at the
end, the peak, and MiB per 1000 requests over each half of the run; ``levels_off`` says
whether the second half grew by at most ``--flat-mib`` MiB per 1000 requests or by at most
a quarter of the first half's rate.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from flotilla.deploy.bench_env import write_result

ENGINE_DEPLOYMENTS = ("engine", "prefill", "decode")
PROXY_TITLE = "ray::ProxyActor"
MIB = 1 << 20


def proc_rss(pid: int) -> dict[str, int] | None:
    """``VmRSS`` and ``RssAnon`` of ``pid`` in bytes (None when it is gone)."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    out = {}
    for line in text.splitlines():
        name, _, value = line.partition(":")
        if name in ("VmRSS", "RssAnon"):
            out[name] = int(value.split()[0]) * 1024
    return out or None


def parent_of(pid: int) -> int | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[1])  # NOTE: the name in parentheses may hold spaces


def descends_from(pid: int, root: int) -> bool:
    while pid and pid != 1:
        if pid == root:
            return True
        pid = parent_of(pid) or 0
    return False


def serve_processes(app: str, root: int | None = None) -> dict[str, int]:
    """``{label: pid}`` of this machine's Serve processes of ``app`` (label: the deployment
    and pid, e.g. ``engine:1234``) and its proxy (``proxy:<pid>``), from process titles;
    with ``root``, only the descendants of that process (the Ray cluster a started
    ``flotilla serve`` runs; other clusters on the machine may serve an ``app`` too)."""
    prefix = f"ray::ServeReplica:{app}:"
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            title = (entry / "cmdline").read_bytes().split(b"\0")[0].decode(errors="replace")
        except OSError:
            continue
        if root is not None and title.startswith(("ray::ServeReplica:", PROXY_TITLE)) and not descends_from(int(entry.name), root):
            continue
        if title.startswith(prefix):
            deployment = title[len(prefix) :].split(".")[0].split(":")[0]
            found[f"{deployment}:{entry.name}"] = int(entry.name)
        elif title.startswith(PROXY_TITLE):
            found[f"proxy:{entry.name}"] = int(entry.name)
    return found


def growth(samples: list[dict[str, Any]], label: str, warmup_s: float, flat_mib: float) -> dict[str, Any] | None:
    """How the RSS of process ``label`` moved: at the first sample past ``warmup_s`` and the
    last, its peak, and MiB per 1000 requests over the first and the second half of the
    samples after warm-up (by time); ``levels_off`` when the second half grew by at most
    ``flat_mib`` MiB per 1000 requests, or by at most a quarter of the first half's rate."""
    points = [(s["t_s"], s["requests"], s["rss"][label]["VmRSS"]) for s in samples if label in s["rss"]]
    warm = [p for p in points if p[0] >= warmup_s] or points
    if len(warm) < 3:
        return None
    middle = warm[len(warm) // 2]

    def per_1000(a, b) -> float | None:
        done = b[1] - a[1]
        return round((b[2] - a[2]) / MIB * 1000 / done, 3) if done > 0 else None

    first_half, second_half = per_1000(warm[0], middle), per_1000(middle, warm[-1])
    levels_off = second_half is not None and (
        second_half <= flat_mib or (first_half is not None and first_half > 0 and second_half <= first_half / 4)
    )
    return {
        "rss_start_mib": round(warm[0][2] / MIB, 1),
        "rss_mid_mib": round(middle[2] / MIB, 1),
        "rss_end_mib": round(warm[-1][2] / MIB, 1),
        "rss_peak_mib": round(max(p[2] for p in warm) / MIB, 1),
        "requests": warm[-1][1] - warm[0][1],
        "mib_per_1000_requests_first_half": first_half,
        "mib_per_1000_requests_second_half": second_half,
        "levels_off": levels_off,
    }


class Sampler(threading.Thread):
    """Samples the app's processes' RSS every ``every_s`` (and once more on ``stop``)."""

    def __init__(self, app: str, every_s: float, counter: dict[str, int], root: int | None = None):
        super().__init__(daemon=True)
        self.app, self.every_s, self.counter, self.root = app, every_s, counter, root
        self.samples: list[dict[str, Any]] = []
        self.started = time.monotonic()
        self._halt = threading.Event()

    def sample(self) -> None:
        found = serve_processes(self.app, self.root)
        rss = {label: r for label, pid in found.items() if (r := proc_rss(pid)) is not None}
        row = {"t_s": round(time.monotonic() - self.started, 1), "requests": self.counter["done"], "rss": rss}
        self.samples.append(row)
        engines = {k: round(v["VmRSS"] / MIB) for k, v in rss.items() if k.split(":")[0] in ENGINE_DEPLOYMENTS}
        print(f"soak: t={row['t_s']:>6.0f}s requests={row['requests']:>6} engine RSS MiB={engines}", flush=True)

    def run(self) -> None:
        while not self._halt.wait(self.every_s):
            self.sample()

    def stop(self) -> None:
        self._halt.set()
        self.join()
        self.sample()


async def soak(url: str, model: str, opts: argparse.Namespace, counter: dict[str, int]) -> dict[str, int]:
    """Closed-loop short completions for ``opts.duration_s``; counts by status."""
    import httpx

    statuses: dict[str, int] = {}
    deadline = time.monotonic() + opts.duration_s
    rng = random.Random(opts.seed)
    limits = httpx.Limits(max_connections=opts.concurrency, max_keepalive_connections=opts.concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as client:

        started = time.monotonic()

        async def worker() -> None:
            while (now := time.monotonic()) < deadline:
                if opts.pause_every_s and (now - started) % (opts.pause_every_s + opts.pause_s) >= opts.pause_every_s:
                    await asyncio.sleep(0.2)  # NOTE: a pause: the engine goes idle
                    continue
                prompt = [rng.randrange(3, opts.vocab) for _ in range(opts.prompt_len)]
                body = {"model": model, "prompt": prompt, "max_tokens": opts.max_tokens, "temperature": 0, "ignore_eos": True}
                try:
                    response = await client.post("/v1/completions", json=body)
                    key = str(response.status_code)
                except httpx.HTTPError as exc:
                    key = type(exc).__name__
                statuses[key] = statuses.get(key, 0) + 1
                counter["done"] += 1

        await asyncio.gather(*(worker() for _ in range(opts.concurrency)))
    return statuses


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(serve_args: list[str], port: int, log_path: Path) -> subprocess.Popen:
    """``flotilla serve --port P ARGS`` in its own process group, its output in ``log_path``;
    returns once ``/health`` answers (RuntimeError when it exits first)."""
    import urllib.request

    cmd = [sys.executable, "-m", "flotilla.deploy.cli", "serve", "--port", str(port), *serve_args]
    log = log_path.open("w")
    process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"flotilla serve exited with {process.returncode}; see {log_path}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as response:
                if response.status == 200:
                    return process
        except OSError:
            pass
        time.sleep(2)
    stop_server(process)
    raise RuntimeError(f"flotilla serve did not answer /health within 600 s; see {log_path}")


def stop_server(process: subprocess.Popen) -> None:
    """SIGINT (``flotilla serve`` shuts Serve and its local cluster down), then SIGKILL of
    its process group after 120 s."""
    if process.poll() is not None:
        return
    os.killpg(process.pid, signal.SIGINT)
    try:
        process.wait(120)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait(30)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default=None, help="a running flotilla serve (default: start one)")
    parser.add_argument("--serve-arg", action="append", default=[], help="one argument for the started flotilla serve")
    parser.add_argument("--model-name", default="smollm2", help="the served model name requests use")
    parser.add_argument("--app", default="flotilla", help="the Serve application whose processes are sampled")
    parser.add_argument("--duration-s", type=float, default=300.0)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=24)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=49152, help="token ids are drawn from [3, vocab)")
    parser.add_argument("--sample-s", type=float, default=10.0)
    parser.add_argument("--warmup-s", type=float, default=30.0, help="samples before this are left out of the growth figures")
    parser.add_argument("--flat-mib", type=float, default=5.0, help="MiB per 1000 requests that counts as flat")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--pause-every-s", type=float, default=0.0, help="pause the load after this many seconds (0: never)")
    parser.add_argument("--pause-s", type=float, default=10.0, help="how long each pause lasts")
    parser.add_argument("--json", default=None, help="where to write the result")
    opts = parser.parse_args(argv)

    process, url = None, opts.url
    if url is None:
        port = _free_port()
        log_path = Path(tempfile.gettempdir()) / f"flotilla-soak-serve-{port}.log"
        process = start_server(opts.serve_arg, port, log_path)
        url = f"http://127.0.0.1:{port}"
    counter = {"done": 0}
    sampler = Sampler(opts.app, opts.sample_s, counter, root=process.pid if process is not None else None)
    try:
        sampler.sample()
        sampler.start()
        started = time.monotonic()
        statuses = asyncio.run(soak(url, opts.model_name, opts, counter))
        wall_s = time.monotonic() - started
        sampler.stop()
    finally:
        if process is not None:
            stop_server(process)
    labels = sorted({label for s in sampler.samples for label in s["rss"]})
    summary = {label: growth(sampler.samples, label, opts.warmup_s, opts.flat_mib) for label in labels}
    result = {
        "workload": {
            k: getattr(opts, k)
            for k in ("duration_s", "concurrency", "prompt_len", "max_tokens", "sample_s", "seed", "pause_every_s", "pause_s")
        },
        "server": {"url": opts.url, "started_with": opts.serve_arg if opts.url is None else None},
        "requests": counter["done"],
        "requests_per_s": round(counter["done"] / wall_s, 2) if wall_s else None,
        "statuses": statuses,
        "growth": summary,
        "samples": sampler.samples,
    }
    for label, figures in summary.items():
        print(f"soak: {label}: {figures}")
    if opts.json:
        write_result(opts.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
