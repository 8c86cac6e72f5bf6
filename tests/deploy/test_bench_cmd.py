"""`flotilla bench offline` end to end on a tiny random Llama (fast), with --compare-hf."""

import json

import pytest
import torch

from flotilla.deploy.cli import main


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=32, intermediate_size=64, num_attention_heads=2, num_key_value_heads=1,
                         num_hidden_layers=1, vocab_size=64, max_position_embeddings=128)
    path = tmp_path_factory.mktemp("bench-llama")
    LlamaForCausalLM(config).save_pretrained(path)
    return path


def test_bench_offline_prints_a_table_and_writes_json(tiny_dir, tmp_path, capsys):
    out = tmp_path / "r.json"
    argv = ["bench", "offline", "--model", str(tiny_dir), "--num-prompts", "3", "--input-len", "20",
            "--output-len", "5", "--compare-hf", "--json", str(out), "--chunked-prefill-size", "32"]
    assert main(argv) == 0
    table = capsys.readouterr().out
    assert "flotilla (all at once)" in table and "hf generate padded batch" in table and "vs HF padded batch" in table
    data = json.loads(out.read_text())
    assert data["flotilla"]["output_tokens"] == 15 and data["flotilla"]["input_tokens"] == 60
    assert data["hf_sequential"]["output_tokens"] == 15 and data["hf_batched"]["output_tokens"] == 15
    assert data["ratios"]["vs_hf_batched"] > 0 and data["command"][:3] == ["flotilla", "bench", "offline"]
    assert 0.0 <= data["flotilla"]["prefix_cache_hit_rate"] <= 1.0
    prov = data["provenance"]  # NOTE: its fields are checked in test_provenance.py
    assert prov["versions"]["torch"] == torch.__version__ and prov["machine"]["cpu_cores"] >= 1
    assert prov["date"].endswith("+00:00") and "commit" in prov["git"]


def test_bench_rejects_bad_options(capsys):
    assert main(["bench", "offline", "--num-prompts", "0"]) == 2
    assert "--num-prompts must be at least 1" in capsys.readouterr().err
    assert main(["bench", "offline", "--num-promts", "2"]) == 2
    assert "did you mean --num-prompts" in capsys.readouterr().err
    assert main(["bench", "online"]) == 2
