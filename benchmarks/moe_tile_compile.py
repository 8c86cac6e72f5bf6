"""Parallel Triton compiles for ``moe_tile_probe.py``: a pool of spawned processes, each running
fused-MoE configurations once at the probe's shape so that Triton writes the kernels to its
on-disk cache (``~/.triton/cache`` or ``TRITON_CACHE_DIR``), where the probe's own process then
finds them instead of compiling one at a time.

A configuration compiles to the same cache entry in a worker as in the probe only if every
specialization matches: the same shapes (hence strides), batch size (``num_routes``), dtype,
expert count and PDL setting, which is why a worker runs the real call rather than compiling
from a hand-written signature.
"""

from __future__ import annotations

import importlib
import multiprocessing
import time
import warnings
from concurrent.futures import ProcessPoolExecutor, wait

import torch

_WORKER: dict = {}


def quiet_interpreter() -> None:
    """Silence the interpreter's NaN warnings from padding rows.

    NOTE: padding rows of the kernels' intermediate are never written (``torch.empty``); the
    interpreter multiplies whatever they hold (NaN too) in rows that are never stored.
    """
    warnings.filterwarnings("ignore", category=RuntimeWarning, module="triton.runtime.interpreter")


def _worker_init(dims: tuple[int, int, int, int], dtype_name: str, device: str) -> None:
    importlib.import_module("flotilla.kernels.triton_moe")  # Triton and the kernels, once per process
    quiet_interpreter()
    dev = torch.device(device)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    hidden, inter, experts, top_k = dims
    dtype = getattr(torch, dtype_name)
    w13 = torch.empty(experts, 2 * inter, hidden, dtype=dtype, device=dev).normal_()
    w2 = torch.empty(experts, hidden, inter, dtype=dtype, device=dev).normal_()
    _WORKER.update(dims=dims, dtype=dtype, device=dev, weights=(w13, w2))


def _worker_run(batch: int, config_args: tuple[int, ...]) -> str | None:
    """Run ``MoEConfig(*config_args)`` once at ``batch``; the error text, or None."""
    from flotilla.kernels.triton_moe import MoEConfig, fused_moe_with_config

    hidden, _, experts, top_k = _WORKER["dims"]
    dev = _WORKER["device"]
    x = torch.randn(batch, hidden, device=dev).to(_WORKER["dtype"])
    weights, ids = torch.rand(batch, experts, device=dev).topk(top_k, dim=-1)
    try:
        fused_moe_with_config(x, *_WORKER["weights"], weights, ids, config=MoEConfig(*config_args))
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
    except Exception as exc:  # noqa: BLE001 -- reported; the probe's process meets it again
        return f"{type(exc).__name__}: {str(exc)[:200]}"
    return None


class Precompiler:
    """``precompiler(batch, config_args_list)`` compiles the configurations on ``workers``
    processes and waits for them (at most ``timeout_s``); failures are only counted: the probe
    compiles and checks every configuration again itself."""

    def __init__(self, workers: int, dims: tuple[int, int, int, int], dtype: torch.dtype, device: torch.device,
                 timeout_s: float = 180.0):
        if workers < 1:
            raise ValueError(f"workers must be >= 1, got workers={workers}")
        self.workers = workers
        self.timeout_s = timeout_s
        self.seconds = 0.0
        self.count = 0
        self._done: set[tuple] = set()
        self._pool = ProcessPoolExecutor(
            workers, mp_context=multiprocessing.get_context("spawn"), initializer=_worker_init,
            initargs=(dims, str(dtype).removeprefix("torch."), str(device)),
        )

    def __call__(self, batch: int, configs: list[tuple[int, ...]]) -> None:
        todo = list(dict.fromkeys((batch, args) for args in configs if (batch, args) not in self._done))
        if not todo:
            return
        start = time.monotonic()
        try:
            futures = [self._pool.submit(_worker_run, *job) for job in todo]
            done, pending = wait(futures, timeout=self.timeout_s)
            failed = sum(1 for f in done if f.exception() is not None or f.result() is not None)
        except Exception as exc:  # noqa: BLE001 -- the probe compiles whatever is missing itself
            print(f"  precompile failed ({type(exc).__name__}: {exc}); compiling in the main process", flush=True)
            return
        self._done.update(todo)
        elapsed = time.monotonic() - start
        self.seconds += elapsed
        self.count += len(todo)
        print(f"  precompiled {len(todo)} configs in {elapsed:.1f} s on {self.workers} processes"
              f" ({failed} failed, {len(pending)} timed out)", flush=True)

    def close(self) -> None:
        self._pool.shutdown(cancel_futures=True)
