"""``benchmarks/moe_tile_probe.py`` on CPU: the search logic (``moe_tile_sweep.py``: candidates,
the shared-memory bound, interleaved rounds, statistics and the staged sweep, driven by a cost
model in place of the GPU) and the probe's flags and launch arithmetic. The GPU timing runs on
the device only; the kernels' correctness under every tile is the probe's ``--cpu-smoke``
(Triton's interpreter, which this venv does not have)."""

import random

import pytest
from helpers.benchmark_scripts import import_benchmark

mts = import_benchmark("moe_tile_sweep")
probe = import_benchmark("moe_tile_probe")
Tiles, TilePair = mts.Tiles, mts.TilePair

H200_SMEM = 232448
DEFAULT = TilePair(16, Tiles(64, 128, 4, 4), Tiles(64, 128, 4, 4))  # today's CONFIGS[0]


@pytest.mark.parametrize(
    "kernel,tiles,shared",
    [  # CompiledKernel.metadata.shared of Triton 3.6 sm_90 compiles, BLOCK_M 16, bf16
        ("gate_up", Tiles(64, 128, 4, 4), 110592),
        ("gate_up", Tiles(16, 64, 8, 5), 24576),
        ("gate_up", Tiles(32, 256, 4, 3), 81920),
        ("gate_up", Tiles(128, 256, 2, 2), 139264),
        ("down", Tiles(64, 128, 4, 4), 61440),
        ("down", Tiles(16, 64, 8, 5), 16384),
        ("down", Tiles(32, 256, 4, 3), 49152),
        ("down", Tiles(128, 256, 2, 2), 73728),
    ],
)
def test_shared_bytes_matches_the_compiler(kernel, tiles, shared):
    assert mts.shared_bytes(kernel, 16, tiles) == shared


def test_shared_bytes_names_a_bad_kernel():
    with pytest.raises(ValueError, match="kernel=.*'up'"):
        mts.shared_bytes("up", 16, Tiles(64, 128, 4, 4))


def test_grid_rejects_tiles_tl_dot_cannot_take():
    with pytest.raises(ValueError, match="TileGrid.block_n"):
        mts.TileGrid(block_n=(8, 16))
    with pytest.raises(ValueError, match="TileGrid.warps"):
        mts.TileGrid(warps=())


def test_coarse_candidates_fall_back_to_fewer_stages_where_the_default_does_not_fit():
    grid = mts.TileGrid()
    coarse = mts.coarse_candidates("gate_up", grid, 16, 4, H200_SMEM)
    assert sorted(t.shape for t in coarse) == sorted(
        (bn, bk, w) for bn in grid.block_n for bk in grid.block_k for w in grid.warps
    )
    by_shape = {t.shape: t for t in coarse}
    assert by_shape[(64, 128, 4)].stages == 4  # 110,592 bytes
    assert by_shape[(128, 256, 4)].stages == 2  # 3 stages would take 278,528
    assert all(mts.shared_bytes("gate_up", 16, t) <= H200_SMEM for t in coarse)


def test_stage_candidates_cover_every_fitting_stage_count():
    grid = mts.TileGrid()
    out = mts.stage_candidates("gate_up", [Tiles(64, 128, 4, 4), Tiles(128, 256, 4, 2)], grid, 16, H200_SMEM)
    assert [t.stages for t in out if t.shape == (64, 128, 4)] == [2, 3, 4, 5]
    assert [t.stages for t in out if t.shape == (128, 256, 4)] == [2]


def test_pair_round_trips_moe_config_fields():
    class Config:  # MoEConfig's field names (kernels/triton_moe.py imports Triton)
        block_m, block_n_1, block_k_1, warps_1, stages_1 = 16, 32, 256, 2, 3
        block_n_2, block_k_2, warps_2, stages_2 = 128, 64, 8, 5

    pair = TilePair.from_config(Config)
    assert pair.moe_config_args() == (16, 32, 256, 2, 3, 128, 64, 8, 5)
    assert pair.label == "m16 gu32x256w2s3 dn128x64w8s5"


