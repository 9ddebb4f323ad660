"""Disk tier against real files: round trip, restart, corruption, eviction, ENOSPC, read-only,
permissions, concurrency, and a writer killed with SIGKILL (file-system oddities at a record path:
tests/test_disk_tier_oddities.py)."""

import errno
import glob
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest
import torch

from lmtier import record as rec
from lmtier.tiers.buffers import AlignedBuffer, round_up
from lmtier.tiers.disk import DiskTier
from lmtier.tiers.disk import io as disk_io

MiB = 1 << 20


def key(i: int) -> bytes:
    return i.to_bytes(4, "little") * 8


def payload(i: int, n: int) -> bytes:
    return np.random.default_rng(i).integers(0, 256, n, dtype=np.uint8).tobytes()


def files(root) -> list[str]:
    return sorted(glob.glob(os.path.join(root, "*", "*.lmt")))


def temp_files(root) -> list[str]:
    """The ``.<key hex>...tmp`` files under ``root``'s shard directories (hidden: a plain ``*.tmp``
    glob never matches them; ``include_hidden=`` needs Python 3.11, lmtier supports 3.10)."""
    return sorted({*glob.glob(os.path.join(root, "*", "*.tmp")), *glob.glob(os.path.join(root, "*", ".*.tmp"))})


@pytest.fixture
def tier(tmp_path):
    t = DiskTier([str(tmp_path / "d")], 256 * MiB, io_threads=2, piece_bytes=1 * MiB)
    yield t
    t.close()


@pytest.mark.parametrize("n", [0, 1, 4095, 4096, 4097, 3 * MiB + 123, 8 * MiB])
@pytest.mark.parametrize("aligned", [True, False])
def test_round_trip_bit_exact(tier, n, aligned):
    data = payload(n, n)
    if aligned:
        src = AlignedBuffer(n)
        src.mv[:n] = data
        src_mv = src.mv[:n]
        dst = AlignedBuffer(n + 1)
        out = dst.mv
    else:
        raw = bytearray(n + 3)
        raw[3:] = data
        src_mv = memoryview(raw)[3:]
        out = memoryview(bytearray(n + 5))[1:]
    assert tier.put(key(n), src_mv)
    assert tier.contains(key(n))
    assert tier.get_into(key(n), out) == n
    assert bytes(out[:n]) == data


def test_tensor_and_numpy_buffers(tier):
    t = torch.arange(1000, dtype=torch.bfloat16)
    assert tier.put(key(1), t)
    out = torch.empty_like(t)
    assert tier.get_into(key(1), out) == 2000
    assert torch.equal(out, t)
    a = np.arange(777, dtype=np.int32)
    assert tier.put(key(2), a)
    b = np.zeros(1000, dtype=np.int32)
    assert tier.get_into(key(2), b) == a.nbytes and np.array_equal(b[:777], a)


def test_out_too_small_is_a_miss_and_keeps_record(tier):
    assert tier.put(key(1), payload(1, 10000))
    assert tier.get_into(key(1), bytearray(9999)) is None
    assert tier.contains(key(1))


def test_missing_key(tier):
    assert not tier.contains(key(9))
    assert tier.get_into(key(9), bytearray(10)) is None


def test_restart_rebuilds_index(tmp_path):
    root = str(tmp_path / "d")
    t = DiskTier([root], 64 * MiB)
    for i in range(5):
        assert t.put(key(i), payload(i, 100_000 + i))
    used = t.usage()
    t.close()
    t2 = DiskTier([root], 64 * MiB)
    assert t2.usage() == used
    for i in range(5):
        out = bytearray(200_000)
        assert t2.get_into(key(i), out) == 100_000 + i
        assert bytes(out[: 100_000 + i]) == payload(i, 100_000 + i)


