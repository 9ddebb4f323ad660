"""A CUDA entry of the compiled core that refuses its arguments raises ``ValueError`` in Python, and
the process lives on. The first GPU run of the PCA codec's stream helper died with a segmentation
fault inside ``lmtier._C.rans.encode`` when the CUDA coder refused a misaligned output (a native
``InvalidArgument`` thrown on the device machine); on the CPU box the same throw becomes a
``ValueError``. Run in a child process, so a crash fails this test instead of the whole GPU run.
Marked ``gpu``: skipped without a CUDA device."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu

_CHILD = """
import torch
from lmtier.codec import rans
s = torch.randint(0, 4, (4096,), dtype=torch.uint8, device="cuda")
out = torch.empty(20000, dtype=torch.uint8, device="cuda")
off = torch.empty(2, dtype=torch.int64, device="cuda")
st = torch.empty(1, dtype=torch.int32, device="cuda")
sc = torch.empty(rans.encode_scratch_bytes(1, 4096), dtype=torch.uint8, device="cuda")
try:
    rans.encode_into([s], rans.ADAPTIVE_TABLE, None, out=out[1:], offsets=off, status=st, scratch=sc)
except ValueError as e:
    print("ValueError:", e)
"""


def test_native_refusal_on_a_cuda_entry_is_a_value_error():
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
    r = subprocess.run([sys.executable, "-c", _CHILD], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, f"child died (rc {r.returncode}): {r.stderr[-2000:]}"
    assert "ValueError:" in r.stdout and "4-byte aligned" in r.stdout, r.stdout + r.stderr[-2000:]
