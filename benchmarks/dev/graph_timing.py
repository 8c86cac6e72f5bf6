"""Timing of GPU work for one-off kernel probes written next to it (the probes that used it,
settled, were removed in 004bdbd; see git history). Short work (kernels of a few
microseconds): ``fn`` captured ``reps`` times into one CUDA graph, the graph replayed, the
mean microseconds of one ``fn`` returned; a graph keeps launch gaps out. Work of a
millisecond or more: ``fn`` launched ``reps`` times between two CUDA events."""

from __future__ import annotations

from typing import Callable

import torch


def replay_us(fn: Callable[[], object], reps: int = 20, replays: int = 10) -> float:
    """Mean microseconds of one ``fn`` over ``replays`` replays of a graph holding ``reps`` calls."""
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        fn()  # NOTE: warm-up outside capture (compiles, allocates)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / (replays * reps)


def events_ms(fn: Callable[[], object], reps: int = 20) -> float:
    """Mean milliseconds of one ``fn`` over ``reps`` back-to-back launches after a warm-up,
    timed with CUDA events (for work long enough that launch gaps do not count)."""
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps
