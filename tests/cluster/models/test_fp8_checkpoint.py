"""Block-FP8 checkpoints (DeepSeek-V3 / Qwen3-*-FP8 layout) load and run end to end.

Each case is a tiny random model (hidden 256, head_dim 128, 2 layers: shapes that cut on
128x128 blocks), saved twice by ``helpers.tiny_fp8``: as an FP8 checkpoint (every projection
float8_e4m3fn + ``weight_scale_inv``) and as the same weights dequantized into a plain float32
checkpoint. The oracle is flotilla on the dequantized checkpoint (itself checked against HF
transformers on those weights), at TP=1 and, over gloo rank processes, at TP=2 (and EP=2 for
the MoE). Cases: Qwen3 dense; Llama with q/k/v/o biases, one KV head (replicated at TP=2),
bfloat16 scales and one projection kept in float32 (``modules_to_not_convert``); Qwen3-MoE with
8 experts top-2, a dense layer and the routers unquantized, as the real Qwen3-MoE FP8
checkpoints list them.

Tolerance: atol 1e-4 on float32 logits of magnitude up to ~5. The torch FP8 path dequantizes
each weight exactly (a float8 value times a float32 scale is one rounding, the same one the
test made writing the dequantized checkpoint), so both models hold bit-identical float32
weights; they differ only in the GEMM call (``x @ W^T`` on the dequantized matrix against
``F.linear``, oneDNN-packed in the engine; under TP the all-reduce), i.e. in float32
summation order, which moves logits by up to 3e-6 (measured with MKL_CBWR, ATEN_CPU_CAPABILITY
and 1-3 threads). A wrong scale block, part offset or shard moves them by 1e-1 or more. Greedy
tokens must be identical: every token is chosen with a lead over the runner-up of more than
2 * ATOL (``helpers.margins.greedy_token``; the smallest is 1.8e-3).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from helpers.margins import greedy_token
from helpers.paged import PagedRunner
from helpers.ranks import free_port, run_ranks
from helpers.tiny_fp8 import COMMON_CONFIG as _COMMON
from helpers.tiny_fp8 import FP8_CASES as CASES
from helpers.tiny_fp8 import VOCAB as _VOCAB
from helpers.tiny_fp8 import fp8_quantization_config, rewrite_checkpoint, save_fp8_case

ATOL = 1e-4
_COLLECTIVE_TIMEOUT_S = 30.0
_RANK_TIMEOUT_S = 120.0
_PROMPT_LENGTHS = (9, 1, 14, 5)
_DECODE_STEPS = 4
# Two-rank scenarios: (case, topology sizes).
TP_SCENARIOS = {
    "qwen3-tp2": ("qwen3", dict(world_size=2)),
    "llama-tp2": ("llama", dict(world_size=2)),
    "qwen3_moe-tp2": ("qwen3_moe", dict(world_size=2)),
    "qwen3_moe-ep2": ("qwen3_moe", dict(world_size=2, ep=2)),
}


# --- driving a model, shared by the parent and the rank processes ----------------------


def _load(model_dir, parallel=None, load_format: str = "auto"):
    from flotilla.cluster.models.sources import load_model, resolve_model_source

    return load_model(resolve_model_source(str(model_dir)), "float32", parallel=parallel, load_format=load_format)


@torch.no_grad()
def _drive(model) -> tuple[list[torch.Tensor], list[list[int]]]:
    """A ragged prefill of four prompts over a paged cache, then greedy decode steps: every
    step's logits (sequences in order) and each sequence's tokens."""
    generator = torch.Generator().manual_seed(1)
    new = {b: torch.randint(0, _VOCAB, (n,), generator=generator).tolist() for b, n in enumerate(_PROMPT_LENGTHS)}
    tokens = {b: list(p) for b, p in new.items()}
    runner = PagedRunner(model, len(new), max(_PROMPT_LENGTHS) + _DECODE_STEPS + 1)
    step_logits = []
    for _ in range(_DECODE_STEPS + 1):
        out = runner.step(new)
        step_logits.append(torch.cat([out[b] for b in sorted(out)]))
        new = {b: [greedy_token(logits[-1], 2 * ATOL)] for b, logits in out.items()}
        for b, token in new.items():
            tokens[b] += token
    return step_logits, [tokens[b] for b in sorted(tokens)]


def _assert_same_run(got, expected, what: str) -> None:
    (got_logits, got_tokens), (want_logits, want_tokens) = got, expected
    assert max(l.abs().max() for l in want_logits) > 1.0  # not a comparison of near-zero logits
    assert len(got_logits) == len(want_logits)
    for step, (actual, wanted) in enumerate(zip(got_logits, want_logits)):
        torch.testing.assert_close(actual, wanted, atol=ATOL, rtol=0, msg=lambda m: f"{what}, step {step}: {m}")
    assert got_tokens == want_tokens, what


def _rank_main(rank: int, world_size: int, root: str, out_dir: str, jobs: list[str]) -> None:
    """One rank process: every ``scenario:port`` job in turn, each in fresh process groups."""
    from flotilla.cluster import distributed
    from flotilla.cluster.models.base import ParallelLayout
    from flotilla.cluster.topology import Topology

    torch.set_num_threads(1)
    for job in jobs:
        name, port = job.split(":")
        case, sizes = TP_SCENARIOS[name]
        topology = Topology.create(**sizes)
        comms = distributed.init_process_groups(topology, rank, int(port), _COLLECTIVE_TIMEOUT_S)
        try:
            model = _load(Path(root) / case / "fp8", ParallelLayout.for_rank(topology, rank, comms))
            logits, tokens = _drive(model)
            torch.save({"logits": logits, "tokens": tokens}, Path(out_dir) / f"{name}-rank{rank}.pt")
        finally:
            distributed.destroy()


# --- fixtures -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> Path:
    """``root/<case>/fp8`` and ``root/<case>/dequant`` for every case."""
    root = tmp_path_factory.mktemp("fp8")
    for case in CASES:
        save_fp8_case(case, root)
    return root


@pytest.fixture(scope="module")
def references(checkpoints) -> dict:
    """Each case's run on the dequantized float32 checkpoint (one rank)."""
    torch.set_num_threads(1)
    return {case: _drive(_load(checkpoints / case / "dequant")) for case in CASES}


