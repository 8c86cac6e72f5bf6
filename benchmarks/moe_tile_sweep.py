"""The search logic of ``moe_tile_probe.py``, without torch or Triton: tile candidates, the
shared-memory bound that prunes them, interleaved timing rounds, robust statistics and the
staged sweep (gate/up tiles, then down tiles, then the best pairs confirmed).

A *pair* is one fused-MoE launch configuration: ``BLOCK_M`` and the tiles of the gate/up and
down kernels (``MoEConfig`` of ``kernels/triton_moe.py``, field for field). The sweep never
times a configuration once: every stage measures all its pairs once per round, in a new random
order each round, the default pair in every round, and ranks pairs by their median.
"""

from __future__ import annotations

import itertools
import random
import statistics
from dataclasses import dataclass, field
from typing import Callable, Iterable

KERNELS = ("gate_up", "down")


@dataclass(frozen=True, order=True)
class Tiles:
    """One kernel's launch: output tile width, reduction step, warps, pipeline stages."""

    block_n: int
    block_k: int
    warps: int
    stages: int

    @property
    def label(self) -> str:
        return f"{self.block_n}x{self.block_k}w{self.warps}s{self.stages}"

    @property
    def shape(self) -> tuple[int, int, int]:
        """Everything but the stages (the coarse sweep's key)."""
        return (self.block_n, self.block_k, self.warps)


@dataclass(frozen=True, order=True)
class TilePair:
    """A whole fused-MoE configuration: ``MoEConfig(*pair.moe_config_args())``."""

    block_m: int
    gate_up: Tiles
    down: Tiles

    @property
    def label(self) -> str:
        return f"m{self.block_m} gu{self.gate_up.label} dn{self.down.label}"

    def moe_config_args(self) -> tuple[int, ...]:
        """``MoEConfig``'s fields in order (block_m, then gate/up's four, then down's four)."""
        g, d = self.gate_up, self.down
        return (self.block_m, g.block_n, g.block_k, g.warps, g.stages, d.block_n, d.block_k, d.warps, d.stages)

    @classmethod
    def from_config(cls, config) -> "TilePair":
        """The pair of a ``MoEConfig`` (any object with its field names)."""
        return cls(
            config.block_m,
            Tiles(config.block_n_1, config.block_k_1, config.warps_1, config.stages_1),
            Tiles(config.block_n_2, config.block_k_2, config.warps_2, config.stages_2),
        )

    def with_half(self, kernel: str, tiles: Tiles) -> "TilePair":
        """This pair with ``kernel``'s tiles replaced."""
        if kernel == "gate_up":
            return TilePair(self.block_m, tiles, self.down)
        return TilePair(self.block_m, self.gate_up, tiles)

    def half(self, kernel: str) -> Tiles:
        return self.gate_up if kernel == "gate_up" else self.down


@dataclass(frozen=True)
class TileGrid:
    """The values each tile dimension may take (the same for both kernels)."""

    block_n: tuple[int, ...] = (16, 32, 64, 128)
    block_k: tuple[int, ...] = (64, 128, 256)
    warps: tuple[int, ...] = (2, 4, 8)
    stages: tuple[int, ...] = (2, 3, 4, 5)

    def __post_init__(self) -> None:
        for name in ("block_n", "block_k", "warps", "stages"):
            values = getattr(self, name)
            if not values or any(not isinstance(v, int) or v < 1 for v in values):
                raise ValueError(f"TileGrid.{name} must be a non-empty tuple of positive ints, got {values!r}")
        for name in ("block_n", "block_k"):
            if any(v < 16 or v & (v - 1) for v in getattr(self, name)):
                raise ValueError(f"TileGrid.{name} must hold powers of two >= 16 (tl.dot), got {getattr(self, name)!r}")


QUICK_GRID = TileGrid(block_n=(32, 64), block_k=(128,), warps=(4,), stages=(3, 4))


def shared_bytes(kernel: str, block_m: int, tiles: Tiles, elem_bytes: int = 2) -> int:
    """Shared memory the Triton 3.6 pipeliner gives one program of ``kernel`` on sm_90.

    One buffer per stage past the first, each holding the activation tile and the weight
    tile(s) (gate/up loads two weight tiles per step). Checked against
    ``CompiledKernel.metadata.shared`` of offline sm_90 compiles of both kernels (pointers and
    strides specialized as the JIT does) over the whole default grid at ``BLOCK_M`` 16: 288
    configurations, all equal. ``stages`` 1 (no pipelining) is over-estimated by one activation tile.
    """
    if kernel not in KERNELS:
        raise ValueError(f"kernel must be one of {KERNELS}, got kernel={kernel!r}")
    weight_tiles = 2 if kernel == "gate_up" else 1
    per_stage = (block_m * tiles.block_k + weight_tiles * tiles.block_k * tiles.block_n) * elem_bytes
    return max(tiles.stages - 1, 1) * per_stage


def fits(kernel: str, block_m: int, tiles: Tiles, smem_limit: int) -> bool:
    return shared_bytes(kernel, block_m, tiles) <= smem_limit


