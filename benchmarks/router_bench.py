"""The engine routers on a shared-preamble workload: prefix-cache hit rate and load balance.

    python benchmarks/router_bench.py [--replicas 2] [--system-prompts 4] [--users 16]
                                      [--concurrency 8] [--routers round-robin,prefix-affinity,cache-aware]
                                      [--no-live] [--json OUT] [server flags as key=value]

Workload: ``--system-prompts`` system prompts x ``--users`` users, one request each: a preamble
every prompt shares (``--preamble-len`` tokens, longer than one KV block: the case where a
first-block hash sends all traffic to one key), then the system prompt's own text
(``--system-len``), then the user's message (``--user-len``); random token ids (seeded), in
shuffled order, ``--concurrency`` in flight.

Two measurements per router, side by side in one run:

- ``simulated``: the router classes themselves (the same code Serve runs) ranking the
  workload for ``--replicas`` stand-in replicas whose load is the requests in flight, each
  replica keeping every full block it computed (an unbounded prefix cache). Deterministic.
- ``live`` (unless ``--no-live``): ``--replicas`` engine replicas of the embedded model behind
  one Serve app per router (deployed one after another on the same Ray cluster), the workload
  sent through ``/v1/completions`` (greedy, 1 output token), the hit rate from each answer's
  ``usage.prompt_tokens_details.cached_tokens`` (and, as ``engine_hit_rate``, the engines'
  ``flotilla:prefix_cache_hits_total`` / ``prefix_cache_queries_total``, which also count
  any recomputation) and each replica's load from its ``flotilla:request_success_total``.

Reported per router: ``hit_rate`` (prompt tokens found in a prefix cache / prompt tokens),
``requests_per_replica`` and ``max_min_load_ratio`` (the busiest replica's requests over the
idlest's; a replica that got none makes it infinite, reported as null).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import sys
import time
from pathlib import Path
from types import SimpleNamespace

from flotilla.deploy.bench_env import write_result

sys.path.insert(0, str(Path(__file__).parent))

from serve_bench import server_flags  # noqa: E402

ROUTERS = ("round-robin", "prefix-affinity", "cache-aware")
# The vocabulary random token ids are drawn from in the simulation (no model is loaded).
SIMULATED_VOCAB = 32000


def shared_preamble_workload(
    system_prompts: int, users: int, preamble_len: int, system_len: int, user_len: int, vocab: int, seed: int
) -> list[list[int]]:
    """One prompt per (system prompt, user): the shared preamble, the system prompt's own
    tokens, the user's; shuffled (seeded)."""
    rng = random.Random(seed)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(1, vocab) for _ in range(n)]

    preamble = tokens(preamble_len)
    systems = [tokens(system_len) for _ in range(system_prompts)]
    prompts = [preamble + system + tokens(user_len) for system in systems for _ in range(users)]
    rng.shuffle(prompts)
    return prompts


def load_ratio(counts: list[int]) -> float | None:
    """The busiest replica's requests over the idlest's (None when one got none)."""
    return round(max(counts) / min(counts), 3) if min(counts) > 0 else None


def simulate(router_name: str, prompts: list[list[int]], replicas: int, concurrency: int, block_size: int) -> dict:
    """Route ``prompts`` with router ``router_name``'s class for ``replicas`` stand-in replicas
    (see the module docstring); returns the hit rate, requests per replica and load ratio."""
    import importlib

    from ray.serve._private.common import DeploymentHandleSource, DeploymentID, ReplicaID

    from flotilla.serve.prefix_tree import block_keys
    from flotilla.serve.router import router_class_path
    from flotilla.cluster.engine.sampling_params import SamplingParams
    from flotilla.serve.types import GenerateRequest

    module, _, name = router_class_path(router_name).rpartition(".")
    deployment = DeploymentID(name="engine", app_name="router-bench")
    router = getattr(importlib.import_module(module), name)(deployment, DeploymentHandleSource.UNKNOWN)
    router.initialize_state(**({"block_size": block_size} if router_name == "cache-aware" else {}))
    ids = [ReplicaID(f"r{i}", deployment) for i in range(replicas)]
    running = {r: 0 for r in ids}
    cached: dict = {r: set() for r in ids}
    counts = {r: 0 for r in ids}
    in_flight: list[tuple[str, ReplicaID]] = []
    hits = queries = 0
    for i, tokens in enumerate(prompts):
        request_id = f"q{i}"
        call = SimpleNamespace(
            args=[GenerateRequest(request_id, tokens, SamplingParams(max_tokens=1), 0.0, None)],
            kwargs={},
            metadata=SimpleNamespace(internal_request_id=request_id),
            routing_context=SimpleNamespace(should_backoff=False),
        )
        candidates = [SimpleNamespace(replica_id=r, routing_stats={"running": running[r]}) for r in ids]
        chosen = asyncio.run(router.choose_replicas(candidates, call))[0][0].replica_id
        router.on_request_routed(call, chosen, None)
        # The replica's prefix cache: the leading full blocks it already computed hit.
        prefixes = [tuple(tokens[: (n + 1) * block_size]) for n in range(len(block_keys(tokens, block_size)))]
        hit_blocks = next((n for n, prefix in enumerate(prefixes) if prefix not in cached[chosen]), len(prefixes))
        hits += hit_blocks * block_size
        queries += len(tokens)
        cached[chosen].update(prefixes)
        counts[chosen] += 1
        running[chosen] += 1
        in_flight.append((request_id, chosen))
        if len(in_flight) >= concurrency:
            done, where = in_flight.pop(0)
            running[where] -= 1
            router.on_request_completed(where, done)
    per_replica = [counts[r] for r in ids]
    return {"hit_rate": round(hits / queries, 4), "requests_per_replica": per_replica, "max_min_load_ratio": load_ratio(per_replica)}


