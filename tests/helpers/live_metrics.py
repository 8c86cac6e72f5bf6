"""Reading a live server's ``/metrics`` in tests (Prometheus text, parsed)."""

import time

import httpx
from prometheus_client.parser import text_string_to_metric_families

# Replicas push their metrics about once a second: checks poll for this long.
METRICS_WAIT_S = 8.0


def metrics(url: str) -> dict[str, dict[tuple, float]]:
    """``GET /metrics`` as {sample name: {sorted label items: value}}."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    out: dict[str, dict[tuple, float]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = s.value
    return out


def total(m: dict, name: str, **labels) -> float:
    return sum(v for k, v in m.get(name, {}).items() if all((key, val) in k for key, val in labels.items()))


def wait_for(predicate, timeout_s: float = METRICS_WAIT_S, interval_s: float = 0.3):
    """Poll ``predicate()`` until it returns a truthy value; return the last value."""
    deadline = time.monotonic() + timeout_s
    value = predicate()
    while not value and time.monotonic() < deadline:
        time.sleep(interval_s)
        value = predicate()
    return value


def pd_blocks_all_free(url: str) -> bool:
    """Both pools' replicas report their KV blocks (``flotilla:kv_cache_used_blocks``) and
    the prefill pool its leased blocks back at 0 (and both pools report at all)."""
    m = metrics(url)
    used = m.get("flotilla:kv_cache_used_blocks", {})
    pools = {dict(k).get("pool") for k in used}
    return (
        {"prefill", "decode"} <= pools
        and sum(v for k, v in used.items() if dict(k).get("pool") in ("prefill", "decode")) == 0
        and total(m, "flotilla:kv_transfer_leased_blocks", pool="prefill") == 0
    )
