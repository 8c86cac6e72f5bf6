"""The parallel phase: data/context parallelism, MoE kernels and A2A, EPLB,
pipeline parallelism, speculative decoding and LayerNorm SP.

Expected values and messages were checked against SGLang 0.5.19's resolution
(the reference oracle) on the same flags, configs and platform presets, except
where a test says it exercises a rule unit directly.
"""

import pytest

from flotilla.resolution import ModelFacts, ResolutionError, ServerArgs, preset, resolve
from flotilla.resolution.engine import View
from flotilla.resolution.fields import DEFAULTS
from flotilla.resolution.frozen import freeze
from flotilla.resolution.rules.parallel import context_parallel, graphs
from flotilla.resolution.rules.parallel.a2a import cutedsl_max_tokens
from helpers.resolution_configs import LLAMA_128K

LLAMA = {**LLAMA_128K, "head_dim": 128}
QWEN3 = {**LLAMA, "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3"}
QWEN3_MOE = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe",
    "hidden_size": 2048,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "num_hidden_layers": 48,
    "intermediate_size": 6144,
    "moe_intermediate_size": 768,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "vocab_size": 151936,
    "max_position_embeddings": 40960,
    "head_dim": 128,
    "torch_dtype": "bfloat16",
    "norm_topk_prob": True,
    "rms_norm_eps": 1e-6,
}


def run(platform, hf, *argv):
    return resolve(ServerArgs.from_cli(list(argv)), ModelFacts.from_hf_config(hf), preset(platform))


def rejection(platform, hf, *argv):
    with pytest.raises(ResolutionError) as info:
        run(platform, hf, *argv)
    return str(info.value)


def view_of(env=None, **values):
    """A view with ``values`` set explicitly over the field defaults."""
    return View({**DEFAULTS, **values}, dict(env or {}), frozenset(values), DEFAULTS)


# -- data parallelism ---------------------------------------------------------


def test_dp_attention_divides_the_chunk_and_clamps_the_prefill_graph():
    cfg = run("h100", LLAMA, "--tp", "4", "--dp-size", "2", "--enable-dp-attention", "--chunked-prefill-size", "8192")
    assert cfg.chunked_prefill_size == 4096
    assert cfg.schedule_conservativeness == pytest.approx(0.3)
    assert cfg.cuda_graph_config["prefill"]["max_bs"] == 4096
    assert max(cfg.cuda_graph_config["prefill"]["bs"]) == 4096


def test_dp_attention_keeps_a_pinned_prefill_graph_size():
    cfg = run(
        "h100", LLAMA, "--tp", "4", "--dp-size", "4", "--enable-dp-attention",
        "--chunked-prefill-size", "8192", "--cuda-graph-max-bs-prefill", "6000",
    )
    assert cfg.chunked_prefill_size == 2048
    assert cfg.cuda_graph_config["prefill"]["max_bs"] == 6000


def test_dp_size_one_turns_dp_attention_and_dp_lm_head_off():
    cfg = run("h100", LLAMA, "--tp", "2", "--enable-dp-attention", "--enable-dp-lm-head")
    assert cfg.enable_dp_attention is False
    assert cfg.enable_dp_lm_head is False
    assert cfg.schedule_conservativeness == 1.0


def test_tp_lm_head_all_to_all_defaults_on_only_for_pure_dp_decode_nodes():
    decode = run("h100", LLAMA, "--tp", "2", "--dp-size", "2", "--enable-dp-attention", "--disaggregation-mode", "decode")
    colocated = run("h100", LLAMA, "--tp", "2", "--dp-size", "2", "--enable-dp-attention")
    assert decode.enable_tp_lm_head_all_to_all is True
    assert colocated.enable_tp_lm_head_all_to_all is False


def test_tp_lm_head_all_to_all_needs_tp_equal_to_dp():
    message = rejection(
        "h100", LLAMA, "--tp", "4", "--dp-size", "2", "--enable-dp-attention", "--enable-tp-lm-head-all-to-all"
    )
    assert "requires tp_size == dp_size, got tp_size=4, dp_size=2." in message


