"""Prefill/decode disaggregation on the ingress side: :class:`PDEngineClient`.

In PD mode (``flotilla serve --disaggregation-mode pd``) the application has two engine
pools, ``prefill`` and ``decode`` (both :class:`~flotilla.serve.engine_replica.EngineReplica`
in a role), and the ingress talks to them through this client. Per request:

1. ``prefill(request)`` on a prefill replica (its router prefers the replica that holds
   the prompt's prefix): the prompt's KV and first token are computed and the KV blocks
   stay held under a lease; the answer is a :class:`~flotilla.serve.types.PrefillTicket`.
2. When the first token already ends the request (``max_tokens`` 1, a stop token), the
   ticket's own chunk is the answer. Otherwise ``generate_prefilled(request, ticket)``
   streams from a decode replica: it allocates blocks, READs the prefill blocks (NIXL, or
   the Ray fallback), emits the first token and decodes on.
3. As soon as the decode stream yields its first chunk (the blocks were read, or the
   decode side gave up on them) or fails, ``release_kv`` goes to the prefill replica
   that holds them, pinned to it by a :class:`~flotilla.serve.types.ReplicaPin`. A
   release that never arrives (the ingress died) is covered by the lease.

Failures (``kv_load_failure_policy``): a failed KV read is the decode replica's to handle
(``recompute``: it computes the prompt itself; ``fail``: the stream fails before any
chunk). A prefill that fails for a reason other than bad input or overload (its replica
died, its engine is dead) is, under ``recompute``, sent whole to a decode replica, which
computes the prompt itself; under ``fail`` the client gets a 503 naming the cause.
Requests the handoff does not carry (``n`` > 1, ``logprobs``) run whole on a decode
replica.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, AsyncIterator, Mapping

from flotilla.serve.handles import call, engine_error, stream_chunks
from flotilla.serve.types import (
    EngineOverloadedError,
    EngineUnavailableError,
    GenerateChunk,
    GenerateRequest,
    PrefillTicket,
    ReplicaPin,
    ServeOptions,
)

logger = logging.getLogger(__name__)

PREFILL_DEPLOYMENT = "prefill"
DECODE_DEPLOYMENT = "decode"
# Bound on one release call; the lease frees the blocks when a release is lost.
RELEASE_TIMEOUT_S = 10.0
# Bound on the health calls of each pool.
HEALTH_TIMEOUT_S = 5.0


# -- configuration ---------------------------------------------------------------------------


def pd_server_fields(
    given: Mapping[str, Any], prefill_tp: int | None = None, decode_tp: int | None = None
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The server fields each pool resolves from: the user's (``given``, from the
    flags) with ``disaggregation_mode`` set to the pool's role and ``tp_size`` to
    ``--prefill-tp`` / ``--decode-tp`` when given (else the shared ``--tp-size``).

    Choices made here (each overridable by giving the flag): the transfer backend reads
    ``nixl`` (what moves the KV; flotilla has no mooncake), and the decode pool keeps its
    prefix cache (``--disaggregation-decode-enable-radix-cache``; SGLang's decode servers
    default to no radix cache), so prompts sharing a prefix skip those blocks' transfer.

    Raises ValueError naming the flag for a transfer backend flotilla does not have.
    """
    base = {k: v for k, v in given.items() if k != "disaggregation_mode"}
    backend = base.get("disaggregation_transfer_backend")
    if backend not in (None, "nixl"):
        raise ValueError(
            f"--disaggregation-transfer-backend {backend}: flotilla moves KV blocks with NIXL "
            "(or its Ray fallback, --kv-transport ray); pass nixl or leave it out"
        )
    base["disaggregation_transfer_backend"] = "nixl"
    prefill = {**base, "disaggregation_mode": "prefill"}
    decode = {**base, "disaggregation_mode": "decode"}
    decode.setdefault("disaggregation_decode_enable_radix_cache", True)
    for fields, tp, flag in ((prefill, prefill_tp, "--prefill-tp"), (decode, decode_tp, "--decode-tp")):
        if tp is not None:
            if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
                raise ValueError(f"{flag} must be an integer >= 1 (got {tp!r})")
            fields["tp_size"] = tp
    return prefill, decode


