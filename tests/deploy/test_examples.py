"""The Serve config examples in deploy/examples/: each is a file ``serve deploy`` accepts
(Ray Serve's own schema), its args are what ``build()`` takes, and ``flotilla serve
--config`` reads and RESOLVES it for the hardware it targets (a platform preset), with a
model directory holding the named model's config.json (written here; no weights, no
download, no GPU). Its ``placement`` passes ``check_placement``."""

import json
from pathlib import Path

import pytest
import yaml

from flotilla.deploy.config_file import load_serve_config
from flotilla.deploy.serve_cmd import parse_serve_args, plan_for
from flotilla.resolution.platform import PRESETS
from flotilla.serve.types import check_placement
from helpers.resolution_configs import DEEPSEEK_V3, LLAMA_128K

EXAMPLES_DIR = Path(__file__).resolve().parents[2] / "deploy" / "examples"

# The models' config.json as published (the keys resolution and the model code read).
LLAMA_31_8B = {
    **LLAMA_128K,
    "hidden_act": "silu",
    "rope_scaling": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
    "tie_word_embeddings": False,
    "bos_token_id": 128000,
    "eos_token_id": [128001, 128008, 128009],
}
LLAMA_31_70B = {
    **LLAMA_31_8B,
    "hidden_size": 8192,
    "intermediate_size": 28672,
    "num_attention_heads": 64,
    "num_hidden_layers": 80,
}
QWEN3_30B_A3B = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe",
    "hidden_size": 2048,
    "intermediate_size": 6144,
    "moe_intermediate_size": 768,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "num_hidden_layers": 48,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "norm_topk_prob": True,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "max_position_embeddings": 40960,
    "vocab_size": 151936,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "tie_word_embeddings": False,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "torch_dtype": "bfloat16",
}

# file -> (the platform preset it targets, the model named in it, that model's config.json;
# None: the embedded SmolLM2, which needs no directory).
EXAMPLES = {
    "cpu-demo.yaml": ("cpu", "smollm2", None),
    "llama-8b-1gpu.yaml": ("h200", "meta-llama/Llama-3.1-8B-Instruct", LLAMA_31_8B),
    "llama-70b-tp8.yaml": ("h200", "meta-llama/Llama-3.1-70B-Instruct", LLAMA_31_70B),
    "pd-node-groups.yaml": ("h200", "meta-llama/Llama-3.1-70B-Instruct", LLAMA_31_70B),
    "elastic-ep-moe.yaml": ("h200", "Qwen/Qwen3-30B-A3B", QWEN3_30B_A3B),
    "deepseek-v3-pd-wide-ep.yaml": ("h200", "deepseek-ai/DeepSeek-V3", DEEPSEEK_V3),
}


def test_the_examples_are_the_six_named():
    assert sorted(p.name for p in EXAMPLES_DIR.glob("*.yaml")) == sorted(EXAMPLES)


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_serve_accepts_the_example(name):
    from ray.serve.schema import ServeDeploySchema

    text = (EXAMPLES_DIR / name).read_text()
    schema = ServeDeploySchema.model_validate(yaml.safe_load(text))
    (app,) = schema.applications
    assert (app.name, app.route_prefix, app.import_path) == ("flotilla", "/", "flotilla.serve.app:build")
    assert app.args["model"] == EXAMPLES[name][1]
    # NOTE: the header shows the three ways to run the file.
    for command in (f"flotilla serve --config deploy/examples/{name}", f"serve deploy deploy/examples/{name}",
                    "ray job submit --address http://HEAD:8265 --working-dir . --"):  # fmt: skip
        assert command in text, command


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_build_takes_the_example_args(name):
    """What ``serve deploy`` runs first: build()'s argument parsing."""
    from flotilla.serve.app import parse_build_args

    given, _ = parse_build_args(load_serve_config(EXAMPLES_DIR / name).args)
    assert given["model_path"] == EXAMPLES[name][1]


def resolve_example(name: str, tmp_path: Path):
    """``flotilla serve --config deploy/examples/NAME [--model DIR]`` resolved for the
    example's platform preset: (opts, config, decode config or None, ServeOptions)."""
    platform, _, hf_config = EXAMPLES[name]
    argv = ["--config", str(EXAMPLES_DIR / name)]
    if hf_config is not None:
        model_dir = tmp_path / name.removesuffix(".yaml")
        model_dir.mkdir()
        (model_dir / "config.json").write_text(json.dumps(hf_config))
        argv += ["--model", str(model_dir)]  # NOTE: the command line wins over the file's model id
    opts, given = parse_serve_args(argv)
    plan = plan_for(opts, given, PRESETS[platform])
    config, decode, options = plan.config, plan.decode_config, plan.options
    check_placement(options.placement)
    return opts, config, decode, options


