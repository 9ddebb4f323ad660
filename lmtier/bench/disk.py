"""Disk tier store/load bandwidth for large chunks vs ``dd`` with O_DIRECT on the same directory.

Usage::

    lmtier bench disk --dir /mnt/nvme/lmtier-bench [--size-mib 32] [--count 16]
        [--threads 1,2,4] [--sync data,none] [--json out.json]

Bytes declared: payload bytes per chunk (the 4 KiB header block is not counted). Each case
writes ``count`` distinct chunks (so a working set of count x size) and reads them back; the
table shows the median per-chunk GB/s and the aggregate. The ceiling is ``dd bs=16M
oflag=direct conv=fdatasync`` (write) and ``dd bs=16M iflag=direct`` (read) of the same total
bytes in the same directory, measured right before and after each case (mean of the two). Page
cache is not involved (O_DIRECT on both sides). A tiny smoke run: ``pytest benchmarks/bench_disk.py``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

from lmtier.bench.args import bounded_float, bounded_int, int_list, name_list, output_file
from lmtier.bench.common import (
    add_common_args,
    odirect_read_gbps,
    plot_bars,
    print_table,
    progress,
    report_plot,
    system_header,
    write_json,
)
from lmtier.bench.presets import preset
from lmtier.errors import LMTierError
from lmtier.tiers.buffers import AlignedBuffer
from lmtier.tiers.disk import DiskTier

MiB = 1 << 20


class DdError(LMTierError, RuntimeError):
    """``dd`` (the raw-device ceiling) failed in the benchmark's directory; the message names the
    directory and quotes dd's stderr (a read-only file system, no O_DIRECT on tmpfs, a full disk)."""


def _dd(directory: str, args: list[str]) -> None:
    """Run ``dd`` with ``args`` for a file in ``directory``.

    Raises:
        DdError: dd exited non-zero (the message names ``directory`` and carries dd's stderr).
    """
    p = subprocess.run(args, capture_output=True, text=True)
    if p.returncode != 0:
        why = p.stderr.strip() or f"exit status {p.returncode}"
        raise DdError(f"dd failed in --dir {directory!r}: {why}")


def _dd_write(directory: str, path: str, count: int) -> None:
    """Write ``count`` 16 MiB blocks of zeros to ``path`` with dd, O_DIRECT, with a final fdatasync.

    Raises:
        DdError: dd failed (see :func:`_dd`).
    """
    _dd(directory, ["dd", "if=/dev/zero", f"of={path}", "bs=16M", f"count={count}", "oflag=direct", "conv=fdatasync"])


def check_writable(directory: str) -> None:
    """Create and remove a temporary file in ``directory``: the benchmark writes there.

    Raises:
        OSError: it cannot (a read-only file system, no permission), ``strerror`` saying why.
    """
    fd, path = tempfile.mkstemp(dir=directory, prefix=".lmtier-probe-")
    os.close(fd)
    os.unlink(path)


