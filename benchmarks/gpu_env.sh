# Source this on a bare GPU box with no network (the H200 test machines): installs the GPU wheels
# from a directory, puts the checkout on PYTHONPATH as `flotilla`, keeps NVLink multicast off,
# and restores / saves flashinfer's JIT cache as an archive split into parts small enough to
# carry between machines.
#
#   source benchmarks/gpu_env.sh WHEEL_DIR [CACHE_DIR]     # FLOTILLA_PREBUILT_ONLY=1: never JIT-compile
#   ... run tests / benchmarks ...
#   save_flashinfer_cache OUT_DIR        # OUT_DIR/ficache.tgz.part-aa, -ab, ... (15 MiB each)
#
# WHEEL_DIR holds flashinfer-python, apache-tvm-ffi (and anything else the box lacks) as wheels
# or as site*.tar.xz archives of installed package trees (see below);
# CACHE_DIR (default: WHEEL_DIR) may hold ficache.tgz.part-* from an earlier save.
wheel_dir="${1:?usage: source benchmarks/gpu_env.sh WHEEL_DIR [CACHE_DIR]}"
cache_dir="${2:-$wheel_dir}"
site=/tmp/flotilla-site
mkdir -p "$site"
# A site archive (site*.tar.xz: installed package trees, e.g. a slimmed ray with flashinfer) is
# unpacked as is: xz packs ray's binaries a third smaller than its wheel, so more fits a carry.
for archive in "$wheel_dir"/site*.tar.xz; do
    [ -f "$archive" ] && { tar xJf "$archive" -C "$site" || return 1; }
done
if ls "$wheel_dir"/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" "$wheel_dir"/*.whl || return 1
fi
mkdir -p /tmp/flotilla-pkg && ln -sfn "$PWD" /tmp/flotilla-pkg/flotilla
export PYTHONPATH="$site:/tmp/flotilla-pkg${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
# Compile flashinfer's kernels for Hopper only (its JIT builds every listed arch otherwise).
export FLASHINFER_CUDA_ARCH_LIST="${FLASHINFER_CUDA_ARCH_LIST:-9.0a}"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export FLASHINFER_WORKSPACE_BASE="${FLASHINFER_WORKSPACE_BASE:-$HOME}"
# install_flashinfer_aot CACHE: every compiled module of a flashinfer JIT cache copied into the
# installed package's AOT directory (flashinfer/data/aot/NAME/NAME.so). flashinfer loads an AOT
# module as it is; a JIT-cache module goes through ninja first, which rebuilds it when the
# build time in its .ninja_log is older than the package's headers, i.e. always on a machine
# where the wheel was installed after the cache was built.
install_flashinfer_aot() {
    local so name count=0
    for so in "$1"/*/*/cached_ops/*/*.so; do
        [ -f "$so" ] || continue
        name="$(basename "$(dirname "$so")")"
        [ "$(basename "$so" .so)" = "$name" ] || continue
        mkdir -p "$site/flashinfer/data/aot/$name" && cp "$so" "$site/flashinfer/data/aot/$name/" && count=$((count + 1))
    done
    echo "flashinfer: $count prebuilt modules installed as AOT"
}
if ls "$cache_dir"/ficache.tgz.part-* >/dev/null 2>&1; then
    mkdir -p "$FLASHINFER_WORKSPACE_BASE/.cache"
    cat "$cache_dir"/ficache.tgz.part-* | tar xzf - -C "$FLASHINFER_WORKSPACE_BASE/.cache" && echo "flashinfer JIT cache restored"
    install_flashinfer_aot "$FLASHINFER_WORKSPACE_BASE/.cache/flashinfer"
    # With FLOTILLA_PREBUILT_ONLY=1 a module the cache lacks is an error at once
    # (flashinfer's MissingJITCacheError) instead of minutes of compiling inside a timed run.
    [ "${FLOTILLA_PREBUILT_ONLY:-0}" = 1 ] && export FLASHINFER_DISABLE_JIT=1
fi
save_flashinfer_cache() {
    mkdir -p "$1" && tar czf - -C "$FLASHINFER_WORKSPACE_BASE/.cache" flashinfer | split -b 15M - "$1/ficache.tgz.part-"
    ls -la "$1"/ficache.tgz.part-*
}
