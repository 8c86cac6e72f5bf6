"""Elastic expert parallelism: SGLang's rules (checked against SGLang 0.5.19's
resolution on the same flags) and flotilla's ``--elastic-ep-backend ray``
deviation (flotilla-only, so no reference exists for it).
"""

import pytest

from flotilla.resolution import ArgumentError, ModelFacts, ResolutionError, ServerArgs, preset, resolve
from helpers.resolution_configs import DEEPSEEK_V3_BF16

DSV3 = {
    **DEEPSEEK_V3_BF16,
    "moe_intermediate_size": 2048,
    "intermediate_size": 18432,
    "first_k_dense_replace": 3,
    "torch_dtype": "bfloat16",
    "num_nextn_predict_layers": 1,
    "rms_norm_eps": 1e-6,
}

# A primary that may grow from 8 to 16 EP ranks (SGLang's seed backend).
SCALE_UP = (
    "--tp", "8", "--dp-size", "8", "--enable-dp-attention", "--enable-dp-lm-head",
    "--moe-a2a-backend", "nixl", "--elastic-ep-backend", "mooncake", "--max-ep-size", "16",
    "--disable-cuda-graph",
)
JOINER = ("--elastic-ep-join-mode", "scale", "--node-rank", "1", "--elastic-ep-join-rank-offset", "8")


def run(*argv):
    return resolve(ServerArgs.from_cli(list(argv)), ModelFacts.from_hf_config(DSV3), preset("b200"))


def rejection(*argv):
    with pytest.raises(ResolutionError) as info:
        run(*argv)
    return str(info.value)


def with_backend(argv, backend):
    """``argv`` with the elastic EP backend replaced."""
    out = list(argv)
    out[out.index("--elastic-ep-backend") + 1] = backend
    return tuple(out)


def with_a2a(argv, backend):
    """``argv`` with the MoE A2A backend replaced."""
    out = list(argv)
    out[out.index("--moe-a2a-backend") + 1] = backend
    return tuple(out)


def without(argv, *flags):
    return tuple(a for a in argv if a not in flags)


# -- SGLang's rules -----------------------------------------------------------


def test_scale_up_primary_defaults_its_initial_size_and_broadcast():
    cfg = run(*SCALE_UP)
    assert cfg.elastic_ep_initial_size == 8
    assert cfg.enable_dp_attention_local_control_broadcast is True
    assert (cfg.moe_a2a_backend, cfg.ep_size) == ("nixl", 8)


def test_scale_joiner_resolves_with_the_primary_size():
    cfg = run(*SCALE_UP, *JOINER, "--elastic-ep-initial-size", "8")
    assert (cfg.ep_join_mode, cfg.elastic_ep_initial_size) == ("scale", 8)
    assert cfg.enable_dp_attention_local_control_broadcast is True


def test_deprecated_rejoin_means_recover_and_eplb_becomes_elasticity_aware():
    cfg = run("--tp", "8", "--elastic-ep-backend", "mooncake", "--elastic-ep-rejoin", "--enable-eplb",
              "--moe-a2a-backend", "deepep")
    assert (cfg.ep_join_mode, cfg.eplb_algorithm) == ("recover", "elasticity_aware")


def test_a_none_backend_string_still_counts_as_elastic():
    cfg = run("--tp", "8", "--elastic-ep-backend", "none", "--enable-eplb", "--moe-a2a-backend", "deepep")
    assert cfg.eplb_algorithm == "elasticity_aware"


