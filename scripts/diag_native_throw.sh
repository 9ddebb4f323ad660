#!/usr/bin/env bash
# Diagnose why a native throw from a CUDA entry kills the process on the device machine (RESULTS §4.1j):
# the failing child of tests/test_gpu_native_errors.py under faulthandler and gdb, a throw from a CPU entry,
# the loaded libstdc++ / libgcc_s. Run on the device from the repo root after a build: bash scripts/diag_native_throw.sh
export PYTHONPATH=$PWD:${PYTHONPATH:-}
PY=${PYTHON:-python3}
CHILD=$(sed -n '/^_CHILD = """/,/^"""/p' tests/test_gpu_native_errors.py | sed '1d;$d')
echo "== faulthandler"; $PY -X faulthandler -c "$CHILD" 2>&1 | tail -25; echo "rc=${PIPESTATUS[0]}"
echo "== cpu entry throw"; $PY -c "
import numpy as np
from lmtier.codec import rans
s=np.zeros(4096,np.uint8)
try:
    rans.decode([b'garbage-not-a-stream'], None)
except Exception as e: print(type(e).__name__, str(e)[:120])
" 2>&1 | tail -5
echo "== lmtier only, no torch first"; $PY -c "
import lmtier._C as C
try:
    C.rans.encode_scratch_bytes(-1, -1)
except Exception as e: print(type(e).__name__, str(e)[:120])
" 2>&1 | tail -3
echo "== maps"; $PY -c "import torch, lmtier._C, re; print('\n'.join(sorted({l.split()[-1] for l in open('/proc/self/maps') if re.search('stdc|gcc_s|pybind|python3', l)})))"
echo "== ldd"; ldd lmtier/_C*.so | grep -Ei "stdc|gcc|cuda"; $PY -c "import pybind11, sys; print(pybind11.__version__, sys.version)"; gcc --version | head -1; which gdb
if command -v gdb >/dev/null; then echo "== gdb"; timeout 120 gdb -batch -ex run -ex bt --args $PY -c "$CHILD" 2>&1 | grep -v "^\[New Thread\|^\[Thread" | tail -40; fi
