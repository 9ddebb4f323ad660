"""Timing plumbing and the same-run ceilings of ``lmtier bench ttft``.

Ceilings, measured in the run they bound: pinned host -> device copy bandwidth (:func:`h2d_gbps`),
``dd`` O_DIRECT and parallel O_DIRECT reads of the disk directory (:func:`dd_read_gbps`), and
raw-socket ``GETRANGE`` reads from the Redis server (:func:`redis_raw_gbps`).
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
import urllib.parse
from concurrent.futures import ThreadPoolExecutor

import torch

from lmtier.bench.common import odirect_read_gbps

__all__ = [
    "Dev",
    "timed",
    "median",
    "drop_caches",
    "fs_type",
    "default_disk_dir",
    "odirect_supported",
    "dd_read_gbps",
    "h2d_gbps",
    "redis_raw_gbps",
]


class Dev:
    """Stream/event plumbing that degrades to synchronous no-ops on the CPU."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self.copy_stream = torch.cuda.Stream(device) if self.cuda else None

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)


def median(xs):
    return statistics.median(xs) if xs else None


def timed(dev: Dev, fn, iters: int, warmup: int, before=None):
    """``(median ms, all ms, last result)`` of ``fn`` by wall time, the device synced before and
    after each run; ``before()`` runs untimed ahead of each run."""
    out = None
    times = []
    for i in range(warmup + iters):
        if before is not None:
            before()
        dev.sync()
        t0 = time.perf_counter()
        out = fn()
        dev.sync()
        if i >= warmup:
            times.append((time.perf_counter() - t0) * 1e3)
    return median(times), times, out


def drop_caches() -> str | None:
    """Drop the page cache; returns None on success, else why not."""
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return None
    except OSError as e:
        return f"{type(e).__name__}: {e.strerror or e}"


def fs_type(path: str) -> str:
    """The file system type (``/proc/mounts``) of the mount holding ``path``; ``"?"`` if unknown."""
    path = os.path.realpath(path)
    best, typ = "", "?"
    try:
        with open("/proc/mounts") as f:
            for line in f:
                parts = line.split()
                if (
                    len(parts) >= 3
                    and (path == parts[1] or path.startswith(parts[1].rstrip("/") + "/"))
                    and len(parts[1]) >= len(best)
                ):
                    best, typ = parts[1], parts[2]
    except OSError:
        pass
    return typ


def default_disk_dir() -> str:
    """A temp dir on a real disk filesystem (not tmpfs/overlay, where O_DIRECT is missing or
    the page cache is the medium): $TMPDIR, /var/tmp, /tmp, the cwd, $HOME — the first that fits."""
    cands = [os.environ.get("TMPDIR"), "/var/tmp", "/tmp", os.getcwd(), os.path.expanduser("~")]
    for base in cands:
        if (
            base
            and os.path.isdir(base)
            and os.access(base, os.W_OK)
            and fs_type(base) not in ("tmpfs", "ramfs", "overlay", "devtmpfs", "?")
        ):
            return tempfile.mkdtemp(prefix="lmtier-ttft-", dir=base)
    return tempfile.mkdtemp(prefix="lmtier-ttft-", dir=os.getcwd())


def dd_read_gbps(directory: str, nbytes: int, inflight: int = 4, piece_bytes: int = 8 << 20) -> dict:
    """:func:`lmtier.bench.disk.dd_ceiling`'s dd O_DIRECT (16 MiB blocks) write then read of ``nbytes``
    in ``directory``: GB/s each; plus ``read_par``: the same file read with O_DIRECT, ``inflight``
    reads of ``piece_bytes`` in flight (:func:`lmtier.bench.common.odirect_read_gbps`) — the device's
    parallel read ceiling, which the tier's pipelined reads (several records in flight) can approach
    and dd (one read) cannot. A failure is reported as ``error``."""
    from lmtier.bench.disk import DdError, dd_ceiling, dd_path

    res = {}
    try:
        res.update(dd_ceiling(directory, nbytes, keep=True))
        res["read_par"] = odirect_read_gbps(dd_path(directory), piece_bytes=piece_bytes, inflight=inflight)
        res["read_par_inflight"] = inflight
        res["read_par_piece_MiB"] = piece_bytes / (1 << 20)
    except (OSError, DdError) as e:
        res["error"] = str(e)
    finally:
        try:
            os.unlink(dd_path(directory))
        except OSError:
            pass
    return res


def odirect_supported(directory: str) -> bool:
    """Whether files in ``directory`` can be opened with O_DIRECT (not on tmpfs, for instance)."""
    flag = getattr(os, "O_DIRECT", 0)
    if not flag:
        return False
    fd, path = tempfile.mkstemp(prefix=".odirect-", dir=directory)
    os.close(fd)
    try:
        fd = os.open(path, os.O_RDONLY | flag)
        os.close(fd)
        return True
    except OSError:
        return False
    finally:
        os.unlink(path)


def h2d_gbps(dev: Dev, host: torch.Tensor, nbytes: int) -> float | None:
    """GB/s of one contiguous pinned ``host`` -> device copy of ``nbytes`` (median of 5 on the copy
    stream): the CPU tier's physical limit. None without CUDA."""
    if not dev.cuda:
        return None
    nbytes = min(nbytes, host.numel())
    dst = torch.empty(nbytes, dtype=torch.uint8, device=dev.device)
    src = host[:nbytes]
    cs = dev.copy_stream

    def go():
        with torch.cuda.stream(cs):
            dst.copy_(src, non_blocking=True)

    ms, _, _ = timed(dev, go, iters=5, warmup=2)
    return nbytes / ms / 1e6  # dst is freed with this frame


def redis_raw_gbps(url: str, nbytes: int, *, inflight: int, piece_bytes: int = 1 << 20, reads: int = 3) -> float | None:
    """Median GB/s (of ``reads`` rounds) of ``inflight`` plain sockets each reading an ``nbytes``
    value with pipelined ``GETRANGE`` pieces straight into a buffer
    (:class:`lmtier.bench.remote.RawGet`: no client library, no checks) — the Redis tier's same-run
    ceiling. None for URLs without a TCP host (unix, cluster,
    TLS) or on any failure."""
    from lmtier.bench.remote import RawGet

    u = urllib.parse.urlsplit(url)
    if u.scheme != "redis" or not u.hostname:
        return None
    name = b"lmtier-ttft-ceiling"
    conns: list = []
    try:
        conns = [RawGet(u.hostname, u.port or 6379, u.password) for _ in range(max(1, inflight))]
        data = os.urandom(nbytes)
        c0 = conns[0]
        c0.sock.sendall(b"*3\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$%d\r\n" % (len(name), name, nbytes) + data + b"\r\n")
        if not c0.sock.recv(64).startswith(b"+OK"):
            return None
        bufs = [bytearray(nbytes) for _ in conns]

        def read(j):
            return conns[j].get_into(name, memoryview(bufs[j]), piece_bytes)

        rates = []
        with ThreadPoolExecutor(len(conns)) as pool:
            for _ in range(reads):
                t0 = time.perf_counter()
                got = sum(pool.map(read, range(len(conns))))
                rates.append(got / (time.perf_counter() - t0) / 1e9)
        c0.sock.sendall(b"*2\r\n$3\r\nDEL\r\n$%d\r\n%s\r\n" % (len(name), name))
        c0.sock.recv(64)
        return statistics.median(rates)
    except (OSError, RuntimeError, ValueError):
        return None
    finally:
        for c in conns:
            c.close()