@pytest.mark.parametrize(
    "argv, message",
    [
        (SCALE_UP + ("--use-ray",), "Elastic EP runtime scale-up does not support --use-ray."),
        (
            with_backend(SCALE_UP, "nixl"),
            "Elastic EP runtime scale-up requires --elastic-ep-backend mooncake (got elastic_ep_backend=nixl).",
        ),
        (
            without(SCALE_UP, "--moe-a2a-backend", "nixl") + ("--ep-size", "8"),
            "Elastic EP scale-up requires --moe-a2a-backend nixl (got moe_a2a_backend=none).",
        ),
        (
            without(SCALE_UP, "--disable-cuda-graph"),
            "Elastic EP runtime scale-up requires decode and prefill CUDA graphs to be disabled.",
        ),
        (
            without(SCALE_UP, "--enable-dp-lm-head"),
            "Elastic EP scale-up requires --enable-dp-lm-head so output projection",
        ),
        (
            SCALE_UP + ("--load-balance-method", "total_requests"),
            "Elastic EP scale-up requires --load-balance-method round_robin; load-aware methods require "
            "global-rank load snapshots after scale (got total_requests).",
        ),
        (SCALE_UP + ("--elastic-ep-scale-timeout", "0"), "--elastic-ep-scale-timeout must be greater than zero."),
        (SCALE_UP + ("--tokenizer-worker-num", "2"), "requires --tokenizer-worker-num 1."),
        (SCALE_UP + ("--enable-elastic-expert-backup",), "does not support --enable-elastic-expert-backup."),
        (
            SCALE_UP + ("--elastic-ep-initial-size", "4"),
            "The primary --elastic-ep-initial-size must equal its launch-time TP size (8).",
        ),
        (SCALE_UP + JOINER, "Elastic EP scale joiners require --elastic-ep-initial-size"),
        (
            SCALE_UP + JOINER + ("--elastic-ep-initial-size", "12"),
            "--elastic-ep-initial-size cannot exceed the current EP size (initial=12, current=8).",
        ),
        (
            SCALE_UP + ("--elastic-ep-join-mode", "scale", "--node-rank", "1", "--elastic-ep-join-rank-offset", "12",
                        "--elastic-ep-initial-size", "8"),
            "Elastic EP joining group exceeds --max-ep-size (join_target=20, max_ep_size=16).",
        ),
        (
            SCALE_UP + ("--elastic-ep-join-mode", "scale", "--node-rank", "1"),
            "Elastic EP scale joiners require --elastic-ep-join-rank-offset set to the current effective EP size.",
        ),
        (
            SCALE_UP + ("--elastic-ep-join-rank-offset", "8"),
            "--elastic-ep-join-rank-offset is only valid with --elastic-ep-join-mode scale.",
        ),
        (
            ("--tp", "8", "--elastic-ep-backend", "mooncake", "--elastic-ep-rejoin", "--elastic-ep-join-mode", "scale"),
            "--elastic-ep-rejoin (deprecated) conflicts with --elastic-ep-join-mode scale.",
        ),
        (
            ("--tp", "8", "--elastic-ep-backend", "mooncake", "--enable-eplb", "--moe-a2a-backend", "deepep",
             "--eplb-algorithm", "deepseek"),
            "Elastic EP requires eplb_algorithm to be set to 'auto' or 'elasticity_aware(_hierarchical)'.",
        ),
        (("--tp", "4", "--pp-size", "2", "--elastic-ep-backend", "mooncake"), "PP size should be set to 1 under elastic EP"),
        (("--tp", "8", "--elastic-ep-join-mode", "recover"), "--elastic-ep-join-mode requires --elastic-ep-backend to be set."),
        (("--tp", "8", "--max-ep-size", "16"), "--max-ep-size requires --elastic-ep-backend to be set."),
        (
            ("--tp", "8", "--elastic-ep-backend", "mooncake", "--max-ep-size", "8", "--elastic-ep-initial-size", "8"),
            "--elastic-ep-initial-size is only valid for an Elastic EP deployment with --max-ep-size larger",
        ),
    ],
)
def test_seed_violations(argv, message):
    assert message in rejection(*argv)


def test_joiner_at_node_rank_zero_is_rejected():
    message = rejection(*SCALE_UP, "--elastic-ep-join-mode", "scale", "--node-rank", "0",
                        "--elastic-ep-join-rank-offset", "8", "--elastic-ep-initial-size", "8")
    assert "Elastic EP scale-up requires one joining TP group at --node-rank 1 (got 0)." in message


