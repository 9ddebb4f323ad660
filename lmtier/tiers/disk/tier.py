"""Local-disk tier (tier 2): one self-describing record file per chunk, O_DIRECT I/O.

On-disk layout under each root path::

    <root>/<kk>/<key hex>.lmt          kk = first key byte in hex (256 shard directories)
    <root>/<kk>/.<key hex>.<pid>.<token>.<n>.tmp   a record being written (never visible to lookups;
                                           token: random per tier instance, lmtier.tiers.disk.tmpfiles)

A record file is the 4 KiB header block of :mod:`lmtier.record` (``payload_offset = 4096``), the
payload, and zero padding up to a multiple of 4 KiB, so every read and write is 4 KiB aligned and
can use ``O_DIRECT`` (no page-cache pollution, device bandwidth from a few threads). Directories
are created 0700 and files 0600 (a KV cache leaks prompts).

Durability and visibility: ``put`` writes a temporary file, ``fdatasync``s it (``sync="data"``, the
default), then ``rename``s it into place and only then adds the key to the index, so a chunk is
visible only once every byte is on the device; a crash leaves at most a ``.tmp`` file, which the
next start removes (only those of dead writers: another tier instance on the same directory, in this
process or another, keeps its in-flight files; :mod:`lmtier.tiers.disk.tmpfiles`). The directory
itself is not fsync'd: after a power loss a renamed record may be absent (a miss) but never
incomplete. ``sync="none"`` skips ``fdatasync`` (faster on some devices; a crash can then leave a
complete-looking file whose data blocks were never written — the payload checksum turns that into a
miss).

Index: an in-memory LRU (by bytes on disk) rebuilt at startup by scanning the shard directories
and validating each header (payload checksums are verified lazily, on read), ordered by the
files' access/modification times. ``get_into`` verifies the payload checksum; any mismatch,
truncation (also while it is read) or read error (``EIO``) is a miss and the file is deleted (only
the inode that was read). Anything else at a record path is a miss that drops the index entry and
leaves the path alone, since the tier never created it: a directory, a symbolic link (never
followed), a FIFO or device node (never opened: ``lstat``, then ``O_NOFOLLOW | O_NONBLOCK`` and
``fstat``; :func:`lmtier.tiers.disk.io.open_record`), or a file that cannot be opened (``EACCES``).
Startup skips such paths the same way. Counters: ``corrupt``, ``get_errors`` (read/open errors),
``not_regular`` (non-regular files at record paths).

Module layout: this file (the tier: index, eviction, visibility), :mod:`lmtier.tiers.disk.records`
(one record file written / read and verified: pieces, CUDA buffers), :mod:`lmtier.tiers.disk.io`
(POSIX helpers, background priority), :mod:`lmtier.tiers.disk.gds` (kvikio loads),
:mod:`lmtier.tiers.disk.tmpfiles` (temporary file names, stale ones).
"""

from __future__ import annotations

import collections
import errno
import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from lmtier import record as rec
from lmtier.affinity import unpin_thread
from lmtier.tiers.base import KEY_BYTES, Eviction, Tier, TierUsage
from lmtier.tiers.buffers import PAGE_BYTES, BouncePool, host_view, round_up
from lmtier.tiers.device import PinnedBounce, is_cuda_tensor
from lmtier.tiers.disk import io as dio
from lmtier.tiers.disk.gds import KvikioLoader
from lmtier.tiers.disk.records import DIR_MODE, FILE_MODE, SUFFIX, RecordFiles
from lmtier.tiers.disk.tmpfiles import TMP_SUFFIX, TmpNames, is_stale

__all__ = ["DiskTier", "SUFFIX", "TMP_SUFFIX", "DIR_MODE", "FILE_MODE"]

log = logging.getLogger("lmtier.tiers.disk")


class _Entry:
    __slots__ = ("path", "nbytes")

    def __init__(self, path: str, nbytes: int) -> None:
        self.path = path
        self.nbytes = nbytes


