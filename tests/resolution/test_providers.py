"""Model-override providers (resolution/rules/overrides/providers): each family's
declarations on the platform presets, checked rule by rule and (once the model
phase runs MODEL_PROVIDERS) through a full resolve.

Expected values were checked against SGLang 0.5.19's resolution (the oracle).
"""

from __future__ import annotations

import dataclasses

import pytest

from flotilla.resolution import resolve
from flotilla.resolution.args import ServerArgs
from flotilla.resolution.engine import Env, View
from flotilla.resolution.errors import ResolutionError, Violation
from flotilla.resolution.fields import DEFAULTS, RESOLVABLE
from flotilla.resolution.model import ModelFacts
from flotilla.resolution.platform import PRESETS, PlatformFacts, apply_flips, preset
from flotilla.resolution.rules.common import default_attention_backend
from flotilla.resolution.rules.overrides.providers import (
    exaone,
    falcon_h1,
    gemma2_gemma3,
    gemma4,
    gpt_oss,
    granitemoehybrid,
    inkling,
    interns2_mobius,
    lfm2,
    llama4,
    minicpm,
    minicpmv,
    moss_vl,
    muse_glimmer,
    nemotron_h,
    olmo2,
    qwen3_5,
    qwen3_moe,
    qwen3_vl,
    step3p,
)
from flotilla.resolution.rules.overrides.registry import providers_for

# -- helpers -------------------------------------------------------------------------


def view(*argv: str, env: dict | None = None, **declared) -> View:
    """The view a provider sees: CLI input overlaid with earlier declarations."""
    args = ServerArgs.from_cli(list(argv))
    return View({**args.values, **declared}, dict(env or {}), args.explicit, DEFAULTS)


def call(provider, platform, config, *argv, env=None, **declared) -> dict:
    """Run one provider rule on a fresh view."""
    model = config if isinstance(config, ModelFacts) else ModelFacts.from_hf_config(config)
    plat = preset(platform) if isinstance(platform, str) else platform
    return dict(provider.fn(view(*argv, env=env, **declared), model, plat) or {})


def violation(provider, platform, config, *argv, **kw) -> Violation:
    with pytest.raises(Violation) as info:
        call(provider, platform, config, *argv, **kw)
    return info.value


def arch(name: str, **extra) -> dict:
    return {"architectures": [name], **extra}


GPT_OSS = arch("GptOssForCausalLM", model_type="gpt_oss")
GPT_OSS_MXFP4 = {**GPT_OSS, "quantization_config": {"quant_method": "mxfp4"}}
QWEN3_NEXT = arch("Qwen3NextForCausalLM", model_type="qwen3_next")
QWEN3_MOE_FP8 = arch(
    "Qwen3MoeForCausalLM", model_type="qwen3_moe", quantization_config={"quant_method": "fp8"}
)
NEMOTRON_NVFP4 = arch(
    "NemotronHForCausalLM",
    model_type="nemotron_h",
    mlp_hidden_act="relu2",
    quantization_config={"quant_method": "modelopt", "quant_algo": "NVFP4"},
)
NEMOTRON_BF16 = arch("NemotronHForCausalLM", model_type="nemotron_h", mlp_hidden_act="relu2")
XPU = PlatformFacts(name="xpu", device="xpu")
MPS = PlatformFacts(name="mps", device="mps")
MUSA = PlatformFacts(name="musa", device="musa", capability=(8, 0))
AMX_CPU = PlatformFacts(name="cpu-amx", device="cpu", amx=True, triton_kernels=True)
MI300X_AITER = preset("mi300x").with_facts(aiter_enabled=True)


# -- registry ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "architecture, expected",
    [
        ("Qwen3NextForCausalLM", ["_qwen3_5_hybrid_overrides", "_qwen3_moe_family_overrides"]),
        (
            "InternS2MobiusForConditionalGeneration",
            ["_interns2_mobius_baseline_overrides", "_qwen3_5_hybrid_overrides"],
        ),
        ("Step3p5ForCausalLM", ["_step3p_overrides"]),
        ("MyStep3p7ForConditionalGenerationMTP", ["_step3p_overrides"]),
        ("GptOssForCausalLM", ["_gpt_oss_overrides"]),
        ("JetVLMForConditionalGeneration", ["_falcon_h1_jet_overrides"]),
        ("Gemma3nForConditionalGeneration", ["_gemma2_gemma3_overrides"]),
        ("LlamaForCausalLM", []),
    ],
)
def test_providers_registered_for_architecture(architecture, expected):
    names = [r.name for r in providers_for(architecture)]
    assert sorted(names) == sorted(expected)


ALL_PROVIDERS = [
    exaone._exaone_overrides,
    falcon_h1._falcon_h1_jet_overrides,
    gemma2_gemma3._gemma2_gemma3_overrides,
    gemma4._gemma4_overrides,
    gpt_oss._gpt_oss_overrides,
    granitemoehybrid._granite_moe_hybrid_overrides,
    inkling._inkling_overrides,
    interns2_mobius._interns2_mobius_baseline_overrides,
    lfm2._lfm2_overrides,
    llama4._llama4_overrides,
    minicpm._minicpm_sala_overrides,
    minicpmv._minicpm_v4_6_overrides,
    moss_vl._moss_vl_overrides,
    muse_glimmer._muse_glimmer_fp4_gemm_runner_overrides,
    nemotron_h._nemotron_h_overrides,
    olmo2._olmo2_overrides,
    qwen3_5._qwen3_5_hybrid_overrides,
    qwen3_moe._qwen3_moe_family_overrides,
    qwen3_vl._qwen3vl_overrides,
    step3p._step3p_overrides,
]


