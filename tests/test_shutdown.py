"""Orderly shutdown (issue 20 section 5): no lmtier thread is inside torch when the interpreter
finalizes, with or without ``close()``.

A daemon thread still inside a torch call at interpreter finalization aborts the process
("terminate called without an active exception", SIGABRT: the torch call returns, re-takes the GIL,
CPython ends the thread with pthread_exit, and the forced unwind through torch's C++ frames calls
std::terminate). ``examples/library_api.py`` with a CPU + disk config aborted so in 3 of ~40 runs on
a loaded 2-core box: the CPU pool's populate thread (nice 19, so starved under load) was still
slicing the arena when the main thread exited, and ``CPUPool.close()`` did not join it. The tests
make that thread slow on purpose (a fake ``lmtier.memory.populate`` doing GIL-releasing torch work),
so the old code fails deterministically, not only under load.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
MiB = 1 << 20


def _populate_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "lmtier-populate" and t.is_alive()]


def test_cpu_pool_close_joins_its_populate_thread(monkeypatch):
    import lmtier.memory
    from lmtier.tiers.cpu import CPUPool

    calls = []

    def slow_populate(tensor, **kw):  # a populate round that takes a while (8 pieces x 0.2 s)
        calls.append(tensor.numel())
        time.sleep(0.2)
        return True

    monkeypatch.setattr(lmtier.memory, "populate", slow_populate)
    before = set(_populate_threads())
    pool = CPUPool(64 * MiB, 1 * MiB)
    deadline = time.monotonic() + 30
    while not calls and time.monotonic() < deadline:
        time.sleep(0.01)
    assert calls, "populate thread never started"
    pool.close()
    assert set(_populate_threads()) <= before  # joined by close(); main: still running
    assert len(calls) < 8  # stopped between pieces, not after the whole round


_SCRIPT = textwrap.dedent(
    """
    import sys, time
    import torch
    import lmtier.memory
    from lmtier.config import LMTierConfig
    from lmtier.keys import Namespace, chunk_keys
    from lmtier.manager import TierManager

    mode, disk = sys.argv[1], sys.argv[2]

    def torch_populate(tensor, **kw):  # a slow populate piece inside torch (releases the GIL)
        a = torch.ones(512, 512)
        t0 = time.monotonic()
        while time.monotonic() - t0 < 0.5:
            a.mm(a)
            tensor[:4096].numel()
        return True

    if mode != "real":
        lmtier.memory.populate = torch_populate
    cfg = LMTierConfig.from_dict(
        {"chunk_size": 16, "max_local_cpu_size": 0.0625, "local_disk": "file://" + disk, "max_local_disk_size": 0.25}
    )
    ns = Namespace(model="t", num_layers=2, num_kv_heads=2, head_size=32, kv_dtype="float32", chunk_size=16)
    m = TierManager.from_config(cfg, ns)
    keys = chunk_keys(list(range(64)), ns)
    for i, k in enumerate(keys):
        m.store(k, torch.full((ns.chunk_bytes,), i, dtype=torch.uint8), timeout_s=None)
    m.flush()
    out = torch.empty(ns.chunk_bytes, dtype=torch.uint8)
    assert m.retrieve_into(keys[0], out) == ns.chunk_bytes
    time.sleep(0.2)
    if mode.endswith("close") or mode == "real":
        m.close()
    print("done", flush=True)
    """
)


def _run(tmp_path: Path, mode: str, i: int) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return subprocess.run(
        [sys.executable, "-c", _SCRIPT, mode, str(tmp_path / f"disk{i}")],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=str(tmp_path),
    )


@pytest.mark.parametrize("mode", ["slow_no_close", "slow_close", "real"])
def test_cpu_disk_process_exits_cleanly(tmp_path, mode):
    """A CPU + disk TierManager process, 3 runs each: exit code 0 and no "terminate called", with
    the populate thread busy inside torch at exit (``slow_*``: with and without ``close()``) and
    with the real populate (``real``). On main the ``slow_*`` runs abort (SIGABRT, rc -6)."""
    for i in range(3):
        r = _run(tmp_path, mode, i)
        assert "terminate called" not in r.stderr, r.stderr[-2000:]
        assert r.returncode == 0 and "done" in r.stdout, (r.returncode, r.stderr[-2000:])
