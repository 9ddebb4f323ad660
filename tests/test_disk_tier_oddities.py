"""Disk tier: file-system oddities at a record path — a directory, a symlink, a FIFO, a device node,
EACCES, EIO, a file shrinking during the read (issue 20 section 2). Each is a miss, never an
exception, a hang or a read through a link. Helpers and the ``tier`` fixture: tests/test_disk_tier.py."""

import errno
import os
import stat
import threading

import pytest

from lmtier import record as rec
from lmtier.tiers.buffers import AlignedBuffer
from lmtier.tiers.disk import DiskTier
from lmtier.tiers.disk import io as disk_io
from tests import test_disk_tier
from tests.test_disk_tier import MiB, files, key, payload

tier = test_disk_tier.tier  # the same fixture: a 256 MiB tier, 2 I/O threads, 1 MiB pieces


def _in_thread(fn, timeout: float = 20.0):
    """``fn()`` on a daemon thread; its result, or fail if it blocks (a FIFO opened for reading)."""
    res: dict = {}

    def run():
        try:
            res["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - re-raised below
            res["error"] = e

    th = threading.Thread(target=run, daemon=True)
    th.start()
    th.join(timeout)
    assert not th.is_alive(), f"blocked for {timeout} s"
    if "error" in res:
        raise res["error"]
    return res["value"]


def _unblock_fifo_reader(path: str) -> None:
    """Release a reader blocked opening the FIFO ``path`` (the old code's hang), so it can exit."""
    try:
        os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
    except OSError:
        pass


ODDITIES = ["directory", "symlink_out_of_cache", "fifo", "char_device"]


@pytest.mark.parametrize("oddity", ODDITIES)
def test_non_regular_file_at_record_path_is_miss_left_in_place(tmp_path, oddity):
    """A directory, a symlink (to a valid record outside the cache directory), a FIFO or a device
    node at a record path: get_into misses (no OSError, no hang, the link is not followed), drops
    the index entry, counts ``not_regular`` and leaves the path alone; a restart skips it the same
    way. Old code: the directory raised OSError(EINVAL), the symlink was read through (a hit from
    outside the cache), the FIFO blocked get_into, the device node was read and then deleted."""
    root = str(tmp_path / "d")
    tier = DiskTier([root], 64 * MiB, io_threads=2, piece_bytes=1 * MiB)
    n = 10000
    assert tier.put(key(1), payload(1, n))
    (f,) = files(root)
    outside = str(tmp_path / "outside.lmt")
    os.rename(f, outside)  # a valid record of key(1), outside the cache directory
    try:
        if oddity == "directory":
            os.mkdir(f)
            open(os.path.join(f, "keep"), "w").write("not the cache's")
        elif oddity == "symlink_out_of_cache":
            os.symlink(outside, f)
        elif oddity == "fifo":
            os.mkfifo(f, 0o600)
        else:
            try:
                os.mknod(f, 0o600 | stat.S_IFCHR, os.makedev(1, 5))  # like /dev/zero
            except PermissionError:
                pytest.skip("mknod not permitted here")
        out = bytearray(n)
        assert _in_thread(lambda: tier.get_into(key(1), out)) is None
        assert not tier.contains(key(1))
        assert tier.usage().used_bytes == 0 and tier.usage().num_chunks == 0
        assert tier.counters["not_regular"] == 1 and tier.counters["misses"] == 1
        assert os.path.lexists(f)  # not ours: left in place
        assert open(outside, "rb").read(4) == rec.MAGIC  # the link's target untouched
        if oddity == "directory":
            assert os.listdir(f) == ["keep"]
        # A restart skips it: not indexed, not followed, not opened, not removed.
        t2 = _in_thread(lambda: DiskTier([root], 64 * MiB))
        assert t2.usage().num_chunks == 0 and t2.counters["not_regular"] == 1
        assert os.path.lexists(f)
        t2.close()
        # A later put of the key replaces a link, FIFO or node (rename replaces the name, not the
        # target); a directory stays and the put fails.
        if oddity == "directory":
            assert not tier.put(key(1), payload(1, n)) and not tier.contains(key(1))
        else:
            assert tier.put(key(1), payload(1, n))
            assert tier.get_into(key(1), out) == n and bytes(out) == payload(1, n)
            assert stat.S_ISREG(os.lstat(f).st_mode)
    finally:
        if oddity == "fifo":
            _unblock_fifo_reader(f)
        tier.close()


def test_permission_denied_is_miss_left_in_place(tier, monkeypatch):
    """``EACCES`` opening a record (injected: the tests run as root, which bypasses file modes) is a
    miss that drops the entry and leaves the file; old code raised PermissionError from get_into."""
    n = 10000
    assert tier.put(key(1), payload(1, n))
    (f,) = files(tier.paths[0])
    real_open = os.open

    def deny(path, flags, *args, **kwargs):
        if os.fspath(path).endswith(".lmt") and not flags & (os.O_WRONLY | os.O_RDWR):
            raise PermissionError(errno.EACCES, "Permission denied", path)
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", deny)
    assert tier.get_into(key(1), bytearray(n)) is None
    monkeypatch.undo()
    assert not tier.contains(key(1)) and tier.usage().used_bytes == 0
    assert tier.counters["get_errors"] == 1
    assert files(tier.paths[0]) == [f]  # not judged ours: left in place


@pytest.mark.parametrize("where", ["header", "payload"])
@pytest.mark.parametrize("n", [10000, 3 * MiB + 5])  # read by the calling thread / in pieces
def test_eio_is_miss_and_record_removed(tier, monkeypatch, where, n):
    """``EIO`` reading a record (injected into the tier's pread) is a miss: the entry is dropped and
    the unreadable file deleted. Old code: a miss that kept the entry (every later lookup claimed
    the chunk and every load failed again)."""
    assert tier.put(key(1), payload(1, n))
    real = disk_io.pread_into

    def eio(fd, mv, off):
        if (off == 0) == (where == "header"):
            raise OSError(errno.EIO, "Input/output error")
        return real(fd, mv, off)

    monkeypatch.setattr(disk_io, "pread_into", eio)
    assert tier.get_into(key(1), AlignedBuffer(n).mv) is None
    monkeypatch.undo()
    assert not tier.contains(key(1)) and tier.usage().used_bytes == 0
    assert tier.counters["get_errors"] == 1
    assert files(tier.paths[0]) == []
    assert tier.put(key(1), payload(1, n))  # stored again
    out = AlignedBuffer(n)
    assert tier.get_into(key(1), out.mv) == n and bytes(out.mv[:n]) == payload(1, n)


@pytest.mark.parametrize("when", ["before_header", "before_payload"])
@pytest.mark.parametrize("to", [0, 4096 + 3000])
@pytest.mark.parametrize("n", [10000, 3 * MiB + 5])
def test_file_shrinking_during_read_is_miss_and_removed(tier, monkeypatch, when, to, n):
    """The record is truncated after it was opened (before its header or its payload is read): a
    miss, the entry dropped and the file deleted, never a partial hit."""
    assert tier.put(key(1), payload(1, n))
    (f,) = files(tier.paths[0])
    real = disk_io.pread_into
    done = []

    def shrink(fd, mv, off):
        if not done and (off == 0) == (when == "before_header"):
            done.append(off)
            os.truncate(f, to)
        return real(fd, mv, off)

    monkeypatch.setattr(disk_io, "pread_into", shrink)
    out = AlignedBuffer(n)
    assert tier.get_into(key(1), out.mv) is None
    monkeypatch.undo()
    assert done
    assert not tier.contains(key(1)) and tier.usage().used_bytes == 0
    assert tier.counters["corrupt"] == 1
    assert files(tier.paths[0]) == []
