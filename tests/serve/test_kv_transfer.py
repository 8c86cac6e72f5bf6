"""KV block transfer between two real Ray actors (NIXL over UCX on loopback, and the
Ray-object fallback), the fault paths, and the source-side leases (fake clock).

Equality is bit-exact: a transfer copies bytes, nothing is computed.
"""

from __future__ import annotations

import pickle
import time
import uuid

import pytest
import torch

from flotilla.serve.kv_transfer import (
    BlockLeases,
    KVTransferError,
    NixlTransport,
    RayObjectTransport,
    block_runs,
)

ray = pytest.importorskip("ray")

# 2 layers x (K, V), each [16 blocks, 4 tokens, 2 heads, 8]
SMALL = dict(num_layers=2, num_blocks=16, block_shape=(4, 2, 8))
# 64 MiB in all: 2 layers x (K, V) x [512 blocks, 16 tokens, 8 heads, 64] float32 (16 MiB each)
LARGE = dict(num_layers=2, num_blocks=512, block_shape=(16, 8, 64))
TRANSPORTS = ["nixl", "ray"]
ENV = {"UCX_NET_DEVICES": "lo", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}


def make_cache(num_layers: int, num_blocks: int, block_shape: tuple[int, ...], seed: int) -> list[tuple[torch.Tensor, ...]]:
    """Values from one arange per cache: every element is distinct within a cache and
    across seeds while they stay below 2**24 (SMALL does; LARGE only has to differ)."""
    numel = num_blocks * int(torch.Size(block_shape).numel())
    caches = []
    for layer in range(num_layers):
        pair = []
        for t in range(2):
            start = ((seed * num_layers + layer) * 2 + t) * numel
            pair.append(torch.arange(start, start + numel, dtype=torch.float64).to(torch.float32).reshape(num_blocks, *block_shape))
        caches.append(tuple(pair))
    return caches


@ray.remote(num_cpus=0, runtime_env={"env_vars": ENV})
class CacheHolder:
    """One rank (the test's stand-in for a worker): a SMALL and a LARGE paged cache, each
    registered with both transports (so one actor process serves every case: actors are
    the slow part of this module on a 2-core box)."""

    def __init__(self, name: str, seed: int, kinds: list[str], sizes: tuple[str, ...]) -> None:
        layouts = {"small": SMALL, "large": LARGE}
        self.caches = {size: make_cache(seed=seed, **layouts[size]) for size in sizes}
        self.transports = {}
        for size, cache in self.caches.items():
            for kind in kinds:
                if kind == "nixl":
                    transport = NixlTransport(f"{name}-{size}")
                else:
                    transport = RayObjectTransport(export_method=f"export_{size}")
                transport.register(cache)
                self.transports[kind, size] = transport

    def metadata(self, kind: str, size: str) -> bytes:
        return self.transports[kind, size].metadata()

    def connect(self, kind: str, size: str, peer: str, metadata: bytes) -> None:
        self.transports[kind, size].connect(peer, metadata)

    def read(self, kind: str, size: str, peer: str, src: list[int], dst: list[int], timeout_s: float) -> float:
        start = time.perf_counter()
        self.transports[kind, size].read(peer, src, dst, timeout_s)
        return time.perf_counter() - start

    def export_small(self, block_ids: list[int]) -> list:
        return self.transports["ray", "small"].export(block_ids)

    def export_large(self, block_ids: list[int]) -> list:
        return self.transports["ray", "large"].export(block_ids)

    def fail_next_reads(self, kind: str, n: int) -> None:
        self.transports[kind, "small"].fail_next_reads = n

    def reset(self, seed: int) -> None:
        """Refill the SMALL cache in place (its memory stays registered)."""
        for layer, fresh in zip(self.caches["small"], make_cache(seed=seed, **SMALL)):
            for t, f in zip(layer, fresh):
                t.copy_(f)

    def cache(self, size: str = "small") -> list[tuple[torch.Tensor, ...]]:
        return self.caches[size]


