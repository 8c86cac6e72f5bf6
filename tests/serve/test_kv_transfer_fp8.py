"""KV block transfer of float8 caches (``--kv-cache-dtype fp8_e4m3`` / ``fp8_e5m2``): both
transports move a float8 block's bytes (one byte an element, so half a bf16 block), whole
blocks and head slices, and a float8 cache never pairs with a cache of another dtype.

The caches hold random bytes (NaN patterns included: nothing here computes), compared as
bytes. NIXL runs in this process; the Ray fallback reads from a real actor.
"""

from __future__ import annotations

import uuid

import pytest
import ray
import torch

from flotilla.kernels.kv_dtype import storage_view
from flotilla.cluster.kv.transport import HeadSpan, NixlTransport, RayObjectTransport


# 2 layers x (K, V), each [8 blocks, 4 tokens, 2 heads, 8]
NUM_LAYERS, NUM_BLOCKS, BLOCK_SHAPE = 2, 8, (4, 2, 8)
BLOCK_BYTES = 4 * 2 * 8  # one block of one region: one byte an element
ENV = {"UCX_NET_DEVICES": "lo", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}


def fp8_cache(seed: int, dtype=torch.float8_e4m3fn, heads: int = 2) -> list[tuple[torch.Tensor, ...]]:
    generator = torch.Generator().manual_seed(seed)
    shape = (NUM_BLOCKS, BLOCK_SHAPE[0], heads, BLOCK_SHAPE[2])
    return [
        tuple(torch.randint(0, 256, shape, dtype=torch.uint8, generator=generator).view(dtype) for _ in range(2))
        for _ in range(NUM_LAYERS)
    ]


def as_bytes(cache) -> list[torch.Tensor]:
    return [storage_view(t) for layer in cache for t in layer]


def nixl(prefix: str, cache, span=None) -> NixlTransport:
    transport = NixlTransport(f"{prefix}-{uuid.uuid4().hex[:8]}")
    transport.register(cache, span)
    return transport


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2], ids=["e4m3", "e5m2"])
def test_nixl_moves_float8_blocks_as_bytes(dtype):
    source, sink = fp8_cache(1, dtype), fp8_cache(2, dtype)
    src, dst = nixl("fp8-src", source), nixl("fp8-dst", sink)
    try:
        dst.connect("src", src.metadata())
        assert dst.read("src", [5, 6], [1, 2], 5.0) == 2 * NUM_LAYERS * 2 * BLOCK_BYTES
        for got, want in zip(as_bytes(sink), as_bytes(source)):
            assert torch.equal(got[1:3], want[5:7])
        assert dst.read("src", [3], [7], 5.0, heads=(1, 2)) == NUM_LAYERS * 2 * BLOCK_BYTES // 2
        for got, want in zip(as_bytes(sink), as_bytes(source)):
            assert torch.equal(got[7, :, 1], want[3, :, 1])
    finally:
        src.close()
        dst.close()


def test_a_float8_cache_does_not_pair_with_another_dtype():
    bf16 = [tuple(torch.zeros(NUM_BLOCKS, *BLOCK_SHAPE, dtype=torch.bfloat16) for _ in range(2)) for _ in range(NUM_LAYERS)]
    e5m2 = fp8_cache(2, torch.float8_e5m2)
    src = nixl("fp8-e4m3", fp8_cache(1))
    others = [nixl("bf16", bf16), nixl("fp8-e5m2", e5m2)]
    try:
        for other, name in zip(others, ("bfloat16", "float8_e5m2")):
            with pytest.raises(ValueError, match=rf"incompatible KV layout: region 0 is dtype=float8_e4m3fn, .* vs dtype={name}"):
                other.connect("src", src.metadata())
    finally:
        for transport in (src, *others):
            transport.close()


@ray.remote(num_cpus=0, runtime_env={"env_vars": ENV})
class Fp8Source:
    """A prefill rank holding a float8 cache behind the Ray fallback's export."""

    def __init__(self, seed: int) -> None:
        self.cache = fp8_cache(seed)
        self.transport = RayObjectTransport(export_method="kv")
        self.transport.register(self.cache, HeadSpan(0, 2, 2))

    def metadata(self) -> bytes:
        return self.transport.metadata()

    def kv(self, op: str, block_ids, heads=None):
        """The dispatching method the Ray fallback calls (``"export"`` first), as a worker rank's."""
        assert op == "export", op
        return self.transport.export(block_ids, heads)

    def cache_bytes(self) -> list[torch.Tensor]:
        return as_bytes(self.cache)


def test_the_ray_fallback_moves_float8_blocks_as_bytes(ray_cluster):
    source = Fp8Source.remote(1)
    try:
        metadata = ray.get(source.metadata.remote(), timeout=60)
        whole, half = fp8_cache(2), fp8_cache(3, heads=1)
        for cache, span, heads in ((whole, HeadSpan(0, 2, 2), None), (half, HeadSpan(1, 1, 2), (1, 2))):
            sink = RayObjectTransport(name=f"fp8-sink-{span.start}")
            sink.register(cache, span)
            sink.connect("prefill", metadata)
            moved = sink.read("prefill", [6, 2], [0, 5], 30.0, heads=heads)
            assert moved == 2 * NUM_LAYERS * 2 * BLOCK_BYTES * span.count // 2
            want = ray.get(source.cache_bytes.remote(), timeout=60)
            for got, region in zip(as_bytes(cache), want):
                expected = region[:, :, span.start : span.stop]
                assert torch.equal(got[0], expected[6]) and torch.equal(got[5], expected[2])
            sink.close()
    finally:
        ray.kill(source)
