"""Moving paged KV-cache blocks from prefill ranks to decode ranks.

One rank's cache is ``kv_caches``: a list of per-layer tuples of tensors, each shaped
``[num_blocks, block_size, heads, *entry]`` (``KVCacheSpec.allocate``; Llama-like K and V
hold the rank's KV heads, MLA one latent "head" replicated on every rank). A *region* is
one such tensor; a block of a region is the contiguous slice ``region[b]``. A transfer
moves the same blocks of every region (all layers, all tensors).

Heterogeneous TP: a rank's :class:`HeadSpan` says which global KV heads its cache holds
on axis 2 (``start``, ``count`` of ``total``). Prefill and decode may shard the heads
differently; a destination rank reads only the heads it holds, each from one source rank
that holds it (:func:`flotilla.cluster.kv.endpoint.plan_head_reads`). When the moved heads are the whole block entry on
both sides a read moves whole (coalesced) block runs; otherwise a head slice of a block is
strided (the layout is ``[block_size, heads, *entry]``), one contiguous chunk per token.

Decode context parallelism on the destination: a rank of a DCP group of ``n`` holds, of each
logical block of ``n * block_size`` tokens, the tokens at offsets ``r, r + n, r + 2n, ...``
(its :data:`TokenShard` ``(r, n)``; :mod:`flotilla.kernels.dcp`), in a block of ``block_size``.
It reads those tokens of each source block (whose block holds the whole logical block), one
chunk per token. A token-sharded source is not read (only the destination may be sharded).

The flow, per rank:

1. each rank builds a transport and calls ``register(kv_caches, head_span)`` once at start;
2. the source's ``metadata()`` bytes (they carry its head span) travel to the destination
   THROUGH RAY (an actor call's argument or result) and the destination calls
   ``connect(peer, metadata)``, which refuses incompatible layouts (region count, dtype,
   block size, per-head entry shape, total heads);
3. per request the destination calls ``read(peer, src_block_ids, dst_block_ids,
   timeout_s, heads)``, which pulls the blocks' heads into its own cache and returns the
   bytes moved, or raises :class:`KVTransferError`; it then tells the source to free them
   (the source holds them under a :class:`BlockLeases` lease meanwhile, so a reader that
   never comes back cannot leak them).

One rank's side of that flow across whole TP groups (planning which peer rank serves which
heads) is :class:`~flotilla.cluster.kv.endpoint.KVEndpoint`.

Two transports:

- :class:`NixlTransport`: one NIXL agent per rank, UCX backend, DRAM on CPU (VRAM for
  CUDA tensors); the destination READs the source's registered memory. NIXL's own
  metadata listener is never started (it binds every interface and a fixed port); its
  agent metadata is exchanged through Ray instead, so many replicas on a node never
  collide on a port. Set ``UCX_NET_DEVICES=lo`` in the actors' environment to keep UCX on
  loopback.
- :class:`RayObjectTransport`: the fallback for machines without NIXL: the source's actor
  serves ``export(block_ids, heads)`` through its dispatching method (a worker's
  ``kv("export", block_ids, heads)``; sliced to the heads before sending) and the
  destination copies the returned arrays into its head offsets.

Test seam: every transport (and endpoint) has ``fail_next_reads`` (an int, default 0);
while it is positive the next ``read`` decrements it and raises :class:`KVTransferError`
without moving anything, so fault tests can inject a transfer failure inside a real actor.
"""

from __future__ import annotations

import abc
import functools
import pickle
import threading
import time
import warnings
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from flotilla.kernels.kv_dtype import storage_view

KVCaches = Sequence[Sequence[torch.Tensor]]
# ``(rank, size)``: of each logical block, a cache holds the tokens at offsets ``rank + i * size``
# (decode context parallelism); ``(0, 1)``: every token.
TokenShard = tuple[int, int]
WHOLE_TOKENS: TokenShard = (0, 1)

class KVTransferError(RuntimeError):
    """A KV transfer did not complete (peer unknown or dead, bad block id, timeout,
    backend error, injected failure). Plain and picklable, so it crosses actors intact."""


# ---------------------------------------------------------------------------------------
# Head spans (heterogeneous TP)


