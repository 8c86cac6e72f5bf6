"""A closed-loop load generator for the OpenAI completions API, and its in-process twin.

``http_load`` keeps ``concurrency`` streaming ``POST /v1/completions`` requests in flight
until ``len(prompts)`` have been sent, and records for each its HTTP status, time to first
token, end-to-end latency and token counts (from ``stream_options.include_usage``).
``engine_load`` runs the same workload against an :class:`~flotilla.serve.types.EngineClient`
in this process (no HTTP, no Serve), so the two reports differ only by the serving path.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Awaitable, Callable, Sequence


@dataclass
class RequestResult:
    """One request's outcome.

    Attributes:
        status: the HTTP status (200 for in-process successes; 0 when the connection failed).
        ttft_s: seconds to the first token (None when none came).
        e2e_s: seconds from send to the last byte.
        output_tokens: completion tokens (from usage).
        cached_tokens: prompt tokens served from the prefix cache (from usage).
        error: the error text of a failed request.
    """

    status: int
    ttft_s: float | None = None
    e2e_s: float = 0.0
    output_tokens: int = 0
    cached_tokens: int = 0
    error: str | None = None


@dataclass
class LoadReport:
    """Every request's result and the wall time of the whole run."""

    results: list[RequestResult] = field(default_factory=list)
    wall_s: float = 0.0

    def count(self, predicate: Callable[[RequestResult], bool]) -> int:
        return sum(1 for r in self.results if predicate(r))

    def summary(self) -> dict[str, Any]:
        """Counts by outcome, output tokens/s over the wall time, TTFT and latency medians."""
        ok = [r for r in self.results if r.status == 200 and r.error is None]
        ttfts = sorted(r.ttft_s for r in ok if r.ttft_s is not None)
        tokens = sum(r.output_tokens for r in ok)
        return {
            "requests": len(self.results),
            "completed": len(ok),
            "rejected_429": self.count(lambda r: r.status == 429),
            "server_errors_5xx": self.count(lambda r: r.status >= 500),
            "other_failures": self.count(lambda r: r.status not in (200, 429) and r.status < 500),
            "wall_s": round(self.wall_s, 3),
            "output_tokens": tokens,
            "output_tok_s": round(tokens / self.wall_s, 2) if self.wall_s else 0.0,
            "ttft_median_s": round(statistics.median(ttfts), 4) if ttfts else None,
            "ttft_p90_s": round(ttfts[int(0.9 * (len(ttfts) - 1))], 4) if ttfts else None,
            "e2e_median_s": round(statistics.median(r.e2e_s for r in ok), 4) if ok else None,
        }

    def to_json(self) -> dict[str, Any]:
        return {"summary": self.summary(), "results": [asdict(r) for r in self.results]}


async def _closed_loop(num: int, concurrency: int, one: Callable[[int], Awaitable[RequestResult]]) -> LoadReport:
    """Run ``one(i)`` for i in range(num), at most ``concurrency`` at a time."""
    if concurrency < 1:
        raise ValueError(f"concurrency must be at least 1, got concurrency={concurrency}")
    indices = iter(range(num))
    results: list[RequestResult | None] = [None] * num

    async def worker() -> None:
        for i in indices:  # NOTE: one shared iterator: each index is taken by exactly one worker
            results[i] = await one(i)

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(min(concurrency, num))))
    return LoadReport([r for r in results if r is not None], time.perf_counter() - start)


async def http_load(
    base_url: str,
    model: str,
    prompts: Sequence[Sequence[int]],
    max_tokens: int,
    concurrency: int,
    api_key: str | None = None,
    timeout_s: float = 600.0,
) -> LoadReport:
    """Stream one greedy completion (``ignore_eos``, exactly ``max_tokens`` tokens) per prompt
    through ``base_url`` (``http://host:port``), ``concurrency`` at a time."""
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=base_url, headers=headers, timeout=timeout_s, limits=limits) as client:

        async def one(i: int) -> RequestResult:
            body = {
                "model": model,
                "prompt": list(prompts[i]),
                "max_tokens": max_tokens,
                "temperature": 0,
                "ignore_eos": True,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            start = time.perf_counter()
            result = RequestResult(status=0)
            try:
                async with client.stream("POST", "/v1/completions", json=body) as response:
                    result.status = response.status_code
                    if response.status_code != 200:
                        result.error = (await response.aread()).decode(errors="replace")[:500]
                    else:
                        await _read_sse(response, result, start)
            except httpx.HTTPError as exc:
                result.error = f"{type(exc).__name__}: {exc}"
            result.e2e_s = time.perf_counter() - start
            return result

        return await _closed_loop(len(prompts), concurrency, one)


async def _read_sse(response: Any, result: RequestResult, start: float) -> None:
    """Fill ``result`` from an OpenAI SSE stream (first token time: the first frame with text
    or token ids; usage; an error frame)."""
    async for line in response.aiter_lines():
        if not line.startswith("data: "):
            continue
        data = line[len("data: ") :]
        if data == "[DONE]":
            break
        frame = json.loads(data)
        if "error" in frame:
            result.error = str(frame["error"].get("message", frame["error"]))
            continue
        # NOTE: a server without a tokenizer streams token ids and empty text.
        choices = frame.get("choices", [])
        if result.ttft_s is None and any(c.get("text") or c.get("token_ids") for c in choices):
            result.ttft_s = time.perf_counter() - start
        usage = frame.get("usage")
        if usage:
            result.output_tokens = int(usage.get("completion_tokens", 0))
            details = usage.get("prompt_tokens_details") or {}
            result.cached_tokens = int(details.get("cached_tokens") or 0)


async def engine_load(
    engine: Any, prompts: Sequence[Sequence[int]], max_tokens: int, concurrency: int
) -> LoadReport:
    """The same workload as :func:`http_load` against an in-process ``EngineClient``."""
    from flotilla.cluster.engine.sampling_params import SamplingParams
    from flotilla.serve.types import EngineOverloadedError, GenerateRequest

    ids = itertools.count()

    async def one(i: int) -> RequestResult:
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        request = GenerateRequest(f"load-{next(ids)}", list(prompts[i]), params, time.time())
        start = time.perf_counter()
        result = RequestResult(status=200)
        try:
            async for chunk in engine.generate(request):
                if result.ttft_s is None and any(c.token_ids for c in chunk.completions):
                    result.ttft_s = time.perf_counter() - start
                if chunk.finished:
                    result.output_tokens, result.cached_tokens = chunk.completion_tokens, chunk.cached_tokens
                    result.error = chunk.error
        except EngineOverloadedError as exc:
            result.status, result.error = 429, str(exc)
        except Exception as exc:  # noqa: BLE001 - a load report records every failure
            result.status, result.error = 500, f"{type(exc).__name__}: {exc}"
        result.e2e_s = time.perf_counter() - start
        return result

    return await _closed_loop(len(prompts), concurrency, one)
