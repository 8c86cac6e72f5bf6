"""Block-FP8 checkpoints of the DeepSeek family (DeepSeek-V3/R1, V2-Lite's q_proj shape) and of
GLM-4.5 and GLM-5 (DSA, IndexShare), in the published on-disk layout (``helpers.tiny_dsa.save_fp8_twin``: every projection
float8_e4m3fn + ``weight_scale_inv`` per 128x128 block, one tensor per expert matrix), against HF
transformers on the exactly dequantized weights.

What runs how: routed and shared experts, dense MLPs and ``o_proj`` (GLM: q/k/v too) are FP8
layers (op ``fp8_block_linear`` / ``fp8_grouped_moe``, torch backend: dequantize, float32 GEMM);
MLA's ``q_a_proj``/``q_b_proj``/``q_proj``/``kv_a_proj_with_mqa``/``kv_b_proj`` and the DSA indexer's
``wq_b``/``wk`` are dequantized at load. Either way every weight equals the dequantized checkpoint's bit for bit (a float8 value times
a float32 scale is one float32 rounding, the same one the twin was written with), so the models
differ from HF only in float32 summation order: ~3e-6 on logits of magnitude ~5. atol 1e-4 holds
on any CPU's SIMD width; a wrong scale block, a missed dequantization (a raw float8 value is off by
its scale, 1e-2 or more) or a wrong shard moves logits by 1e-1 or more. Greedy tokens are identical.
"""

from __future__ import annotations

import json

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    DeepseekV3Config,
    DeepseekV3ForCausalLM,
    Glm4MoeConfig,
    Glm4MoeForCausalLM,
    GlmMoeDsaConfig,
    GlmMoeDsaForCausalLM,
)

from flotilla import LLM, SamplingParams
from flotilla.cluster.models.fp8_dequant import dequantize_on_load
from flotilla.cluster.models.fp8_linear import Fp8RowParallelLinear
from flotilla.cluster.models.fp8_moe import Fp8FusedMoE
from flotilla.cluster.models.sources import load_model, resolve_model_source
from helpers.paged import PagedRunner
from helpers.prompts import random_prompts
from helpers.tiny_dsa import SelectionMargins, quantize_blocks, save_fp8_twin
from helpers.tiny_fp8 import randomize
from helpers.tiny_glm import randomize_correction_bias
from helpers.tiny_models import hf_greedy
from helpers.torch_threads import one_intra_op_thread

ATOL = 1e-4
NEW_TOKENS = 32
VOCAB = 384
# Widths that cut on 128-wide blocks where flotilla keeps FP8 layers (MLP and expert widths,
# hidden); MLA's own widths (q LoRA 96, latent 64 + rope 16, 4 heads) need not, as real ones
# (kv_a_proj_with_mqa: 576 rows) do not.
_DEEPSEEK = dict(
    vocab_size=VOCAB, hidden_size=128, intermediate_size=256, moe_intermediate_size=128, num_hidden_layers=3,
    num_attention_heads=4, kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32,
    n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1, n_shared_experts=1, first_k_dense_replace=1,
    norm_topk_prob=True, routed_scaling_factor=2.5, max_position_embeddings=256, num_nextn_predict_layers=0,
)
CASES = {
    "deepseek_v3": (DeepseekV3Config, DeepseekV3ForCausalLM, dict(_DEEPSEEK, q_lora_rank=96)),
    "deepseek_v3_q_proj": (DeepseekV3Config, DeepseekV3ForCausalLM, dict(_DEEPSEEK, q_lora_rank=None)),
    "glm4_moe": (
        Glm4MoeConfig,
        Glm4MoeForCausalLM,
        dict(
            vocab_size=VOCAB, hidden_size=128, intermediate_size=256, moe_intermediate_size=128, num_hidden_layers=3,
            num_attention_heads=2, num_key_value_heads=2, head_dim=64, n_routed_experts=8, num_experts_per_tok=2,
            n_group=2, topk_group=1, n_shared_experts=1, first_k_dense_replace=1, routed_scaling_factor=2.5,
            use_qk_norm=True, attention_bias=True, max_position_embeddings=256, num_nextn_predict_layers=0,
        ),
    ),
    # GLM-5-FP8: DSA (the indexer's wq_b/wk dequantized at load, weights_proj float32) with IndexShare.
    "glm5": (
        GlmMoeDsaConfig,
        GlmMoeDsaForCausalLM,
        dict(
            _DEEPSEEK, q_lora_rank=96, num_key_value_heads=4, index_topk=8, index_head_dim=32, index_n_heads=16,
            index_topk_pattern="FSF", num_nextn_predict_layers=None,
        ),
    ),
}  # fmt: skip
# Weight seeds: GLM-5's leaves every top-k boundary of the test at least 1e-3 wide (measured 2.3e-3).
SEEDS = {"glm5": 6}


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    with one_intra_op_thread():
        yield


@pytest.fixture(scope="module")
def twins(tmp_path_factory):
    """``twins(case) -> (case, fp8_dir, oracle)``, each case built once."""
    built = {}

    def get(case: str):
        if case not in built:
            config_cls, model_cls, settings = CASES[case]
            seed = SEEDS.get(case, 0)
            torch.manual_seed(seed)
            hf = model_cls(config_cls(**settings)).eval()
            randomize(hf, seed)
            randomize_correction_bias(hf, seed)
            fp8_dir, dequant_dir = save_fp8_twin(hf, tmp_path_factory.mktemp(case))
            built[case] = case, fp8_dir, AutoModelForCausalLM.from_pretrained(dequant_dir, dtype=torch.float32).eval()
        return built[case]

    return get


