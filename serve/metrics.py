"""Prometheus metrics of the engine replicas, and how the ingress gathers them.

Each engine replica records into its own :class:`EngineMetrics`, which owns a private
``CollectorRegistry`` (never prometheus_client's global one, so several engines in one
process, as in tests, never collide). Names mirror vLLM's under the ``flotilla:`` prefix,
and every series carries a ``replica`` label and a ``pool`` label (the replica's role:
``colocated``, or ``prefill`` / ``decode`` under prefill/decode disaggregation):

- histograms ``time_to_first_token_seconds``, ``inter_token_latency_seconds``,
  ``e2e_request_latency_seconds``, ``request_queue_time_seconds``;
- gauges ``num_requests_running``, ``num_requests_waiting``, ``kv_cache_usage_perc``
  (a fraction in [0, 1], as vLLM reports it despite the name);
- counters ``prompt_tokens_total``, ``generation_tokens_total``,
  ``request_success_total{finished_reason}``, ``prefix_cache_queries_total`` and
  ``prefix_cache_hits_total`` (both in prompt tokens);
- speculative decoding (``--speculative-algorithm``): counters ``spec_decode_num_drafts_total``
  (rounds: a request verifying drafts in one step), ``spec_decode_num_draft_tokens_total``,
  ``spec_decode_num_accepted_tokens_total`` and the histogram ``spec_decode_accepted_length``
  (drafts accepted per round); zero without speculation;
- KV handoff (prefill/decode disaggregation): gauges ``kv_cache_used_blocks`` (blocks
  referenced by requests or held for a handoff, not merely cached) and
  ``kv_transfer_leased_blocks`` (prefill side: blocks held under a lease for a decode
  replica to read); on the decode side the counters ``kv_transfer_bytes_total`` and
  ``kv_transfer_failures_total`` and the histogram ``kv_transfer_seconds`` (one
  observation per successful read of a prompt's blocks).

An elastic EP deployment's replica adds (:class:`ElasticEPMetrics`, same labels): the gauge
``ep_size`` (ranks serving now), the counter ``ep_scale_total{outcome="success|failure"}``
(scales that ran; refused requests are not counted), the histograms ``ep_scale_seconds``
(a successful scale, from its request to serving at the new size) and
``ep_commit_pause_seconds`` (how long its commit paused the engine: no tokens produced).
A replica whose engine has DP ranks (DP attention in any pool, or elastic EP) adds the counter
``dp_rank_requests_total{dp_rank}`` (requests admitted per DP rank).

Replicas are separate actors, so the ingress cannot read their registries. Each replica
pushes its exposition text to :class:`MetricsHub`, one small named Ray actor per
namespace, about once a second; ``GET /metrics`` calls :func:`collect_metrics_text`, which
returns the live replicas' texts merged by :func:`merge_expositions` into one exposition.
A replica that stops pushing drops out after :data:`HUB_TTL_S`.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
import time
from collections import deque
from typing import Any, Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily
from prometheus_client.parser import text_string_to_metric_families

logger = logging.getLogger(__name__)

PREFIX = "flotilla:"
# Seconds a replica's pushed exposition stays in the hub without a newer push.
HUB_TTL_S = 10.0
# Seconds between a replica's pushes to the hub.
PUSH_INTERVAL_S = 1.0
METRICS_HUB_NAME = "flotilla-metrics-hub"
# The hub lives in this fixed Ray namespace, whoever creates it (a replica, whose job
# namespace may be anonymous, or a driver), so every process finds the same one.
METRICS_HUB_NAMESPACE = "flotilla"

# Bucket bounds (seconds), spanning CPU test models to large models on accelerators.
_TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
_E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0, 600.0)
_QUEUE_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
_KV_TRANSFER_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
_EP_SCALE_BUCKETS = (0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1200.0)
_EP_COMMIT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
# Drafts accepted per speculative round (a count; rounds verify up to num_draft_tokens).
_ACCEPTED_LENGTH_BUCKETS = (0, 1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 16, 24, 32)
# TTFTs kept for the elastic EP autoscaler (EngineMetrics.ttfts_since); the oldest go first.
RECENT_TTFTS = 4096

# The ``pool`` label's values: a replica's role in the application.
POOLS = ("colocated", "prefill", "decode")


class EngineMetrics:
    """One engine replica's metrics, in a registry of its own.

    Thread-safe (prometheus_client's metrics are): the engine thread records, any thread
    reads :meth:`exposition`.

    Args:
        replica_id: the value of the ``replica`` label on every series.
        pool: the value of the ``pool`` label on every series, one of :data:`POOLS`.
    """

    def __init__(self, replica_id: str, pool: str = "colocated"):
        if pool not in POOLS:
            raise ValueError(f"pool must be one of {POOLS} (got pool={pool!r})")
        self.replica_id = str(replica_id)
        self.pool = pool
        self.registry = CollectorRegistry(auto_describe=True)
        reg, labels = self.registry, {"replica": self.replica_id, "pool": pool}
        names = list(labels)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]):
            return Histogram(PREFIX + name, doc, names, buckets=buckets, registry=reg).labels(**labels)

        def gauge(name: str, doc: str):
            return Gauge(PREFIX + name, doc, names, registry=reg).labels(**labels)

        def counter(name: str, doc: str):
            return Counter(PREFIX + name, doc, names, registry=reg).labels(**labels)

        self.time_to_first_token = _Recent(histogram(
            "time_to_first_token_seconds",
            "Seconds from a request's arrival to its first generated token.",
            _TTFT_BUCKETS,
        ))
        self.inter_token_latency = _Recent(histogram(
            "inter_token_latency_seconds", "Seconds between consecutive tokens of one completion.", _ITL_BUCKETS
        ))  # fmt: skip
        self.e2e_request_latency = histogram(
            "e2e_request_latency_seconds", "Seconds from a request's arrival to its last token.", _E2E_BUCKETS
        )
        self.request_queue_time = histogram(
            "request_queue_time_seconds",
            "Seconds a request waited in the replica before its first step.",
            _QUEUE_BUCKETS,
        )
        self.num_requests_running = gauge("num_requests_running", "Requests being generated.")
        self.num_requests_waiting = gauge("num_requests_waiting", "Requests queued in the replica, not yet scheduled.")
        self.kv_cache_usage = gauge("kv_cache_usage_perc", "Fraction of KV cache blocks in use (0 to 1).")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of requests that reached their first token.")
        self.generation_tokens = counter("generation_tokens", "Generated tokens.")
        self.engine_restarts = counter(
            "engine_restarts", "Worker groups the replica rebuilt after a rank failed (its requests migrated)."
        )
        self.prefix_cache_queries = counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
        self.prefix_cache_hits = counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.")
        self.kv_cache_used_blocks = gauge(
            "kv_cache_used_blocks",
            "KV cache blocks referenced by requests or held for a KV handoff (not merely cached).",
        )
        self.kv_transfer_leased_blocks = gauge(
            "kv_transfer_leased_blocks",
            "KV cache blocks held under a lease for a decode replica to read (prefill side).",
        )
        self.kv_transfer_bytes = counter("kv_transfer_bytes", "Bytes of KV cache read from prefill replicas.")
        self.kv_transfer_failures = counter(
            "kv_transfer_failures", "KV reads from prefill replicas that failed (connect, timeout, transport error)."
        )
        self.kv_transfer_seconds = histogram(
            "kv_transfer_seconds", "Seconds one successful read of a prompt's KV blocks took.", _KV_TRANSFER_BUCKETS
        )
        self.spec_decode_num_drafts = counter(
            "spec_decode_num_drafts", "Speculative rounds verified (a request verifying drafts in one step)."
        )
        self.spec_decode_num_draft_tokens = counter("spec_decode_num_draft_tokens", "Drafted tokens verified.")
        self.spec_decode_num_accepted_tokens = counter("spec_decode_num_accepted_tokens", "Drafted tokens accepted.")
        self.spec_decode_accepted_length = histogram(
            "spec_decode_accepted_length", "Drafts accepted in one speculative round.", _ACCEPTED_LENGTH_BUCKETS
        )
        self._labels = labels
        self._request_success = Counter(
            PREFIX + "request_success",
            "Finished completions, by finish reason (stop, length, abort, error).",
            names + ["finished_reason"],
            registry=reg,
        )

    def record_finished(self, finished_reason: str) -> None:
        """Count one finished completion."""
        self._request_success.labels(**self._labels, finished_reason=finished_reason).inc()

    def record_speculation(self, drafts: int, draft_tokens: int, accepted_tokens: int, accepted_lengths: Iterable[int]) -> None:
        """Count speculative rounds since the last call (see :class:`~flotilla.cluster.engine.speculative.SpecDecodeStats`)."""
        if drafts:
            self.spec_decode_num_drafts.inc(drafts)
            self.spec_decode_num_draft_tokens.inc(draft_tokens)
            self.spec_decode_num_accepted_tokens.inc(accepted_tokens)
        for length in accepted_lengths:
            self.spec_decode_accepted_length.observe(length)

    def record_kv_transfer(self, num_bytes: int, seconds: float) -> None:
        """Count one successful KV read of ``num_bytes`` that took ``seconds``."""
        self.kv_transfer_bytes.inc(num_bytes)
        self.kv_transfer_seconds.observe(seconds)

    def set_load(self, running: int, waiting: int, kv_usage: float, used_blocks: int | None = None) -> None:
        """Set the load gauges (``used_blocks``: ``kv_cache_used_blocks``, left as is when None)."""
        self.num_requests_running.set(running)
        self.num_requests_waiting.set(waiting)
        self.kv_cache_usage.set(kv_usage)
        if used_blocks is not None:
            self.kv_cache_used_blocks.set(used_blocks)

    def ttfts_since(self, cursor: int = 0) -> tuple[list[float], int]:
        """``(the TTFTs in seconds observed since cursor, the cursor for next time)``:
        the requests whose first token came after the call that returned ``cursor`` (0:
        from the start), oldest first; only the last :data:`RECENT_TTFTS` are kept."""
        return self.time_to_first_token.since(cursor)

    def itls_since(self, cursor: int = 0) -> tuple[list[float], int]:
        """As :meth:`ttfts_since`, for the inter-token latencies (seconds)."""
        return self.inter_token_latency.since(cursor)

    def enable_elastic_ep(self, ep_size: Callable[[], int]) -> "ElasticEPMetrics":
        """Add the elastic EP series to this registry (see :class:`ElasticEPMetrics`)."""
        return ElasticEPMetrics(self.registry, self._labels, ep_size)

    def enable_dp_rank_requests(self, counts: Callable[[], list[int]]) -> None:
        """Add ``dp_rank_requests_total{dp_rank}`` (requests admitted per DP rank so far, read
        from ``counts`` at exposition time) to this registry: engines with DP ranks (DP
        attention, elastic EP)."""
        self.registry.register(_DPRankRequests(self._labels, counts))

    def exposition(self) -> str:
        """This replica's metrics in the Prometheus text format."""
        return generate_latest(self.registry).decode()


class _Recent:
    """A labelled histogram that also remembers its latest observations, numbered in
    order (thread-safe: the engine thread observes, the event loop reads)."""

    def __init__(self, histogram: Any, keep: int = RECENT_TTFTS):
        self._histogram = histogram
        self._recent: deque[float] = deque(maxlen=keep)
        self._count = 0  # observations so far; the newest kept one is number _count - 1
        self._lock = threading.Lock()

    def observe(self, value: float) -> None:
        self._histogram.observe(value)
        with self._lock:
            self._recent.append(float(value))
            self._count += 1

    def since(self, cursor: int) -> tuple[list[float], int]:
        with self._lock:
            new = max(0, min(self._count - cursor, len(self._recent)))
            return list(self._recent)[len(self._recent) - new:], self._count


class ElasticEPMetrics:
    """An elastic EP replica's series, in its :class:`EngineMetrics` registry.

    ``ep_size`` is read at exposition time from the callable (the requests per DP rank are
    :meth:`EngineMetrics.enable_dp_rank_requests`'); :meth:`record_scale` counts a scale that ran.

    Args:
        registry: the replica's registry.
        labels: the ``replica`` and ``pool`` labels.
        ep_size: the EP size serving now.
    """

    def __init__(self, registry: CollectorRegistry, labels: dict[str, str], ep_size: Callable[[], int]):
        names = list(labels)
        self._labels = dict(labels)
        self._ep_size = ep_size
        self._last_ep_size = 0
        gauge = Gauge(PREFIX + "ep_size", "Expert-parallel ranks serving now (elastic EP).", names, registry=registry)
        gauge.labels(**labels).set_function(self._read_ep_size)
        self._scales = Counter(
            PREFIX + "ep_scale",
            "Elastic EP scales that ran, by outcome (success, failure).",
            names + ["outcome"],
            registry=registry,
        )
        for outcome in ("success", "failure"):
            self._scales.labels(**labels, outcome=outcome)  # NOTE: both series from the start, at 0
        self.scale_seconds = Histogram(
            PREFIX + "ep_scale_seconds",
            "Seconds from a successful elastic EP scale request to serving at the new size.",
            names, buckets=_EP_SCALE_BUCKETS, registry=registry,
        ).labels(**labels)  # fmt: skip
        self.commit_pause_seconds = Histogram(
            PREFIX + "ep_commit_pause_seconds",
            "Seconds an elastic EP commit paused the engine (no tokens produced).",
            names, buckets=_EP_COMMIT_BUCKETS, registry=registry,
        ).labels(**labels)  # fmt: skip

    def _read_ep_size(self) -> float:
        try:
            self._last_ep_size = int(self._ep_size())
        except Exception as exc:  # noqa: BLE001 - a dead engine still has metrics to show
            logger.debug("ep_size unavailable: %s", exc)
        return float(self._last_ep_size)

    def record_scale(self, ok: bool, scale_s: float | None = None, commit_pause_s: float | None = None) -> None:
        """Count a scale that ran; a successful one with its timings."""
        self._scales.labels(**self._labels, outcome="success" if ok else "failure").inc()
        if scale_s is not None:
            self.scale_seconds.observe(scale_s)
        if commit_pause_s is not None:
            self.commit_pause_seconds.observe(commit_pause_s)


class _DPRankRequests:
    """The ``dp_rank_requests_total{dp_rank}`` counter, read from the engine's counts."""

    NAME = PREFIX + "dp_rank_requests"
    DOC = "Requests admitted per DP rank (DP attention, elastic EP: new ranks receive requests once committed)."

    def __init__(self, labels: dict[str, str], counts: Callable[[], list[int]]):
        self._labels, self._counts = labels, counts

    def describe(self):
        return [CounterMetricFamily(self.NAME, self.DOC, labels=[*self._labels, "dp_rank"])]

    def collect(self):
        family = CounterMetricFamily(self.NAME, self.DOC, labels=[*self._labels, "dp_rank"])
        try:
            counts = list(self._counts())
        except Exception as exc:  # noqa: BLE001 - a dead engine still has metrics to show
            logger.debug("dp_rank_requests unavailable: %s", exc)
            counts = []
        for rank, count in enumerate(counts):
            family.add_metric([*self._labels.values(), str(rank)], float(count))
        return [family]


class _Families:
    """A collector that yields already-built metric families (for :func:`merge_expositions`)."""

    def __init__(self, families: Iterable[Any]):
        self._families = list(families)

    def collect(self):
        return self._families


def merge_expositions(texts: Iterable[str]) -> str:
    """Merge several replicas' exposition texts into one valid exposition.

    Each metric family appears once (HELP and TYPE of the first text that has it) with
    the samples of every text. Samples are told apart by their labels (the ``replica``
    and ``pool`` labels); if two texts carry the very same sample (name and labels), the
    later one wins. A family whose type disagrees with the first one seen is dropped (and
    logged), since one exposition cannot give a name two types. Raises ValueError for a
    text that does not parse.
    """
    families: dict[str, Any] = {}
    samples: dict[str, dict[tuple, Any]] = {}
    for text in texts:
        for family in text_string_to_metric_families(text):
            first = families.get(family.name)
            if first is None:
                families[family.name] = first = family
                samples[family.name] = {}
            elif first.type != family.type:
                logger.warning(
                    "metrics family %s has type %s in one replica and %s in another; dropping the latter",
                    family.name,
                    first.type,
                    family.type,
                )
                continue
            for sample in family.samples:
                samples[family.name][(sample.name, tuple(sorted(sample.labels.items())))] = sample
    for name, family in families.items():
        family.samples = list(samples[name].values())
    registry = CollectorRegistry(auto_describe=False)
    # NOTE: a family without samples (a TYPE line whose samples carry another name) is left
    # out: re-exposed, it would repeat the TYPE line of the family that holds them.
    registry.register(_Families(f for f in families.values() if f.samples))
    return generate_latest(registry).decode()


class MetricsHub:
    """Latest exposition text of each engine replica (the body of the named Ray actor).

    Args:
        ttl_s: a replica's text is dropped this long after its last push.
    """

    def __init__(self, ttl_s: float = HUB_TTL_S):
        self.ttl_s = ttl_s
        self._texts: dict[str, tuple[float, str]] = {}

    def push(self, replica_id: str, text: str) -> None:
        """Store ``replica_id``'s current exposition."""
        self._texts[str(replica_id)] = (time.monotonic(), text)

    def remove(self, replica_id: str) -> None:
        """Forget a replica at once (it shut down)."""
        self._texts.pop(str(replica_id), None)

    def replicas(self) -> list[str]:
        """Replicas whose text has not expired."""
        self._expire()
        return sorted(self._texts)

    def collect(self) -> str:
        """The live replicas' expositions merged into one."""
        self._expire()
        texts = []
        for replica_id, (_, text) in sorted(self._texts.items()):
            try:
                list(text_string_to_metric_families(text))  # NOTE: the parser is lazy; list() runs it
            except ValueError as exc:
                logger.warning("dropping unparsable metrics text of replica %s: %s", replica_id, exc)
                continue
            texts.append(text)
        return merge_expositions(texts)

    def _expire(self) -> None:
        cutoff = time.monotonic() - self.ttl_s
        for replica_id in [r for r, (at, _) in self._texts.items() if at < cutoff]:
            del self._texts[replica_id]


@functools.lru_cache(maxsize=1)
def _hub_actor_class():
    import ray

    return ray.remote(num_cpus=0)(MetricsHub)


def get_metrics_hub():
    """The :class:`MetricsHub` actor (in :data:`METRICS_HUB_NAMESPACE`), created on first use.

    Needs a connected Ray. The actor is detached, so it outlives the replica that happened
    to create it (a restarted replica must not take the others' metrics down with it);
    :func:`shutdown_metrics_hub` removes it.
    """
    options = dict(name=METRICS_HUB_NAME, namespace=METRICS_HUB_NAMESPACE, get_if_exists=True, lifetime="detached")
    return _hub_actor_class().options(**options).remote()


def shutdown_metrics_hub() -> bool:
    """Kill the hub, if there is one; returns whether one was found."""
    import ray

    try:
        hub = ray.get_actor(METRICS_HUB_NAME, namespace=METRICS_HUB_NAMESPACE)
    except ValueError:
        return False
    ray.kill(hub)
    return True


async def collect_metrics_text(timeout_s: float = 5.0) -> str:
    """Every live engine replica's metrics as one exposition (what ``GET /metrics`` serves).

    Call it where Ray is connected, in the replicas' namespace (e.g. in the Serve ingress).
    Raises ``TimeoutError`` when the hub does not answer within ``timeout_s``.
    """
    hub = get_metrics_hub()
    return await asyncio.wait_for(asyncio.wrap_future(hub.collect.remote().future()), timeout_s)


async def push_metrics_forever(replica_id: str, exposition, interval_s: float = PUSH_INTERVAL_S) -> None:
    """Push ``exposition()`` (a callable returning text) to the hub every ``interval_s``
    seconds until cancelled; fire-and-forget (a lost push is replaced by the next one)."""
    hub = None
    while True:
        try:
            if hub is None:
                hub = get_metrics_hub()
            hub.push.remote(replica_id, exposition())
        except Exception as exc:  # noqa: BLE001 - metrics must never take the replica down
            logger.debug("metrics push of replica %s failed: %s", replica_id, exc)
            hub = None
        await asyncio.sleep(interval_s)