def test_tp_lm_head_all_to_all_excludes_the_dp_lm_head():
    message = rejection(
        "h100", LLAMA, "--tp", "2", "--dp-size", "2", "--enable-dp-attention",
        "--enable-tp-lm-head-all-to-all", "--enable-dp-lm-head",
    )
    assert "incompatible with --enable-dp-lm-head" in message


def test_dp_attention_needs_tp_divisible_by_dp():
    with pytest.raises(ResolutionError) as info:
        run("h100", LLAMA, "--tp", "3", "--dp-size", "2", "--enable-dp-attention")
    assert info.value.violations[0].kind == "AssertionError"


def test_load_balancing_follows_the_bootstrap_room_on_prefill_nodes():
    assert run("h100", LLAMA, "--disaggregation-mode", "prefill").load_balance_method == "follow_bootstrap_room"
    assert run("h100", LLAMA).load_balance_method == "round_robin"


# -- context parallelism ------------------------------------------------------


def test_cp_v2_is_declared_for_its_default_architectures_only():
    assert run("h100", QWEN3_MOE, "--tp", "8").env.get("SGLANG_ENABLE_CP_V2") == "True"
    assert "SGLANG_ENABLE_CP_V2" not in run("h100", LLAMA, "--tp", "8").env


def test_cp_v2_on_a_dsa_model_needs_the_interleave_strategy():
    dsa = ModelFacts(hf=freeze({}), architectures=("DeepseekV32ForCausalLM",), is_dsa=True)
    rule = context_parallel.handle_context_parallelism
    plain = rule.fn(view_of(tp_size=8), dsa, preset("h200"))
    zigzag = rule.fn(view_of(tp_size=8, enable_prefill_cp=True, cp_strategy="zigzag"), dsa, preset("h200"))
    interleave = rule.fn(view_of(tp_size=8, enable_prefill_cp=True, cp_strategy="interleave"), dsa, preset("h200"))
    assert plain == {} and zigzag == {}
    assert list(interleave.values()) == ["True"]


def test_cp_v2_is_left_alone_when_already_declared():
    qwen = ModelFacts.from_hf_config(QWEN3_MOE)
    declared = context_parallel.handle_context_parallelism.fn(
        view_of(env={"SGLANG_ENABLE_CP_V2": "0"}, tp_size=8), qwen, preset("h100")
    )
    assert declared == {}


def test_mimo_v2_cp_v2_only_runs_zigzag_on_text():
    mimo = ModelFacts(hf=freeze({}), architectures=("MiMoV2FlashForCausalLM",), multimodal_capable=True, is_multimodal=True)
    rule = context_parallel.handle_context_parallelism
    with pytest.raises(Exception, match="MiMo V2 CP-v2 only supports --cp-strategy zigzag."):
        rule.fn(view_of(tp_size=2, enable_prefill_cp=True, cp_strategy="interleave"), mimo, preset("h100"))
    with pytest.raises(Exception, match="only supports text inference; add --language-only."):
        rule.fn(view_of(tp_size=2, enable_prefill_cp=True, cp_strategy="zigzag"), mimo, preset("h100"))
    text_only = rule.fn(
        view_of(tp_size=2, enable_prefill_cp=True, cp_strategy="zigzag", language_only=True), mimo, preset("h100")
    )
    assert list(text_only.values()) == ["True"]


@pytest.mark.parametrize(
    "argv, message",
    [
        (("--attn-cp-size", "3"), "tp_size must be divisible by attn_cp_size"),
        (("--attn-cp-size", "4", "--dp-size", "4"), "tp_size must be divisible by dp_size * attn_cp_size"),
        (("--moe-dp-size", "2", "--ep-size", "2"), "ep_size * moe_dp_size must be equal to tp_size"),
        (("--moe-dp-size", "2"), "attn_cp_size != moe_dp_size is only supported when moe_dp_size == 1"),
        (
            ("--enable-prefill-context-parallel", "--enable-dsa-prefill-context-parallel"),
            "--enable-prefill-context-parallel and --enable-nsa-prefill-context-parallel are mutually exclusive",
        ),
    ],
)
def test_cp_layout_violations(argv, message):
    assert message in rejection("h100", QWEN3_MOE, "--tp", "8", *argv)