def test_rounds_measure_everything_each_round_in_new_orders_and_drop_failures():
    calls = []

    def measure(label):
        calls.append(label)
        if label == "bad":
            raise RuntimeError("out of resources")
        return {"base": 10.0, "a": 9.0, "b": 11.0}[label]

    samples, failures = mts.interleaved_rounds(["base", "a", "b", "bad"], measure, 6, seed=1, baseline="base")
    assert set(samples) == {"base", "a", "b"} and all(len(v) == 6 for v in samples.values())
    assert failures == {"bad": "RuntimeError: out of resources"}
    assert calls.count("bad") == 1  # never measured again
    orders = {tuple(calls[i : i + 3]) for i in range(4, len(calls), 3)}
    assert len(orders) > 1  # re-ordered between rounds
    with pytest.raises(ValueError, match="baseline"):
        mts.interleaved_rounds(["a"], measure, 2, seed=1, baseline="base")


def test_summary_pairs_each_sample_with_the_baselines_round():
    drift = [1.0, 1.3, 0.8, 1.1, 1.0]  # the GPU's clock moving between rounds
    samples = {"base": [10.0 * d for d in drift], "fast": [9.0 * d for d in drift]}
    stats = mts.summarize(samples, "base")
    assert stats["fast"].paired_ratio == pytest.approx(0.9)
    assert stats["fast"].median_us == pytest.approx(9.0)
    assert stats["fast"].min_us == pytest.approx(7.2) and stats["fast"].max_us == pytest.approx(11.7)
    assert stats["fast"].spread_pct == pytest.approx(100 * (11.7 - 7.2) / 9.0)
    with pytest.raises(ValueError, match="rounds must align"):
        mts.summarize({"base": [1.0, 2.0], "x": [1.0]}, "base")


GU_BEST = Tiles(32, 128, 4, 3)
DN_BEST = Tiles(16, 256, 2, 5)


def _cost(tiles: Tiles, best: Tiles) -> float:
    """Microseconds of one half: 10% more per step away from ``best`` in each dimension."""
    steps = sum(
        abs(a - b) for a, b in [(tiles.block_n.bit_length(), best.block_n.bit_length()),
                                (tiles.block_k.bit_length(), best.block_k.bit_length()),
                                (tiles.warps.bit_length(), best.warps.bit_length()),
                                (tiles.stages, best.stages)]
    )
    return 10.0 * (1.0 + 0.1 * steps)


class FakeDevice:
    """A GPU whose times follow ``_cost`` with +-2% noise; some tiles the compiler rejects."""

    def __init__(self, rejected=()):
        self.rng = random.Random(0)
        self.rejected = set(rejected)
        self.prepared: list[list[str]] = []
        self.measured: list[str] = []

    def prepare(self, pairs):
        self.prepared.append([p.label for p in pairs])
        return {p.label: "rejected: OutOfResources" for p in pairs if p.gate_up in self.rejected}

    def measure(self, pair):
        self.measured.append(pair.label)
        return (_cost(pair.gate_up, GU_BEST) + _cost(pair.down, DN_BEST)) * self.rng.uniform(0.98, 1.02)


def test_sweep_finds_the_best_pair_and_times_the_default_in_every_stage():
    device = FakeDevice(rejected=[Tiles(16, 64, 2, 4)])
    result = mts.sweep(DEFAULT, mts.TileGrid(), device.prepare, device.measure, rounds=3, smem_limit=H200_SMEM,
                       log=lambda line: None)
    assert result.best == TilePair(16, GU_BEST, DN_BEST)
    assert result.best_stage == "confirm"
    assert list(result.stages) == ["gate_up", "gate_up_stages", "down", "down_stages", "confirm"]
    for name, stats in result.stages.items():
        assert DEFAULT.label in stats, name
        rounds = 6 if name == "confirm" else 3
        assert all(len(s.samples_us) == rounds for s in stats.values()), name
    assert result.rejected == {"m16 gu16x64w2s4 dn64x128w4s4": "rejected: OutOfResources"}
    assert all("gu16x64w2s4" not in label for label in device.measured)
    # gate/up was swept with down at the default, down with gate/up at gate/up's best
    assert all(result.pairs[label].down == DEFAULT.down for label in result.stages["gate_up"])
    down_labels = set(result.stages["down"]) - {DEFAULT.label}
    assert all(result.pairs[label].gate_up == GU_BEST for label in down_labels)
    confirm = result.stages["confirm"]
    assert confirm[result.best.label].paired_ratio < 0.8
    pooled = result.pooled()
    assert pooled[DEFAULT.label]["samples"] == sum(len(s[DEFAULT.label].samples_us) for s in result.stages.values())


