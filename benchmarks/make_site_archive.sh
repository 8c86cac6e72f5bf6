#!/bin/bash
# Pack wheels into one site archive for a GPU box with no network (benchmarks/gpu_env.sh unpacks
# site*.tar.xz archives into its site directory as they are).
#
#   benchmarks/make_site_archive.sh OUT.tar.xz WHEEL...
#
# Ray's wheel is slimmed on the way: the Java jar (~32 MB packed), the dashboard's web client and
# the libraries flotilla does not import (rllib, data, tune, train, llm) are left out, and its
# three native binaries (_raylet.so, gcs_server, raylet) lose their symbol tables (115 -> 84 MB).
# flashinfer's wheel loses the kernel sources of families flotilla does not build (its csrc
# subfolders, and the non-Python files of its experimental, MoE-EP, fused-MoE backend and
# prims_ts packages; the JIT builds flotilla's kernels from the top-level csrc files and the
# headers; every Python module stays, so `import flashinfer` is unchanged).
# xz -9e packs the tree with a dictionary large enough to share the two ray binaries' code.
# Measured 2026-12-01:
# - ray 2.60.0 + the ray[serve] dependencies the H200 image lacks (fastapi, starlette, uvicorn,
#   pydantic + pydantic-core, jsonschema and its three, aiohttp-cors, colorful, opencensus,
#   google-api-core/-auth, googleapis-common-protos, proto-plus, pyasn1(-modules), smart-open,
#   watchfiles, httptools, websockets, python-dotenv, opentelemetry-*, gguf): 23 MB;
#   grpcio-reflection must match the image's grpcio (1.84.0 there), so carry it as a wheel of
#   that version next to the archive;
# - flashinfer-python 0.7.2.post1 + apache-tvm-ffi 0.1.12: 15 MB;
# with the flashinfer JIT cache of the bench shapes and the fp8 tests (17 MB) and the checkout
# (5 MB): 60 MB, inside one 64 MiB carry. Fetch the wheels here with
#   python3 -m pip download --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
#       -d WHEELDIR "ray[serve]==2.60.0"
# and pass only those the image lacks (its package list: the device tool's KINDS.md).
set -euo pipefail
out="${1:?usage: make_site_archive.sh OUT.tar.xz WHEEL...}"
shift
[ $# -gt 0 ] || { echo "make_site_archive.sh: no wheels given" >&2; exit 2; }
tree="$(mktemp -d)"
trap 'rm -rf "$tree"' EXIT
for wheel in "$@"; do
    unzip -q -o "$wheel" -d "$tree"
done
rm -rf "$tree"/ray/jars "$tree"/ray/dashboard/client/build \
    "$tree"/ray/rllib "$tree"/ray/data "$tree"/ray/tune "$tree"/ray/train "$tree"/ray/llm
for binary in "$tree"/ray/_raylet.so "$tree"/ray/core/src/ray/gcs/gcs_server "$tree"/ray/core/src/ray/raylet/raylet; do
    [ -f "$binary" ] && strip --strip-unneeded "$binary"
done
if [ -d "$tree"/flashinfer/data/csrc ]; then
    find "$tree"/flashinfer/data/csrc -mindepth 1 -maxdepth 1 -type d -exec rm -rf {} +
    for folder in experimental moe_ep/kernel_src fused_moe/backends attention/prims_ts prims_ts; do
        [ -d "$tree/flashinfer/$folder" ] && find "$tree/flashinfer/$folder" -type f ! -name '*.py' -delete
    done
fi
tar cf - -C "$tree" . | xz -9e -T0 > "$out"
ls -la "$out"
