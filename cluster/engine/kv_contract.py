"""What a prefill/decode KV handoff passes between its two sides, and what the decode engine
asks of whatever reads the KV: shared by the engine (:mod:`~flotilla.cluster.engine.llm_engine`),
the offline handoff (:mod:`~flotilla.cluster.engine.kv_handoff`) and the serving side
(``serve/``), none of which imports another for these names.

- :class:`PrefillTicket`: ONE prefilled prompt, on the wire and off it (picklable);
- :data:`KV_LOAD_FAILURE_POLICIES`, :func:`check_policy`, :class:`KVHandoffError`: what a
  failed KV load does;
- :class:`KVRead`, :class:`KVReader`, :class:`KVReadListener`: the protocols of a read in
  flight, of what starts reads (a runner's ``kv`` handle, or an offline copier) and of who
  hears how reads went (the serving side's metrics).

Pure Python: no torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, Sequence

# What a decode engine does when the prompt's KV cannot be loaded (vLLM's kv_load_failure_policy).
KV_LOAD_FAILURE_POLICIES = ("recompute", "fail")
# The bound on one read of a prompt's KV when the caller gives none.
DEFAULT_KV_READ_TIMEOUT_S = 30.0


class KVHandoffError(RuntimeError):
    """A prompt's KV could not be loaded on the decode engine under ``policy="fail"``, or a
    prefill could not hold its KV for a handoff."""


def check_policy(policy: str) -> None:
    """ValueError naming the value unless ``policy`` is one of :data:`KV_LOAD_FAILURE_POLICIES`."""
    if policy not in KV_LOAD_FAILURE_POLICIES:
        raise ValueError(f"policy must be one of {KV_LOAD_FAILURE_POLICIES} (got policy={policy!r})")


@dataclass(frozen=True)
class PrefillTicket:
    """A prompt computed by a prefill engine whose KV blocks it holds for a decode engine to
    read: the prefill's answer and the decode's input, in one process (the offline
    handoff) and across replicas (prefill/decode disaggregation, through Ray).

    Attributes:
        request_id: the request's id (the ingress's; offline, the prefill engine's).
        prefill_request_id: the prefill engine's id for the held blocks (release them under it).
        prompt_token_ids: the prompt.
        first_token: the token the prefill sampled after the prompt.
        block_ids: the prefill engine's blocks holding the prompt's KV, in position order.
        finish_reason: the prefill completion's reason: ``"length"`` (max_tokens 1 reached on
            the prefill side; decoding goes on) or ``"stop"`` (the first token ends the
            completion: nothing to decode).
        replica_id: the prefill replica's Serve id (the ``ReplicaPin`` of the release; empty
            offline).
        peer_id: the prefill engine's KV peer name, unique per engine incarnation (the decode
            side connects once per peer id); empty when nothing is to be connected (an
            offline copier).
        peer_metadata: per prefill rank (rank order), the transport metadata of its KV
            endpoint (``cluster.kv.endpoint.KVEndpoint.metadata``). Under DP attention on the
            prefill side: the ranks of the DP rank holding the blocks only, and ``peer_id``
            names that DP rank (to the decode side each prefill DP rank is its own peer).
        dp_rank: the prefill DP-attention rank whose pool holds ``block_ids`` (0 without DP
            attention).
        lease_s: how long the prefill side holds the blocks without a release (0: no lease,
            offline: until ``release_prefill``).
        chunk: the prefill's own final chunk (the serving side's ``GenerateChunk``: the first
            token, its text, usage; opaque here), the answer when the request ends at its first
            token; None offline.
    """

    request_id: str
    prefill_request_id: str
    prompt_token_ids: list[int]
    first_token: int
    block_ids: list[int]
    finish_reason: str | None
    replica_id: str = ""
    peer_id: str = ""
    peer_metadata: list[bytes] = field(default_factory=list)
    lease_s: float = 0.0
    chunk: Any = None
    dp_rank: int = 0

    @property
    def num_tokens(self) -> int:
        """Tokens whose KV the blocks hold (the prompt's length)."""
        return len(self.prompt_token_ids)


class KVRead(Protocol):
    """One KV read in flight (a ``concurrent.futures.Future`` in process; a worker group's
    handle, polled on its ranks). Never blocks in :meth:`done`."""

    def done(self) -> bool:
        """Whether the read ended (moved its blocks or failed); never waits."""
        ...

    def result(self) -> int:
        """The bytes moved; raises the read's error. Waits for the read when not :meth:`done`."""
        ...

    def cancel(self) -> bool:
        """Give up on the read (best effort: a read that started runs to its own bound)."""
        ...


class KVReader(Protocol):
    """What starts KV reads into this engine's cache: a runner's ``kv`` handle (the rank's
    port, or a worker group's fan-out over its ranks), or an offline block copier."""

    def start_read(
        self,
        peer_id: str,
        src: Sequence[int],
        dst: Sequence[int],
        timeout_s: float,
        connect_with: Sequence[bytes] | None = None,
        dp_rank: int | None = None,
    ) -> KVRead:
        """Start reading peer blocks ``src`` into local blocks ``dst`` (pairwise) within
        ``timeout_s``; with ``connect_with`` (the peer's per-rank metadata), connect the peer
        first when it is not connected; ``dp_rank``: only the ranks of that DP-attention rank
        read (the blocks are its pool's; None: every rank). Returns at once; the read runs
        elsewhere."""
        ...

    def forget(self, peer_id: str) -> None:
        """Drop a peer's connection (no-op when unknown); never waits for a read."""
        ...


class KVReadListener(Protocol):
    """Hears how each KV read of a decode engine went (on the engine's thread, when the engine
    observes it): the serving side counts and logs them."""

    def kv_read_done(self, peer_id: str, num_blocks: int, num_bytes: int, seconds: float) -> None: ...

    def kv_read_failed(self, peer_id: str, num_blocks: int, error: BaseException) -> None: ...
