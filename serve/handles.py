"""Calling engine deployments through Serve handles, in the serving contract's terms.

Shared by the ingress's engine clients (:class:`~flotilla.serve.app.ServeEngineClient`,
:class:`~flotilla.serve.pd.PDEngineClient`): what a handle call raised becomes the
contract's error, and a streaming call is consumed so that a consumer that leaves early
cancels it (the replica then aborts the request and frees its KV blocks).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import uuid
from typing import Any, AsyncIterator, Callable, Iterator

from flotilla.serve.types import EngineOverloadedError, EngineUnavailableError, GenerateChunk, ReplicaLostError

logger = logging.getLogger(__name__)


def call(method: Any, *args: Any, **kwargs: Any) -> Any:
    """``method.remote(*args, **kwargs)`` (a handle method or ``handle.options(...)``) as a
    request of its own to the deployment's router.

    NOTE: inside a replica, Serve gives every handle call the internal request id of the
    request being served (Ray 2.60), and its ``RequestRouter`` matches a chosen replica to a
    pending call by that id: of two concurrent calls from one request (the prompts of one
    ``/v1/completions`` list, a prefill and its release) one is never matched and waits
    forever. Each call made through here gets a fresh internal id.
    """
    with _own_internal_request_id():
        return method.remote(*args, **kwargs)


@contextlib.contextmanager
def _own_internal_request_id() -> Iterator[None]:
    try:
        from ray.serve import context as serve_context

        current = serve_context._get_serve_request_context()
        fresh = dataclasses.replace(current, _internal_request_id=uuid.uuid4().hex)
        token = serve_context._serve_request_context.set(fresh)
    except (ImportError, AttributeError, TypeError):  # NOTE: another Serve: its own ids
        yield
        return
    try:
        yield
    finally:
        serve_context._serve_request_context.reset(token)


def engine_error(exc: BaseException) -> BaseException:
    """The contract's error for what a handle call raised: the replica's own exception
    (unwrapped from Ray's RayTaskError), ``EngineOverloadedError`` for Serve's
    backpressure, :class:`ReplicaLostError` (an ``EngineUnavailableError``) for a dead or
    unreachable replica; anything else as it is."""
    from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError, RayTaskError
    from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError

    if isinstance(exc, RayTaskError) and isinstance(getattr(exc, "cause", None), Exception):
        exc = exc.cause
    if isinstance(exc, (EngineOverloadedError, EngineUnavailableError, ValueError)):
        return exc
    if isinstance(exc, BackPressureError):
        return EngineOverloadedError(f"every engine replica is busy ({exc})", retry_after_s=1)
    if isinstance(exc, (ActorDiedError, ActorUnavailableError, RayActorError, DeploymentUnavailableError)):
        # NOTE: Ray's message names the actor, its pid, node address and namespace: the log
        # keeps them; the client gets a plain reason.
        logger.warning("an engine replica call failed: %s: %s", type(exc).__name__, exc)
        return ReplicaLostError("the engine replica serving this request stopped; retry the request")
    return exc


async def stream_chunks(
    response: Any,
    on_first: Callable[[], None] | None = None,
    wrap_unknown: bool = False,
) -> AsyncIterator[GenerateChunk]:
    """The chunks of a streaming handle call (``handle.options(stream=True).remote(...)``).

    Errors are raised as :func:`engine_error` makes them; with ``wrap_unknown`` any other
    error becomes an :class:`EngineUnavailableError` carrying its message (a server-side
    failure the client may retry, e.g. a KV load that failed under
    ``kv_load_failure_policy='fail'``). ``on_first`` runs once, when the first chunk
    arrives or the call fails before it. A consumer that stops early cancels the call.
    """
    done = False
    pending_first = on_first is not None
    try:
        async for chunk in response:
            if pending_first:
                pending_first = False
                on_first()
            yield chunk
        done = True
    except (GeneratorExit, asyncio.CancelledError):
        raise
    except Exception as exc:
        done = True
        if pending_first:
            on_first()
        error = engine_error(exc)
        if wrap_unknown and not isinstance(error, (ValueError, EngineOverloadedError, EngineUnavailableError)):
            error = EngineUnavailableError(f"{type(error).__name__}: {error}")
        if error is exc:
            raise
        raise error from None
    finally:
        if not done:
            response.cancel()
