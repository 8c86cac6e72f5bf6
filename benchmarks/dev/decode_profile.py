"""Where one decode step's GPU time goes, kernel by kernel: build a bundled model shape with
random weights, decode a few tokens (so the decode CUDA graphs are captured and warm), then
replay the graph of one batch size under torch's profiler and print the kernels by total
time, grouped into families (GEMM, attention, norm, RoPE, KV write, activation, MoE, other).

    python benchmarks/dev/decode_profile.py --shape llama-3.1-8b --batch-size 1 [--context 512]
        [--replays 20] [--json OUT] [--eager] [--without OP,...] [any server flag as --name value]

``--eager`` profiles eager forwards instead (``--disable-cuda-graph``: launch gaps show up as
idle time between kernels). The replays run padding rows (one token of context each, see
``DecodeGraphs.time_replay``), so attention is at its cheapest; ``--context`` instead decodes
real requests of that many prompt tokens and profiles their steps. ``--without`` turns fused
decode ops off for a side-by-side (``rms_norm_linear``, ``silu_and_mul_linear``,
``qkv_prepare``: the separate ops run; ``linear``: ``F.linear`` for every projection;
``pdl``: the Triton kernels without programmatic dependent launch; ``triton_decode``: small
decode batches on flashinfer's decode kernels instead of the Triton split-KV kernel;
``fold_route_sum``: one token's MoE route sum in its own launch; ``fold_merge``: the Triton
decode's merge in its own launch).

Needs a CUDA GPU and the GPU wheels (docs/gpu.md); the numbers are for reading, not for CI.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

from flotilla.deploy.bench_env import write_result

# Kernel-name patterns of each family, matched in order (first match wins).
FAMILIES = (
    ("attention", r"flashinfer.*(Prefill|Decode|MLA|Attention)|BatchPrefill|BatchDecode|MergeStates|fmha|mla"),
    ("moe", r"fused_moe|_moe_|moe_"),
    ("gemm", r"gemm|gemv|sm90_xmma|cutlass|cublas|nvjet|splitK|Kernel2|_linear|addmm|aten::mm"),
    ("norm", r"[Rr]ms[Nn]orm|Norm"),
    ("rope", r"[Rr]ope|[Rr]otary"),
    ("kv_write", r"index_copy|indexCopy|scatter"),
    ("activation", r"[Ss]ilu|[Gg]elu|act_and_mul|ActAndMul"),
    ("sampling_or_logits", r"[Ss]oftmax|argmax|[Ss]ampling|reduce"),
)


def family_of(name: str) -> str:
    """The family a kernel name belongs to (``"other"`` when no pattern matches)."""
    for family, pattern in FAMILIES:
        if re.search(pattern, name):
            return family
    return "other"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--shape", help="a bundled model shape (random weights)")
    source.add_argument("--model", type=Path, help="a model directory holding config.json (random weights)")
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--context", type=int, default=0, help="profile real decode steps of this prompt length")
    parser.add_argument("--replays", type=int, default=20)
    parser.add_argument("--eager", action="store_true")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--without", default="", help="comma-separated ops to turn off: " + ", ".join(ABLATABLE))
    opts, rest = parser.parse_known_args(argv)
    without = [op for op in opts.without.split(",") if op]
    unknown = sorted(set(without) - set(ABLATABLE))
    if unknown:
        parser.error(f"--without: unknown op(s) {unknown}; choose from {list(ABLATABLE)}")
    flags = _server_flags(rest)
    with _turned_off(without):
        return _profile(opts, flags, without)


def _profile(opts: argparse.Namespace, flags: dict[str, object], without: list[str]) -> int:
    """Build the model, warm it, profile, print and write the JSON (see the module docstring)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from flotilla.cluster.engine.llm import LLM
    from flotilla.cluster.engine.sampling_params import SamplingParams
    from flotilla.deploy.bench import shape_config

    if opts.eager:
        flags["disable_cuda_graph"] = True
    config = shape_config(opts.shape) if opts.shape else json.loads((opts.model / "config.json").read_text())
    with tempfile.TemporaryDirectory(prefix="flotilla-profile-") as tmp:
        (Path(tmp) / "config.json").write_text(json.dumps(config))
        llm = LLM(tmp, load_format="dummy", skip_tokenizer_init=True, dtype=flags.pop("dtype", "bfloat16"), **flags)
    runner = llm.engine.runner
    on_cuda = runner.device.type == "cuda"
    prompt = list(range(1, max(2, opts.context) + 1))
    warm = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    llm.generate([{"prompt_token_ids": prompt}] * opts.batch_size, warm)
    replay = runner.graphs is not None and not opts.context and not opts.eager
    # NOTE: off CUDA (a smoke run) the CPU ops are counted instead of kernels.
    with profile(activities=[ProfilerActivity.CUDA if on_cuda else ProfilerActivity.CPU]) as prof:
        if replay:
            runner.graphs.time_replay(opts.batch_size, opts.replays)
        else:
            params = SamplingParams(temperature=0, max_tokens=opts.replays + 1, ignore_eos=True)
            llm.generate([{"prompt_token_ids": prompt}] * opts.batch_size, params)
        if on_cuda:
            torch.cuda.synchronize()
    steps = opts.replays + (1 if replay else 0)
    # Outside the profiler (which adds per-kernel overhead): the graph's plain replay time.
    replay_ms = runner.graphs.time_replay(opts.batch_size, 50) if replay else None
    kernels = []
    for event in prof.key_averages():
        cuda_us = getattr(event, "device_time_total", 0.0) if on_cuda else event.self_cpu_time_total
        if cuda_us > 0 and event.count > 0:
            kernels.append({"name": event.key, "count": event.count, "total_us": cuda_us})
    kernels.sort(key=lambda k: -k["total_us"])
    families: dict[str, float] = defaultdict(float)
    for kernel in kernels:
        kernel["family"] = family_of(kernel["name"])
        families[kernel["family"]] += kernel["total_us"] / steps
    total = sum(families.values())
    name = opts.shape or str(opts.model)
    print(f"{name} batch {opts.batch_size}: {'graph replay' if replay else 'eager steps'} x {steps}, "
          f"kernel time per step {max(total, 1e-9) / 1e3:.3f} ms (graphs: {runner.startup_report()['graph_batch_sizes'][:4]}...)"
          + (f", graph replay unprofiled {replay_ms:.3f} ms" if replay_ms is not None else "")
          + (f", without {','.join(without)}" if without else ""))
    for family, us in sorted(families.items(), key=lambda item: -item[1]):
        print(f"  {family:<20} {us / 1e3:8.3f} ms  {100 * us / max(total, 1e-9):5.1f}%")
    print("top kernels (per step):")
    for kernel in kernels[:25]:
        print(f"  {kernel['total_us'] / steps:9.1f} us  x{kernel['count'] // steps:<4} {kernel['family']:<10} {kernel['name'][:110]}")
    if opts.json:
        write_result(opts.json, {
            "shape": name, "batch_size": opts.batch_size, "mode": "graph replay" if replay else "eager steps",
            "steps": steps, "without": without, "replay_ms": replay_ms, "kernel_ms_per_step": total / 1e3, "families_ms": {k: v / 1e3 for k, v in families.items()},
            "kernels": kernels,
        })  # fmt: skip
    llm.shutdown()
    return 0


