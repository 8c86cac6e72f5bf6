"""The elastic EP autoscaling policy (pure, no Ray): scenarios on a synthetic clock (no
sleeps), a small queueing model of a bounded load, a brute-force oracle for the window
rule over random sample streams, validation, and the decision log."""

import logging
import random

import pytest

from flotilla.serve.ep_autoscale import (
    HOLD_AT_MAX,
    HOLD_COOLDOWN,
    HOLD_SCALING,
    HOLD_WINDOW,
    AutoscalePolicyConfig,
    ElasticEPAutoscaler,
    LoadSample,
    ScaleDecision,
    signals_above,
)

LOGGER = "flotilla.serve.ep_autoscale"


def policy(**overrides):
    values = dict(
        max_ep_size=4,
        waiting_per_rank_threshold=4.0,
        kv_usage_threshold=0.85,
        ttft_p90_threshold_s=2.0,
        window_s=10.0,
        cooldown_s=30.0,
        max_sample_gap_s=5.0,
    )
    return AutoscalePolicyConfig(**{**values, **overrides})


def hot(t, ep=1, **kw):
    """A sample under pressure on the queue alone."""
    return LoadSample(time_s=t, ep_size=ep, waiting=10 * ep, running=8 * ep, kv_usage=0.5, **kw)


def cold(t, ep=1, **kw):
    """A sample with every signal under its threshold."""
    return LoadSample(time_s=t, ep_size=ep, waiting=1, running=4, kv_usage=0.3, ttft_p90_s=0.2, **kw)


def decisions(scaler, samples):
    """(time_s, decision) for every sample that produced a join request."""
    out = []
    for s in samples:
        d = scaler.observe(s)
        if d is not None:
            out.append((s.time_s, d))
    return out


# -- scenarios ---------------------------------------------------------------------


def test_sustained_overload_requests_exactly_one_join_after_one_full_window():
    scaler = ElasticEPAutoscaler(policy(cooldown_s=1000.0))
    got = decisions(scaler, [hot(float(t)) for t in range(0, 100)])
    assert [t for t, _ in got] == [10.0]  # the run spans t=0..10: one full window
    (_, d), = got
    assert d.new_ep_size == 2 and d.request_body() == {"new_ep_size": 2}
    assert "waiting_per_rank above 4 in 11/11 samples" in d.reason
    assert d.inputs["window_samples"] == 11 and d.inputs["window_min"]["waiting_per_rank"] == 10.0
    assert d.inputs["sample"]["time_s"] == 10.0 and d.inputs["policy"]["max_ep_size"] == 4


def test_cooldown_holds_then_a_still_overloaded_deployment_grows_again_up_to_max():
    """Request at 10 (1->2); the join runs 11..14; success at 15; overloaded at EP=2 from
    15, so the window is full by 25, but the cooldown (30 s from the outcome) holds until
    45 (2->3); at 3 == max nothing more, however long the overload lasts."""
    scaler = ElasticEPAutoscaler(policy(max_ep_size=3, window_s=10.0, cooldown_s=30.0))
    got, ep, done_at = [], 1, None
    for t in range(0, 300):
        if done_at is not None and t == done_at:  # the join committed: serving at the new size
            ep, done_at = got[-1][1], None
            scaler.record_outcome(True, t)
        d = scaler.observe(hot(t, ep, scaling=done_at is not None))
        if d is not None:
            got.append((t, d.new_ep_size))
            done_at = t + 5
    assert got == [(10, 2), (45, 3)] and ep == 3


def test_a_failed_join_starts_the_cooldown_too_counted_from_the_outcome():
    scaler = ElasticEPAutoscaler(policy(cooldown_s=30.0))
    got = []
    for t in range(0, 120):
        d = scaler.observe(hot(float(t)))
        if d is not None:
            got.append(t)
        if t == 20:
            scaler.record_outcome(False, 20.0)  # the joiner timed out; still EP=1
    # the request's cooldown alone would end at 40; the failure at 20 holds it until 50
    assert got == [10, 50, 80, 110]


def test_a_request_spends_its_evidence_even_without_a_cooldown():
    """With no cooldown and a driver that never applies the join, each request needs a
    fresh full window of samples taken after the previous one."""
    scaler = ElasticEPAutoscaler(policy(window_s=10.0, cooldown_s=0.0))
    assert [t for t, _ in decisions(scaler, [hot(t) for t in range(0, 40)])] == [10, 21, 32]


