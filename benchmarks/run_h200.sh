#!/usr/bin/env bash
# Issue 8 on one H200: the flotilla benchmarks and the HF transformers peer, JSON into OUTDIR.
#
#   benchmarks/run_h200.sh part1 OUTDIR   # Llama-3.1-8B shape: latency bs1 128/512, offline 512 x 1000/1000
#   benchmarks/run_h200.sh part2 OUTDIR   # Qwen3-30B-A3B: latency bs1, offline 256 x 1000/1000; Qwen3-8B latency bs1
#   benchmarks/run_h200.sh part3 OUTDIR   # DeepSeek-V2-Lite latency bs1; HF peer (Llama-3.1-8B): eager bs1, bs64, static+compiled bs1
#   benchmarks/run_h200.sh profile OUTDIR # kernel-by-kernel GPU time of a batch-1 decode step (Llama-3.1-8B, Qwen3-30B-A3B)
#   benchmarks/run_h200.sh tp2 OUTDIR     # 2x H200 only: Llama-3.1-8B latency bs1 at TP=2 (compare with part1's TP=1)
#
# Each part is sized to finish in under 9 minutes with a warm flashinfer JIT cache; the first
# part on a fresh machine also compiles flashinfer's kernels (minutes, see shared/notes/gpu-h200.md).
# The JIT cache goes to build/flashinfer/.cache/flashinfer (build/ is ignored, so it stays on the
# machine between calls) unless FLASHINFER_WORKSPACE_BASE is set. Every command writes its JSON
# and a .log next to it; a failing command is reported and the part goes on with the next.
# PYTHON (default python3) must have torch, transformers and the GPU wheels; the checkout is put
# on PYTHONPATH as `flotilla` when that package is not importable. BENCH_TIMEOUT (default 480)
# bounds each command in seconds.
set -uo pipefail

part="${1:?usage: run_h200.sh part1|part2|part3|profile|tp2 OUTDIR}"
out="${2:?usage: run_h200.sh part1|part2|part3|profile|tp2 OUTDIR}"
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
py="${PYTHON:-python3}"
limit="${BENCH_TIMEOUT:-480}"
mkdir -p "$out"
out="$(cd "$out" && pwd)"
cd "$repo"

export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export FLASHINFER_WORKSPACE_BASE="${FLASHINFER_WORKSPACE_BASE:-$repo/build/flashinfer}"
mkdir -p "$FLASHINFER_WORKSPACE_BASE"
if ! "$py" -c "import flotilla.deploy.cli" 2>/dev/null; then
    mkdir -p "$repo/build/pypath"
    ln -sfn "$repo" "$repo/build/pypath/flotilla"
    export PYTHONPATH="$repo/build/pypath${PYTHONPATH:+:$PYTHONPATH}"
fi

failed=()
# run NAME CMD...: the command's output to OUTDIR/NAME.log (and the terminal), bounded by BENCH_TIMEOUT.
run() {
    local name="$1"; shift
    echo "=== $name: $*"
    local started=$SECONDS
    timeout --signal=TERM --kill-after=20 "$limit" "$@" 2>&1 | tee "$out/$name.log"
    local rc=${PIPESTATUS[0]}
    echo "=== $name: exit $rc after $((SECONDS - started)) s"
    [ "$rc" -eq 0 ] || failed+=("$name (exit $rc)")
}
bench() {  # bench NAME latency|offline ARGS...: flotilla bench, JSON to OUTDIR/NAME.json
    local name="$1" kind="$2"; shift 2
    run "$name" "$py" -m flotilla.deploy.cli bench "$kind" "$@" --output-json "$out/$name.json"
}

"$py" - <<'PY' 2>&1 | tee "$out/$part-environment.log"
import importlib.metadata as m, torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "devices", torch.cuda.device_count(),
      torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no CUDA")
for dist in ("transformers", "flashinfer-python", "apache-tvm-ffi", "triton", "sgl-deep-gemm"):
    try:
        print(dist, m.version(dist))
    except m.PackageNotFoundError:
        print(dist, "not installed")
PY

