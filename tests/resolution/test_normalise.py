"""The normalise phase: aliases, defaults, legacy CP, DCP/DWDP, CUDA-graph config,
per-device backends and memory defaults.

Expected values were checked against SGLang 0.5.19's resolution (the oracle) on
the same platform preset. Most tests run the normalise phase alone, so they stay
independent of the later phases; a few run the whole resolution.
"""

from __future__ import annotations

import pytest

from flotilla.resolution import ResolutionError, resolve
from flotilla.resolution.engine import Phase, View
from flotilla.resolution.fields import DEFAULTS
from flotilla.resolution.rules import normalise
from flotilla.resolution.rules.normalise import cuda_graph
from flotilla.resolution.rules.normalise.legacy import handle_legacy_cp_arguments
from helpers.resolution_configs import (
    DEEPSEEK_V3_ROUTED as DEEPSEEK_V3,
    LLAMA_8K,
    MODEL_DIR,
    resolution_inputs as _inputs,
    run_phases,
)

LLAMA = {**LLAMA_8K, "intermediate_size": 14336, "torch_dtype": "bfloat16"}

DEEPSEEK_V32 = {**DEEPSEEK_V3, "architectures": ["DeepseekV32ForCausalLM"], "index_topk": 2048}


def normalise_only(argv, hf=LLAMA, platform="b200"):
    """Run only the normalise phase; return the engine outcome."""
    return run_phases([(Phase.NORMALISE, normalise.STEPS)], argv, hf, platform)


def values(argv, hf=LLAMA, platform="b200"):
    return normalise_only(argv, hf, platform).values


def rejection(argv, hf=LLAMA, platform="b200"):
    with pytest.raises(ResolutionError) as info:
        normalise_only(argv, hf, platform)
    return info.value.violations[0]


def view_of(values_):
    return View(values_, {}, frozenset(), DEFAULTS)


# -- defaults ------------------------------------------------------------------


@pytest.mark.parametrize(
    "platform, device", [("b200", "cuda"), ("mi300x", "cuda"), ("cpu", "cpu"), ("a100", "cuda")]
)
def test_device_comes_from_the_platform(platform, device):
    assert values([], platform=platform)["device"] == device


def test_device_index_is_stripped_and_paths_default_to_the_model():
    got = values(["--device", "cuda:0"])
    assert got["device"] == "cuda"
    assert got["tokenizer_path"] == MODEL_DIR
    assert got["served_model_name"] == MODEL_DIR
    assert got["mm_process_config"] == {}


def test_unquant_means_no_quantization_for_target_and_draft():
    got = values(["--quantization", "unquant"])
    assert got["quantization"] is None
    assert got["speculative_draft_model_quantization"] is None
    assert got["_speculative_draft_quantization_explicitly_set"] is False


def test_draft_quantization_defaults_to_the_target_one():
    got = values(["--quantization", "fp8"])
    assert got["speculative_draft_model_quantization"] == "fp8"
    assert got["_speculative_draft_quantization_explicitly_set"] is False
    assert values(["--speculative-draft-model-quantization", "fp8"])[
        "_speculative_draft_quantization_explicitly_set"
    ] is True


def test_megamoe_runner_is_an_a2a_alias():
    got = values(["--moe-runner-backend", "megamoe", "--moe-a2a-backend", "deepep"], DEEPSEEK_V3)
    assert (got["moe_runner_backend"], got["moe_a2a_backend"]) == ("auto", "megamoe")


def test_hidden_states_flags_imply_each_other():
    assert values(["--enable-return-hidden-states"])["return_hidden_states_mode"] == "full"
    assert values(["--return-hidden-states-mode", "last"])["enable_return_hidden_states"] is True


@pytest.mark.parametrize(
    "argv, ratio",
    [
        ([], 2.0),
        (["--hicache-host-memory-mode", "buffer_only"], 1.2),
        (["--disaggregation-mode", "decode"], None),
    ],
)
def test_hicache_ratio_default(argv, ratio):
    assert values(argv)["hicache_ratio"] == ratio