def test_light_load_never_scales():
    rng = random.Random(7)
    scaler = ElasticEPAutoscaler(policy(window_s=5.0, cooldown_s=0.0))
    for t in range(2000):
        ep = 2
        sample = LoadSample(
            time_s=t * 0.5, ep_size=ep, waiting=rng.randint(0, 4 * ep), running=rng.randint(0, 16),
            kv_usage=rng.uniform(0.0, 0.85), ttft_p90_s=rng.choice([None, rng.uniform(0.0, 2.0)]),
        )
        assert signals_above(sample, scaler.config) == ()
        assert scaler.observe(sample) is None


@pytest.mark.parametrize("spike_s", [1, 5, 9])
def test_spikes_shorter_than_the_window_never_scale(spike_s):
    scaler = ElasticEPAutoscaler(policy(window_s=10.0, cooldown_s=0.0))
    samples, t = [], 0
    for _ in range(30):
        samples += [hot(t + i) for i in range(spike_s + 1)]  # above for spike_s seconds
        samples.append(cold(t + spike_s + 1))
        t += spike_s + 2
    assert decisions(scaler, samples) == []


def test_one_cold_sample_restarts_the_window():
    scaler = ElasticEPAutoscaler(policy(window_s=10.0))
    samples = [hot(t) for t in range(0, 9)] + [cold(9)] + [hot(t) for t in range(10, 21)]
    assert [t for t, _ in decisions(scaler, samples)] == [20]


def test_signals_may_take_turns_as_long_as_every_sample_is_above_one():
    scaler = ElasticEPAutoscaler(policy(window_s=6.0))
    kinds = [
        dict(waiting=20, kv_usage=0.1, ttft_p90_s=None),
        dict(waiting=0, kv_usage=0.95, ttft_p90_s=0.1),
        dict(waiting=0, kv_usage=0.1, ttft_p90_s=3.0),
    ]
    samples = [LoadSample(time_s=t, ep_size=1, **kinds[t % 3]) for t in range(7)]
    (t, d), = decisions(scaler, samples)
    assert t == 6
    for part in ("waiting_per_rank above 4 in 3/7", "kv_usage above 0.85 in 2/7", "ttft_p90_s above 2 in 2/7"):
        assert part in d.reason


def test_waiting_is_per_rank_and_a_missing_ttft_is_not_a_signal():
    cfg = policy()
    assert signals_above(LoadSample(0, ep_size=2, waiting=8), cfg) == ()  # 4 per rank: not above 4
    assert signals_above(LoadSample(0, ep_size=2, waiting=9), cfg) == ("waiting_per_rank",)
    assert signals_above(LoadSample(0, ep_size=1, ttft_p90_s=None), cfg) == ()
    assert signals_above(LoadSample(0, ep_size=1, ttft_p90_s=2.5, kv_usage=0.9), cfg) == ("kv_usage", "ttft_p90_s")
    off = policy(kv_usage_threshold=None, ttft_p90_threshold_s=None)
    assert signals_above(LoadSample(0, ep_size=1, ttft_p90_s=9.0, kv_usage=1.0), off) == ()


def test_at_max_never_scales_and_says_so_once_per_window(caplog):
    scaler = ElasticEPAutoscaler(policy(max_ep_size=2, window_s=10.0))
    with caplog.at_level(logging.DEBUG, logger=LOGGER):
        assert decisions(scaler, [hot(t, ep=2) for t in range(0, 36)]) == []
    at_max = [r for r in caplog.records if r.ep_autoscale.get("hold") == HOLD_AT_MAX]
    loud = [r.ep_autoscale["sample"]["time_s"] for r in at_max if r.levelno == logging.INFO]
    assert loud == [10, 20, 30]
    assert len(at_max) == 26 and "but ep_size is at max_ep_size=2" in at_max[0].getMessage()
    # memory stays bounded: the window holds only the last window_s of samples
    assert at_max[-1].ep_autoscale["window_samples"] == 11


def test_the_target_is_clamped_to_max():
    scaler = ElasticEPAutoscaler(policy(max_ep_size=4, step=3))
    (_, d), = decisions(scaler, [hot(t, ep=2) for t in range(0, 11)])
    assert d.new_ep_size == 4


