"""``benchmarks/dev/phase_profile.py`` on CPU: the device-idle accounting it reports for a phase,
on hand-built device operations (the profiling itself needs a GPU)."""

import pytest
from helpers.benchmark_scripts import import_benchmark

phase_profile = import_benchmark("phase_profile")


def _op(start, end):
    return {"name": "k", "start": start, "end": end, "graph": False}


def test_idle_is_the_span_no_operation_covers():
    # 0-10 busy, 10-15 idle, 15-30 busy by two overlapping ops (counted once), 30-40 idle, 40-50 busy.
    events = [_op(0, 10), _op(15, 25), _op(20, 30), _op(40, 50)]
    span, idle = phase_profile.device_idle(events)
    assert span == pytest.approx(50e-6)
    assert idle == pytest.approx(15e-6)


def test_an_operation_inside_another_adds_no_busy_time():
    span, idle = phase_profile.device_idle([_op(0, 100), _op(10, 20), _op(120, 130)])
    assert (span, idle) == (pytest.approx(130e-6), pytest.approx(20e-6))


def test_no_operations_is_no_span():
    assert phase_profile.device_idle([]) == (0.0, 0.0)