@pytest.mark.parametrize("platform", sorted(PRESETS))
@pytest.mark.parametrize("provider", ALL_PROVIDERS, ids=lambda r: r.name)
def test_providers_declare_only_resolvable_fields(provider, platform):
    assert provider.whitelist
    assert provider.overrides <= RESOLVABLE
    config = {**NEMOTRON_NVFP4, **GPT_OSS_MXFP4, "sliding_window_pattern": 4}
    declared = call(provider, platform, config)
    assert {k for k in declared if not isinstance(k, Env)} <= RESOLVABLE


# -- EXAONE / Gemma 2-3 / OLMo 2: hybrid SWA memory --------------------------------


def test_exaone_with_sliding_window_pattern_disables_hybrid_swa():
    config = arch("Exaone4ForCausalLM", model_type="exaone4", sliding_window_pattern="LLLG")
    assert call(exaone._exaone_overrides, "h100", config) == {"disable_hybrid_swa_memory": True}


def test_exaone_pattern_defaults_and_null_window():
    # The config class defaults the pattern to 4; a null window makes it 0: both not None.
    default = arch("ExaoneMoEForCausalLM", model_type="exaone_moe")
    no_window = arch("Exaone4ForCausalLM", sliding_window=None, sliding_window_pattern=None)
    assert call(exaone._exaone_overrides, "b200", default) == {"disable_hybrid_swa_memory": True}
    assert call(exaone._exaone_overrides, "b200", no_window) == {"disable_hybrid_swa_memory": True}


def test_exaone_null_pattern_declares_nothing():
    config = arch("Exaone4ForCausalLM", sliding_window=4096, sliding_window_pattern=None)
    assert call(exaone._exaone_overrides, "h100", config) == {}


@pytest.mark.parametrize("platform", ["cpu", "h100", "b200", "mi300x"])
def test_gemma2_gemma3_always_disable_hybrid_swa(platform):
    config = arch("Gemma3ForConditionalGeneration")
    assert call(gemma2_gemma3._gemma2_gemma3_overrides, platform, config) == {
        "disable_hybrid_swa_memory": True
    }


@pytest.mark.parametrize(
    "platform, backend",
    [("b200", "trtllm_mha"), ("a100", "fa3"), ("rtx-pro-6000", "fa3"), ("mi300x", "triton"), ("cpu", "triton")],
)
def test_olmo2_attention_per_platform(platform, backend):
    declared = call(olmo2._olmo2_overrides, platform, arch("Olmo2ForCausalLM"))
    assert declared == {"disable_hybrid_swa_memory": True, "attention_backend": backend}


def test_olmo2_keeps_explicit_attention():
    declared = call(olmo2._olmo2_overrides, "h100", arch("Olmo2ForCausalLM"), "--attention-backend", "flashinfer")
    assert declared == {"disable_hybrid_swa_memory": True}


# -- SM100 attention defaults of hybrid families -----------------------------------


@pytest.mark.parametrize(
    "provider, architecture, backend",
    [
        (falcon_h1._falcon_h1_jet_overrides, "FalconH1ForCausalLM", "triton"),
        (falcon_h1._falcon_h1_jet_overrides, "JetNemotronForCausalLM", "triton"),
        (minicpmv._minicpm_v4_6_overrides, "MiniCPMV4_6ForConditionalGeneration", "triton"),
        (lfm2._lfm2_overrides, "Lfm2MoeForCausalLM", "flashinfer"),
    ],
)
def test_sm100_attention_defaults(provider, architecture, backend):
    assert call(provider, "b200", arch(architecture)) == {"attention_backend": backend}
    assert call(provider, "gb200", arch(architecture)) == {"attention_backend": backend}
    assert call(provider, "h100", arch(architecture)) == {}
    assert call(provider, "rtx-pro-6000", arch(architecture)) == {}
    assert call(provider, "b200", arch(architecture), "--attention-backend", "fa4") == {}


def test_granite_hybrid_with_mamba_layers_takes_flashinfer_on_sm100():
    config = arch("GraniteMoeHybridForCausalLM", layer_types=["mamba", "attention"], num_hidden_layers=2)
    rule = granitemoehybrid._granite_moe_hybrid_overrides
    assert call(rule, "b200", config) == {"attention_backend": "flashinfer"}
    assert call(rule, "h100", config) == {}


