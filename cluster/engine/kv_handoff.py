"""The engine side of a prefill/decode KV handoff, in one process and without Ray.

A prefill engine computes a prompt's KV and its first token and keeps the KV blocks
(:func:`prefill`, answering a :class:`~flotilla.cluster.engine.kv_contract.PrefillTicket`); a
decode engine admits the request waiting for its KV, has the prefill blocks copied into its
own and, once the copy is done, takes the first token as its first output and decodes on
(:func:`decode_prefilled`); the prefill side then frees its blocks (:func:`release_prefill`).
:func:`handoff` does all three.

How blocks move is the caller's: a ``copy_blocks(src_block_ids, dst_block_ids)`` callable
fills decode blocks ``dst[i]`` (every layer, every cache tensor) from prefill blocks ``src[i]``
(:class:`BlockCopier` makes it the engine's
:class:`~flotilla.cluster.engine.kv_contract.KVReader`; it copies when the read starts). For
reads off the engine's thread pass a reader instead: the decode runner's ``kv`` handle (its
rank's port), as the serving engines do. :func:`tensor_block_copier` copies between two caches
of this process; :func:`transport_block_copier` wraps any object with a ``read(peer,
src_block_ids, dst_block_ids, timeout_s)`` method (``cluster.kv.transport``'s transports).

Failure policy (vLLM's ``kv_load_failure_policy``): ``"recompute"`` turns a request whose
copy failed into an ordinary request that computes its prompt on the decode engine (the
caller sees no error); ``"fail"`` finishes it with ``"error"``. Either way no block is leaked
on the decode side, and the prefill side's blocks are freed by :func:`release_prefill`
(``handoff`` always calls it).

Greedy decoding gives the colocated engine's tokens: the prompt's KV and the first
token are the ones the colocated engine would compute. Seeded random sampling does
not carry the generator's state across engines.
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Callable, Sequence

import torch

from flotilla.cluster.engine.kv_contract import (
    DEFAULT_KV_READ_TIMEOUT_S,
    KVHandoffError,
    KVReader,
    PrefillTicket,
    check_policy,
)
from flotilla.cluster.engine.sampling_params import SamplingParams
from flotilla.kernels.kv_dtype import storage_view

if TYPE_CHECKING:
    from flotilla.cluster.engine.llm_engine import LLMEngine

__all__ = [
    "BlockCopier",
    "CopyBlocks",
    "decode_prefilled",
    "handoff",
    "prefill",
    "release_prefill",
    "tensor_block_copier",
    "transport_block_copier",
]

CopyBlocks = Callable[[list[int], list[int]], None]


class BlockCopier:
    """A ``copy_blocks`` callable as a :class:`~flotilla.cluster.engine.kv_contract.KVReader`:
    the copy runs when the read starts (on the caller's thread: offline handoffs and tests);
    its outcome is a done future."""

    def __init__(self, copy_blocks: CopyBlocks):
        self.copy_blocks = copy_blocks

    def start_read(
        self,
        peer_id: str,
        src: Sequence[int],
        dst: Sequence[int],
        timeout_s: float,
        connect_with: Any = None,
        dp_rank: int | None = None,
    ) -> Future:
        done: Future = Future()
        try:
            self.copy_blocks(list(src), list(dst))
        except Exception as exc:  # noqa: BLE001 - the read's outcome
            done.set_exception(exc)
        else:
            done.set_result(0)
        return done

    def forget(self, peer_id: str) -> None:
        pass


def prefill(
    engine: "LLMEngine",
    prompt_token_ids: Sequence[int],
    params: SamplingParams | None = None,
    request_id: str | None = None,
) -> PrefillTicket:
    """Compute ``prompt_token_ids`` on ``engine`` and sample one token, keeping the KV.

    ``params`` are the request's sampling parameters (``max_tokens`` is replaced by 1).
    Steps the engine until this request finishes (other requests advance too; their deltas
    are not returned here, read them with ``get_output``). The blocks stay held until
    :func:`release_prefill`.
    """
    params = replace(params or SamplingParams(), max_tokens=1)
    request_id = engine.add_request(prompt_token_ids, params, request_id, hold_kv=True)
    while not engine.get_output(request_id).finished:
        engine.step()
        if getattr(engine.scheduler, "waiting_for_held_blocks", False) and not engine.scheduler.num_running:
            # NOTE: nothing runs and only held blocks are short: in this call nobody else frees them.
            engine.abort(request_id)
            engine.step()
            engine.pop_output(request_id)
            raise KVHandoffError(
                f"prefill of request {request_id!r}: the KV pool is full of blocks held for earlier prefills "
                f"({engine.scheduler.num_held_blocks} blocks); release them (release_prefill) before prefilling more"
            )
    output = engine.pop_output(request_id)
    completion = output.outputs[0]
    if completion.finish_reason not in ("length", "stop"):
        engine.release_kv(request_id)
        raise KVHandoffError(
            f"prefill of request {request_id!r} ended with {completion.finish_reason!r}: {output.error or 'no token'}"
        )
    blocks = engine.held_kv_blocks(request_id) or []
    return PrefillTicket(
        request_id, request_id, list(output.prompt_token_ids), completion.token_ids[0], blocks, completion.finish_reason,
        dp_rank=engine.held_kv_dp_rank(request_id),
    )  # fmt: skip


def release_prefill(engine: "LLMEngine", ticket: PrefillTicket) -> bool:
    """Free the prefill engine's blocks of ``ticket``; False when already released."""
    return engine.release_kv(ticket.prefill_request_id)


def decode_prefilled(
    engine: "LLMEngine",
    ticket: PrefillTicket,
    copy_blocks: CopyBlocks | KVReader,
    params: SamplingParams | None = None,
    request_id: str | None = None,
    policy: str = "recompute",
    stream: bool = False,
    timeout_s: float = DEFAULT_KV_READ_TIMEOUT_S,
) -> str:
    """Queue ``ticket``'s request on the decode ``engine`` (see
    ``LLMEngine.add_prefilled_request``), its blocks filled by ``copy_blocks`` (a callable,
    or a :class:`~flotilla.cluster.engine.kv_contract.KVReader` such as the decode runner's
    ``kv`` handle); returns the decode engine's request id. Step the engine for the tokens;
    release the prefill blocks once the request runs or failed (its read ended)."""
    reader = BlockCopier(copy_blocks) if callable(copy_blocks) else copy_blocks
    return engine.add_prefilled_request(
        ticket, params, request_id=request_id, stream=stream, policy=policy, timeout_s=timeout_s, reader=reader
    )


def handoff(
    prefill_engine: "LLMEngine",
    decode_engine: "LLMEngine",
    prompt_token_ids: Sequence[int],
    copy_blocks: CopyBlocks | KVReader,
    params: SamplingParams | None = None,
    request_id: str | None = None,
    policy: str = "recompute",
) -> tuple[PrefillTicket, str]:
    """Prefill on ``prefill_engine``, queue the decode on ``decode_engine`` and wait until its
    KV read ended (the decode engine steps meanwhile), then release the prefill blocks (also
    when the decode side raised). Returns the ticket and the decode engine's request id;
    step ``decode_engine`` for the rest of the tokens."""
    check_policy(policy)
    ticket = prefill(prefill_engine, prompt_token_ids, params, request_id)
    try:
        decode_id = decode_prefilled(decode_engine, ticket, copy_blocks, params, request_id, policy)
        while decode_id in decode_engine.remote_kv:
            # NOTE: the prefill blocks must stay held until the read ended.
            decode_engine.step()
        return ticket, decode_id
    finally:
        release_prefill(prefill_engine, ticket)


def tensor_block_copier(src_caches: Sequence[Sequence[torch.Tensor]], dst_caches: Sequence[Sequence[torch.Tensor]]) -> CopyBlocks:
    """``copy_blocks`` between two KV caches of this process (``ModelRunner.kv_caches``:
    per layer, tensors shaped ``[num_blocks, block_size, ...]``; same layers and shapes)."""
    src_regions = [t for layer in src_caches for t in layer]
    dst_regions = [t for layer in dst_caches for t in layer]
    if len(src_regions) != len(dst_regions) or any(s.shape[1:] != d.shape[1:] for s, d in zip(src_regions, dst_regions)):
        raise ValueError("src_caches and dst_caches must hold the same layers with the same block shapes")
    mismatched = next(((s.dtype, d.dtype) for s, d in zip(src_regions, dst_regions) if s.dtype != d.dtype), None)
    if mismatched is not None:
        raise ValueError(
            f"src_caches hold {mismatched[0]} and dst_caches {mismatched[1]}: KV blocks move between caches of one "
            "dtype (give both engines the same --kv-cache-dtype)"
        )
    # NOTE: copied as stored (uint8 views of float8 caches: torch has no float8 index_copy_ on CPU).
    src_regions = [storage_view(t) for t in src_regions]
    dst_regions = [storage_view(t) for t in dst_regions]

    def copy_blocks(src: list[int], dst: list[int]) -> None:
        if not src:
            return
        # NOTE: the caches are inference tensors; writing them needs inference mode.
        with torch.inference_mode():
            _copy(src, dst)

    def _copy(src: list[int], dst: list[int]) -> None:
        for s, d in zip(src_regions, dst_regions):
            index = torch.tensor(dst, dtype=torch.long, device=d.device)
            d.index_copy_(0, index, s[torch.tensor(src, dtype=torch.long, device=s.device)].to(d.device))

    return copy_blocks


def transport_block_copier(transport: Any, peer_name: str, timeout_s: float = 30.0) -> CopyBlocks:
    """``copy_blocks`` by ``transport.read(peer_name, src, dst, timeout_s)`` (a connected
    ``KVTransport`` on the decode side; any object with that method)."""

    def copy_blocks(src: list[int], dst: list[int]) -> None:
        transport.read(peer_name, src, dst, timeout_s)

    return copy_blocks
