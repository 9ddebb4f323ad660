#!/usr/bin/env bash
# The one GPU script: build for sm_90, run the `gpu` tests, run the GPU benchmarks, print a short
# table last. Run on the lent H200 through the device tool from the repo root:
#   bash scripts/gpu_run.sh            (writes logs and JSON under $OUT, default ./out)
# LMTIER_GPU_STEPS selects steps (default: "tests transfer layerwise ttft rans codec"; also "ttftremote": the
# Redis and Mooncake Store tiers (+ codec) at 7,500 tokens; "ttftpca": disk, Redis (and Mooncake) with the codec
# at default and pca_default at 7,500 tokens, the random model's KV as built and then with --kv-spectrum trained
# (its KV's spectrum decaying as a trained model's), each up to 560 s (LMTIER_TTFTPCA_TIMEOUT), with the bench's own PCA fit;
# "mooncake": lmtier bench mooncake; "ttftsweep": the
# disk+codec / redis+codec TTFT at 7,500 tokens for 2, 4 and 8 reads in flight; "ttfthost": the codec tiers
# decoded on the host, the vLLM connector's path today; "ttftspy": py-spy's GIL samples of the trained-spectrum
# bench's pca_default loads (disk and Redis); "decspy": the same for 4 threads decoding PCA records
# (benchmarks/pca_decode_threads.py); "decprof": its --profile, the GPU's busy share with 1 and 4 threads; "quickpca": the PCA levels' GPU tests (tests/test_gpu_codec_pca_native.py,
# tests/test_gpu_codec_pca_queued.py, tests/test_gpu_codec_pca.py) and tests/test_gpu_cuda_streams.py and its rate with 1 and 4 threads, for a short device budget; "decbreak": its --breakdown, each decode step's time a record with 1, 2 and 4 threads (and 4
# with a 0.5 ms GIL switch interval); "getbreak": the same for the product's batched read (--op get, 1 and 4
# threads or LMTIER_GETBREAK_THREADS, with --profile) and py-spy's GIL samples of it (4 threads); "putbreak": the same
# for the product's write path (--op put, 1 and 2 threads or LMTIER_PUTBREAK_THREADS; py-spy --gil of 2, --idle of 1); "hostab": an A/B of the host's
# PCA encode or decode (LMTIER_HOSTAB_OPS, default "encode:1 encode:2": op:threads; LMTIER_HOSTAB_ARGS: more arguments of every run,
# e.g. "--get-batch 1 --get-stream") between this tree and the
# package in .whl/ab_old (copied there on the dev box, e.g. `git archive <commit> lmtier | tar -x -C .whl/ab_old`),
# with this build, or with its own when it holds csrc/ too (`git archive <commit> lmtier csrc setup.py
# CMakeLists.txt pyproject.toml`); "ttftbatch1": the Mooncake tiers at 7,500 tokens with
# --fetch-batch 1, one chunk per I/O task, beside ttftremote's default; "seal": the Redis+codec tier at 7,500 tokens
# with unsealed, MACed and encrypted records in one run, and lmtier bench seal); LMTIER_GPU_BENCH=quick
# shrinks the transfer benchmark. Redis: the machine has none; `bash scripts/bundle_redis.sh` here packs
# redis-server with its libraries into .whl/redis (carry .whl), which this script puts on PATH, so the
# ttft bench measures the Redis tiers on loopback too; `bash scripts/bundle_mooncake.sh` packs the
# Mooncake client and master into .whl/mooncake.tar.xz, unpacked here the same way; "p2p": P2P over NIXL,
# two processes pool to pool over UCX (lmtier bench p2p, Llama-3.1-8B, 8 and 32 chunks, beside a raw NIXL
# READ and a host memcpy of the same bytes, same run), with `bash scripts/bundle_nixl.sh`'s trimmed NIXL
# (.whl/nixl.tar.xz, ~9 MB) unpacked and checked first (scripts/check_nixl_bundle.py); "ebcodec": the
# error-bounded codec levels (issue 19) on the GPU: tests/test_gpu_codec_bound.py (CUDA vs CPU records and
# decodes, byte/bit identity; SmolLM2's real KV from .whl/eb_kv, written by `python -m tests.eb_kv --write
# .whl/eb_kv/smollm2_gpl3.lmkc` on the dev box: carry .whl/eb_kv) and lmtier.bench.codec_product (the
# product encode/decode path per level, 8 and 32 Llama-3.1-8B chunks, beside `default` and a device memcpy);
# "pcacodec": the PCA levels on CUDA: tests/test_gpu_codec_pca.py (records and decodes equal the host's) and
# tests/test_gpu_codec_pca_queued.py (queued decodes, coder calls side by side, the tier's batched reads),
# tests/test_gpu_codec_pca_native.py (one record's decode queued by one native call), tests/test_gpu_rans_run_luts.py (the coder's decode lookups) and
# lmtier.bench.codec_pca (product encode/decode, Llama-3.1-8B geometry, beside a memcpy and the int8 GEMMs).
set -uo pipefail
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
STEPS=${LMTIER_GPU_STEPS:-tests transfer layerwise ttft rans codec}
has() { [[ " $STEPS " == *" $1 "* ]]; }
nvidia-smi --query-gpu=name,memory.total,driver_version,pcie.link.gen.current,pcie.link.width.current --format=csv | tee "$OUT/gpu.txt"
if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
  $PY -m pip install -q --upgrade --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl 2>/dev/null \
    && export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
