"""``--kv-cache-dtype`` on the runner: which dtype the KV cache is allocated in
(``kv_cache_dtype_for``), what is refused and when, and what a float8 cache changes in the
runner's KV pool (bytes per token, allocation, the start-up report).

The pool on a CUDA device is sized from free memory over the bytes per token, so halving
the bytes doubles its tokens; CPU pools are sized in tokens (``DEFAULT_CPU_KV_TOKENS`` or
``--max-total-tokens``), so here the halving is checked on the bytes (the GPU test
``tests/gpu/test_fp8_kv_cache.py`` checks the doubled pool).
"""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest
import torch

from flotilla import LLM, SamplingParams
from flotilla.cluster.engine.kv_cache_dtype import kv_cache_dtype_for
from flotilla.cluster.engine.model_runner import ModelRunner
from flotilla.cluster.models.sources import resolve_model_source
from flotilla.resolution import ModelFacts, ServerArgs, preset, resolve
from helpers.prompts import random_prompts
from helpers.tiny_deepseek import TINY_DEEPSEEK_V2
from helpers.tiny_models import save_tiny_llama
from helpers.tiny_moe import save_tiny_qwen3_moe
from helpers.torch_threads import one_intra_op_thread

LLAMA = {"architectures": ["LlamaForCausalLM"], "num_attention_heads": 4}
DEEPSEEK = {"architectures": ["DeepseekV2ForCausalLM"], "kv_lora_rank": 32}


def config(kv_cache_dtype="auto", quantization_param_path=None):
    return SimpleNamespace(kv_cache_dtype=kv_cache_dtype, quantization_param_path=quantization_param_path)


@pytest.mark.parametrize(
    "name, model_dtype, expected",
    [
        ("auto", torch.bfloat16, torch.bfloat16),
        ("auto", torch.float32, torch.float32),
        (None, torch.float16, torch.float16),
        ("bfloat16", torch.float32, torch.bfloat16),
        ("bf16", torch.bfloat16, torch.bfloat16),
        ("fp8_e4m3", torch.bfloat16, torch.float8_e4m3fn),
        ("fp8_e5m2", torch.float16, torch.float8_e5m2),
        ("fp8_e4m3", torch.float32, torch.float8_e4m3fn),
    ],
)
def test_each_supported_value_maps_to_its_dtype(name, model_dtype, expected):
    assert kv_cache_dtype_for(config(name), model_dtype, LLAMA) == expected


@pytest.mark.parametrize("name", ["mxfp8", "nvfp4", "fp4_mx_block16", "fp4_e2m1", "int8"])
def test_unsupported_values_are_refused_by_name(name):
    with pytest.raises(ValueError, match=rf"kv_cache_dtype='{name}' is not supported by flotilla's runtime"):
        kv_cache_dtype_for(config(name), torch.bfloat16, LLAMA)


def test_an_mla_latent_cache_stays_in_the_model_dtype():
    assert kv_cache_dtype_for(config("auto"), torch.bfloat16, DEEPSEEK) == torch.bfloat16
    assert kv_cache_dtype_for(config("bfloat16"), torch.bfloat16, DEEPSEEK) == torch.bfloat16
    for name in ("fp8_e4m3", "fp8_e5m2"):
        with pytest.raises(ValueError, match=rf"kv_cache_dtype='{name}' is not supported for an MLA model \(DeepseekV2"):
            kv_cache_dtype_for(config(name), torch.bfloat16, DEEPSEEK)
    with pytest.raises(ValueError, match="kv_cache_dtype='bfloat16' is not supported for an MLA model"):
        kv_cache_dtype_for(config("bfloat16"), torch.float32, DEEPSEEK)


@pytest.mark.parametrize(
    "quantization_config, named",
    [
        ({"quant_method": "compressed-tensors", "kv_cache_scheme": {"num_bits": 8, "type": "float"}}, "kv_cache_scheme"),
        ({"quant_method": "modelopt", "kv_cache_quant_algo": "FP8"}, "kv_cache_quant_algo"),
        ({"quantization": {"quant_algo": "FP8", "kv_cache_quant_algo": "FP8"}}, r"quantization\.kv_cache_quant_algo"),
    ],
    ids=["compressed-tensors", "modelopt", "modelopt-nested"],
)
def test_checkpoint_kv_scales_are_refused_for_a_float8_cache(quantization_config, named):
    hf = {**LLAMA, "quantization_config": quantization_config}
    with pytest.raises(ValueError, match=rf"kv_cache_dtype='fp8_e4m3': .*{named}.*scale of 1\.0"):
        kv_cache_dtype_for(config("fp8_e4m3"), torch.bfloat16, hf)
    # NOTE: an unquantized cache uses no scales, so the declaration is harmless there.
    assert kv_cache_dtype_for(config("auto"), torch.bfloat16, hf) == torch.bfloat16


