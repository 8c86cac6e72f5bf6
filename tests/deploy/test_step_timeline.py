"""``benchmarks/dev/step_timeline.py`` on CPU: how it reads a profiler trace (which device
operations a CUDA graph launched, where one decode step ends and the next begins, the busy
and idle time of a step) on hand-built Kineto-style traces. The profiling itself needs a GPU."""

import pytest
from helpers.benchmark_scripts import import_benchmark

timeline = import_benchmark("step_timeline")


def _kernel(name, ts, dur, correlation, cat="kernel", **args):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "args": {"correlation": correlation, **args}}


def _trace():
    """Two steps: a graph replay (correlation 10, then 20) of two kernels, then a copy in and
    an argmax outside the graph; one CPU op that must be ignored."""
    return {
        "traceEvents": [
            {"ph": "X", "cat": "cuda_runtime", "name": "cudaGraphLaunch", "ts": 0, "dur": 5, "args": {"correlation": 10}},
            {"ph": "X", "cat": "cuda_runtime", "name": "cudaGraphLaunch", "ts": 90, "dur": 5, "args": {"correlation": 20}},
            {"ph": "X", "cat": "cpu_op", "name": "aten::argmax", "ts": 1, "dur": 3, "args": {}},
            _kernel("embed", 10, 10, 10),
            _kernel("layer", 22, 40, 10),
            _kernel("argmax", 70, 5, 11),
            _kernel("Memcpy DtoH", 80, 2, 12, cat="gpu_memcpy"),
            _kernel("embed", 100, 10, 20),
            _kernel("layer", 110, 40, 0, **{"graph node id": 7}),
            _kernel("argmax", 155, 5, 21),
        ]
    }


def test_graph_kernels_are_found_by_launch_correlation_or_node_id():
    events = timeline.device_events(_trace())
    assert [e["name"] for e in events] == ["embed", "layer", "argmax", "Memcpy DtoH", "embed", "layer", "argmax"]
    assert [e["graph"] for e in events] == [True, True, False, False, True, True, False]


def test_a_step_is_a_replay_and_the_operations_after_it():
    steps = timeline.split_steps(timeline.device_events(_trace()))
    assert [[e["name"] for e in s] for s in steps] == [
        ["embed", "layer", "argmax", "Memcpy DtoH"],
        ["embed", "layer", "argmax"],
    ]


def test_step_description_splits_the_period_into_graph_outside_and_idle():
    first, _ = timeline.split_steps(timeline.device_events(_trace()))
    described = timeline.describe_step(first, next_start=100)
    assert described["period_us"] == 90
    assert described["graph_us"] == 52  # 10 .. 62
    assert described["outside_busy_us"] == 7
    # busy: 10 + 40 + 5 + 2 = 57 of the 90 us period
    assert described["idle_us"] == pytest.approx(33)
    assert [op["name"] for op in described["outside"]] == ["argmax", "Memcpy DtoH"]
    summary = timeline.summarize([described, described])
    assert summary["outside_ops_us_p50"] == {"Memcpy DtoH": 2, "argmax": 5}
    assert summary["outside_ops_per_step"] == 2
