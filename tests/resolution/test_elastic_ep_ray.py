"""flotilla's ``--elastic-ep-backend ray`` at dp_size 1: a deployment that starts
at one rank and grows to ``--max-ep-size`` DP ranks keeps the DP attention the
user asked for (a flotilla deviation; SGLang resets it at dp_size 1).
"""

import pytest

from flotilla.resolution import ModelFacts, ResolutionError, ServerArgs, preset, resolve

# A tiny Qwen3-MoE, as in the issue 7 acceptance invocation.
QWEN3_MOE = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe",
    "hidden_size": 64,
    "intermediate_size": 128,
    "moe_intermediate_size": 32,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_hidden_layers": 2,
    "vocab_size": 256,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "head_dim": 16,
    "max_position_embeddings": 512,
}

SINGLE_RANK = (
    "--tp", "1", "--dp", "1", "--ep", "1", "--enable-dp-attention", "--enable-dp-lm-head",
    "--disable-cuda-graph",
)
RAY_ELASTIC = (*SINGLE_RANK, "--elastic-ep-backend", "ray", "--max-ep-size", "2")


def run(*argv):
    return resolve(ServerArgs.from_cli(list(argv)), ModelFacts.from_hf_config(QWEN3_MOE), preset("h200"))


def rejection(*argv):
    with pytest.raises(ResolutionError) as info:
        run(*argv)
    return str(info.value)


def test_ray_elastic_keeps_dp_attention_at_one_rank():
    cfg = run(*RAY_ELASTIC)
    assert (cfg.enable_dp_attention, cfg.enable_dp_lm_head) == (True, True)
    assert (cfg.elastic_ep_backend, cfg.max_ep_size, cfg.elastic_ep_initial_size) == ("ray", 2, 1)
    assert cfg.enable_dp_attention_local_control_broadcast is True
    assert not any(
        p.rule == "_data_parallelism_defaults" and p.field == "enable_dp_attention" for p in cfg.provenance
    )


def test_without_an_elastic_backend_dp_attention_is_still_reset_at_one_rank():
    cfg = run(*SINGLE_RANK)
    assert (cfg.enable_dp_attention, cfg.enable_dp_lm_head) == (False, False)
    reset = [
        p for p in cfg.provenance if p.rule == "_data_parallelism_defaults" and p.field == "enable_dp_attention"
    ]
    assert len(reset) == 1 and reset[0].overrode_user


def test_max_ep_size_without_an_elastic_backend_is_still_rejected():
    message = rejection(*SINGLE_RANK, "--max-ep-size", "2")
    assert "--max-ep-size requires --elastic-ep-backend to be set." in message


def test_seed_backend_at_one_rank_still_loses_dp_attention():
    message = rejection(*SINGLE_RANK, "--elastic-ep-backend", "mooncake", "--moe-a2a-backend", "nixl",
                        "--max-ep-size", "2")
    assert "Elastic EP scale-up requires --enable-dp-attention" in message


def test_ray_elastic_without_scale_up_resets_dp_attention():
    cfg = run(*SINGLE_RANK, "--elastic-ep-backend", "ray")
    assert (cfg.enable_dp_attention, cfg.enable_dp_lm_head) == (False, False)


def test_ray_elastic_without_the_flag_still_requires_dp_attention():
    argv = tuple(a for a in RAY_ELASTIC if a not in ("--enable-dp-attention", "--enable-dp-lm-head"))
    assert "Elastic EP scale-up requires --enable-dp-attention" in rejection(*argv)


def test_ray_elastic_with_cuda_graphs_is_rejected():
    argv = tuple(a for a in RAY_ELASTIC if a != "--disable-cuda-graph")
    assert "requires decode and prefill CUDA graphs to be disabled" in rejection(*argv)


def test_ray_elastic_initial_size_must_match_the_launch_size():
    message = rejection(*RAY_ELASTIC, "--elastic-ep-initial-size", "2")
    assert "The primary --elastic-ep-initial-size must equal its launch-time TP size (1)." in message