def coarse_candidates(kernel: str, grid: TileGrid, block_m: int, stages: int, smem_limit: int) -> list[Tiles]:
    """Every (block_n, block_k, warps) of ``grid``, each at ``stages`` or, where that does
    not fit in ``smem_limit``, the most stages of the grid below it that do (shapes that fit
    with none are left out)."""
    out = []
    for bn, bk, warps in itertools.product(grid.block_n, grid.block_k, grid.warps):
        for s in sorted({stages, *(s for s in grid.stages if s < stages)}, reverse=True):
            tiles = Tiles(bn, bk, warps, s)
            if fits(kernel, block_m, tiles, smem_limit):
                out.append(tiles)
                break
    return out


def stage_candidates(kernel: str, shapes: Iterable[Tiles], grid: TileGrid, block_m: int, smem_limit: int) -> list[Tiles]:
    """Each of ``shapes`` at every stage count of ``grid`` that fits (plus the tiles themselves)."""
    out: list[Tiles] = []
    for base in shapes:
        for s in sorted({base.stages, *grid.stages}):
            tiles = Tiles(base.block_n, base.block_k, base.warps, s)
            if fits(kernel, block_m, tiles, smem_limit) and tiles not in out:
                out.append(tiles)
    return out


@dataclass(frozen=True)
class Stats:
    """One pair's samples in one stage (microseconds per MoE call)."""

    median_us: float
    min_us: float
    max_us: float
    spread_pct: float  # (max - min) / median
    paired_ratio: float  # median over rounds of (this sample / the default's sample in that round)
    samples_us: tuple[float, ...]

    def as_dict(self) -> dict:
        return {
            "median_us": round(self.median_us, 3),
            "min_us": round(self.min_us, 3),
            "max_us": round(self.max_us, 3),
            "spread_pct": round(self.spread_pct, 2),
            "paired_ratio_to_default": round(self.paired_ratio, 4),
            "samples_us": [round(s, 3) for s in self.samples_us],
        }


def summarize(samples: dict[str, list[float]], baseline: str) -> dict[str, Stats]:
    """Median, range and spread of each label's samples, and its paired ratio to ``baseline``
    (round ``r``'s sample over the baseline's round-``r`` sample, median over rounds): slow
    drift of the GPU's clock cancels in the ratio."""
    if baseline not in samples:
        raise ValueError(f"baseline={baseline!r} has no samples")
    base = samples[baseline]
    out = {}
    for label, values in samples.items():
        if len(values) != len(base):
            raise ValueError(f"{label!r} has {len(values)} samples, the baseline {len(base)}: rounds must align")
        med = statistics.median(values)
        out[label] = Stats(
            median_us=med,
            min_us=min(values),
            max_us=max(values),
            spread_pct=100.0 * (max(values) - min(values)) / med if med > 0 else 0.0,
            paired_ratio=statistics.median(v / b for v, b in zip(values, base)),
            samples_us=tuple(values),
        )
    return out


def interleaved_rounds(
    labels: list[str],
    measure: Callable[[str], float],
    rounds: int,
    seed: int,
    baseline: str,
) -> tuple[dict[str, list[float]], dict[str, str]]:
    """``rounds`` rounds, each measuring every label once, in a fresh random order per round.

    Returns ``(samples, failures)``: ``samples[label][r]`` is round ``r``'s value; a label whose
    measurement raises is dropped from all rounds and reported in ``failures`` (the baseline
    failing raises: nothing could be compared).
    """
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got rounds={rounds}")
    if baseline not in labels:
        raise ValueError(f"the baseline {baseline!r} must be measured in every round")
    rng = random.Random(seed)
    samples: dict[str, list[float]] = {label: [] for label in labels}
    failures: dict[str, str] = {}
    for _ in range(rounds):
        order = [label for label in labels if label not in failures]
        rng.shuffle(order)
        for label in order:
            try:
                samples[label].append(float(measure(label)))
            except Exception as exc:  # noqa: BLE001 -- a config failing at run time is reported, not fatal
                if label == baseline:
                    raise
                failures[label] = f"{type(exc).__name__}: {str(exc)[:200]}"
    return {k: v for k, v in samples.items() if k not in failures}, failures


@dataclass
class SweepResult:
    """What :func:`sweep` found for one batch size."""

    default: TilePair
    stages: dict[str, dict[str, Stats]] = field(default_factory=dict)
    pairs: dict[str, TilePair] = field(default_factory=dict)  # label -> pair, of everything prepared
    rejected: dict[str, str] = field(default_factory=dict)  # label -> why it was not timed
    skipped_stages: list[str] = field(default_factory=list)
    best: TilePair | None = None
    best_stage: str | None = None

    def pooled(self) -> dict[str, dict[str, float]]:
        """Each label's median/min/max over all its samples of all stages."""
        pooled: dict[str, list[float]] = {}
        for stats in self.stages.values():
            for label, s in stats.items():
                pooled.setdefault(label, []).extend(s.samples_us)
        return {
            label: {"median_us": round(statistics.median(v), 3), "min_us": round(min(v), 3),
                    "max_us": round(max(v), 3), "samples": len(v)}
            for label, v in sorted(pooled.items(), key=lambda item: statistics.median(item[1]))
        }