def test_moe_dp_matching_attention_cp_is_accepted():
    cfg = run("h100", QWEN3_MOE, "--tp", "8", "--moe-dp-size", "2", "--attn-cp-size", "2")
    assert cfg.attn_cp_size == 2 and cfg.moe_dp_size == 2


# -- MoE runner backends ------------------------------------------------------


def test_mxfp8_replaces_an_unsupported_runner_and_disables_fusion():
    cfg = run("b200", QWEN3_MOE, "--tp", "8", "--quantization", "mxfp8", "--moe-runner-backend", "triton")
    assert cfg.moe_runner_backend == "flashinfer_trtllm"
    assert cfg.disable_shared_experts_fusion is True
    assert cfg.speculative_moe_runner_backend == "flashinfer_trtllm"


def test_mxfp8_on_gfx95_runs_triton():
    assert run("mi355x", QWEN3_MOE, "--tp", "8", "--quantization", "mxfp8").moe_runner_backend == "triton"


def test_modelopt_fp4_on_sm120_runs_flashinfer_cutlass():
    cfg = run("rtx-pro-6000", QWEN3_MOE, "--tp", "8", "--quantization", "modelopt_fp4")
    assert cfg.moe_runner_backend == "flashinfer_cutlass"


def test_nvfp4_online_on_blackwell_runs_trtllm():
    cfg = run("b200", QWEN3_MOE, "--tp", "8", "--quantization", "nvfp4_online")
    assert cfg.moe_runner_backend == "flashinfer_trtllm"
    assert cfg.disable_shared_experts_fusion is True


@pytest.mark.parametrize(
    "platform, argv, message",
    [
        ("h100", ("--quantization", "nvfp4_online"), "nvfp4_online is supported only on NVIDIA Blackwell SM100/SM103"),
        (
            "b200",
            ("--quantization", "nvfp4_online", "--moe-runner-backend", "triton"),
            "--quantization nvfp4_online supports only --moe-runner-backend flashinfer_trtllm",
        ),
        (
            "b200",
            ("--quantization", "fp8", "--moe-runner-backend", "flashinfer_cutlass"),
            "Invalid quantization 'fp8'. \nFlashInfer Cutlass MOE supports only",
        ),
    ],
)
def test_runner_quantization_violations(platform, argv, message):
    assert message in rejection(platform, QWEN3_MOE, "--tp", "8", *argv)


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ("--moe-runner-backend", "flashinfer_cutedsl", "--quantization", "fp8"),
            "Invalid quantization 'fp8'. \nFlashInfer CuteDSL MOE currently supports only",
        ),
        (
            ("--moe-runner-backend", "flashinfer_cutedsl", "--quantization", "modelopt_fp4", "--moe-a2a-backend", "mooncake"),
            "flashinfer_cutedsl supports moe_a2a_backend='none', 'deepep', or 'flashinfer', got 'mooncake'.",
        ),
        (
            ("--moe-runner-backend", "flashinfer_cutedsl", "--quantization", "nvfp4_online", "--moe-a2a-backend", "deepep"),
            "flashinfer_cutedsl per-token NVFP4 activation requires moe_a2a_backend='none' or 'flashinfer'.",
        ),
        (
            ("--moe-runner-backend", "flashinfer_cutedsl", "--quantization", "modelopt_fp4", "--moe-a2a-backend", "deepep",
             "--deepep-mode", "normal"),
            "flashinfer_cutedsl FP4 MoE only supports DeepEP low_latency dispatch",
        ),
        (
            ("--moe-runner-backend", "flashinfer_trtllm", "--quantization", "w8a8_fp8"),
            "Invalid quantization 'w8a8_fp8'. \nFlashInfer TRTLLM MOE supports only",
        ),
        (
            ("--moe-runner-backend", "flashinfer_trtllm_routed", "--quantization", "w8a8_fp8"),
            "Invalid quantization 'w8a8_fp8'. \nFlashInfer TRTLLM routed MOE supports only",
        ),
    ],
)
def test_flashinfer_runner_violations(argv, message):
    assert message in rejection("b200", QWEN3_MOE, "--tp", "8", *argv)


