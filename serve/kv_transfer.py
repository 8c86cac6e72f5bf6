"""Moving paged KV-cache blocks from a prefill rank to a decode rank.

One rank's cache is ``kv_caches``: a list of per-layer tuples of tensors, each shaped
``[num_blocks, block_size, *entry]`` (``KVCacheSpec.allocate``). A *region* is one such
tensor; a block of a region is the contiguous slice ``region[b]``. A transfer moves the
same blocks of every region (all layers, all tensors).

The flow, on the two ranks that hold the same layer shards (same TP layout):

1. each rank builds a transport and calls ``register(kv_caches)`` once at start;
2. the source's ``metadata()`` bytes travel to the destination THROUGH RAY (an actor
   call's argument or result) and the destination calls ``connect(peer, metadata)``;
3. per request the destination calls ``read(peer, src_block_ids, dst_block_ids,
   timeout_s)``, which pulls the blocks into its own cache or raises
   :class:`KVTransferError`; it then tells the source to free them (the source holds them
   under a :class:`BlockLeases` lease meanwhile, so a reader that never comes back cannot
   leak them).

Two transports:

- :class:`NixlTransport`: one NIXL agent per rank, UCX backend, DRAM on CPU (VRAM for
  CUDA tensors); the destination READs the source's registered memory. NIXL's own
  metadata listener is never started (it binds every interface and a fixed port); its
  agent metadata is exchanged through Ray instead, so many replicas on a node never
  collide on a port. Set ``UCX_NET_DEVICES=lo`` in the actors' environment to keep UCX on
  loopback.
- :class:`RayObjectTransport`: the fallback for machines without NIXL: the source's actor
  serves ``export(block_ids)`` through one of its methods and the destination copies the
  returned tensors in.

Test seam: every transport has ``fail_next_reads`` (an int, default 0); while it is
positive the next ``read`` decrements it and raises :class:`KVTransferError` without
moving anything, so fault tests can inject a transfer failure inside a real actor.
"""

from __future__ import annotations

import abc
import pickle
import time
import warnings
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
import torch

KVCaches = Sequence[Sequence[torch.Tensor]]


class KVTransferError(RuntimeError):
    """A KV transfer did not complete (peer unknown or dead, bad block id, timeout,
    backend error, injected failure). Plain and picklable, so it crosses actors intact."""


# ---------------------------------------------------------------------------------------
# Layout shared by both transports


@dataclass(frozen=True)
class RegionLayout:
    """One registered tensor: ``num_blocks`` blocks of ``block_shape`` and ``dtype``."""

    num_blocks: int
    block_shape: tuple[int, ...]
    dtype: str

    @property
    def block_bytes(self) -> int:
        element_size = torch.tensor([], dtype=getattr(torch, self.dtype)).element_size()
        return int(torch.Size(self.block_shape).numel()) * element_size

    def same_blocks(self, other: RegionLayout) -> bool:
        return (self.block_shape, self.dtype) == (other.block_shape, other.dtype)


def flatten_regions(kv_caches: KVCaches) -> list[torch.Tensor]:
    """The cache's tensors in (layer, tensor) order, checked to be contiguous."""
    regions = [t for layer in kv_caches for t in layer]
    if not regions:
        raise ValueError("kv_caches is empty: register the cache allocated by KVCacheSpec.allocate")
    for i, t in enumerate(regions):
        if not t.is_contiguous() or t.dim() < 2:
            raise ValueError(
                f"kv_caches region {i} must be a contiguous [num_blocks, block_size, ...] tensor (got shape {tuple(t.shape)})"
            )
    return regions


def region_layouts(regions: Sequence[torch.Tensor]) -> tuple[RegionLayout, ...]:
    return tuple(RegionLayout(int(t.shape[0]), tuple(t.shape[1:]), str(t.dtype).removeprefix("torch.")) for t in regions)


def check_compatible(peer_name: str, local: Sequence[RegionLayout], peer: Sequence[RegionLayout]) -> None:
    """Raise ValueError unless the peer's blocks have the same shapes and dtypes as ours
    (the block counts may differ)."""
    if len(local) != len(peer) or not all(a.same_blocks(b) for a, b in zip(local, peer)):
        raise ValueError(
            f"peer {peer_name!r} has an incompatible KV layout: local regions "
            f"{[(r.block_shape, r.dtype) for r in local]} vs peer {[(r.block_shape, r.dtype) for r in peer]}; "
            "both sides must hold the same layers with the same TP sharding"
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


# ---------------------------------------------------------------------------------------
# Interface


class KVTransport(abc.ABC):
    """Moves paged KV blocks from a source rank into a destination rank's cache.

    Lifecycle: ``register`` once, ``metadata``/``connect`` once per peer (metadata goes
    through Ray), ``read`` per request on the destination, ``close`` at shutdown.

    Attributes:
        fail_next_reads: test seam; while positive, ``read`` decrements it and raises
            :class:`KVTransferError` without moving anything.
    """

    def __init__(self) -> None:
        self.fail_next_reads = 0
        self._regions: list[torch.Tensor] = []
        self._layouts: tuple[RegionLayout, ...] = ()
        self._peers: dict[str, tuple[RegionLayout, ...]] = {}

    def register(self, kv_caches: KVCaches) -> None:
        """Register this rank's cache (once, at start); its tensors must stay alive and
        never be reallocated while the transport is open."""
        if self._regions:
            raise ValueError("register() was already called: the cache is registered once at start")
        self._regions = flatten_regions(kv_caches)
        self._layouts = region_layouts(self._regions)
        self._register_backend()

    @abc.abstractmethod
    def metadata(self) -> bytes:
        """A picklable descriptor of this rank (agent and registered regions) for peers;
        send it through Ray, never through NIXL's listener."""

    def connect(self, peer_name: str, peer_metadata: bytes) -> None:
        """Make the source described by ``peer_metadata`` readable as ``peer_name``."""
        self._require_registered()
        info = pickle.loads(peer_metadata)
        check_compatible(peer_name, self._layouts, info["layouts"])
        self._connect_backend(peer_name, info)
        self._peers[peer_name] = info["layouts"]

    def read(
        self, peer_name: str, src_block_ids: Sequence[int], dst_block_ids: Sequence[int], timeout_s: float
    ) -> None:
        """Pull ``src_block_ids`` of every region of ``peer_name`` into our blocks
        ``dst_block_ids`` (pairwise), within ``timeout_s`` seconds.

        Raises:
            KVTransferError: unknown peer, a source block id outside the peer's cache,
                a dead peer, a backend error, the timeout, or an injected failure.
            ValueError: mismatched lengths or a destination block id outside our cache.
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
        bad_src = [b for b in src if not 0 <= b < peer[0].num_blocks]
        if bad_src:
            raise KVTransferError(
                f"source block ids {bad_src} are outside peer {peer_name!r}'s cache of {peer[0].num_blocks} blocks"
            )
        bad_dst = [b for b in dst if not 0 <= b < self._layouts[0].num_blocks]
        if bad_dst:
            raise ValueError(f"dst_block_ids {bad_dst} are outside the local cache of {self._layouts[0].num_blocks} blocks")
        if self.fail_next_reads > 0:
            self.fail_next_reads -= 1
            raise KVTransferError(f"injected KV transfer failure reading from {peer_name!r} (fail_next_reads test seam)")
        if src:
            self._read_backend(peer_name, src, dst, timeout_s)

    def close(self) -> None:
        """Forget peers and release backend resources; the transport is unusable after."""
        self._peers.clear()
        self._regions = []

    def _require_registered(self) -> None:
        if not self._regions:
            raise ValueError(f"{type(self).__name__}: call register(kv_caches) first")

    @abc.abstractmethod
    def _register_backend(self) -> None: ...

    @abc.abstractmethod
    def _connect_backend(self, peer_name: str, info: dict) -> None: ...

    @abc.abstractmethod
    def _read_backend(self, peer_name: str, src: list[int], dst: list[int], timeout_s: float) -> None: ...


# ---------------------------------------------------------------------------------------
# NIXL


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
        super().__init__()
        from nixl._api import nixl_agent, nixl_agent_config

        # NOTE: no listener thread: it binds 0.0.0.0 on a fixed port; metadata goes via Ray.
        config = nixl_agent_config(enable_prog_thread=True, enable_listen_thread=False, backends=[])
        self.agent_name = agent_name
        self._agent = nixl_agent(agent_name, config)
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

    def _read_backend(self, peer_name: str, src: list[int], dst: list[int], timeout_s: float) -> None:
        remote, remote_dev, remote_bases = self._remote[peer_name]
        mem_type, device_id = self._mem()
        local_descs, remote_descs = [], []
        for region, base, layout in zip(self._regions, remote_bases, self._layouts):
            nb = layout.block_bytes
            for s, d, n in block_runs(src, dst):
                local_descs.append((region.data_ptr() + d * nb, n * nb, device_id))
                remote_descs.append((base + s * nb, n * nb, remote_dev))
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
        try:
            state = self._agent.transfer(handle)
            while state == "PROC":
                if time.monotonic() > deadline:
                    raise KVTransferError(f"NIXL READ of {len(src)} blocks from {peer_name!r} did not finish within {timeout_s} s")
                time.sleep(self._poll_interval_s)
                state = self._agent.check_xfer_state(handle)
            if state != "DONE":
                raise KVTransferError(
                    f"NIXL READ of {len(src)} blocks from {peer_name!r} failed (state {state}); is the peer alive?"
                )
        except KVTransferError:
            raise
        except Exception as e:
            raise KVTransferError(f"NIXL READ from {peer_name!r} failed: {type(e).__name__}: {e}") from None
        finally:
            try:
                self._agent.release_xfer_handle(handle)
            except Exception:  # NOTE: releasing a handle still in flight may fail; NIXL cleans up at agent teardown
                pass

    def close(self) -> None:
        for remote, _, _ in self._remote.values():
            try:
                self._agent.remove_remote_agent(remote)
            except Exception:
                pass
        self._remote.clear()
        if self._reg_descs is not None:
            self._agent.deregister_memory(self._reg_descs)
            self._reg_descs = None
        super().close()


# ---------------------------------------------------------------------------------------
# Ray objects (fallback)


class RayObjectTransport(KVTransport):
    """KV transfer through a Ray actor call: the destination calls the source actor's
    ``export_method(block_ids)``, which must return ``transport.export(block_ids)``.

    Args:
        actor_handle: the actor hosting this transport (the source side publishes it in
            ``metadata``); ``None`` means the current actor
            (``ray.get_runtime_context().current_actor``).
        export_method: name of that actor's method that delegates to :meth:`export`.
    """

    def __init__(self, actor_handle=None, export_method: str = "export_kv_blocks") -> None:
        super().__init__()
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
        return ray.cloudpickle.dumps({"actor": actor, "method": self._export_method, "layouts": self._layouts})

    def _connect_backend(self, peer_name: str, info: dict) -> None:
        self._sources[peer_name] = getattr(info["actor"], info["method"])

    def export(self, block_ids: Sequence[int]) -> list[np.ndarray]:
        """Source side: per region, the blocks' bytes as one uint8 array
        ``[len(block_ids), block_bytes]`` (numpy, so Ray moves it without pickling a
        copy and the reader maps it straight from the object store)."""
        self._require_registered()
        ids = [int(b) for b in block_ids]
        bad = [b for b in ids if not 0 <= b < self._layouts[0].num_blocks]
        if bad:
            raise KVTransferError(f"block ids {bad} are outside this cache of {self._layouts[0].num_blocks} blocks")
        index = torch.tensor(ids, dtype=torch.long, device=self._regions[0].device)
        return [r.index_select(0, index).cpu().view(torch.uint8).reshape(len(ids), -1).numpy() for r in self._regions]

    def _read_backend(self, peer_name: str, src: list[int], dst: list[int], timeout_s: float) -> None:
        import ray
        from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

        ref = self._sources[peer_name].remote(src)
        try:
            blocks = ray.get(ref, timeout=timeout_s)
        except GetTimeoutError:
            try:
                ray.cancel(ref)  # NOTE: best effort; a running sync actor task is not interrupted
            except Exception:
                pass
            raise KVTransferError(f"Ray export of {len(src)} blocks from {peer_name!r} did not finish within {timeout_s} s") from None
        except RayActorError as e:
            raise KVTransferError(f"KV source {peer_name!r} is dead or unreachable: {e}") from None
        except RayTaskError as e:
            raise KVTransferError(f"KV export from {peer_name!r} failed: {e.cause if e.cause is not None else e}") from None
        index = torch.tensor(dst, dtype=torch.long, device=self._regions[0].device)
        with warnings.catch_warnings():
            # NOTE: Ray hands back read-only arrays; they are only read from here.
            warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
            for region, data in zip(self._regions, blocks):
                src = torch.from_numpy(data).view(region.dtype).reshape(len(dst), *region.shape[1:])
                region.index_copy_(0, index, src.to(region.device))

    def close(self) -> None:
        self._sources.clear()
        super().close()


# ---------------------------------------------------------------------------------------
# Source-side leases


class BlockLeases:
    """Blocks a source handed to a reader, held until released or expired.

    Pure Python. ``clock`` gives seconds (``time.monotonic`` by default; tests pass a
    fake). The owner frees the block ids that ``release`` and ``expire`` return.
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._leases: dict[str, tuple[float, list[int]]] = {}

    def grant(self, request_id: str, block_ids: Sequence[int], ttl_s: float) -> None:
        """Hold ``block_ids`` for ``request_id`` until ``ttl_s`` seconds from now."""
        if ttl_s <= 0:
            raise ValueError(f"ttl_s must be positive (got {ttl_s})")
        if request_id in self._leases:
            raise ValueError(f"request {request_id!r} already holds a lease; release it before granting another")
        self._leases[request_id] = (self._clock() + ttl_s, [int(b) for b in block_ids])

    def release(self, request_id: str) -> list[int] | None:
        """End the lease; returns its block ids, or None when there is none (never
        granted, already released, or expired)."""
        lease = self._leases.pop(request_id, None)
        return None if lease is None else lease[1]

    def expire(self, now: float | None = None) -> list[list[int]]:
        """End every lease whose deadline is at or before ``now`` (default: the clock);
        returns their block id lists."""
        now = self._clock() if now is None else now
        expired = [rid for rid, (deadline, _) in self._leases.items() if deadline <= now]
        return [self._leases.pop(rid)[1] for rid in expired]

    def held(self) -> dict[str, list[int]]:
        """Request id -> block ids currently leased."""
        return {rid: list(ids) for rid, (_, ids) in self._leases.items()}

    def __len__(self) -> int:
        return len(self._leases)
