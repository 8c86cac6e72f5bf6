"""One rank's KV endpoint for prefill/decode disaggregation, held by the rank that owns the cache.

A runner (the in-process :class:`~flotilla.cluster.engine.model_runner.ModelRunner`, or each
:class:`~flotilla.cluster.worker.Worker` rank of a group) holds one :class:`KVPort`. The port
builds the rank's endpoint from a factory passed in (``factory(rank, kv_caches, head_span)``;
``cluster.kv.endpoint.KVEndpointFactory`` in production) and forwards the runner KV protocol to
it: metadata, connect, read, export (the Ray fallback's source side), forget, the
``fail_next_reads`` test seam, close.

NOTE: ``cluster/`` never imports ``serve/``: the endpoint is duck-typed here. Its failures
(``KVTransferError`` and anything else but ``ValueError``) come out of :meth:`KVPort.read` and
:meth:`KVPort.connect` as :class:`KVRankError`, which names the rank and crosses Ray intact.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

KVEndpointFactory = Callable[[int, Any, tuple[int, int, int]], Any]


class KVRankError(RuntimeError):
    """One rank's KV endpoint failed (a transfer error, an unknown peer, an injected failure).

    Picklable (plain message plus ``rank``), so it crosses actors intact; a worker group
    re-raises it without breaking (the rank is alive and its cache intact).

    Attributes:
        rank: the failed rank.
        reason: what happened.
    """

    def __init__(self, rank: int, reason: str):
        super().__init__(f"KV transfer on rank {rank} failed: {reason}")
        self.rank, self.reason = rank, reason

    def __reduce__(self):
        return (KVRankError, (self.rank, self.reason))


def check_kv_attachable(dcp_size: int, attn_dp_size: int, attn_cp_size: int = 1) -> None:
    """Refuse a KV endpoint for layouts the head-sliced transfer does not cover.

    Raises NotImplementedError for decode context parallelism (``dcp_size > 1``: each rank
    holds a token shard of every block), for DP attention (``attn_dp_size > 1``: each DP
    rank has its own scheduler and block ids) and for attention context parallelism
    (``attn_cp_size > 1``: ranks do not map to attention-TP ranks one to one).
    """
    if dcp_size > 1:
        raise NotImplementedError(
            f"prefill/decode disaggregation does not support decode context parallelism (got dcp_size={dcp_size}): "
            "each rank holds a token shard of every KV block; use dcp_size=1 on PD engines"
        )
    if attn_dp_size > 1:
        raise NotImplementedError(
            f"prefill/decode disaggregation does not support DP attention (got attention dp_size={attn_dp_size}): "
            "each DP rank has its own scheduler and KV pool; turn enable_dp_attention off on PD engines"
        )
    if attn_cp_size > 1:
        raise NotImplementedError(
            f"prefill/decode disaggregation does not support attention context parallelism "
            f"(got attn_cp_size={attn_cp_size}); use attn_cp_size=1 on PD engines"
        )


class KVPort:
    """One rank's KV endpoint (see the module docstring).

    Args:
        rank: the rank that owns the cache (named in every error; the factory names the
            endpoint's agent after it).
    """

    def __init__(self, rank: int):
        self.rank = rank
        self._endpoint: Any = None

    @property
    def attached(self) -> bool:
        return self._endpoint is not None

    def attach(self, factory: KVEndpointFactory, kv_caches: Any, head_span: tuple[int, int, int]) -> None:
        """Build the endpoint over ``kv_caches`` (registers the cache; once until :meth:`detach`)."""
        if self._endpoint is not None:
            raise RuntimeError(
                f"rank {self.rank}: a KV endpoint is already attached ({self._endpoint.name!r}); "
                "kv_detach() before attaching another"
            )
        self._endpoint = factory(self.rank, kv_caches, tuple(int(x) for x in head_span))

    def _require(self) -> Any:
        if self._endpoint is None:
            raise RuntimeError(f"rank {self.rank}: no KV endpoint attached; call kv_attach(factory) first")
        return self._endpoint

    def metadata(self) -> bytes:
        """This rank's endpoint descriptor for peers (travels through Ray)."""
        return self._require().metadata()

    def connect(self, peer_id: str, peer_metadata: Sequence[bytes]) -> None:
        """Connect the peer engine ``peer_id`` (one metadata entry per peer rank, rank order)."""
        endpoint = self._require()
        self._call(endpoint.connect, peer_id, list(peer_metadata))

    def read(self, peer_id: str, src: Sequence[int], dst: Sequence[int], timeout_s: float) -> int:
        """Pull this rank's KV heads of blocks ``src`` of ``peer_id`` into local blocks ``dst``;
        returns the bytes moved. KVRankError on a transfer failure, ValueError on misuse."""
        endpoint = self._require()
        return int(self._call(endpoint.read, peer_id, [int(b) for b in src], [int(b) for b in dst], float(timeout_s)))

    def export(self, block_ids: Sequence[int], heads: tuple[int, int] | None = None) -> Any:
        """Source side of the Ray fallback: the blocks' bytes (the reader wraps its errors)."""
        return self._require().export([int(b) for b in block_ids], heads)

    def forget(self, peer_id: str) -> None:
        self._require().forget(peer_id)

    def set_fail_next_reads(self, n: int) -> None:
        """Test seam: the next ``n`` reads of this rank fail without moving anything."""
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"n must be a non-negative int (got n={n!r})")
        self._require().fail_next_reads = n

    def detach(self) -> None:
        """Close the endpoint (idempotent); a later :meth:`attach` may build a new one."""
        endpoint, self._endpoint = self._endpoint, None
        if endpoint is not None:
            endpoint.close()

    def _call(self, method: Callable[..., Any], *args: Any) -> Any:
        try:
            return method(*args)
        except ValueError as exc:
            raise ValueError(f"rank {self.rank}: {exc}") from exc
        except Exception as exc:  # noqa: BLE001 - every endpoint failure is this rank's KV error
            raise KVRankError(self.rank, f"{type(exc).__name__}: {exc}") from exc