@dataclass(frozen=True)
class HeadSpan:
    """The global KV heads one rank's cache holds on axis 2 of each region:
    ``[start, start + count)`` of ``total`` (MLA: ``HeadSpan(0, 1, 1)`` on every rank)."""

    start: int
    count: int
    total: int

    def __post_init__(self) -> None:
        values = (self.start, self.count, self.total)
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in values) or not (
            0 <= self.start and self.count >= 1 and self.start + self.count <= self.total
        ):
            raise ValueError(
                "head_span needs integers with 0 <= start, count >= 1 and start + count <= total "
                f"(got start={self.start!r}, count={self.count!r}, total={self.total!r})"
            )

    @property
    def stop(self) -> int:
        return self.start + self.count

    @classmethod
    def of(cls, span: HeadSpan | Sequence[int]) -> HeadSpan:
        """``span`` itself, or a ``(start, count, total)`` triple as a HeadSpan."""
        if isinstance(span, HeadSpan):
            return span
        values = tuple(span)
        if len(values) != 3:
            raise ValueError(f"head_span must be a HeadSpan or (start, count, total) (got {span!r})")
        return cls(*(int(v) for v in values))

    def __str__(self) -> str:
        return f"heads [{self.start}, {self.stop}) of {self.total}"


# ---------------------------------------------------------------------------------------
# Layout shared by both transports


@functools.cache
def _element_size(dtype: str) -> int:
    return torch.empty(0, dtype=getattr(torch, dtype)).element_size()


@dataclass(frozen=True)
class RegionLayout:
    """One registered tensor: ``num_blocks`` blocks of ``block_shape``
    (``(block_size, heads, *entry)``) and ``dtype``."""

    num_blocks: int
    block_shape: tuple[int, ...]
    dtype: str

    @property
    def block_size(self) -> int:
        return self.block_shape[0]

    @property
    def entry_shape(self) -> tuple[int, ...]:
        """One head's entry of one token (e.g. ``(head_dim,)``)."""
        return self.block_shape[2:]

    @property
    def head_bytes(self) -> int:
        return int(torch.Size(self.entry_shape).numel()) * _element_size(self.dtype)

    @property
    def token_bytes(self) -> int:
        return self.block_shape[1] * self.head_bytes

    @property
    def block_bytes(self) -> int:
        return self.block_size * self.token_bytes


def flatten_regions(kv_caches: KVCaches) -> list[torch.Tensor]:
    """The cache's tensors in (layer, tensor) order, checked to be contiguous
    ``[num_blocks, block_size, heads, *entry]`` tensors."""
    regions = [t for layer in kv_caches for t in layer]
    if not regions:
        raise ValueError("kv_caches is empty: register the cache allocated by KVCacheSpec.allocate")
    for i, t in enumerate(regions):
        if not t.is_contiguous() or t.dim() < 3:
            raise ValueError(
                f"kv_caches region {i} must be a contiguous [num_blocks, block_size, heads, ...] tensor "
                f"(got shape {tuple(t.shape)})"
            )
    return regions


def region_layouts(regions: Sequence[torch.Tensor]) -> tuple[RegionLayout, ...]:
    return tuple(RegionLayout(int(t.shape[0]), tuple(t.shape[1:]), str(t.dtype).removeprefix("torch.")) for t in regions)


def check_compatible(
    peer_name: str,
    local: Sequence[RegionLayout],
    local_span: HeadSpan,
    peer: Sequence[RegionLayout],
    peer_span: HeadSpan,
    local_shard: TokenShard = WHOLE_TOKENS,
    peer_shard: TokenShard = WHOLE_TOKENS,
) -> None:
    """Raise ValueError unless the peer's regions match ours in count, dtype, logical block
    size (a block's tokens times the token shard's size) and per-head entry shape, and both
    sides shard the same total of heads (the block counts and the per-rank head counts may
    differ); a token-sharded peer is refused (only the reading side may be sharded)."""
    problem = None
    if peer_shard != WHOLE_TOKENS:
        problem = f"it holds a token shard {peer_shard} of each block (decode context parallelism); read from unsharded ranks"
    elif len(local) != len(peer):
        problem = f"{len(peer)} regions vs {len(local)} here"
    elif local_span.total != peer_span.total:
        problem = f"{peer_span.total} KV heads in all vs {local_span.total} here"
    else:
        n = local_shard[1]
        for i, (a, b) in enumerate(zip(local, peer)):
            if (a.dtype, a.block_size * n, a.entry_shape) != (b.dtype, b.block_size, b.entry_shape):
                problem = (
                    f"region {i} is dtype={b.dtype}, block_size={b.block_size}, per-head entry {b.entry_shape} "
                    f"vs dtype={a.dtype}, block_size={a.block_size} x {n} (token shard {local_shard}), "
                    f"per-head entry {a.entry_shape} here"
                )
                break
    if problem:
        raise ValueError(
            f"peer {peer_name!r} has an incompatible KV layout: {problem}; both sides must hold the same "
            "layers, dtype, logical block size and head shape (only the TP split of the heads, and the "
            "reading side's DCP token shard, may differ)"
        )


