"""Per-call time of the greedy argmax: ``torch.argmax`` (a memset and a reduce) against
``kernels/triton_argmax.greedy_argmax`` (one launch), on float32 logits ``[B, V]``.

    python benchmarks/argmax_probe.py [--vocab 151936] [--rows 1 2 4 8] [--json OUT]

For each size it first checks the indices are equal (a tie across programs planted), then
prints two times per call: ``graph_us``, the calls captured back to back in a CUDA graph (device
time, launch gaps hidden), and ``eager_us``, the calls launched back to back from Python, as
the sampler runs them after the decode graph (launch cost and gaps included). Needs a CUDA GPU.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from flotilla.deploy.bench_env import write_result
from graph_timing import replay_us  # benchmarks/graph_timing.py (run as a script from here)


def eager_us(fn, calls: int = 2000) -> float:
    """Mean microseconds of one ``fn`` over ``calls`` back-to-back eager calls (wall clock)."""
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1e6 / calls


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--json", type=Path)
    opts = parser.parse_args(argv)
    from flotilla.kernels.triton_argmax import BLOCK, greedy_argmax, launch_shape

    results = []
    for rows in opts.rows:
        iters, parts = launch_shape(rows, opts.vocab)
        logits = torch.randn(rows, opts.vocab, device="cuda")
        boundary = iters * BLOCK if parts > 1 else 1
        logits[:, boundary - 1 : boundary + 1] = 10.0  # NOTE: a tie across the first programs' boundary
        assert torch.equal(greedy_argmax(logits), logits.argmax(dim=-1)), f"B={rows}: indices differ"
        row = {"rows": rows, "vocab": opts.vocab, "programs": rows * parts, "blocks_per_program": iters}
        for name, fn in (("torch", lambda: logits.argmax(dim=-1)), ("triton", lambda: greedy_argmax(logits))):
            row[f"{name}_graph_us"] = replay_us(fn, reps=50)
            row[f"{name}_eager_us"] = eager_us(fn)
        results.append(row)
        print(
            f"B={rows} V={opts.vocab} programs={row['programs']}: graph torch {row['torch_graph_us']:.2f} "
            f"triton {row['triton_graph_us']:.2f} us; eager torch {row['torch_eager_us']:.2f} "
            f"triton {row['triton_eager_us']:.2f} us"
        )
    if opts.json:
        write_result(opts.json, {"device": torch.cuda.get_device_name(), "results": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
