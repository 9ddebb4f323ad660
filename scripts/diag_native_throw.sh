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
# the CUDA encode entry's own argument check throws before any CUDA call: host pointers suffice
THROW='
import numpy as np, lmtier._C as C
off = np.zeros(2, np.uint64); st = np.zeros(1, np.int32); sc = np.zeros(1 << 20, np.uint8); desc = np.zeros(64, np.uint8)
try:
    C.rans.encode(True, desc.ctypes.data, 1, 0, 0, 14, 1, 1000, off.ctypes.data, st.ctypes.data, sc.ctypes.data, sc.nbytes, 0, 0)
except Exception as e: print(type(e).__name__, str(e)[:120])
'
echo "== native throw from the .cu entry, lmtier only"; $PY -X faulthandler -c "$THROW" 2>&1 | tail -4; echo "rc=${PIPESTATUS[0]}"
echo "== the same, torch imported first"; $PY -X faulthandler -c "import torch; $THROW" 2>&1 | tail -4; echo "rc=${PIPESTATUS[0]}"
echo "== the same, after a CUDA op"; $PY -X faulthandler -c "import torch; torch.zeros(1, device='cuda'); $THROW" 2>&1 | tail -4; echo "rc=${PIPESTATUS[0]}"
echo "== a CPU entry's native throw (seg_log2 99)"; $PY -c "
import numpy as np, lmtier._C as C
off = np.zeros(2, np.uint64); st = np.zeros(1, np.int32); sc = np.zeros(1 << 20, np.uint8); desc = np.zeros(64, np.uint8)
try:
    C.rans.encode(False, desc.ctypes.data, 1, 0, 0, 99, sc.ctypes.data, 1000, off.ctypes.data, st.ctypes.data, sc.ctypes.data, sc.nbytes, 0, 0)
except Exception as e: print(type(e).__name__, str(e)[:120])
" 2>&1 | tail -3; echo "rc=${PIPESTATUS[0]}"
echo "== pybind11 internals ids"; for f in lmtier/_C*.so $($PY -c "import torch, os; print(os.path.join(os.path.dirname(torch.__file__), 'lib', 'libtorch_python.so'))"); do echo "$f: $(strings "$f" | grep -m2 -o '__pybind11_internals_v[^ ]*' | sort -u | tr '\n' ' ')"; done
echo "== maps"; $PY -c "import torch, lmtier._C, re; print('\n'.join(sorted({l.split()[-1] for l in open('/proc/self/maps') if re.search('stdc|gcc_s|pybind|python3', l)})))"
echo "== ldd"; ldd lmtier/_C*.so | grep -Ei "stdc|gcc|cuda"; $PY -c "import pybind11, sys; print(pybind11.__version__, sys.version)"; gcc --version | head -1; which gdb
DBG=$(command -v gdb || command -v cuda-gdb)  # the device machine has no gdb; cuda-gdb debugs host code too
if [ -n "$DBG" ]; then echo "== $DBG backtrace"; timeout 150 "$DBG" -batch -ex run -ex bt --args $PY -c "$CHILD" 2>&1 | grep -v "^\[New Thread\|^\[Thread\|^\[Detaching" | tail -45; fi
