#!/usr/bin/env bash
# Bundle NIXL (the nixl-cu12 wheel for the GPU machine's Python, cp312) trimmed to what lmtier's P2P tier
# uses -- the Python package, libnixl and its libraries, the UCX backend plugin and UCX with its shared
# memory (CMA) and CUDA transport modules -- into .whl/nixl.tar.xz, for a machine with no registry (the
# lent GPU machine: scripts/gpu_run.sh unpacks it and puts it on PYTHONPATH; `carry` .whl).
#
#   bash scripts/bundle_nixl.sh              (run here, from the repo root; the wheel alone is 68.6 MB,
#                                             over the 64 MiB a device call carries)
#   NIXL_BUNDLE_PYTHON=3.11 bash scripts/bundle_nixl.sh   (the same trim of this box's cp311 wheel, to
#                                             check the bundle here: scripts/check_nixl_bundle.py)
#
# Dropped: every backend plugin but UCX (GDS, GDS_MT, POSIX, OBJ, AZURE_BLOB, GPUNETIO, LIBFABRIC, GUSLI,
# INFINIA, ...) and the telemetry exporters; UCX's InfiniBand modules (ib, mlx5, efa: with libibverbs,
# libmlx5 and libnl -- the hosts lmtier's P2P runs on here have no RDMA device, and libnl-route's
# destructor crashes such a process at exit, docs/p2p.md) and its perftest modules; nixl_ep_cu12 and the
# wheel's scripts; then every bundled library no kept ELF file loads (ldd closure of the Python
# extensions, the UCX plugin and the kept UCX modules). Kept UCX transports: tcp, self, sysv/posix
# shared memory, cma (built into libuct / libuct_cma) and cuda (libuct_cuda: cuda_copy, cuda_ipc; it
# loads the driver's libcuda at run time). A fabric with RDMA needs the full wheel.
set -euo pipefail
top=$(git rev-parse --show-toplevel)
cd "$top"
source scripts/lib/wheels.sh
ver=${NIXL_VERSION:-1.5.1}
GPU_PYTHON_VERSION=${NIXL_BUNDLE_PYTHON:-$GPU_PYTHON_VERSION}
out=${NIXL_BUNDLE_OUT:-$top/.whl/nixl.tar.xz}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
download_gpu_wheels "$work/dl" "nixl-cu12==$ver"  # scripts/lib/wheels.sh
mkdir -p "$work/pkg" "$(dirname "$out")"
python3 -m zipfile -e "$work"/dl/*.whl "$work/pkg"
cd "$work/pkg"
rm -rf nixl_ep_cu12 nixl_cu12.scripts nixl_cu12-*.data
plugins=.nixl_cu12.mesonpy.libs/plugins
find "$plugins" -maxdepth 1 -type f ! -name libplugin_UCX.so -delete
find nixl_cu12.libs/ucx -type f ! -name 'libuct_cma.so*' ! -name 'libuct_cuda.so*' ! -name 'libucm_cuda.so*' -delete
# the ldd closure of what stays; every other bundled library goes
roots=(nixl_cu12/*.so "$plugins"/libplugin_UCX.so nixl_cu12.libs/ucx/*.so*)
for f in "${roots[@]}"; do
  echo "$PWD/$f"
  ldd "$f" | awk '/=> \// {print $3}'
done | while read -r p; do realpath -m "$p"; done | sort -u > "$work/keep"
if ldd "${roots[@]}" | grep "not found" | grep -v -E 'libcuda\.so|libcudart\.so|libnvidia-ml\.so'; then
  echo "bundle_nixl: a library the bundle needs is not found (only CUDA's libcuda, libcudart, libnvidia-ml may be)" >&2
  exit 1
fi
for f in $(find .nixl_cu12.mesonpy.libs nixl_cu12.libs -maxdepth 1 -type f -name '*.so*'); do
  grep -qxF "$(realpath "$f")" "$work/keep" || rm -f "$f"
done
find . -name '*.la' -delete
du -sh . | sed 's/^/bundle_nixl: unpacked /'
tar -cf - . | xz -T0 -6 > "$out"
cd "$top"
ls -la "$out"
