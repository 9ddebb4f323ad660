#!/usr/bin/env python3
"""NIXL READ throughput and idle CPU of two plain agents (two processes, UCX on loopback) with the
progress thread's ``pthrDelay`` given in microseconds (``lmtier.tiers.p2p.transport.new_agent``;
the wheel's ``nixl_agent`` uses 0, a busy-polling thread).

Usage (repository root)::

    .venv/bin/python benchmarks/nixl_progress_delay.py DELAY_US [--extra N] [--mib 189] [--iters 8]

Process A registers ``--mib`` MiB of random bytes; process B (this one) READs them in 32 pieces
into a registered NumPy buffer, ``--iters`` times (the first untimed), then idles 2 s. ``--extra``
starts N more idle agents in B (as a process with several agents). Prints the median and best
GB/s, CPU ms of A + B per READ, and the cores A + B use while idle. Every READ is compared with
A's bytes at the end.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import time

import numpy as np


def _agent(name: str, delay_us: int):
    from lmtier.tiers.p2p.transport import _ucx_modules_default, import_nixl, new_agent

    api = import_nixl()
    _ucx_modules_default()
    return new_agent(api, name, api.nixl_agent_config(backends=["UCX"]), delay_us)


def _serve(conn, delay_us: int, total: int) -> None:
    a = _agent("A", delay_us)
    buf = np.random.default_rng(1).integers(0, 256, total, dtype=np.uint8)
    a.register_memory([(buf.ctypes.data, total, 0, "")], "DRAM")
    conn.send((bytes(a.get_agent_metadata()), buf.ctypes.data, buf[:: 1 << 16].copy()))
    conn.recv()


def _cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        s = f.read().rsplit(")", 1)[1].split()
    return (int(s[11]) + int(s[12])) / os.sysconf("SC_CLK_TCK")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("delay_us", type=int)
    ap.add_argument("--extra", type=int, default=0, help="idle agents started in B besides the reader")
    ap.add_argument("--mib", type=int, default=189)
    ap.add_argument("--iters", type=int, default=8)
    a = ap.parse_args()
    total, n = a.mib << 20, 32
    size = total // n
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_serve, args=(child, a.delay_us, total))
    proc.start()
    md, base, sample = parent.recv()
    b = _agent("B", a.delay_us)
    extra = [_agent(f"X{i}", a.delay_us) for i in range(a.extra)]
    dst = np.zeros(total, dtype=np.uint8)
    b.register_memory([(dst.ctypes.data, total, 0, "")], "DRAM")
    peer = b.add_remote_agent(md)
    peer = peer.decode() if isinstance(peer, bytes) else peer
    local = b.get_xfer_descs([(dst.ctypes.data + i * size, size, 0) for i in range(n)], "DRAM")
    remote = b.get_xfer_descs([(base + i * size, size, 0) for i in range(n)], "DRAM")
    secs, cpu = [], []
    for _ in range(a.iters):
        c0, t0 = _cpu_s(os.getpid()) + _cpu_s(proc.pid), time.perf_counter()
        h = b.initialize_xfer("READ", local, remote, peer)
        state = b.transfer(h)
        while state == "PROC":
            state = b.check_xfer_state(h)
        h.release()
        if state != "DONE":
            raise RuntimeError(f"READ: {state}")
        secs.append(time.perf_counter() - t0)
        cpu.append(_cpu_s(os.getpid()) + _cpu_s(proc.pid) - c0)
    time.sleep(1.0)
    c0 = _cpu_s(os.getpid()) + _cpu_s(proc.pid)
    time.sleep(2.0)
    idle = (_cpu_s(os.getpid()) + _cpu_s(proc.pid) - c0) / 2
    secs, cpu = secs[1:], cpu[1:]
    if not np.array_equal(dst[:: 1 << 16], sample):
        raise RuntimeError("wrong bytes")
    print(
        f"pthrDelay {a.delay_us} us, {1 + a.extra} agent(s) in B: "
        f"READ {total / statistics.median(secs) / 1e9:.2f} GB/s "
        f"median (best {total / min(secs) / 1e9:.2f}), CPU {1e3 * statistics.median(cpu):.0f} ms per READ (A + B), "
        f"idle {idle:.2f} cores (A + B), load {os.getloadavg()[0]:.1f}",
        flush=True,
    )
    parent.send(None)
    proc.join()
    del extra
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