def test_single_rank_joiner_needs_dense_tp_one():
    single = ("--tp", "1", "--dp-size", "1") + SCALE_UP[4:] + JOINER + ("--elastic-ep-initial-size", "8")
    message = rejection(*single)
    assert "A single-rank Elastic EP joining group requires --moe-dense-tp-size 1." in message
    cfg = run(*single, "--moe-dense-tp-size", "1")
    assert cfg.enable_dp_attention is True  # a scale joiner keeps DP attention at dp_size 1
    assert cfg.moe_dense_tp_size == 1


def test_mooncake_ib_devices_are_deduplicated():
    cfg = run("--tp", "8", "--elastic-ep-backend", "mooncake", "--mooncake-ib-device", "mlx5_0, mlx5_1,mlx5_0")
    assert cfg.mooncake_ib_device == "mlx5_0,mlx5_1"


# -- flotilla's Ray backend (deviation) ---------------------------------------

RAY_SCALE_UP = with_backend(SCALE_UP, "ray")


def test_ray_is_an_accepted_elastic_backend_and_sglang_backends_still_parse():
    assert ServerArgs.from_cli(["--elastic-ep-backend", "ray"]).elastic_ep_backend == "ray"
    assert ServerArgs.from_cli(["--elastic-ep-backend", "mooncake"]).elastic_ep_backend == "mooncake"
    with pytest.raises(ArgumentError):
        ServerArgs.from_cli(["--elastic-ep-backend", "gloo"])


def test_ray_backend_scales_up_under_ray_with_nixl():
    cfg = run(*RAY_SCALE_UP, "--use-ray")
    assert cfg.elastic_ep_initial_size == 8
    assert cfg.enable_dp_attention_local_control_broadcast is True
    assert cfg.use_ray is True


def test_ray_backend_scales_up_without_an_a2a_backend():
    cfg = run(*without(RAY_SCALE_UP, "--moe-a2a-backend", "nixl"), "--ep-size", "8")
    assert (cfg.moe_a2a_backend, cfg.ep_size, cfg.elastic_ep_initial_size) == ("none", 8, 8)


def test_ray_backend_does_not_touch_mooncake_devices():
    cfg = run("--tp", "8", "--elastic-ep-backend", "ray", "--mooncake-ib-device", "mlx5_0,mlx5_0")
    assert cfg.mooncake_ib_device == "mlx5_0,mlx5_0"


def test_ray_joiner_resolves():
    cfg = run(*RAY_SCALE_UP, *JOINER, "--elastic-ep-initial-size", "8", "--use-ray")
    assert (cfg.ep_join_mode, cfg.elastic_ep_initial_size) == ("scale", 8)


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            with_a2a(RAY_SCALE_UP, "deepep"),
            "Elastic EP scale-up with --elastic-ep-backend ray requires --moe-a2a-backend none or nixl "
            "(got moe_a2a_backend=deepep).",
        ),
        (
            without(RAY_SCALE_UP, "--disable-cuda-graph"),
            "Elastic EP runtime scale-up requires decode and prefill CUDA graphs to be disabled.",
        ),
        (
            without(RAY_SCALE_UP, "--enable-dp-lm-head"),
            "Elastic EP scale-up requires --enable-dp-lm-head so output projection",
        ),
        (RAY_SCALE_UP + ("--tokenizer-worker-num", "2"), "requires --tokenizer-worker-num 1."),
        (RAY_SCALE_UP + ("--enable-elastic-expert-backup",), "does not support --enable-elastic-expert-backup."),
        (
            RAY_SCALE_UP + ("--load-balance-method", "total_tokens"),
            "Elastic EP scale-up requires --load-balance-method round_robin",
        ),
        (
            RAY_SCALE_UP + ("--elastic-ep-initial-size", "4"),
            "The primary --elastic-ep-initial-size must equal its launch-time TP size (8).",
        ),
        (("--tp", "4", "--pp-size", "2", "--elastic-ep-backend", "ray"), "PP size should be set to 1 under elastic EP"),
    ],
)
def test_ray_backend_keeps_the_other_scale_up_invariants(argv, message):
    assert message in rejection(*argv)


def test_ray_scale_up_errors_never_mention_the_seed_backend_requirements():
    message = rejection(*without(RAY_SCALE_UP, "--enable-dp-lm-head"), "--use-ray")
    assert "--use-ray" not in message
    assert "mooncake" not in message