def _replica_totals(url: str) -> dict[str, dict[str, float]]:
    """Per engine replica: prefix-cache hits, queries and finished requests so far."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    names = {
        "flotilla:prefix_cache_hits_total": "hits",
        "flotilla:prefix_cache_queries_total": "queries",
        "flotilla:request_success_total": "requests",
    }
    totals: dict[str, dict[str, float]] = {}
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=10).text):
        for sample in family.samples:
            if sample.name in names and "replica" in sample.labels:
                entry = totals.setdefault(sample.labels["replica"], {"hits": 0.0, "queries": 0.0, "requests": 0.0})
                entry[names[sample.name]] += sample.value
    return totals


def _settled(url: str, expected_requests: int, timeout_s: float = 30.0) -> dict[str, dict[str, float]]:
    """The totals once every request is counted and two reads agree (replicas push their
    metrics about once a second)."""
    deadline = time.monotonic() + timeout_s
    value = _replica_totals(url)
    while time.monotonic() < deadline:
        time.sleep(1.5)
        again = _replica_totals(url)
        if again == value and sum(e["requests"] for e in again.values()) >= expected_requests:
            return again
        value = again
    raise TimeoutError(f"the replicas' metrics did not settle on {expected_requests} requests within {timeout_s}s: {value}")


def live(routers: list[str], prompts: list[list[int]], replicas: int, concurrency: int, flags: dict) -> dict:
    """Each router in turn behind its own Serve app of ``replicas`` engine replicas."""
    from ray import serve

    from flotilla.deploy.loadgen import http_load
    from flotilla.deploy.serve_cmd import wait_until_healthy
    from flotilla.serve.app import build_app
    from flotilla.serve.plan import resolve_pool, serve_options

    from pd_bench import _free_port

    config, model = resolve_pool(flags)
    port = _free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    out = {}
    for router in routers:
        options = serve_options(config, model=model, router=router, num_replicas=replicas)
        app = f"router-{router}"
        serve.run(build_app(config, options), name=app, route_prefix=f"/{app}")
        url = f"http://127.0.0.1:{port}/{app}"
        wait_until_healthy(url, 300)
        report = asyncio.run(http_load(url, options.served_model_name, prompts, 1, concurrency))
        failed = [r.status for r in report.results if r.status != 200]
        if failed:
            raise RuntimeError(f"router {router}: {len(failed)} requests failed (statuses {sorted(set(failed))})")
        totals = _settled(url, len(prompts))
        per_replica = sorted(int(e["requests"]) for e in totals.values())
        per_replica += [0] * (replicas - len(per_replica))
        cached = sum(r.cached_tokens for r in report.results)
        out[router] = {
            "hit_rate": round(cached / sum(len(p) for p in prompts), 4),
            "engine_hit_rate": round(sum(e["hits"] for e in totals.values()) / sum(e["queries"] for e in totals.values()), 4),
            "requests_per_replica": per_replica,
            "max_min_load_ratio": load_ratio(per_replica),
        }
        print(router, out[router], flush=True)
        serve.delete(app)
    serve.shutdown()
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--system-prompts", type=int, default=4)
    parser.add_argument("--users", type=int, default=16)
    parser.add_argument("--preamble-len", type=int, default=48)
    parser.add_argument("--system-len", type=int, default=160)
    parser.add_argument("--user-len", type=int, default=32)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--routers", default=",".join(ROUTERS))
    parser.add_argument("--no-live", action="store_true", help="the simulation only")
    parser.add_argument("--num-cpus", type=int, default=None, help="logical CPUs of the local Ray cluster")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("flags", nargs="*", help="server fields as key=value (e.g. max_total_tokens=16384)")
    opts = parser.parse_args(argv)
    routers = [r for r in opts.routers.split(",") if r]
    if any(pair.startswith("disable_radix_cache=") for pair in opts.flags):
        parser.error("disable_radix_cache: this benchmark measures the prefix cache, which stays on")
    # NOTE: server_flags turns the prefix cache off for the other benchmarks' repeated rounds.
    flags = {**server_flags(opts.flags), "disable_radix_cache": False}

    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    from flotilla.cluster.engine.limits import DEFAULT_BLOCK_SIZE

    block_size = int(flags.get("page_size", DEFAULT_BLOCK_SIZE))
    shape = (opts.system_prompts, opts.users, opts.preamble_len, opts.system_len, opts.user_len)
    workload = {k: getattr(opts, k) for k in ("replicas", "system_prompts", "users", "preamble_len", "system_len", "user_len", "concurrency", "seed")}
    results: dict = {"workload": workload, "block_size": block_size, "server_flags": flags}
    prompts = shared_preamble_workload(*shape, SIMULATED_VOCAB, opts.seed)
    results["simulated"] = {r: simulate(r, prompts, opts.replicas, opts.concurrency, block_size) for r in routers}
    for router, entry in results["simulated"].items():
        print("simulated", router, entry, flush=True)
    if not opts.no_live:
        from flotilla.cluster.models.sources import resolve_model_source
        from flotilla.serve.app import ensure_ray
        from flotilla.serve.plan import resolve_pool

        ensure_ray(None, num_cpus=opts.num_cpus or max(6, os.cpu_count() or 1))
        _, model = resolve_pool(flags)
        vocab = int(resolve_model_source(model).config_dict["vocab_size"])
        results["model"] = model
        results["live"] = live(routers, shared_preamble_workload(*shape, vocab, opts.seed), opts.replicas, opts.concurrency, flags)
    if opts.json:
        write_result(opts.json, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
