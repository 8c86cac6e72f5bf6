"""`flotilla bench latency` / `offline` on a tiny random Llama on CPU (the JSON's structure and
arithmetic), the bundled model shapes (they resolve for an H200, and have the published
parameter counts), the roofline's byte model, and the HF peer script on CPU."""

import json
import math
from types import SimpleNamespace

import pytest

from flotilla.cluster.models.dummy_weights import hf_tensor_shapes
from flotilla.deploy.bench import shape_config, shape_names
from flotilla.deploy.bench_roofline import WeightBytes, expected_distinct_experts
from flotilla.deploy.bench_breakdown import HOST_PHASES, PhaseClock, decode_breakdown, time_graph_replay
from flotilla.deploy.bench_run import StepClock, StepRecord, percentile, step_windows
from flotilla.deploy.cli import main
from flotilla.resolution import ModelFacts, ServerArgs, resolve
from flotilla.resolution.platform import PRESETS
from helpers.benchmark_scripts import import_benchmark
from helpers.resolution_configs import LLAMA_128K

TINY = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
    "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2, "vocab_size": 256,
    "max_position_embeddings": 512, "torch_dtype": "float32", "tie_word_embeddings": False,
}  # fmt: skip
# float32 on CPU: 2 layers x (K, V) x 2 KV heads x head dim 16 x 4 bytes.
TINY_KV_BYTES_PER_TOKEN = 2 * 2 * 2 * 16 * 4
COPY_BYTES = str(32 * 2**20)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("bench-tiny")
    (path / "config.json").write_text(json.dumps(TINY))
    return path


def _ordered(stats):
    assert stats["min"] <= stats["p50"] <= stats["p90"] <= stats["max"], stats
    assert stats["min"] <= stats["mean"] <= stats["max"], stats


def _check_common(data, weights_per_step_rows):
    bw = data["bandwidth"]
    assert bw["peak_bytes_per_s"] == pytest.approx(2 * bw["buffer_bytes"] * bw["iters"] / bw["seconds"])
    params = sum(math.prod(s) for s in hf_tensor_shapes(TINY).values())
    w = data["weights"]
    assert data["weight_dtype"] == "float32" and w["element_size"] == 4
    assert w["total"] == 4 * params and w["dense"] + w["embedding"] == w["total"] and w["embedding_row"] == 64 * 4
    assert (w["moe_layers"], w["expert"], data["model"]["params"]) == (0, 0, params)
    assert data["kv_bytes_per_token"] == TINY_KV_BYTES_PER_TOKEN and data["devices"] == 1
    roof = data["flotilla"]["roofline"]
    assert 0 < roof["mbu"] < 1.5 and roof["mbu"] < roof["mbu_embedding_counted"]
    # NOTE: a decode step of B sequences reads the dense weights and B embedding rows.
    assert roof["weight_bytes_per_step_mean"] == pytest.approx(w["dense"] + weights_per_step_rows * w["embedding_row"])
    per_step = roof["weight_bytes_per_step_mean"] + roof["kv_bytes_per_step_mean"]
    assert roof["bytes_per_step_mean"] == pytest.approx(per_step)
    expected = roof["bytes_per_step_mean"] * roof["decode_steps"] / roof["decode_seconds"] / bw["peak_bytes_per_s"]
    assert roof["mbu"] == pytest.approx(expected)
    assert data["config"]["device"] == "cpu" and "attention_backend" in data["config"] and data["config"]["digest"]
    assert data["environment"]["torch"] and data["startup"]["load_s"] > 0 and data["startup"]["warmup_s"] > 0
    assert data["model"]["load_format"] == "dummy"