def test_granite_layer_types_default_and_aliases():
    rule = granitemoehybrid._granite_moe_hybrid_overrides
    # No layer_types: SGLang's config class puts mamba layers between every sixth attention layer.
    assert call(rule, "b200", arch("GraniteMoeHybridForCausalLM", num_hidden_layers=6)) == {
        "attention_backend": "flashinfer"
    }
    aliased = arch("GraniteMoeHybridForCausalLM", layer_types=["linear_attention", "full_attention"])
    assert call(rule, "b200", aliased) == {"attention_backend": "flashinfer"}
    attention_only = arch("GraniteMoeHybridForCausalLM", layer_types=["attention", "attention"])
    assert call(rule, "b200", attention_only) == {}


# -- GPT-OSS ---------------------------------------------------------------------------


def test_gpt_oss_mxfp4_on_b200():
    declared = call(gpt_oss._gpt_oss_overrides, "b200", GPT_OSS_MXFP4, "--tp", "8")
    assert declared == {
        "attention_backend": "trtllm_mha",
        "dtype": "bfloat16",
        "moe_runner_backend": "flashinfer_mxfp4",
    }


def test_gpt_oss_mxfp4_on_sm120_and_hopper():
    assert call(gpt_oss._gpt_oss_overrides, "rtx-pro-6000", GPT_OSS_MXFP4) == {
        "attention_backend": "triton",
        "dtype": "bfloat16",
        "moe_runner_backend": "flashinfer_mxfp4",
    }
    assert call(gpt_oss._gpt_oss_overrides, "h100", GPT_OSS_MXFP4) == {
        "attention_backend": "fa3",
        "dtype": "bfloat16",
    }


@pytest.mark.parametrize(
    "platform, flips, runner",
    [
        ("b200", {"triton_kernels": "true"}, "triton_kernel"),
        ("b200", {"triton_kernels": "true", "driver_version": "595.0"}, "triton"),
        ("b300", {"triton_kernels": "true", "driver_version": "600.1"}, "triton"),
        ("rtx-pro-6000", {"triton_kernels": "true", "driver_version": "595.0"}, "triton"),
        ("h100", {"triton_kernels": "true", "driver_version": "595.0"}, "triton_kernel"),
        ("b200", {}, None),
    ],
)
def test_gpt_oss_bf16_triton_kernels(platform, flips, runner):
    plat = apply_flips(preset(platform), flips)
    declared = call(gpt_oss._gpt_oss_overrides, plat, GPT_OSS, "--tp", "8")
    assert declared.get("moe_runner_backend") == runner
    assert "dtype" not in declared


def test_gpt_oss_triton_kernels_needs_ep1_and_no_quantization():
    plat = apply_flips(preset("h100"), {"triton_kernels": "true"})
    assert "moe_runner_backend" not in call(gpt_oss._gpt_oss_overrides, plat, GPT_OSS, "--tp", "8", "--ep", "8")
    assert "moe_runner_backend" not in call(gpt_oss._gpt_oss_overrides, plat, GPT_OSS, "--quantization", "fp8")


def test_gpt_oss_explicit_choices_kept_but_mxfp4_forces_bf16():
    declared = call(
        gpt_oss._gpt_oss_overrides,
        "b200",
        GPT_OSS_MXFP4,
        "--moe-runner-backend",
        "triton",
        "--dtype",
        "float16",
        "--attention-backend",
        "triton",
    )
    assert declared == {"dtype": "bfloat16"}
    assert {"dtype", "moe_runner_backend"} <= gpt_oss._gpt_oss_overrides.overrides


def test_gpt_oss_rocm_aiter_branches():
    assert call(gpt_oss._gpt_oss_overrides, "mi300x", GPT_OSS) == {"attention_backend": "aiter"}
    assert call(gpt_oss._gpt_oss_overrides, MI300X_AITER, GPT_OSS) == {
        "attention_backend": "aiter",
        "moe_runner_backend": "triton",
    }
    assert call(gpt_oss._gpt_oss_overrides, MI300X_AITER, GPT_OSS_MXFP4) == {
        "attention_backend": "aiter",
        "dtype": "bfloat16",
        "moe_runner_backend": "auto",
    }


def test_gpt_oss_cpu_xpu_mps_musa():
    # On CPU the platform's attention default is declared before the providers run.
    assert call(gpt_oss._gpt_oss_overrides, "cpu", GPT_OSS, attention_backend="torch_native") == {}
    assert call(gpt_oss._gpt_oss_overrides, AMX_CPU, GPT_OSS) == {"attention_backend": "intel_amx"}
    assert call(gpt_oss._gpt_oss_overrides, XPU, GPT_OSS) == {"attention_backend": "intel_xpu"}
    assert call(gpt_oss._gpt_oss_overrides, MPS, GPT_OSS) == {"attention_backend": "triton"}
    assert call(
        gpt_oss._gpt_oss_overrides, MUSA, GPT_OSS, env={"SGLANG_DEEPEP_BF16_DISPATCH": "true"}
    ) == {"attention_backend": "triton", "moe_runner_backend": "deep_gemm"}


def test_gpt_oss_xpu_rejects_non_bf16_dtype():
    error = violation(gpt_oss._gpt_oss_overrides, XPU, GPT_OSS, "--dtype", "float16")
    assert error.kind == "NotImplementedError"
    assert "GptOssForCausalLM on Intel XPU only supports bfloat16 dtype, but got 'float16'" in error.message
    assert call(gpt_oss._gpt_oss_overrides, XPU, GPT_OSS, "--dtype", "bfloat16") == {
        "attention_backend": "intel_xpu"
    }


