"""EngineMetrics (names, the replica and pool labels, private registries), merging replicas' expositions, and
the MetricsHub's bookkeeping as a plain object (its Ray actor form is exercised by the live
Serve tests). The oracle for merged text is prometheus_client's own parser."""

from __future__ import annotations

import pytest
from prometheus_client import REGISTRY
from prometheus_client.parser import text_string_to_metric_families

from flotilla.serve.metrics import EngineMetrics, MetricsHub, merge_expositions

FAMILIES = {
    "flotilla:time_to_first_token_seconds": "histogram",
    "flotilla:inter_token_latency_seconds": "histogram",
    "flotilla:e2e_request_latency_seconds": "histogram",
    "flotilla:request_queue_time_seconds": "histogram",
    "flotilla:num_requests_running": "gauge",
    "flotilla:num_requests_waiting": "gauge",
    "flotilla:kv_cache_usage_perc": "gauge",
    "flotilla:prompt_tokens": "counter",
    "flotilla:generation_tokens": "counter",
    "flotilla:request_success": "counter",
    "flotilla:prefix_cache_queries": "counter",
    "flotilla:prefix_cache_hits": "counter",
    "flotilla:kv_cache_used_blocks": "gauge",
    "flotilla:kv_transfer_leased_blocks": "gauge",
    "flotilla:kv_transfer_bytes": "counter",
    "flotilla:kv_transfer_failures": "counter",
    "flotilla:kv_transfer_seconds": "histogram",
}


def replica(replica_id: str, tokens: int, ttfts: list[float], running: int, pool: str = "colocated") -> EngineMetrics:
    metrics = EngineMetrics(replica_id, pool)
    metrics.generation_tokens.inc(tokens)
    metrics.prompt_tokens.inc(3 * tokens)
    for ttft in ttfts:
        metrics.time_to_first_token.observe(ttft)
    metrics.set_load(running, 1, 0.25, used_blocks=4 * running)
    metrics.record_finished("stop")
    metrics.record_finished("length")
    return metrics


def families(text: str) -> dict:
    return {f.name: f for f in text_string_to_metric_families(text)}


def value(text: str, name: str, **labels) -> float:
    found = [
        s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
    ]
    return sum(found)


def test_every_family_has_the_flotilla_name_its_type_and_the_replica_and_pool_labels():
    metrics = replica("a", 5, [0.1], 2, pool="decode")
    metrics.record_kv_transfer(4096, 0.003)
    metrics.kv_transfer_failures.inc()
    metrics.kv_transfer_leased_blocks.set(3)
    text = metrics.exposition()
    parsed = families(text)
    for name, kind in FAMILIES.items():
        assert parsed[name].type == kind, name
        assert parsed[name].samples, name
        assert all(s.labels["replica"] == "a" and s.labels["pool"] == "decode" for s in parsed[name].samples), name
    assert value(text, "flotilla:request_success_total", finished_reason="length") == 1
    assert value(text, "flotilla:kv_transfer_bytes_total") == 4096
    assert value(text, "flotilla:kv_transfer_failures_total") == 1
    assert value(text, "flotilla:kv_transfer_seconds_count") == 1
    assert value(text, "flotilla:kv_transfer_seconds_bucket", le="0.005") == 1
    assert value(text, "flotilla:kv_transfer_seconds_bucket", le="0.0025") == 0
    assert value(text, "flotilla:kv_cache_used_blocks") == 8
    assert value(text, "flotilla:kv_transfer_leased_blocks") == 3


def test_pool_defaults_to_colocated_and_must_be_a_known_role():
    samples = families(EngineMetrics("a").exposition())["flotilla:kv_cache_used_blocks"].samples
    assert samples and all(s.labels["pool"] == "colocated" for s in samples)
    with pytest.raises(ValueError, match="pool='both'"):
        EngineMetrics("a", "both")


def test_each_engine_has_its_own_registry_never_the_global_one():
    first, second = EngineMetrics("x"), EngineMetrics("x")  # same label: would clash in one registry
    first.generation_tokens.inc(2)
    assert value(second.exposition(), "flotilla:generation_tokens_total") == 0
    assert REGISTRY.get_sample_value("flotilla:generation_tokens_total", {"replica": "x", "pool": "colocated"}) is None