def test_cutedsl_over_deepep_dispatches_low_latency():
    cfg = run(
        "b200", QWEN3_MOE, "--tp", "8", "--moe-a2a-backend", "deepep", "--moe-runner-backend", "flashinfer_cutedsl",
        "--quantization", "modelopt_fp4",
    )
    assert cfg.deepep_mode == "low_latency"


def test_experimental_marlin_lora_needs_virtual_experts():
    message = rejection("h100", QWEN3_MOE, "--tp", "2", "--moe-runner-backend", "experimental_sgl_marlin", "--enable-lora")
    assert "experimental_sgl_marlin LoRA requires --lora-use-virtual-experts" in message


def test_fp8_cutlass_moe_needs_ep_one():
    message = rejection(
        "h100", QWEN3_MOE, "--tp", "2", "--ep-size", "2", "--quantization", "fp8", "--moe-runner-backend", "cutlass"
    )
    assert "FP8/MXFP8 Cutlass MoE is only supported with ep_size == 1" in message


def test_experimental_marlin_ep_needs_no_a2a():
    message = rejection(
        "h100", QWEN3_MOE, "--tp", "2", "--moe-a2a-backend", "deepep", "--moe-runner-backend", "experimental_sgl_marlin"
    )
    assert "experimental_sgl_marlin EP requires --moe-a2a-backend none" in message


# -- A2A backends -------------------------------------------------------------


def test_deepep_normal_mode_disables_both_graph_phases():
    cfg = run("h100", QWEN3_MOE, "--tp", "8", "--moe-a2a-backend", "deepep", "--deepep-mode", "normal")
    assert cfg.ep_size == 8
    assert cfg.cuda_graph_config["decode"]["backend"] == "disabled"
    assert cfg.cuda_graph_config["prefill"]["backend"] == "disabled"


def test_waterfill_forces_deepep_and_shared_expert_fusion():
    cfg = run("h100", QWEN3_MOE, "--tp", "8", "--enable-waterfill", "--disable-shared-experts-fusion")
    assert (cfg.moe_a2a_backend, cfg.ep_size) == ("deepep", 8)
    assert cfg.disable_shared_experts_fusion is False
    assert cfg.enforce_shared_experts_fusion is True


def test_pplx_resolves_low_latency_deep_gemm():
    cfg = run(
        "h100", QWEN3_MOE, "--tp", "8", "--dp-size", "8", "--enable-dp-attention", "--moe-a2a-backend", "pplx",
        "--chunked-prefill-size", "512", "--cuda-graph-max-bs", "64",
    )
    assert (cfg.deepep_mode, cfg.moe_runner_backend, cfg.chunked_prefill_size) == ("low_latency", "deep_gemm", 64)


def test_mori_defaults_to_normal_dispatch():
    cfg = run("h100", QWEN3_MOE, "--tp", "8", "--moe-a2a-backend", "mori", "--chunked-prefill-size", "4096")
    assert (cfg.deepep_mode, cfg.ep_size) == ("normal", 8)


@pytest.mark.parametrize(
    "argv, message",
    [
        (("--moe-a2a-backend", "pplx"), "moe_a2a_backend='pplx' requires --enable-dp-attention with at least 2 DP groups"),
        (
            ("--dp-size", "8", "--enable-dp-attention", "--moe-a2a-backend", "pplx"),
            "SGLANG_PPLX_NUM_MAX_DISPATCH_TOKENS_PER_RANK (default 128) must be >=",
        ),
        (("--moe-a2a-backend", "mori"), "SGLANG_MORI_NUM_MAX_DISPATCH_TOKENS_PER_RANK (default 4096) must be >="),
    ],
)
def test_a2a_dispatch_violations(argv, message):
    assert message in rejection("h100", QWEN3_MOE, "--tp", "8", *argv)


