"""The CPU codec's thread helper (csrc/include/lmtier/parallel.h) when threads cannot be created:
the work finishes on the threads that exist, with the same bytes, instead of aborting the process
(std::terminate on a joinable std::thread). Run in a child whose address space is capped
(RLIMIT_AS) so that pthread_create fails for lack of room for thread stacks."""

from __future__ import annotations

import subprocess
import sys

import pytest

_CHILD = r"""
import resource, sys
import torch
from lmtier.codec import chunk as cchunk
shape = (4, 2, 256, 4, 64)  # (L, P, T, H, D)
g = torch.Generator().manual_seed(0)
x = (torch.randn(shape, generator=g) * 0.5).to(torch.bfloat16).contiguous().view(-1).view(torch.uint8)
ref = cchunk.encode_chunk(x, shape=shape, dtype="bfloat16", level="default", num_threads=1)
vm = int(next(l for l in open("/proc/self/status") if l.startswith("VmSize")).split()[1]) * 1024
cap = vm + (48 << 20)  # room for a few 8 MiB thread stacks, not for 15
hard = resource.getrlimit(resource.RLIMIT_AS)[1]
resource.setrlimit(resource.RLIMIT_AS, (cap, hard))
got = cchunk.encode_chunk(x, shape=shape, dtype="bfloat16", level="default", num_threads=16)
resource.setrlimit(resource.RLIMIT_AS, (hard, hard))
print("same" if got == ref else "differs")
"""


@pytest.mark.skipif(sys.platform != "linux", reason="RLIMIT_AS and /proc are Linux")
def test_thread_creation_failure_finishes_on_fewer_threads():
    p = subprocess.run([sys.executable, "-c", _CHILD], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, f"rc {p.returncode} (-6 = SIGABRT: std::terminate)\n{p.stderr[-2000:]}"
    assert p.stdout.strip().endswith("same")
