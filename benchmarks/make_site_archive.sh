#!/bin/bash
# Pack wheels into one site archive for a GPU box with no network (benchmarks/gpu_env.sh unpacks
# site*.tar.xz archives into its site directory as they are).
#
#   benchmarks/make_site_archive.sh OUT.tar.xz WHEEL...
#
# Ray's wheel is slimmed on the way: the Java jar (~32 MB packed), the dashboard's web client and
# the libraries flotilla does not import (rllib, data, tune, train, llm) are left out; xz packs
# ray's binaries about a third smaller than the wheel's zip. Measured 2026-11-30: ray 2.60.0 +
# jsonschema and its three dependencies + flashinfer-python 0.7.2.post1 (slimmed wheel) +
# apache-tvm-ffi 0.1.12 -> 44 MB, which leaves room in one 64 MiB carry for the flashinfer JIT
# cache parts (19 MB) and the checkout. Fetch the wheels here with
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 -d WHEELDIR \
#       ray==2.60.0 jsonschema jsonschema-specifications referencing rpds-py
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
tar cJf "$out" -C "$tree" .
ls -la "$out"