# -- Gemma 4 -----------------------------------------------------------------------------

GEMMA4 = arch("Gemma4ForConditionalGeneration", model_type="gemma4")
GEMMA4_NVFP4 = {**GEMMA4, "quantization_config": {"quant_method": "modelopt", "quant_algo": "NVFP4"}}


def test_gemma4_attention_defaults():
    assert call(gemma4._gemma4_overrides, "b200", GEMMA4) == {"attention_backend": "trtllm_mha"}
    assert call(gemma4._gemma4_overrides, "h100", GEMMA4) == {"attention_backend": "triton"}
    # Only one split side chosen: the base backend still gets the Gemma4 default.
    assert call(gemma4._gemma4_overrides, "h100", GEMMA4, "--prefill-attention-backend", "fa3") == {
        "attention_backend": "triton"
    }
    assert call(gemma4._gemma4_overrides, "h100", GEMMA4, "--attention-backend", "triton") == {}


def test_gemma4_modelopt_fp4_moe_on_sm100():
    assert call(gemma4._gemma4_overrides, "b200", GEMMA4_NVFP4) == {
        "attention_backend": "trtllm_mha",
        "quantization": "modelopt_fp4",
        "moe_runner_backend": "flashinfer_trtllm",
    }
    assert "quantization" not in call(gemma4._gemma4_overrides, "h100", GEMMA4_NVFP4)
    assert "quantization" not in call(
        gemma4._gemma4_overrides, "b200", GEMMA4_NVFP4, "--moe-runner-backend", "cutlass"
    )


# -- Llama 4 -----------------------------------------------------------------------------

LLAMA4 = arch("Llama4ForConditionalGeneration", model_type="llama4")


@pytest.mark.parametrize(
    "platform, backend",
    [("b200", "trtllm_mha"), ("h200", "fa3"), ("mi355x", "aiter"), ("a100", "triton"), ("rtx-pro-6000", "triton")],
)
def test_llama4_attention_per_platform(platform, backend):
    declared = call(llama4._llama4_overrides, platform, LLAMA4, device=preset(platform).torch_device)
    assert declared == {"attention_backend": backend}


def test_llama4_cpu_and_xpu_devices():
    assert call(llama4._llama4_overrides, "cpu", LLAMA4, device="cpu") == {}
    assert call(llama4._llama4_overrides, XPU, LLAMA4, device="xpu") == {"attention_backend": "intel_xpu"}


@pytest.mark.parametrize(
    "quantization, runner",
    [("fp8", "flashinfer_trtllm"), ("modelopt_fp8", "flashinfer_trtllm"), ("modelopt_fp4", None)],
)
def test_llama4_fp8_moe_on_sm100(quantization, runner):
    declared = call(llama4._llama4_overrides, "b200", LLAMA4, "--quantization", quantization, device="cuda")
    assert declared.get("moe_runner_backend") == runner


# -- Inkling -------------------------------------------------------------------------------

INKLING = arch("InklingForConditionalGeneration", model_type="inkling_mm_model")


def test_inkling_defaults_on_b200():
    declared = call(inkling._inkling_overrides, "b200", INKLING)
    assert declared == {
        "swa_full_tokens_ratio": 0.1,
        "mamba_full_memory_ratio": 0.1,
        "mamba_radix_cache_strategy": "extra_buffer",
        "attention_backend": "fa4",
        Env("SGLANG_ENABLE_UNIFIED_RADIX_TREE"): "True",
    }


def test_inkling_yields_to_non_default_user_values():
    declared = call(
        inkling._inkling_overrides,
        "h100",
        INKLING,
        "--swa-full-tokens-ratio",
        "0.5",
        "--mamba-full-memory-ratio",
        "0.9",  # equal to the default: replaced, as SGLang compares with the default
        "--mamba-scheduler-strategy",
        "no_buffer",
        "--attention-backend",
        "triton",
    )
    assert declared == {
        "mamba_full_memory_ratio": 0.1,
        Env("SGLANG_ENABLE_UNIFIED_RADIX_TREE"): "True",
    }
    assert call(inkling._inkling_overrides, "h100", INKLING)["attention_backend"] == "triton"


# -- Intern-S2-Mobius / Muse Glimmer / Qwen3-VL ------------------------------------------


def test_interns2_mobius_moe_runner():
    config = arch("InternS2MobiusForConditionalGeneration")
    rule = interns2_mobius._interns2_mobius_baseline_overrides
    assert call(rule, "h100", config) == {"moe_runner_backend": "triton_kernel"}
    assert call(rule, "h100", config, "--moe-runner-backend", "auto") == {"moe_runner_backend": "triton_kernel"}
    assert call(rule, "h100", config, "--moe-runner-backend", "triton") == {}


def test_muse_glimmer_fp4_gemm_runner_on_sm120():
    rule = muse_glimmer._muse_glimmer_fp4_gemm_runner_overrides
    config = arch("MuseGlimmerForCausalLM")
    assert call(rule, "rtx-pro-6000", config) == {"fp4_gemm_runner_backend": "marlin"}
    assert call(rule, "b200", config) == {}
    assert call(rule, "rtx-pro-6000", config, "--fp4-gemm-backend", "flashinfer_cutlass") == {}