@pytest.fixture(scope="module")
def two_rank_results(checkpoints, tmp_path_factory) -> Path:
    out_dir = tmp_path_factory.mktemp("fp8-ranks")
    jobs = [f"{name}:{free_port()}" for name in TP_SCENARIOS]
    run_ranks(__file__, 2, [checkpoints, out_dir, *jobs], _RANK_TIMEOUT_S)
    return out_dir


# --- FP8 against the dequantized oracle ----------------------------------------------------


@pytest.mark.parametrize("case", list(CASES))
def test_fp8_checkpoint_matches_its_dequantized_twin(case, checkpoints, references):
    from flotilla.cluster.models.fp8_linear import (
        Fp8MergedColumnParallelLinear,
        Fp8QKVParallelLinear,
        Fp8RowParallelLinear,
    )
    from flotilla.cluster.models.fp8_moe import Fp8FusedMoE

    model = _load(checkpoints / case / "fp8")
    _assert_same_run(_drive(model), references[case], case)
    fp8_layers = {name: type(m).__name__ for name, m in model.named_modules() if hasattr(m, "weight_scale_inv")}
    fp8_layers.update({name: "Fp8FusedMoE" for name, m in model.named_modules() if isinstance(m, Fp8FusedMoE)})
    for name, param in model.named_parameters():
        if name.endswith("scale_inv"):
            assert param.dtype == torch.float32 and bool((param > 0).all()), name
    # Which layers are FP8: every projection except the ones the checkpoint keeps in float32;
    # never the embedding, LM head, norms or routers.
    if case == "llama":
        assert type(model.model.layers[1].mlp.down_proj).__name__ == "RowParallelLinear"
        assert isinstance(model.model.layers[1].mlp.gate_up_proj, Fp8MergedColumnParallelLinear)
        assert isinstance(model.model.layers[0].self_attn.qkv_proj, Fp8QKVParallelLinear)
        assert len(fp8_layers) == 4 * 2 - 1
    elif case == "qwen3_moe":
        assert isinstance(model.layers[0].mlp.experts, Fp8FusedMoE)
        assert model.layers[0].mlp.experts.w13.dtype == torch.float8_e4m3fn
        assert model.layers[0].mlp.gate.weight.dtype == torch.float32
        assert isinstance(model.layers[1].mlp.down_proj, Fp8RowParallelLinear)
        assert len(fp8_layers) == 2 * 2 + 2 + 1  # q/k/v and o per layer, the dense MLP, the experts
    else:
        assert len(fp8_layers) == 4 * 2
    assert all(p.dtype == torch.float32 for n, p in model.named_parameters() if "embed" in n or "norm" in n)


