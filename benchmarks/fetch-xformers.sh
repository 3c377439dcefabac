#!/usr/bin/env bash
# Run here, from the project root: puts into .gpuxf (git-ignored through .git/info/exclude) what the GPU
# machine needs to run the xformers adapter on the real library: xformers' wheel (no dependencies: the
# device has its PyTorch) and the CUDA 12 runtime its C++/CUDA extensions link (the device has CUDA 13
# only; without it xformers imports with a warning and has no operator). Then, in a call that carries
# [".gpudeps", ".gpuxf"] (with .fa4b for flash-attn 4 too):  bash benchmarks/gpu_session.sh xformers SHA
set -euo pipefail
rm -rf .gpuxf && mkdir -p .gpuxf
download() {
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .gpuxf "$@"
}
download "xformers==${XFORMERS_VERSION:-0.0.35}"
download "nvidia-cuda-runtime-cu12==12.8.*"
grep -qx "/.gpuxf/" .git/info/exclude 2>/dev/null || echo "/.gpuxf/" >> .git/info/exclude
ls .gpuxf; du -sh .gpuxf
