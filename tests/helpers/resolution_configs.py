"""Model configs (config.json dicts) and phase runners shared by the resolution tests.

The configs are layered: a test that needs a slightly different config builds it
from the nearest one here (``{**LLAMA_8K, "intermediate_size": 14336}``) so its
own file shows only what it changes. Treat them as read-only: tests copy before
changing one.
"""

from __future__ import annotations

import pytest

from flotilla.resolution import ModelFacts, ResolutionError, ServerArgs, preset
from flotilla.resolution.engine import run
from flotilla.resolution.fields import DEFAULTS, RESOLVABLE
from flotilla.resolution.platform import apply_flips
from flotilla.resolution.rules import CATALOG

MODEL_DIR = "/models/example"

FP8 = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3", "weight_block_size": [128, 128]}

# -- Llama-3 8B -------------------------------------------------------------------

# Architecture and attention shape only.
LLAMA_SHAPE = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 4096,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "num_hidden_layers": 32,
}
# With an 8K context and the Llama-3 vocabulary.
LLAMA_8K = {**LLAMA_SHAPE, "max_position_embeddings": 8192, "vocab_size": 128256}
# Llama-3.1 8B as its config.json has it (128K context, bf16).
LLAMA_128K = {
    **LLAMA_SHAPE,
    "intermediate_size": 14336,
    "vocab_size": 128256,
    "max_position_embeddings": 131072,
    "torch_dtype": "bfloat16",
    "rope_theta": 500000.0,
    "rms_norm_eps": 1e-5,
}

# -- DeepSeek V3 / V3.2 / V4 ---------------------------------------------------------

# Architecture and MLA attention shape only.
DEEPSEEK_V3_MLA = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "deepseek_v3",
    "hidden_size": 7168,
    "num_attention_heads": 128,
    "num_key_value_heads": 128,
    "num_hidden_layers": 61,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
}
# With routed experts, but no shared expert and no quantization config.
DEEPSEEK_V3_ROUTED = {
    **DEEPSEEK_V3_MLA,
    "q_lora_rank": 1536,
    "n_routed_experts": 256,
    "num_experts_per_tok": 8,
    "max_position_embeddings": 163840,
    "vocab_size": 129280,
}
# The full expert layout, unquantized.
DEEPSEEK_V3_BF16 = {**DEEPSEEK_V3_ROUTED, "n_shared_experts": 1}
# DeepSeek-V3 as released (block FP8).
DEEPSEEK_V3 = {**DEEPSEEK_V3_BF16, "quantization_config": FP8}
DEEPSEEK_V32 = {**DEEPSEEK_V3, "architectures": ["DeepseekV32ForCausalLM"], "model_type": "deepseek_v32",
                "index_topk": 2048, "index_head_dim": 128, "index_n_heads": 64}
DEEPSEEK_V4 = {
    "architectures": ["DeepseekV4ForCausalLM"],
    "model_type": "deepseek_v4",
    "hidden_size": 4096,
    "num_attention_heads": 64,
    "num_key_value_heads": 1,
    "num_hidden_layers": 43,
    "head_dim": 512,
    "q_lora_rank": 1024,
    "qk_rope_head_dim": 64,
    "n_routed_experts": 256,
    "num_experts_per_tok": 6,
    "index_topk": 512,
    "index_head_dim": 128,
    "index_n_heads": 64,
    "sliding_window": 128,
    "max_position_embeddings": 1048576,
    "vocab_size": 129280,
}


# -- running phases ------------------------------------------------------------------


def resolution_inputs(argv, hf, platform="b200", **flips):
    """(ServerArgs for ``--model-path MODEL_DIR *argv``, ModelFacts of ``hf``, platform facts).

    ``flips`` are platform facts to change on the preset (see ``apply_flips``).
    """
    args = ServerArgs.from_cli(["--model-path", MODEL_DIR, *argv])
    facts = preset(platform)
    if flips:
        facts = apply_flips(facts, flips)
    return args, ModelFacts.from_hf_config(hf), facts


def run_phases(phases, argv, hf, platform="b200", **flips):
    """Run ``phases`` on :func:`resolution_inputs`; return the engine outcome."""
    args, model, facts = resolution_inputs(argv, hf, platform, **flips)
    return run(
        phases,
        user=args.values,
        explicit=args.explicit,
        defaults=DEFAULTS,
        resolvable=RESOLVABLE,
        model=model,
        platform=facts,
    )


def through_model_phase(argv, hf, platform="b200", **flips):
    """Run the normalise and model phases; return the outcome (values, env, provenance)."""
    return run_phases(CATALOG[:2], argv, hf, platform, **flips)


def model_phase_error(argv, hf, platform="b200"):
    """The :class:`ResolutionError` the normalise and model phases raise."""
    with pytest.raises(ResolutionError) as info:
        through_model_phase(argv, hf, platform)
    return info.value


def declared_by(outcome, rule_name):
    """{field: value} a rule declared (its last declaration of each field)."""
    return {c.field: c.new for c in outcome.provenance if c.rule == rule_name}


def default_cpu_config():
    """The resolved config of a Llama-3 8K model with no flags on the CPU preset: what an
    ingress built over a stub engine takes for "no server field set"."""
    from flotilla.resolution import resolve

    return resolve(ServerArgs.create(model_path=MODEL_DIR), ModelFacts.from_hf_config(LLAMA_8K), preset("cpu"))