export PYTHONPATH=$PWD:${PYTHONPATH:-}
if [ -x .whl/redis/redis-server ]; then
  export PATH=$PWD/.whl/redis:$PATH
  echo "redis: bundled $(redis-server --version | cut -d' ' -f1-3)"
elif ! command -v redis-server >/dev/null; then
  echo "redis: none (run scripts/bundle_redis.sh on the dev box and carry .whl): Redis tiers skipped"
fi
if [ -f .whl/mooncake.tar.xz ]; then  # scripts/bundle_mooncake.sh: the Mooncake client and master
  mc=/tmp/mooncake; rm -rf "$mc"; mkdir -p "$mc/missing"
  tar -xJf .whl/mooncake.tar.xz -C "$mc"
  for lib in $(cat "$mc/syslibs/LIST"); do  # only what this machine's loader lacks
    ldconfig -p | grep -q " $lib " || ln -s "$mc/syslibs/$lib" "$mc/missing/$lib"
  done
  export PYTHONPATH=$mc:${PYTHONPATH:-} LD_LIBRARY_PATH=$mc/missing:${LD_LIBRARY_PATH:-} PATH=$mc/mooncake:$PATH
  echo "mooncake: bundled ($(ls "$mc/missing" | wc -l) system libraries added)"
  $PY -c "from mooncake.store import MooncakeDistributedStore" 2>&1 | tail -1
else
  echo "mooncake: none (run scripts/bundle_mooncake.sh on the dev box and carry .whl): Mooncake tiers skipped"
fi
if [ -f .whl/nixl.tar.xz ]; then  # scripts/bundle_nixl.sh: NIXL with its UCX backend only
  nx=/tmp/nixl; rm -rf "$nx"; mkdir -p "$nx"
  tar -xJf .whl/nixl.tar.xz -C "$nx"
  export PYTHONPATH=$nx:${PYTHONPATH:-}
  $PY scripts/check_nixl_bundle.py "$nx" > "$OUT/nixl_check.log" 2>&1
  echo "nixl: bundled, loopback check rc=$?"; grep -E "READ|WRITE|loaded" "$OUT/nixl_check.log"
elif has p2p; then
  echo "nixl: none (run scripts/bundle_nixl.sh on the dev box and carry .whl): P2P step skipped"
fi
rm -f lmtier/_C*.so
t0=$(date +%s)
LMTIER_CUDA=ON LMTIER_CUDA_ARCHS=90 $PY setup.py -q build_ext --inplace > "$OUT/build.log" 2>&1 \
  || { tail -40 "$OUT/build.log"; echo "BUILD FAILED"; exit 1; }
echo "build: $(( $(date +%s) - t0 )) s"
$PY -c "import lmtier._C as C; print('built_with_cuda', C.built_with_cuda(), 'devices', C.cuda_device_count())"

if has tests; then
  $PY -m pytest -m gpu -q -p no:cacheprovider $(grep -l "mark.gpu" tests/test_*.py) \
    > "$OUT/gpu_tests.log" 2>&1
  echo "gpu tests rc=$?"; tail -3 "$OUT/gpu_tests.log"