case "$part" in
part1)
    # Acceptance: TPOT <= 4.5 ms and MBU >= 0.8 at batch 1; >= 10,000 output tok/s offline.
    bench latency-llama-3.1-8b-bs1-128-512 latency --shape llama-3.1-8b --dtype bfloat16 \
        --batch-size 1 --input-len 128 --output-len 512 --num-iters 3 --warmup-steps 16
    # Side by side: the same run without overlap scheduling.
    bench latency-llama-3.1-8b-bs1-128-512-no-overlap latency --shape llama-3.1-8b --dtype bfloat16 \
        --batch-size 1 --input-len 128 --output-len 512 --num-iters 3 --warmup-steps 16 --disable-overlap-schedule
    bench offline-llama-3.1-8b-512x1000-1000 offline --shape llama-3.1-8b --dtype bfloat16 \
        --num-prompts 512 --input-len 1000 --output-len 1000
    # The default cap of 256 running requests leaves KV room unused (the pool holds ~444 sequences
    # of 2000 tokens on one H200): the same workload with more decode parallelism.
    bench offline-llama-3.1-8b-512x1000-1000-run512 offline --shape llama-3.1-8b --dtype bfloat16 \
        --num-prompts 512 --input-len 1000 --output-len 1000 --max-running-requests 512 --cuda-graph-max-bs-decode 512
    ;;
part2)
    # Acceptance: MBU >= 0.5 at batch 1; offline tokens/s reported.
    bench latency-qwen3-30b-a3b-bs1-128-512 latency --shape qwen3-30b-a3b --dtype bfloat16 \
        --batch-size 1 --input-len 128 --output-len 512 --num-iters 3 --warmup-steps 16
    bench offline-qwen3-30b-a3b-256x1000-1000 offline --shape qwen3-30b-a3b --dtype bfloat16 \
        --num-prompts 256 --input-len 1000 --output-len 1000
    bench latency-qwen3-8b-bs1-128-512 latency --shape qwen3-8b --dtype bfloat16 \
        --batch-size 1 --input-len 128 --output-len 512 --num-iters 3 --warmup-steps 16
    ;;
part3)
    bench latency-deepseek-v2-lite-bs1-128-512 latency --shape deepseek-v2-lite --dtype bfloat16 \
        --batch-size 1 --input-len 128 --output-len 512 --num-iters 3 --warmup-steps 16
    # The peer: flotilla >= 5x HF eager at batch 64, >= 2.5x HF static+compiled at batch 1.
    run hf-peer-llama-3.1-8b "$py" benchmarks/hf_peer_bench.py --shape llama-3.1-8b --dtype bfloat16 \
        --parts eager1,eager64,static1 --input-len 128 --output-len 512 --batch-size 64 --batch-output-len 256 \
        --json "$out/hf-peer-llama-3.1-8b.json"
    # flotilla's side of the batch-64 comparison: the same 64 x 128/256 workload.
    bench offline-llama-3.1-8b-64x128-256 offline --shape llama-3.1-8b --dtype bfloat16 \
        --num-prompts 64 --input-len 128 --output-len 256
    ;;
profile)
    # Where a batch-1 decode step's GPU time goes, kernel by kernel (graph replay under torch's profiler).
    run profile-llama-3.1-8b-bs1 "$py" benchmarks/dev/decode_profile.py --shape llama-3.1-8b --batch-size 1 \
        --json "$out/profile-llama-3.1-8b-bs1.json"
    # Side by side: the same graph without programmatic dependent launch of the Triton GEMVs.
    run profile-llama-3.1-8b-bs1-no-pdl "$py" benchmarks/dev/decode_profile.py --shape llama-3.1-8b --batch-size 1 \
        --without pdl --json "$out/profile-llama-3.1-8b-bs1-no-pdl.json"
    run profile-qwen3-30b-a3b-bs1 "$py" benchmarks/dev/decode_profile.py --shape qwen3-30b-a3b --batch-size 1 \
        --json "$out/profile-qwen3-30b-a3b-bs1.json"
    ;;
tp2)  # needs ray on the box (gpu_env.sh unpacks a site*.tar.xz archive holding a slimmed ray)
    bench latency-llama-3.1-8b-bs1-128-512-tp2 latency --shape llama-3.1-8b --dtype bfloat16 --tp 2 \
        --batch-size 1 --input-len 128 --output-len 512 --num-iters 3 --warmup-steps 16
    bench latency-llama-3.1-8b-bs1-128-512-tp1 latency --shape llama-3.1-8b --dtype bfloat16 --tp 1 \
        --batch-size 1 --input-len 128 --output-len 512 --num-iters 3 --warmup-steps 16
    ;;
*)
    echo "run_h200.sh: unknown part '$part' (part1, part2, part3, profile, tp2)" >&2
    exit 2
    ;;
esac

if [ "${#failed[@]}" -gt 0 ]; then
    echo "run_h200.sh $part: FAILED: ${failed[*]}"
    exit 1
fi
echo "run_h200.sh $part: all commands succeeded; results in $out"