def start_holder(role: str, seed: int, sizes: tuple[str, ...] = ("small", "large")):
    return CacheHolder.remote(f"{role}-{uuid.uuid4().hex[:8]}-rank0", seed, TRANSPORTS, sizes)


def connect(src, dst, peer: str, sizes: tuple[str, ...]) -> list:
    """Every transport of ``dst`` learns ``src`` as ``peer``; metadata crosses through
    Ray (an actor call's result passed to another actor call). Returns the refs."""
    return [dst.connect.remote(kind, size, peer, src.metadata.remote(kind, size)) for kind in TRANSPORTS for size in sizes]


@pytest.fixture(scope="module")
def holders(ray_cluster):
    """(source, destination, doomed): the destination knows the source as "prefill" and
    the doomed source (SMALL only; the peer-death test kills it) as "doomed".

    NOTE: the three actors start together: actor start-up dominates this module's time."""
    src, dst, doomed = start_holder("prefill", 1), start_holder("decode", 2), start_holder("doomed", 3, ("small",))
    ray.get(connect(src, dst, "prefill", ("small", "large")) + connect(doomed, dst, "doomed", ("small",)), timeout=60)
    yield src, dst, doomed
    for actor in (src, dst, doomed):
        ray.kill(actor)


@pytest.fixture(params=TRANSPORTS)
def kind(request):
    return request.param


def test_read_moves_exactly_the_requested_blocks(holders, kind):
    src, dst, _ = holders
    ray.get(dst.reset.remote(2), timeout=30)  # NOTE: both transports share this cache
    ray.get(dst.read.remote(kind, "small", "prefill", [3, 7, 8], [0, 5, 1], 10.0), timeout=30)
    source, after = ray.get([src.cache.remote(), dst.cache.remote()])
    before = make_cache(seed=2, **SMALL)
    untouched = [b for b in range(SMALL["num_blocks"]) if b not in (0, 5, 1)]
    for layer in range(SMALL["num_layers"]):
        for t in range(2):
            for s, d in zip([3, 7, 8], [0, 5, 1]):
                assert torch.equal(after[layer][t][d], source[layer][t][s])
            assert torch.equal(after[layer][t][untouched], before[layer][t][untouched])


def test_unknown_block_and_unknown_peer_raise(holders, kind):
    _, dst, _ = holders
    with pytest.raises(KVTransferError, match=r"source block ids \[16\]"):
        ray.get(dst.read.remote(kind, "small", "prefill", [2, 16], [2, 3], 5.0), timeout=30)
    with pytest.raises(KVTransferError, match="unknown KV peer"):
        ray.get(dst.read.remote(kind, "small", "nobody", [1], [1], 5.0), timeout=30)


def test_injected_failure_raises_once_and_moves_nothing(holders, kind):
    src, dst, _ = holders
    block = 9 if kind == "nixl" else 10  # NOTE: a block no other test of this kind writes
    before = ray.get(dst.cache.remote())
    ray.get(dst.fail_next_reads.remote(kind, 1))
    with pytest.raises(KVTransferError, match="injected"):
        ray.get(dst.read.remote(kind, "small", "prefill", [block], [block], 5.0), timeout=30)
    assert all(torch.equal(a, b) for la, lb in zip(before, ray.get(dst.cache.remote())) for a, b in zip(la, lb))
    ray.get(dst.read.remote(kind, "small", "prefill", [block], [block], 5.0), timeout=30)  # the seam fires once
    assert torch.equal(ray.get(dst.cache.remote())[1][1][block], ray.get(src.cache.remote())[1][1][block])


def test_read_after_peer_died_raises_within_timeout(holders):
    """The doomed source, killed after one good read: every transport's next read raises
    KVTransferError. The bound: the transport's timeout is 5 s and the driver's guard
    30 s; both transports in fact fail at once (NIXL: NIXL_ERR_REMOTE_DISCONNECT)."""
    _, dst, doomed = holders
    for kind in TRANSPORTS:
        ray.get(dst.read.remote(kind, "small", "doomed", [1], [15], 5.0), timeout=30)  # the connection is up
    ray.kill(doomed, no_restart=True)
    time.sleep(0.5)
    for kind in TRANSPORTS:
        with pytest.raises(KVTransferError):
            ray.get(dst.read.remote(kind, "small", "doomed", [2, 3], [14, 13], 5.0), timeout=30)


