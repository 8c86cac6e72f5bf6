"""The commands asyncio callers queue for an :class:`~flotilla.serve.async_engine.AsyncEngine`'s
engine thread, and the stream each answer goes to.

Internal to the ``async_engine`` modules: :mod:`flotilla.serve.async_engine` queues and
applies them, :mod:`flotilla.serve.async_engine_pd` queues the KV handoff's two adds.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any, Callable

from flotilla.cluster.engine.kv_contract import PrefillTicket
from flotilla.serve.types import GenerateRequest


@dataclass(eq=False)
class _Stream:
    """Where one request's chunks go: a queue owned by the event loop that called generate()."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue


@dataclass(eq=False)
class _Add:
    engine_id: str
    request: GenerateRequest
    stream: _Stream
    submitted: float  # time.monotonic() when generate() queued it
    arrival_wall: float  # time.time() of arrival (the ingress's, else generate()'s)


@dataclass(eq=False)
class _Prefill(_Add):
    """Prefill side: run the prompt for one token and hold its KV under a lease."""

    lease_s: float = 0.0


@dataclass(eq=False)
class _AddPrefilled(_Add):
    """Decode side: a request whose prompt's KV is read from ``ticket``'s peer."""

    ticket: PrefillTicket | None = None
    policy: str = "recompute"
    timeout_s: float = 30.0


@dataclass(eq=False)
class _Abort:
    engine_id: str


@dataclass(eq=False)
class _Call:
    """Run ``fn()`` on the engine thread; its result (or exception) goes to ``stream``."""

    fn: Callable[[], Any]
    stream: _Stream


_Command = _Add | _Abort | _Call