def test_the_dequantized_oracle_matches_hf_transformers(checkpoints, references):
    """The oracle itself: flotilla on the dequantized checkpoint against HF on the same weights
    (the prefill of the first prompt)."""
    from transformers import AutoModelForCausalLM

    for case in CASES:
        hf = AutoModelForCausalLM.from_pretrained(checkpoints / case / "dequant", dtype=torch.float32).eval()
        generator = torch.Generator().manual_seed(1)
        prompt = torch.randint(0, _VOCAB, (_PROMPT_LENGTHS[0],), generator=generator)
        with torch.no_grad():
            expected = hf(prompt[None]).logits[0]
        torch.testing.assert_close(references[case][0][0][: len(prompt)], expected, atol=ATOL, rtol=0, msg=case)


@pytest.mark.parametrize("scenario", list(TP_SCENARIOS))
def test_fp8_at_two_ranks_matches_the_dequantized_single_rank(scenario, two_rank_results, references):
    case = TP_SCENARIOS[scenario][0]
    for rank in range(2):
        got = torch.load(two_rank_results / f"{scenario}-rank{rank}.pt")
        _assert_same_run((got["logits"], got["tokens"]), references[case], f"{scenario} rank {rank}")


def _resolved(path: Path):
    from flotilla.cluster.models.sources import resolve_model_source
    from flotilla.resolution import ModelFacts, ServerArgs, preset, resolve

    source = resolve_model_source(str(path))
    args = ServerArgs.create(model_path=str(path))
    return resolve(args, ModelFacts.from_hf_config(source.config_dict), preset("cpu")), source


def test_the_engine_serves_an_fp8_checkpoint(checkpoints):
    """Through resolution and the runner (kernel backends, oneDNN packing of the plain layers):
    the FP8 checkpoint's greedy tokens are the dequantized checkpoint's."""
    from flotilla.cluster.engine.llm_engine import LLMEngine
    from flotilla.cluster.engine.sampling_params import SamplingParams

    def greedy(path):
        engine = LLMEngine(*_resolved(path))
        params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
        ids = [engine.add_request(p, params) for p in ([5, 17, 300, 2, 41], [99, 3])]
        while engine.has_unfinished_requests():
            engine.step()
        return [engine.pop_output(i).outputs[0].token_ids for i in ids], engine.runner.startup_report()

    want, _ = greedy(checkpoints / "qwen3_moe" / "dequant")
    got, report = greedy(checkpoints / "qwen3_moe" / "fp8")
    assert got == want
    assert report["kernel_backends"]["fp8"] == "torch"


# --- the fused decode ops leave FP8 layers alone -------------------------------------------


def test_use_linear_op_skips_fp8_layers(checkpoints):
    """The linear backend's ops read ``.weight`` as a half-precision matrix: FP8 layers, and
    the modules that would hand an FP8 weight to a fused op, keep their own forward."""
    from flotilla.cluster.models.layers import use_linear_op

    model = _load(checkpoints / "llama" / "fp8")
    want = _drive(model)
    fail = lambda *args, **kwargs: pytest.fail("a fused op ran on a model whose projections are FP8")  # noqa: E731
    seen = []

    def linear(x, weight, bias=None):
        seen.append(weight.dtype)
        return torch.nn.functional.linear(x, weight, bias)

    changed = use_linear_op(model, linear, rms_norm_linear=fail, silu_and_mul_linear=fail)
    assert changed == 1  # layer 1's float32 down_proj
    _assert_same_run(_drive(model), want, "use_linear_op")
    assert seen and set(seen) == {torch.float32}


# --- dummy weights --------------------------------------------------------------------------