def test_bench_latency_json(tiny_dir, tmp_path, capsys):
    out = tmp_path / "latency.json"
    argv = ["bench", "latency", "--model", str(tiny_dir), "--load-format", "dummy", "--batch-size", "2",
            "--input-len", "12", "--output-len", "6", "--num-iters", "2", "--warmup-steps", "2",
            "--bandwidth-bytes", COPY_BYTES, "--output-json", str(out)]  # fmt: skip
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "TPOT p50" in printed and "MBU" in printed
    data = json.loads(out.read_text())
    assert data["benchmark"] == "latency" and data["command"][:3] == ["flotilla", "bench", "latency"]
    res = data["flotilla"]
    assert (res["iterations"], res["batch_size"], res["output_tokens"], res["input_tokens"]) == (2, 2, 24, 48)
    # NOTE: the prefill step makes the first token; each of the 5 later steps decodes both sequences.
    assert res["tpot_ms"]["count"] == 2 * 5 and res["roofline"]["decode_steps"] == 10
    for key in ("ttft_ms", "tpot_ms", "latency_s"):
        _ordered(res[key])
    walls = [it["wall_s"] for it in res["iteration_details"]]
    assert res["output_tok_s"] == pytest.approx(24 / sum(walls))
    assert all(it["ttft_s"] < it["wall_s"] for it in res["iteration_details"])
    assert res["ttft_ms"]["max"] < 1e3 * res["latency_s"]["max"]
    # Context after decode step j is 12 + j (j = 1..5) per sequence: a mean of 2 * 15 tokens read.
    assert res["roofline"]["kv_bytes_per_step_mean"] == pytest.approx(30 * TINY_KV_BYTES_PER_TOKEN)
    _check_common(data, weights_per_step_rows=2)
    _check_breakdown(res, printed)


def _check_breakdown(res, printed):
    """On CPU: no graph replay (and why), and the last iteration's 5 decode steps split into host phases."""
    br = res["breakdown"]
    assert br["graph_replay_ms"] is None and "not CUDA" in br["graph_replay_reason"]
    assert br["host_overhead_ms"] is None and br["graph_mbu"] is None and br["graph_batch_size"] is None
    assert br["step_wall_ms_p50"] == res["tpot_ms"]["p50"]
    assert "graph replay not timed" in printed and "host phases p50 ms over 5 steps" in printed
    phases, means, step = br["host_phases_ms"], br["host_phases_mean_ms"], br["host_step_ms"]
    assert sorted(phases) == sorted(HOST_PHASES) == sorted(means) and br["host_phase_steps"] == step["count"] == 5
    assert all(v >= 0 for v in [*phases.values(), *means.values()]) and phases["forward"] > 0
    # NOTE: a step's phases add up to it (so do the means); each phase's p50 is at most the step's.
    assert sum(means.values()) == pytest.approx(step["mean"], rel=1e-6)
    assert all(v <= step["p50"] for v in phases.values())
    # The phases are timed inside the benchmark's own step timing, over the last iteration's decode steps.
    assert step["max"] <= res["tpot_ms"]["max"] and sum(means.values()) <= res["tpot_ms"]["max"]


def test_bench_offline_json(tiny_dir, tmp_path, capsys):
    out = tmp_path / "offline.json"
    argv = ["bench", "offline", "--model", str(tiny_dir), "--load-format", "dummy", "--num-prompts", "5",
            "--input-len", "10", "--output-len", "4", "--warmup-steps", "1", "--bandwidth-bytes", COPY_BYTES,
            "--json", str(out)]  # fmt: skip
    assert main(argv) == 0
    assert "flotilla (all at once)" in capsys.readouterr().out
    data = json.loads(out.read_text())
    res = data["flotilla"]
    assert (res["requests"], res["input_tokens"], res["output_tokens"]) == (5, 50, 20)
    assert res["output_tok_s"] * res["wall_s"] == pytest.approx(20)
    assert res["total_tok_s"] * res["wall_s"] == pytest.approx(70)
    assert res["input_tok_s"] * res["wall_s"] == pytest.approx(50)
    assert res["ttft_s"]["count"] == 5 and res["tpot_ms"]["count"] == 5
    _ordered(res["ttft_s"])
    _ordered(res["tpot_ms"])
    assert res["ttft_s"]["max"] < res["wall_s"] and res["prefix_cache_hit_rate"] == 0.0
    # NOTE: all five prompts prefill in one step; the three later steps decode all five.
    assert res["roofline"]["decode_steps"] == 3 and res["max_batch_seqs"] == 5
    # One window a step here (4 steps < 40 windows): the prefill of 50 tokens, then three decodes.
    windows = res["step_windows"]
    assert [w["first_step"] for w in windows] == [0, 1, 2, 3] and all(w["steps"] == 1 for w in windows)
    assert [w["tokens"] for w in windows] == [50, 5, 5, 5] and [w["decode_only_steps"] for w in windows] == [0, 1, 1, 1]
    assert [w["mean_context_tokens"] for w in windows] == [50, 55, 60, 65] and all(w["mean_seqs"] == 5 for w in windows)
    assert sum(w["seconds"] for w in windows) <= res["wall_s"]
    # Contexts after decode steps: 11, 12, 13 per sequence -> mean 12 x 5 sequences.
    assert res["roofline"]["kv_bytes_per_step_mean"] == pytest.approx(60 * TINY_KV_BYTES_PER_TOKEN)
    _check_common(data, weights_per_step_rows=5)


