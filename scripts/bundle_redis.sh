#!/usr/bin/env bash
# Bundle this machine's redis-server / redis-cli / redis-benchmark with every shared library they
# load (glibc and its loader included) into .whl/redis/, for a machine that has no redis and no
# network (the lent GPU machine: scripts/gpu_run.sh puts .whl/redis on PATH; `carry` .whl), and the
# redis-py + hiredis wheels the tier needs there.
#
#   bash scripts/bundle_redis.sh          (run here, from the repo root; ~20 MB)
#
# The wrappers start each program through the bundled dynamic loader with the bundled libraries
# only (`ld-linux-x86-64.so.2 --library-path`), so the other machine's glibc version does not
# matter. The binaries come from the Debian packages installed here (redis-server, redis-tools;
# `dpkg -S` names them in .whl/redis/SOURCES); `apt-get download redis-server redis-tools` + `dpkg -x`
# would give the same files. Check: .whl/redis/redis-server --version
set -euo pipefail
top=$(git rev-parse --show-toplevel)
cd "$top"
source scripts/lib/wheels.sh
dst=.whl/redis
rm -rf "$dst"
mkdir -p "$dst/bin" "$dst/lib"
loader=/lib64/ld-linux-x86-64.so.2
: > "$dst/SOURCES"
for prog in redis-server redis-cli redis-benchmark; do
  src=$(command -v "$prog") || { echo "bundle_redis: $prog not installed here" >&2; exit 1; }
  real=$(readlink -f "$src")
  # a real file named after the program: redis-server picks its mode from argv[0]'s name
  cp -L "$real" "$dst/bin/$prog"
  echo "$prog <- $real ($(dpkg -S "$src" 2>/dev/null | cut -d: -f1) $(dpkg-query -W -f='${Version}' "$(dpkg -S "$src" 2>/dev/null | cut -d: -f1)" 2>/dev/null))" >> "$dst/SOURCES"
  ldd "$real" | awk '/=>/ {print $3}' | while read -r lib; do
    [ -f "$dst/lib/$(basename "$lib")" ] || cp -L "$lib" "$dst/lib/"
  done
  cat > "$dst/$prog" <<EOF
#!/bin/sh
# bundled $prog: runs through the bundled loader and libraries (see scripts/bundle_redis.sh)
d=\$(cd "\$(dirname "\$0")" && pwd)
exec "\$d/lib/ld-linux-x86-64.so.2" --library-path "\$d/lib" "\$d/bin/$prog" "\$@"
EOF
  chmod +x "$dst/$prog"
done
cp -L "$loader" "$dst/lib/ld-linux-x86-64.so.2"
"$dst/redis-server" --version
du -sh "$dst"
# The Redis client the tier uses (redis-py + hiredis), as cp312 wheels for the GPU machine's Python
# (scripts/lib/wheels.sh; gpu_run.sh installs every .whl/*.whl there); versions pinned to this venv's.
py=${PYTHON:-.venv/bin/python}
ver() { "$py" -m pip show "$1" 2>/dev/null | awk '/^Version/{print $2}'; }
download_gpu_wheels .whl "redis==$(ver redis)" "hiredis==$(ver hiredis)"
ls .whl/redis-*.whl .whl/hiredis-*.whl