fi
if has transfer; then
  bench_args=(--interference)
  [ "${LMTIER_GPU_BENCH:-full}" = quick ] && bench_args=(--batches 1,8 --cache-gb 8)
  $PY -m lmtier.bench.transfer --quiet "${bench_args[@]}" --json "$OUT/transfer.json" > "$OUT/bench_transfer.log" 2>&1
  echo "bench transfer rc=$?"
fi
if has layerwise; then
  timeout 300 $PY benchmarks/bench_layerwise.py --json "$OUT/layerwise.json" > "$OUT/bench_layerwise.log" 2>&1
  echo "bench layerwise rc=$?"
fi
if has ttft; then
  timeout 520 $PY -m lmtier.bench.ttft --device cuda --compare-layouts --json "$OUT/ttft.json" --plot "$OUT/ttft.png" > "$OUT/bench_ttft.log" 2>&1
  echo "bench ttft rc=$?"
fi
if has ttftsweep; then
  for inf in 2 4 8; do
    timeout 170 $PY -m lmtier.bench.ttft --device cuda --lengths 7500 --codec-levels default --inflight $inf \
      --ring $((inf + 2)) --disk-threads $((inf > 4 ? inf : 4)) --quiet --json "$OUT/ttft_inflight$inf.json" \
      > "$OUT/bench_ttft_inflight$inf.log" 2>&1
    echo "bench ttft --inflight $inf rc=$?"
  done
fi
if has ttftremote; then
  # the shared tiers at the user's prompt length: Redis and Mooncake Store (loopback), each with the codec
  timeout 400 $PY -m lmtier.bench.ttft --device cuda --lengths 7500 --codec-levels default \
    --json "$OUT/ttft_remote.json" > "$OUT/bench_ttft_remote.log" 2>&1
  echo "bench ttft (remote tiers at 7,500) rc=$?"
fi
if has ttftpca; then
  # issue 19: the PCA level beside default and recompute at 7,500 tokens, disk and Redis (+ Mooncake when bundled).
  # The PCA model file is fitted by the bench first, untimed, on the KV of other random token ids than the measured
  # prompt's (Llama-3.1-8B: G = 1, N = 1,024, 16 x N = 16,384 tokens; lmtier.bench.ttft.pca_model).
  # Then the same with --kv-spectrum trained: the random model's k_proj / v_proj reshaped so its KV's
  # eigen-spectrum decays as SmolLM2's (a random model's KV is near isotropic: no structure for a basis).
  # LMTIER_TTFTPCA_SPECTRA: which of the two runs ("model trained", the default; "trained" alone saves a run)
  for spectrum in ${LMTIER_TTFTPCA_SPECTRA:-model trained}; do
    tag=$([ "$spectrum" = model ] && echo ttft_pca || echo "ttft_pca_$spectrum")
    timeout "${LMTIER_TTFTPCA_TIMEOUT:-560}" $PY -m lmtier.bench.ttft --device cuda --lengths 7500 \
      --codec-levels default,pca_default --kv-spectrum "$spectrum" --json "$OUT/$tag.json" > "$OUT/bench_$tag.log" 2>&1
    echo "bench ttft (codec default and pca_default at 7,500, --kv-spectrum $spectrum) rc=$?"
  done
fi
if has ttftspy; then
  # where the host's time goes in the PCA level's loads: py-spy (carry its wheel in .whl) samples the threads
  # holding the GIL while the trained-spectrum bench loads disk+pca_default and redis+pca_default (raw stacks;
  # tally with scripts/spy_tally.py; 100 Hz: at 250 py-spy fell 1-2 s behind and the Redis reads timed out, RESULTS §4.1v)
  spy=$(command -v py-spy || echo /tmp/site/bin/py-spy)
  if [ -x "$spy" ]; then
    timeout "${LMTIER_TTFTPCA_TIMEOUT:-560}" "$spy" record --gil --threads -r 100 -f raw -o "$OUT/spy_gil.txt" -- \
      $PY -m lmtier.bench.ttft --device cuda --lengths 7500 --codec-levels pca_default --kv-spectrum trained \
      --no-mooncake --iters 3 --warmup 1 --codec-pca-fit-tokens 4096 --json "$OUT/ttft_spy.json" \
      > "$OUT/bench_ttft_spy.log" 2>&1
    echo "bench ttft under py-spy --gil rc=$?"
  else
    echo "ttftspy: no py-spy (carry its wheel in .whl)"
  fi
