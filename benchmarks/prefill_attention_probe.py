"""Prefill attention: flashinfer's paged prefill (what flotilla runs for every step with a
query longer than one token) against its ragged prefill and torch's SDPA, FA3 and FA2
kernels, for the Llama-3.1-8B head layout (32 query heads, 8 KV heads, head dim 128), bf16,
causal, on the chunks an offline prefill step holds (a few prompts of ~1000-1500 tokens in
an 8192-token chunk; one long prompt; a chunk continuing prompts whose first part is cached).

    python benchmarks/prefill_attention_probe.py [--json OUT] [--cases 8x1000,5x1500,1x8192,4x1000+1000]
        [--mixed 256x1000:4x1000,...]

A case ``BxQ`` is B prompts of Q new tokens with nothing cached; ``BxQ+P`` adds P cached
tokens before each prompt's Q new ones (the second chunk of a split prompt). Each variant is
timed as the mean of 20 calls after a warm-up, and reported in TFLOPS of the causal work
(``4 * head_dim * heads`` per query-key pair a query sees). The pages of the paged variants
are handed out shuffled, as a long-running pool does, and in order (``contiguous``).

``--mixed DxC:BxQ`` times a step of D decodes (C cached tokens each) followed by B fresh
prompts of Q tokens, all on the FA3 prefill kernels against the decodes on the decode
kernel (tensor cores) and the prompts on FA3, as ``FlashInferAttentionPlanner`` splits it.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch
from flotilla.deploy.bench_env import write_result
from graph_timing import events_ms  # benchmarks/graph_timing.py (run as a script from here)

HEADS, KV_HEADS, HEAD_DIM, PAGE = 32, 8, 128, 16


def parse_case(text: str) -> tuple[int, int, int]:
    """``"BxQ"`` or ``"BxQ+P"`` -> (batch, new tokens, cached tokens)."""
    batch, rest = text.split("x")
    new, _, cached = rest.partition("+")
    return int(batch), int(new), int(cached or 0)


def causal_flops(batch: int, new: int, cached: int) -> float:
    """FLOPs of causal attention over one layer: each of a prompt's ``new`` queries sees the
    ``cached`` keys and the new keys up to itself."""
    pairs = new * cached + new * (new + 1) / 2
    return 4.0 * HEAD_DIM * HEADS * pairs * batch


def probe(flashinfer, workspace: torch.Tensor, batch: int, new: int, cached: int) -> dict:
    total = new + cached
    dev, dt = "cuda", torch.bfloat16
    q = torch.randn(batch * new, HEADS, HEAD_DIM, device=dev, dtype=dt)
    k = torch.randn(batch * total, KV_HEADS, HEAD_DIM, device=dev, dtype=dt)
    v = torch.randn_like(k)
    pages_per_seq = (total + PAGE - 1) // PAGE
    num_pages = batch * pages_per_seq
    qo_indptr = torch.arange(0, batch * new + 1, new, dtype=torch.int32, device=dev)
    kv_indptr = torch.arange(0, batch * total + 1, total, dtype=torch.int32, device=dev)
    page_indptr = torch.arange(0, num_pages + 1, pages_per_seq, dtype=torch.int32, device=dev)
    last_page_len = torch.full((batch,), total - (pages_per_seq - 1) * PAGE, dtype=torch.int32, device=dev)
    scale = 1 / math.sqrt(HEAD_DIM)
    flops = causal_flops(batch, new, cached)
    row: dict = {"batch": batch, "new": new, "cached": cached, "gflop": flops / 1e9, "ms": {}, "tflops": {}}

    def record(name: str, fn, out: torch.Tensor, reference: torch.Tensor | None) -> None:
        ms = events_ms(fn)
        row["ms"][name], row["tflops"][name] = ms, flops / ms / 1e9
        if reference is not None:
            row.setdefault("max_diff", {})[name] = (out.float() - reference.float()).abs().max().item()

    reference = None
    for order in ("shuffled", "contiguous"):
        perm = torch.randperm(num_pages, device=dev) if order == "shuffled" else torch.arange(num_pages, device=dev)
        k_cache = torch.zeros(num_pages, PAGE, KV_HEADS, HEAD_DIM, device=dev, dtype=dt)
        v_cache = torch.zeros_like(k_cache)
        # NOTE: token t of sequence s lives at page perm[s * pages_per_seq + t // PAGE], slot t % PAGE.
        token = torch.arange(total, device=dev)
        for s in range(batch):
            pages = perm[s * pages_per_seq + token // PAGE]
            k_cache[pages, token % PAGE] = k[s * total : (s + 1) * total]
            v_cache[pages, token % PAGE] = v[s * total : (s + 1) * total]
        for backend in ("fa3", "fa2"):
            wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD", backend=backend)
            wrapper.plan(qo_indptr, page_indptr, perm.to(torch.int32), last_page_len, HEADS, KV_HEADS, HEAD_DIM, PAGE,
                         causal=True, sm_scale=scale, q_data_type=dt, kv_data_type=dt)  # fmt: skip
            out = wrapper.run(q, (k_cache, v_cache))
            if reference is None:
                reference = out
            record(f"paged_{backend}_{order}", lambda w=wrapper, kc=k_cache, vc=v_cache: w.run(q, (kc, vc)), out, reference)
    for backend in ("fa3", "fa2"):
        ragged = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(workspace, "NHD", backend=backend)
        ragged.plan(qo_indptr, kv_indptr, HEADS, KV_HEADS, HEAD_DIM, causal=True, sm_scale=scale, q_data_type=dt,
                    kv_data_type=dt)  # fmt: skip
        out = ragged.run(q, k, v)
        record(f"ragged_{backend}", lambda r=ragged: r.run(q, k, v), out, reference)

    def sdpa():
        outs = []
        for s in range(batch):
            qs = q[s * new : (s + 1) * new].transpose(0, 1)
            ks = k[s * total : (s + 1) * total].transpose(0, 1)
            vs = v[s * total : (s + 1) * total].transpose(0, 1)
            # NOTE: bottom-right causal alignment (cached keys visible to every new query) only
            # matches is_causal when nothing is cached; the cached cases time SDPA without it.
            outs.append(torch.nn.functional.scaled_dot_product_attention(
                qs, ks, vs, is_causal=cached == 0, scale=scale, enable_gqa=True).transpose(0, 1))  # fmt: skip
        return torch.cat(outs)

    record("torch_sdpa", sdpa, sdpa(), reference if cached == 0 else None)
    return row


def probe_mixed(flashinfer, workspace: torch.Tensor, decodes: int, context: int, batch: int, new: int) -> dict:
    """A mixed step: ``decodes`` sequences decoding one token after ``context`` cached ones,
    then ``batch`` fresh prompts of ``new`` tokens; every sequence on the paged prefill
    kernels (FA3) against the decodes on the tensor-core decode kernel and the prompts on FA3
    (what the flashinfer planner plans for such a step)."""
    dev, dt = "cuda", torch.bfloat16
    lens = [context + 1] * decodes + [new] * batch
    q_lens = [1] * decodes + [new] * batch
    pages = [(n + PAGE - 1) // PAGE for n in lens]
    num_pages = sum(pages)
    k_cache = torch.randn(num_pages, PAGE, KV_HEADS, HEAD_DIM, device=dev, dtype=dt)
    v_cache = torch.randn_like(k_cache)
    as_int = dict(dtype=torch.int32, device=dev)
    qo_indptr = torch.tensor([0] + q_lens, **as_int).cumsum(0, dtype=torch.int32)
    page_indptr = torch.tensor([0] + pages, **as_int).cumsum(0, dtype=torch.int32)
    indices = torch.randperm(num_pages, device=dev).to(torch.int32)
    last = torch.tensor([n - (p - 1) * PAGE for n, p in zip(lens, pages)], **as_int)
    q = torch.randn(int(qo_indptr[-1]), HEADS, HEAD_DIM, device=dev, dtype=dt)
    scale, common = 1 / math.sqrt(HEAD_DIM), dict(q_data_type=dt, kv_data_type=dt)
    whole = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD", backend="fa3")
    whole.plan(qo_indptr, page_indptr, indices, last, HEADS, KV_HEADS, HEAD_DIM, PAGE, causal=True, sm_scale=scale, **common)
    decode = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD", use_tensor_cores=True, backend="fa2")
    split_page = int(page_indptr[decodes])
    decode.plan(page_indptr[: decodes + 1], indices[:split_page], last[:decodes], HEADS, KV_HEADS, HEAD_DIM, PAGE,
                sm_scale=scale, **common)  # fmt: skip
    prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD", backend="fa3")
    prefill.plan(qo_indptr[decodes:] - decodes, page_indptr[decodes:] - split_page, indices[split_page:], last[decodes:],
                 HEADS, KV_HEADS, HEAD_DIM, PAGE, causal=True, sm_scale=scale, **common)  # fmt: skip
    kv = (k_cache, v_cache)

    def split():
        out = torch.empty_like(q)
        decode.run(q[:decodes], kv, out=out[:decodes])
        prefill.run(q[decodes:], kv, out=out[decodes:])
        return out

    row = {"decodes": decodes, "context": context, "batch": batch, "new": new,
           "whole_prefill_ms": events_ms(lambda: whole.run(q, kv)), "split_ms": events_ms(split),
           "max_diff": (split().float() - whole.run(q, kv).float()).abs().max().item()}  # fmt: skip
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path)
    parser.add_argument("--cases", default="8x1000,5x1500,1x8192,4x1000+1000,8x500+1000")
    parser.add_argument("--mixed", default="256x1000:4x1000,480x1500:2x1000,64x2000:6x1000",
                        help="mixed steps DxC:BxQ: D decodes after C cached tokens, then B prompts of Q tokens")
    opts = parser.parse_args(argv)
    import flashinfer

    workspace = torch.zeros(256 << 20, dtype=torch.uint8, device="cuda")
    rows = []
    for case in opts.cases.split(","):
        row = probe(flashinfer, workspace, *parse_case(case))
        rows.append(row)
        summary = ", ".join(f"{name} {ms:.3f} ms ({row['tflops'][name]:.0f} TF)" for name, ms in row["ms"].items())
        print(f"{case:12} {row['gflop']:.0f} GFLOP: {summary}; max diff {row.get('max_diff')}", flush=True)
    for case in opts.mixed.split(",") if opts.mixed else ():
        decodes, prompts = case.split(":")
        row = probe_mixed(flashinfer, workspace, *map(int, decodes.split("x")), *map(int, prompts.split("x")))
        rows.append(row)
        print(f"mixed {case}: every sequence on FA3 prefill {row['whole_prefill_ms']:.3f} ms, decodes on the decode "
              f"kernel {row['split_ms']:.3f} ms; max diff {row['max_diff']:.1e}", flush=True)  # fmt: skip
    if opts.json:
        write_result(opts.json, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