class DiskTier(RecordFiles, Tier):
    """Chunks as record files on one or more local directories, LRU-evicted by bytes.

    Args:
        paths: root directories (created 0700 if missing). Chunks are spread over them by key.
        capacity_bytes: the most bytes of record files (header block + payload + padding) kept
            across all paths; the least recently used chunks are deleted to make room.
        io_threads: threads moving the pieces of one large record (and concurrent records).
        piece_bytes: size of one I/O piece (multiple of 4 KiB); records up to this size are
            moved by the calling thread alone.
        use_odirect: open record files with ``O_DIRECT`` where the filesystem supports it
            (checked per path at startup; falls back to buffered I/O with a log line).
        use_kvikio: ``"auto"`` (kvikio for loads into CUDA tensors if it imports, works and has
            real GPUDirect Storage, i.e. not compat mode), ``"never"``, or ``"always"`` (kvikio
            even in compat mode; raise ``RuntimeError`` at the first CUDA load if it is unusable).
        sync: ``"data"`` (``fdatasync`` each record before it becomes visible) or ``"none"``.
        max_payload_bytes: larger payloads are refused by ``put`` and treated as corruption on read.
        namespace: 16-byte namespace digest written into each header (informational).

    Evictions: the keys the LRU dropped to make room reach the eviction listeners
    (:meth:`Tier.add_eviction_listener`, one :class:`~lmtier.tiers.base.Eviction` per batch,
    ``payloads=None``) after their files are unlinked, outside the tier's lock, in the thread that
    needed the room (the tier manager publishes them as ``disk_evicted`` index events, so a
    scheduler in another process stops claiming them). So does a key whose record a read found
    missing, corrupt or unreadable (its index entry dropped, the file deleted or left as the read
    describes), one :class:`~lmtier.tiers.base.Eviction` per key, in the reading thread: before, a
    scheduler kept claiming such a chunk, every load of it failed, and the recomputed chunk was never
    stored again. Exceptions are logged, counted (``counters["evict_listener_errors"]``) and ignored.
    ``delete`` and ``forget`` are not reported.

    Raises:
        ValueError: malformed arguments. OSError: a root cannot be created.
    """

    name = "disk"

    def __init__(
        self,
        paths: list[str] | str,
        capacity_bytes: int,
        *,
        io_threads: int = 4,
        piece_bytes: int = 8 << 20,
        use_odirect: bool = True,
        use_kvikio: str = "auto",
        sync: str = "data",
        max_payload_bytes: int = rec.DEFAULT_MAX_PAYLOAD_BYTES,
        namespace: bytes = bytes(16),
    ) -> None:
        super().__init__()
        if isinstance(paths, (str, os.PathLike)):
            paths = [paths]
        if not paths:
            raise ValueError("DiskTier: at least one path is required")
        if not isinstance(capacity_bytes, int) or capacity_bytes <= 0:
            raise ValueError(f"DiskTier: capacity_bytes must be a positive int, got {capacity_bytes!r}")
        if io_threads < 1:
            raise ValueError(f"DiskTier: io_threads must be >= 1, got {io_threads}")
        if piece_bytes <= 0 or piece_bytes % PAGE_BYTES:
            raise ValueError(f"DiskTier: piece_bytes must be a positive multiple of 4096, got {piece_bytes}")
        if sync not in ("data", "none"):
            raise ValueError(f"DiskTier: sync must be 'data' or 'none', got {sync!r}")
        self.paths = [os.path.abspath(os.fspath(p)) for p in paths]
        self.capacity_bytes = capacity_bytes
        self.piece_bytes = piece_bytes
        self.sync = sync
        self.max_payload_bytes = max_payload_bytes
        self._meta = rec.RecordMeta(namespace=bytes(namespace))
        self._gds = KvikioLoader(use_kvikio)
        self._pool = ThreadPoolExecutor(
            max_workers=io_threads, thread_name_prefix="lmtier-disk", initializer=unpin_thread
        )
        # Writes (always background work: write-through, write-back) move their pieces on their own
        # threads at background CPU/I-O priority, so a load never queues behind a store's pieces.
        self._wpool = ThreadPoolExecutor(
            max_workers=io_threads, thread_name_prefix="lmtier-disk-w", initializer=dio.background_priority
        )
        self._io_threads = io_threads
        self._bounce = BouncePool(max_cached=2)  # payload-sized bounce buffers
        self._small = BouncePool(max_cached=2 * io_threads + 2)  # header/tail blocks
        self._device = PinnedBounce(max_cached=2)  # CUDA payloads / destinations
        self._lock = threading.Lock()
        self._index: collections.OrderedDict[bytes, _Entry] = collections.OrderedDict()
        self._used = 0
        self._reserved = 0
        self._tmp = TmpNames()
        self._direct: dict[str, bool] = {}
        self.counters = collections.Counter()
        for root in self.paths:
            os.makedirs(root, mode=DIR_MODE, exist_ok=True)
            self._direct[root] = use_odirect and self._probe_odirect(root, self._tmp.probe("odirect-probe"))
        self._rebuild()

    # ---- public API ------------------------------------------------------------------------

    def contains(self, key: bytes) -> bool:
        """True if ``key`` is in the index (a complete record was written or found at startup)."""
        with self._lock:
            return bytes(key) in self._index

    def usage(self) -> TierUsage:
        with self._lock:
            return TierUsage(self.capacity_bytes, self._used + self._reserved, len(self._index))

    def forget(self, key: bytes) -> bool:
        """Drop ``key`` from this instance's index without touching its file: another process's
        view of the same directory evicted it (a scheduler's read-only view of the worker's disk
        tier). Returns whether the key was indexed."""
        return self._unindex(bytes(key)) is not None

    def _unindex(self, key: bytes) -> _Entry | None:
        """Remove ``key`` from the index (and its bytes from the usage); returns its entry."""
        with self._lock:
            entry = self._index.pop(key, None)
            if entry is not None:
                self._used -= entry.nbytes
        return entry

    def delete(self, key: bytes) -> bool:
        key = bytes(key)
        entry = self._unindex(key)
        path = entry.path if entry is not None else self._path(key)
        try:
            os.unlink(path)
            return True
        except FileNotFoundError:
            return entry is not None
        except OSError as e:
            log.warning("delete %s failed: %s", path, e)
            return entry is not None

    def put(self, key: bytes, payload) -> bool:
        """Store ``payload`` under ``key`` durably; visible only once complete.

        Args:
            key: 32-byte chunk key.
            payload: contiguous bytes (bytes/memoryview/ndarray/CPU or CUDA torch tensor).

        Returns:
            True on success; False if the record cannot fit (larger than the capacity or the
            ``max_payload_bytes`` limit), on ENOSPC/EACCES/EROFS or any other I/O error (the
            temporary file is removed and nothing becomes visible).
        """
        key = bytes(key)
        if len(key) != KEY_BYTES:
            raise ValueError(f"DiskTier.put: key must be {KEY_BYTES} bytes, got {len(key)}")
        with self._device.host_payload(payload) as mv:
            return self._put_host(key, mv)

    def get_into(self, key: bytes, out) -> int | None:
        """Read the chunk into ``out`` and verify it.

        Args:
            key: 32-byte chunk key.
            out: writable contiguous buffer of >= payload bytes (host buffer or CUDA tensor).
                Host buffers whose address is 4 KiB aligned are read into directly; others via a
                pooled aligned bounce buffer.

        Returns:
            The payload length in bytes, or None on a miss / too-small ``out`` / any failure.
            Missing files drop the index entry; corrupted, truncated or unreadable (``EIO``) files
            are deleted (where they cannot be, as on a read-only file system, left in place out of
            the index); a directory, symlink, FIFO, device node or a file that cannot be opened
            (``EACCES``) drops the index entry and is left in place. Never raises ``OSError``.
        """
        key = bytes(key)
        with self._lock:
            entry = self._index.get(key)
            if entry is not None:
                self._index.move_to_end(key)
        if entry is None:
            self.counters["misses"] += 1
            return None
        try:
            if is_cuda_tensor(out):
                n = self._get_cuda(key, entry.path, out)
            else:
                n = self._get_host(key, entry.path, host_view(out, writable=True))
        except FileNotFoundError:
            self._drop(key, entry)
            n = None
        except dio.NotRegularFile as e:
            log.warning("disk record path %s holds a %s; a miss, left in place", entry.path, e.kind)
            self.counters["not_regular"] += 1
            self._drop(key, entry)
            n = None
        except OSError as e:  # the open failed (EACCES, EIO, ...): the path is not ours to judge
            log.warning("cannot open disk record %s: %s; a miss, left in place", entry.path, e)
            self.counters["get_errors"] += 1
            self._drop(key, entry)
            n = None
        if n is None:
            self.counters["misses"] += 1
            with self._lock:
                gone = key not in self._index  # dropped or discarded by this read (a newer put re-indexes it)
            if gone:
                self._report_evicted((key,))
        else:
            self.counters["hits"] += 1
        return n

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        self._wpool.shutdown(wait=True)
        self._bounce.close()
        self._small.close()
        self._device.close()
        self._tmp.release()

    def keys(self) -> list[bytes]:
        """Indexed keys, least recently used first."""
        with self._lock:
            return list(self._index)

    # ---- paths -----------------------------------------------------------------------------

    def _root(self, key: bytes) -> str:
        return self.paths[int.from_bytes(key[:8], "little") % len(self.paths)]

    def _path(self, key: bytes) -> str:
        h = key.hex()
        return os.path.join(self._root(key), h[:2], h + SUFFIX)

    def _tmp_path(self, key: bytes) -> str:
        h = key.hex()
        return os.path.join(self._root(key), h[:2], self._tmp.record(h))

    @staticmethod
    def _probe_odirect(root: str, name: str) -> bool:
        probe = os.path.join(root, name)
        try:
            fd = os.open(probe, os.O_CREAT | os.O_WRONLY | os.O_DIRECT, FILE_MODE)
        except OSError as e:
            if e.errno == errno.EINVAL:
                log.info("O_DIRECT not supported under %s; using buffered I/O", root)
                return False
            log.warning("cannot probe O_DIRECT under %s: %s", root, e)
            return False
        os.close(fd)
        try:
            os.unlink(probe)
        except OSError:
            pass
        return True

    def _open_flags(self, root: str) -> int:
        return os.O_DIRECT if self._direct.get(root) else 0

    # ---- index -----------------------------------------------------------------------------

    def _rebuild(self) -> None:
        """Scan every root, validate headers, drop temp/invalid files, order by access time."""
        found = []
        t0 = time.perf_counter()
        for root in self.paths:
            for shard in dio.listdir(root):
                d = os.path.join(root, shard)
                if len(shard) != 2 or not os.path.isdir(d):
                    continue
                for name in dio.listdir(d):
                    path = os.path.join(d, name)
                    if name.endswith(TMP_SUFFIX):
                        if is_stale(name):
                            dio.unlink_quiet(path)
                        continue
                    if not name.endswith(SUFFIX):
                        continue
                    item = self._validate_file(path, name)
                    if item is not None:
                        found.append(item)
        found.sort(key=lambda x: x[0])  # oldest access first
        with self._lock:
            for _, key, path, nbytes in found:
                self._index[key] = _Entry(path, nbytes)
                self._used += nbytes
            victims = self._evict_locked(0)
        self._unlink_all(victims)
        if victims:  # a restart with a smaller capacity (max_local_disk_size) deletes stored chunks
            log.warning(
                "disk tier: %d chunks (%d bytes) under %s exceed the capacity of %d bytes: removed the %d "
                "least recently used (max_local_disk_size is smaller than what was stored)",
                len(found),
                sum(item[3] for item in found),
                self.paths,
                self.capacity_bytes,
                len(victims),
            )
        log.info(
            "disk tier: %d chunks, %d bytes found under %s in %.3f s",
            len(self._index),
            self._used,
            self.paths,
            time.perf_counter() - t0,
        )

    def _validate_file(self, path: str, name: str):
        try:
            key = bytes.fromhex(name[: -len(SUFFIX)])
        except ValueError:
            return None
        if len(key) != KEY_BYTES:
            return None
        try:
            fd = dio.open_record(path)
        except FileNotFoundError:
            return None
        except dio.NotRegularFile as e:
            log.warning("skipping %s at record path %s (left in place)", e.kind, path)
            self.counters["not_regular"] += 1
            return None
        except OSError as e:
            log.warning("skipping record %s: cannot open it: %s (left in place)", path, e)
            self.counters["get_errors"] += 1
            return None
        try:
            st = os.fstat(fd)
            head = os.pread(fd, rec.HEADER_BYTES, 0)
            hdr = rec.decode_header(head, expected_key=key, max_payload_bytes=self.max_payload_bytes)
            if hdr.payload_offset != rec.DISK_PAYLOAD_OFFSET or st.st_size < hdr.record_bytes:
                raise rec.RecordError(f"file size {st.st_size} < record size {hdr.record_bytes} (truncated)")
        except (OSError, rec.RecordError) as e:
            log.warning("removing invalid record %s: %s", path, e)
            dio.unlink_if_same(path, fd)
            self.counters["corrupt"] += 1
            return None
        finally:
            os.close(fd)
        return (max(st.st_atime_ns, st.st_mtime_ns), key, path, round_up(st.st_size))

    def _evict_locked(self, need: int) -> list[tuple[bytes, str]]:
        """Pop LRU entries until ``need`` more bytes fit; returns ``(key, path)`` of each, to unlink
        (and report) outside the lock with :meth:`_unlink_all`."""
        victims = []
        while self._index and self._used + self._reserved + need > self.capacity_bytes:
            key, entry = self._index.popitem(last=False)
            self._used -= entry.nbytes
            victims.append((key, entry.path))
            self.counters["evictions"] += 1
        return victims

    def _unlink_all(self, victims: list[tuple[bytes, str]]) -> None:
        for _, p in victims:
            dio.unlink_quiet(p)
        if victims:
            self._report_evicted(tuple(k for k, _ in victims))

    def _report_evicted(self, keys: tuple[bytes, ...]) -> None:
        """Tell the eviction listeners that ``keys`` left the tier (the LRU's victims, or a key whose
        record a read found unusable); failing listeners are counted."""
        failed = self._notify_evicted(Eviction(self.name, keys))
        if failed:
            self.counters["evict_listener_errors"] += failed

    def _drop(self, key: bytes, entry: _Entry) -> None:
        with self._lock:
            if self._index.get(key) is entry:
                del self._index[key]
                self._used -= entry.nbytes

    def _discard_corrupt(self, key: bytes, entry_path: str, fd: int, why: str, *, counter: str = "corrupt") -> None:
        """Remove a corrupt or unreadable record — but only the inode we read (a fresh put may have
        replaced it) — and its index entry; counted in ``counters[counter]``. A file that cannot be
        removed (a read-only file system) stays, out of the index: later lookups miss without
        reading it again, until a restart's scan finds it."""
        log.warning("disk record %s is %s; deleting it", entry_path, why)
        self.counters[counter] += 1
        gone = dio.unlink_if_same(entry_path, fd)
        if isinstance(gone, OSError):
            log.warning(
                "disk record %s could not be deleted (%s); left in place, dropped from the index", entry_path, gone
            )
        if gone is not False:
            with self._lock:
                e = self._index.get(key)
                # after an unlink, a file at the path again is a fresh put's (renamed in, indexed or about
                # to be): its entry stays
                fresh = gone is True and os.path.lexists(entry_path)
                if e is not None and e.path == entry_path and not fresh:
                    del self._index[key]
                    self._used -= e.nbytes

    # ---- writes ----------------------------------------------------------------------------

    def _put_host(self, key: bytes, mv: memoryview) -> bool:
        n = mv.nbytes
        if n > self.max_payload_bytes:
            log.warning("put: payload of %d bytes exceeds max_payload_bytes %d", n, self.max_payload_bytes)
            return False
        file_bytes = rec.DISK_PAYLOAD_OFFSET + round_up(n)
        if file_bytes > self.capacity_bytes:
            return False
        with self._lock:
            victims = self._evict_locked(file_bytes)
            self._reserved += file_bytes
        self._unlink_all(victims)
        path = self._path(key)
        tmp = self._tmp_path(key)
        ok = False
        try:
            self._write_record(key, mv, tmp, path)
            ok = True
        except OSError as e:
            lvl = logging.INFO if e.errno in (errno.ENOSPC, errno.EDQUOT) else logging.WARNING
            log.log(lvl, "put %s failed: %s", path, e)
            self.counters["put_errors"] += 1
            dio.unlink_quiet(tmp)
        except BaseException:
            dio.unlink_quiet(tmp)
            raise
        finally:
            with self._lock:
                self._reserved -= file_bytes
                if ok:
                    old = self._index.pop(key, None)
                    if old is not None:
                        self._used -= old.nbytes
                    self._index[key] = _Entry(path, file_bytes)
                    self._used += file_bytes
                    victims = self._evict_locked(0)
                else:
                    victims = []
            self._unlink_all(victims)
        return ok
