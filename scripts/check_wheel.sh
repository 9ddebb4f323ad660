#!/usr/bin/env bash
# Build lmtier's wheel, install it into a fresh venv and run the CLI outside the checkout: the check
# that `lmtier bench ...` works from an installed wheel (no file of the source tree is read).
# Usage: scripts/check_wheel.sh [WORK_DIR]      (default: a temp dir; LMTIER_CUDA / LMTIER_CUDA_ARCHS
# choose the build as in setup.py; the check itself runs on the CPU)
set -euo pipefail
top=$(cd "$(dirname "$0")/.." && pwd)
work=${1:-$(mktemp -d /tmp/lmtier-wheel-XXXX)}
mkdir -p "$work"
py=${PYTHON:-python3}
echo "check_wheel: building in $work"
LMTIER_BUILD_JOBS=${LMTIER_BUILD_JOBS:-2} "$top/.venv/bin/python" -m pip wheel -q --no-deps --no-build-isolation \
  -w "$work/dist" "$top"
"$py" -m venv "$work/venv"
"$work/venv/bin/python" -m pip install -q "$(ls "$work"/dist/lmtier-*.whl)[bench]"  # bench: transformers, matplotlib
cd "$work"   # outside the checkout
"$work/venv/bin/lmtier" --help >/dev/null
"$work/venv/bin/lmtier" bench transfer --help >/dev/null
"$work/venv/bin/python" -c "import lmtier, lmtier._C; print('lmtier', lmtier.__version__, 'from', lmtier.__file__)"
"$work/venv/bin/lmtier" bench ttft --device cpu --lengths 512 --no-redis --iters 2 --warmup 1 --quiet \
  --json "$work/ttft.json"
echo "check_wheel: OK ($work)"
