"""Tensor parallelism on GPUs: TP=2 (two Ray worker actors, NCCL) against TP=1 (in process).

    python benchmarks/tp_bench.py [--shape llama-3.1-8b|tiny] [--batch 8] [--input-len 128]
                                  [--output-len 32] [--dtypes float32,bfloat16] [--json OUT]

The model is a Llama-3.1-8B-shaped config with ``--load-format dummy`` weights (deterministic
random tensors, the same full tensors on every rank, so TP=2 holds exactly TP=1's weights).
For each dtype the same greedy batch runs at TP=2 and at TP=1 in one process, one after the
other; the script reports whether the greedy tokens are identical and the median decode
step time of each (wall time of ``LLMEngine.step()`` on the driver, i.e. including the
step RPC and the logits' trip back for TP=2).

float32 is the correctness check (reduction-order differences of TP stay ~1e-5, far below
the greedy margins); bfloat16 is the serving dtype, whose rounding can flip near-tied
random-weight logits, so its token agreement is reported, not asserted.

``--shape tiny`` runs the same code on a tiny config (CPU is fine), as a smoke test.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from flotilla.deploy.bench_env import write_result

LLAMA_31_8B = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "num_hidden_layers": 32,
    "vocab_size": 128256,
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "rope_scaling": {
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "initializer_range": 0.02,
}
TINY = {**LLAMA_31_8B, "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
        "num_key_value_heads": 2, "num_hidden_layers": 2, "vocab_size": 512, "initializer_range": 0.2}


def run_one(model_dir: str, tp: int, dtype: str, prompts: list[list[int]], output_len: int, device: str) -> dict:
    """Greedy-generate ``prompts`` at ``tp`` ranks; the tokens and per-step wall times."""
    import torch

    from flotilla.cluster.engine.llm import LLM
    from flotilla.cluster.engine.sampling_params import SamplingParams

    flags = dict(
        tp_size=tp,
        dtype=dtype,
        load_format="dummy",
        skip_tokenizer_init=True,
        attention_backend="torch_native",
        max_total_tokens=len(prompts) * (len(prompts[0]) + output_len) + 256,
        chunked_prefill_size=8192,
        disable_cuda_graph=True,
    )
    if device == "cpu":
        from flotilla.resolution import preset

        flags["platform"] = preset("cpu")
    start = time.perf_counter()
    llm = LLM(model_dir, **flags)
    load_s = time.perf_counter() - start
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    ids = [engine.add_request(p, params) for p in prompts]
    step_s: list[float] = []
    decode_s: list[float] = []
    while engine.has_unfinished_requests():
        t = time.perf_counter()
        deltas = engine.step()
        if device != "cpu":
            torch.cuda.synchronize()
        dt = time.perf_counter() - t
        step_s.append(dt)
        # NOTE: a decode step is one where every request already had its first token.
        if len(step_s) > 1 and all(len(engine.get_output(i).outputs[0].token_ids) > 1 for i in ids) and deltas:
            decode_s.append(dt)
    tokens = [list(engine.get_output(i).outputs[0].token_ids) for i in ids]
    llm.shutdown()
    del llm, engine
    gc.collect()
    if device != "cpu":
        torch.cuda.empty_cache()
    return {
        "tp": tp,
        "dtype": dtype,
        "load_s": round(load_s, 2),
        "steps": len(step_s),
        "first_step_s": round(step_s[0], 4),
        "decode_step_ms_median": round(1000 * statistics.median(decode_s), 2) if decode_s else None,
        "decode_step_ms_min": round(1000 * min(decode_s), 2) if decode_s else None,
        "tokens": tokens,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=("llama-3.1-8b", "tiny"), default="llama-3.1-8b")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--json", type=Path, default=None)
    opts = parser.parse_args(argv)

    import torch

    config = LLAMA_31_8B if opts.shape == "llama-3.1-8b" else TINY
    generator = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, config["vocab_size"], (opts.batch, opts.input_len), generator=generator).tolist()
    results: dict = {"shape": opts.shape, "batch": opts.batch, "input_len": opts.input_len,
                     "output_len": opts.output_len, "runs": []}
    if opts.device == "cuda":
        results["gpu"] = torch.cuda.get_device_name(0)
        results["gpus"] = torch.cuda.device_count()
    with tempfile.TemporaryDirectory() as model_dir:
        (Path(model_dir) / "config.json").write_text(json.dumps(config))
        for dtype in opts.dtypes.split(","):
            # NOTE: TP=2 first: its actors free both GPUs when killed; TP=1 then runs in this process.
            tp2 = run_one(model_dir, 2, dtype, prompts, opts.output_len, opts.device)
            tp1 = run_one(model_dir, 1, dtype, prompts, opts.output_len, opts.device)
            same = sum(a == b for a, b in zip(tp1["tokens"], tp2["tokens"]))
            agree = sum(x == y for a, b in zip(tp1["tokens"], tp2["tokens"]) for x, y in zip(a, b))
            total = sum(len(a) for a in tp1["tokens"])
            summary = {
                "dtype": dtype,
                "identical_sequences": f"{same}/{len(prompts)}",
                "token_agreement": round(agree / total, 4),
                "tp1_decode_step_ms": tp1["decode_step_ms_median"],
                "tp2_decode_step_ms": tp2["decode_step_ms_median"],
                "tp2_over_tp1": round(tp2["decode_step_ms_median"] / tp1["decode_step_ms_median"], 3)
                if tp1["decode_step_ms_median"] and tp2["decode_step_ms_median"] else None,
            }
            print(json.dumps(summary), flush=True)
            for run in (tp1, tp2):
                run.pop("tokens")
            results["runs"].extend([tp1, tp2, {"summary": summary}])
    if opts.json:
        write_result(opts.json, results)
    print(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