def test_no_join_while_scaling_and_a_scale_restarts_the_window():
    scaler = ElasticEPAutoscaler(policy(window_s=10.0))
    assert decisions(scaler, [hot(t, scaling=True) for t in range(0, 50)]) == []
    scaler = ElasticEPAutoscaler(policy(window_s=10.0))
    samples = [hot(t) for t in range(0, 9)] + [hot(9, scaling=True)] + [hot(t) for t in range(10, 21)]
    assert [t for t, _ in decisions(scaler, samples)] == [20]


def test_a_changed_ep_size_or_a_gap_in_the_samples_restarts_the_window():
    scaler = ElasticEPAutoscaler(policy(window_s=10.0, max_sample_gap_s=5.0))
    samples = [hot(t, ep=1) for t in range(0, 6)] + [hot(t, ep=2) for t in range(6, 17)]
    assert [t for t, _ in decisions(scaler, samples)] == [16]
    scaler = ElasticEPAutoscaler(policy(window_s=10.0, max_sample_gap_s=5.0))
    assert decisions(scaler, [hot(t) for t in range(0, 200, 6)]) == []  # every gap is 6 s
    scaler = ElasticEPAutoscaler(policy(window_s=10.0, max_sample_gap_s=5.0))
    assert [t for t, _ in decisions(scaler, [hot(t) for t in range(0, 11, 5)])] == [10]  # 5 s is allowed


def test_a_bounded_synthetic_load_gets_exactly_one_join():
    """A queueing model: 12 requests/s arrive, each DP rank finishes 8/s, a join takes 5 s.
    At EP=1 the queue grows; after one join EP=2 serves 16/s, the queue drains and stays
    empty, so the policy asks for exactly one join although max_ep_size allows three."""
    scaler = ElasticEPAutoscaler(policy(max_ep_size=4, window_s=10.0, cooldown_s=20.0))
    arrival, per_rank, join_s = 12, 8, 5
    ep, queue, joining_until, target, joins = 1, 0, None, None, []
    for t in range(0, 600):
        queue = max(0, queue + arrival - per_rank * ep)
        scaling = joining_until is not None
        sample = LoadSample(time_s=t, ep_size=ep, waiting=queue, running=min(arrival, per_rank * ep),
                            kv_usage=min(1.0, 0.4 + queue / 200), scaling=scaling)
        d = scaler.observe(sample)
        if d is not None:
            joins.append((t, d.new_ep_size))
            joining_until, target = t + join_s, d.new_ep_size
        elif scaling and t >= joining_until:
            ep, joining_until = target, None
            scaler.record_outcome(True, t)
    # the queue first exceeds 4 per rank at t=1 (8 waiting), so the window is full at 11
    assert joins == [(11, 2)] and ep == 2 and queue == 0


def _oracle_first_join(samples, cfg):
    """The first time some run of consecutive above samples, gaps within the limit, spans
    a full window: the rule restated by brute force (one EP size, never scaling)."""
    for i, last in enumerate(samples):
        for j in range(i, -1, -1):
            run = samples[j:i + 1]
            if not all(signals_above(s, cfg) for s in run):
                break
            if any(b.time_s - a.time_s > cfg.max_sample_gap_s for a, b in zip(run, run[1:])):
                break
            if last.time_s - samples[j].time_s >= cfg.window_s:
                return last.time_s
    return None


@pytest.mark.parametrize("seed", range(40))
def test_the_first_join_agrees_with_a_brute_force_oracle_on_random_streams(seed):
    rng = random.Random(seed)
    cfg = policy(window_s=rng.choice([2.0, 5.0, 8.0]), max_sample_gap_s=rng.choice([1.5, 3.0]), cooldown_s=0.0)
    p_hot = rng.choice([0.5, 0.8, 0.95])
    samples, t = [], 0.0
    for _ in range(60):
        t += rng.choice([0.5, 1.0, 1.0, 2.0])
        samples.append(hot(t) if rng.random() < p_hot else cold(t))
    scaler = ElasticEPAutoscaler(cfg)
    got = decisions(scaler, samples)
    assert (got[0][0] if got else None) == _oracle_first_join(samples, cfg)


# -- validation --------------------------------------------------------------------