def test_flashinfer_a2a_with_fp4_experts_dispatches_nvfp4():
    cfg = run(
        "b200", QWEN3_MOE, "--tp", "8", "--dp-size", "8", "--enable-dp-attention", "--moe-a2a-backend", "flashinfer",
        "--moe-runner-backend", "flashinfer_cutlass", "--quantization", "modelopt_fp4",
    )
    assert cfg.env["SGLANG_MOE_NVFP4_DISPATCH"] == "True"
    assert cfg.disable_shared_experts_fusion is True
    assert cfg.ep_size == 8


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ("--dp-size", "8", "--enable-dp-attention", "--moe-a2a-backend", "flashinfer"),
            "FlashInfer MoE A2A is supported with flashinfer_cutlass",
        ),
        (
            ("--moe-a2a-backend", "flashinfer", "--moe-runner-backend", "flashinfer_cutlass"),
            "Flashinfer MoE A2A is only supported with dp_size == tp_size and --enable-dp-attention",
        ),
        (
            (
                "--dp-size", "8", "--enable-dp-attention", "--moe-a2a-backend", "flashinfer",
                "--moe-runner-backend", "flashinfer_cutedsl", "--quantization", "modelopt_fp4",
            ),
            "to cover the largest CuteDSL MoE forward (16384 tokens)",
        ),
    ],
)
def test_flashinfer_a2a_violations(argv, message):
    assert message in rejection("b200", QWEN3_MOE, "--tp", "8", *argv)


def test_cutedsl_forward_size_counts_verify_tokens_and_piecewise_prefill():
    config = {
        "decode": {"backend": "full", "max_bs": 512},
        "prefill": {"backend": "breakable", "max_bs": 8192},
        "locked": [],
    }
    piecewise = {**config, "prefill": {"backend": "tc_piecewise", "max_bs": 8192}}
    spec = {"speculative_algorithm": "EAGLE", "speculative_num_draft_tokens": 4}
    assert cutedsl_max_tokens(view_of(max_prefill_tokens=1024, cuda_graph_config=config)) == 1024
    assert cutedsl_max_tokens(view_of(max_prefill_tokens=1024, cuda_graph_config=config, **spec)) == 2048
    assert cutedsl_max_tokens(view_of(max_prefill_tokens=1024, cuda_graph_config=piecewise)) == 8192


def test_ascend_tp_a2a_becomes_none():
    cfg = run("h100", QWEN3_MOE, "--tp", "8", "--moe-a2a-backend", "ascend_tp")
    assert (cfg.moe_a2a_backend, cfg.ep_size) == ("none", 1)


def test_deepep_v2_resolves_deep_gemm_without_prefill_graphs():
    cfg = run(
        "h100", QWEN3_MOE, "--tp", "8", "--moe-a2a-backend", "deepep_v2", "--chunked-prefill-size", "64",
        "--max-prefill-tokens", "64", "--cuda-graph-max-bs", "64",
    )
    assert cfg.moe_runner_backend == "deep_gemm"
    assert cfg.disable_shared_experts_fusion is True
    assert cfg.cuda_graph_config["prefill"]["backend"] == graphs.DISABLED
    assert cfg.env["NCCL_CUMEM_ENABLE"] == "1"


def test_deepep_v2_rejects_unvalidated_architectures():
    message = rejection("h100", LLAMA, "--tp", "8", "--moe-a2a-backend", "deepep_v2")
    assert "DeepEP v2 MoE is not validated for 'LlamaForCausalLM'" in message


# -- EPLB and expert metrics --------------------------------------------------


def test_eplb_with_an_a2a_backend_dispatches_statically():
    cfg = run("h100", QWEN3_MOE, "--tp", "8", "--enable-eplb", "--moe-a2a-backend", "deepep")
    assert (cfg.ep_dispatch_algorithm, cfg.expert_distribution_recorder_mode) == ("static", "stat")


def test_eplb_without_a2a_dispatches_rank_invariantly():
    cfg = run("h100", QWEN3_MOE, "--tp", "8", "--enable-eplb", "--ep-size", "8")
    assert (cfg.ep_dispatch_algorithm, cfg.expert_distribution_recorder_mode) == ("dynamic", "stat")