def block_runs(src: Sequence[int], dst: Sequence[int]) -> list[tuple[int, int, int]]:
    """Coalesce block pairs into runs ``(src_start, dst_start, length)`` where both sides
    are consecutive, keeping the given order."""
    runs: list[tuple[int, int, int]] = []
    for s, d in zip(src, dst):
        if runs and s == runs[-1][0] + runs[-1][2] and d == runs[-1][1] + runs[-1][2]:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((s, d, 1))
    return runs


def check_heads(heads: Sequence[int], *spans: tuple[str, HeadSpan]) -> tuple[int, int]:
    """``heads`` as ``(lo, hi)``, checked to be a non-empty range inside every named span."""
    try:
        lo, hi = (int(h) for h in heads)
    except (TypeError, ValueError):
        raise ValueError(f"heads must be a (lo, hi) pair of global KV head indices (got heads={heads!r})") from None
    if lo >= hi:
        raise ValueError(f"heads must be a non-empty range lo < hi (got heads={heads!r})")
    for owner, span in spans:
        if lo < span.start or hi > span.stop:
            raise ValueError(f"heads=({lo}, {hi}) is outside the {span} that {owner} holds")
    return lo, hi


def check_token_shard(shard: Sequence[int]) -> TokenShard:
    """``shard`` as a :data:`TokenShard`, checked: ``0 <= rank < size``."""
    try:
        rank, size = (int(v) for v in shard)
    except (TypeError, ValueError):
        raise ValueError(f"token_shard must be a (rank, size) pair (got token_shard={shard!r})") from None
    if not 0 <= rank < size:
        raise ValueError(f"token_shard needs 0 <= rank < size (got token_shard={shard!r})")
    return rank, size


def _load_metadata(peer_name: str, peer_metadata: bytes) -> dict:
    try:
        info = pickle.loads(peer_metadata)
        HeadSpan.of(info["head_span"])
        info["layouts"]
        info["token_shard"] = check_token_shard(info.get("token_shard", WHOLE_TOKENS))
    except Exception as e:
        raise ValueError(
            f"peer_metadata of {peer_name!r} is not KV transport metadata ({type(e).__name__}: {e}); "
            "pass the bytes of the peer's metadata()"
        ) from None
    return info


# ---------------------------------------------------------------------------------------
# Interface