def test_bench_offline_passes_the_kv_cache_dtype_through(tiny_dir, tmp_path, capsys):
    """``--kv-cache-dtype fp8_e4m3`` reaches the runner: the cache is float8, and the KV bytes the
    roofline counts are one byte an element (a quarter of the float32 cache's here)."""
    out = tmp_path / "offline-fp8.json"
    argv = ["bench", "offline", "--model", str(tiny_dir), "--load-format", "dummy", "--num-prompts", "5",
            "--input-len", "10", "--output-len", "4", "--warmup-steps", "0", "--bandwidth-bytes", COPY_BYTES,
            "--kv-cache-dtype", "fp8_e4m3", "--json", str(out)]  # fmt: skip
    assert main(argv) == 0
    assert "(float8_e4m3fn)" in capsys.readouterr().out
    data = json.loads(out.read_text())
    assert data["config"]["kv_cache_dtype"] == "fp8_e4m3"
    assert data["kv_cache"]["dtype"] == data["startup"]["runner"]["kv_cache_dtype"] == "float8_e4m3fn"
    assert data["kv_bytes_per_token"] == data["kv_cache"]["bytes_per_token_per_rank"] == TINY_KV_BYTES_PER_TOKEN // 4
    assert data["flotilla"]["roofline"]["kv_bytes_per_step_mean"] == pytest.approx(60 * TINY_KV_BYTES_PER_TOKEN // 4)


@pytest.mark.parametrize("kind", ["latency", "offline"])
def test_bench_reports_speculation_and_its_speedup_over_the_same_workload(kind, tiny_dir, tmp_path, capsys):
    """``--speculative-algorithm NGRAM``: the JSON says what was drafted and accepted in the
    measured run (the random model repeats itself, so NGRAM finds drafts), and the speedup over
    the same prompts run again without speculation on the same runner."""
    out = tmp_path / f"{kind}-spec.json"
    size = ["--batch-size", "2", "--num-iters", "1"] if kind == "latency" else ["--num-prompts", "3"]
    argv = ["bench", kind, "--model", str(tiny_dir), "--load-format", "dummy", *size, "--input-len", "12",
            "--output-len", "48", "--warmup-steps", "0", "--bandwidth-bytes", COPY_BYTES,
            "--speculative-algorithm", "NGRAM", "--speculative-num-draft-tokens", "4", "--json", str(out)]  # fmt: skip
    assert main(argv) == 0
    assert "speculative decoding NGRAM (3 drafts per step)" in capsys.readouterr().out
    spec = json.loads(out.read_text())["flotilla"]["speculative_decoding"]
    assert spec["algorithm"] == "NGRAM" and spec["num_draft_tokens"] == 3
    assert spec["draft_tokens"] >= spec["accepted_tokens"] > 0 and spec["rounds"] > 0
    assert spec["acceptance_rate"] == pytest.approx(spec["accepted_tokens"] / spec["draft_tokens"])
    assert spec["baseline_output_tok_s"] > 0 and spec["speedup"] > 0


def test_bench_offline_reports_the_host_tier_blocks_of_the_run(tiny_dir, tmp_path, capsys):
    """With ``--enable-hierarchical-cache`` and a pool the batch outgrows (4 blocks of 16 tokens
    for five 10 + 20-token requests), the JSON counts the blocks the timed run offloaded to the
    host tier and loaded back; the runner's start-up reports the tier's size."""
    out = tmp_path / "offline-host.json"
    argv = ["bench", "offline", "--model", str(tiny_dir), "--load-format", "dummy", "--num-prompts", "5",
            "--input-len", "10", "--output-len", "20", "--warmup-steps", "0", "--bandwidth-bytes", COPY_BYTES,
            "--max-total-tokens", "64", "--enable-hierarchical-cache", "--json", str(out)]  # fmt: skip
    assert main(argv) == 0
    data = json.loads(out.read_text())
    res = data["flotilla"]
    assert res["num_preemptions"] > 0 and res["output_tokens"] == 100
    assert res["host_kv"]["stored_blocks"] > 0 and res["host_kv"]["loaded_blocks"] > 0, res["host_kv"]
    assert data["startup"]["runner"]["host_kv_blocks"] == 8  # hicache_ratio 2.0 x 4 blocks


@pytest.mark.parametrize(
    "argv, message",
    [
        (["latency", "--shape", "llama-3.1-8b", "--model", "/x"], "give --shape or --model, not both"),
        (["latency", "--shape", "gpt-9"], "--shape 'gpt-9' is not a bundled model shape"),
        (["latency", "--shape", "qwen3-8b", "--load-format", "auto"], "--load-format must be dummy"),
        (["latency", "--batch-size", "0"], "--batch-size must be at least 1"),
        (["offline", "--num-prompts", "0"], "--num-prompts must be at least 1"),
        (["offline", "--warmup-steps", "-1"], "--warmup-steps must be 0 or more"),
        (["offline", "--shape", "qwen3-8b", "--compare-hf"], "hf_peer_bench.py"),
        (["latency", "--batch-sise", "2"], "did you mean --batch-size"),
        (["latency", "--num-prompts", "2"], "unrecognized flag --num-prompts"),
    ],
)
def test_bench_rejects_bad_options(argv, message, capsys):
    assert main(["bench", *argv]) == 2
    assert message in capsys.readouterr().err


def test_bench_usage(capsys):
    assert main(["bench"]) == 2 and main(["bench", "online"]) == 2
    assert main(["bench", "--help"]) == 0 and "latency" in capsys.readouterr().out


# Published totals (HF model cards): parameters, and parameters one token reads (MoE "active").
SHAPES = {
    "llama-3.1-8b": (8.03e9, None),
    "qwen3-8b": (8.19e9, None),
    "qwen3-30b-a3b": (30.5e9, 3.3e9),  # "3.3B activated", embedding table included
    "deepseek-v2-lite": (15.7e9, 2.4e9),  # "2.4B activated"; this count leaves the embedding table out
}


def test_bundled_shapes_include_the_four():
    # NOTE: the GLM shapes' sizes are checked in tests/cluster/models/test_bench_shapes.py.
    assert set(SHAPES) <= set(shape_names())


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_bundled_shape_resolves_for_h200_with_its_published_size(name):
    config = shape_config(name)
    resolved = resolve(
        ServerArgs.create(model_path=f"/models/{name}", load_format="dummy"),
        ModelFacts.from_hf_config(config),
        PRESETS["h200"],
    )
    assert (resolved.device, resolved.load_format, resolved.tp_size) == ("cuda", "dummy", 1)
    total, active = SHAPES[name]
    params = sum(math.prod(s) for s in hf_tensor_shapes(config).values())
    assert params == pytest.approx(total, rel=0.01)
    weights = WeightBytes.from_config(config, element_size=2)
    assert weights.total == 2 * params
    if active is None:
        assert (weights.moe_layers, weights.num_experts) == (0, 0)
        assert weights.per_step(1, count_embedding=True) == weights.total
    else:
        counted = name == "qwen3-30b-a3b"
        assert weights.per_step(1, count_embedding=counted) / 2 == pytest.approx(active, rel=0.03)
        # A large batch touches every expert: the whole model is read.
        assert weights.per_step(10**6, count_embedding=True) == pytest.approx(weights.total)


def test_llama_shape_is_the_shared_llama_31_8b_config():
    config = shape_config("llama-3.1-8b")
    assert {k: config[k] for k in LLAMA_128K} == LLAMA_128K
    assert config["rope_scaling"]["rope_type"] == "llama3" and config["tie_word_embeddings"] is False


def test_moe_shapes_carry_their_routing_fields():
    qwen = shape_config("qwen3-30b-a3b")
    assert (qwen["num_experts"], qwen["num_experts_per_tok"], qwen["moe_intermediate_size"]) == (128, 8, 768)
    ds = shape_config("deepseek-v2-lite")
    assert (ds["n_routed_experts"], ds["num_experts_per_tok"], ds["n_shared_experts"]) == (64, 6, 2)
    assert (ds["q_lora_rank"], ds["kv_lora_rank"], ds["first_k_dense_replace"]) == (None, 512, 1)
    weights = WeightBytes.from_config(ds, element_size=2)
    assert (weights.moe_layers, weights.num_experts, weights.top_k) == (26, 64, 6)
    assert weights.expert == 2 * 3 * 2048 * 1408


def test_block_fp8_weights_count_one_byte_an_element_plus_their_scales():
    """A block-FP8 checkpoint's quantized projections (not the embedding, LM head, norms or
    routers) read one byte an element plus a float32 scale per 128x128 block."""
    fp8 = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
    for name in ("llama-3.1-8b", "qwen3-30b-a3b"):
        config = shape_config(name)
        plain = WeightBytes.from_config(config, element_size=2)
        quantized = WeightBytes.from_config({**config, "quantization_config": fp8}, element_size=2)
        shapes = hf_tensor_shapes(config)
        projections = {n: s for n, s in shapes.items() if ("_proj" in n or ".experts." in n) and n.endswith(("weight", "proj"))}
        elements = sum(math.prod(s) for s in projections.values())
        scales = sum(
            math.prod(s[:-2]) * math.ceil(s[-2] / 128) * math.ceil(s[-1] / 128) for s in projections.values()
        )
        assert plain.total - quantized.total == elements - 4 * scales, name
        assert quantized.embedding == plain.embedding and quantized.embedding_row == plain.embedding_row
    qwen = WeightBytes.from_config({**shape_config("qwen3-30b-a3b"), "quantization_config": fp8}, element_size=2)
    # one expert: gate and up [768, 2048] and down [2048, 768], 96 scale blocks each
    assert qwen.expert == 3 * 768 * 2048 + 4 * 3 * 96


def test_expected_distinct_experts():
    assert expected_distinct_experts(128, 8, 1) == pytest.approx(8)
    assert expected_distinct_experts(64, 6, 2) == pytest.approx(64 * (1 - (58 / 64) ** 2))
    grown = [expected_distinct_experts(128, 8, b) for b in (1, 2, 8, 64, 512)]
    assert grown == sorted(grown) and grown[-1] == pytest.approx(128, rel=1e-3)
    assert expected_distinct_experts(0, 8, 4) == 0.0


class _FakeTime:
    """A perf_counter that only the fakes below advance."""

    def __init__(self):
        self.now = 0.0

    def perf_counter(self):
        return self.now

    def spend(self, ms):
        self.now += ms / 1e3


def _fake_engine(clock):
    """An engine whose step calls what LLMEngine.step and ModelRunner call, each spending fixed time."""
    item = SimpleNamespace(num_new_tokens=1, start_position=5, request=SimpleNamespace(num_prompt_tokens=4))
    planner = SimpleNamespace(plan=lambda meta, graph_batch_size=None: clock.spend(0.2))
    runner = SimpleNamespace(planner=planner, graphs=None, graphs_off_reason="off")
    runner.prepare_inputs = lambda step: clock.spend(0.5)
    runner.step_logits = lambda step: (runner.prepare_inputs(step), runner.planner.plan(None), clock.spend(3.0))
    runner.execute = lambda step, rows: (runner.step_logits(step), clock.spend(4.0))
    scheduler = SimpleNamespace(schedule=lambda: (clock.spend(0.1), SimpleNamespace(scheduled=[item]))[1])
    engine = SimpleNamespace(runner=runner, scheduler=scheduler)
    engine.step = lambda: (runner.execute(engine.scheduler.schedule(), []), clock.spend(0.7))
    return engine


def test_phase_clock_splits_a_step_and_unwraps(monkeypatch):
    from flotilla.deploy import bench_breakdown

    fake_time = _FakeTime()
    monkeypatch.setattr(bench_breakdown, "time", fake_time)
    engine = _fake_engine(fake_time)
    originals = (engine.step, engine.scheduler.schedule, engine.runner.step_logits, engine.runner.planner.plan)
    steps = StepClock(engine.runner)
    timed_execute = engine.runner.execute
    with PhaseClock(engine, steps) as phases:
        engine.step()
        engine.step()
    assert phases.reason is None and len(phases.records) == 2
    want = {"schedule": 0.1, "prepare_inputs": 0.5, "plan": 0.2, "forward": 3.0, "sample": 4.0, "update": 0.7}
    report = phases.report()
    assert report["host_phases_ms"] == pytest.approx(want) and report["host_phases_mean_ms"] == pytest.approx(want)
    assert report["host_step_ms"]["p50"] == pytest.approx(8.5) and report["host_phase_steps"] == 2
    # Unwrapped on exit: the originals are back, and the StepClock's wrapper under it.
    assert (engine.step, engine.scheduler.schedule, engine.runner.step_logits, engine.runner.planner.plan) == originals
    assert engine.runner.execute == timed_execute

    # A runner stepping in other processes (no step_logits): nothing wrapped, and the report says why.
    group = SimpleNamespace(runner=SimpleNamespace(execute=lambda step, rows: []), scheduler=engine.scheduler, step=None)
    with PhaseClock(group, StepClock(group.runner)) as idle:
        assert group.step is None
    assert idle.report()["host_phases_ms"] is None and "no step_logits" in idle.report()["host_phases_reason"]


def test_decode_breakdown_against_a_graph_replay():
    weights = WeightBytes.from_config(TINY, element_size=4)
    replays = []

    class Graphs:
        max_bs = 8

        def padded_size(self, n):
            return 4 if n <= 4 else 8 if n <= 8 else None

        def time_replay(self, n, iters):
            replays.append((n, iters))
            return 2.0

    runner = SimpleNamespace(graphs=Graphs())
    replay = time_graph_replay(runner, 3, iters=7)
    assert replays == [(3, 7)] and replay == {
        "graph_replay_ms": 2.0, "graph_batch_size": 4, "graph_replay_iters": 7, "graph_replay_reason": None,
    }  # fmt: skip
    out = decode_breakdown(replay, 2.5, PhaseClock(SimpleNamespace(runner=runner), None), weights, 100, 1e9, 1)
    graph_bytes = weights.per_step(1) + 4 * 100
    assert out["host_overhead_ms"] == pytest.approx(0.5) and out["graph_bytes"] == pytest.approx(graph_bytes)
    assert out["graph_mbu"] == pytest.approx(graph_bytes / 2e-3 / 1e9)
    assert "above the largest captured" in time_graph_replay(runner, 9)["graph_replay_reason"]
    off = time_graph_replay(SimpleNamespace(graphs=None, graphs_off_reason="device='cpu' is not CUDA"), 1)
    assert off["graph_replay_ms"] is None and off["graph_replay_reason"] == "device='cpu' is not CUDA"


def test_percentile_interpolates():
    assert percentile([3.0, 1.0, 2.0, 4.0], 50) == pytest.approx(2.5)
    assert percentile([1.0, 2.0, 3.0, 4.0, 5.0], 90) == pytest.approx(4.6)
    assert percentile([7.0], 90) == 7.0 and percentile([], 50) is None


def test_step_windows_cover_every_step_once():
    # 100 steps into windows of ceil(100 / 40) = 3 steps: 34 windows, the last of one step.
    steps = [StepRecord(0.01 * (i + 1), num_seqs=i % 7 + 1, num_tokens=2 * i, decode_only=i >= 10, context_tokens=i)
             for i in range(100)]  # fmt: skip
    windows = step_windows(steps)
    assert len(windows) == 34 and [w["steps"] for w in windows] == [3] * 33 + [1]
    assert [w["first_step"] for w in windows] == list(range(0, 100, 3))
    assert sum(w["seconds"] for w in windows) == pytest.approx(sum(s.seconds for s in steps))
    assert sum(w["tokens"] for w in windows) == sum(s.num_tokens for s in steps)
    assert sum(w["decode_only_steps"] for w in windows) == 90 and windows[3]["decode_only_steps"] == 2
    assert windows[1] == {"first_step": 3, "steps": 3, "seconds": pytest.approx(0.15), "decode_only_steps": 0,
                          "mean_seqs": 5.0, "tokens": 24, "mean_context_tokens": 4.0}  # fmt: skip
    assert step_windows([]) == [] and len(step_windows(steps, windows=200)) == 100


def test_hf_peer_bench_on_cpu(tmp_path):
    peer = import_benchmark("hf_peer_bench")
    config = tmp_path / "config.json"
    config.write_text(json.dumps(TINY))
    out = tmp_path / "hf.json"
    argv = ["--config", str(config), "--dtype", "float32", "--device", "cpu", "--input-len", "8", "--output-len", "5",
            "--batch-size", "3", "--batch-output-len", "4", "--bandwidth-bytes", COPY_BYTES, "--json", str(out)]  # fmt: skip
    assert peer.main(argv) == 0
    data = json.loads(out.read_text())
    assert sorted(data["parts"]) == ["eager1", "eager64", "static1"]
    assert data["kv_bytes_per_token"] == TINY_KV_BYTES_PER_TOKEN
    for part, (batch, new) in {"eager1": (1, 5), "eager64": (3, 4), "static1": (1, 5)}.items():
        row = data["parts"][part]
        assert (row["batch_size"], row["output_len"], row["output_tokens"]) == (batch, new, batch * new)
        assert row["output_tok_s"] * row["wall_s"] == pytest.approx(batch * new)
        assert row["ms_per_token"] == pytest.approx(1e3 * row["wall_s"] / new)


def test_decode_profile_on_cpu(tmp_path, capsys):
    """The kernel profile script end to end on a tiny model (on CPU it counts CPU ops: no graphs,
    eager steps); families partition the per-step time."""
    profile = import_benchmark("decode_profile")
    (tmp_path / "config.json").write_text(json.dumps(TINY))
    out = tmp_path / "profile.json"
    assert profile.main(["--model", str(tmp_path), "--dtype", "float32", "--replays", "3", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert (data["mode"], data["steps"], data["batch_size"]) == ("eager steps", 3, 1)
    assert data["kernel_ms_per_step"] > 0
    assert sum(data["families_ms"].values()) == pytest.approx(data["kernel_ms_per_step"])
    assert data["families_ms"]["gemm"] > 0  # the tiny Llama's linear layers
    assert profile.family_of("void flashinfer::BatchDecodeWithPagedKVCacheKernel<...>") == "attention"
    assert profile.family_of("fused_moe_kernel") == "moe" and profile.family_of("nvjet_tst_64x8") == "gemm"
    assert "kernel time per step" in capsys.readouterr().out


def test_decode_profile_turns_fused_ops_off_for_the_run_only(tmp_path):
    """``--without`` hands the model the unfused ops while the profile runs and restores the
    kernel registry afterwards; an unknown op name is a usage error naming it."""
    from flotilla.kernels import registry

    profile = import_benchmark("decode_profile")
    (tmp_path / "config.json").write_text(json.dumps(TINY))
    out = tmp_path / "profile.json"
    lookup = registry.get
    with profile._turned_off(["rms_norm_linear", "linear"]):
        assert registry.get("rms_norm_linear", "triton") is None
        assert registry.get("linear", "triton") is lookup("linear", "torch")
        assert registry.get("rms_norm", "torch") is lookup("rms_norm", "torch")
    assert registry.get is lookup
    argv = ["--model", str(tmp_path), "--dtype", "float32", "--replays", "2", "--json", str(out)]
    assert profile.main(argv + ["--without", "qkv_prepare,silu_and_mul_linear"]) == 0
    assert json.loads(out.read_text())["without"] == ["qkv_prepare", "silu_and_mul_linear"]
    assert registry.get is lookup
    with pytest.raises(SystemExit):
        profile.main(argv + ["--without", "rope"])
