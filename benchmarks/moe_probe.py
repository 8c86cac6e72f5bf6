"""The Triton fused MoE at decode batch sizes on the Qwen3-30B-A3B shape (H 2048, I 768, 128
experts, top-8): the grouped path (route, gate/up, down, route sum) against the decode GEMV
path (gate/up, down) over its launch configurations, each call timed as CUDA-graph replays
with the layer's weights rotated through three copies (so the experts are read from HBM).

    python benchmarks/moe_probe.py [--json OUT]

Prints microseconds per call and the bytes/s of the active experts' weights
(top-8 x 9.4 MB per token, fewer when tokens share experts).
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch
from graph_timing import replay_us  # benchmarks/graph_timing.py (run as a script from here)

EXPERTS, TOP_K, HIDDEN, INTER = 128, 8, 2048, 768
COPIES = 3


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path)
    parser.add_argument("--tokens", default="1,2,4")
    opts = parser.parse_args(argv)
    from flotilla.kernels import triton_moe as tm

    layers = [
        (
            torch.randn(EXPERTS, 2 * INTER, HIDDEN, device="cuda", dtype=torch.bfloat16) * 0.02,
            torch.randn(EXPERTS, HIDDEN, INTER, device="cuda", dtype=torch.bfloat16) * 0.02,
        )
        for _ in range(COPIES)
    ]
    configs = [
        tm.GemvMoEConfig(n1, k1, 4, n2, k2, 4)
        for n1, k1, (n2, k2) in itertools.product((4, 8, 16), (512, 1024), ((4, 256), (8, 256), (8, 128), (16, 128)))
    ]
    results: dict[str, dict[str, float]] = {}
    for tokens in (int(t) for t in opts.tokens.split(",")):
        x = torch.randn(tokens, HIDDEN, device="cuda", dtype=torch.bfloat16)
        gen = torch.Generator(device="cuda").manual_seed(tokens)
        weights, ids = torch.randn(tokens, EXPERTS, device="cuda", generator=gen).softmax(-1).topk(TOP_K, dim=-1)
        active = ids.unique().numel()
        state = {"i": 0}

        def call(config):
            state["i"] = (state["i"] + 1) % COPIES
            tm.fused_moe_with_config(x, *layers[state["i"]], weights, ids, config=config)

        row: dict[str, float] = {"grouped": replay_us(lambda: call(tm.pick_config(tokens * TOP_K, EXPERTS)))}
        for cfg in configs:
            tag = f"gemv[{cfg.block_n_1}x{cfg.block_k_1} / {cfg.block_n_2}x{cfg.block_k_2}]"
            try:
                row[tag] = replay_us(lambda: call(cfg))
            except Exception as exc:  # a configuration the compiler rejects: report and go on
                print(f"  {tag}: {type(exc).__name__}: {str(exc)[:100]}")
        row["gemv_default"] = replay_us(lambda: call(None))
        results[f"tokens={tokens}"] = row
        moved = active * 3 * HIDDEN * INTER * 2
        print(f"tokens={tokens} ({active} experts active, {moved / 1e6:.1f} MB):")
        for label, us in sorted(row.items(), key=lambda item: item[1])[:6] + [("grouped", row["grouped"])]:
            print(f"    {us:7.1f} us  {moved / (us * 1e-6) / 1e12:5.2f} TB/s  {label}")
    if opts.json:
        opts.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
