"""The timing harness of ``moe_tile_probe.py`` for one batch size: inputs (random expert
weights, routings with distinct experts per token), the correctness check of a configuration
(against the default's output and the float32 torch reference), its CUDA graph of ``layers``
chained MoE calls, and samples of microseconds per call from graph replays (eager wall-clock
time where there are no graphs: the CPU smoke under Triton's interpreter).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from moe_tile_sweep import TilePair  # benchmarks/ (the probe runs as a script)

# Tolerances (tests/gpu/test_triton_moe.py's): relative norm error, and every element within
# ELEM_TOL * (|want| + max|want| / 4). Against the default, a correct configuration differs only
# in the float32 summation order over K, which can move the one rounding of the 16-bit
# intermediate or output by an ulp (2^-8 relative in bf16) on a few elements; against the
# float32 reference those two roundings are the whole error. A wrong tile (columns or K blocks
# missed or doubled) is off by O(1).
REL_NORM_TOL = 1e-2
ELEM_TOL = 2e-2
KERNEL_NAMES = ("_route_kernel", "_gate_up_kernel", "_down_kernel", "_sum_routes_kernel")


@dataclass(frozen=True)
class Shape:
    """The experts of one MoE layer."""

    hidden: int
    intermediate: int
    experts: int
    top_k: int

    def __post_init__(self) -> None:
        for name in ("hidden", "intermediate", "experts", "top_k"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be a positive integer, got {value!r}")
        if self.top_k > self.experts:
            raise ValueError(f"--top-k={self.top_k} must not exceed --experts={self.experts}")

    def expert_bytes(self, elem_bytes: int) -> int:
        """One expert's gate, up and down projections."""
        return 3 * self.hidden * self.intermediate * elem_bytes


QWEN3_30B_A3B = Shape(hidden=2048, intermediate=768, experts=128, top_k=8)
SMOKE_SHAPE = Shape(hidden=256, intermediate=256, experts=16, top_k=4)