def test_qwen3_vl_aiter_unified_attention_page_size():
    rule = qwen3_vl._qwen3vl_overrides
    config = arch("Qwen3VLForConditionalGeneration")
    env = {"SGLANG_USE_AITER_UNIFIED_ATTN": "True"}
    assert call(rule, "mi300x", config, env=env) == {"page_size": 16}
    assert call(rule, "mi300x", config) == {}
    assert call(rule, "mi300x", config, "--page-size", "32", env=env) == {}
    assert call(rule, "h100", config, env=env) == {}


# -- MiniCPM ---------------------------------------------------------------------------------

SALA = dict(
    architectures=["MiniCPMSALAForCausalLM"],
    model_type="minicpm_sala",
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=8,
)
SALA_SPARSE_LIGHTNING = {**SALA, "mixer_types": ["minicpm4", "lightning"], "sparse_config": {"kernel_size": 32}}
SALA_LIGHTNING = {**SALA, "mixer_types": ["minicpm4", "lightning"]}
SALA_SPARSE = {**SALA, "sparse_config": {"kernel_size": 32}}


def test_minicpm_sala_sparse_defaults():
    rule = minicpm._minicpm_sala_overrides
    assert call(rule, "h100", SALA_SPARSE_LIGHTNING) == {
        "disable_radix_cache": True,
        "attention_backend": "minicpm_flashattn",
    }
    assert call(rule, "b200", SALA_SPARSE_LIGHTNING) == {
        "disable_radix_cache": True,
        "attention_backend": "minicpm_flashinfer",
    }
    assert call(rule, "h100", SALA_LIGHTNING) == {"disable_radix_cache": True}
    assert call(rule, "h100", SALA_SPARSE, "--attention-backend", "triton") == {"disable_radix_cache": True}
    assert call(rule, "h100", SALA) == {}


def test_minicpm_plain_config_reads_stated_flags():
    config = arch("MiniCPMForCausalLM", model_type="minicpm", has_lightning_layers=True)
    assert call(minicpm._minicpm_sala_overrides, "h100", config) == {"disable_radix_cache": True}


def test_minicpm_rejections():
    rule = minicpm._minicpm_sala_overrides
    error = violation(rule, "h100", SALA, "--tp", "2", "--dp", "2", "--enable-dp-attention")
    assert error.message == "MiniCPM does not support DP attention"
    error = violation(rule, "h100", SALA_LIGHTNING, "--enable-hierarchical-cache")
    assert error.message == "MiniCPM SALA does not support hierarchical cache"
    error = violation(rule, "h100", SALA_SPARSE, "--disaggregation-mode", "prefill")
    assert error.message == "MiniCPM sparse attention does not support PD disaggregation"


def test_minicpm_force_dense_swaps_sparse_backends():
    declared = call(
        minicpm._minicpm_sala_overrides,
        "b200",
        SALA_SPARSE,
        "--prefill-attention-backend",
        "minicpm_flashattn",
        "--decode-attention-backend",
        "minicpm_flashinfer",
        env={"SGLANG_MINICPM_FORCE_DENSE": "1"},
    )
    assert declared == {
        "disable_radix_cache": True,
        "prefill_attention_backend": "fa4",
        "decode_attention_backend": "flashinfer",
    }


# -- MOSS-VL ------------------------------------------------------------------------------------

MOSS = arch("MossVLForConditionalGeneration")


def test_moss_vl_prefill_backend():
    rule = moss_vl._moss_vl_overrides
    assert call(rule, "h100", MOSS) == {"prefill_attention_backend": "flashinfer"}
    assert call(rule, "h100", MOSS, "--attention-backend", "fa3", "--prefill-attention-backend", "flashinfer") == {}
    error = violation(rule, "h100", MOSS, "--attention-backend", "triton")
    assert error.kind == "AssertionError"
    assert error.message == (
        "MossVLForConditionalGeneration requires flashinfer prefill "
        "attention backend for cross-attention custom mask support."
    )


# -- Nemotron-H ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "platform, runner, attention",
    [
        ("b200", "flashinfer_trtllm", "trtllm_mha"),
        ("h100", "marlin", None),
        ("a100", "marlin", None),
        ("rtx-pro-6000", "flashinfer_cutlass", None),
    ],
)
def test_nemotron_h_nvfp4(platform, runner, attention):
    declared = call(nemotron_h._nemotron_h_overrides, platform, NEMOTRON_NVFP4, "--tp", "2")
    assert declared.get("quantization") == "modelopt_fp4"
    assert declared.get("moe_runner_backend") == runner
    assert declared.get("attention_backend") == attention