def dd_ceiling(directory: str, total_bytes: int, keep: bool = False) -> dict:
    """GB/s of dd with O_DIRECT, 16 MiB blocks: write (with a final fdatasync) and read of
    ``total_bytes`` (rounded down to 16 MiB, at least 16 MiB) in ``directory``'s ``dd-ceiling.bin``.
    The file is removed unless ``keep`` (then the caller removes it; ``dd_path`` names it).

    Raises:
        DdError: dd failed (the directory is not writable, or its file system lacks O_DIRECT).
    """
    path = dd_path(directory)
    count = max(1, total_bytes // (16 * MiB))
    res = {}
    try:
        t0 = time.perf_counter()
        _dd_write(directory, path, count)
        res["write"] = count * 16 * MiB / (time.perf_counter() - t0) / 1e9
        t0 = time.perf_counter()
        _dd(directory, ["dd", f"if={path}", "of=/dev/null", "bs=16M", f"count={count}", "iflag=direct"])
        res["read"] = count * 16 * MiB / (time.perf_counter() - t0) / 1e9
    finally:
        if not keep and os.path.exists(path):
            os.unlink(path)
    return res


def dd_path(directory: str) -> str:
    """The file :func:`dd_ceiling` writes in ``directory``."""
    return os.path.join(directory, "dd-ceiling.bin")


def bench_tier(
    directory: str, *, size: int, count: int, threads: int, sync: str, aligned: bool, rounds: int = 2
) -> dict:
    root = tempfile.mkdtemp(dir=directory, prefix="tier-")
    tier = DiskTier([root], capacity_bytes=(count + 2) * (size + 8192), io_threads=threads, sync=sync)
    src = AlignedBuffer(size + 1)
    src.mv[:size] = os.urandom(size)
    dst = AlignedBuffer(size + 1)
    s_mv = src.mv[:size] if aligned else memoryview(bytearray(src.mv[:size]))  # bytearray: unaligned
    d_mv = dst.mv[:size] if aligned else memoryview(bytearray(size + 64))[1:]
    keys = [i.to_bytes(4, "little") * 8 for i in range(count)]
    put_t, get_t = [], []
    try:
        tier.put(b"w" * 32, s_mv)  # warm pools
        tier.get_into(b"w" * 32, d_mv)
        tier.delete(b"w" * 32)
        for _ in range(rounds):
            for k in keys:
                t0 = time.perf_counter()
                assert tier.put(k, s_mv)
                put_t.append(time.perf_counter() - t0)
            for k in keys:
                t0 = time.perf_counter()
                assert tier.get_into(k, d_mv) == size
                get_t.append(time.perf_counter() - t0)
            for k in keys:
                tier.delete(k)
    finally:
        tier.close()
        shutil.rmtree(root, ignore_errors=True)
    return {
        "threads": threads,
        "sync": sync,
        "buffers": "aligned" if aligned else "unaligned",
        "store_GBps": size / statistics.median(put_t) / 1e9,
        "load_GBps": size / statistics.median(get_t) / 1e9,
        "store_agg_GBps": size * len(put_t) / sum(put_t) / 1e9,
        "load_agg_GBps": size * len(get_t) / sum(get_t) / 1e9,
    }


def bench_inflight(
    directory: str, *, size: int, count: int, inflight: list[int], threads: int = 4, rounds: int = 2
) -> list[dict]:
    """Loads of ``count`` records with ``k`` ``get_into`` calls in flight (one thread each, aligned
    buffers: the ttft bench's read pipeline) vs ``k`` parallel O_DIRECT reads of 8 MiB of a raw file,
    for each ``k`` in ``inflight``; both in GB/s of payload, aggregate over the batch."""
    from concurrent.futures import ThreadPoolExecutor

    root = tempfile.mkdtemp(dir=directory, prefix="tier-")
    tier = DiskTier([root], capacity_bytes=(count + 2) * (size + 8192), io_threads=threads, sync="none")
    src = AlignedBuffer(size)
    src.mv[:size] = os.urandom(size)
    keys = [i.to_bytes(4, "little") * 8 for i in range(count)]
    raw = os.path.join(directory, "inflight-raw.bin")
    rows = []
    try:
        for k in keys:
            assert tier.put(k, src.mv[:size])
        _dd_write(directory, raw, max(1, size * count // (16 * MiB)))
        for k_in in inflight:
            bufs = [AlignedBuffer(size) for _ in range(k_in)]
            tl, tr = [], []
            for _ in range(rounds):
                t0 = time.perf_counter()
                with ThreadPoolExecutor(max_workers=k_in) as pool:

                    def one(j):
                        for key in keys[j::k_in]:
                            assert tier.get_into(key, bufs[j].mv[:size]) == size

                    list(pool.map(one, range(k_in)))
                tl.append(time.perf_counter() - t0)
                tr.append(odirect_read_gbps(raw, inflight=k_in))
            for b in bufs:
                b.close()
            load = size * count / statistics.median(tl) / 1e9
            ceil = statistics.median(tr)
            rows.append(
                {
                    "inflight": k_in,
                    "io_threads": threads,
                    "load_GBps": load,
                    "odirect_par_GBps": ceil,
                    "load_%par": 100 * load / ceil,
                }
            )
    finally:
        tier.close()
        shutil.rmtree(root, ignore_errors=True)
        src.close()
        if os.path.exists(raw):
            os.unlink(raw)
    return rows


def mount_of(path: str) -> str:
    """The mount point holding ``path`` and its device as ``/proc/mounts`` names them (``"mount /mnt/nvme
    (/dev/nvme0n1p1, xfs)"``), or the mount point alone where ``/proc/mounts`` cannot be read."""
    real = os.path.realpath(path)
    best = ("/", "?", "?")
    try:
        with open("/proc/mounts") as f:
            for line in f:
                dev, mnt, fs = line.split()[:3]
                mnt = mnt.replace("\\040", " ")
                if (real == mnt or real.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best[0]):
                    best = (mnt, dev, fs)
    except OSError:
        pass
    return f"mount {best[0]} ({best[1]}, {best[2]})"


def run(
    directory: str,
    *,
    size: int,
    count: int,
    threads: list[int],
    syncs: list[str],
    rounds: int = 2,
    inflight: list[int] | None = None,
    quiet: bool = True,
) -> dict:
    os.makedirs(directory, exist_ok=True)
    rows = []
    ceilings = []
    cases = [(sync, th, aligned) for sync in syncs for th in threads for aligned in (True, False)]
    for sync, th, aligned in progress(cases, desc="disk cases", disable=quiet):
        # Virtual disks drift by 2x within minutes: measure dd right before and after each case and
        # compare against the mean of the two.
        before = dd_ceiling(directory, size * count)
        r = bench_tier(directory, size=size, count=count, threads=th, sync=sync, aligned=aligned, rounds=rounds)
        after = dd_ceiling(directory, size * count)
        r["dd_write_GBps"] = (before["write"] + after["write"]) / 2
        r["dd_read_GBps"] = (before["read"] + after["read"]) / 2
        r["store_%dd"] = 100 * r["store_agg_GBps"] / r["dd_write_GBps"]
        r["load_%dd"] = 100 * r["load_agg_GBps"] / r["dd_read_GBps"]
        ceilings += [before, after]
        rows.append(r)
    res = {
        "system": system_header(),
        "dir": directory,
        "chunk_bytes": size,
        "chunks": count,
        "dd_GBps": {k: statistics.median(c[k] for c in ceilings) for k in ("write", "read")},
        "rows": rows,
    }
    if inflight:
        res["inflight_rows"] = bench_inflight(directory, size=size, count=count, inflight=inflight, rounds=rounds)
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="lmtier bench disk", description=__doc__.split("\n")[0])
    ap.add_argument("--dir", default=os.path.join(tempfile.gettempdir(), "lmtier-bench-disk"))
    ap.add_argument(
        "--size-mib",
        type=bounded_float(above=0),
        default=None,
        help="record size (default: one 256-token chunk of --model-preset; 32 MiB for Llama-3.1-8B)",
    )
    ap.add_argument("--count", type=bounded_int(min_value=1), default=16)
    ap.add_argument("--rounds", type=bounded_int(min_value=1), default=2)
    ap.add_argument("--threads", type=int_list(min_value=1), default="1,2,4", help="disk tier I/O threads")
    ap.add_argument("--sync", type=name_list(("data", "none")), default="data,none", help="disk tier sync modes")
    ap.add_argument(
        "--inflight",
        type=int_list(min_value=1, allow_empty=True),
        default="1,2,4,8",
        help="records read concurrently in the pipelined-load rows ('' to skip)",
    )
    ap.add_argument("--json", type=output_file)
    add_common_args(ap)
    a = ap.parse_args(argv)
    existed = os.path.isdir(a.dir)
    try:
        os.makedirs(a.dir, exist_ok=True)
        check_writable(a.dir)
    except OSError as e:  # a file there, no permission, read-only: a usage error, not a traceback from run()
        ap.error(f"--dir {a.dir!r}: {e.strerror or e}")
    if not existed:  # a mistyped mount point would otherwise measure the disk under it, silently
        print(f"{ap.prog}: --dir {a.dir!r} did not exist: created it (on {mount_of(a.dir)})", file=sys.stderr)
    size = int(a.size_mib * MiB) if a.size_mib else 256 * preset(a.model_preset).bytes_per_token()
    size = max(4096, size // 4096 * 4096)
    a.size_mib = size / MiB
    try:
        res = run(
            a.dir,
            size=size,
            count=a.count,
            threads=a.threads,
            syncs=a.sync,
            rounds=a.rounds,
            inflight=a.inflight,
            quiet=a.quiet,
        )
    except DdError as e:
        raise SystemExit(f"{ap.prog}: {e}") from None
    res["model_preset"] = a.model_preset
    print(f"# {res['system']}")
    print(
        f"dd O_DIRECT bs=16M on {a.dir} (median over the run): write {res['dd_GBps']['write']:.2f} GB/s, "
        f"read {res['dd_GBps']['read']:.2f} GB/s  ({a.count} x {a.size_mib} MiB per case)"
    )
    print_table(
        res["rows"],
        [
            "threads",
            "sync",
            "buffers",
            "store_agg_GBps",
            "dd_write_GBps",
            "store_%dd",
            "load_agg_GBps",
            "dd_read_GBps",
            "load_%dd",
            "store_GBps",
            "load_GBps",
        ],
    )
    if res.get("inflight_rows"):
        print(
            "pipelined loads: k records in flight (get_into, aligned) vs k parallel O_DIRECT 8 MiB reads of a raw file"
        )
        print_table(res["inflight_rows"], ["inflight", "io_threads", "load_GBps", "odirect_par_GBps", "load_%par"])
    write_json(a.json, res)
    if a.plot:
        rows = res["rows"]
        groups = [f"{r['threads']} thr, sync={r['sync']}, {r['buffers']}" for r in rows]
        bars = {
            "store": [r["store_agg_GBps"] for r in rows],
            "dd write": [r["dd_write_GBps"] for r in rows],
            "load": [r["load_agg_GBps"] for r in rows],
            "dd read": [r["dd_read_GBps"] for r in rows],
        }
        for r in res.get("inflight_rows", []):
            groups.append(f"load, {r['inflight']} in flight")
            for k in bars:
                bars[k].append(None)
            bars["load"][-1] = r["load_GBps"]
            bars["dd read"][-1] = r["odirect_par_GBps"]
        why = plot_bars(
            a.plot,
            groups,
            bars,
            title=f"disk tier vs raw device, {a.count} x {a.size_mib:.1f} MiB records ({a.model_preset}) in {a.dir}",
            ylabel="GB/s",
        )
        report_plot(a.plot, why)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
