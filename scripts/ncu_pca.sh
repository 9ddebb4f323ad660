#!/usr/bin/env bash
# Nsight Compute profile of the PCA level's rANS kernels (issue 19): one decode launch (dec_kernel,
# table switching) and one encode launch (enc_segments_kernel) of lmtier.bench.codec_pca at
# Llama-3.1-8B geometry, full section set, SASS-level stall samples. On the device, from the repo root:
#   bash scripts/ncu_pca.sh        (builds first unless lmtier/_C*.so exists; writes under $OUT)
# Reports: $OUT/ncu_details.txt (every section), $OUT/ncu_source.csv (per-SASS-instruction samples).
set -uo pipefail
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
if ! ls lmtier/_C*.so >/dev/null 2>&1; then
  LMTIER_CUDA=ON LMTIER_CUDA_ARCHS=90 $PY setup.py -q build_ext --inplace > "$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; exit 1; }
fi
for k in dec_kernel enc_segments_kernel; do
  timeout 240 ncu --clock-control none --set full --import-source no -k "regex:$k" --launch-skip 2 --launch-count 2 \
    -o "$OUT/ncu_$k" -f $PY -m lmtier.bench.codec_pca --device cuda --chunks 1 --iters 1 --levels pca_default \
    > "$OUT/ncu_run_$k.log" 2>&1
  echo "ncu $k rc=$?"; tail -3 "$OUT/ncu_run_$k.log"
  ncu -i "$OUT/ncu_$k.ncu-rep" --page details > "$OUT/ncu_details_$k.txt" 2>&1
  ncu -i "$OUT/ncu_$k.ncu-rep" --page source --csv --print-source sass > "$OUT/ncu_source_$k.csv" 2>&1
  ls -la "$OUT"/ncu_*"$k"*
done