def test_dummy_load_format_builds_random_fp8_weights(tmp_path):
    """``--load-format dummy`` on an FP8 config: float8 projections with positive block scales,
    the same weights on every run, finite logits; sharded at TP=2 like a real checkpoint."""
    from flotilla.cluster.models.base import ParallelLayout

    hf = dict(
        architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", **_COMMON, **CASES["qwen3_moe"][1],
        quantization_config=fp8_quantization_config(["lm_head", "model.layers.0.mlp.gate"]),
    )  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(hf))
    first, second = _load(tmp_path, load_format="dummy"), _load(tmp_path, load_format="dummy")
    experts = first.layers[0].mlp.experts
    assert experts.w13.dtype == torch.float8_e4m3fn and experts.w13_scale_inv.shape == (8, 4, 2)
    assert bool((experts.w13_scale_inv > 0).all()) and first.layers[0].mlp.gate.weight.dtype == torch.float32
    assert all(torch.equal(a.float(), b.float()) for a, b in zip(first.parameters(), second.parameters()))
    logits, _ = _drive(first)
    assert all(bool(torch.isfinite(l).all()) for l in logits)
    shard = _load(tmp_path, ParallelLayout(tp_size=2, tp_rank=1), load_format="dummy")
    full, half = first.layers[1].self_attn.o_proj, shard.layers[1].self_attn.o_proj
    assert torch.equal(half.weight.float(), full.weight.float()[:, 256:])
    assert torch.equal(half.weight_scale_inv, full.weight_scale_inv[:, 2:])


# --- bad checkpoints and layouts --------------------------------------------------------------


def _copy_checkpoint(checkpoints: Path, case: str, tmp_path: Path) -> Path:
    import shutil

    return Path(shutil.copytree(checkpoints / case / "fp8", tmp_path / case))


def test_a_missing_scale_is_named(checkpoints, tmp_path):
    dense = _copy_checkpoint(checkpoints, "qwen3", tmp_path)
    rewrite_checkpoint(dense, lambda t: t.pop("model.layers.1.self_attn.k_proj.weight_scale_inv"))
    with pytest.raises(ValueError, match=r"missing .*layers\.1\.self_attn\.qkv_proj\.weight_scale_inv\[shard 1\]"):
        _load(dense)
    moe = _copy_checkpoint(checkpoints, "qwen3_moe", tmp_path)
    rewrite_checkpoint(moe, lambda t: t.pop("model.layers.0.mlp.experts.5.up_proj.weight_scale_inv"))
    with pytest.raises(ValueError, match=r"no scales .*layers\.0\.mlp\.experts\.w13_scale_inv \(local expert rows \[5\]"):
        _load(moe)


def test_a_wrong_scale_shape_or_dtype_is_named(checkpoints, tmp_path):
    path = _copy_checkpoint(checkpoints, "qwen3", tmp_path)
    name = "model.layers.0.mlp.down_proj.weight_scale_inv"
    rewrite_checkpoint(path, lambda t: t.update({name: t[name][:, :2].contiguous()}))
    with pytest.raises(ValueError, match=rf"{name} has shape \(2, 2\), expected \(2, 4\) for a \[256, 512\] weight"):
        _load(path)
    moe = _copy_checkpoint(checkpoints, "qwen3_moe", tmp_path)
    name = "model.layers.0.mlp.experts.2.down_proj.weight_scale_inv"
    rewrite_checkpoint(moe, lambda t: t.update({name: t[name].t().contiguous()[:1]}))
    with pytest.raises(ValueError, match=rf"{name} has shape \(1, 2\), expected \(2, 2\)"):
        _load(moe)
    dtype = _copy_checkpoint(checkpoints, "llama", tmp_path)
    name = "model.layers.0.self_attn.v_proj.weight_scale_inv"
    rewrite_checkpoint(dtype, lambda t: t.update({name: t[name].to(torch.float8_e4m3fn)}))
    with pytest.raises(ValueError, match=rf"{name} is torch.float8_e4m3fn, expected float32 or bfloat16"):
        _load(dtype)