@pytest.mark.parametrize(
    "field, value",
    [
        ("max_ep_size", 0), ("max_ep_size", 2.0), ("step", 0), ("step", True),
        ("waiting_per_rank_threshold", -1), ("kv_usage_threshold", 0.0), ("kv_usage_threshold", 1.0),
        ("ttft_p90_threshold_s", 0), ("window_s", 0), ("window_s", float("inf")),
        ("cooldown_s", -1.0), ("max_sample_gap_s", float("nan")),
    ],
)
def test_a_bad_config_names_the_field_and_value(field, value):
    with pytest.raises(ValueError, match=rf"AutoscalePolicyConfig\.{field} must be .*\(got {field}={value!r}\)"):
        policy(**{field: value})


def test_a_config_with_every_signal_off_is_refused():
    with pytest.raises(ValueError, match="needs at least one signal"):
        policy(waiting_per_rank_threshold=None, kv_usage_threshold=None, ttft_p90_threshold_s=None)


@pytest.mark.parametrize(
    "field, value",
    [
        ("time_s", float("nan")), ("ep_size", 0), ("waiting", -1), ("running", 1.5),
        ("kv_usage", 1.2), ("kv_usage", -0.1), ("ttft_p90_s", -1.0), ("scaling", 1),
    ],
)
def test_a_bad_sample_names_the_field_and_value(field, value):
    values = dict(time_s=0.0, ep_size=1)
    with pytest.raises(ValueError, match=rf"LoadSample\.{field} must be .*\(got {field}={value!r}\)"):
        LoadSample(**{**values, field: value})


def test_samples_out_of_time_order_are_refused_and_equal_times_accepted():
    scaler = ElasticEPAutoscaler(policy())
    scaler.observe(cold(5.0))
    scaler.observe(cold(5.0))
    with pytest.raises(ValueError, match=r"time_s=4\.0 is older than the previous sample's time_s=5\.0"):
        scaler.observe(cold(4.0))


def test_a_sample_beyond_max_ep_size_is_refused():
    scaler = ElasticEPAutoscaler(policy(max_ep_size=2))
    with pytest.raises(ValueError, match=r"ep_size=3 exceeds max_ep_size=2"):
        scaler.observe(cold(0.0, ep=3))


def test_record_outcome_checks_its_arguments():
    scaler = ElasticEPAutoscaler(policy())
    with pytest.raises(ValueError, match=r"ok must be a bool \(got ok='yes'\)"):
        scaler.record_outcome("yes", 1.0)
    with pytest.raises(ValueError, match=r"time_s must be a finite number"):
        scaler.record_outcome(True, float("inf"))


# -- the decision log --------------------------------------------------------------


def test_every_decision_is_logged_with_its_inputs(caplog):
    scaler = ElasticEPAutoscaler(policy(window_s=3.0, cooldown_s=5.0))
    samples = [cold(0), hot(1), hot(2), hot(3), hot(4), hot(5, scaling=True), hot(6)]
    with caplog.at_level(logging.DEBUG, logger=LOGGER):
        got = decisions(scaler, samples)
        scaler.record_outcome(False, 7.0)
    records = [r for r in caplog.records if r.name == LOGGER]
    assert len(records) == len(samples) + 1  # one per decision, plus the outcome
    holds = [r.ep_autoscale.get("hold") for r in records[:-1]]
    assert holds == ["below_thresholds", HOLD_WINDOW, HOLD_WINDOW, HOLD_WINDOW, None, HOLD_SCALING, HOLD_COOLDOWN]
    assert all(r.levelno == logging.DEBUG for r, h in zip(records, holds) if h is not None)

    scale = records[4]
    (_, d), = got
    assert isinstance(d, ScaleDecision) and scale.levelno == logging.INFO
    assert scale.ep_autoscale is d.inputs and d.inputs["new_ep_size"] == 2
    assert d.inputs["sample"] == {"time_s": 4, "ep_size": 1, "waiting": 10, "running": 8, "kv_usage": 0.5,
                                  "ttft_p90_s": None, "scaling": False}
    assert d.inputs["above"] == ["waiting_per_rank"] and d.inputs["run_start_s"] == 1
    message = scale.getMessage()
    assert "request scale 1 -> 2" in message and "'waiting': 10" in message and "'window_s': 3.0" in message

    outcome = records[-1]
    assert outcome.levelno == logging.WARNING and "scale failed" in outcome.getMessage()
    assert outcome.ep_autoscale == {"ok": False, "time_s": 7.0, "cooldown_until_s": 12.0}
