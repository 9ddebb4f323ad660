"""Record files of the disk tier: one record written or read and verified, its pieces in flight on
thread pools while the calling thread checksums (and copies) them.

Large records are split into pieces of ``piece_bytes`` moved by ``io_threads`` threads
(``os.preadv``/``os.pwrite`` release the GIL), which is what reaches device bandwidth.

GPU buffers (torch CUDA tensors) are accepted as ``payload``/``out``: stores go through the device
adapter (:class:`lmtier.tiers.device.PinnedBounce`: a pinned bounce buffer; the checksum needs the
bytes on the host anyway); loads use kvikio (``kvikio.CuFile.pread``, GPUDirect Storage where the
system has it; :mod:`lmtier.tiers.disk.gds`) when ``use_kvikio`` allows and it imports and works,
else the device adapter (read into a pinned bounce buffer, one H2D copy). kvikio is imported
lazily, only for CUDA buffers (it needs libcuda). In ``"auto"`` mode it is used only with real
GPUDirect Storage: in compat mode it bounces through host memory itself, so O_DIRECT into a pinned
buffer plus one H2D copy moves fewer bytes (and the checksum needs the host copy).

:class:`RecordFiles` is a mixin of :class:`~lmtier.tiers.disk.tier.DiskTier`, which owns the state
it uses.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import xxhash

from lmtier import record as rec
from lmtier.tiers.buffers import PAGE_BYTES, BouncePool, address_of, copy_into, round_up
from lmtier.tiers.device import PinnedBounce, flat_u8
from lmtier.tiers.disk import io as dio
from lmtier.tiers.disk.gds import KvikioLoader

__all__ = ["RecordFiles", "SUFFIX", "DIR_MODE", "FILE_MODE"]

log = logging.getLogger("lmtier.tiers.disk")

SUFFIX = ".lmt"
DIR_MODE = 0o700
FILE_MODE = 0o600


class RecordFiles:
    """Record-file I/O of :class:`~lmtier.tiers.disk.tier.DiskTier` (a mixin: it uses the tier's
    ``_pool`` (reads) and ``_wpool`` (writes), its buffers ``_small``, ``_bounce`` and ``_device``,
    ``_gds``, ``_meta``, ``sync``, ``piece_bytes``, ``_io_threads``, ``max_payload_bytes``,
    ``_root``, ``_open_flags`` and ``_discard_corrupt``)."""

    sync: str
    piece_bytes: int
    max_payload_bytes: int
    _io_threads: int
    _pool: ThreadPoolExecutor
    _wpool: ThreadPoolExecutor
    _small: BouncePool
    _bounce: BouncePool
    _device: PinnedBounce
    _gds: KvikioLoader
    _meta: rec.RecordMeta
    _root: Callable[[bytes], str]
    _open_flags: Callable[[str], int]
    _discard_corrupt: Callable[..., None]

    def _write_record(self, key: bytes, mv: memoryview, tmp: str, path: str) -> None:
        """Write the record to ``tmp`` (payload pieces in flight on the pool while this thread
        checksums them — or copies + checksums them, for an unaligned source — then the header
        block last), ``fdatasync``, rename to ``path``."""
        n = mv.nbytes
        os.makedirs(os.path.dirname(tmp), mode=DIR_MODE, exist_ok=True)
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | self._open_flags(self._root(key))
        fd = os.open(tmp, flags, FILE_MODE)
        small = self._small.acquire(PAGE_BYTES * 2)
        big = None
        futs = []
        base = rec.DISK_PAYLOAD_OFFSET
        try:
            hasher = xxhash.xxh3_64()
            body = n // PAGE_BYTES * PAGE_BYTES  # whole pages of payload
            tail = n - body
            if address_of(mv) % PAGE_BYTES == 0:
                # Aligned source: whole pages straight from the caller's buffer.
                pieces = self._pieces(mv[:body], base)
                futs = [self._submit(len(pieces), dio.pwrite_all, fd, v, off, pool=self._wpool) for v, off in pieces]
                for v, _ in pieces:
                    hasher.update(v)
                if tail:
                    t = small.mv[PAGE_BYTES : 2 * PAGE_BYTES]
                    t[:tail] = mv[body:]
                    t[tail:] = bytes(PAGE_BYTES - tail)
                    hasher.update(t[:tail])
                    futs.append(self._submit(2, dio.pwrite_all, fd, t, base + body, pool=self._wpool))
            else:
                # Unaligned source: copy piece by piece into an aligned bounce buffer, each
                # piece's write starting as soon as it is copied.
                padded = round_up(n)
                big = self._bounce.acquire(padded)
                for v, off in self._pieces(big.mv[:padded], base):
                    o = off - base
                    k = max(0, min(v.nbytes, n - o))
                    copy_into(v[:k], mv[o : o + k])
                    if k < v.nbytes:
                        v[k:] = bytes(v.nbytes - k)
                    hasher.update(v[:k])
                    futs.append(self._submit(2, dio.pwrite_all, fd, v, off, pool=self._wpool))
            header = rec.encode_header(key, n, hasher.intdigest(), payload_offset=base, meta=self._meta)
            h = small.mv[:PAGE_BYTES]
            h[:] = bytes(PAGE_BYTES)
            h[: rec.HEADER_BYTES] = header
            dio.pwrite_all(fd, h, 0)
            dio.wait_all(futs)
            futs = []
            if self.sync == "data":
                os.fdatasync(fd)
        finally:
            try:
                dio.wait_all(futs)  # they use fd and the buffers; errors already being raised
            except BaseException:
                pass
            os.close(fd)
            self._small.release(small)
            if big is not None:
                self._bounce.release(big)
        os.rename(tmp, path)

    def _submit(self, njobs: int, fn, *args, pool: ThreadPoolExecutor | None = None) -> Future:
        """Run ``fn`` on ``pool`` (default: the read pool), or inline when it is the only job (no hand-off)."""
        if njobs > 1:
            return (pool or self._pool).submit(fn, *args)
        f: Future = Future()
        try:
            f.set_result(fn(*args))
        except BaseException as e:  # noqa: BLE001 - delivered through the future
            f.set_exception(e)
        return f

    def _pieces(self, mv: memoryview, file_offset: int) -> list:
        """Split ``mv`` into (view, file offset) jobs of at most ``piece_bytes``."""
        n = mv.nbytes
        if n == 0:
            return []
        # Spread over the threads even when the record is only a few pieces long; below 1 MiB
        # a piece is not worth a thread hand-off.
        per = max(min(1 << 20, self.piece_bytes), min(self.piece_bytes, round_up(-(-n // self._io_threads))))
        return [(mv[o : min(o + per, n)], file_offset + o) for o in range(0, n, per)]

    # ---- reads -----------------------------------------------------------------------------

    def _read_header(self, key: bytes, path: str, fd: int, hb: memoryview):
        """Read + decode the header block; return (header, file size) or None if corrupt."""
        st = os.fstat(fd)
        got = dio.pread_into(fd, hb[:PAGE_BYTES], 0)
        try:
            hdr = rec.decode_header(hb[:got], expected_key=key, max_payload_bytes=self.max_payload_bytes)
            if hdr.payload_offset != rec.DISK_PAYLOAD_OFFSET:
                raise rec.RecordError(f"payload offset {hdr.payload_offset} != {rec.DISK_PAYLOAD_OFFSET}")
            if st.st_size < hdr.payload_offset + round_up(hdr.payload_bytes):
                raise rec.RecordError(
                    f"file size {st.st_size} < {hdr.payload_offset + round_up(hdr.payload_bytes)} (truncated)"
                )
        except rec.RecordError as e:
            self._discard_corrupt(key, path, fd, f"corrupt ({e})")
            return None
        return hdr

    def _get_host(self, key: bytes, path: str, out: memoryview) -> int | None:
        """Read header + payload into the host buffer ``out``; verify; None if corrupt/short."""
        root = os.path.dirname(os.path.dirname(path))
        fd = dio.open_record(path, self._open_flags(root))
        hbuf = self._small.acquire(PAGE_BYTES * 2)
        big = None
        try:
            hdr = self._read_header(key, path, fd, hbuf.mv)
            if hdr is None:
                return None
            n = hdr.payload_bytes
            if out.nbytes < n:
                log.warning("get_into: out has %d bytes < payload %d", out.nbytes, n)
                return None
            base = rec.DISK_PAYLOAD_OFFSET
            # segments: (aligned read target, file offset, payload bytes it holds, copy target)
            if address_of(out) % PAGE_BYTES == 0:
                body = n // PAGE_BYTES * PAGE_BYTES
                segs = [(v, off, v, None) for v, off in self._pieces(out[:body], base)]
                if n > body:
                    t = hbuf.mv[PAGE_BYTES : 2 * PAGE_BYTES]
                    segs.append((t, base + body, t[: n - body], out[body:n]))
            else:
                padded = round_up(n)
                big = self._bounce.acquire(padded)
                segs = []
                for v, off in self._pieces(big.mv[:padded], base):
                    o = off - base
                    k = max(0, min(v.nbytes, n - o))
                    segs.append((v, off, v[:k], out[o : o + k]))
            # All pieces in flight on the pool; this thread checksums (and copies) them in order
            # as they land, so verification overlaps the I/O.
            futs = [self._submit(len(segs), dio.pread_into, fd, v, off) for v, off, _, _ in segs]
            hasher = xxhash.xxh3_64()
            short = None
            try:
                for f, (v, _, data, dst) in zip(futs, segs):
                    got = f.result()
                    if got != v.nbytes:
                        short = short or got
                    if short is None:
                        hasher.update(data)
                        if dst is not None:
                            copy_into(dst, data)
            finally:
                dio.wait_all(futs)
            if short is not None:
                self._discard_corrupt(key, path, fd, "corrupt (short read of the payload: truncated)")
                return None
            if hasher.intdigest() != hdr.payload_xxh3:
                self._discard_corrupt(
                    key, path, fd, f"corrupt (payload checksum mismatch, stored {hdr.payload_xxh3:#018x})"
                )
                return None
            try:
                os.utime(fd)  # recency for the LRU order rebuilt at the next start
            except OSError:
                pass
            return n
        except OSError as e:  # EIO, ...: this inode cannot be read back
            self._discard_corrupt(key, path, fd, f"unreadable ({e})", counter="get_errors")
            return None
        finally:
            os.close(fd)
            self._small.release(hbuf)
            if big is not None:
                self._bounce.release(big)

    # ---- CUDA buffers ----------------------------------------------------------------------

    def _get_cuda(self, key: bytes, path: str, out) -> int | None:
        """Load into a CUDA tensor: kvikio straight into device memory where
        :class:`~lmtier.tiers.disk.gds.KvikioLoader` says so, verified through a pinned host copy,
        else the device adapter (pinned bounce + H2D copy). Opening the record (and reading its
        header) fails as on the host path (get_into's miss); only kvikio's own failures disable it."""
        kvikio = self._gds.module()
        if kvikio is not None:
            out_u8 = flat_u8(out)  # (a non-contiguous out is the caller's error, not kvikio's)
            fd = dio.open_record(path)
            try:
                return self._get_cuda_kvikio(kvikio, key, path, fd, out_u8)
            except Exception as e:
                self._gds.disable(e)
            finally:
                os.close(fd)
        return self._device.get_into(out, lambda mv: self._get_host(key, path, mv))

    def _get_cuda_kvikio(self, kvikio, key: bytes, path: str, fd: int, out_u8) -> int | None:
        hbuf = self._small.acquire(PAGE_BYTES)
        try:
            try:
                hdr = self._read_header(key, path, fd, hbuf.mv)
            except OSError as e:  # our own pread (EIO, ...), not kvikio's
                self._discard_corrupt(key, path, fd, f"unreadable ({e})", counter="get_errors")
                return None
            if hdr is None:
                return None
            if out_u8.numel() < hdr.payload_bytes:
                return None
            try:
                # kvikio opens by name: through the descriptor's /proc link it reads the inode
                # validated above, never a symlink or FIFO put at the path since.
                return self._gds.read_payload(kvikio, f"/proc/self/fd/{fd}", hdr, out_u8, self._device)
            except rec.RecordError as e:
                self._discard_corrupt(key, path, fd, f"corrupt ({e})")
                return None
        finally:
            self._small.release(hbuf)