def test_an_unquantized_weight_where_fp8_is_expected_is_named(checkpoints, tmp_path):
    path = _copy_checkpoint(checkpoints, "qwen3", tmp_path)
    name = "model.layers.0.self_attn.o_proj.weight"
    rewrite_checkpoint(path, lambda t: t.update({name: t[name].float()}))
    with pytest.raises(ValueError, match=rf"{name} is torch.float32 in the checkpoint.*modules_to_not_convert"):
        _load(path)


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(weight_block_size=[64, 64]), r"weight_block_size=\[64, 64\] is not supported"),
        (dict(weight_block_size=None), r"no weight_block_size: per-tensor FP8"),
        (dict(fmt="e5m2"), r"fmt='e5m2' is not supported"),
        (dict(activation_scheme="static"), r"activation_scheme='static' is not supported"),
        (dict(modules_to_not_convert=["model.layers.0.self_attn.q_proj"]), r"quantizes .*k_proj.* but not .*q_proj"),
    ],
)
def test_an_fp8_config_flotilla_cannot_load_fails_at_start(checkpoints, tmp_path, change, message):
    from flotilla.cluster.engine.model_runner import ModelRunner

    path = _copy_checkpoint(checkpoints, "qwen3", tmp_path)
    hf = json.loads((path / "config.json").read_text())
    hf["quantization_config"].update(change)
    (path / "config.json").write_text(json.dumps(hf))
    with pytest.raises(ValueError, match=message):
        ModelRunner(*_resolved(path))


def test_an_fp8_config_on_an_unwired_architecture_is_refused(tmp_path):
    # NOTE: Mixtral's experts are not wired for block FP8 (DeepSeek's are, since the flagship models).
    hf = {
        "architectures": ["MixtralForCausalLM"],
        "model_type": "mixtral",
        "quantization_config": fp8_quantization_config(),
    }
    (tmp_path / "config.json").write_text(json.dumps(hf))
    with pytest.raises(ValueError, match=r"MixtralForCausalLM does not load block-FP8 checkpoints.*Qwen3Moe"):
        _load(tmp_path)


def test_shards_that_cut_through_scale_blocks_are_refused():
    from flotilla.cluster.models.base import ModelConfig, ParallelLayout
    from flotilla.cluster.models.registry import model_class

    def build(config_name: str, tp: int, **extra):
        import transformers

        hf = getattr(transformers, config_name)(**_COMMON, **extra).to_dict()
        hf["quantization_config"] = fp8_quantization_config()
        layout = ParallelLayout(tp_size=tp, moe_tp_size=tp)  # tp ranks, no EP: MoE TP is tp
        model_class(hf["architectures"][0])(ModelConfig(hf=hf, parallel=layout))

    qwen3 = dict(num_attention_heads=4, num_key_value_heads=2, head_dim=128, architectures=["Qwen3ForCausalLM"])
    with pytest.raises(ValueError, match=r"layers\.0\.mlp\.gate_proj: its rows per rank \(192 of 384, tp_size=2\)"):
        build("Qwen3Config", 2, intermediate_size=384, **qwen3)
    build("Qwen3Config", 1, intermediate_size=384, **qwen3)  # one rank: the last part may end mid-block
    with pytest.raises(ValueError, match=r"self_attn\.k_proj: its rows per rank \(64 of 128"):
        build("Qwen3Config", 2, intermediate_size=512, **{**qwen3, "head_dim": 64, "num_attention_heads": 4})
    with pytest.raises(ValueError, match=r"mlp\.experts: moe_intermediate_size=256 gives 64 rows per MoE-TP rank"):
        build(
            "Qwen3MoeConfig", 4, intermediate_size=512, moe_intermediate_size=256, num_attention_heads=4,
            num_key_value_heads=4, head_dim=128, num_experts=8, num_experts_per_tok=2,
            architectures=["Qwen3MoeForCausalLM"],
        )  # fmt: skip


def test_skip_patterns_match_at_module_boundaries():
    from flotilla.cluster.models.fp8_config import BlockFp8Config

    section = fp8_quantization_config(["model.layers.1", "mlp.gate", "lm_head"])
    fp8 = BlockFp8Config.from_hf({"quantization_config": section})
    assert not fp8.quantizes("model.layers.1.mlp.down_proj")
    assert fp8.quantizes("model.layers.11.mlp.down_proj")
    assert fp8.quantizes("model.layers.0.mlp.gate_proj")  # "mlp.gate" names the router only
    assert not fp8.quantizes("model.layers.0.mlp.gate")  # never a projection flotilla quantizes
    assert not fp8.quantizes("lm_head") and not fp8.quantizes("model.embed_tokens")
    assert BlockFp8Config.from_hf({"quantization_config": {"quant_method": "awq"}}) is None


if __name__ == "__main__":
    # argv: rank, world_size, root, out_dir, *jobs (see helpers.ranks.run_ranks)
    _rank_main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5:])