fi
if has decspy; then
  # which Python code holds the GIL while 4 threads decode PCA records as a tier's I/O threads do
  # (py-spy: carry its wheel in .whl; tally with scripts/spy_tally.py --within decode_one)
  spy=$(command -v py-spy || echo /tmp/site/bin/py-spy)
  if [ -x "$spy" ]; then
    $PY benchmarks/pca_decode_threads.py --seconds 8 > "$OUT/decspy_plain.log" 2>&1  # the rate without py-spy
    timeout 200 "$spy" record --gil --threads -r 100 -f raw -o "$OUT/spy_decode.txt" -- \
      $PY benchmarks/pca_decode_threads.py --seconds 20 > "$OUT/decspy.log" 2>&1
    echo "decspy rc=$?"; tail -1 "$OUT/decspy_plain.log"; tail -1 "$OUT/decspy.log"
  else
    echo "decspy: no py-spy (carry its wheel in .whl)"
  fi
fi
if has decprof; then
  # is the threads' decode rate bound by the device or the host? (torch.profiler's CUDA events)
  for th in 1 4; do
    timeout 150 $PY benchmarks/pca_decode_threads.py --threads $th --seconds 6 --profile 4 > "$OUT/decprof_$th.log" 2>&1
    echo "decprof threads=$th rc=$?"; grep -v "^\s*$" "$OUT/decprof_$th.log" | tail -15
  done
fi
if has quickpca; then
  timeout 300 $PY -m pytest -m gpu -q -p no:cacheprovider tests/test_gpu_codec_pca_native.py \
    tests/test_gpu_codec_pca_queued.py tests/test_gpu_codec_pca.py tests/test_gpu_cuda_streams.py \
    > "$OUT/quickpca_tests.log" 2>&1
  echo "quickpca tests rc=$?"; tail -4 "$OUT/quickpca_tests.log"
  for th in 1 4; do
    timeout 40 $PY benchmarks/pca_decode_threads.py --threads $th --seconds 4 2>&1 | tail -1
  done
fi
if has decbreak; then
  for args in "--threads 1" "--threads 2" "--threads 4" "--threads 4 --switch-ms 0.5"; do
    timeout 120 $PY benchmarks/pca_decode_threads.py $args --seconds 5 --breakdown 8 > "$OUT/decbreak.tmp" 2>&1
    echo "decbreak $args rc=$?" | tee -a "$OUT/decbreak.log"; grep -v "^\s*$" "$OUT/decbreak.tmp" | grep -v -i warn | tail -9 | tee -a "$OUT/decbreak.log"
  done
fi
# benchmarks/pca_decode_threads.py --op $1: its steps' time a record and the GPU's busy share at each thread count
# of $2 (--breakdown, --profile), then py-spy of it for each "mode:threads" of $3 (gil: the GIL-held samples;
# idle: every sample, waits and native frames included), tallied over the stacks through a frame matching $4
op_break() {
  local op=$1 th how mode flags spy
  for th in $2; do
    timeout 150 $PY benchmarks/pca_decode_threads.py --op $op --threads $th --seconds 5 --breakdown 6 --profile 4 \
      > "$OUT/${op}break_$th.log" 2>&1
    echo "${op}break threads=$th rc=$?"; grep -v "^\s*$" "$OUT/${op}break_$th.log" | grep -v -i warn | tail -40
  done
  spy=$(command -v py-spy || echo /tmp/site/bin/py-spy)
  [ -x "$spy" ] || return 0
  for how in $3; do
    mode=${how%%:*}; th=${how##*:}
    case $mode in gil) flags=--gil ;; idle) flags="--idle --native" ;; *) echo "${op}spy: mode $mode?"; continue ;; esac
    timeout 120 "$spy" record $flags --threads -r 100 -f raw -o "/tmp/spy_${op}_$mode$th.txt" -- \
      $PY benchmarks/pca_decode_threads.py --op $op --threads $th --seconds 8 > "$OUT/${op}spy_$mode$th.log" 2>&1
    echo "${op}spy $how rc=$?"; tail -1 "$OUT/${op}spy_$mode$th.log"
    $PY scripts/spy_tally.py "/tmp/spy_${op}_$mode$th.txt" --within "$4" --top 40 2>&1 \
      | tee "$OUT/${op}spy_$mode${th}_tally.txt" | tail -90
  done
}
if has getbreak; then  # the product's batched read (PCACodecTier.get_many_into)
  op_break get "${LMTIER_GETBREAK_THREADS:-1 4}" gil:4 'get_many_into|get_into'