def ranks_in_replica(config: Any, options: ServeOptions, pool: str) -> bool:
    """Whether a replica of ``pool`` runs its one rank in its own process (else in worker
    actors): always at ``tp_size`` 1, except that a PD replica with the Ray-object KV
    fallback needs its rank in an actor the other side can call."""
    if int(config.tp_size or 1) > 1:
        return False
    return pool == "colocated" or options.kv_transport != "ray"


def check_pd_options(prefill_config: Any, decode_config: Any, options: ServeOptions) -> None:
    """Refuse a PD setup that cannot work, with a message naming the flag and value."""
    from flotilla.cluster.engine.kv_handoff import check_policy
    from flotilla.cluster.engine.model_runner import block_size_for
    from flotilla.serve.kv_endpoint import KV_TRANSPORTS

    if options.disaggregation_mode != "pd":
        raise ValueError(f"disaggregation_mode={options.disaggregation_mode!r}: build_pd_app needs 'pd'")
    for flag, count in (("--prefill-replicas", options.prefill_replicas), ("--decode-replicas", options.decode_replicas)):
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise ValueError(f"{flag} must be an integer >= 1 (got {count!r})")
    if options.kv_transport not in KV_TRANSPORTS:
        raise ValueError(f"--kv-transport must be one of {', '.join(KV_TRANSPORTS)} (got {options.kv_transport!r})")
    check_policy(options.kv_load_failure_policy)
    for flag, value in (("kv_lease_s", options.kv_lease_s), ("kv_transfer_timeout_s", options.kv_transfer_timeout_s)):
        if not value > 0:
            raise ValueError(f"{flag} must be positive (got {value!r})")
    for role, config in (("prefill", prefill_config), ("decode", decode_config)):
        if config.disaggregation_mode != role:
            raise ValueError(f"the {role} pool's config has disaggregation_mode={config.disaggregation_mode!r}")
        if int(config.dcp_size or 1) > 1 or config.enable_dp_attention:
            raise ValueError(
                f"the {role} pool: PD moves a prompt's whole KV between engines; decode context parallelism "
                f"(dcp_size={config.dcp_size}) and DP attention (enable_dp_attention={config.enable_dp_attention}) "
                "are not supported with --disaggregation-mode pd"
            )
    pairs = (
        ("model_path", prefill_config.model_path, decode_config.model_path),
        ("kv_cache_dtype", prefill_config.kv_cache_dtype, decode_config.kv_cache_dtype),
        ("dtype", prefill_config.dtype, decode_config.dtype),
        ("page_size (KV block size)", block_size_for(prefill_config), block_size_for(decode_config)),
    )
    for what, a, b in pairs:
        if a != b:
            raise ValueError(f"prefill and decode pools must agree on {what}: prefill {a!r}, decode {b!r}")


# -- the ingress's client -----------------------------------------------------------------------


def takes_handoff(params: Any) -> bool:
    """Whether a KV handoff can carry a request with these sampling parameters: one
    completion and no logprobs (``LLMEngine.add_prefilled_request``'s limits); other
    requests run whole on a decode replica."""
    return params.n == 1 and params.logprobs is None


def ends_at_first_token(request: GenerateRequest, ticket: PrefillTicket) -> bool:
    """Whether the ticket's chunk is the request's whole answer: the first token ended
    the completion (a stop) or it was the only token asked for."""
    return ticket.finish_reason == "stop" or request.params.max_tokens == 1