def test_deprecated_spellings_are_translated():
    got = values(
        [
            "--tool-call-parser",
            "qwen25",
            "--enable-flashinfer-allreduce-fusion",
            "--disable-fast-image-processor",
        ]
    )
    assert got["tool_call_parser"] == "qwen"
    assert got["flashinfer_allreduce_fusion_backend"] == "auto"
    assert got["enable_flashinfer_allreduce_fusion"] is False
    assert got["image_processor_backend"] == "pil"
    assert values(["--attention-backend", "compressed"])["attention_backend"] == "dsv4"


def test_legacy_grpc_mode_derives_its_port():
    got = values(["--grpc-mode", "--port", "40000"])
    assert got["smg_grpc_mode"] is True
    assert got["grpc_port"] == 50000
    assert got["grpc_worker_threads"] == 4


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--prefill-decode-interval", "-1"], "--prefill-decode-interval must be non-negative."),
        (["--ssl-keyfile", "k"], "--ssl-keyfile requires --ssl-certfile to be specified as well."),
        (
            ["--ssl-ca-certs", "x"],
            "--ssl-ca-certs has no effect without --ssl-certfile and --ssl-keyfile.",
        ),
        (["--asr-max-buffer-seconds", "0"], "--asr-max-buffer-seconds must be positive (got 0)."),
        (["--mm-preprocess-cache-size-mb", "-1"], "mm_preprocess_cache_size_mb must be non-negative"),
        (
            ["--grpc-port", "70000"],
            "--grpc-port / SGLANG_GRPC_PORT (70000) must be between 1 and 65535",
        ),
        (["--sidecar-args", '["a"]'], "--sidecar-args requires --sidecar."),
        (
            ["--disable-fast-image-processor", "--image-processor-backend", "torchvision"],
            "--disable-fast-image-processor conflicts with --image-processor-backend=torchvision.",
        ),
    ],
)
def test_flag_combination_errors(argv, message):
    assert rejection(argv).message == message


def test_mm_process_config_must_hold_objects():
    violation = rejection(["--mm-process-config", '{"image": 3}'])
    assert violation.kind == "TypeError"
    assert violation.message == "mm_process_config['image'] must be a dict, but got <class 'int'>"


def test_prefill_only_kv_cache_needs_embedding_mode():
    assert rejection(["--prefill-only-disable-kv-cache"]).message.startswith(
        "--prefill-only-disable-kv-cache currently requires --is-embedding."
    )
    assert rejection(
        ["--prefill-only-disable-kv-cache", "--is-embedding", "--chunked-prefill-size", "-1"]
    ).message.startswith("--prefill-only-disable-kv-cache requires --disable-radix-cache")


# -- serving modes ---------------------------------------------------------------


def test_pd_decode_server_uses_chunk_cache_and_extra_slots():
    argv = ["--disaggregation-mode", "decode", "--tp", "2", "--dp-size", "2"]
    got = values([*argv, "--max-running-requests", "40"])
    assert got["disable_radix_cache"] is True
    assert got["disaggregation_decode_extra_slots"] == 40  # 20 per worker, doubled


def test_mooncake_tcp_is_mooncake_over_tcp():
    outcome = normalise_only(
        ["--disaggregation-mode", "prefill", "--disaggregation-transfer-backend", "mooncake_tcp"]
    )
    assert outcome.values["disaggregation_transfer_backend"] == "mooncake"
    assert outcome.env["MC_FORCE_TCP"] == "1"


def test_pd_prefill_rejects_fake_transfer():
    violation = rejection(
        ["--disaggregation-mode", "prefill", "--disaggregation-transfer-backend", "fake"]
    )
    assert violation.kind == "AssertionError"
    assert violation.message == "Prefill server does not support 'fake' as the transfer backend"


def test_expert_pack_reports_every_problem():
    message = rejection(["--load-format", "expert_pack", "--tp", "2", "--enable-waterfill"]).message
    assert message.startswith("Invalid expert_pack configuration:\n")
    assert "- tensor parallelism (--tp-size) must be 1, got 2" in message
    assert "- --enable-waterfill is incompatible with expert_pack" in message
    assert (
        "model_type must be 'deepseek_v4' or the text-only Kimi-K3 'kimi_linear' config, "
        "got 'llama'"
    ) in message


