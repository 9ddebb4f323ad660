#!/usr/bin/env bash
# Install the Mooncake Store client (the `mooncake` extra: the Mooncake tier, lmtier.tiers.mooncake)
# into a venv, idempotently:
#
#   bash scripts/setup_mooncake.sh [VENV]      (default: .venv; run from anywhere)
#
# * Debian libraries the wheel's store.so links against (libibverbs1 librdmacm1 libnuma1; without them
#   `from mooncake.store import MooncakeDistributedStore` fails with "libibverbs.so.1: cannot open
#   shared object file"), installed with apt-get when run as root, else a hint and exit 1.
# * the wheel mooncake-transfer-engine-non-cuda (pinned below; it ships mooncake_master too) and its
#   dependencies aiohttp, msgpack, requests. A local wheel is used when MOONCAKE_WHEEL names one or one
#   lies in .whl/ or /tmp/mc/ (no network needed then for the wheel itself), else PyPI.
# Skips every step already done; the last line checks the import and the master binary.
set -euo pipefail
top=$(cd "$(dirname "$0")/.." && pwd)
venv=${1:-$top/.venv}
py=$venv/bin/python
[ -x "$py" ] || { echo "setup_mooncake: no python at $py" >&2; exit 1; }
version=0.3.13.post1
pkgs=()
for p in libibverbs1 librdmacm1 libnuma1; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'ok installed' || pkgs+=("$p")
done
if [ ${#pkgs[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    apt-get -o DPkg::Lock::Timeout=600 update -qq >/dev/null
    DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=600 install -y -qq "${pkgs[@]}" >/dev/null
  else
    echo "setup_mooncake: missing Debian packages ${pkgs[*]}: apt-get install ${pkgs[*]}" >&2
    exit 1
  fi
fi
installed=$("$py" -m pip show mooncake-transfer-engine-non-cuda 2>/dev/null | awk '/^Version/{print $2}' || true)
if [ "$installed" != "$version" ]; then
  wheel=${MOONCAKE_WHEEL:-}
  if [ -z "$wheel" ]; then
    wheel=$(ls "$top"/.whl/mooncake_transfer_engine_non_cuda-"$version"-*.whl \
      /tmp/mc/mooncake_transfer_engine_non_cuda-"$version"-*.whl 2>/dev/null | head -1 || true)
  fi
  # aiohttp, msgpack, requests: the wheel's own dependencies (pip skips those already present)
  "$py" -m pip install -q "${wheel:-mooncake-transfer-engine-non-cuda==$version}" aiohttp msgpack requests
fi
"$py" -c 'from mooncake.store import MooncakeDistributedStore' &&
  mm=$(dirname "$py")/mooncake_master && [ -x "$mm" ] &&
  echo "setup_mooncake: mooncake-transfer-engine-non-cuda $version ready in $venv ($mm)"