def test_files_and_dirs_are_private(tier):
    assert tier.put(key(1), b"secret prompt kv")
    (f,) = files(tier.paths[0])
    assert os.stat(f).st_mode & 0o777 == 0o600
    assert os.stat(os.path.dirname(f)).st_mode & 0o777 == 0o700
    assert os.stat(tier.paths[0]).st_mode & 0o777 == 0o700


def test_record_file_layout(tier):
    data = payload(3, 5000)
    assert tier.put(key(3), data)
    (f,) = files(tier.paths[0])
    raw = open(f, "rb").read()
    assert len(raw) == 4096 + 8192 and len(raw) % 4096 == 0
    h = rec.decode_header(raw, expected_key=key(3))
    assert h.payload_offset == 4096 and raw[4096 : 4096 + 5000] == data


@pytest.mark.parametrize("damage", ["flip_payload", "flip_header", "truncate", "truncate_header", "wrong_key", "empty"])
def test_corrupted_record_is_miss_and_removed(tier, damage):
    n = 3 * MiB + 5
    assert tier.put(key(1), payload(1, n))
    (f,) = files(tier.paths[0])
    with open(f, "r+b") as fh:
        if damage == "flip_payload":
            fh.seek(4096 + n // 2)
            b = fh.read(1)
            fh.seek(4096 + n // 2)
            fh.write(bytes([b[0] ^ 1]))
        elif damage == "flip_header":
            fh.seek(30)
            fh.write(b"\xff")
        elif damage == "truncate":
            fh.truncate(4096 + n // 2)
        elif damage == "truncate_header":
            fh.truncate(60)
        elif damage == "wrong_key":
            fh.seek(40)
            fh.write(key(2))  # header checksum now fails too; either way a miss
        elif damage == "empty":
            fh.truncate(0)
    seen = []
    tier.add_eviction_listener(lambda ev: seen.append((ev.tier, ev.keys)))
    out = AlignedBuffer(n)
    assert tier.get_into(key(1), out.mv) is None
    assert not tier.contains(key(1))
    assert files(tier.paths[0]) == []
    assert tier.usage().used_bytes == 0
    # reported as gone (a scheduler in another process stops claiming it); a plain miss is not
    assert seen == [("disk", (key(1),))]
    assert tier.get_into(key(1), out.mv) is None and tier.get_into(key(9), out.mv) is None
    assert len(seen) == 1


def test_a_put_landing_while_a_corrupt_record_is_discarded_stays(tier, monkeypatch):
    """A reader discarding a corrupt record, and another thread's put of the same key landing between
    the reader's unlink and its index update: the fresh record stays indexed and loads."""
    import lmtier.tiers.disk.tier as disk_tier

    n = 8192
    assert tier.put(key(1), payload(1, n))
    with open(tier._path(key(1)), "r+b") as fh:
        fh.seek(4096 + 10)
        fh.write(b"\xff" * 10)
    real = disk_tier.dio.unlink_if_same

    def racy(path, fd):
        gone = real(path, fd)
        assert tier.put(key(1), payload(1, n))  # the other thread's put, renamed in and indexed
        return gone

    monkeypatch.setattr(disk_tier.dio, "unlink_if_same", racy)
    out = AlignedBuffer(n)
    assert tier.get_into(key(1), out.mv) is None  # the corrupt read: a miss
    monkeypatch.setattr(disk_tier.dio, "unlink_if_same", real)
    assert tier.contains(key(1)) and tier.usage().num_chunks == 1
    assert tier.get_into(key(1), out.mv) == n and bytes(out.mv[:n]) == payload(1, n)


def test_vanished_record_is_reported_gone_and_a_short_buffer_is_not(tier):
    """A record deleted behind the tier's back is a miss reported to the eviction listeners; a read
    into a too-small buffer is a miss that keeps the record, and reports nothing."""
    seen = []
    tier.add_eviction_listener(lambda ev: seen.append(ev.keys))
    assert tier.put(key(1), payload(1, 5000)) and tier.put(key(2), payload(2, 5000))
    assert tier.get_into(key(2), bytearray(100)) is None and tier.contains(key(2)) and seen == []
    os.unlink(tier._path(key(1)))
    assert tier.get_into(key(1), bytearray(5000)) is None and not tier.contains(key(1))
    assert seen == [(key(1),)]


def test_corruption_found_at_restart(tmp_path):
    root = str(tmp_path / "d")
    t = DiskTier([root], 64 * MiB)
    for i in range(3):
        t.put(key(i), payload(i, 10000))
    t.close()
    fs = files(root)
    with open(fs[0], "r+b") as fh:
        fh.truncate(5000)  # shorter than the record
    with open(fs[1], "r+b") as fh:
        fh.write(b"JUNK")
    open(os.path.join(os.path.dirname(fs[2]), ".deadbeef.999999999.0.tmp"), "wb").write(b"x")  # stale temp
    t2 = DiskTier([root], 64 * MiB)
    assert t2.usage().num_chunks == 1
    assert len(files(root)) == 1
    assert not temp_files(root)


def test_second_tier_on_the_same_directory_keeps_an_in_flight_write(tmp_path, monkeypatch):
    """Two DiskTier instances of one process on one directory: the second one's start used to delete
    every ``.tmp`` carrying this pid, so the first one's rename failed and its put returned False."""
    root = str(tmp_path / "d")
    a = DiskTier([root], 64 * MiB)
    in_flight, release = threading.Event(), threading.Event()
    real_fdatasync = os.fdatasync

    def slow_fdatasync(fd):  # the record is in its temporary file, about to be renamed
        in_flight.set()
        assert release.wait(30)
        real_fdatasync(fd)

    monkeypatch.setattr(os, "fdatasync", slow_fdatasync)
    d = payload(7, 3 * MiB + 5)
    result = []
    writer = threading.Thread(target=lambda: result.append(a.put(key(7), d)))
    writer.start()
    try:
        assert in_flight.wait(30)
        tmp = temp_files(root)
        assert len(tmp) == 1
        b = DiskTier([root], 64 * MiB)  # scans the directory while a's write is in flight
        assert os.path.exists(tmp[0])
    finally:
        release.set()
        writer.join(30)
    monkeypatch.setattr(os, "fdatasync", real_fdatasync)
    assert result == [True] and a.counters["put_errors"] == 0
    out = bytearray(len(d))
    assert a.get_into(key(7), out) == len(d) and bytes(out) == d
    assert not temp_files(root)
    c = DiskTier([root], 64 * MiB)  # a later start finds the record a wrote
    assert c.get_into(key(7), out) == len(d) and bytes(out) == d
    for t in (a, b, c):
        t.close()


def test_start_removes_only_temp_files_of_dead_writers(tmp_path):
    root = str(tmp_path / "d")
    live = DiskTier([root], 64 * MiB)
    shard = os.path.join(root, "ab")
    os.makedirs(shard, exist_ok=True)
    h, me, parent = "ab" * 32, os.getpid(), os.getppid()
    names = {
        f".{h}.{me}.{live._tmp.token}.0.tmp": True,  # a live instance of this process: kept
        f".{h}.{parent}.{'0' * 16}.0.tmp": True,  # another live process: kept
        f".{h}.{me}.{'f' * 16}.0.tmp": False,  # this pid, no live instance: an earlier process with this pid
        f".{h}.{me}.3.tmp": False,  # an older lmtier's name, this pid: no live writer here uses it
        f".{h}.999999999.{'0' * 16}.0.tmp": False,  # a dead process
        f".{h}.999999999.0.tmp": False,
        "junk.tmp": False,
    }
    for n in names:
        open(os.path.join(shard, n), "wb").close()
    DiskTier([root], 64 * MiB).close()
    assert sorted(os.listdir(shard)) == sorted(n for n, kept in names.items() if kept)
    live.close()  # a closed instance writes no more: its leftover is stale to the next start
    DiskTier([root], 64 * MiB).close()
    assert os.listdir(shard) == [f".{h}.{parent}.{'0' * 16}.0.tmp"]


def test_deleted_file_is_miss_and_dropped(tier):
    assert tier.put(key(1), b"x" * 100)
    os.unlink(files(tier.paths[0])[0])
    assert tier.contains(key(1))  # the index does not know yet
    assert tier.get_into(key(1), bytearray(100)) is None
    assert not tier.contains(key(1))
    assert tier.usage().used_bytes == 0


def test_delete(tier):
    assert tier.put(key(1), b"x" * 100)
    assert tier.delete(key(1))
    assert not tier.delete(key(1))
    assert files(tier.paths[0]) == [] and tier.usage().num_chunks == 0


def test_lru_eviction_by_bytes(tmp_path):
    rec_bytes = 4096 + 1 * MiB
    t = DiskTier([str(tmp_path)], 3 * rec_bytes)
    for i in range(3):
        assert t.put(key(i), payload(i, MiB))
    assert t.get_into(key(0), bytearray(MiB)) == MiB  # 0 is now most recent
    assert t.put(key(3), payload(3, MiB))
    assert [t.contains(key(i)) for i in range(4)] == [True, False, True, True]
    assert t.usage().used_bytes == 3 * rec_bytes <= t.capacity_bytes
    assert len(files(str(tmp_path))) == 3
    assert not t.put(key(9), payload(9, 4 * MiB))  # larger than the whole tier
    assert t.usage().num_chunks == 3


def test_eviction_listener_reports_lru_victims_and_forget(tmp_path):
    """The LRU's victims reach the eviction listeners (after their files are gone); ``delete`` does
    not report; a second view of the directory ``forget``s a key without unlinking its file; a
    failing listener does not fail the put."""
    rec_bytes = 4096 + 1 * MiB
    t = DiskTier([str(tmp_path)], 2 * rec_bytes)
    seen = []

    def cb(ev):
        assert ev.tier == "disk" and ev.payloads is None and isinstance(ev.keys, tuple)
        seen.append((list(ev.keys), [os.path.exists(t._path(k)) for k in ev.keys]))

    t.add_eviction_listener(cb)
    assert t.put(key(0), payload(0, MiB)) and t.put(key(1), payload(1, MiB))
    assert seen == []
    assert t.put(key(2), payload(2, MiB))
    assert seen == [([key(0)], [False])]
    assert t.delete(key(1)) and len(seen) == 1
    view = DiskTier([str(tmp_path)], 2 * rec_bytes)  # the scheduler's view: finds key 2 at startup
    assert view.contains(key(2))
    assert view.forget(key(2)) and not view.contains(key(2)) and not view.forget(key(2))
    assert t.get_into(key(2), bytearray(MiB)) == MiB  # the file is untouched
    t.remove_eviction_listener(cb)
    t.add_eviction_listener(lambda ev: 1 / 0)
    assert t.put(key(3), payload(3, MiB)) and t.put(key(4), payload(4, MiB))
    assert t.contains(key(4)) and not t.contains(key(2))
    assert t.counters["evict_listener_errors"] == 1 and len(seen) == 1


def test_restart_respects_smaller_capacity(tmp_path, caplog):
    t = DiskTier([str(tmp_path)], 64 * MiB)
    for i in range(4):
        t.put(key(i), payload(i, MiB))
        time.sleep(0.01)
    t.close()
    with caplog.at_level("WARNING", logger="lmtier.tiers.disk"):
        t2 = DiskTier([str(tmp_path)], 2 * (4096 + MiB))
    assert t2.usage().num_chunks == 2
    assert len(files(str(tmp_path))) == 2
    # the deletion is said (it was silent: the only line, at INFO, said "2 chunks found")
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warned) == 1 and "4 chunks" in warned[0] and "removed the 2 least recently used" in warned[0], warned
    t2.close()
    caplog.clear()
    with caplog.at_level("WARNING", logger="lmtier.tiers.disk"):
        DiskTier([str(tmp_path)], 2 * (4096 + MiB)).close()
    assert not [r for r in caplog.records if r.levelname == "WARNING"]  # nothing removed: no warning


def test_multiple_paths_spread(tmp_path):
    roots = [str(tmp_path / "a"), str(tmp_path / "b")]
    t = DiskTier(roots, 64 * MiB)
    for _ in range(40):
        assert t.put(os.urandom(32), b"y" * 1000)
    assert len(files(roots[0])) > 5 and len(files(roots[1])) > 5
    t.close()
    assert DiskTier(roots, 64 * MiB).usage().num_chunks == 40


def test_write_error_leaves_nothing_visible(tier, monkeypatch):
    def boom(fd, mv, off):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(disk_io, "pwrite_all", boom)
    assert not tier.put(key(1), payload(1, 3 * MiB))
    assert not tier.contains(key(1))
    assert not glob.glob(os.path.join(tier.paths[0], "*", "*"))  # no temp, no record
    assert tier.usage().used_bytes == 0


def _ioprio(tid: int) -> int | None:
    """ioprio_get(IOPRIO_WHO_PROCESS, tid) on x86_64 Linux, else None."""
    import ctypes

    if sys.platform != "linux" or os.uname().machine != "x86_64":
        return None
    return ctypes.CDLL(None, use_errno=True).syscall(252, 1, tid)


def test_write_pieces_run_at_background_priority_reads_do_not(tier, monkeypatch):
    """A put's pieces run on the write pool (nice 19, best-effort I/O level 7); a get's pieces on
    the read pool at the caller's priority, so a load never waits behind a store's pieces."""
    seen = []
    real_w, real_r = disk_io.pwrite_all, disk_io.pread_into

    def note(kind):
        tid = threading.get_native_id()
        seen.append((kind, threading.current_thread().name, os.getpriority(os.PRIO_PROCESS, tid), _ioprio(tid)))

    def w(fd, mv, off):
        note("w")
        return real_w(fd, mv, off)

    def r(fd, mv, off):
        note("r")
        return real_r(fd, mv, off)

    monkeypatch.setattr(disk_io, "pwrite_all", w)
    monkeypatch.setattr(disk_io, "pread_into", r)
    data = payload(7, 3 * MiB + 5)  # unaligned source: several pieces + the tail, all on the write pool
    assert tier.put(key(7), memoryview(bytearray(data)))
    buf = AlignedBuffer(len(data))
    assert tier.get_into(key(7), buf.mv) == len(data)
    assert bytes(buf.mv[: len(data)]) == data
    writes = [x for x in seen if x[0] == "w" and x[1].startswith("lmtier-disk-w")]
    reads = [x for x in seen if x[0] == "r" and x[1].startswith("lmtier-disk")]
    assert len(writes) >= 3 and reads
    for _, name, nice, prio in writes:
        assert nice == 19, name
        assert prio in (None, (2 << 13) | 7), (name, prio)
    base = os.getpriority(os.PRIO_PROCESS, 0)
    for _, name, nice, _ in reads:
        assert not name.startswith("lmtier-disk-w") and nice == base, (name, nice)


def _mount_tmpfs(path, size="1m"):
    os.makedirs(path, exist_ok=True)
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", path], capture_output=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount tmpfs (needs root): {r.stderr.decode().strip()}")


def _umount(path):
    subprocess.run(["umount", "-l", path], capture_output=True)


def test_enospc_on_real_tmpfs(tmp_path):
    mnt = str(tmp_path / "small")
    _mount_tmpfs(mnt, "1m")
    try:
        t = DiskTier([mnt], 64 * MiB)  # capacity larger than the filesystem
        assert t.put(key(1), payload(1, 300_000))
        assert not t.put(key(2), payload(2, 2 * MiB))  # ENOSPC
        assert not t.contains(key(2))
        assert not temp_files(mnt)
        out = bytearray(300_000)
        assert t.get_into(key(1), out) == 300_000 and bytes(out) == payload(1, 300_000)
        t.close()
        assert DiskTier([mnt], 64 * MiB).usage().num_chunks == 1
    finally:
        _umount(mnt)


def test_read_only_filesystem(tmp_path):
    mnt = str(tmp_path / "ro")
    _mount_tmpfs(mnt, "8m")
    try:
        t = DiskTier([mnt], 64 * MiB)
        assert t.put(key(1), b"kept" * 1000)
        subprocess.run(["mount", "-o", "remount,ro", mnt], check=True)
        assert not t.put(key(2), b"new" * 1000)
        assert not t.contains(key(2))
        out = bytearray(4000)
        assert t.get_into(key(1), out) == 4000 and bytes(out) == b"kept" * 1000  # nothing lost
        assert DiskTier([mnt], 64 * MiB).usage().num_chunks == 1
    finally:
        _umount(mnt)


def test_corrupt_record_on_a_read_only_filesystem_is_read_once(tmp_path):
    """A corrupt record the tier cannot delete (the file system went read-only) is a miss reported
    gone, dropped from the index: later lookups miss without reading the file again, and the other
    record still loads; after a restart, the first lookup drops it again."""
    mnt = str(tmp_path / "ro")
    _mount_tmpfs(mnt, "8m")
    try:
        t = DiskTier([mnt], 64 * MiB)
        assert t.put(key(1), payload(1, 5000)) and t.put(key(2), payload(2, 5000))
        with open(t._path(key(1)), "r+b") as fh:
            fh.seek(4096 + 100)
            b = fh.read(1)
            fh.seek(4096 + 100)
            fh.write(bytes([b[0] ^ 1]))
        subprocess.run(["mount", "-o", "remount,ro", mnt], check=True)
        seen = []
        t.add_eviction_listener(lambda ev: seen.append(ev.keys))
        out = bytearray(5000)
        assert t.get_into(key(1), out) is None
        assert not t.contains(key(1)) and seen == [(key(1),)]
        assert os.path.exists(t._path(key(1)))  # left in place: it cannot be removed
        assert t.counters["corrupt"] == 1
        assert t.get_into(key(1), out) is None and t.counters["corrupt"] == 1  # not read again
        assert t.get_into(key(2), out) == 5000 and bytes(out) == payload(2, 5000)
        assert t.usage().num_chunks == 1
        t2 = DiskTier([mnt], 64 * MiB)  # the scan reads headers only: it indexes the file again
        assert t2.get_into(key(1), out) is None and not t2.contains(key(1))
        assert t2.get_into(key(2), out) == 5000 and t2.usage().num_chunks == 1
    finally:
        _umount(mnt)


def test_concurrent_puts_and_gets_same_key(tier):
    n = 2 * MiB + 17
    data = payload(7, n)
    errors = []
    stop = threading.Event()

    def writer():
        while not stop.is_set():
            if not tier.put(key(7), data):
                errors.append("put failed")

    def reader():
        out = bytearray(n)
        while not stop.is_set():
            got = tier.get_into(key(7), out)
            if got is not None and (got != n or bytes(out) != data):
                errors.append("wrong data")

    assert tier.put(key(7), data)
    threads = [threading.Thread(target=writer) for _ in range(3)] + [threading.Thread(target=reader) for _ in range(3)]
    for th in threads:
        th.start()
    time.sleep(2.0)
    stop.set()
    for th in threads:
        th.join()
    assert errors == []
    assert tier.usage().num_chunks == 1 and tier.usage().used_bytes == 4096 + round_up(n)
    assert len(files(tier.paths[0])) == 1
    assert tier.counters["corrupt"] == 0


def test_concurrent_distinct_keys_under_eviction(tmp_path):
    t = DiskTier([str(tmp_path)], 10 * (4096 + 256 * 1024), io_threads=2)
    errors = []

    def work(w):
        for i in range(30):
            k = key(w * 1000 + i)
            d = payload(w * 1000 + i, 256 * 1024)
            if t.put(k, d):
                out = bytearray(len(d))
                got = t.get_into(k, out)
                if got is not None and bytes(out) != d:
                    errors.append(k)
            assert t.usage().used_bytes <= t.capacity_bytes

    threads = [threading.Thread(target=work, args=(w,)) for w in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert errors == []
    assert t.usage().used_bytes <= t.capacity_bytes
    assert len(files(str(tmp_path))) == t.usage().num_chunks <= 10


WRITER = textwrap.dedent("""
    import sys, numpy as np
    from lmtier.tiers.disk import DiskTier
    t = DiskTier([sys.argv[1]], 1 << 34, io_threads=2)
    n = 32 << 20
    for i in range(1000):
        k = i.to_bytes(4, "little") * 8
        d = np.random.default_rng(i).integers(0, 256, n, dtype=np.uint8)
        t.put(k, d)
        print(i, flush=True)
""")


def test_writer_killed_mid_write_leaves_no_visible_record(tmp_path):
    root = str(tmp_path / "d")
    p = subprocess.Popen(
        [sys.executable, "-c", WRITER, root],
        stdout=subprocess.PIPE,
        text=True,
        cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
    )
    assert p.stdout.readline().strip() == "0"  # one record complete, the next in flight
    time.sleep(0.05)
    p.send_signal(signal.SIGKILL)
    p.wait()
    t = DiskTier([root], 1 << 34)
    assert not temp_files(root)
    n = 32 << 20
    out = AlignedBuffer(n)
    assert t.usage().num_chunks >= 1
    for k in t.keys():
        i = int.from_bytes(k[:4], "little")
        assert t.get_into(k, out.mv) == n
        assert bytes(out.mv[:n]) == np.random.default_rng(i).integers(0, 256, n, dtype=np.uint8).tobytes()


def test_invalid_arguments(tmp_path):
    with pytest.raises(ValueError):
        DiskTier([], 1)
    with pytest.raises(ValueError):
        DiskTier([str(tmp_path)], 0)
    with pytest.raises(ValueError):
        DiskTier([str(tmp_path)], 1, use_kvikio="maybe")
    with pytest.raises(ValueError):
        DiskTier([str(tmp_path)], 1 << 20).put(b"short", b"x")


def test_odirect_off(tmp_path):
    t = DiskTier([str(tmp_path)], 64 * MiB, use_odirect=False, sync="none")
    assert t.put(key(1), payload(1, 12345))
    out = bytearray(12345)
    assert t.get_into(key(1), out) == 12345 and bytes(out) == payload(1, 12345)


@pytest.mark.gpu
@pytest.mark.parametrize("use_kvikio", ["never", "auto", "always"])
def test_cuda_tensor_round_trip(tmp_path, use_kvikio):
    if use_kvikio == "always":
        pytest.importorskip("kvikio")
    t = DiskTier([str(tmp_path)], 256 * MiB, use_kvikio=use_kvikio)
    n = 8 * MiB + 3
    src = torch.randint(0, 256, (n,), dtype=torch.uint8, device="cuda")
    assert t.put(key(1), src)
    out = torch.zeros(n + 5, dtype=torch.uint8, device="cuda")
    assert t.get_into(key(1), out) == n
    assert torch.equal(out[:n], src)
    # corruption is still caught on the CUDA path
    (f,) = files(str(tmp_path))
    with open(f, "r+b") as fh:
        fh.seek(4096 + 100)
        fh.write(b"\x00\xff\x00")
    assert t.get_into(key(1), out) is None and not t.contains(key(1))