# -- legacy context parallelism ---------------------------------------------------------


def test_legacy_dsa_cp_flag_maps_to_interleave():
    got = values(["--tp", "8", "--enable-dsa-prefill-context-parallel"], DEEPSEEK_V32, "h200")
    assert got["enable_prefill_cp"] is True
    assert got["cp_strategy"] == "interleave"
    assert got["enable_dsa_prefill_context_parallel"] is True
    assert got["enable_prefill_context_parallel"] is False
    assert got["dsa_prefill_cp_mode"] == got["prefill_cp_mode"] == "round-robin-split"


def test_canonical_cp_is_mirrored_onto_the_mha_alias():
    argv = ["--tp", "8", "--enable-prefill-cp", "--cp-strategy", "zigzag"]
    got = values(argv, DEEPSEEK_V3, "h100")
    assert got["enable_prefill_context_parallel"] is True
    assert got["enable_dsa_prefill_context_parallel"] is False
    assert got["prefill_cp_mode"] == "in-seq-split"


def test_legacy_cp_rule_switches_to_dsa_aliases_on_a_dsa_backend():
    # the parallel phase re-runs the same rule once the backend is final
    state = {
        **DEFAULTS,
        "enable_prefill_cp": True,
        "cp_strategy": "interleave",
        "attention_backend": "dsa",
    }
    declared = handle_legacy_cp_arguments.fn(view_of(state), None, None)
    assert declared["enable_dsa_prefill_context_parallel"] is True
    assert declared["enable_prefill_context_parallel"] is False
    assert declared["dsa_prefill_cp_mode"] == "round-robin-split"


def test_both_legacy_flags_only_enable_cp():
    argv = ["--enable-prefill-context-parallel", "--enable-dsa-prefill-context-parallel"]
    got = values(["--tp", "8", *argv], DEEPSEEK_V32)
    assert got["enable_prefill_cp"] is True
    assert got["cp_strategy"] == "zigzag"  # from prefill_cp_mode, the first legacy flag
    assert got["dsa_prefill_cp_mode"] == "round-robin-split"  # untouched default


# -- DCP and DWDP ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "argv, platform, start",
    [
        (
            ["--dcp-size", "0"],
            "b200",
            "Decode context parallel size (--dcp-size / --decode-context-parallel-size) must be >= 1",
        ),
        (
            ["--dcp-comm-backend", "a2a"],
            "b200",
            "--dcp-comm-backend a2a only affects the decode context-parallel",
        ),
        (
            ["--dcp-comm-backend", "fi_a2a", "--dcp-size", "2", "--tp", "2"],
            "mi300x",
            "--dcp-comm-backend fi_a2a delegates",
        ),
        (["--dcp-replicate-q-proj"], "b200", "--dcp-replicate-q-proj requires --dcp-size > 1."),
        (
            ["--dcp-replicate-q-proj", "--dcp-size", "2", "--tp", "2"],
            "b200",
            "--dcp-replicate-q-proj only applies",
        ),
    ],
)
def test_dcp_validation(argv, platform, start):
    assert rejection(argv, DEEPSEEK_V3, platform).message.startswith(start)


def test_dwdp_forces_dp_attention_layout_and_disables_graphs():
    argv = ["--tp", "8", "--dwdp-size", "8", "--moe-a2a-backend", "deepep"]
    outcome = normalise_only(argv, DEEPSEEK_V3)
    got = outcome.values
    layout = (got["dp_size"], got["ep_size"], got["moe_dp_size"], got["moe_dense_tp_size"])
    assert layout == (8, 8, 1, 1)
    assert got["enable_dp_attention"] and got["enable_dp_lm_head"]
    assert got["enable_dp_attention_local_control_broadcast"] is True
    assert got["moe_a2a_backend"] == "none"
    assert outcome.env["SGLANG_SCHEDULER_SKIP_ALL_GATHER"] == "True"
    view = view_of(got)
    assert cuda_graph.decode_graph_disabled(view) and cuda_graph.prefill_graph_disabled(view)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--tp", "8", "--dwdp-size", "4"], "dwdp_size (4) must equal tp_size (8)"),
        (
            ["--tp", "8", "--dwdp-size", "8", "--enable-eplb"],
            "EPLB dynamic migration conflicts with static DWDP partitioning",
        ),
        (
            ["--tp", "8", "--dwdp-size", "8", "--disaggregation-mode", "decode"],
            "DWDP requires --disaggregation-mode null or prefill",
        ),
    ],
)
def test_dwdp_preconditions(argv, message):
    violation = rejection(argv, DEEPSEEK_V3)
    assert (violation.kind, violation.message) == ("AssertionError", message)