def test_a_non_trivial_expert_layout_picks_a_dispatch_algorithm_without_eplb():
    cfg = run("h100", QWEN3_MOE, "--tp", "8", "--ep-size", "8", "--init-expert-location", "/tmp/layout.json")
    assert cfg.ep_dispatch_algorithm == "dynamic"
    assert cfg.expert_distribution_recorder_mode is None


def test_per_rank_dispatch_without_a2a_is_rejected():
    message = rejection("h100", QWEN3_MOE, "--tp", "8", "--ep-size", "8", "--ep-dispatch-algorithm", "lp")
    assert "--ep-dispatch-algorithm lp picks a different physical replica per rank" in message


def test_eplb_needs_expert_parallelism():
    with pytest.raises(ResolutionError) as info:
        run("h100", QWEN3_MOE, "--tp", "8", "--enable-eplb")
    assert info.value.violations[0].kind == "AssertionError"


def test_balancedness_reports_enable_the_recorder_sized_by_rebalance_period():
    cfg = run(
        "h100", QWEN3_MOE, "--tp", "8", "--expert-balancedness-report-mode", "server_log",
        "--eplb-rebalance-num-iterations", "500",
    )
    assert (cfg.expert_distribution_recorder_mode, cfg.expert_distribution_recorder_buffer_size) == ("stat", 500)
    assert run("h100", QWEN3_MOE, "--tp", "8").expert_distribution_recorder_mode is None


# -- pipeline parallelism and LayerNorm SP ------------------------------------


def test_pipeline_parallelism_disables_the_overlap_schedule():
    assert run("h100", LLAMA, "--tp", "2", "--pp-size", "2").disable_overlap_schedule is True
    assert run("h100", LLAMA, "--tp", "2").disable_overlap_schedule is False


def test_layernorm_sp_on_qwen3_with_tp():
    assert run("h100", QWEN3, "--tp", "2", "--enable-layernorm-sp").enable_layernorm_sp is True


@pytest.mark.parametrize(
    "hf, argv, message",
    [
        (LLAMA, ("--tp", "2"), "--enable-layernorm-sp is only supported for ['Qwen3ForCausalLM']; got LlamaForCausalLM."),
        (QWEN3, (), "--enable-layernorm-sp requires tp_size > 1"),
        (QWEN3, ("--tp", "2", "--speculative-algorithm", "ngram"), "not compatible with speculative decoding"),
    ],
)
def test_layernorm_sp_violations(hf, argv, message):
    assert message in rejection("h100", hf, "--enable-layernorm-sp", *argv)


# -- speculative decoding -----------------------------------------------------


def test_nextn_becomes_eagle_with_tuned_llama_parameters():
    cfg = run("h100", LLAMA, "--speculative-algorithm", "nextn")
    assert cfg.speculative_algorithm == "EAGLE"
    steps = (cfg.speculative_num_steps, cfg.speculative_eagle_topk, cfg.speculative_num_draft_tokens)
    assert steps == (5, 4, 8)
    assert cfg.max_running_requests == 48


def test_top1_eagle_drafts_steps_plus_one_tokens():
    cfg = run(
        "h100", LLAMA, "--speculative-algorithm", "EAGLE", "--speculative-eagle-topk", "1",
        "--speculative-num-steps", "3", "--speculative-num-draft-tokens", "8",
    )
    assert cfg.speculative_num_draft_tokens == 4


def test_adaptive_eagle_starts_at_the_middle_candidate():
    cfg = run("h100", LLAMA, "--speculative-algorithm", "EAGLE", "--speculative-adaptive")
    assert cfg.speculative_adaptive is True
    assert (cfg.speculative_num_steps, cfg.speculative_eagle_topk, cfg.speculative_num_draft_tokens) == (3, 1, 4)


def test_adaptive_falls_back_to_static_under_dp_attention():
    cfg = run(
        "h100", LLAMA, "--tp", "2", "--dp-size", "2", "--enable-dp-attention",
        "--speculative-algorithm", "EAGLE", "--speculative-adaptive",
    )
    assert cfg.speculative_adaptive is False
    assert (cfg.speculative_num_steps, cfg.speculative_eagle_topk) == (5, 4)