def rank_half(stats: dict[str, Stats], pairs: dict[str, TilePair], kernel: str, other: Tiles) -> list[Tiles]:
    """``kernel``'s tiles ranked by median, among the pairs whose other kernel runs ``other``."""
    rows = []
    for label, s in stats.items():
        pair = pairs[label]
        other_half = pair.down if kernel == "gate_up" else pair.gate_up
        if other_half == other:
            rows.append((s.median_us, pair.half(kernel)))
    return [tiles for _, tiles in sorted(rows)]


def sweep(
    default: TilePair,
    grid: TileGrid,
    prepare: Callable[[list[TilePair]], dict[str, str]],
    measure: Callable[[TilePair], float],
    *,
    rounds: int,
    smem_limit: int,
    refine_top: int = 4,
    confirm_top: int = 3,
    seed: int = 0,
    out_of_time: Callable[[], bool] = lambda: False,
    log: Callable[[str], None] = print,
) -> SweepResult:
    """The staged search for one batch size.

    1. ``gate_up``: every gate/up tile shape at the default's stage count (down at the default);
    2. ``gate_up_stages``: the ``refine_top`` best shapes at every stage count;
    3. ``down``: every down tile shape, gate/up at the best of step 2;
    4. ``down_stages``: the ``refine_top`` best down shapes at every stage count;
    5. ``confirm``: the ``confirm_top`` best of each half crossed, plus each best half alone
       with the other at the default, over twice the rounds; its fastest pair is ``best``.

    ``prepare(pairs)`` readies pairs for timing (compile, check, capture) and returns
    ``{label: reason}`` for those that cannot be timed; ``measure(pair)`` returns one sample in
    microseconds per call. A stage starts only while ``out_of_time()`` is false; the ones left
    are listed in ``skipped_stages`` and the best comes from the last stage that ran.
    """
    result = SweepResult(default=default)
    stage_no = itertools.count()

    def run_stage(name: str, pairs: list[TilePair], n_rounds: int) -> dict[str, Stats] | None:
        index = next(stage_no)
        if out_of_time():
            result.skipped_stages.append(name)
            log(f"  [{name}] skipped: out of time")
            return None
        unique = list(dict.fromkeys([default, *pairs]))
        for pair in unique:
            result.pairs[pair.label] = pair
        errors = prepare(unique)
        result.rejected.update(errors)
        if default.label in errors:
            raise RuntimeError(f"the default configuration {default.label} failed: {errors[default.label]}")
        usable = {p.label: p for p in unique if p.label not in errors}
        log(f"  [{name}] {len(usable)} configs x {n_rounds} rounds ({len(errors)} rejected)")
        samples, failures = interleaved_rounds(
            list(usable), lambda label: measure(usable[label]), n_rounds, seed * 1000 + index, default.label
        )
        result.rejected.update(failures)
        stats = summarize(samples, default.label)
        result.stages[name] = stats
        base = stats[default.label]
        for label, s in sorted(stats.items(), key=lambda item: item[1].median_us)[:5]:
            log(f"    {s.median_us:8.2f} us (min {s.min_us:.2f}, max {s.max_us:.2f}, x{s.paired_ratio:.3f})  {label}")
        log(f"    default {base.median_us:.2f} us (spread {base.spread_pct:.1f}%)")
        if stats:
            fastest = min(stats, key=lambda label: stats[label].median_us)
            result.best, result.best_stage = usable[fastest], name
        return stats

    top: dict[str, list[Tiles]] = {}
    for kernel in KERNELS:
        base_half = default.half(kernel)
        # NOTE: gate/up is swept with down at the default; down with gate/up at gate/up's best.
        anchor = default if kernel == "gate_up" else default.with_half("gate_up", top["gate_up"][0])
        other = anchor.down if kernel == "gate_up" else anchor.gate_up
        coarse = coarse_candidates(kernel, grid, default.block_m, base_half.stages, smem_limit)
        stats = run_stage(kernel, [anchor.with_half(kernel, t) for t in coarse], rounds)
        ranked = rank_half(stats, result.pairs, kernel, other) if stats else []
        refined = stage_candidates(kernel, ranked[:refine_top], grid, default.block_m, smem_limit)
        if ranked:
            stats2 = run_stage(f"{kernel}_stages", [anchor.with_half(kernel, t) for t in refined], rounds)
        else:  # the coarse stage did not run
            stats2 = None
            result.skipped_stages.append(f"{kernel}_stages")
        if stats2:
            ranked = rank_half(stats2, result.pairs, kernel, other)
        top[kernel] = ranked[:confirm_top] or [base_half]

    best_gu, best_dn = top["gate_up"][0], top["down"][0]
    confirm = [TilePair(default.block_m, g, d) for g, d in itertools.product(top["gate_up"], top["down"])]
    confirm += [default.with_half("gate_up", best_gu), default.with_half("down", best_dn)]
    run_stage("confirm", confirm, 2 * rounds)
    return result