class KVTransport(abc.ABC):
    """Moves paged KV blocks (all their heads, or a range of them) from a source rank into
    a destination rank's cache.

    Lifecycle: ``register`` once, ``metadata``/``connect`` once per peer (metadata goes
    through Ray), ``read`` per request on the destination, ``forget`` a gone peer,
    ``close`` at shutdown.

    Attributes:
        name: this rank's name (the NIXL agent name).
        head_span: the heads the registered cache holds (set by ``register``).
        fail_next_reads: test seam; while positive, ``read`` decrements it and raises
            :class:`KVTransferError` without moving anything.
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self.fail_next_reads = 0
        self.head_span: HeadSpan | None = None
        self.token_shard: TokenShard = WHOLE_TOKENS
        self._regions: list[torch.Tensor] = []
        self._layouts: tuple[RegionLayout, ...] = ()
        self._peers: dict[str, tuple[tuple[RegionLayout, ...], HeadSpan]] = {}

    def register(
        self,
        kv_caches: KVCaches,
        head_span: HeadSpan | Sequence[int] | None = None,
        token_shard: Sequence[int] = WHOLE_TOKENS,
    ) -> None:
        """Register this rank's cache (once, at start); its tensors must stay alive and
        never be reallocated while the transport is open.

        Args:
            kv_caches: per layer a tuple of ``[num_blocks, block_size, heads, *entry]``
                tensors, every one holding ``head_span.count`` heads on axis 2.
            head_span: the global heads held; ``None``: all of them
                (``HeadSpan(0, heads, heads)``).
            token_shard: the tokens of each logical block the cache holds (decode context
                parallelism; :data:`TokenShard`); default every token.
        """
        self.token_shard = check_token_shard(token_shard)
        if self._regions:
            raise ValueError("register() was already called: the cache is registered once at start")
        regions = flatten_regions(kv_caches)
        heads = int(regions[0].shape[2])
        span = HeadSpan(0, heads, heads) if head_span is None else HeadSpan.of(head_span)
        bad = [(i, int(t.shape[2])) for i, t in enumerate(regions) if t.shape[2] != span.count]
        if bad:
            raise ValueError(
                f"kv_caches regions (index, heads) {bad} do not hold head_span.count={span.count} heads on axis 2 "
                f"(head_span={span})"
            )
        self._regions, self._layouts, self.head_span = regions, region_layouts(regions), span
        self._register_backend()

    @property
    def layouts(self) -> tuple[RegionLayout, ...]:
        """The registered regions' layouts (empty before ``register``)."""
        return self._layouts

    @abc.abstractmethod
    def metadata(self) -> bytes:
        """A picklable descriptor of this rank (agent, registered regions, head span) for
        peers; send it through Ray, never through NIXL's listener."""

    def connect(self, peer_name: str, peer_metadata: bytes) -> None:
        """Make the source described by ``peer_metadata`` readable as ``peer_name``
        (replacing a peer of that name). ValueError when its layout is incompatible."""
        self._require_registered()
        info = _load_metadata(peer_name, peer_metadata)
        peer_span = HeadSpan.of(info["head_span"])
        check_compatible(
            peer_name, self._layouts, self.head_span, info["layouts"], peer_span, self.token_shard, info["token_shard"]
        )
        if peer_name in self._peers:
            self.forget(peer_name)
        self._connect_backend(peer_name, info)
        self._peers[peer_name] = (info["layouts"], peer_span)

    def read(
        self,
        peer_name: str,
        src_block_ids: Sequence[int],
        dst_block_ids: Sequence[int],
        timeout_s: float,
        heads: Sequence[int] | None = None,
    ) -> int:
        """Pull the heads ``heads`` of ``src_block_ids`` of every region of ``peer_name``
        into our blocks ``dst_block_ids`` (pairwise, at our offsets of those heads; a
        token-sharded cache pulls its :attr:`token_shard` of each source block), within
        ``timeout_s`` seconds; nothing else of our cache changes.

        Args:
            heads: global ``(lo, hi)`` heads to move, inside both sides' spans; ``None``:
                our whole span (which must lie inside the peer's).

        Returns:
            The bytes moved.

        Raises:
            KVTransferError: unknown peer, a source block id outside the peer's cache,
                a dead peer, a backend error, the timeout, or an injected failure.
            ValueError: mismatched lengths, a destination block id outside our cache,
                a non-positive timeout, or ``heads`` outside either side's span.
        """
        self._require_registered()
        src, dst = [int(b) for b in src_block_ids], [int(b) for b in dst_block_ids]
        if len(src) != len(dst):
            raise ValueError(f"src_block_ids and dst_block_ids must pair up (got {len(src)} and {len(dst)} ids)")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive (got {timeout_s})")
        peer = self._peers.get(peer_name)
        if peer is None:
            raise KVTransferError(
                f"unknown KV peer {peer_name!r}: call connect() with its metadata first (known: {sorted(self._peers)})"
            )
        peer_layouts, peer_span = peer
        span = self.head_span
        if heads is None and not peer_span.start <= span.start < span.stop <= peer_span.stop:
            raise ValueError(
                f"heads=None reads this rank's {span}, which peer {peer_name!r} does not hold (it holds {peer_span}); "
                "pass the heads to read from it"
            )
        lo, hi = check_heads(
            (span.start, span.stop) if heads is None else heads, ("this rank", span), (f"peer {peer_name!r}", peer_span)
        )
        bad_src = [b for b in src if not 0 <= b < peer_layouts[0].num_blocks]
        if bad_src:
            raise KVTransferError(
                f"source block ids {bad_src} are outside peer {peer_name!r}'s cache of {peer_layouts[0].num_blocks} blocks"
            )
        bad_dst = [b for b in dst if not 0 <= b < self._layouts[0].num_blocks]
        if bad_dst:
            raise ValueError(f"dst_block_ids {bad_dst} are outside the local cache of {self._layouts[0].num_blocks} blocks")
        if self.fail_next_reads > 0:
            self.fail_next_reads -= 1
            raise KVTransferError(f"injected KV transfer failure reading from {peer_name!r} (fail_next_reads test seam)")
        if not src:
            return 0
        self._read_backend(peer_name, src, dst, lo, hi, timeout_s)
        return len(src) * sum(r.block_size * (hi - lo) * r.head_bytes for r in self._layouts)

    def forget(self, peer_name: str) -> None:
        """Drop a connected peer (no-op when unknown)."""
        if self._peers.pop(peer_name, None) is not None:
            self._forget_backend(peer_name)

    def close(self) -> None:
        """Forget peers and release backend resources; the transport is unusable after."""
        for peer_name in list(self._peers):
            self.forget(peer_name)
        self._regions = []

    def _whole(self, peer_name: str, lo: int, hi: int) -> bool:
        """True when ``[lo, hi)`` is the whole block entry on both sides and every token moves
        (whole blocks move)."""
        peer_span = self._peers[peer_name][1]
        whole_heads = (lo, hi) == (self.head_span.start, self.head_span.stop) == (peer_span.start, peer_span.stop)
        return whole_heads and self.token_shard == WHOLE_TOKENS

    def _require_registered(self) -> None:
        if not self._regions:
            raise ValueError(f"{type(self).__name__}: call register(kv_caches) first")

    @abc.abstractmethod
    def _register_backend(self) -> None: ...

    @abc.abstractmethod
    def _connect_backend(self, peer_name: str, info: dict) -> None: ...

    @abc.abstractmethod
    def _forget_backend(self, peer_name: str) -> None: ...

    @abc.abstractmethod
    def _read_backend(self, peer_name: str, src: list[int], dst: list[int], lo: int, hi: int, timeout_s: float) -> None: ...