def test_eagle_keeps_mixed_chunks():
    assert run("h100", LLAMA, "--speculative-algorithm", "EAGLE", "--enable-mixed-chunk").enable_mixed_chunk is True


def test_standalone_uses_the_small_tree_and_no_mixed_chunks():
    cfg = run("h100", LLAMA, "--speculative-algorithm", "STANDALONE", "--enable-mixed-chunk")
    assert (cfg.speculative_num_steps, cfg.speculative_eagle_topk, cfg.speculative_num_draft_tokens) == (3, 1, 4)
    assert cfg.enable_mixed_chunk is False


def test_ngram_uses_bfs_breadth_as_topk():
    cfg = run("h100", LLAMA, "--speculative-algorithm", "NGRAM", "--speculative-eagle-topk", "3")
    assert (cfg.speculative_eagle_topk, cfg.speculative_num_draft_tokens, cfg.speculative_num_steps) == (10, 12, 1)
    assert cfg.disable_overlap_schedule is False


def test_ngram_on_cpu_has_no_overlap_schedule():
    assert run("cpu", LLAMA, "--speculative-algorithm", "NGRAM").disable_overlap_schedule is True


def test_frozen_kv_mtp_turns_mixed_chunks_off():
    cfg = run("h100", LLAMA, "--speculative-algorithm", "FROZEN_KV_MTP", "--enable-mixed-chunk")
    assert (cfg.enable_mixed_chunk, cfg.max_running_requests) == (False, 48)
    assert cfg.speculative_num_steps is None


def test_mtp_targets_draft_from_their_own_checkpoint():
    dsv3 = ModelFacts(hf=freeze({}), architectures=("DeepseekV3ForCausalLM",))
    from flotilla.resolution.rules.parallel.speculative_algos import handle_eagle_family

    declared = handle_eagle_family.fn(
        view_of(speculative_algorithm="EAGLE", model_path="/models/dsv3", page_size=64, attention_backend="fa3"),
        dsv3,
        preset("h100"),
    )
    assert declared["speculative_draft_model_path"] == "/models/dsv3"
    assert (declared["speculative_num_steps"], declared["speculative_eagle_topk"]) == (3, 1)


def test_draft_moe_runner_follows_the_target():
    cfg = run("b200", QWEN3_MOE, "--tp", "8", "--moe-runner-backend", "flashinfer_trtllm")
    assert cfg.speculative_moe_runner_backend == "flashinfer_trtllm"


@pytest.mark.parametrize(
    "argv, message",
    [
        (("--speculative-algorithm", "medusa"), "Unknown speculative algorithm name: MEDUSA"),
        (
            ("--speculative-algorithm", "EAGLE", "--speculative-num-steps", "3"),
            "'>' not supported between instances of 'NoneType' and 'int'",
        ),
        (
            ("--speculative-algorithm", "EAGLE", "--speculative-adaptive", "--speculative-num-steps", "5"),
            "--speculative-num-steps=5 is not in the adaptive config candidate_steps [0, 1, 3, 7].",
        ),
        (
            (
                "--speculative-algorithm", "EAGLE", "--speculative-use-rejection-sampling",
                "--speculative-eagle-topk", "2", "--speculative-num-steps", "3", "--speculative-num-draft-tokens", "4",
            ),
            "--speculative-use-rejection-sampling requires --speculative-eagle-topk=1.",
        ),
        (
            ("--speculative-algorithm", "STANDALONE", "--speculative-use-rejection-sampling"),
            "not speculative_algorithm=STANDALONE.",
        ),
        (
            ("--speculative-algorithm", "NGRAM", "--speculative-ngram-external-corpus-path", "/x/corpus.txt"),
            "--speculative-ngram-external-sam-budget must be positive when",
        ),
        (
            ("--speculative-algorithm", "NGRAM", "--page-size", "16"),
            "speculative_eagle_topk(10) > 1 with page_size(16) > 1 is unstable",
        ),
        (
            (
                "--speculative-algorithm", "EAGLE", "--speculative-eagle-topk", "1", "--speculative-num-steps", "2",
                "--speculative-num-draft-tokens", "3", "--speculative-use-rejection-sampling",
                "--speculative-accept-threshold-single", "0.5",
            ),
            "--speculative-use-rejection-sampling is incompatible with --speculative-accept-threshold-single",
        ),
        (("--speculative-algorithm", "DFLASH"), "DFLASH speculative decoding requires setting --speculative-draft-model-path."),
        (
            ("--speculative-algorithm", "NGRAM", "--speculative-skip-dp-mlp-sync"),
            "--speculative-skip-dp-mlp-sync is only supported with speculative_algorithm == EAGLE, got NGRAM.",
        ),
        (
            ("--speculative-algorithm", "EAGLE", "--speculative-draft-window-size", "0"),
            "--speculative-draft-window-size must be positive, got 0.",
        ),
        (
            ("--speculative-algorithm", "EAGLE", "--attention-backend", "flashmla", "--page-size", "64"),
            "speculative_eagle_topk > 1 with page_size > 1 is only supported on ('flashinfer', 'fa3', 'triton')",
        ),
    ],
)
def test_speculative_violations(argv, message):
    assert message in rejection("h100", LLAMA, *argv)