def test_cpu_demo_resolves_for_cpu(tmp_path):
    _, config, decode, options = resolve_example("cpu-demo.yaml", tmp_path)
    assert (config.device, config.tp_size, config.max_total_tokens, decode) == ("cpu", 1, 8192, None)
    assert (config.host, config.port, options.served_model_name, options.num_replicas) == ("127.0.0.1", 8000, "smollm2", 1)


def test_llama_8b_resolves_for_one_h200(tmp_path):
    _, config, _, options = resolve_example("llama-8b-1gpu.yaml", tmp_path)
    assert (config.device, config.tp_size, config.context_length, config.port) == ("cuda", 1, 32768, 8000)
    assert (options.router, options.num_replicas, options.placement) == ("prefix-affinity", 1, {})


def test_llama_70b_resolves_for_tp8_on_one_h200_node(tmp_path):
    _, config, _, options = resolve_example("llama-70b-tp8.yaml", tmp_path)
    assert (config.device, config.tp_size, options.num_replicas) == ("cuda", 8, 1)
    assert config.tp_size <= PRESETS["h200"].device_count  # NOTE: the TP group fits one node ...
    assert options.placement_strategy == {"engine": "STRICT_PACK"}  # ... and waits for one


def test_pd_example_resolves_each_pool_and_pins_it_to_its_node_group(tmp_path):
    from flotilla.serve.plan import check_pd_options

    opts, prefill, decode, options = resolve_example("pd-node-groups.yaml", tmp_path)
    assert opts.pd and (prefill.disaggregation_mode, decode.disaggregation_mode) == ("prefill", "decode")
    assert (prefill.tp_size, decode.tp_size, options.prefill_replicas, options.decode_replicas) == (4, 8, 2, 1)
    assert (options.kv_transport, options.kv_load_failure_policy) == ("nixl", "recompute")
    assert options.placement == {"prefill": {"prefill_nodes": 0.001}, "decode": {"decode_nodes": 0.001}}
    check_pd_options(prefill, decode, options)


def test_wide_ep_pd_example_resolves_dp_attention_x_ep_pools_one_node_each(tmp_path):
    from flotilla.serve.plan import check_pd_options

    opts, prefill, decode, options = resolve_example("deepseek-v3-pd-wide-ep.yaml", tmp_path)
    assert opts.pd
    for config, role in ((prefill, "prefill"), (decode, "decode")):
        assert config.disaggregation_mode == role and config.device == "cuda"
        assert (config.tp_size, config.dp_size, config.enable_dp_attention, config.ep_size) == (8, 8, True, 8)
        assert config.moe_a2a_backend == "deepep"
        # NOTE: the group is one node's GPUs (STRICT_PACK waits for a whole node).
        assert config.tp_size <= PRESETS["h200"].device_count
    assert options.placement_strategy == {"prefill": "STRICT_PACK", "decode": "STRICT_PACK"}
    assert options.placement == {"prefill": {"prefill_nodes": 0.001}, "decode": {"decode_nodes": 0.001}}
    check_pd_options(prefill, decode, options)


def test_elastic_example_resolves_its_joiners_up_to_four_ranks(tmp_path):
    _, config, _, options = resolve_example("elastic-ep-moe.yaml", tmp_path)
    plan = options.elastic_plan
    assert (config.tp_size, config.ep_size, config.enable_dp_attention, config.max_ep_size) == (1, 1, True, 4)
    assert (plan.initial_size, plan.max_ep_size, options.num_replicas) == (1, 4, 1)
    assert plan.joiner_config(1, 2).ep_join_mode == "scale"
    auto = options.elastic_autoscale
    assert (auto.enabled, auto.interval_s, auto.window_s, auto.cooldown_s, auto.step) == (True, 5.0, 60.0, 300.0, 1)
    assert options.placement == {"joiners": {"ep_joiner_nodes": 0.001}}


def test_serve_config_yaml_is_the_cpu_demo():
    """README's ``serve run deploy/serve-config.yaml`` runs the CPU demo."""
    alias = EXAMPLES_DIR.parent / "serve-config.yaml"
    assert yaml.safe_load(alias.read_text()) == yaml.safe_load((EXAMPLES_DIR / "cpu-demo.yaml").read_text())
