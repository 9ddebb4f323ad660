"""POSIX I/O helpers of the disk tier: opening a record file safely (:func:`open_record`),
whole-buffer ``pread``/``pwrite``, GIL-free copies and quiet unlinks; re-exports
:func:`lmtier.affinity.background_priority` for the write threads."""

from __future__ import annotations

import errno
import os
import stat

from lmtier.affinity import background_priority
from lmtier.errors import LMTierError

__all__ = [
    "NotRegularFile",
    "background_priority",
    "listdir",
    "open_record",
    "pread_into",
    "pwrite_all",
    "unlink_if_same",
    "unlink_quiet",
    "wait_all",
]


class NotRegularFile(LMTierError, OSError):
    """A record path holds something other than a regular file: a directory, a symbolic link, a
    FIFO, a device node or a socket. ``kind`` names it. The disk tier never created it, so it is a
    miss that is left in place (never followed, read, or removed)."""

    def __init__(self, path: str, kind: str) -> None:
        super().__init__(errno.EINVAL, f"{kind}, not a regular file", path)
        self.kind = kind


_KINDS = (
    (stat.S_ISDIR, "directory"),
    (stat.S_ISLNK, "symbolic link"),
    (stat.S_ISFIFO, "FIFO"),
    (stat.S_ISCHR, "character device"),
    (stat.S_ISBLK, "block device"),
    (stat.S_ISSOCK, "socket"),
)


def _kind(mode: int) -> str:
    return next((name for test, name in _KINDS if test(mode)), f"file type {stat.S_IFMT(mode):#o}")


def open_record(path: str, flags: int = 0) -> int:
    """Open the record file ``path`` read-only without following a symbolic link and without ever
    blocking or reading a non-regular file; returns the file descriptor (the caller closes it).

    ``lstat`` first (a FIFO, device node, directory or symlink is never opened), then
    ``O_NOFOLLOW | O_NONBLOCK`` (the path may be replaced between the two: a symlink then fails
    with ``ELOOP``, a FIFO opens without waiting for a writer), then ``fstat`` of what was opened.

    Args:
        path: the record file.
        flags: extra ``os.open`` flags (``O_DIRECT``); ``O_RDONLY | O_CLOEXEC | O_NOFOLLOW |
            O_NONBLOCK`` are always added (``O_NONBLOCK`` does nothing on a regular file).

    Raises:
        FileNotFoundError: nothing at ``path``.
        NotRegularFile: a directory, symlink, FIFO, device node or socket at ``path``.
        OSError: any other failure to open (``EACCES``, ``EIO``, ...).
    """
    st = os.lstat(path)
    if not stat.S_ISREG(st.st_mode):
        raise NotRegularFile(path, _kind(st.st_mode))
    try:
        fd = os.open(path, flags | os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as e:
        if e.errno == errno.ELOOP:  # replaced by a symlink since the lstat
            raise NotRegularFile(path, "symbolic link") from e
        raise
    try:
        st = os.fstat(fd)
    except BaseException:
        os.close(fd)
        raise
    if not stat.S_ISREG(st.st_mode):  # replaced by something else since the lstat
        os.close(fd)
        raise NotRegularFile(path, _kind(st.st_mode))
    return fd


def listdir(d: str) -> list[str]:
    try:
        return os.listdir(d)
    except OSError:
        return []


def unlink_quiet(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def unlink_if_same(path: str, fd: int) -> bool | OSError:
    """Unlink ``path`` if it still names the inode open as ``fd`` (a fresh put may have replaced
    it; ``lstat``: a symlink put there since is not followed). Never raises.

    Returns:
        True: unlinked. False: ``path`` names another inode or none (replaced or gone), or either
        cannot be examined (``fstat`` / ``lstat`` failed). The
        ``OSError`` of the unlink when ``path`` still names that inode but cannot be removed (a
        read-only file system, ``EACCES``): the file stays."""
    try:
        st_fd = os.fstat(fd)
        st_path = os.lstat(path)
    except OSError:
        return False
    if (st_fd.st_ino, st_fd.st_dev) != (st_path.st_ino, st_path.st_dev):
        return False
    try:
        os.unlink(path)
    except FileNotFoundError:
        return False
    except OSError as e:
        return e
    return True


def wait_all(futs) -> None:
    """Wait for every future; re-raise the first error after all finished."""
    err = None
    for f in futs:
        try:
            f.result()
        except BaseException as e:  # noqa: BLE001
            err = err or e
    if err is not None:
        raise err


def pwrite_all(fd: int, mv: memoryview, offset: int) -> None:
    while mv.nbytes:
        k = os.pwrite(fd, mv, offset)
        if k <= 0:
            raise OSError(errno.EIO, "pwrite wrote 0 bytes")
        mv = mv[k:]
        offset += k


def pread_into(fd: int, mv: memoryview, offset: int) -> int:
    """Read up to ``mv.nbytes`` at ``offset``; returns the count (short only at end of file)."""
    total = 0
    while total < mv.nbytes:
        k = os.preadv(fd, [mv[total:]], offset + total)
        if k == 0:
            break
        total += k
    return total