def test_nemotron_h_bf16_and_a2a():
    assert call(nemotron_h._nemotron_h_overrides, "h100", NEMOTRON_BF16) == {"moe_runner_backend": "flashinfer_cutlass"}
    a2a = ("--ep", "2", "--moe-a2a-backend", "deepep")
    declared = call(nemotron_h._nemotron_h_overrides, "b200", NEMOTRON_NVFP4, *a2a)
    assert declared["moe_runner_backend"] == "flashinfer_cutlass"
    fp8 = {**NEMOTRON_BF16, "quantization_config": {"quant_method": "fp8"}}
    assert "moe_runner_backend" not in call(nemotron_h._nemotron_h_overrides, "h100", fp8)


def test_nemotron_h_speculative_attention_on_blackwell():
    eagle = ("--speculative-algorithm", "EAGLE", "--speculative-eagle-topk")
    declared = call(nemotron_h._nemotron_h_overrides, "b200", NEMOTRON_NVFP4, *eagle, "1")
    assert declared["attention_backend"] == "trtllm_mha"
    assert declared["page_size"] == 64
    assert declared["mamba_radix_cache_strategy"] == "extra_buffer"
    assert declared["speculative_draft_attention_backend"] == "trtllm_mha"
    declared = call(nemotron_h._nemotron_h_overrides, "b200", NEMOTRON_NVFP4, *eagle, "4")
    assert declared["attention_backend"] == "triton"
    assert declared["speculative_draft_attention_backend"] == "flashinfer"
    assert "page_size" not in declared
    declared = call(nemotron_h._nemotron_h_overrides, "rtx-pro-6000", NEMOTRON_NVFP4, *eagle, "1")
    assert declared["attention_backend"] == "triton"


def test_nemotron_h_w4a16_moe_layers():
    mixed = {
        **NEMOTRON_BF16,
        "quantization_config": {
            "quant_method": "modelopt",
            "quant_algo": "MIXED_PRECISION",
            "quantized_layers": {"backbone.layers.1.mixer.experts.0.up_proj": {"quant_algo": "W4A16_NVFP4"}},
        },
    }
    rule = nemotron_h._nemotron_h_overrides
    declared = call(rule, "b200", mixed)
    assert declared["quantization"] == "modelopt_mixed"
    assert declared["moe_runner_backend"] == "marlin"
    error = violation(rule, "b200", mixed, "--moe-runner-backend", "triton")
    assert error.message == "W4A16_NVFP4 MoE layers require --moe-runner-backend=marlin."
    error = violation(rule, "b200", mixed, "--ep", "2", "--moe-a2a-backend", "deepep")
    assert error.message == "W4A16_NVFP4 MoE layers require --moe-a2a-backend=none."


def test_nemotron_h_modelopt_requires_relu2():
    config = {**NEMOTRON_NVFP4, "mlp_hidden_act": "silu"}
    assert violation(nemotron_h._nemotron_h_overrides, "b200", config).kind == "AssertionError"


# -- Qwen3.5 / Qwen3-Next hybrids ----------------------------------------------------------------


@pytest.mark.parametrize(
    "argv, backend, page",
    [
        ((), "triton", 1),
        (("--disable-radix-cache",), "trtllm_mha", 64),
        (("--mamba-scheduler-strategy", "extra_buffer"), "trtllm_mha", 64),
        (("--page-size", "16"), "triton", 1),
        (("--speculative-algorithm", "EAGLE", "--speculative-eagle-topk", "1"), "trtllm_mha", 64),
        (("--speculative-algorithm", "EAGLE", "--speculative-eagle-topk", "4"), "triton", 1),
    ],
)
def test_qwen3_5_hybrid_on_sm100(argv, backend, page):
    declared = call(qwen3_5._qwen3_5_hybrid_overrides, "b200", QWEN3_NEXT, "--tp", "4", *argv)
    assert declared == {"attention_backend": backend, "page_size": page}


def test_qwen3_5_hybrid_only_on_sm100_without_backend():
    rule = qwen3_5._qwen3_5_hybrid_overrides
    assert call(rule, "h100", QWEN3_NEXT, "--disable-radix-cache") == {}
    assert call(rule, "rtx-pro-6000", QWEN3_NEXT) == {}
    assert call(rule, "b200", QWEN3_NEXT, "--attention-backend", "flashinfer") == {}


def test_qwen3_5_hybrid_asymmetric_kv_default_is_fa4_so_triton():
    model = dataclasses.replace(ModelFacts.from_hf_config(QWEN3_NEXT), has_asymmetric_kv=True)
    declared = call(qwen3_5._qwen3_5_hybrid_overrides, "b200", model, "--disable-radix-cache")
    assert declared == {"attention_backend": "triton", "page_size": 1}


# -- Qwen3 MoE family ------------------------------------------------------------------------------


def test_qwen3_moe_fp8_on_b200():
    assert call(qwen3_moe._qwen3_moe_family_overrides, "b200", QWEN3_MOE_FP8) == {
        "quantization": "fp8",
        "moe_runner_backend": "flashinfer_trtllm",
    }
    assert call(qwen3_moe._qwen3_moe_family_overrides, "h100", QWEN3_MOE_FP8) == {}


def test_qwen3_moe_unquant_keeps_quantization_off():
    declared = call(
        qwen3_moe._qwen3_moe_family_overrides, "b200", QWEN3_MOE_FP8, "--quantization", "unquant", quantization=None
    )
    assert declared == {"moe_runner_backend": "flashinfer_trtllm"}