fi
if has putbreak; then  # the product's write path (PCACodecTier.put, encode_device on the GPU)
  op_break put "${LMTIER_PUTBREAK_THREADS:-1 2}" "gil:2 idle:1" 'PCACodecTier\.put '
fi
if has hostab; then
  if [ -d .whl/ab_old/lmtier ]; then
    if [ -d .whl/ab_old/csrc ]; then  # the old tree's own build (its bindings may differ)
      (cd .whl/ab_old && LMTIER_CUDA=ON LMTIER_CUDA_ARCHS=90 $PY setup.py -q build_ext --inplace > "$OUT/build_old.log" 2>&1) \
        || { tail -20 "$OUT/build_old.log"; echo "hostab: old build failed"; }
    else
      cp lmtier/_C*.so .whl/ab_old/lmtier/
    fi
    for round in 1 2; do
      for side in old new; do
        for op in ${LMTIER_HOSTAB_OPS:-encode:1 encode:2}; do
          pp=$PYTHONPATH; [ $side = old ] && pp=$PWD/.whl/ab_old:$PYTHONPATH
          line=$(PYTHONPATH=$pp timeout 100 $PY benchmarks/pca_decode_threads.py --op ${op%%:*} --threads ${op##*:} --seconds 4 \
            ${LMTIER_HOSTAB_ARGS:-} 2>&1 | tail -1)
          echo "hostab round $round $side $op: $line" | tee -a "$OUT/hostab.log"
        done
      done
    done
  else
    echo "hostab: no .whl/ab_old/lmtier"
  fi
fi
if has ttftbatch1; then
  timeout 170 $PY -m lmtier.bench.ttft --device cuda --lengths 7500 --codec-levels default --no-disk --no-redis \
    --fetch-batch 1 --json "$OUT/ttft_batch1.json" > "$OUT/bench_ttft_batch1.log" 2>&1
  echo "bench ttft --fetch-batch 1 rc=$?"
fi
if has mooncake; then
  timeout 300 $PY -m lmtier.cli bench mooncake --pipeline-depths 1,2 --modes direct,bounce --json "$OUT/mooncake.json" \
    > "$OUT/bench_mooncake.log" 2>&1
  echo "bench mooncake rc=$?"
fi
if has p2p && [ -f .whl/nixl.tar.xz ]; then
  timeout 400 $PY -m lmtier.cli bench p2p --presets llama-3.1-8b --counts 8,32 --iters 5 --modes direct,bounce \
    --json "$OUT/p2p.json" > "$OUT/bench_p2p.log" 2>&1
  echo "bench p2p rc=$?"
fi
if has seal; then
  # issue 18: TTFT added by sealed records (MAC, encryption) on the Redis+codec tier, same-run recompute
  for seal in none mac encrypt; do
    timeout 150 $PY -m lmtier.bench.ttft --device cuda --lengths 7500 --codec-levels default --no-disk --no-mooncake \
      --remote-seal $seal --quiet --json "$OUT/ttft_seal_$seal.json" > "$OUT/bench_ttft_seal_$seal.log" 2>&1
    echo "bench ttft --remote-seal $seal rc=$?"
  done
  timeout 200 $PY -m lmtier.cli bench seal --json "$OUT/seal.json" > "$OUT/bench_seal.log" 2>&1
  echo "bench seal rc=$?"
fi
if has ttfthost; then
  # the codec tiers as the vLLM connector runs them today: records decoded on the host (CPU), then copied
  timeout 300 $PY -m lmtier.bench.ttft --device cuda --lengths 1024,4096,7500 --codec-levels default --codec-decode host \
    --quiet --json "$OUT/ttft_hostdecode.json" > "$OUT/bench_ttft_hostdecode.log" 2>&1
  echo "bench ttft --codec-decode host rc=$?"
fi
if has rans; then
  timeout 200 $PY -m lmtier.bench.rans --json "$OUT/rans.json" > "$OUT/bench_rans.log" 2>&1
  echo "bench rans rc=$?"
fi
if has codec; then
  timeout 240 $PY -m lmtier.bench.codec_kernels --chunks 8 32 --json "$OUT/codec.json" > "$OUT/bench_codec.log" 2>&1
  echo "bench codec rc=$?"
fi
if has ebcodec; then
  [ -f .whl/eb_kv/smollm2_gpl3.lmkc ] || echo "ebcodec: no .whl/eb_kv/smollm2_gpl3.lmkc: the real-KV cases skip"
  timeout 150 $PY -m pytest -m gpu -q -rA -p no:cacheprovider tests/test_gpu_codec_bound.py > "$OUT/ebcodec_tests.log" 2>&1
  echo "ebcodec tests rc=$?"; tail -3 "$OUT/ebcodec_tests.log"
  timeout 150 $PY -m lmtier.bench.codec_product --device cuda --levels default eb_default eb_high eb_low --chunks 8 32 \
    --json "$OUT/codec_product.json" > "$OUT/bench_codec_product.log" 2>&1
  echo "bench codec_product rc=$?"
fi
if has pcacodec; then  # the PCA levels (issue 19) on CUDA: byte/bit identity with the host, product throughput
  timeout 420 $PY -m pytest -m gpu -q -rA -p no:cacheprovider tests/test_gpu_native_errors.py tests/test_gpu_codec_pca.py tests/test_gpu_codec_pca_queued.py tests/test_gpu_codec_pca_native.py tests/test_gpu_rans_run_luts.py > "$OUT/pcacodec_tests.log" 2>&1
  echo "pcacodec tests rc=$?"; tail -3 "$OUT/pcacodec_tests.log"
  if [ "${LMTIER_PCACODEC_BENCH:-1}" = 1 ]; then  # LMTIER_PCACODEC_BENCH=0: the tests alone
    timeout 200 $PY -m lmtier.bench.codec_pca --device cuda --chunks 8 --json "$OUT/codec_pca.json" \
      --profile "$OUT/codec_pca_profile.txt" > "$OUT/bench_codec_pca.log" 2>&1
    echo "bench codec_pca rc=$? (default G)"
  fi
  if [ "${LMTIER_PCACODEC_BENCH:-1}${LMTIER_PCACODEC_G4:-1}" = 11 ]; then  # LMTIER_PCACODEC_G4=0 skips the G = 4 run
    timeout 200 $PY -m lmtier.bench.codec_pca --device cuda --chunks 8 --geometry 32,8,128,4 \
      --json "$OUT/codec_pca_g4.json" >> "$OUT/bench_codec_pca.log" 2>&1
    echo "bench codec_pca rc=$? (G = 4)"
  fi
fi
echo "==================== summary ===================="
[ -f "$OUT/gpu_tests.log" ] && grep -E "passed|failed|error" "$OUT/gpu_tests.log" | tail -2
for f in bench_transfer bench_layerwise bench_ttft bench_ttft_remote bench_ttft_pca bench_ttft_pca_trained bench_ttft_batch1 bench_mooncake bench_p2p bench_seal bench_rans bench_codec bench_codec_product bench_codec_pca; do
  [ -f "$OUT/$f.log" ] && { echo "--- $f"; grep -v "^\s*$" "$OUT/$f.log" | tail -22; }
done
# the short table, last: TTFT per tier at each N (% of recompute) with the same-run ceilings
for f in "$OUT"/ttft.json "$OUT"/ttft_remote.json "$OUT"/ttft_pca.json "$OUT"/ttft_batch1.json "$OUT"/ttft_seal_*.json "$OUT"/ttft_inflight*.json "$OUT"/ttft_hostdecode.json; do
  [ -f "$f" ] && $PY scripts/ttft_table.py "$f"
done
# LMTIER_GPU_PACK=1: leave $OUT as one out.tgz (the device tool returns only so many files from $OUT)
if [ "${LMTIER_GPU_PACK:-0}" = 1 ]; then
  tar -czf /tmp/lmtier_gpu_out.tgz -C "$OUT" . && find "$OUT" -mindepth 1 -delete && mv /tmp/lmtier_gpu_out.tgz "$OUT/out.tgz"
  echo "packed: $OUT/out.tgz"
fi