def test_sweep_out_of_time_keeps_the_best_of_the_last_stage_run():
    device = FakeDevice()
    stages_started = []

    def out_of_time():
        stages_started.append(None)
        return len(stages_started) > 2  # time for two stages

    result = mts.sweep(DEFAULT, mts.TileGrid(), device.prepare, device.measure, rounds=2, smem_limit=H200_SMEM,
                       out_of_time=out_of_time, log=lambda line: None)
    assert list(result.stages) == ["gate_up", "gate_up_stages"]
    assert result.skipped_stages == ["down", "down_stages", "confirm"]
    assert result.best_stage == "gate_up_stages" and result.best.gate_up == GU_BEST
    assert result.best.down == DEFAULT.down


def test_sweep_stops_when_the_default_itself_fails():
    def prepare(pairs):
        return {DEFAULT.label: "rejected: boom"}

    with pytest.raises(RuntimeError, match="default configuration .* failed: rejected: boom"):
        mts.sweep(DEFAULT, mts.QUICK_GRID, prepare, lambda pair: 1.0, rounds=1, smem_limit=H200_SMEM,
                  log=lambda line: None)


def test_programs_per_kernel_at_decode_batches():
    """Batch 1 at the Qwen3-30B-A3B shape: 8 routes in 8 row blocks of 16; gate/up has 768/64
    column tiles (96 programs on the H200's 132 SMs), down 2048/64."""
    shape = probe.QWEN3_30B_A3B
    assert probe.programs(DEFAULT, shape, 1) == {"gate_up": 96, "down": 256}
    narrow = TilePair(16, Tiles(16, 128, 4, 4), Tiles(32, 128, 4, 4))
    assert probe.programs(narrow, shape, 1) == {"gate_up": 384, "down": 512}
    assert probe.programs(DEFAULT, shape, 4) == {"gate_up": 32 * 12, "down": 32 * 32}


def test_flags_are_checked():
    with pytest.raises(SystemExit):
        probe.parse_args(["--rounds", "0"])
    with pytest.raises(SystemExit):
        probe.parse_args(["--batches", "1,x"])
    with pytest.raises(ValueError, match="--top-k=9 must not exceed --experts=8"):
        probe.Shape(hidden=64, intermediate=64, experts=8, top_k=9)
    opts = probe.parse_args(["--cpu-smoke", "--batches", "1,2"])
    run = probe.Run.resolve(opts)
    assert (run.shape, run.grid, run.workers, run.rounds, run.layers) == (probe.SMOKE_SHAPE, mts.QUICK_GRID, 0, 2, 2)
    assert str(run.dtype) == "torch.float16"  # the interpreter's bf16 tl.dot is wrong


def test_probe_refuses_to_run_without_what_it_needs(monkeypatch, capsys):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert probe.main(["--cpu-smoke"]) == 2
    assert "TRITON_INTERPRET=1" in capsys.readouterr().err
    monkeypatch.setattr(probe.torch.cuda, "is_available", lambda: False)
    assert probe.main([]) == 2
    assert "needs a GPU" in capsys.readouterr().err


def test_the_check_passes_rounding_and_catches_a_wrong_tile():
    """One bf16 rounding of every element passes; a missed column tile, a doubled K block or
    a NaN fails (what a wrong tile configuration would produce)."""
    torch = probe.torch
    bench = import_benchmark("moe_tile_bench")
    want = torch.randn(4, 256, generator=torch.Generator().manual_seed(0))
    assert bench.compare(want.to(torch.bfloat16), want)[0]
    missed = want.clone()
    missed[:, 64:128] = 0.0  # one BLOCK_N=64 column tile never stored
    ok, rel, worst = bench.compare(missed, want)
    assert not ok and rel > 0.3 and worst > 1.0
    doubled = want * 1.25  # a quarter of K summed twice, roughly
    assert not bench.compare(doubled, want)[0]
    nan = want.clone()
    nan[0, 0] = float("nan")
    assert not bench.compare(nan, want)[0]
