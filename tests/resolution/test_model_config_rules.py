"""The first ModelConfig build's checks, --json-model-override-args, the
flag-aware multimodal test and the deprecated CP-mode flags' choices.

Expected outcomes were taken from SGLang 0.5.19 (the oracle)."""

from __future__ import annotations

import pytest

from flotilla.resolution import ModelFacts, ResolutionError, ServerArgs, preset, resolve
from flotilla.resolution.errors import ArgumentError
from flotilla.resolution.model_derive import apply_overrides
from flotilla.resolution.rules import normalise
from flotilla.resolution.rules.normalise.graph_rules import apply_inkling_prefill_cuda_graph_default
from flotilla.resolution.rules.normalise.model_config import verify_model_config
from helpers.resolution_configs import LLAMA_8K

LLAMA = {**LLAMA_8K, "intermediate_size": 14336}

GPT_OSS = {
    "architectures": ["GptOssForCausalLM"],
    "model_type": "gpt_oss",
    "hidden_size": 2880,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "num_hidden_layers": 24,
    "vocab_size": 201088,
    "max_position_embeddings": 131072,
    "sliding_window": 128,
    "layer_types": ["sliding_attention", "full_attention"] * 12,
    "num_local_experts": 32,
    "num_experts_per_tok": 4,
    "intermediate_size": 2880,
    "quantization_config": {"quant_method": "mxfp4"},
}

GEMMA3 = {
    "architectures": ["Gemma3ForConditionalGeneration"],
    "model_type": "gemma3",
    "text_config": {
        "model_type": "gemma3_text",
        "hidden_size": 2560,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": 256,
        "num_hidden_layers": 34,
        "sliding_window": 1024,
        "max_position_embeddings": 131072,
    },
    "vision_config": {"model_type": "siglip_vision_model"},
}

CONTEXT_MESSAGE = (
    "Warning: User-specified context_length (9000) is greater than the derived context_length (8192)."
)


def _resolve(cfg, platform, *flags):
    return resolve(ServerArgs.from_cli(list(flags)), ModelFacts.from_hf_config(cfg), preset(platform))


def _errors(cfg, platform, *flags) -> list[str]:
    with pytest.raises(ResolutionError) as info:
        _resolve(cfg, platform, *flags)
    return [v.message for v in info.value.violations]


# -- item 1: the ModelConfig build at the Inkling slot ------------------------


def test_model_config_check_runs_just_before_the_inkling_default():
    steps = normalise.STEPS
    assert steps.index(verify_model_config) + 1 == steps.index(apply_inkling_prefill_cuda_graph_default)


def test_gpt_oss_mxfp4_is_unknown_on_mi300x():
    errors = _errors(GPT_OSS, "mi300x")
    assert errors[0].startswith("Unknown quantization method: mxfp4. Must be one of ['fp8', 'mxfp8',")
    assert errors[0].endswith("'humming', 'mxfp_w4a8'].")


def test_gpt_oss_mxfp4_resolves_on_mi355x_and_h100():
    for platform in ("mi355x", "h100"):
        config = _resolve(GPT_OSS, platform).config
        # ModelConfig keeps its quantization to itself: --quantization stays unset.
        assert config["quantization"] is None


def test_context_length_beyond_the_derived_one_is_rejected():
    errors = _errors(LLAMA, "h100", "--context-length", "9000")
    assert errors[0].startswith(CONTEXT_MESSAGE)
    assert errors[0].endswith("set the env var SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN=1")
    assert _resolve(LLAMA, "h100", "--context-length", "8192").config["context_length"] == 8192


def test_context_length_is_checked_before_quantization():
    awq = {**LLAMA, "quantization_config": {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True}}
    errors = _errors(awq, "h100", "--quantization", "fp8", "--context-length", "9000")
    assert errors[0].startswith(CONTEXT_MESSAGE)
    errors = _errors(awq, "h100", "--quantization", "fp8")
    assert errors[0] == (
        "Quantization method specified in the model config (awq) does not match the "
        "quantization method specified in the `quantization` argument (fp8)."
    )


# -- item 2: --json-model-override-args ---------------------------------------


def test_model_override_args_reach_the_derived_facts():
    flags = ("--context-length", "9000", "--json-model-override-args", '{"max_position_embeddings": 16384}')
    assert _resolve(LLAMA, "h100", *flags).config["context_length"] == 9000


def test_model_override_args_can_change_the_quantization():
    flags = ("--json-model-override-args", '{"quantization_config": {"quant_method": "fp8"}}')
    assert _resolve(GPT_OSS, "mi300x", *flags).config["quantization"] is None


def test_model_facts_with_overrides_rederive_from_the_raw_config():
    facts = ModelFacts.from_hf_config(LLAMA)
    assert facts.hf_raw_dict["max_position_embeddings"] == 8192
    assert facts.with_overrides({}) is facts
    assert facts.with_overrides({"max_position_embeddings": 4096}).context_len == 4096
    assert facts.context_len == 8192


def test_override_of_a_sub_config_updates_it():
    merged = apply_overrides(GEMMA3, {"text_config": {"max_position_embeddings": 4096}, "quantization_config": {"a": 1}})
    assert merged["text_config"]["num_hidden_layers"] == 34
    assert merged["text_config"]["max_position_embeddings"] == 4096
    assert merged["quantization_config"] == {"a": 1}
    assert ModelFacts.from_hf_config(merged).context_len == 4096


def test_model_override_args_must_be_a_json_object():
    with pytest.raises(ArgumentError, match="must be a JSON object"):
        _resolve(LLAMA, "h100", "--json-model-override-args", "[1]")


# -- item 3: multimodal under --model-impl transformers -----------------------


def test_gemma3_transformers_impl_is_multimodal():
    auto = _resolve(GEMMA3, "h100").config["cuda_graph_config"]
    transformers = _resolve(GEMMA3, "h100", "--model-impl", "transformers").config["cuda_graph_config"]
    assert auto["prefill"]["backend"] == "breakable"
    assert transformers["prefill"]["backend"] == "disabled"


# -- item 4: choices of the deprecated CP-mode flags --------------------------


@pytest.mark.parametrize(
    "flag, value",
    [
        ("--prefill-cp-mode", "round-robin-split"),
        ("--dsa-prefill-cp-mode", "bogus"),
        ("--nsa-prefill-cp-mode", "bogus"),
    ],
)
def test_deprecated_cp_mode_flags_enforce_choices(flag, value):
    with pytest.raises(ArgumentError, match="invalid choice"):
        ServerArgs.from_cli([flag, value])


def test_deprecated_cp_mode_flags_accept_their_choices():
    assert ServerArgs.from_cli(["--nsa-prefill-cp-mode", "in-seq-split"]).dsa_prefill_cp_mode == "in-seq-split"
    assert ServerArgs.from_cli(["--prefill-cp-mode", "in-seq-split"]).prefill_cp_mode == "in-seq-split"
    # SGLang's deprecated --mamba-scheduler-strategy declares no choices.
    assert ServerArgs.from_cli(["--mamba-scheduler-strategy", "x"]).mamba_radix_cache_strategy == "x"