# -- CUDA graph config ----------------------------------------------------------------------


def _graphs(argv, hf=LLAMA, platform="b200"):
    return values(argv, hf, platform)["cuda_graph_config"]


def test_cuda_defaults_are_full_decode_and_breakable_prefill():
    config = _graphs(["--tp", "8"])
    assert config["decode"]["backend"] == "full" and config["prefill"]["backend"] == "breakable"
    assert config["decode"]["max_bs"] == 512 and config["decode"]["bs"][-1] == 512
    assert config["prefill"]["max_bs"] == 16384  # chunked_prefill_size on B200
    assert config["locked"] == []


def test_rocm_prefill_graph_is_tc_piecewise_and_then_disabled():
    assert _graphs([], platform="mi300x")["prefill"]["backend"] == "disabled"


def test_pipeline_parallelism_turns_off_the_default_breakable_prefill_graph():
    assert _graphs(["--tp", "2", "--pp-size", "2"])["prefill"]["backend"] == "disabled"


def test_a_pinned_prefill_backend_survives_compatibility_rules():
    config = _graphs(["--tp", "2", "--pp-size", "2", "--cuda-graph-backend-prefill", "breakable"])
    assert config["prefill"]["backend"] == "breakable"
    assert config["prefill"]["max_bs"] == 8192  # PP cap on the default prefill capture size
    assert "prefill.backend" in config["locked"]


def test_json_config_overrides_flags_and_locks_its_keys():
    json_config = '{"decode": {"max_bs": 64}}'
    config = _graphs(["--cuda-graph-max-bs", "128", "--cuda-graph-config", json_config])
    assert config["decode"]["max_bs"] == 64
    assert config["decode"]["bs"][-1] == 64
    view = view_of({**DEFAULTS, "cuda_graph_config": config})
    assert cuda_graph.is_locked(view, "decode", "max_bs")
    assert not cuda_graph.is_locked(view, "prefill", "backend")


def test_invalid_json_backend_is_rejected():
    message = rejection(["--cuda-graph-config", '{"prefill": {"backend": "bogus"}}']).message
    assert message == (
        "--cuda-graph-config[prefill].backend='bogus' not allowed; "
        "allowed: ('full', 'breakable', 'tc_piecewise', 'disabled')"
    )


def test_pd_roles_disable_the_idle_phase():
    assert _graphs(["--disaggregation-mode", "prefill"])["decode"]["backend"] == "disabled"
    assert _graphs(["--disaggregation-mode", "decode"])["prefill"]["backend"] == "disabled"


def test_deepep_aligns_breakable_prefill_buckets_to_eight():
    config = _graphs(["--tp", "8", "--moe-a2a-backend", "deepep"], DEEPSEEK_V3)
    prefill = config["prefill"]
    assert prefill["backend"] == "breakable"
    assert all(size % 8 == 0 for size in prefill["bs"]) and prefill["max_bs"] == 2048


def test_breakable_prefill_is_off_under_dcp_and_two_batch_overlap():
    config = _graphs(["--tp", "8", "--dcp-size", "8"], DEEPSEEK_V3)
    assert config["prefill"]["backend"] == "disabled"
    argv = ["--tp", "8", "--moe-a2a-backend", "deepep", "--enable-two-batch-overlap"]
    config = _graphs(argv, DEEPSEEK_V3)
    assert config["prefill"]["backend"] == "disabled"


def test_inkling_opts_into_full_prefill_graphs():
    inkling = {**LLAMA, "architectures": ["InklingForConditionalGeneration"]}
    got = values([], inkling)
    assert got["cuda_graph_backend_prefill"] == "full"
    assert got["cuda_graph_config"]["prefill"]["backend"] == "full"


