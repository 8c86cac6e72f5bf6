"""The HF transformers peer of ``flotilla bench``: the same model shape, random weights, dtype,
GPU and workload, through ``model.generate`` (greedy, exactly N new tokens, no end-of-sequence).

    python benchmarks/hf_peer_bench.py --shape llama-3.1-8b [--parts eager1,eager64,static1]
        [--input-len 128] [--output-len 512] [--batch-size 64] [--batch-output-len 256]
        [--dtype bfloat16] [--device cuda] [--config PATH] [--json OUT]

Parts (``--parts``, comma-separated; each is timed on its own, after its own warm-up):

- ``eager1``: eager ``generate``, batch 1, ``--input-len`` in / ``--output-len`` out:
  milliseconds per output token (wall / tokens, prefill included) and per decode step
  (prefill, timed by a 1-token ``generate``, taken out).
- ``eager64``: eager ``generate``, batch ``--batch-size``, ``--input-len`` in /
  ``--batch-output-len`` out: output tokens/s.
- ``static1``: ``cache_implementation="static"``, batch 1, with the decode step compiled
  by ``generate`` itself (transformers compiles the forward for a static cache on CUDA):
  the first full-length call is the compile and warm-up (reported on its own), the next
  is timed.

The model is ``AutoModelForCausalLM.from_config`` built directly on the device (HF's own
random init runs there: seconds, not minutes, for 8B parameters), in ``--dtype``. The
device-to-device copy bandwidth is measured first, in the same process, and each part
reports MBU with the weight model of :mod:`flotilla.deploy.bench_roofline` (HF's KV cache:
a static cache's attention reads the whole ``max_cache_len`` buffer every step).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from flotilla.deploy.bench import shape_config, shape_names
from flotilla.deploy.bench_env import environment, write_result
from flotilla.deploy.bench_roofline import WeightBytes, mbu, measure_copy_bandwidth
from flotilla.deploy.bench_run import random_prompts

PARTS = ("eager1", "eager64", "static1")


def hf_kv_bytes_per_token(cfg: dict, element_size: int) -> int:
    """Bytes HF's cache keeps per token over all layers (MLA: HF caches the decompressed
    per-head K and V, not the latent)."""
    layers = int(cfg["num_hidden_layers"])
    heads = int(cfg["num_attention_heads"])
    if cfg.get("kv_lora_rank"):
        k = int(cfg["qk_nope_head_dim"]) + int(cfg["qk_rope_head_dim"])
        return layers * heads * (k + int(cfg["v_head_dim"])) * element_size
    head_dim = int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads)
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    return layers * 2 * kv_heads * head_dim * element_size


def build_model(cfg: dict, dtype, device):
    """HF's model class for ``cfg`` with its own random init, built directly on ``device``."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(**cfg)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.eval()
    model.generation_config.eos_token_id = None  # NOTE: exactly max_new_tokens, like ignore_eos
    model.generation_config.pad_token_id = 0
    return model


def timed_generate(model, ids, new_tokens: int, **kwargs) -> float:
    """Seconds of one greedy ``generate`` of exactly ``new_tokens`` tokens (device synced)."""
    import torch

    sync = torch.cuda.synchronize if ids.device.type == "cuda" else (lambda: None)
    sync()
    started = time.perf_counter()
    out = model.generate(ids, max_new_tokens=new_tokens, do_sample=False, **kwargs)
    sync()
    seconds = time.perf_counter() - started
    produced = out.shape[1] - ids.shape[1]
    if produced != new_tokens:
        raise RuntimeError(f"generate made {produced} tokens, expected {new_tokens}")
    return seconds


