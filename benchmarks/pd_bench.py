"""Prefill/decode disaggregation against the colocated deployment, and the KV transfer's
bandwidth against raw NIXL, on one machine.

    python benchmarks/pd_bench.py [--num-requests 24] [--concurrency 4] [--input-len 256]
                                  [--output-len 32] [--rounds 2] [--kv-transport nixl]
                                  [--json OUT] [server flags as key=value]

Two applications on one Serve: ``colocated`` (one engine replica) and ``pd`` (one prefill
and one decode replica, KV moved by ``--kv-transport``), same model (the embedded SmolLM2
unless ``model_path=...``) and flags. Workload: ``--num-requests`` random token-id prompts
(seeded, distinct: no prefix sharing) through ``/v1/completions`` (streaming, greedy,
``ignore_eos``: exactly ``--output-len`` tokens each), ``--concurrency`` in flight. Rounds
alternate colocated and PD so a noisy machine's drift hits both. Reported per deployment
(median over rounds): TTFT median, TPOT median ((e2e - TTFT) / (tokens - 1) per request),
output tokens/s; and the ratios PD / colocated.

KV bandwidth: the decode pool's ``flotilla:kv_transfer_bytes_total`` over
``flotilla:kv_transfer_seconds_sum`` across the PD rounds (what the serving path achieves
per request, connection set-up excluded after warm-up), against raw NIXL: two Ray actors,
one NIXL agent each (UCX, the same memory kind), READing a buffer of the mean per-request
KV size, and 64 MiB, timed per read (median of 20).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import sys
import time
from pathlib import Path

from flotilla.deploy.bench_env import write_result

sys.path.insert(0, str(Path(__file__).parent))

from serve_bench import random_token_prompts, server_flags  # noqa: E402

RAW_READS = 20


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _pd_transfer_totals(url: str) -> tuple[float, float, float]:
    """(bytes, seconds, reads) the decode pool's KV transfers have moved so far."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    totals = {"flotilla:kv_transfer_bytes_total": 0.0, "flotilla:kv_transfer_seconds_sum": 0.0, "flotilla:kv_transfer_seconds_count": 0.0}
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=10).text):
        for sample in family.samples:
            if sample.name in totals and sample.labels.get("pool") == "decode":
                totals[sample.name] += sample.value
    return tuple(totals.values())  # type: ignore[return-value]


def _settled_totals(url: str) -> tuple[float, float, float]:
    """The totals once two reads agree (replicas push their metrics about once a second)."""
    value = _pd_transfer_totals(url)
    for _ in range(10):
        time.sleep(1.5)
        again = _pd_transfer_totals(url)
        if again == value:
            break
        value = again
    return value


def raw_nixl_gbps(sizes: list[int], device: str) -> dict[str, float]:
    """GB/s of raw NIXL READs (agent to agent, no flotilla code) of each size in bytes:
    median over :data:`RAW_READS` reads after one warm-up read."""
    import ray

    env = {"UCX_NET_DEVICES": "lo", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}

    @ray.remote(num_cpus=0, num_gpus=1 if device == "cuda" else 0, runtime_env={"env_vars": env})
    class Agent:
        def __init__(self, name: str, nbytes: int):
            import torch
            from nixl._api import nixl_agent, nixl_agent_config

            self.buffer = torch.ones(nbytes, dtype=torch.uint8, device=device)
            self.agent = nixl_agent(name, nixl_agent_config(enable_prog_thread=True, enable_listen_thread=False, backends=[]))
            self.agent.create_backend("UCX", {})
            self.agent.register_memory([self.buffer])
            self.mem = "VRAM" if device == "cuda" else "DRAM"

        def metadata(self) -> tuple[bytes, int]:
            return self.agent.get_agent_metadata(), self.buffer.data_ptr()

        def read(self, peer: tuple[bytes, int], nbytes: int, times: int) -> list[float]:
            remote = self.agent.add_remote_agent(peer[0])
            local = self.agent.get_xfer_descs([(self.buffer.data_ptr(), nbytes, 0)], self.mem)
            far = self.agent.get_xfer_descs([(peer[1], nbytes, 0)], self.mem)
            seconds = []
            for _ in range(times + 1):
                start = time.perf_counter()
                handle = self.agent.initialize_xfer("READ", local, far, remote)
                state = self.agent.transfer(handle)
                while state == "PROC":
                    state = self.agent.check_xfer_state(handle)
                assert state == "DONE", state
                seconds.append(time.perf_counter() - start)
                self.agent.release_xfer_handle(handle)
            return seconds[1:]

    out = {}
    for nbytes in sizes:
        src, dst = Agent.remote(f"raw-src-{nbytes}", nbytes), Agent.remote(f"raw-dst-{nbytes}", nbytes)
        seconds = ray.get(dst.read.remote(src.metadata.remote(), nbytes, RAW_READS), timeout=300)
        out[str(nbytes)] = round(nbytes / statistics.median(seconds) / 1e9, 3)
        for actor in (src, dst):
            ray.kill(actor)
    return out


