# shellcheck shell=bash
# Downloading wheels for the lent GPU machine's Python (CPython 3.12, x86-64 manylinux), which has no
# registry: scripts/bundle_redis.sh and scripts/bundle_mooncake.sh put them under .whl/ (`carry` .whl;
# scripts/gpu_run.sh installs or unpacks them there). Sourced; needs python3 with pip here.
#
#   source scripts/lib/wheels.sh
#   download_gpu_wheels DIR SPEC...   # e.g. download_gpu_wheels .whl "redis==5.2.1"
#
# Binary wheels only, no dependencies (name every wheel needed); the newest manylinux tag the GPU
# machine's glibc takes first (2_28), then 2_17 / manylinux2014.

GPU_PYTHON_VERSION=3.12
GPU_WHEEL_PLATFORMS=(manylinux_2_28_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64)

# download_gpu_wheels DIR SPEC...: pip download of SPEC... (pinned requirement strings) into DIR.
download_gpu_wheels() {
  local dir=$1
  shift
  local plat=()
  for p in "${GPU_WHEEL_PLATFORMS[@]}"; do plat+=(--platform "$p"); done
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$GPU_PYTHON_VERSION" \
    --implementation cp "${plat[@]}" -d "$dir" "$@"
}