def test_qwen3_moe_a2a_or_other_quantization_keeps_runner():
    rule = qwen3_moe._qwen3_moe_family_overrides
    assert call(rule, "b200", QWEN3_MOE_FP8, "--ep", "8", "--moe-a2a-backend", "deepep") == {"quantization": "fp8"}
    awq = {**QWEN3_MOE_FP8, "quantization_config": {"quant_method": "awq"}}
    assert call(rule, "b200", awq) == {"quantization": "awq"}
    bf16 = arch("Qwen3_5MoeForConditionalGeneration")
    assert call(rule, "b300", bf16) == {"moe_runner_backend": "flashinfer_trtllm"}


# -- Step 3.5 / 3.7 ----------------------------------------------------------------------------------

STEP = arch(
    "Step3p5ForCausalLM",
    model_type="step3p5",
    num_hidden_layers=4,
    layer_types=["full_attention", "sliding_attention", "sliding_attention", "sliding_attention"],
    sliding_window=512,
    moe_layers_enum="[3]",
    num_attention_heads=64,
    num_attention_groups=8,
    head_dim=128,
    hidden_size=4096,
)


@pytest.mark.parametrize(
    "platform, backend", [("b200", "fa4"), ("rtx-pro-6000", "fa4"), ("h200", "fa3"), ("a100", None), ("mi300x", None)]
)
def test_step3p_attention(platform, backend):
    assert call(step3p._step3p_overrides, platform, STEP).get("attention_backend") == backend


def test_step3p_eagle_and_hierarchical_cache():
    declared = call(step3p._step3p_overrides, "h100", STEP, "--speculative-algorithm", "EAGLE")
    assert declared == {"attention_backend": "fa3", "enable_multi_layer_eagle": True}
    hicache = ("--enable-hierarchical-cache", "--swa-full-tokens-ratio", "0.5")
    declared = call(step3p._step3p_overrides, "h100", STEP, *hicache)
    assert declared == {"attention_backend": "fa3", "swa_full_tokens_ratio": 1.0, "disable_hybrid_swa_memory": True}


# -- the default attention backend (shared with the passes) --------------------------------------


@pytest.mark.parametrize(
    "platform, argv, backend",
    [
        ("h100", (), "fa3"),
        ("h100", ("--speculative-algorithm", "EAGLE", "--speculative-eagle-topk", "4"), "flashinfer"),
        ("b200", (), "trtllm_mha"),
        ("b200", ("--speculative-algorithm", "EAGLE"), "flashinfer"),
        ("rtx-pro-6000", (), "flashinfer"),
        ("a100", (), "flashinfer"),
        ("mi300x", (), "aiter"),
        ("cpu", (), "triton"),
    ],
)
def test_default_attention_backend_mha(platform, argv, backend):
    model = ModelFacts.from_hf_config(arch("LlamaForCausalLM"))
    assert default_attention_backend(view(*argv), model, preset(platform)) == backend


def test_default_attention_backend_special_cases():
    llama = ModelFacts.from_hf_config(arch("LlamaForCausalLM"))
    sinks = dataclasses.replace(llama, has_attention_sinks=True)
    assert default_attention_backend(view(), sinks, preset("a100")) == "triton"
    assert default_attention_backend(view(), llama, apply_flips(preset("a100"), {"flashinfer": "false"})) == "triton"
    assert default_attention_backend(view(), llama, MPS) == "torch_native"
    whisper = ModelFacts.from_hf_config(arch("WhisperForConditionalGeneration"))
    assert default_attention_backend(view(), whisper, preset("h100")) == "flashinfer"


@pytest.mark.parametrize(
    "platform, tp, backend",
    [
        ("h100", 8, "fa3"),
        ("b200", 8, "flashinfer"),
        ("a100", 8, "triton"),
        ("mi300x", 8, "aiter"),  # 128 KV heads over 8 ranks: 16 per rank
        ("mi300x", 4, "triton"),
    ],
)
def test_default_attention_backend_mla(platform, tp, backend):
    model = ModelFacts.from_hf_config(arch("DeepseekV3ForCausalLM", kv_lora_rank=512, num_attention_heads=128))
    assert model.is_mla
    assert default_attention_backend(view("--tp", str(tp)), model, preset(platform)) == backend


def test_default_attention_backend_mla_rocm_head_counts():
    mla = ModelFacts.from_hf_config(arch("DeepseekV3ForCausalLM", kv_lora_rank=512))
    for heads, backend in ((16, "aiter"), (128, "aiter"), (32, "triton")):
        model = dataclasses.replace(mla)
        # NOTE: per-rank KV heads come from ModelFacts; pin them to isolate the choice.
        object.__setattr__(model, "num_kv_heads", lambda tp, h=heads: h)
        assert default_attention_backend(view(), model, preset("mi355x")) == backend


# -- full resolve through the model phase ------------------------------