def tpot_median(report) -> float | None:
    """Median over requests of (e2e - TTFT) / (output tokens - 1)."""
    values = [
        (r.e2e_s - r.ttft_s) / (r.output_tokens - 1)
        for r in report.results
        if r.status == 200 and r.error is None and r.ttft_s is not None and r.output_tokens > 1
    ]
    return round(statistics.median(values), 5) if values else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-requests", type=int, default=24)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--kv-transport", choices=("nixl", "ray"), default="nixl")
    parser.add_argument("--num-cpus", type=int, default=None, help="logical CPUs of the local Ray cluster")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("flags", nargs="*", help="server fields as key=value (e.g. max_total_tokens=8192)")
    opts = parser.parse_args(argv)
    # NOTE: distinct prompts, and no cache across rounds: every request computes and moves its whole prompt.
    flags = server_flags(opts.flags)

    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    from ray import serve

    from flotilla.cluster.models.sources import resolve_model_source
    from flotilla.deploy.loadgen import http_load
    from flotilla.deploy.serve_cmd import wait_until_healthy
    from flotilla.serve.app import build_app, build_pd_app, ensure_ray
    from flotilla.serve.plan import resolve_pool, serve_options
    from flotilla.serve.plan import pd_server_fields

    ensure_ray(None, num_cpus=opts.num_cpus or max(6, os.cpu_count() or 1))
    colocated, model = resolve_pool(flags)
    prefill_fields, decode_fields = pd_server_fields(flags)
    # NOTE: the decode pool's prefix cache stays off too (pd_server_fields turns it on by default).
    decode_fields["disaggregation_decode_enable_radix_cache"] = False
    prefill, _ = resolve_pool(prefill_fields)
    decode, _ = resolve_pool(decode_fields)
    colocated_options = serve_options(colocated, model=model)
    pd_options = serve_options(decode, model=model, disaggregation_mode="pd", kv_transport=opts.kv_transport)
    source = resolve_model_source(model)
    prompts = random_token_prompts(opts.num_requests, opts.input_len, int(source.config_dict["vocab_size"]), opts.seed)

    port = _free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(build_app(colocated, colocated_options), name="colocated", route_prefix="/colo")
    serve.run(build_pd_app(prefill, decode, pd_options), name="pd", route_prefix="/pd")
    urls = {"colocated": f"http://127.0.0.1:{port}/colo", "pd": f"http://127.0.0.1:{port}/pd"}
    for url in urls.values():
        wait_until_healthy(url, 300)
    name = colocated_options.served_model_name

    def run(which: str, batch: list[list[int]], output_len: int, concurrency: int):
        return asyncio.run(http_load(urls[which], name, batch, output_len, concurrency))

    warm = random_token_prompts(4, opts.input_len, int(source.config_dict["vocab_size"]), opts.seed + 1)
    for which in urls:
        run(which, warm, 4, 2)
    start_totals = _settled_totals(urls["pd"])
    rounds = []
    for _ in range(opts.rounds):
        entry = {}
        for which in ("colocated", "pd"):
            report = run(which, prompts, opts.output_len, opts.concurrency)
            summary = report.summary()
            summary["tpot_median_s"] = tpot_median(report)
            entry[which] = summary
        rounds.append(entry)
        print(json.dumps(entry), flush=True)
    end_totals = _settled_totals(urls["pd"])
    moved, seconds, reads = (b - a for a, b in zip(start_totals, end_totals))
    mean_read = int(moved / reads) if reads else 0
    serve.shutdown()
    raw = raw_nixl_gbps([s for s in (mean_read, 64 << 20) if s > 0], prefill.device or "cpu")

    def med(which: str, key: str) -> float | None:
        values = [r[which][key] for r in rounds if r[which][key] is not None]
        return statistics.median(values) if values else None

    results = {
        "workload": {k: getattr(opts, k) for k in ("num_requests", "concurrency", "input_len", "output_len", "seed")},
        "server_flags": flags,
        "kv_transport": opts.kv_transport,
        "model": name,
        "device": prefill.device or "cpu",
        "rounds": rounds,
        "ttft_median_s": {w: med(w, "ttft_median_s") for w in urls},
        "tpot_median_s": {w: med(w, "tpot_median_s") for w in urls},
        "output_tok_s": {w: med(w, "output_tok_s") for w in urls},
        "kv_transfer": {
            "reads": int(reads),
            "bytes": int(moved),
            "mean_bytes_per_read": mean_read,
            "serving_path_gb_s": round(moved / seconds / 1e9, 3) if seconds else None,
            "raw_nixl_gb_s_by_bytes": raw,
        },
    }
    for key in ("ttft_median_s", "tpot_median_s", "output_tok_s"):
        both = results[key]
        if both["colocated"] and both["pd"]:
            results[f"{key}_pd_over_colocated"] = round(both["pd"] / both["colocated"], 3)
    print(json.dumps({k: v for k, v in results.items() if k != "rounds"}, indent=2))
    if opts.json:
        write_result(opts.json, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