@pytest.fixture(params=sorted(CASES))
def twin(request, twins):
    return twins(request.param)


def test_the_checkpoint_is_fp8_where_deepseeks_is(twin):
    from safetensors import safe_open

    _, fp8_dir, _ = twin
    with safe_open(str(next(fp8_dir.glob("*.safetensors"))), "pt") as f:
        names = set(f.keys())
        assert f.get_tensor("model.layers.1.mlp.experts.3.down_proj.weight").dtype == torch.float8_e4m3fn
    assert "model.layers.1.mlp.experts.3.down_proj.weight_scale_inv" in names
    assert "model.layers.1.mlp.shared_experts.gate_proj.weight_scale_inv" in names
    assert "model.layers.0.self_attn.o_proj.weight_scale_inv" in names
    assert "model.layers.1.mlp.gate.weight_scale_inv" not in names  # the router stays float32


def test_prefill_logits_and_greedy_decode_match_hf_on_the_dequantized_weights(twin):
    case, fp8_dir, oracle = twin
    ours = load_model(resolve_model_source(str(fp8_dir)), "float32")
    kinds = {type(m) for m in ours.modules()}
    assert Fp8FusedMoE in kinds and Fp8RowParallelLinear in kinds
    if case != "glm4_moe":
        attn = ours.layers[0].self_attn
        assert attn.w_kc.dtype == torch.float32 and attn.kv_a_proj_with_mqa.weight.dtype == torch.float32
    margins = SelectionMargins().attach(ours)
    prompts = random_prompts((13, 6), VOCAB)
    runner = PagedRunner(ours, len(prompts), max(map(len, prompts)) + NEW_TOKENS)
    prefill = runner.step(dict(enumerate(prompts)))
    outputs = [[int(prefill[b][-1].argmax())] for b in range(len(prompts))]
    for _ in range(NEW_TOKENS - 1):
        logits = runner.step({b: out[-1:] for b, out in enumerate(outputs)})
        for b, out in enumerate(outputs):
            out.append(int(logits[b][-1].argmax()))
    for b, prompt in enumerate(prompts):
        with torch.no_grad():
            expected = oracle(torch.tensor([prompt])).logits[0]
        torch.testing.assert_close(prefill[b], expected, atol=ATOL, rtol=0)
        assert outputs[b] == hf_greedy(oracle, prompt, NEW_TOKENS)
    # NOTE: GLM-5's top-k boundaries wider than float32 noise (see test_dsa.py); no boundary elsewhere.
    assert margins.smallest >= 1e-4


def test_the_engine_serves_the_fp8_checkpoint_with_hfs_tokens(twins):
    _, fp8_dir, oracle = twins("deepseek_v3")
    prompts = random_prompts((7, 30), VOCAB, seed=3)
    llm = LLM(str(fp8_dir), chunked_prefill_size=16)
    assert llm.engine.runner.startup_report()["kernel_backends"]["fp8"] == "torch"
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(oracle, p, NEW_TOKENS) for p in prompts]


# --- dequantization on load ---------------------------------------------------------------


def test_a_weight_and_its_scale_pair_in_any_order_and_fp8_layers_pass_through():
    weight = torch.randn(200, 130)
    q, scale, dequant = quantize_blocks(weight)
    keep = lambda module: module.endswith("o_proj")  # noqa: E731
    stream = [
        ("a.kv_b_proj.weight_scale_inv", scale),
        ("a.o_proj.weight", q),
        ("b.q_a_proj.weight", q),
        ("norm.weight", torch.ones(3)),
        ("a.kv_b_proj.weight", q),
        ("a.o_proj.weight_scale_inv", scale),
        ("b.q_a_proj.weight_scale_inv", scale),
    ]
    out = dict(dequantize_on_load(stream, keep))
    assert set(out) == {"a.kv_b_proj.weight", "a.o_proj.weight", "a.o_proj.weight_scale_inv", "b.q_a_proj.weight", "norm.weight"}
    assert torch.equal(out["a.kv_b_proj.weight"], dequant) and torch.equal(out["b.q_a_proj.weight"], dequant)
    assert out["a.o_proj.weight"].dtype == torch.float8_e4m3fn


def test_a_missing_scale_names_the_module():
    q, _, _ = quantize_blocks(torch.randn(4, 4))
    with pytest.raises(ValueError, match=r"model\.layers\.0\.self_attn\.kv_b_proj\.weight has no weight_scale_inv"):
        list(dequantize_on_load([("model.layers.0.self_attn.kv_b_proj.weight", q)], lambda module: False))


# --- formats flotilla does not load -------------------------------------------------------


def _config_dir(tmp_path, **extra):
    hf = dict(CASES["deepseek_v3"][2], architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3", **extra)
    (tmp_path / "config.json").write_text(json.dumps(hf))
    return tmp_path


@pytest.mark.parametrize("algo", ["NVFP4", "MIXED_PRECISION"])
def test_modelopt_checkpoints_are_refused_naming_their_quant_algo(tmp_path, algo):
    path = _config_dir(tmp_path, quantization_config={"quant_method": "modelopt", "quant_algo": algo, "group_size": 16})
    with pytest.raises(ValueError, match=rf"ModelOpt \(quant_algo='{algo}'\).*block-FP8 release"):
        load_model(resolve_model_source(str(path)), "float32")


def test_a_modelopt_export_beside_config_json_is_refused_too(tmp_path):
    path = _config_dir(tmp_path)
    (path / "hf_quant_config.json").write_text(json.dumps({"quantization": {"quant_algo": "NVFP4", "group_size": 16}}))
    with pytest.raises(ValueError, match=r"quant_algo='NVFP4'"):
        load_model(resolve_model_source(str(path)), "float32")