RESOLVE_CASES = [
    (
        "gptoss-mxfp4-b200",
        "b200",
        {},
        GPT_OSS_MXFP4,
        ["--tp", "8"],
        {"attention_backend": "trtllm_mha", "dtype": "bfloat16", "moe_runner_backend": "flashinfer_mxfp4"},
    ),
    (
        "gptoss-bf16-b200-tk-drv595",
        "b200",
        {"triton_kernels": "true", "driver_version": "595.0"},
        GPT_OSS,
        ["--tp", "8"],
        {"attention_backend": "trtllm_mha", "moe_runner_backend": "triton", "dtype": "auto"},
    ),
    (
        "gptoss-bf16-b200-tk",
        "b200",
        {"triton_kernels": "true"},
        GPT_OSS,
        ["--tp", "8", "--moe-runner-backend", "auto"],
        {"moe_runner_backend": "triton_kernel"},
    ),
    (
        "gptoss-mxfp4-b200-explicit",
        "b200",
        {},
        GPT_OSS_MXFP4,
        ["--tp", "8", "--moe-runner-backend", "triton", "--dtype", "float16", "--attention-backend", "triton"],
        {"attention_backend": "triton", "dtype": "bfloat16", "moe_runner_backend": "triton"},
    ),
    ("llama4-h100", "h100", {}, LLAMA4, ["--tp", "8"], {"attention_backend": "fa3", "moe_runner_backend": "auto"}),
    ("llama4-mi300x", "mi300x", {}, LLAMA4, ["--tp", "8"], {"attention_backend": "aiter"}),
    (
        "llama4-b200-fp8",
        "b200",
        {},
        LLAMA4,
        ["--tp", "8", "--quantization", "fp8"],
        {"attention_backend": "trtllm_mha", "moe_runner_backend": "flashinfer_trtllm", "quantization": "fp8"},
    ),
    (
        "gemma4-nvfp4-b200",
        "b200",
        {},
        GEMMA4_NVFP4,
        ["--tp", "4"],
        {"attention_backend": "trtllm_mha", "quantization": "modelopt_fp4", "moe_runner_backend": "flashinfer_trtllm"},
    ),
    (
        "olmo2-a100",
        "a100",
        {},
        arch("Olmo2ForCausalLM", model_type="olmo2"),
        ["--tp", "2"],
        {"attention_backend": "fa3", "disable_hybrid_swa_memory": True},
    ),
    (
        "qwen3next-b200-noradix",
        "b200",
        {},
        QWEN3_NEXT,
        ["--tp", "4", "--disable-radix-cache"],
        {"attention_backend": "trtllm_mha", "page_size": 64, "moe_runner_backend": "flashinfer_trtllm"},
    ),
    (
        "qwen3moe-unquant-b200",
        "b200",
        {},
        QWEN3_MOE_FP8,
        ["--tp", "8", "--quantization", "unquant"],
        {"quantization": None, "moe_runner_backend": "flashinfer_trtllm"},
    ),
    (
        "nemotronh-nvfp4-h100",
        "h100",
        {},
        NEMOTRON_NVFP4,
        ["--tp", "2"],
        {"quantization": "modelopt_fp4", "moe_runner_backend": "marlin"},
    ),
    (
        "step3p5-h100-hicache",
        "h100",
        {},
        STEP,
        ["--tp", "8", "--enable-hierarchical-cache"],
        {"attention_backend": "fa3", "swa_full_tokens_ratio": 1.0, "disable_hybrid_swa_memory": True},
    ),
    (
        "muse-rtx",
        "rtx-pro-6000",
        {},
        arch(
            "MuseGlimmerForCausalLM",
            model_type="muse_glimmer",
            num_hidden_layers=4,
            layer_types=["sliding_attention", "full_attention"] * 2,
            no_rope_layers=[0, 1, 0, 1],
        ),
        ["--tp", "2"],
        {"fp4_gemm_runner_backend": "marlin"},
    ),
    (
        "minicpm-sala-b200",
        "b200",
        {},
        SALA_SPARSE_LIGHTNING,
        ["--tp", "2"],
        {"attention_backend": "minicpm_flashinfer", "disable_radix_cache": True},
    ),
]


@pytest.mark.parametrize("case", RESOLVE_CASES, ids=[c[0] for c in RESOLVE_CASES])
def test_full_resolve(case):
    _name, platform, flips, config, argv, expected = case
    resolved = resolve(
        ServerArgs.from_cli(argv), ModelFacts.from_hf_config(config), apply_flips(preset(platform), flips)
    )
    got = {field: resolved.config[field] for field in expected}
    assert got == expected


def test_full_resolve_inkling_sets_unified_radix_env():
    resolved = resolve(ServerArgs.from_cli(["--tp", "2"]), ModelFacts.from_hf_config(INKLING), preset("b200"))
    assert resolved.config["attention_backend"] == "fa4"
    assert resolved.config["mamba_full_memory_ratio"] == 0.1
    assert str(resolved.env["SGLANG_ENABLE_UNIFIED_RADIX_TREE"]).lower() in ("true", "1")


def test_full_resolve_minicpm_dp_attention_rejected():
    with pytest.raises(ResolutionError, match="MiniCPM does not support DP attention"):
        resolve(
            ServerArgs.from_cli(["--tp", "2", "--dp", "2", "--enable-dp-attention"]),
            ModelFacts.from_hf_config(SALA),
            preset("h100"),
        )