# ---------------------------------------------------------------------------------------
# NIXL

# Microseconds NIXL's progress thread sleeps between polls. NOTE: nixl's Python wrapper
# (1.5) pins this to 0, and an idle agent then spins a whole core. Measured on a 2-core box
# (12 MiB READs between two actors over UCX/TCP on loopback): delay 0: 2.9 GB/s and ~1 core
# per idle agent; 100 us: 6.3 GB/s and ~2 % of a core; 500 us: 4.8 GB/s.
PROGRESS_THREAD_DELAY_US = 100
_AGENT_LOCK = threading.Lock()


def _make_nixl_agent(agent_name: str, delay_us: int = PROGRESS_THREAD_DELAY_US):
    """A NIXL agent with its progress thread on, its listener off (it binds 0.0.0.0 on a
    fixed port; metadata goes through Ray instead), and the progress thread sleeping
    ``delay_us`` between polls."""
    from nixl import _api

    base = _api.nixlBind.nixlAgentConfig

    class _DelayedProgress(base):  # type: ignore[misc, valid-type]
        # NOTE: the wrapper writes ``pthrDelay = 0`` after building the config; keep ours.
        @property
        def pthrDelay(self):  # noqa: N802 - the binding's name
            return base.pthrDelay.__get__(self)

        @pthrDelay.setter
        def pthrDelay(self, _value):  # noqa: N802
            base.pthrDelay.__set__(self, delay_us)

    config = _api.nixl_agent_config(enable_prog_thread=True, enable_listen_thread=False, backends=[])
    with _AGENT_LOCK:  # NOTE: the class swap is process-wide for the constructor's duration
        _api.nixlBind.nixlAgentConfig = _DelayedProgress
        try:
            return _api.nixl_agent(agent_name, config)
        finally:
            _api.nixlBind.nixlAgentConfig = base


