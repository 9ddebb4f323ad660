#!/usr/bin/env bash
# Bundle the Mooncake Store client and master (the cp312 wheel of mooncake-transfer-engine-non-cuda,
# the GPU machine's Python) with the Debian libraries it loads that a base image may lack, into
# .whl/mooncake.tar.xz, for a machine with no registry (the lent GPU machine: scripts/gpu_run.sh
# unpacks it, puts the package on PYTHONPATH and mooncake_master / mooncake_client on PATH; `carry` .whl).
#
#   bash scripts/bundle_mooncake.sh        (run here, from the repo root, after scripts/setup_mooncake.sh;
#                                           ~24 MB; the wheel alone is 46 MB, over half a device call)
#
# Dropped from the wheel: transfer_engine_bench (not used), and the second copy
# of libetcd_wrapper (store.so's copy becomes a link to the one mooncake_master loads). System
# libraries (libibverbs, libnuma, libcurl and theirs, not glibc or libstdc++) go to syslibs/;
# gpu_run.sh puts on LD_LIBRARY_PATH only those the other machine's loader does not find.
set -euo pipefail
top=$(git rev-parse --show-toplevel)
cd "$top"
source scripts/lib/wheels.sh
ver=${MOONCAKE_VERSION:-0.3.13.post1}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
download_gpu_wheels "$work/dl" "mooncake-transfer-engine-non-cuda==$ver"  # scripts/lib/wheels.sh
mkdir -p "$work/pkg"
python3 -m zipfile -e "$work"/dl/*.whl "$work/pkg"
cd "$work/pkg"
rm -f mooncake/transfer_engine_bench
etcd=$(basename mooncake_transfer_engine_non_cuda.libs/libetcd_wrapper-*.so)
rm -f mooncake/libetcd_wrapper.so
ln -s "../mooncake_transfer_engine_non_cuda.libs/$etcd" mooncake/libetcd_wrapper.so
chmod +x mooncake/mooncake_master mooncake/mooncake_client
mkdir -p syslibs
skip='^(libc|libm|libdl|libpthread|libresolv|librt|libgcc_s|libstdc\+\+|ld-linux-x86-64)\.so'
for bin in mooncake/store.so mooncake/engine.so mooncake/mooncake_master mooncake/mooncake_client; do
  ldd "$bin" | awk '/=> \// {print $1, $3}'
done | sort -u | while read -r name path; do
  case "$path" in "$work"/*) continue ;; esac
  [[ "$name" =~ $skip ]] && continue
  cp -L "$path" "syslibs/$name"
done
ls syslibs > syslibs/LIST
# every system library the bundle may need must be found by ldd here (the libraries installed by
# scripts/setup_mooncake.sh); a "not found" means the bundle would be incomplete
if ldd mooncake/store.so mooncake/mooncake_master | grep -q "not found"; then
  echo "bundle_mooncake: a library is missing here; run scripts/setup_mooncake.sh first" >&2
  exit 1
fi
tar -cf - . | xz -T0 -6 > "$top/.whl/mooncake.tar.xz"
cd "$top"
ls -la .whl/mooncake.tar.xz