class PDEngineClient:
    """:class:`~flotilla.serve.types.EngineClient` over a prefill pool and a decode pool.

    Args:
        prefill: the ``DeploymentHandle`` of the prefill deployment.
        decode: the ``DeploymentHandle`` of the decode deployment.
        policy: ``kv_load_failure_policy``, ``"recompute"`` or ``"fail"`` (what happens when
            the prefill side fails; the decode replicas apply it to failed KV reads).
        metrics_timeout_s: bound on gathering the replicas' metrics.
    """

    def __init__(self, prefill: Any, decode: Any, policy: str = "recompute", metrics_timeout_s: float = 5.0):
        from flotilla.cluster.engine.kv_handoff import check_policy

        check_policy(policy)
        self.policy = policy
        self._prefill = prefill
        self._decode = decode
        self._release = prefill.options(method_name="release_kv")
        self._prefill_call = prefill.options(method_name="prefill")
        self._decode_whole = decode.options(stream=True, method_name="generate")
        self._decode_prefilled = decode.options(stream=True, method_name="generate_prefilled")
        self._metrics_timeout_s = metrics_timeout_s
        self._background: set[asyncio.Task] = set()

    async def generate(self, request: GenerateRequest) -> AsyncIterator[GenerateChunk]:
        """Stream the request's chunks: prefill on the prefill pool, decode on the decode
        pool (see the module docstring). Closing the iterator early cancels the decode
        call (the decode replica aborts and frees its blocks) and releases the prefill's."""
        if not takes_handoff(request.params):
            async for chunk in stream_chunks(call(self._decode_whole, request)):
                yield chunk
            return
        ticket = await self._prefill_or_none(request)
        if ticket is None:
            # NOTE: recompute: the prefill side failed; a decode replica computes the prompt.
            async for chunk in stream_chunks(call(self._decode_whole, request)):
                yield chunk
            return
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                self._in_background(self._release_now(ticket))

        if ends_at_first_token(request, ticket):
            release()
            yield ticket.chunk
            return
        stream = stream_chunks(call(self._decode_prefilled, request, ticket), on_first=release, wrap_unknown=True)
        try:
            async for chunk in stream:
                yield chunk
        finally:
            release()

    async def _prefill_or_none(self, request: GenerateRequest) -> PrefillTicket | None:
        """The prefill's ticket; None when the prefill side failed and the policy is
        ``recompute``. Bad input and overload raise as they are under either policy."""
        try:
            return await call(self._prefill_call, request)
        except Exception as exc:  # noqa: BLE001 - sorted out below
            error = engine_error(exc)
            if isinstance(error, (ValueError, EngineOverloadedError)):
                raise error from None
            if self.policy == "fail":
                raise EngineUnavailableError(
                    f"the prefill of request {request.request_id!r} failed ({type(error).__name__}: {error}); "
                    "kv_load_failure_policy='fail'"
                ) from None
            logger.warning(
                "prefill of request %s failed (%s: %s); the decode pool computes the prompt (kv_load_failure_policy=recompute)",
                request.request_id,
                type(error).__name__,
                error,
            )
            return None

    def _in_background(self, coroutine) -> None:
        """Run ``coroutine`` on this event loop without waiting for it (kept referenced
        until done, so it is not collected half-way)."""
        task = asyncio.get_running_loop().create_task(coroutine)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _release_now(self, ticket: PrefillTicket) -> None:
        try:
            release = call(self._release, ReplicaPin(ticket.replica_id), ticket.prefill_request_id)
            await asyncio.wait_for(release, RELEASE_TIMEOUT_S)
        except Exception as exc:  # noqa: BLE001 - the lease frees the blocks anyway
            logger.warning(
                "releasing the prefill blocks of request %s on replica %s failed (%s); its lease frees them",
                ticket.request_id,
                ticket.replica_id,
                exc,
            )

    async def is_healthy(self) -> bool:
        """Whether a replica of each pool answers healthy within the health timeout."""
        try:
            answers = await asyncio.wait_for(
                asyncio.gather(call(self._prefill.is_healthy), call(self._decode.is_healthy)), HEALTH_TIMEOUT_S
            )
            return all(bool(a) for a in answers)
        except Exception as exc:  # noqa: BLE001 - unreachable or dead is unhealthy
            logger.warning("engine health check failed: %s", exc)
            return False

    async def metrics_text(self) -> str:
        """Every live engine replica's ``flotilla:`` metrics (both pools, a ``pool``
        label on each series), merged, from the namespace's metrics hub."""
        from flotilla.serve.metrics import collect_metrics_text

        return await collect_metrics_text(self._metrics_timeout_s)