# Module flags rather than registry ops: the flotilla.kernels module and its flag set False.
SWITCHES = {
    "pdl": ("triton_pdl", "ENABLED"),
    "triton_decode": ("triton_decode_attention", "ENABLED"),
    "fold_route_sum": ("triton_moe", "FOLD_ROUTE_SUM"),
    "fold_merge": ("triton_decode_attention", "FOLD_MERGE"),
}
ABLATABLE = ("linear", "rms_norm_linear", "silu_and_mul_linear", "qkv_prepare", *SWITCHES)


@contextlib.contextmanager
def _turned_off(ops: list[str]):
    """While inside, the kernel registry hands out the unfused choice for ``ops``: None for a
    fused op (the model then runs the separate ops), torch's ``F.linear`` for ``linear``;
    ``pdl``: the Triton kernels launched without programmatic dependent launch; ``triton_decode``:
    every decode on flashinfer; ``fold_route_sum``, ``fold_merge``: the launches those folds
    remove. Restored on exit."""
    import importlib

    from flotilla.kernels import registry

    lookup = registry.get
    # NOTE: a switch's module imports Triton: import only the ones asked for (CPU runs have none).
    switches = {
        op: (importlib.import_module(f"flotilla.kernels.{SWITCHES[op][0]}"), SWITCHES[op][1])
        for op in SWITCHES
        if op in ops
    }
    before = {op: getattr(module, flag) for op, (module, flag) in switches.items()}
    for module, flag in switches.values():
        setattr(module, flag, False)

    def get(op: str, backend: str = "torch"):
        if op in ops:
            return lookup("linear", "torch") if op == "linear" else None
        return lookup(op, backend)

    if any(op not in SWITCHES for op in ops):
        registry.get = get
    try:
        yield
    finally:
        registry.get = lookup
        for op, (module, flag) in switches.items():
            setattr(module, flag, before[op])


def _server_flags(rest: list[str]) -> dict[str, object]:
    """``--name value`` pairs (and bare ``--switch``es) as server flags, dashes to underscores."""
    flags: dict[str, object] = {}
    i = 0
    while i < len(rest):
        key = rest[i].lstrip("-").replace("-", "_")
        if i + 1 < len(rest) and not rest[i + 1].startswith("--"):
            value: object = rest[i + 1]
            i += 2
        else:
            value = True
            i += 1
        flags[key] = int(value) if isinstance(value, str) and value.isdigit() else value
    return flags


if __name__ == "__main__":
    sys.exit(main())