def make_weights(shape: Shape, dtype: torch.dtype, device: torch.device, seed: int):
    """Random ``(w13 [E, 2I, H], w2 [E, H, I])``, scaled so activations stay O(1)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    e, h, i = shape.experts, shape.hidden, shape.intermediate
    w13 = torch.empty(e, 2 * i, h, dtype=dtype, device=device).normal_(0.0, h**-0.5, generator=gen)
    w2 = torch.empty(e, h, i, dtype=dtype, device=device).normal_(0.0, i**-0.5, generator=gen)
    return w13, w2


def make_routing(batch: int, shape: Shape, device: torch.device, gen: torch.Generator):
    """``(topk_weights [T, k] float32 summing to 1, topk_ids [T, k] int64)``: distinct experts per token."""
    scores = torch.rand(batch, shape.experts, device=device, generator=gen)
    weights, ids = scores.topk(shape.top_k, dim=-1)
    return weights / weights.sum(dim=-1, keepdim=True), ids


def compare(got: torch.Tensor, want: torch.Tensor) -> tuple[bool, float, float]:
    """``(ok, relative norm error, worst |got - want| / element bound)`` under the tolerances above."""
    diff = (got.float() - want.float()).abs()
    want_abs = want.float().abs()
    rel = (diff.norm() / want_abs.norm().clamp(min=1e-12)).item()
    worst = (diff / (ELEM_TOL * (want_abs + want_abs.max() / 4)).clamp(min=1e-30)).max().item()
    finite = bool(torch.isfinite(got).all())
    return finite and rel < REL_NORM_TOL and worst <= 1.0, rel, worst


def moe_config(pair: TilePair):
    from flotilla.kernels.triton_moe import MoEConfig

    return MoEConfig(*pair.moe_config_args())


# --------------------------------------------------------------------------- one batch size


class BatchBench:
    """One batch size's inputs, and the check, capture and timing of configurations on them.

    ``graphs`` False (the CPU smoke): a sample is the wall-clock time of the calls run eagerly.
    """

    def __init__(self, shape: Shape, weight_sets: list, batch: int, layers: int, replays: int,
                 dtype: torch.dtype, device: torch.device, graphs: bool, seed: int):
        from flotilla.kernels.triton_moe import pick_config

        self.shape, self.batch, self.layers, self.replays, self.graphs = shape, batch, layers, replays, graphs
        self.device = device
        gen = torch.Generator(device=device).manual_seed(seed + batch)
        self.x = torch.randn(batch, shape.hidden, device=device, generator=gen).to(dtype)
        self.routing = [make_routing(batch, shape, device, gen) for _ in range(layers)]
        self.sets = [weight_sets[layer % len(weight_sets)] for layer in range(layers)]
        self.default = TilePair.from_config(pick_config(batch * shape.top_k, shape.experts))
        self.errors: dict[str, str] = {}
        # label -> (rel err, worst element ratio) against the default's output, and rel err against the reference
        self.checks: dict[str, tuple[float, float, float]] = {}
        self._captured: dict[str, torch.cuda.CUDAGraph] = {}
        self._ready: set[str] = set()
        unique = [len(torch.unique(ids)) for _, ids in self.routing]
        self.unique_experts_per_call = sum(unique) / layers
        self.weight_bytes_per_call = self.unique_experts_per_call * shape.expert_bytes(self.x.element_size())
        self.reference = self._reference()
        self.default_out = self._call(self.default, 0, self.x)
        ok, rel, worst = compare(self.default_out, self.reference)
        if not ok:
            raise RuntimeError(
                f"batch {batch}: the default {self.default.label} disagrees with the torch reference "
                f"(rel_norm_err={rel:.2e}, worst element at {worst:.2f}x its bound): nothing here can be trusted"
            )
        self.default_vs_reference = {"rel_norm_err": rel, "worst_elem_ratio": worst}

    def _call(self, pair: TilePair, layer: int, x: torch.Tensor) -> torch.Tensor:
        from flotilla.kernels.triton_moe import fused_moe_with_config

        w13, w2 = self.sets[layer]
        weights, ids = self.routing[layer]
        return fused_moe_with_config(x, w13, w2, weights, ids, config=moe_config(pair))

    def _run_layers(self, pair: TilePair) -> torch.Tensor:
        x = self.x
        for layer in range(self.layers):
            x = self._call(pair, layer, x)
        return x

    def _reference(self) -> torch.Tensor:
        """Layer 0's output by the float32 torch reference, on the experts it uses only."""
        from flotilla.kernels.moe import fused_moe as torch_fused_moe

        w13, w2 = self.sets[0]
        weights, ids = self.routing[0]
        used, local_ids = torch.unique(ids, return_inverse=True)
        return torch_fused_moe(self.x.float(), w13[used].float(), w2[used].float(), weights, local_ids)

    def prepare(self, pairs: list[TilePair], precompile=None) -> dict[str, str]:
        """Compile, check (against the default's output and the reference) and capture each new
        pair; returns ``{label: why it cannot be timed}`` for ``pairs``."""
        new = [p for p in pairs if p.label not in self._ready and p.label not in self.errors]
        if precompile is not None and new:
            precompile(self.batch, [p.moe_config_args() for p in new])
        for pair in new:
            try:
                got = self._call(pair, 0, self.x)
            except Exception as exc:  # noqa: BLE001 -- the compiler refusing a tile is a result
                self.errors[pair.label] = f"rejected: {type(exc).__name__}: {str(exc)[:200]}"
                continue
            ok, rel, worst = compare(got, self.default_out)
            ok_ref, rel_ref, worst_ref = compare(got, self.reference)
            self.checks[pair.label] = (rel, worst, rel_ref)
            if not (ok and ok_ref):
                self.errors[pair.label] = (
                    f"wrong output: against the default rel_norm_err={rel:.2e}, worst element {worst:.2f}x its bound;"
                    f" against the torch reference {rel_ref:.2e}, {worst_ref:.2f}x"
                )
                continue
            if self.graphs:
                try:
                    self._capture(pair)
                except Exception as exc:  # noqa: BLE001
                    self.errors[pair.label] = f"capture failed: {type(exc).__name__}: {str(exc)[:200]}"
                    continue
            self._ready.add(pair.label)
        return {p.label: self.errors[p.label] for p in pairs if p.label in self.errors}

    def _capture(self, pair: TilePair) -> None:
        self._run_layers(pair)  # NOTE: every launch once outside capture (Triton loads the kernels)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            self._run_layers(pair)
        graph.replay()
        torch.cuda.synchronize()
        self._captured[pair.label] = graph

    def measure(self, pair: TilePair) -> float:
        """One sample: microseconds per MoE call."""
        if not self.graphs:
            start = time.perf_counter()
            self._run_layers(pair)
            return (time.perf_counter() - start) * 1e6 / self.layers
        graph = self._captured[pair.label]
        graph.replay()  # NOTE: untimed; the events below follow it in stream order
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(self.replays):
            graph.replay()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) * 1e3 / (self.replays * self.layers)

    def warm_up(self, seconds: float) -> None:
        """Replay the default's graph for ``seconds`` (clocks up before the first stage)."""
        if not self.graphs:
            return
        self.prepare([self.default])
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            self.measure(self.default)

    def kernel_us(self, pair: TilePair, replays: int = 3) -> dict[str, float] | str:
        """Each kernel's mean duration per MoE call inside the pair's graph (torch profiler).
        With programmatic dependent launch a kernel starts before the one before it ends and
        waits, so the durations may add up past the time per call."""
        if not self.graphs or pair.label not in self._captured:
            return "unavailable"
        try:
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(replays):
                    self._captured[pair.label].replay()
                torch.cuda.synchronize()
            out: dict[str, float] = {}
            for evt in prof.key_averages():
                name = next((k for k in KERNEL_NAMES if k in evt.key), None)
                if name:
                    total = getattr(evt, "device_time_total", 0) or getattr(evt, "cuda_time_total", 0)
                    out[name] = round(out.get(name, 0.0) + total / (replays * self.layers), 3)
            return out or "no kernels recorded (the profiler saw none inside the graph)"
        except Exception as exc:  # noqa: BLE001 -- optional numbers; never lose the sweep for them
            return f"unavailable: {type(exc).__name__}: {str(exc)[:200]}"

    def release(self) -> None:
        self._captured.clear()