class NixlTransport(KVTransport):
    """KV transfer by NIXL READs over UCX (one agent per rank).

    Args:
        agent_name: unique across the cluster, e.g. ``f"{replica_id}-rank{rank}"``.
        backend_params: UCX backend init parameters (e.g. ``{"ucx_error_handling_mode":
            "none"}`` when ``UCX_TLS`` is shared memory only).
        poll_interval_s: sleep between status checks while a transfer is in flight.
    """

    def __init__(
        self, agent_name: str, backend_params: dict[str, str] | None = None, poll_interval_s: float = 0.0002
    ) -> None:
        super().__init__(agent_name)
        self.agent_name = agent_name
        self._agent = _make_nixl_agent(agent_name)
        self._agent.create_backend("UCX", dict(backend_params or {}))
        self._poll_interval_s = poll_interval_s
        self._reg_descs = None
        self._remote: dict[str, tuple[str, int, list[int]]] = {}  # peer -> (agent, device id, region bases)

    def _mem(self) -> tuple[str, int]:
        t = self._regions[0]
        return ("VRAM", t.device.index or 0) if t.is_cuda else ("DRAM", 0)

    def _register_backend(self) -> None:
        self._reg_descs = self._agent.register_memory(self._regions)

    def metadata(self) -> bytes:
        self._require_registered()
        mem_type, device_id = self._mem()
        return pickle.dumps(
            {
                "agent_name": self.agent_name,
                "agent_metadata": self._agent.get_agent_metadata(),
                "mem_type": mem_type,
                "device_id": device_id,
                "bases": [t.data_ptr() for t in self._regions],
                "layouts": self._layouts,
                "head_span": self.head_span,
                "token_shard": self.token_shard,
            }
        )

    def _connect_backend(self, peer_name: str, info: dict) -> None:
        if info["mem_type"] != self._mem()[0]:
            # NOTE: DRAM<->VRAM is possible in NIXL but the pairing is not wired here yet.
            raise ValueError(
                f"peer {peer_name!r} holds its cache in {info['mem_type']}, this rank in {self._mem()[0]}; both must match"
            )
        remote = self._agent.add_remote_agent(info["agent_metadata"])
        self._remote[peer_name] = (remote, info["device_id"], info["bases"])

    def _forget_backend(self, peer_name: str) -> None:
        remote = self._remote.pop(peer_name, None)
        # NOTE: two peer names may share one agent (re-connect); drop it only when unused.
        if remote is not None and all(r[0] != remote[0] for r in self._remote.values()):
            try:
                self._agent.remove_remote_agent(remote[0])
            except Exception:
                pass

    def _descriptors(self, peer_name: str, src: list[int], dst: list[int], lo: int, hi: int) -> tuple[np.ndarray, ...]:
        """``(local, remote)`` Nx3 ``(address, length, device)`` descriptor arrays."""
        _, remote_dev, remote_bases = self._remote[peer_name]
        peer_layouts, peer_span = self._peers[peer_name]
        device_id = self._mem()[1]
        local_rows, remote_rows = [], []

        def add(local_addr: np.ndarray, remote_addr: np.ndarray, length: np.ndarray) -> None:
            ones = np.ones(len(length), np.uint64)
            local_rows.append(np.stack([local_addr, length, ones * device_id], 1))
            remote_rows.append(np.stack([remote_addr, length, ones * remote_dev], 1))

        if self._whole(peer_name, lo, hi):
            runs = np.array(block_runs(src, dst), dtype=np.uint64).reshape(-1, 3)
            for region, base, layout in zip(self._regions, remote_bases, self._layouts):
                nb = layout.block_bytes
                add(region.data_ptr() + runs[:, 1] * nb, base + runs[:, 0] * nb, runs[:, 2] * nb)
        else:
            # A head slice of a block is strided: one chunk of (hi - lo) heads per token; so is a
            # token shard (local token j is source token j * n + r). NOTE: neighbouring chunks are
            # contiguous on both sides only in the branch above, so nothing here coalesces.
            s, d = np.array(src, dtype=np.uint64), np.array(dst, dtype=np.uint64)
            shard_rank, shard_size = (np.uint64(v) for v in self.token_shard)
            for region, base, local, peer in zip(self._regions, remote_bases, self._layouts, peer_layouts):
                tokens = np.arange(local.block_size, dtype=np.uint64)
                local_tokens = (d[:, None] * local.block_size + tokens).ravel()
                remote_tokens = (s[:, None] * peer.block_size + tokens * shard_size + shard_rank).ravel()
                add(
                    region.data_ptr() + (lo - self.head_span.start) * local.head_bytes + local_tokens * local.token_bytes,
                    base + (lo - peer_span.start) * peer.head_bytes + remote_tokens * peer.token_bytes,
                    np.full(len(local_tokens), (hi - lo) * local.head_bytes, np.uint64),
                )
        return np.concatenate(local_rows), np.concatenate(remote_rows)

    def _read_backend(self, peer_name: str, src: list[int], dst: list[int], lo: int, hi: int, timeout_s: float) -> None:
        remote = self._remote[peer_name][0]
        mem_type = self._mem()[0]
        local_descs, remote_descs = self._descriptors(peer_name, src, dst, lo, hi)
        deadline = time.monotonic() + timeout_s
        try:
            handle = self._agent.initialize_xfer(
                "READ",
                self._agent.get_xfer_descs(local_descs, mem_type),
                self._agent.get_xfer_descs(remote_descs, mem_type),
                remote,
            )
        except Exception as e:  # nixl raises its own binding errors (e.g. nixlBackendError)
            raise KVTransferError(f"NIXL could not prepare a READ from {peer_name!r}: {type(e).__name__}: {e}") from None
        what = f"NIXL READ of {len(src)} blocks (heads [{lo}, {hi})) from {peer_name!r}"
        try:
            state = self._agent.transfer(handle)
            while state == "PROC":
                if time.monotonic() > deadline:
                    raise KVTransferError(f"{what} did not finish within {timeout_s} s")
                time.sleep(self._poll_interval_s)
                state = self._agent.check_xfer_state(handle)
            if state != "DONE":
                raise KVTransferError(f"{what} failed (state {state}); is the peer alive?")
        except KVTransferError:
            raise
        except Exception as e:
            raise KVTransferError(f"{what} failed: {type(e).__name__}: {e}") from None
        finally:
            try:
                self._agent.release_xfer_handle(handle)
            except Exception:  # NOTE: releasing a handle still in flight may fail; NIXL cleans up at agent teardown
                pass

    def close(self) -> None:
        super().close()
        if self._reg_descs is not None:
            self._agent.deregister_memory(self._reg_descs)
            self._reg_descs = None