@pytest.mark.parametrize(
    "algorithm, message",
    [
        ("STANDALONE", "Currently standalone speculative decoding does not support dp attention."),
        ("NGRAM", "Currently ngram speculative decoding does not support dp attention."),
    ],
)
def test_speculative_algorithms_without_dp_attention(algorithm, message):
    argv = ("--tp", "2", "--dp-size", "2", "--enable-dp-attention", "--speculative-algorithm", algorithm)
    assert message in rejection("h100", LLAMA, *argv)


def test_trtllm_mha_drafts_only_top1():
    message = rejection("b200", LLAMA, "--speculative-algorithm", "EAGLE", "--attention-backend", "trtllm_mha")
    assert "trtllm_mha backend only supports topk = 1 for speculative decoding." in message


def test_dspark_with_a_bundled_draft_head_drafts_from_the_target():
    # Port-only check: the reference oracle cannot construct DSpark's draft config.
    bundled = {**QWEN3, "dspark_block_size": 4}
    cfg = run("h100", bundled, "--model-path", "/models/q", "--speculative-algorithm", "DSPARK")
    assert cfg.speculative_draft_model_path == "/models/q"
    assert (cfg.speculative_num_steps, cfg.speculative_eagle_topk, cfg.speculative_num_draft_tokens) == (1, 1, 5)
    pinned = run("h100", bundled, "--model-path", "/m", "--speculative-algorithm", "DSPARK",
                 "--speculative-dspark-block-size", "3")
    assert pinned.speculative_num_draft_tokens == 4
    message = rejection("h100", QWEN3, "--speculative-algorithm", "DSPARK")
    assert "DSpark dense speculative decoding requires setting --speculative-draft-model-path." in message


def test_dflash_drafts_one_block_with_a_supported_draft_backend():
    # Port-only check: SGLang reads the separate draft checkpoint's config here,
    # which resolution cannot see; an unreadable draft config means block size 16.
    cfg = run("h100", LLAMA, "--speculative-algorithm", "DFLASH", "--speculative-draft-model-path", "/drafts/d",
              "--speculative-num-steps", "4")
    assert (cfg.speculative_num_steps, cfg.speculative_eagle_topk, cfg.speculative_num_draft_tokens) == (1, 1, 16)
    assert cfg.speculative_draft_attention_backend == "fa3"
    assert cfg.speculative_draft_model_revision == "main"
    assert cfg.max_running_requests == 48
    message = rejection("h100", LLAMA, "--speculative-algorithm", "DFLASH", "--speculative-draft-model-path", "/d",
                        "--speculative-dflash-block-size", "8", "--speculative-num-draft-tokens", "4")
    assert "Both --speculative-num-draft-tokens and --speculative-dflash-block-size are set but they differ." in message
