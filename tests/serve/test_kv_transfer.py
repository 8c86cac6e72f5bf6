"""KV block transfer between real Ray actors (NIXL over UCX on loopback, and the
Ray-object fallback): whole blocks and head slices (heterogeneous TP), endpoints across
TP sizes, the fault paths, and the source-side leases (fake clock).

Equality is bit-exact: a transfer copies bytes, nothing is computed.
"""

from __future__ import annotations

import pickle
import time
import uuid

import pytest
import ray
import torch

from flotilla.cluster.kv.endpoint import (
    KV_TRANSPORTS,
    KVEndpoint,
    KVEndpointFactory,
    default_kv_transport,
    plan_head_reads,
)
from flotilla.cluster.kv.transport import (
    HeadSpan,
    KVTransferError,
    NixlTransport,
    RayObjectTransport,
    RegionLayout,
    block_runs,
    check_compatible,
)
from flotilla.serve.kv_leases import BlockLeases


# 2 layers x (K, V), each [16 blocks, 4 tokens, 2 heads, 8]
SMALL = dict(num_layers=2, num_blocks=16, block_shape=(4, 2, 8))
# SMALL's layout holding one of its two heads (a rank of a TP-2 group)
HALF = dict(num_layers=2, num_blocks=16, block_shape=(4, 1, 8))
# 64 MiB in all: 2 layers x (K, V) x [512 blocks, 16 tokens, 8 heads, 64] float32 (16 MiB each)
LARGE = dict(num_layers=2, num_blocks=512, block_shape=(16, 8, 64))
# size -> (layout, head span); "head1" holds head 1 of SMALL's 2
CACHES = {"small": (SMALL, None), "large": (LARGE, None), "head1": (HALF, HeadSpan(1, 1, 2))}
TRANSPORTS = ["nixl", "ray"]
ENV = {"UCX_NET_DEVICES": "lo", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
SMALL_HEAD_BYTES = 4 * 8 * 4  # one head of one block of one region: 4 tokens x 8 float32
REGIONS = 4


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


def slice_heads(cache, lo: int, hi: int) -> list[tuple[torch.Tensor, ...]]:
    """A rank's own cache holding heads [lo, hi) of ``cache`` (contiguous copies)."""
    return [tuple(t[:, :, lo:hi].contiguous() for t in layer) for layer in cache]


def tensors(cache) -> list[torch.Tensor]:
    return [t for layer in cache for t in layer]


@ray.remote(num_cpus=0, runtime_env={"env_vars": ENV})
class CacheHolder:
    """One process standing in for workers: paged caches (``CACHES``), each registered with
    both transports, and per transport kind a group of TP ranks with a KVEndpoint each (one
    actor process serves every case: actors are the slow part of this module on a 2-core
    box)."""

    def __init__(self, name: str, seed: int, sizes: tuple[str, ...]) -> None:
        self.seed = seed
        self.caches = {size: make_cache(seed=seed, **CACHES[size][0]) for size in sizes}
        self.transports = {}
        for size, cache in self.caches.items():
            for kind in TRANSPORTS:
                if kind == "nixl":
                    transport = NixlTransport(f"{name}-{size}")
                else:
                    transport = RayObjectTransport(export_method=f"export_{size}")
                transport.register(cache, CACHES[size][1])
                self.transports[kind, size] = transport
        self.full: dict[str, list] = {}  # kind -> the group's whole cache (its ranks hold slices)
        self.endpoints: dict[tuple[str, int], KVEndpoint] = {}
        self.rank_caches: dict[tuple[str, int], list] = {}

    def metadata(self, kind: str, size: str) -> bytes:
        return self.transports[kind, size].metadata()

    def connect(self, kind: str, size: str, peer: str, metadata: bytes) -> None:
        self.transports[kind, size].connect(peer, metadata)

    def read(self, kind: str, size: str, peer: str, src: list[int], dst: list[int], timeout_s: float, heads=None):
        """(bytes moved, seconds)."""
        start = time.perf_counter()
        moved = self.transports[kind, size].read(peer, src, dst, timeout_s, heads=heads)
        return moved, time.perf_counter() - start

    def export_small(self, op: str, block_ids: list[int], heads=None) -> list:
        return dispatch_export(op, self.transports["ray", "small"], block_ids, heads)

    def export_large(self, op: str, block_ids: list[int], heads=None) -> list:
        return dispatch_export(op, self.transports["ray", "large"], block_ids, heads)

    def export_head1(self, op: str, block_ids: list[int], heads=None) -> list:
        return dispatch_export(op, self.transports["ray", "head1"], block_ids, heads)

    def fail_next_reads(self, kind: str, n: int) -> None:
        self.transports[kind, "small"].fail_next_reads = n

    def reset(self, seed: int) -> None:
        """Refill the small caches in place (their memory stays registered)."""
        for size in ("small", "head1"):
            if size in self.caches:
                for t, fresh in zip(tensors(self.caches[size]), tensors(make_cache(seed=seed, **CACHES[size][0]))):
                    t.copy_(fresh)

    def cache(self, size: str = "small") -> list[tuple[torch.Tensor, ...]]:
        return self.caches[size]

    # ---- a TP group of endpoints per transport kind

    def attach_group(self, kind: str, name: str, spans: list[tuple[int, int, int]], seed: int) -> list[bytes]:
        """Rank r holds heads ``spans[r]`` of one SMALL cache; returns the ranks' metadata."""
        self.full[kind] = make_cache(seed=seed, **SMALL)
        for rank, span in enumerate(spans):
            # NOTE: real ranks are one actor each and share one export method; here the
            # ranks share this actor, so each gets its own.
            factory = KVEndpointFactory(kind, name, export_method=f"export_rank{rank}")
            self.rank_caches[kind, rank] = slice_heads(self.full[kind], span[0], span[0] + span[1])
            self.endpoints[kind, rank] = factory(rank, self.rank_caches[kind, rank], span)
        return [self.endpoints[kind, rank].metadata() for rank in range(len(spans))]

    def group_connect(self, kind: str, peer_id: str, peer_metadata: list[bytes]) -> None:
        for (k, _), endpoint in self.endpoints.items():
            if k == kind:
                endpoint.connect(peer_id, peer_metadata)

    def group_read(self, kind: str, peer_id: str, src: list[int], dst: list[int]) -> list[int]:
        """Every rank of the group reads; the bytes per rank."""
        ranks = sorted(r for k, r in self.endpoints if k == kind)
        return [self.endpoints[kind, r].read(peer_id, src, dst, 10.0) for r in ranks]

    def group_caches(self, kind: str) -> tuple[list, list]:
        """(the group's whole cache as attached, each rank's cache now)."""
        ranks = sorted(r for k, r in self.endpoints if k == kind)
        return self.full[kind], [tensors(self.rank_caches[kind, r]) for r in ranks]

    def export_rank0(self, op: str, block_ids: list[int], heads=None) -> list:
        return dispatch_export(op, self.endpoints["ray", 0], block_ids, heads)

    def export_rank1(self, op: str, block_ids: list[int], heads=None) -> list:
        return dispatch_export(op, self.endpoints["ray", 1], block_ids, heads)


def dispatch_export(op: str, source, block_ids: list[int], heads) -> list:
    """A dispatching export method, as a worker rank's ``kv(op, ...)`` is: the Ray fallback
    calls it with ``"export"`` first."""
    assert op == "export", op
    return source.export(block_ids, heads)


def start_holder(role: str, seed: int, sizes: tuple[str, ...]):
    return CacheHolder.remote(f"{role}-{uuid.uuid4().hex[:8]}-rank0", seed, sizes)


def connect(src, src_size: str, dst, dst_size: str, peer: str) -> list:
    """Every transport kind of ``dst``'s ``dst_size`` cache learns ``src``'s ``src_size``
    cache as ``peer``; metadata crosses through Ray (an actor call's result passed to
    another actor call). Returns the refs."""
    return [dst.connect.remote(kind, dst_size, peer, src.metadata.remote(kind, src_size)) for kind in TRANSPORTS]


@pytest.fixture(scope="module")
def holders(ray_cluster):
    """(source, destination, doomed). The destination knows the source's small cache as
    "prefill" (from its small and head1 caches), the source's large one as "prefill"
    (from its large one), the source's head1 cache as "prefill-head1" (from its small
    one), and the doomed source (small only; the peer-death test kills it) as "doomed".

    NOTE: the three actors start together: actor start-up dominates this module's time."""
    src = start_holder("prefill", 1, ("small", "large", "head1"))
    dst = start_holder("decode", 2, ("small", "large", "head1"))
    doomed = start_holder("doomed", 3, ("small",))
    refs = connect(src, "small", dst, "small", "prefill") + connect(src, "large", dst, "large", "prefill")
    refs += connect(src, "small", dst, "head1", "prefill") + connect(src, "head1", dst, "small", "prefill-head1")
    ray.get(refs + connect(doomed, "small", dst, "small", "doomed"), timeout=60)
    yield src, dst, doomed
    for actor in (src, dst, doomed):
        ray.kill(actor)


@pytest.fixture(params=TRANSPORTS)
def kind(request):
    return request.param


def assert_untouched(after, before, blocks: list[int]) -> None:
    untouched = [b for b in range(after[0].shape[0]) if b not in blocks]
    for a, b in zip(after, before):
        assert torch.equal(a[untouched], b[untouched])


def test_read_moves_exactly_the_requested_blocks(holders, kind):
    src, dst, _ = holders
    ray.get(dst.reset.remote(2), timeout=30)  # NOTE: both transports share this cache
    moved, _ = ray.get(dst.read.remote(kind, "small", "prefill", [3, 7, 8], [0, 5, 1], 10.0), timeout=30)
    assert moved == 3 * REGIONS * 2 * SMALL_HEAD_BYTES
    source, after = (tensors(c) for c in ray.get([src.cache.remote(), dst.cache.remote()]))
    for a, s in zip(after, source):
        for s_block, d_block in zip([3, 7, 8], [0, 5, 1]):
            assert torch.equal(a[d_block], s[s_block])
    assert_untouched(after, tensors(make_cache(seed=2, **SMALL)), [0, 5, 1])


def test_head_sliced_reads_move_only_those_heads(holders, kind):
    """Strided on both sides (head 1 of whole caches), strided on the source only (into a
    one-head cache), and strided on the destination only (from a one-head cache)."""
    src, dst, _ = holders
    ray.get(dst.reset.remote(2), timeout=30)
    before_small = tensors(make_cache(seed=2, **SMALL))
    before_half = tensors(make_cache(seed=2, **HALF))
    pairs = [(3, 2), (4, 3), (9, 11)]
    src_ids, dst_ids = [s for s, _ in pairs], [d for _, d in pairs]
    one_head = 3 * REGIONS * SMALL_HEAD_BYTES

    # Whole -> whole, heads (1, 2) only: head 0 of the destination blocks stays.
    assert ray.get(dst.read.remote(kind, "small", "prefill", src_ids, dst_ids, 10.0, (1, 2)), timeout=30)[0] == one_head
    # Whole -> the one-head cache (its own span by default).
    assert ray.get(dst.read.remote(kind, "head1", "prefill", src_ids, dst_ids, 10.0), timeout=30)[0] == one_head
    source = tensors(ray.get(src.cache.remote()))
    after_small, after_half = (tensors(c) for c in ray.get([dst.cache.remote("small"), dst.cache.remote("head1")]))
    for s_t, a_t, b_t, h_t in zip(source, after_small, before_small, after_half):
        for s, d in pairs:
            assert torch.equal(a_t[d, :, 1], s_t[s, :, 1])
            assert torch.equal(a_t[d, :, 0], b_t[d, :, 0])
            assert torch.equal(h_t[d], s_t[s, :, 1:2])
    assert_untouched(after_small, before_small, dst_ids)
    assert_untouched(after_half, before_half, dst_ids)

    # The one-head source -> head 1 of a whole cache (other blocks than above).
    pairs = [(0, 7), (15, 8)]
    moved, _ = ray.get(dst.read.remote(kind, "small", "prefill-head1", [0, 15], [7, 8], 10.0, (1, 2)), timeout=30)
    assert moved == 2 * REGIONS * SMALL_HEAD_BYTES
    source_half = tensors(ray.get(src.cache.remote("head1")))
    after = tensors(ray.get(dst.cache.remote("small")))
    for s_t, a_t, b_t in zip(source_half, after, after_small):
        for s, d in pairs:
            assert torch.equal(a_t[d, :, 1:2], s_t[s]) and torch.equal(a_t[d, :, 0], b_t[d, :, 0])
    assert_untouched(after, after_small, [7, 8])
    # By default a whole cache reads both heads, and that peer holds only head 1.
    with pytest.raises(ValueError, match=r"heads=None .* does not hold \(it holds heads \[1, 2\) of 2\)"):
        ray.get(dst.read.remote(kind, "small", "prefill-head1", [0], [7], 10.0), timeout=30)


@pytest.fixture(scope="module")
def groups(holders):
    """Per transport kind a TP-2 group of endpoints in the source actor (full cache seed 4,
    head 0 and head 1) and a TP-1 group in the destination actor (seed 5), each connected
    to the other: "tp1" and "tp2"."""
    src, dst, _ = holders
    for kind in TRANSPORTS:
        tag = uuid.uuid4().hex[:8]
        tp2 = src.attach_group.remote(kind, f"tp2-{tag}", [(0, 1, 2), (1, 1, 2)], 4)
        tp1 = dst.attach_group.remote(kind, f"tp1-{tag}", [(0, 2, 2)], 5)
        ray.get([dst.group_connect.remote(kind, "tp2", tp2), src.group_connect.remote(kind, "tp1", tp1)], timeout=60)
    return src, dst


def test_endpoints_read_across_tp_sizes(groups, kind):
    """TP 2 -> 1: the one rank assembles whole blocks from both; TP 1 -> 2: each rank
    takes its head. Other blocks stay as they were."""
    tp2, tp1 = groups
    one_head = 3 * REGIONS * SMALL_HEAD_BYTES
    assert ray.get(tp1.group_read.remote(kind, "tp2", [1, 2, 3], [4, 5, 6]), timeout=30) == [2 * one_head]
    assert ray.get(tp2.group_read.remote(kind, "tp1", [7, 8, 9], [10, 12, 11]), timeout=30) == [one_head, one_head]
    (full2, ranks2), (full1, (rank0,)) = ray.get([tp2.group_caches.remote(kind), tp1.group_caches.remote(kind)], timeout=30)
    for t2, t1, after in zip(tensors(full2), tensors(full1), rank0):
        assert torch.equal(after[4:7], t2[1:4])
        assert_untouched([after], [t1], [4, 5, 6])
    for rank, regions in enumerate(ranks2):
        for t2, t1, after in zip(tensors(full2), tensors(full1), regions):
            assert torch.equal(after[[10, 12, 11]], t1[7:10, :, rank : rank + 1])
            assert_untouched([after], [t2[:, :, rank : rank + 1]], [10, 11, 12])


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
    assert all(torch.equal(a, b) for a, b in zip(tensors(before), tensors(ray.get(dst.cache.remote()))))
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


# ---- in process (no Ray actors): NIXL agents of this process --------------------------


def nixl(prefix: str, cache, span=None) -> NixlTransport:
    transport = NixlTransport(f"{prefix}-{uuid.uuid4().hex[:8]}")
    transport.register(cache, span)
    return transport


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
    with pytest.raises(ValueError, match=r"regions \(index, heads\) \[\(0, 2\), .* head_span.count=1"):
        NixlTransport(f"api-d-{uuid.uuid4().hex[:8]}").register(cache_b, (0, 1, 2))
    other = nixl("api-c", [(torch.zeros(16, 4, 2, 4),)])
    with pytest.raises(ValueError, match="incompatible KV layout: 1 regions vs 4 here"):
        b.connect("c", other.metadata())
    with pytest.raises(ValueError, match="not KV transport metadata"):
        b.connect("c", b"junk")
    b.connect("a", a.metadata())
    with pytest.raises(ValueError, match="pair up"):
        b.read("a", [1, 2], [1], 5.0)
    with pytest.raises(ValueError, match=r"dst_block_ids \[16\]"):
        b.read("a", [1], [16], 5.0)
    for heads, message in [
        ((1, 1), r"non-empty range lo < hi \(got heads=\(1, 1\)\)"),
        ((0, 3), r"heads=\(0, 3\) is outside the heads \[0, 2\) of 2 that this rank holds"),
        ((0,), r"\(lo, hi\) pair .*heads=\(0,\)"),
    ]:
        with pytest.raises(ValueError, match=message):
            b.read("a", [1], [1], 5.0, heads=heads)
    assert b.read("a", [4, 5], [6, 7], 5.0) == 2 * REGIONS * 2 * SMALL_HEAD_BYTES
    assert torch.equal(cache_b[1][0][6:8], cache_a[1][0][4:6])
    # Consecutive on both sides: one descriptor per region; a head slice: one per token.
    assert len(b._descriptors("a", [4, 5], [6, 7], 0, 2)[0]) == REGIONS
    assert len(b._descriptors("a", [4, 5], [6, 7], 1, 2)[0]) == REGIONS * 2 * 4
    error = pickle.loads(pickle.dumps(KVTransferError("lost")))
    assert isinstance(error, KVTransferError) and str(error) == "lost"
    for t in (a, b, other):
        t.close()


def test_incompatible_layouts_are_refused_with_the_difference():
    def layouts(block_shape=(4, 2, 8), dtype="float32", regions=4):
        return [RegionLayout(16, block_shape, dtype)] * regions

    whole = HeadSpan(0, 2, 2)
    for peer, peer_span, message in [
        (layouts(regions=2), whole, "2 regions vs 4 here"),
        (layouts(block_shape=(8, 2, 8)), whole, r"region 0 is .*block_size=8, per-head entry \(8,\) vs .*block_size=4"),
        (layouts(block_shape=(4, 2, 4)), whole, r"per-head entry \(4,\) vs .* per-head entry \(8,\) here"),
        (layouts(dtype="bfloat16"), whole, "dtype=bfloat16, .* vs dtype=float32"),
        (layouts(block_shape=(4, 1, 8)), HeadSpan(0, 1, 1), "1 KV heads in all vs 2 here"),
    ]:
        with pytest.raises(ValueError, match=f"peer 'p' has an incompatible KV layout: .*{message}"):
            check_compatible("p", layouts(), whole, peer, peer_span)
    # Only the per-rank head count differs: compatible.
    check_compatible("p", layouts(), whole, [RegionLayout(8, (4, 1, 8), "float32")] * 4, HeadSpan(1, 1, 2))


def test_head_spans_are_validated():
    assert HeadSpan(2, 2, 8).stop == 4 and HeadSpan.of((2, 2, 8)) == HeadSpan(2, 2, 8)
    for bad in [(-1, 1, 2), (0, 0, 2), (1, 2, 2), (0, 1.5, 2)]:
        with pytest.raises(ValueError, match=r"head_span needs .*\(got start="):
            HeadSpan(*bad)
    with pytest.raises(ValueError, match=r"\(start, count, total\) \(got \(0, 1\)\)"):
        HeadSpan.of((0, 1))


def spans(tp: int, kv_heads: int) -> list[HeadSpan]:
    """Rank r's KV heads as QKVParallelLinear lays them out: split when kv_heads >= tp,
    else head r // (tp / kv_heads) (replicated)."""
    if kv_heads >= tp:
        return [HeadSpan(r * kv_heads // tp, kv_heads // tp, kv_heads) for r in range(tp)]
    return [HeadSpan(r // (tp // kv_heads), 1, kv_heads) for r in range(tp)]


@pytest.mark.parametrize(
    "prefill_tp, decode_tp, kv_heads, plans",
    [
        (2, 1, 2, [[(0, 0, 1), (1, 1, 2)]]),  # 2 -> 1: both halves
        (1, 2, 2, [[(0, 0, 1)], [(0, 1, 2)]]),  # 1 -> 2: each rank its head from the one rank
        (2, 4, 8, [[(0, 0, 2)], [(0, 2, 4)], [(1, 4, 6)], [(1, 6, 8)]]),  # 2 -> 4
        (4, 2, 8, [[(0, 0, 2), (1, 2, 4)], [(2, 4, 6), (3, 6, 8)]]),  # 4 -> 2
        (4, 1, 2, [[(0, 0, 1), (2, 1, 2)]]),  # replicated KV heads: read each once, from the first holder
        (4, 4, 2, [[(0, 0, 1)], [(0, 0, 1)], [(2, 1, 2)], [(2, 1, 2)]]),  # same layout, replicated
        (2, 4, 1, [[(0, 0, 1)]] * 4),  # MLA-like: one replicated latent "head"
    ],
)
def test_plan_head_reads(prefill_tp, decode_tp, kv_heads, plans):
    peers = spans(prefill_tp, kv_heads)
    assert [plan_head_reads(local, peers) for local in spans(decode_tp, kv_heads)] == plans


def test_plan_head_reads_refuses_mismatches():
    with pytest.raises(ValueError, match=r"peer head totals \[4, 4\] differ from the local total 2"):
        plan_head_reads(HeadSpan(0, 2, 2), spans(2, 4))
    with pytest.raises(ValueError, match=r"KV head 1 \(local heads \[0, 2\) of 2\) is held by no peer rank"):
        plan_head_reads(HeadSpan(0, 2, 2), [HeadSpan(0, 1, 2)])
    with pytest.raises(ValueError, match="peers is empty"):
        plan_head_reads(HeadSpan(0, 2, 2), [])


def test_endpoints_in_process_connect_read_fail_and_forget():
    """A TP-2 NIXL source (head 0, head 1 of one cache) and a TP-1 destination, in this
    process, built by the factory."""
    tag = uuid.uuid4().hex[:8]
    full = make_cache(seed=1, **SMALL)
    prefill = KVEndpointFactory("nixl", f"pre-{tag}")
    sources = [prefill(rank, slice_heads(full, rank, rank + 1), (rank, 1, 2)) for rank in range(2)]
    cache = make_cache(seed=2, **SMALL)
    sink = KVEndpointFactory("nixl", f"dec-{tag}")(0, cache, HeadSpan(0, 2, 2))
    metadata = [s.metadata() for s in sources]
    try:
        assert sink.name == f"dec-{tag}-rank0" and sources[1].name == f"pre-{tag}-rank1"
        with pytest.raises(KVTransferError, match="unknown KV peer 'pre'"):
            sink.read("pre", [1], [1], 5.0)
        with pytest.raises(ValueError, match="KV head 1 .* is held by no peer rank"):
            sink.connect("pre", metadata[:1])
        with pytest.raises(ValueError, match="peer_metadata for 'pre' is empty"):
            sink.connect("pre", [])
        with pytest.raises(ValueError, match="peer_metadata of 'pre/1' is not KV transport metadata"):
            sink.connect("pre", [metadata[0], b"junk"])
        assert not sink.is_connected("pre")
        sink.connect("pre", metadata)
        sink.connect("pre", [b"ignored: already connected"])
        assert sink.is_connected("pre")

        # The injected failure fires once through the endpoint and moves nothing.
        sink.fail_next_reads = 1
        with pytest.raises(KVTransferError, match="injected"):
            sink.read("pre", [3], [3], 5.0)
        assert sink.fail_next_reads == 0 and torch.equal(cache[0][0][3], make_cache(seed=2, **SMALL)[0][0][3])

        assert sink.read("pre", [3, 4, 9], [3, 4, 5], 5.0) == 3 * REGIONS * 2 * SMALL_HEAD_BYTES
        assert sink.read("pre", [], [], 5.0) == 0
        for got, want in zip(tensors(cache), tensors(full)):
            assert torch.equal(got[3:6], want[[3, 4, 9]])

        # TP 4 with 2 KV heads (ranks 0, 1 hold head 0; ranks 2, 3 head 1): one read per head.
        sink.connect("rep", [metadata[0], metadata[0], metadata[1], metadata[1]])
        sink.forget("pre")
        assert not sink.is_connected("pre") and sink.is_connected("rep")
        assert sink.read("rep", [7], [8], 5.0) == REGIONS * 2 * SMALL_HEAD_BYTES  # the shared agents stay usable
        assert all(torch.equal(got[8], want[7]) for got, want in zip(tensors(cache), tensors(full)))
        with pytest.raises(KVTransferError, match="unknown KV peer 'pre'"):
            sink.read("pre", [1], [1], 5.0)
        with pytest.raises(ValueError, match="export\\(\\) serves the Ray fallback"):
            sources[0].export([1])
    finally:
        for endpoint in (sink, *sources):
            endpoint.close()


def test_endpoint_factory_is_a_picklable_value():
    factory = KVEndpointFactory("ray", "replica-1234abcd", (("ucx_error_handling_mode", "none"),), "kv_export")
    assert pickle.loads(pickle.dumps(factory)) == factory and hash(factory) == hash(pickle.loads(pickle.dumps(factory)))
    with pytest.raises(ValueError, match=r"kind must be one of \('nixl', 'ray'\) \(got kind='tcp'\)"):
        KVEndpointFactory("tcp", "x")
    with pytest.raises(ValueError, match="name must be a non-empty string"):
        KVEndpointFactory("nixl", "")
    with pytest.raises(ValueError, match="kind='ray' builds endpoints inside a Ray actor"):
        factory(0, make_cache(seed=1, **SMALL), (0, 2, 2))
    # NOTE: nixl is a pinned dependency here, so the default is NIXL.
    assert KV_TRANSPORTS == ("nixl", "ray") and default_kv_transport() == "nixl"


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
    assert leases.expire() == {}
    now[0] = 105.0
    assert leases.expire() == {"a": [1, 2]}
    assert leases.release("a") is None  # expired: its blocks were already handed back
    assert leases.held() == {"b": [3]}
    assert leases.release("b") == [3]
    assert leases.expire(now=1e9) == {} and len(leases) == 0 and leases.next_deadline() is None


def test_bandwidth_64_mib(holders, capsys):
    """Not timed: prints GB/s of one 64 MiB read (every block of the LARGE caches) and of
    its first 4 of 8 heads (strided: one chunk per token) per transport, after a one-block
    warm-up read, and checks the bytes arrived."""
    src, dst, _ = holders
    total = LARGE["num_layers"] * 2 * LARGE["num_blocks"] * int(torch.Size(LARGE["block_shape"]).numel()) * 4
    assert total == 64 * 2**20
    ids = list(range(LARGE["num_blocks"]))
    for kind in TRANSPORTS:
        ray.get(dst.read.remote(kind, "large", "prefill", [0], [0], 30.0), timeout=60)
        for heads, label in [(None, "64 MiB"), ((0, 4), "32 MiB as heads [0, 4) of 8")]:
            moved, seconds = ray.get(dst.read.remote(kind, "large", "prefill", ids, ids, 30.0, heads), timeout=60)
            assert moved == (total if heads is None else total // 2)
            with capsys.disabled():
                print(f"\nKV transfer {kind}: {label} in {seconds * 1e3:.1f} ms = {moved / seconds / 1e9:.2f} GB/s")
        assert torch.equal(ray.get(dst.cache.remote("large"))[1][0], ray.get(src.cache.remote("large"))[1][0])


def test_a_dcp_rank_reads_its_token_shard_of_each_block_in_process():
    """Decode context parallelism on the reading side: DCP rank r of 2 holds, of each 4-token
    logical block, the tokens at offsets r and r + 2 in a 2-token block; its NIXL endpoint reads
    exactly those tokens of the source's blocks (all heads, then one head of a TP-2 source), and
    the Ray fallback exports the same bytes. A token-sharded source, or a logical block size
    that differs, is refused at connect."""
    tag = uuid.uuid4().hex[:8]
    full = make_cache(seed=3, **SMALL)  # 16 blocks of 4 tokens, 2 heads
    source = KVEndpointFactory("nixl", f"src-{tag}")(0, full, HeadSpan(0, 2, 2))
    shard_layout = dict(num_layers=2, num_blocks=16, block_shape=(2, 2, 8))
    sinks = [KVEndpointFactory("nixl", f"dcp{r}-{tag}")(0, make_cache(seed=4 + r, **shard_layout), HeadSpan(0, 2, 2), (r, 2)) for r in range(2)]
    caches = [sink._transport._regions for sink in sinks]
    try:
        for r, sink in enumerate(sinks):
            sink.connect("src", [source.metadata()])
            # 2 blocks x 2 tokens x 2 heads of every region moved
            assert sink.read("src", [5, 2], [0, 9], 5.0) == 2 * REGIONS * 2 * (SMALL_HEAD_BYTES // 2)
            for got, want in zip(caches[r], tensors(full)):
                assert torch.equal(got[0], want[5][r::2]) and torch.equal(got[9], want[2][r::2])
        # A TP-2 source (one head per rank) read by a DCP rank holding both heads: per head.
        halves = [KVEndpointFactory("nixl", f"half{h}-{tag}")(h, slice_heads(full, h, h + 1), (h, 1, 2)) for h in range(2)]
        try:
            sinks[1].connect("tp2", [h.metadata() for h in halves])
            sinks[1].read("tp2", [7], [3], 5.0)
            assert all(torch.equal(got[3], want[7][1::2]) for got, want in zip(caches[1], tensors(full)))
        finally:
            for h in halves:
                h.close()
        ray_source = RayObjectTransport(actor_handle=object(), name="ray-src")
        ray_source.register(full, HeadSpan(0, 2, 2))
        exported = ray_source.export([5], None, (1, 2))
        assert all(torch.equal(torch.from_numpy(e).view(torch.float32).reshape(1, 2, 2, 8)[0], want[5][1::2])
                   for e, want in zip(exported, tensors(full)))  # fmt: skip
        with pytest.raises(ValueError, match=r"token shard \(1, 2\) of each block"):
            sinks[0].connect("sharded", [sinks[1].metadata()])
        other = KVEndpointFactory("nixl", f"src8-{tag}")(0, make_cache(seed=9, num_layers=2, num_blocks=4, block_shape=(8, 2, 8)), HeadSpan(0, 2, 2))
        try:
            with pytest.raises(ValueError, match=r"block_size=8, .* block_size=2 x 2 \(token shard \(0, 2\)\)"):
                sinks[0].connect("wide", [other.metadata()])
        finally:
            other.close()
    finally:
        for endpoint in (source, *sinks):
            endpoint.close()