def run_part(model, part: str, args, weights: WeightBytes, kv_per_token: int, peak: float, vocab: int) -> dict:
    """One part (see the module docstring): its timings and MBU."""
    import torch

    batch = args.batch_size if part == "eager64" else 1
    new = args.batch_output_len if part == "eager64" else args.output_len
    device = next(model.parameters()).device
    ids = torch.tensor(random_prompts(batch, args.input_len, vocab, args.seed), device=device)
    extra = {"cache_implementation": "static"} if part == "static1" else {}
    with torch.inference_mode():
        started = time.perf_counter()
        # NOTE: the static part's warm-up has the timed call's shapes, so the compile is not repeated.
        timed_generate(model, ids, new if part == "static1" else 4, **extra)
        warmup_s = time.perf_counter() - started
        prefill_s = timed_generate(model, ids, 1, **extra)
        wall = timed_generate(model, ids, new, **extra)
    # NOTE: None when noise swamps the difference (tiny models on a CPU).
    decode_s = (wall - prefill_s) / (new - 1) if new > 1 and wall > prefill_s else None
    context = args.input_len + new if part == "static1" else args.input_len + new / 2
    moved = weights.per_step(batch) + batch * context * kv_per_token
    moved_emb = weights.per_step(batch, count_embedding=True) + batch * context * kv_per_token
    return {
        "batch_size": batch,
        "input_len": args.input_len,
        "output_len": new,
        "cache": "static, compiled decode step" if part == "static1" else "dynamic, eager",
        "warmup_s": warmup_s,
        "prefill_s": prefill_s,
        "wall_s": wall,
        "output_tokens": batch * new,
        "output_tok_s": batch * new / wall,
        "ms_per_token": 1e3 * wall / new,
        "decode_ms_per_step": None if decode_s is None else 1e3 * decode_s,
        "mbu": None if decode_s is None else mbu(moved, decode_s, peak),
        "mbu_embedding_counted": None if decode_s is None else mbu(moved_emb, decode_s, peak),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=shape_names(), default="llama-3.1-8b")
    parser.add_argument("--config", default=None, help="a config.json to use instead of --shape")
    parser.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated subset of {','.join(PARTS)}")
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=512, help="new tokens of the batch-1 parts")
    parser.add_argument("--batch-size", type=int, default=64, help="batch of the eager64 part")
    parser.add_argument("--batch-output-len", type=int, default=256, help="new tokens of the eager64 part")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--device", default=None, help="default: cuda when present, else cpu")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--bandwidth-bytes", type=int, default=None)
    parser.add_argument("--json", default=None, metavar="OUT")
    args = parser.parse_args(argv)
    parts = [p for p in args.parts.split(",") if p]
    unknown = [p for p in parts if p not in PARTS]
    if unknown or not parts:
        parser.error(f"--parts: unknown part(s) {unknown} (choose from {','.join(PARTS)})")

    import torch

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = getattr(torch, args.dtype)
    cfg = json.loads(Path(args.config).read_text()) if args.config else shape_config(args.shape)
    bandwidth = measure_copy_bandwidth(device, args.bandwidth_bytes)
    element_size = torch.empty((), dtype=dtype).element_size()
    weights = WeightBytes.from_config(cfg, element_size)
    started = time.perf_counter()
    model = build_model(cfg, dtype, device)
    build_s = time.perf_counter() - started
    kv_per_token = hf_kv_bytes_per_token(cfg, element_size)
    results = {
        "benchmark": "hf_peer",
        "shape": None if args.config else args.shape,
        "config": args.config,
        "dtype": args.dtype,
        "environment": environment(device),
        "bandwidth": bandwidth,
        "weights": weights.as_dict(),
        "kv_bytes_per_token": kv_per_token,
        "build_s": build_s,
        "attn_implementation": getattr(model.config, "_attn_implementation", None),
        "command": ["python", "benchmarks/hf_peer_bench.py", *(sys.argv[1:] if argv is None else argv)],
        "parts": {},
    }
    for part in parts:
        row = run_part(model, part, args, weights, kv_per_token, bandwidth["peak_bytes_per_s"], int(cfg["vocab_size"]))
        results["parts"][part] = row
        print(
            f"{part:<8} batch {row['batch_size']:>3} {row['input_len']} in / {row['output_len']} out: "
            f"{row['ms_per_token']:.2f} ms per token (decode step {row['decode_ms_per_step'] or 0:.2f} ms), "
            f"{row['output_tok_s']:.1f} output tok/s, MBU {row['mbu'] or 0:.3f}, warm-up {row['warmup_s']:.1f} s",
            flush=True,
        )
        if args.json:  # NOTE: after every part, so a run cut short keeps what it measured
            write_result(args.json, results, sort_keys=True)
    print(f"copy bandwidth {bandwidth['peak_bytes_per_s'] / 1e12:.3f} TB/s; weights {weights.total / 1e9:.2f} GB")
    if args.json:
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