def test_a_kv_scales_file_is_refused_for_a_float8_cache():
    with pytest.raises(ValueError, match=r"kv_cache_dtype='fp8_e5m2' with quantization_param_path='/scales.json'"):
        kv_cache_dtype_for(config("fp8_e5m2", "/scales.json"), torch.bfloat16, LLAMA)
    assert kv_cache_dtype_for(config("auto", "/scales.json"), torch.bfloat16, LLAMA) == torch.bfloat16


# -- the runner ------------------------------------------------------------------------------


# (saver, K/V elements a token: layers x (K, V) x KV heads x head dim)
TINY_MODELS = {
    "llama": (save_tiny_llama, 2 * 2 * 2 * 16),
    "qwen3-moe": (save_tiny_qwen3_moe, 3 * 2 * 2 * 16),
}


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory):
    sources = {}
    for name, (save, _) in TINY_MODELS.items():
        path = tmp_path_factory.mktemp(f"tiny-{name}-kv8")
        save(path)
        sources[name] = resolve_model_source(str(path))
    return sources


def runner_for(source, **flags) -> ModelRunner:
    args = ServerArgs.create(model_path=str(source.path), max_total_tokens=256, **flags)
    with one_intra_op_thread():
        return ModelRunner(resolve(args, ModelFacts.from_hf_config(source.config_dict), preset("cpu")), source)


@pytest.mark.parametrize("model", list(TINY_MODELS))
def test_a_float8_cache_is_allocated_in_float8_at_half_the_bytes_per_token(tiny_models, model):
    source, elements = tiny_models[model], TINY_MODELS[model][1]
    plain = runner_for(source, dtype="bfloat16")
    assert plain.startup_report()["kv_cache_dtype"] == "bfloat16"
    for name, dtype in (("fp8_e4m3", torch.float8_e4m3fn), ("fp8_e5m2", torch.float8_e5m2)):
        fp8 = runner_for(source, dtype="bfloat16", kv_cache_dtype=name)
        assert {t.dtype for layer in fp8.kv_caches for t in layer} == {dtype}
        assert [t.shape for layer in fp8.kv_caches for t in layer] == [t.shape for layer in plain.kv_caches for t in layer]
        assert (fp8.kv_layout.bytes_per_token, plain.kv_layout.bytes_per_token) == (elements, 2 * elements)
        stored = sum(t.nbytes for layer in fp8.kv_caches for t in layer)
        assert stored * 2 == sum(t.nbytes for layer in plain.kv_caches for t in layer)
        assert fp8.startup_report()["kv_cache_dtype"] == str(dtype).removeprefix("torch.")


@pytest.mark.parametrize("model", list(TINY_MODELS))
def test_the_engine_decodes_over_a_float8_cache(tiny_models, model):
    """Dense and MoE attention layers write and read the float8 cache through the engine
    (the token agreement with a bf16 cache is ``test_llm_fp8_kv.py``'s)."""
    llm = LLM(str(tiny_models[model].path), platform=preset("cpu"), kv_cache_dtype="fp8_e4m3", max_total_tokens=256,
              skip_tokenizer_init=True)  # fmt: skip
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=1)
    with one_intra_op_thread():
        outs = llm.generate(random_prompts((5, 17, 40), 256), params)
    assert all(t.dtype == torch.float8_e4m3fn for layer in llm.engine.runner.kv_caches for t in layer)
    for out in outs:
        completion = out.outputs[0]
        assert len(completion.token_ids) == 6
        assert all(math.isfinite(step[t].logprob) for step, t in zip(completion.logprobs, completion.token_ids))
    assert llm.engine.scheduler.pool.num_used_blocks == 0


def test_an_unsupported_value_fails_before_any_weight_loads(tmp_path):
    # NOTE: a config.json without weights: had the check come after loading, the error would
    # be the missing checkpoint instead.
    hf = {**LLAMA, "model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_key_value_heads": 2,
          "num_hidden_layers": 2, "vocab_size": 256}  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(hf))
    source = resolve_model_source(str(tmp_path))
    with pytest.raises(ValueError, match="kv_cache_dtype='fp4_e2m1' is not supported by flotilla's runtime"):
        runner_for(source, kv_cache_dtype="fp4_e2m1")


def test_an_mla_model_refuses_a_float8_cache_at_start(tmp_path):
    hf = {**TINY_DEEPSEEK_V2, "architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2"}
    (tmp_path / "config.json").write_text(json.dumps(hf))
    source = resolve_model_source(str(tmp_path))
    with pytest.raises(ValueError, match=r"kv_cache_dtype='fp8_e4m3' is not supported for an MLA model"):
        runner_for(source, kv_cache_dtype="fp8_e4m3")
