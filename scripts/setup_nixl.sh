#!/usr/bin/env bash
# Install NIXL (the `p2p` extra: P2P sharing over NIXL, lmtier.tiers.p2p) into a venv, idempotently:
#
#   bash scripts/setup_nixl.sh [VENV]      (default: .venv; run from anywhere)
#
# * the wheel nixl-cu12 (pinned below, ~68 MB; module `nixl_cu12`, with the UCX plugin) installed
#   with --no-deps: its declared dependencies pull a CUDA torch (~3 GB), which lmtier does not need
#   for CPU-pool sharing (`pip install nixl` would also pull nixl-cu13; the `nixl` 1.5.2 meta package
#   pins sub-packages this registry lacks: docs/p2p.md). numpy, its one runtime import, is already
#   in the venv. A local wheel is used when NIXL_WHEEL names one or one lies in .whl/, else the index.
# Skips the install when that version is present; the last line checks that an agent with the UCX
# backend starts.
set -euo pipefail
top=$(cd "$(dirname "$0")/.." && pwd)
venv=${1:-$top/.venv}
py=$venv/bin/python
[ -x "$py" ] || { echo "setup_nixl: no python at $py" >&2; exit 1; }
version=1.5.1
installed=$("$py" -m pip show nixl-cu12 2>/dev/null | awk '/^Version/{print $2}' || true)
if [ "$installed" != "$version" ]; then
  wheel=${NIXL_WHEEL:-}
  if [ -z "$wheel" ]; then
    wheel=$(ls "$top"/.whl/nixl_cu12-"$version"-*.whl 2>/dev/null | head -1 || true)
  fi
  "$py" -m pip install -q --no-deps "${wheel:-nixl-cu12==$version}"
fi
# UCX_MODULES=^ib: the wheel crashes at exit on hosts without RDMA devices otherwise (docs/p2p.md)
UCX_MODULES=${UCX_MODULES:-^ib} "$py" -c '
import nixl_cu12._api as api
a = api.nixl_agent("setup-nixl-check", api.nixl_agent_config(backends=["UCX"]))
assert "UCX" in a.backends, a.backends
' >/dev/null 2>&1 && echo "setup_nixl: nixl-cu12 $version (UCX backend) ready in $venv"
