"""Prefill on one GPU, decode on another: the engines' KV handoff VRAM to VRAM with NIXL.

    python benchmarks/kv_gpu_bench.py [--shape llama-3.1-8b|tiny] [--prompts 8] [--input-len 1024]
                                      [--output-len 16] [--dtype bfloat16] [--device cuda|cpu] [--json OUT]

Two Ray actors, one GPU each (Ray gives each its own ``CUDA_VISIBLE_DEVICES``): a prefill
engine on GPU 0 and a decode engine on GPU 1, both the in-process engine (``LLM``) over a
Llama-3.1-8B-shaped config with ``--load-format dummy`` weights (the same deterministic
tensors on both). Each engine's rank has a NIXL KV endpoint (UCX; VRAM registered once);
the decode engine connects to the prefill's metadata (passed through Ray) and, per prompt,
READs the prompt's KV blocks straight from GPU 0's memory into its own blocks, then decodes.
Per prompt the script times the read alone (``runner.kv.read``) and reports its bytes and
GB/s; the greedy tokens of the handoff are compared with the decode engine computing the same
prompt itself. Raw NIXL (two agents, one buffer each, one READ of the same size, no flotilla
code) is measured in the same run for comparison.

``--shape tiny --device cpu`` runs the same code on a tiny config in DRAM, as a smoke test.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from flotilla.deploy.bench_env import write_result

sys.path.insert(0, str(Path(__file__).parent))

from pd_bench import raw_nixl_gbps  # noqa: E402
from tp_bench import LLAMA_31_8B, TINY  # noqa: E402


def _host_class():
    import ray

    @ray.remote
    class EngineHost:
        """One engine on one device with a NIXL KV endpoint on its rank."""

        def __init__(self, model_dir: str, name: str, flags: dict, device: str):
            from flotilla.cluster.engine.llm import LLM
            from flotilla.cluster.kv.endpoint import KVEndpointFactory

            from flotilla.cluster.platform import probe

            # NOTE: this actor's own device: a probe on "a worker" would need a free GPU,
            # and both are held by the two engines.
            flags = {**flags, "platform": probe()}
            self.llm = LLM(model_dir, **flags)
            self.engine = self.llm.engine
            self.runner = self.engine.runner
            self.runner.kv.attach(KVEndpointFactory("nixl", name))
            self.name = name
            self.device = device

        def metadata(self) -> list[bytes]:
            return self.runner.kv.metadata()

        def connect(self, peer: str, metadata: list[bytes]) -> None:
            self.runner.kv.connect(peer, metadata)

        def prefill(self, prompt: list[int]):
            from flotilla.cluster.engine.kv_handoff import prefill
            from flotilla.cluster.engine.sampling_params import SamplingParams

            return prefill(self.engine, prompt, SamplingParams(temperature=0, ignore_eos=True))

        def release(self, ticket) -> bool:
            from flotilla.cluster.engine.kv_handoff import release_prefill

            return release_prefill(self.engine, ticket)

        def decode_prefilled(self, ticket, peer: str, output_len: int) -> dict:
            """Read the prompt's blocks from ``peer`` (timed alone: the read waited for, on this
            actor's thread), then decode; policy ``fail`` so a broken read cannot hide behind a
            recompute."""
            import torch

            from flotilla.cluster.engine.kv_handoff import decode_prefilled
            from flotilla.cluster.engine.sampling_params import SamplingParams

            reads: list[tuple[int, float]] = []

            def copy_blocks(src: list[int], dst: list[int]) -> None:
                if self.device == "cuda":
                    torch.cuda.synchronize()
                start = time.perf_counter()
                moved = self.runner.kv.read(peer, src, dst, 60.0)
                if self.device == "cuda":
                    torch.cuda.synchronize()
                reads.append((moved, time.perf_counter() - start))

            params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
            request_id = decode_prefilled(self.engine, ticket, copy_blocks, params, policy="fail")
            while not self.engine.get_output(request_id).finished:
                self.engine.step()
            tokens = list(self.engine.pop_output(request_id).outputs[0].token_ids)
            return {"tokens": tokens, "bytes": sum(b for b, _ in reads), "seconds": sum(s for _, s in reads)}

        def generate(self, prompt: list[int], output_len: int) -> list[int]:
            from flotilla.cluster.engine.sampling_params import SamplingParams

            params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
            return list(self.llm.generate([prompt], params)[0].outputs[0].token_ids)

        def used_blocks(self) -> int:
            pool = self.engine.scheduler.pool
            return int(pool.num_blocks - pool.num_free_blocks) if hasattr(pool, "num_free_blocks") else -1

    return EngineHost


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=("llama-3.1-8b", "tiny"), default="llama-3.1-8b")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--input-len", type=int, default=1024)
    parser.add_argument("--output-len", type=int, default=16)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--json", type=Path, default=None)
    opts = parser.parse_args(argv)

    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    import ray
    import torch

    config = LLAMA_31_8B if opts.shape == "llama-3.1-8b" else TINY
    generator = torch.Generator().manual_seed(0)
    prompts = torch.randint(3, config["vocab_size"], (opts.prompts, opts.input_len), generator=generator).tolist()
    flags = dict(
        dtype=opts.dtype,
        load_format="dummy",
        skip_tokenizer_init=True,
        attention_backend="torch_native",
        max_total_tokens=opts.prompts * (opts.input_len + opts.output_len) + 1024,
        chunked_prefill_size=8192,
        disable_cuda_graph=True,
    )
    gpus = 1 if opts.device == "cuda" else 0
    env = {k: os.environ[k] for k in ("UCX_NET_DEVICES", "UCX_TLS") if k in os.environ}
    # NOTE: address="local": a cluster of its own, even where another process's cluster runs here.
    ray.init(address="local", num_cpus=4, num_gpus=2 * gpus, include_dashboard=False, runtime_env={"env_vars": env})
    host = _host_class().options(num_gpus=gpus, num_cpus=1)
    results: dict = {"shape": opts.shape, "prompts": opts.prompts, "input_len": opts.input_len,
                     "output_len": opts.output_len, "dtype": opts.dtype, "device": opts.device}
    with tempfile.TemporaryDirectory() as model_dir:
        (Path(model_dir) / "config.json").write_text(json.dumps(config))
        start = time.perf_counter()
        prefill_host = host.remote(model_dir, "bench-prefill", flags, opts.device)
        decode_host = host.remote(model_dir, "bench-decode", flags, opts.device)
        ray.get(decode_host.connect.remote("prefill", prefill_host.metadata.remote()), timeout=900)
        results["load_s"] = round(time.perf_counter() - start, 1)
        reads, same, agree, total = [], 0, 0, 0
        for i, prompt in enumerate(prompts):
            ticket = ray.get(prefill_host.prefill.remote(prompt), timeout=300)
            try:
                out = ray.get(decode_host.decode_prefilled.remote(ticket, "prefill", opts.output_len), timeout=300)
            finally:
                ray.get(prefill_host.release.remote(ticket), timeout=60)
            colocated = ray.get(decode_host.generate.remote(prompt, opts.output_len), timeout=300)
            same += out["tokens"] == colocated
            agree += sum(a == b for a, b in zip(out["tokens"], colocated))
            total += len(colocated)
            reads.append(out)
            print(json.dumps({"prompt": i, "bytes": out["bytes"], "read_ms": round(1e3 * out["seconds"], 3),
                              "gb_s": round(out["bytes"] / out["seconds"] / 1e9, 2)}), flush=True)
        # NOTE: the first read sets up the UCX connection (cuda_ipc handles); report it apart.
        steady = reads[1:] or reads
        results.update(
            {
                "first_read_ms": round(1e3 * reads[0]["seconds"], 2),
                "bytes_per_read": reads[0]["bytes"],
                "read_ms_median": round(1e3 * statistics.median(r["seconds"] for r in steady), 3),
                "kv_read_gb_s_median": round(statistics.median(r["bytes"] / r["seconds"] for r in steady) / 1e9, 2),
                "identical_sequences": f"{same}/{len(prompts)}",
                "token_agreement": round(agree / total, 4),
                "prefill_blocks_left": ray.get(prefill_host.used_blocks.remote(), timeout=60),
            }
        )
        if opts.device == "cuda":
            results["gpu"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
        for actor in (prefill_host, decode_host):
            ray.kill(actor)
    results["raw_nixl_gb_s_by_bytes"] = raw_nixl_gbps([results["bytes_per_read"], 64 << 20], opts.device)
    results["kv_read_over_raw_nixl"] = round(
        results["kv_read_gb_s_median"] / results["raw_nixl_gb_s_by_bytes"][str(results["bytes_per_read"])], 3
    )
    print(json.dumps(results, indent=2))
    if opts.json:
        write_result(opts.json, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
