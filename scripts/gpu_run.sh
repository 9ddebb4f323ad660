#!/usr/bin/env bash
# The one GPU script: build for sm_90, run the `gpu` tests, run the GPU benchmarks, print a short
# table last. Run on the lent H200 through the device tool from the repo root:
#   bash scripts/gpu_run.sh            (writes logs and JSON under $OUT, default ./out)
# Optional: LMTIER_GPU_BENCH=quick for smaller benchmark sizes.
set -uo pipefail
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
nvidia-smi --query-gpu=name,memory.total,driver_version,pcie.link.gen.current,pcie.link.width.current --format=csv | tee "$OUT/gpu.txt"
if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
rm -f lmtier/_C*.so
t0=$(date +%s)
LMTIER_CUDA=ON LMTIER_CUDA_ARCHS=90 $PY setup.py -q build_ext --inplace > "$OUT/build.log" 2>&1 \
  || { tail -40 "$OUT/build.log"; echo "BUILD FAILED"; exit 1; }
echo "build: $(( $(date +%s) - t0 )) s"
$PY -c "import lmtier._C as C; print('built_with_cuda', C.built_with_cuda(), 'devices', C.cuda_device_count())"

$PY -m pytest -m gpu -q -p no:cacheprovider tests/test_transfer.py $(ls tests/test_gpu_*.py 2>/dev/null) \
  > "$OUT/gpu_tests.log" 2>&1
echo "gpu tests rc=$?"; tail -3 "$OUT/gpu_tests.log"

bench_args=(--interference)
[ "${LMTIER_GPU_BENCH:-full}" = quick ] && bench_args=(--batches 1,8 --cache-gb 8)
$PY -m lmtier.bench.transfer --quiet "${bench_args[@]}" --json "$OUT/transfer.json" > "$OUT/bench_transfer.log" 2>&1
echo "bench transfer rc=$?"
for extra in ${LMTIER_GPU_EXTRA:-}; do bash -c "$extra" >> "$OUT/extra.log" 2>&1; echo "extra rc=$?: $extra"; done
echo "==================== summary ===================="
grep -E "passed|failed|error" "$OUT/gpu_tests.log" | tail -2
cat "$OUT/bench_transfer.log" | grep -v "^\s*$" | tail -20