# ---------------------------------------------------------------------------------------
# Ray objects (fallback)


class RayObjectTransport(KVTransport):
    """KV transfer through a Ray actor call: the destination calls the source actor's
    dispatching method as ``export_method("export", block_ids, heads)``, which must return
    ``transport.export(block_ids, heads)`` (a worker rank's ``kv`` method does).

    Args:
        actor_handle: the actor hosting this transport (the source side publishes it in
            ``metadata``); ``None`` means the current actor
            (``ray.get_runtime_context().current_actor``).
        export_method: name of that actor's dispatching method (called with ``"export"``
            first) that delegates to :meth:`export`.
        name: this rank's name (for messages).
    """

    def __init__(self, actor_handle=None, export_method: str = "kv", name: str = "ray-kv") -> None:
        super().__init__(name)
        self._actor = actor_handle
        self._export_method = export_method
        self._sources: dict[str, object] = {}

    def _register_backend(self) -> None:
        pass

    def metadata(self) -> bytes:
        import ray

        self._require_registered()
        actor = self._actor or ray.get_runtime_context().current_actor
        # NOTE: cloudpickle: an actor handle pickles only through Ray's reducer.
        return ray.cloudpickle.dumps(
            {
                "actor": actor, "method": self._export_method, "layouts": self._layouts, "head_span": self.head_span,
                "token_shard": self.token_shard,
            }  # fmt: skip
        )

    def _connect_backend(self, peer_name: str, info: dict) -> None:
        self._sources[peer_name] = getattr(info["actor"], info["method"])

    def _forget_backend(self, peer_name: str) -> None:
        self._sources.pop(peer_name, None)

    def export(
        self, block_ids: Sequence[int], heads: Sequence[int] | None = None, tokens: Sequence[int] = WHOLE_TOKENS
    ) -> list[np.ndarray]:
        """Source side: per region, the blocks' heads ``heads`` (global ``(lo, hi)``
        inside this rank's span; ``None``: all) of the tokens of ``tokens`` (a reader's
        :data:`TokenShard`: offsets ``rank, rank + size, ...`` of each block) as one uint8
        array ``[len(block_ids), tokens * (hi - lo) * head_bytes]`` (numpy, so Ray moves it
        without pickling a copy and the reader maps it straight from the object store)."""
        self._require_registered()
        shard_rank, shard_size = check_token_shard(tokens)
        span = self.head_span
        lo, hi = (span.start, span.stop) if heads is None else check_heads(heads, ("this rank", span))
        ids = [int(b) for b in block_ids]
        bad = [b for b in ids if not 0 <= b < self._layouts[0].num_blocks]
        if bad:
            raise KVTransferError(f"block ids {bad} are outside this cache of {self._layouts[0].num_blocks} blocks")
        index = torch.tensor(ids, dtype=torch.long, device=self._regions[0].device)
        out = []
        for region in self._regions:
            blocks = storage_view(region).index_select(0, index)
            if (shard_rank, shard_size) != WHOLE_TOKENS:
                blocks = blocks[:, shard_rank::shard_size]
            if (lo, hi) != (span.start, span.stop):
                blocks = blocks[:, :, lo - span.start : hi - span.start]
            blocks = blocks.contiguous()
            out.append(blocks.cpu().view(torch.uint8).reshape(len(ids), -1).numpy())
        return out

    def _read_backend(self, peer_name: str, src: list[int], dst: list[int], lo: int, hi: int, timeout_s: float) -> None:
        import ray
        from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

        try:
            # NOTE: the token shard travels only when there is one (the export's original call).
            shard = () if self.token_shard == WHOLE_TOKENS else (self.token_shard,)
            ref = self._sources[peer_name].remote("export", src, (lo, hi), *shard)
        except Exception as e:  # e.g. an export method without the ("export", block_ids, heads) signature
            raise KVTransferError(f"could not call the KV export of {peer_name!r}: {type(e).__name__}: {e}") from None
        try:
            blocks = ray.get(ref, timeout=timeout_s)
        except GetTimeoutError:
            try:
                ray.cancel(ref)  # NOTE: best effort; a running sync actor task is not interrupted
            except Exception:
                pass
            raise KVTransferError(
                f"Ray export of {len(src)} blocks from {peer_name!r} did not finish within {timeout_s} s"
            ) from None
        except RayActorError as e:
            raise KVTransferError(f"KV source {peer_name!r} is dead or unreachable: {e}") from None
        except RayTaskError as e:
            raise KVTransferError(f"KV export from {peer_name!r} failed: {e.cause if e.cause is not None else e}") from None
        sizes = [len(dst) * r.block_size * (hi - lo) * r.head_bytes for r in self._layouts]
        if len(blocks) != len(sizes) or any(b.nbytes != n for b, n in zip(blocks, sizes)):
            raise KVTransferError(
                f"KV export from {peer_name!r} returned {[b.nbytes for b in blocks]} bytes per region, expected {sizes}"
            )
        index = torch.tensor(dst, dtype=torch.long, device=self._regions[0].device)
        offset = lo - self.head_span.start
        with warnings.catch_warnings():
            # NOTE: Ray hands back read-only arrays; they are only read from here.
            warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
            for region, data in zip(self._regions, blocks):
                shape = (len(dst), region.shape[1], hi - lo, *region.shape[3:])
                # NOTE: a view; index_copy_ writes through it (float8 caches as uint8: see storage_view).
                heads_view = storage_view(region)[:, :, offset : offset + hi - lo]
                data_view = torch.from_numpy(data).view(heads_view.dtype).reshape(shape).to(region.device)
                heads_view.index_copy_(0, index, data_view)

    def close(self) -> None:
        super().close()
        self._sources.clear()
