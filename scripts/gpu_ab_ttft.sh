#!/usr/bin/env bash
# Same-call A/B of the TTFT benchmark: this tree ("new") against an archived commit ("old"), each built for
# sm_90, run alternately new, old, new, old against ONE redis-server started here (so the server and its
# flags are the same for both and only the tier code differs). On the dev box, first:
#   git archive <commit> | xz > .whl/ab_old.tar.xz        (carry .whl/ab_old.tar.xz and .whl/redis)
# On the device, from the repo root:
#   bash scripts/gpu_ab_ttft.sh [more lmtier.bench.ttft options]
# Default options: --device cuda --lengths 7500 --codec-levels default --no-disk --quiet --redis-url <the server>
# (the new tree also gets --no-mooncake). LMTIER_AB_ROUNDS (default 2) pairs. Logs and JSON under $OUT.
# Exits 1 when the server does not come up within ~10 s or a FLUSHALL between runs is not answered +OK.
set -uo pipefail
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
NEW=$PWD
OLD=/tmp/ab_old
[ -f .whl/ab_old.tar.xz ] || { echo "no .whl/ab_old.tar.xz (git archive <commit> | xz > .whl/ab_old.tar.xz)"; exit 2; }
[ -x .whl/redis/redis-server ] || { echo "no .whl/redis/redis-server (scripts/bundle_redis.sh)"; exit 2; }
if ls .whl/*.whl >/dev/null 2>&1; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl >/dev/null 2>&1 \
    && export PYTHONPATH=/tmp/site
fi
rm -rf "$OLD" && mkdir -p "$OLD" && tar -xJf .whl/ab_old.tar.xz -C "$OLD"
build() {  # $1: tree; both builds at once, half the cores each
  (cd "$1" && rm -f lmtier/_C*.so && LMTIER_CUDA=${LMTIER_CUDA:-ON} LMTIER_CUDA_ARCHS=90 LMTIER_BUILD_JOBS=$(( $(nproc) / 2 )) \
    $PY setup.py -q build_ext --inplace > "$OUT/build_$2.log" 2>&1) || { tail -20 "$OUT/build_$2.log"; return 1; }
}
build "$NEW" new & p1=$!
build "$OLD" old & p2=$!
wait $p1 && wait $p2 || { echo "BUILD FAILED"; exit 1; }
port=$(( 20000 + RANDOM % 20000 ))
.whl/redis/redis-server --port $port --bind 127.0.0.1 --save "" --appendonly no --protected-mode no \
  --loglevel warning --maxmemory 8gb --dir /tmp > "$OUT/redis-server.log" 2>&1 &
rpid=$!
trap 'kill $rpid 2>/dev/null' EXIT
flushall() {  # empty the server; fails (nonzero) unless it answers +OK
  local ok=""
  { exec 3<>"/dev/tcp/127.0.0.1/$port"; } 2>/dev/null || return 1
  printf '*1\r\n$8\r\nFLUSHALL\r\n' >&3 && read -r -t 5 ok <&3
  exec 3>&-
  [[ $ok == +OK* ]]
}
for _ in $(seq 50); do flushall && break; sleep 0.2; done
flushall || { echo "redis-server on port $port did not answer (see $OUT/redis-server.log)"; exit 1; }
url=redis://127.0.0.1:$port/0
for r in $(seq "${LMTIER_AB_ROUNDS:-2}"); do
  for v in new old; do
    # an empty server for every run (the two versions' records must not meet)
    flushall || { echo "FLUSHALL failed before $v $r: stopping (the runs would share records)"; exit 1; }
    tree=$NEW; extra=(--no-mooncake)
    [ $v = old ] && { tree=$OLD; extra=(); }
    (cd "$tree" && PYTHONPATH=$tree${PYTHONPATH:+:$PYTHONPATH} timeout 200 $PY -m lmtier.bench.ttft --device cuda \
      --lengths 7500 --codec-levels default --no-disk --quiet --redis-url "$url" "${extra[@]}" "$@" \
      --json "$OUT/ab_${v}_$r.json" > "$OUT/ab_${v}_$r.log" 2>&1)
    echo "$v $r rc=$?: $(grep -A1 -E '^N +recompute_ms' "$OUT/ab_${v}_$r.log" | tail -1 | tr -s ' ' | cut -c1-200)"
  done
done