def test_merged_exposition_parses_back_with_each_family_once_and_sums_right():
    texts = [replica("a", 5, [0.1, 0.3], 2).exposition(), replica("b", 7, [2.0], 3).exposition()]
    merged = merge_expositions(texts)
    for name in FAMILIES:
        exposed = name + "_total" if FAMILIES[name] == "counter" else name
        assert merged.count(f"# TYPE {exposed} ") == 1, name
        assert merged.count(f"# HELP {exposed} ") == 1, name
    parsed = families(merged)
    assert {s.labels["replica"] for s in parsed["flotilla:generation_tokens"].samples} == {"a", "b"}
    assert value(merged, "flotilla:generation_tokens_total") == 12
    assert value(merged, "flotilla:prompt_tokens_total") == 36
    assert value(merged, "flotilla:num_requests_running") == 5
    assert value(merged, "flotilla:time_to_first_token_seconds_count") == 3
    assert value(merged, "flotilla:time_to_first_token_seconds_sum") == pytest.approx(2.4)
    assert value(merged, "flotilla:time_to_first_token_seconds_bucket", le="0.5") == 2
    assert value(merged, "flotilla:request_success_total", finished_reason="stop") == 2
    # Merging is stable: the merged text merges to itself.
    assert families(merge_expositions([merged])) == parsed


def test_merge_keeps_the_pools_of_a_pd_application_apart():
    # The same replica tag in both pools stays two series (the pool label tells them apart).
    prefill, decode = replica("r", 1, [0.1], 1, pool="prefill"), replica("r", 9, [0.2], 2, pool="decode")
    decode.record_kv_transfer(100, 0.01)
    merged = merge_expositions([prefill.exposition(), decode.exposition(), replica("c", 4, [0.1], 0).exposition()])
    assert value(merged, "flotilla:generation_tokens_total") == 14
    assert value(merged, "flotilla:generation_tokens_total", pool="prefill") == 1
    assert value(merged, "flotilla:generation_tokens_total", pool="decode") == 9
    assert value(merged, "flotilla:kv_transfer_bytes_total", pool="decode") == 100
    assert value(merged, "flotilla:kv_cache_used_blocks", pool="decode") == 8
    assert merged.count("# TYPE flotilla:kv_transfer_seconds ") == 1
    assert {s.labels["pool"] for s in families(merged)["flotilla:num_requests_running"].samples} == {
        "prefill", "decode", "colocated"
    }


def test_merge_keeps_the_last_copy_of_a_repeated_sample_and_drops_a_conflicting_type():
    old = "# TYPE m_total counter\nm_total{replica=\"a\"} 1\n"
    new = "# TYPE m_total counter\nm_total{replica=\"a\"} 4\n"
    clash = "# TYPE m gauge\nm{replica=\"b\"} 9\n"
    merged = merge_expositions([old, new, clash])
    assert value(merged, "m_total") == 4
    assert families(merged)["m"].type == "counter" and 'replica="b"' not in merged
    assert merge_expositions([]) == ""
    # A TYPE line whose samples go by another name yields one family of samples, one TYPE line.
    odd = merge_expositions(["# TYPE n counter\nn_total{replica=\"a\"} 2\n"])
    assert odd.count("# TYPE n_total ") == 1 and value(odd, "n_total") == 2


def test_merge_rejects_text_that_does_not_parse():
    with pytest.raises(ValueError):
        merge_expositions(["this is { not prometheus"])


def test_hub_merges_live_replicas_and_expires_silent_ones():
    hub = MetricsHub(ttl_s=10.0)
    hub.push("a", replica("a", 5, [0.1], 1).exposition())
    hub.push("b", replica("b", 7, [0.1], 1).exposition())
    hub.push("broken", "not { metrics")
    assert value(hub.collect(), "flotilla:generation_tokens_total") == 12  # the unparsable text is left out
    hub.push("a", replica("a", 50, [0.1], 1).exposition())  # a newer push replaces the older
    assert value(hub.collect(), "flotilla:generation_tokens_total") == 57
    at, text = hub._texts["b"]
    hub._texts["b"] = (at - 11.0, text)  # b last pushed 11 s ago: past the 10 s TTL
    assert hub.replicas() == ["a", "broken"]
    assert value(hub.collect(), "flotilla:generation_tokens_total") == 50
    hub.remove("a")
    assert value(hub.collect(), "flotilla:generation_tokens_total") == 0