def test_graph_helpers_read_flags_before_the_config_is_built():
    view = view_of({**DEFAULTS, "disable_cuda_graph": True, "cuda_graph_backend_decode": "full"})
    assert not cuda_graph.decode_graph_disabled(view)
    assert cuda_graph.prefill_graph_disabled(view)


# -- per-device backends ------------------------------------------------------------------


def test_cpu_engine_backends_and_graph_sizes():
    got = values([], platform="cpu")
    assert got["attention_backend"] == "intel_amx"
    assert got["sampling_backend"] == "pytorch"
    assert got["torch_compile_max_bs"] == 32
    assert got["cuda_graph_config"]["decode"]["max_bs"] == 32
    assert got["cuda_graph_config"]["prefill"]["backend"] == "disabled"


def test_cpu_graph_batch_sizes_follow_torch_compile_max_bs():
    got = values(["--device", "cpu", "--cuda-graph-bs", "1", "2", "8"])
    assert got["torch_compile_max_bs"] == 8
    assert got["cuda_graph_config"]["decode"]["bs"] == [1, 2, 8]


def test_symmetric_memory_needs_cuda_or_rocm():
    assert values(["--enable-symm-mem"], platform="cpu")["enable_symm_mem"] is False
    outcome = normalise_only(["--enable-symm-mem"])
    assert outcome.values["enable_symm_mem"] is True
    assert outcome.env["SGLANG_SYMM_MEM_PREALLOC_GB_SIZE"] == "4"


def test_xpu_decode_graphs_are_opt_in():
    assert _graphs(["--device", "xpu"])["decode"]["backend"] == "disabled"
    config = _graphs(["--device", "xpu", "--cuda-graph-backend-decode", "full"])
    assert config["decode"]["backend"] == "full"


# -- memory defaults ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "platform, tp, chunk, max_bs",
    [
        ("a100", "1", 8192, 256),
        ("h100", "8", 8192, 512),
        ("h200", "2", 8192, 256),
        ("rtx-pro-6000", "8", 8192, 512),
        ("b200", "1", 16384, 512),
        ("mi300x", "1", 16384, 512),
    ],
)
def test_memory_tiers(platform, tp, chunk, max_bs):
    got = values(["--tp", tp], platform=platform)
    assert got["chunked_prefill_size"] == chunk
    assert got["cuda_graph_config"]["decode"]["max_bs"] == max_bs


@pytest.mark.parametrize(
    "argv, hf, platform, fraction",
    [
        (["--tp", "8"], LLAMA, "b200", 0.849),
        (["--tp", "8"], DEEPSEEK_V3, "b200", 0.844),
        (
            ["--tp", "8", "--dwdp-size", "8", "--disaggregation-mode", "prefill"],
            DEEPSEEK_V3,
            "b200",
            0.858,
        ),
        (["--tp", "8", "--chunked-prefill-size", "8192"], DEEPSEEK_V32, "h200", 0.886),
    ],
)
def test_mem_fraction_static_matches_sglang(argv, hf, platform, fraction):
    assert values(argv, hf, platform)["mem_fraction_static"] == fraction


def test_mla_prefill_capture_defaults_to_2048_tokens():
    config = _graphs(["--tp", "8"], DEEPSEEK_V3, "h100")
    assert config["prefill"]["max_bs"] == 2048
    assert config["prefill"]["bs"][-1] == 2048


def test_explicit_chunked_prefill_size_is_kept():
    got = values(["--chunked-prefill-size", "4096"], platform="b200")
    assert got["chunked_prefill_size"] == 4096


# -- whole resolution -----------------------------------------------------------------------


def test_full_resolution_keeps_the_normalised_device_and_chunk_size():
    args, model, facts = _inputs(["--tp", "8"], LLAMA, "h200")
    resolved = resolve(args, model, facts)
    assert resolved.device == "cuda"
    assert resolved.chunked_prefill_size == 8192
    rules = {change.rule for change in resolved.provenance}
    expected = {
        "_handle_missing_default_values",
        "_parse_cuda_graph_config",
        "_handle_gpu_memory_settings",
    }
    assert expected <= rules
