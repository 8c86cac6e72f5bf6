#!/usr/bin/env bash
# The single-H200 benchmarks (issues 8 and 33): flotilla and the HF transformers peer, JSON into OUTDIR.
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
# bounds each command in seconds. RUN_H200_ONLY=NAME,NAME runs only the commands of the part so
# named (the names of their JSON files, without .json). RUN_H200_PREBUILD=1 first builds the
# flashinfer modules that take no shape arguments (norm, sampling, RoPE, SiLU) in background
# processes while a short latency run of the part's first shape compiles the rest, and waits
# for all of them, so no compile overlaps a timed command (on a cold cache: ~2.5 min, not ~5).
# On a copy of the checkout (its .git may be stale or missing), FLOTILLA_GIT_STATE names the git state saved in the
# checkout beforehand (`python -m flotilla.deploy.bench_env FILE`), so each JSON names its commit.
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
export FLASHINFER_CUDA_ARCH_LIST="${FLASHINFER_CUDA_ARCH_LIST:-9.0a}"
mkdir -p "$FLASHINFER_WORKSPACE_BASE"
if ! "$py" -c "import flotilla.deploy.cli" 2>/dev/null; then
    mkdir -p "$repo/build/pypath"
    ln -sfn "$repo" "$repo/build/pypath/flotilla"
    export PYTHONPATH="$repo/build/pypath${PYTHONPATH:+:$PYTHONPATH}"
fi

failed=()
only=",${RUN_H200_ONLY:-},"
# run NAME CMD...: the command's output to OUTDIR/NAME.log (and the terminal), bounded by BENCH_TIMEOUT.
run() {
    local name="$1"; shift
    if [ "$only" != ",," ] && [[ "$only" != *",$name,"* ]]; then
        echo "=== $name: skipped (RUN_H200_ONLY)"
        return 0
    fi
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

# prebuild SHAPE: flashinfer's shape-free modules in the background and a short latency run of
# SHAPE (prefill, decode and graph-decode modules), all finished before the part's first command.
prebuild() {
    [ "${RUN_H200_PREBUILD:-0}" = 1 ] || return 0
    local started=$SECONDS pids=() getter
    for getter in "norm import get_norm_module as g; g()" "sampling import get_sampling_module as g; g()" \
                  "rope import get_rope_module as g; g()" "activation import get_act_and_mul_module as g; g('silu')"; do
        FLASHINFER_USE_CUDA_NORM=1 "$py" -c "from flashinfer.$getter" >"$out/prebuild-$$-${#pids[@]}.log" 2>&1 &
        pids+=($!)
    done
    timeout --signal=TERM --kill-after=20 "$limit" "$py" -m flotilla.deploy.cli bench latency --shape "$1" \
        --dtype bfloat16 --batch-size 1 --input-len 128 --output-len 8 --num-iters 1 --warmup-steps 2 \
        >"$out/prebuild-$1.log" 2>&1 || echo "=== prebuild: the warm-up run of $1 failed (see prebuild-$1.log)"
    for pid in "${pids[@]}"; do wait "$pid" || echo "=== prebuild: a flashinfer module build failed"; done
    echo "=== prebuild: $((SECONDS - started)) s"
}

case "$part" in
part1)
    prebuild llama-3.1-8b
    # Acceptance (issue 33): TPOT <= 3.9 ms and MBU >= 0.9 at batch 1; >= 12,000 output tok/s
    # offline with the default flags (issue 8's: 4.5 ms, 0.8, 10,000).
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
    prebuild qwen3-30b-a3b
    # Acceptance: MBU >= 0.65 at batch 1 (issue 33; issue 8's: 0.5); offline tokens/s reported.
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
