"""DeepSeek sparse attention in resolution: flotilla's deviation for the ``cpu`` platform (DSA
resolves to the torch reference instead of the seeds' start-up crash), the seeds' behaviour
everywhere else, and the per-layer indexer modes (GLM-5's IndexShare) the runtime builds from the
resolved top-k sharing pattern."""

from __future__ import annotations

import pytest

from flotilla.resolution import ModelFacts, ResolutionError, ServerArgs, resolve
from flotilla.resolution.model_derive import dsa_indexer_types, index_topk_pattern
from flotilla.resolution.platform import PRESETS, PlatformFacts

_MLA = dict(
    hidden_size=6144, num_attention_heads=64, num_key_value_heads=64, num_hidden_layers=4, kv_lora_rank=512,
    q_lora_rank=2048, qk_rope_head_dim=64, qk_nope_head_dim=192, v_head_dim=256, n_routed_experts=256,
    num_experts_per_tok=8, n_group=1, topk_group=1, first_k_dense_replace=3, max_position_embeddings=202752,
    vocab_size=154880, index_topk=2048, index_head_dim=128, index_n_heads=32,
)  # fmt: skip
GLM5 = dict(_MLA, architectures=["GlmMoeDsaForCausalLM"], model_type="glm_moe_dsa")
DSV32 = dict(_MLA, architectures=["DeepseekV32ForCausalLM"], model_type="deepseek_v32")


def _resolve(hf: dict, platform, **flags):
    return resolve(ServerArgs.create(model_path="/models/m", **flags), ModelFacts.from_hf_config(hf), platform)


# --- the cpu deviation, and the seeds elsewhere -----------------------------------------------


@pytest.mark.parametrize("hf", [GLM5, DSV32], ids=["glm5", "dsv32"])
def test_on_the_cpu_platform_dsa_resolves_to_the_torch_reference(hf):
    config = _resolve(hf, PRESETS["cpu"])
    assert (config.dsa_prefill_backend, config.dsa_decode_backend, config.dsa_topk_backend) == ("torch",) * 3
    assert config.kv_cache_dtype == "auto" and config.device == "cpu"
    rules = {change.rule for change in config.provenance if change.field.startswith("dsa_")}
    assert rules == {"_flotilla_cpu_reference_dsa"}


def test_an_explicit_top_k_backend_is_kept_on_the_cpu_platform():
    config = _resolve(GLM5, PRESETS["cpu"], dsa_topk_backend="sgl-kernel")
    assert config.dsa_topk_backend == "sgl-kernel" and config.dsa_prefill_backend == "torch"


@pytest.mark.parametrize(
    "platform, prefill, decode, kv",
    [("h200", "flashmla_sparse", "fa3", "bfloat16"), ("b200", "trtllm", "trtllm", "fp8_e4m3")],
)
def test_gpu_platforms_keep_the_seeds_dsa_backends(platform, prefill, decode, kv):
    config = _resolve(GLM5, PRESETS[platform], tp_size=8)
    assert (config.dsa_prefill_backend, config.dsa_decode_backend, config.kv_cache_dtype) == (prefill, decode, kv)
    assert config.dsa_topk_backend == "sgl-kernel" and config.attention_backend == "dsa"
    assert "_flotilla_cpu_reference_dsa" not in {change.rule for change in config.provenance}


def test_other_platforms_without_a_cuda_torch_keep_the_seeds_refusal():
    mac = PlatformFacts(name="mac", device="mps")
    with pytest.raises(ResolutionError, match=r"DeepSeek sparse attention \(DSA\), which needs an NVIDIA or AMD GPU"):
        _resolve(GLM5, mac)


def test_a_dense_deepseek_on_cpu_is_untouched():
    v3 = dict(DSV32, architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3")
    v3.pop("index_topk")
    config = _resolve(v3, PRESETS["cpu"])
    assert config.dsa_prefill_backend is None and config.dsa_topk_backend == "sgl-kernel"


# --- IndexShare: the per-layer indexer modes ------------------------------------------------


def test_the_pattern_gives_each_layers_mode():
    assert dsa_indexer_types({"index_topk_pattern": "FSSF"}, 4) == ("full", "shared", "shared", "full")
    types = {"indexer_types": ["full", "shared", "full", "shared"]}
    assert index_topk_pattern(types) == "FSFS"
    assert dsa_indexer_types(types, 4) == ("full", "shared", "full", "shared")
    # An explicit pattern wins over indexer_types (as resolution derives it).
    assert dsa_indexer_types({**types, "index_topk_pattern": "FFFF"}, 4) == ("full",) * 4
    assert dsa_indexer_types({}, 3) == ("full",) * 3


@pytest.mark.parametrize("freq, offset", [(2, None), (2, 4), (3, 1), (1, 2)])
def test_without_a_pattern_the_schedule_is_transformers_indexer_types(freq, offset):
    from transformers import GlmMoeDsaConfig

    extra = {"index_topk_freq": freq} | ({} if offset is None else {"index_skip_topk_offset": offset})
    expected = tuple(GlmMoeDsaConfig(num_hidden_layers=10, **extra).indexer_types)
    assert dsa_indexer_types(extra, 10) == expected


@pytest.mark.parametrize(
    "cfg, message",
    [
        ({"index_topk_pattern": "FSF"}, "one F \\(full\\) or S \\(shared\\) per layer \\(4 layers\\)"),
        ({"index_topk_pattern": "FSXF"}, "one F"),
        ({"index_topk_pattern": "SFFF"}, "starts with a shared layer"),
    ],
)
def test_bad_patterns_are_refused(cfg, message):
    with pytest.raises(ValueError, match=message):
        dsa_indexer_types(cfg, 4)