def test_api_misuse_is_refused_in_process():
    """Two NIXL agents in this process (no Ray): the checks made before any transfer."""
    a, b = NixlTransport(f"api-a-{uuid.uuid4().hex[:8]}"), NixlTransport(f"api-b-{uuid.uuid4().hex[:8]}")
    cache_a, cache_b = make_cache(seed=1, **SMALL), make_cache(seed=2, **SMALL)
    with pytest.raises(ValueError, match="register"):
        b.connect("a", b"")
    a.register(cache_a)
    b.register(cache_b)
    with pytest.raises(ValueError, match="already"):
        b.register(cache_b)
    other = NixlTransport(f"api-c-{uuid.uuid4().hex[:8]}")
    other.register([(torch.zeros(16, 4, 2, 4),)])
    with pytest.raises(ValueError, match="incompatible KV layout"):
        b.connect("c", other.metadata())
    b.connect("a", a.metadata())
    with pytest.raises(ValueError, match="pair up"):
        b.read("a", [1, 2], [1], 5.0)
    with pytest.raises(ValueError, match=r"dst_block_ids \[16\]"):
        b.read("a", [1], [16], 5.0)
    b.read("a", [4, 5], [6, 7], 5.0)  # consecutive on both sides: one descriptor per region
    assert torch.equal(cache_b[1][0][6:8], cache_a[1][0][4:6])
    error = pickle.loads(pickle.dumps(KVTransferError("lost")))
    assert isinstance(error, KVTransferError) and str(error) == "lost"
    for t in (a, b, other):
        t.close()


def test_block_runs_coalesce_only_where_both_sides_are_consecutive():
    assert block_runs([3, 7, 8], [0, 5, 1]) == [(3, 0, 1), (7, 5, 1), (8, 1, 1)]
    assert block_runs([3, 4, 5, 9], [0, 1, 2, 3]) == [(3, 0, 3), (9, 3, 1)]
    assert block_runs([], []) == []


def test_leases_expire_release_and_never_double_free():
    now = [100.0]
    leases = BlockLeases(clock=lambda: now[0])
    leases.grant("a", [1, 2], ttl_s=5.0)
    leases.grant("b", [3], ttl_s=10.0)
    with pytest.raises(ValueError, match="already holds"):
        leases.grant("a", [4], ttl_s=1.0)
    with pytest.raises(ValueError, match="ttl_s"):
        leases.grant("c", [4], ttl_s=0)
    now[0] = 104.9
    assert leases.expire() == []
    now[0] = 105.0
    assert leases.expire() == [[1, 2]]
    assert leases.release("a") is None  # expired: its blocks were already handed back
    assert leases.held() == {"b": [3]}
    assert leases.release("b") == [3]
    assert leases.expire(now=1e9) == [] and len(leases) == 0


def test_bandwidth_64_mib(holders, capsys):
    """Not timed: prints GB/s of one 64 MiB read (every block of the LARGE caches) per
    transport, after a one-block warm-up read, and checks the bytes arrived."""
    src, dst, _ = holders
    total = LARGE["num_layers"] * 2 * LARGE["num_blocks"] * int(torch.Size(LARGE["block_shape"]).numel()) * 4
    assert total == 64 * 2**20
    ids = list(range(LARGE["num_blocks"]))
    for kind in TRANSPORTS:
        ray.get(dst.read.remote(kind, "large", "prefill", [0], [0], 30.0), timeout=60)
        seconds = ray.get(dst.read.remote(kind, "large", "prefill", ids, ids, 30.0), timeout=60)
        assert torch.equal(ray.get(dst.cache.remote("large"))[1][0], ray.get(src.cache.remote("large"))[1][0])
        with capsys.disabled():
            print(f"\nKV transfer {kind}: 64 MiB in {seconds * 1e3:.1f} ms = {total / seconds / 1e9:.2f} GB/s")
