#!/usr/bin/env bash
# vLLM 0.33's own engine on the lent H200, with lmtier's connector and vLLM's native offloading:
# the user's serving benchmark (benchmarks/bench_vllm_gpu.py), one device call. From the repo root:
#   bash scripts/gpu_vllm_bench.sh [bench_vllm_gpu.py options]     (writes logs and JSON under $OUT)
# Needs .whl/vllm from scripts/bundle_vllm.sh here (carry .whl/vllm). Steps:
#   1. lmtier's _C for CUDA (sm_90) in the background (kept in /tmp for a later call on a warm machine);
#   2. vLLM's Python-only package unpacked to /tmp/vllm_py, its wheels installed to /tmp/vllm_site, the
#      shim's platform plugin made discoverable there (lmtier/testing/vllm_gpu_shim);
#   3. the shim's op self-test;
#   4. the benchmark: the no-connector case starts at once, the lmtier cases wait for the build.
#   5. with LMTIER_GPU_TESTS=1: the `gpu` tests on this build (after the benchmark, not beside it).
# Environment: VLLM_BENCH_BUDGET_S (default 470: all cases together), VLLM_BENCH_CASES, VLLM_BUNDLE
# (default .whl/vllm). The lmtier_redis_codec case needs redis-server (scripts/bundle_redis.sh: carry
# .whl/redis) and redis-py (carry its wheel under .whl/, installed with the other .whl/*.whl).
# $OUT gets gpu.txt, bench.log, bench_vllm_gpu.json, gpu_tests.log and logs.tar.gz (every log).
set -uo pipefail
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 VLLM_NO_USAGE_STATS=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
PY=${PYTHON:-python3}
B=${VLLM_BUNDLE:-.whl/vllm}
T0=$(date +%s)
el() { echo "[$(( $(date +%s) - T0 )) s]"; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
$PY -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'
echo "repo $PWD; $(nproc) cores; $(free -g | awk '/Mem:/ {print $2 " GiB RAM"}'); /dev/shm $(df -BG --output=size,avail /dev/shm | tail -1)"
# vLLM's native offloading maps its CPU tier from /dev/shm (vllm_offload_*.mmap): make room for it
# (this VM's tmpfs is sized from the memory at boot, which grows later)
need_gib=${VLLM_SHM_GIB:-40}
if [ "$(df -BG --output=avail /dev/shm | tail -1 | tr -dc 0-9)" -lt "$need_gib" ]; then
  mount -o remount,size=${need_gib}G /dev/shm && echo "/dev/shm remounted: $(df -BG --output=size /dev/shm | tail -1)"
fi

if ls .whl/*.whl >/dev/null 2>&1; then  # small extra wheels (redis-py, hiredis)
  $PY -m pip install -q --upgrade --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl \
    > /tmp/extra_pip.log 2>&1 && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
if [ -x .whl/redis/redis-server ]; then export PATH=$PWD/.whl/redis:$PATH; fi

# 1. lmtier's extension, built in the background unless this machine already has this source's build
hash=$(cat setup.py CMakeLists.txt $(find csrc -type f | sort) | sha1sum | cut -c1-16)
so=/tmp/lmtier_so/$hash
ready=/tmp/lmtier_build_ready
rm -f "$ready"
if ls "$so"/_C*.so >/dev/null 2>&1; then
  cp "$so"/_C*.so lmtier/ && echo ok > "$ready"
  echo "$(el) lmtier _C: reused $so"
else
  (
    rm -f lmtier/_C*.so
    # half the cores, lower priority: the first benchmark case runs meanwhile
    if LMTIER_CUDA=ON LMTIER_CUDA_ARCHS=90 LMTIER_BUILD_JOBS=$(( $(nproc) / 2 )) nice -n 10 \
      $PY setup.py -q build_ext --inplace > /tmp/lmtier_build.log 2>&1; then
      mkdir -p "$so" && cp lmtier/_C*.so "$so"/ && echo ok > "$ready.tmp"
    else
      echo failed > "$ready.tmp"
    fi
    mv "$ready.tmp" "$ready"
  ) &
  echo "$(el) lmtier _C: building in the background"
fi

# 2. vLLM (Python only) + its wheels + the shim's entry point
EX=/tmp/vllm_py SITE=/tmp/vllm_site
tarball=$(ls $B/vllm-*-py.tar.xz) || { echo "no $B/vllm-*-py.tar.xz: run scripts/bundle_vllm.sh and carry .whl/vllm"; exit 1; }
stamp=$(sha1sum "$tarball" | cut -c1-16)
if [ ! -f "$EX/.$stamp" ]; then
  rm -rf "$EX" && mkdir -p "$EX" && tar -C "$EX" -xJf "$tarball" && touch "$EX/.$stamp"
fi
if [ ! -f "$SITE/.$stamp" ]; then
  rm -rf "$SITE"
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" $B/wheels/*.whl \
    > /tmp/vllm_pip.log 2>&1 || { tail -5 /tmp/vllm_pip.log; echo "pip install failed"; exit 1; }
  touch "$SITE/.$stamp"
fi
export PYTHONPATH=$PWD:$EX:$SITE${PYTHONPATH:+:$PYTHONPATH}
$PY -c "from lmtier.testing.vllm_gpu_shim import write_entry_point as w; w('$SITE')"
echo "$(el) vLLM $($PY -c 'import importlib.metadata as m; print(m.version("vllm"))') from $EX"

# 3. the shim's ops
$PY -m lmtier.testing.vllm_gpu_shim.selftest 2>&1 | tee /tmp/bench_vllm_gpu_selftest.log

# 4. the benchmark
budget=${VLLM_BENCH_BUDGET_S:-470}
echo "$(el) benchmark, budget $budget s"
$PY benchmarks/bench_vllm_gpu.py --cases "${VLLM_BENCH_CASES:-none,lmtier_cpu,native_cpu}" \
  --budget-s "$budget" --wait-for "$ready" --work /tmp/bench_vllm_gpu --json /tmp/bench_vllm_gpu/results.json "$@" \
  2>&1 | tee "$OUT/bench.log" | cut -c1-400
# at most 8 files come back: the logs go in one archive
tar -czf "$OUT/logs.tar.gz" -C /tmp $(cd /tmp && ls -d bench_vllm_gpu lmtier_build.log vllm_pip.log \
  bench_vllm_gpu_selftest.log 2>/dev/null) 2>/dev/null
grep -q failed "$ready" 2>/dev/null && { echo "--- lmtier build failed:"; tail -20 /tmp/lmtier_build.log; }
cp /tmp/bench_vllm_gpu/results.json "$OUT/bench_vllm_gpu.json" 2>/dev/null
# 5. the GPU tests on the same build
if [ "${LMTIER_GPU_TESTS:-0}" = 1 ] && [ "$(cat "$ready" 2>/dev/null)" = ok ]; then
  $PY -m pytest -m gpu -q -p no:cacheprovider $(grep -l "mark.gpu" tests/test_*.py) > "$OUT/gpu_tests.log" 2>&1
  echo "$(el) gpu tests rc=$?"; tail -3 "$OUT/gpu_tests.log"
fi
echo "$(el) done"
