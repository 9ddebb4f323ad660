"""Static rANS tables calibrated automatically for a namespace lmtier ships none for (issue 19).

The package ships calibrated tables for SmolLM2-135M's geometry only
(:func:`lmtier.codec.calibrate.shipped_tables`); records of any other model used to carry
per-stream tables (about 10 % larger: 5.44x instead of 6.07x for ``default``, RESULTS §4.1b).
:class:`AutoTables` closes that gap: it counts the symbols of the first
:data:`CALIBRATION_CHUNKS` chunks a :class:`lmtier.tiers.codec.CodecTier` stores for the namespace
(the chunks are not kept: :class:`lmtier.codec.calibrate.Calibrator`), fits the tables, writes them
to a *table file* and from then on the tier codes with them. Records are tied to their tables by
the ``table_id`` of the record header, as for shipped tables: records written before calibration
carry per-stream tables (``NO_TABLE``) and stay decodable; a record coded with a set this process
does not hold is decoded with the set's file from the table directory (another process calibrated
it) or, without one, is a miss (never decoded with other tables). A set is used only once its file
is written (a set that cannot be written is dropped: per-stream tables), so every record's set has
a file unless the file was removed or damaged since.

Table directory: one file per (namespace, level, table set),
``<namespace id>-<level>-<table id as 8 hex digits>.lmtt``. A process that starts with a file for
its namespace and level there adopts it (the oldest one when several) instead of calibrating, so
processes sharing the directory (and the disk or remote tier) converge on one set; one that
calibrates checks the directory again before writing and adopts what another wrote meanwhile.

Table file format (version 1; little-endian; 64-byte header, then the arrays)::

    off size field
      0    4 magic        b"LMKT"
      4    2 version      TABLE_FILE_VERSION (1)
      6    2 header_bytes 64
      8    4 table_id     the set's id (lmtier.codec.calibrate.table_set_id)
     12    1 level_id
     13    1 has_qmax     1 for adaptive levels (a uint8 [L, 2] plane_qmax array follows)
     14    2 alphabet     A, columns of the symbol table array
     16    4 num_layers   L \
     20    4 num_heads    H  | geometry
     24    4 head_size    D /
     28    4 sym_rows     N, rows of the symbol table array
     32   16 namespace    the namespace id, ASCII, zero-padded
     48    8 payload_bytes
     56    8 checksum     xxh3-64 (seed 0) of bytes [0, 56) and the payload

    payload: sym uint16 [N, A], scale uint16 [L * 2, 256], (has_qmax) qmax uint8 [L, 2]

:func:`read_table_file` refuses (:class:`TableFileError`, naming the file and the reason) a file
that is truncated or longer than announced, of another magic or version, with a bad checksum, of
another namespace, level or geometry, whose tables do not each sum to 4096 or whose id differs from
the id of its tables. A refused file is never used; the tier codes with per-stream tables (or
calibrates anew) and records of that set are misses.

Where the directory is: ``codec_tables_dir`` in the YAML, else ``lmtier-codec-tables`` in the first
``local_disk`` directory (:mod:`lmtier.config`); a tier with neither keeps today's behaviour
(shipped tables where they exist, else per-stream tables), as tables that only one process knows
would make a shared remote tier's records unreadable for the others.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import re
import struct
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
import xxhash

from lmtier.affinity import background_priority
from lmtier.errors import LMTierError

from . import format as fmt
from .calibrate import Calibrator, _tables, calibrate
from .chunk import StaticTables
from .levels import Level, get_level

__all__ = [
    "CALIBRATION_CHUNKS",
    "TABLE_FILE_VERSION",
    "TableFileError",
    "AutoTables",
    "table_file_bytes",
    "read_table_file",
    "write_table_file",
    "record_table_id",
]

log = logging.getLogger("lmtier.codec.autotables")

CALIBRATION_CHUNKS = 16
"""Chunks a new namespace's tables are fitted on (16 x 256 tokens: the size of the shipped tables'
calibration text)."""

QUEUE_CHUNKS = 2
"""Chunks waiting for the calibration thread at most (:meth:`AutoTables.observe`)."""

RETRY_S = 30.0
"""Seconds before :meth:`AutoTables.lookup` looks again for a table file it did not find."""

TABLE_FILE_VERSION = 1
FILE_MODE = 0o600
DIR_MODE = 0o700
"""Modes of table files and of a table directory lmtier creates (the disk tier's: README, Security notes)."""
_MAGIC = b"LMKT"
_HEADER = struct.Struct("<4sHHIBBHIIII16sQQ")
assert _HEADER.size == 64
_SUFFIX = ".lmtt"
_NS_RE = re.compile(r"^[0-9A-Za-z_.]{1,16}$")


class TableFileError(LMTierError, ValueError):
    """A table file that must not be used (truncated, corrupt, other version / namespace / level /
    geometry); the message names the file and the reason."""


def _check_ns(namespace: str) -> bytes:
    if not isinstance(namespace, str) or not _NS_RE.match(namespace):
        raise ValueError(f"namespace id must be 1-16 characters of [0-9A-Za-z_.], got {namespace!r}")
    return namespace.encode("ascii")


def table_file_bytes(namespace: str, level: str | int | Level, tables: StaticTables, arrays: dict) -> bytes:
    """The table file of ``tables`` (``arrays``: what :func:`lmtier.codec.calibrate.calibrate`
    returned with them) for ``namespace`` (an id of at most 16 characters, e.g. the first 16 hex
    digits of :meth:`lmtier.keys.Namespace.digest`)."""
    lv = get_level(level)
    ns = _check_ns(namespace)
    sym = np.ascontiguousarray(arrays["sym"], "<u2")
    scale = np.ascontiguousarray(arrays["scale"], "<u2")
    qmax = arrays.get("qmax")
    nl, h, d = (int(v) for v in arrays["geometry"])
    payload = (
        sym.tobytes() + scale.tobytes() + (b"" if qmax is None else np.ascontiguousarray(qmax, np.uint8).tobytes())
    )
    head = _HEADER.pack(
        _MAGIC,
        TABLE_FILE_VERSION,
        _HEADER.size,
        int(tables.table_id),
        lv.level_id,
        int(qmax is not None),
        sym.shape[1],
        nl,
        h,
        d,
        sym.shape[0],
        ns,
        len(payload),
        0,
    )
    x = xxhash.xxh3_64()
    x.update(head[:56])
    x.update(payload)
    return head[:56] + struct.pack("<Q", x.intdigest()) + payload


def read_table_file(
    path: str | Path,
    *,
    namespace: str,
    level: str | int | Level,
    geometry: Sequence[int],
    data: bytes | None = None,
) -> StaticTables:
    """Read and check a table file (``data``: its bytes, when already read).

    Args:
        path: the file (named in errors).
        namespace, level, geometry: what the file must be for (``geometry`` ``(L, H, D)``).

    Returns:
        The :class:`StaticTables` (their id recomputed from the arrays and equal to the file's).

    Raises:
        TableFileError: see the module doc; OSError: the file cannot be read.
    """
    lv = get_level(level)
    want_ns = _check_ns(namespace)
    if data is None:
        data = Path(path).read_bytes()

    def bad(why: str) -> TableFileError:
        return TableFileError(f"codec table file {path}: {why}; not used")

    if len(data) < _HEADER.size:
        raise bad(f"truncated ({len(data)} bytes, the header alone is {_HEADER.size})")
    magic, ver, hb, tid, level_id, has_q, alpha, nl, h, d, rows, ns, plen, checksum = _HEADER.unpack_from(data, 0)
    if magic != _MAGIC:
        raise bad(f"not a table file (magic {bytes(magic)!r})")
    if ver != TABLE_FILE_VERSION:
        raise bad(f"version {ver}, this reader knows {TABLE_FILE_VERSION}")
    if hb != _HEADER.size:
        raise bad(f"header_bytes {hb}")
    if len(data) != _HEADER.size + plen:
        raise bad(f"{len(data)} bytes, the header announces {_HEADER.size + plen} (truncated or trailing bytes)")
    x = xxhash.xxh3_64()
    x.update(data[:56])
    x.update(data[_HEADER.size :])
    if x.intdigest() != checksum:
        raise bad("checksum mismatch (corrupted)")
    got_ns = ns.rstrip(b"\0")
    if got_ns != want_ns:
        raise bad(f"namespace {got_ns.decode('ascii', 'replace')!r}, expected {namespace!r}")
    if level_id != lv.level_id:
        raise bad(f"level id {level_id}, expected {lv.level_id} ({lv.name})")
    if (nl, h, d) != tuple(int(v) for v in geometry):
        raise bad(f"geometry {(nl, h, d)}, expected {tuple(geometry)}")
    if bool(has_q) != lv.adaptive:
        raise bad("qmax array present for a fixed level or missing for an adaptive one")
    n_sym = rows * alpha * 2
    n_scale = nl * 2 * 256 * 2
    n_q = nl * 2 if has_q else 0
    if plen != n_sym + n_scale + n_q or not 0 < alpha <= 256:
        raise bad(f"payload of {plen} bytes does not hold [{rows}, {alpha}] + [{nl * 2}, 256] tables")
    o = _HEADER.size
    sym = np.frombuffer(data, "<u2", rows * alpha, o).reshape(rows, alpha).astype(np.uint16)
    scale = np.frombuffer(data, "<u2", nl * 2 * 256, o + n_sym).reshape(nl * 2, 256).astype(np.uint16)
    qmax = np.frombuffer(data, np.uint8, n_q, o + n_sym + n_scale).reshape(nl, 2).copy() if has_q else None
    try:
        tab = _tables(lv, (nl, h, d), sym, scale, qmax)
    except ValueError as e:
        raise bad(str(e)) from None
    if int(tab.table_id) != tid:
        raise bad(f"table id {tid:#010x} in the header, the tables' id is {int(tab.table_id):#010x}")
    return tab


def write_table_file(path: str | Path, data: bytes) -> None:
    """Write ``data`` to ``path`` atomically (a temporary file in the same directory, fsync,
    rename): readers see the whole file or none. The file is created :data:`FILE_MODE` (0600), as
    the disk tier's records."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, FILE_MODE), "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def record_table_id(record: np.ndarray) -> int | None:
    """The ``table_id`` field of a codec record's header (not verified: for choosing the table set
    before :func:`lmtier.codec.chunk.parse_record` checks everything), or None if too short."""
    if record.size < fmt.HEADER_BYTES:
        return None
    return int(np.frombuffer(record[12:16].tobytes(), "<u4")[0])


class AutoTables:
    """The auto-calibrated table sets of one (namespace, level, geometry) in one process.

    Args:
        directory: the table directory (created if missing).
        namespace: the namespace id (1-16 characters of ``[0-9A-Za-z_.]``, e.g. the first 16 hex
            digits of :meth:`lmtier.keys.Namespace.digest`).
        level: a quantized level.
        shape: canonical chunk shape ``(L, 2, T, H, D)``.
        chunks: chunks to calibrate on (default :data:`CALIBRATION_CHUNKS`).

    At construction the directory's files for this namespace and level are read: the oldest valid
    one becomes :attr:`current`; invalid ones are logged (:class:`TableFileError`) and ignored.

    Attributes:
        current: the set new records are coded with, None until calibrated or adopted.
        calibrated: True once this process fitted a set itself (False when it adopted a file).
        rejected: paths of table files refused (logged), for diagnostics.

    Thread-safe: :meth:`observe` may run in several threads; the counting and fitting run in one
    background thread (:meth:`wait`, :meth:`close`).

    Raises:
        ValueError: lossless level, bad namespace id or shape. OSError: the directory cannot be made.
    """

    def __init__(
        self,
        directory: str | Path,
        *,
        namespace: str,
        level: str | int | Level,
        shape: Sequence[int],
        chunks: int = CALIBRATION_CHUNKS,
    ) -> None:
        self.level = get_level(level)
        if self.level.lossless:
            raise ValueError("the lossless level has no static tables")
        _check_ns(namespace)
        self.namespace = namespace
        self.directory = Path(directory)
        self.directory.mkdir(mode=DIR_MODE, parents=True, exist_ok=True)
        self.shape = tuple(int(v) for v in shape)
        nl, _, _, h, d = self.shape
        self.geometry = (nl, h, d)
        self.chunks = int(chunks)
        if self.chunks < 1:
            raise ValueError(f"chunks must be >= 1, got {chunks}")
        self._lock = threading.Lock()
        self._handed = 0  # chunks given to the worker
        self._queue: queue.Queue = queue.Queue(QUEUE_CHUNKS)
        self._worker: threading.Thread | None = None
        self._done = threading.Event()
        self._sets: dict[int, StaticTables] = {}
        self._missing: dict[int, float] = {}  # table id -> when no valid file was found
        self._cal = None if self.level.adaptive else Calibrator(self.level)
        self._kept: list[torch.Tensor] = []  # adaptive levels: calibrate() needs the chunks
        self._seen = 0
        self._off = False
        self.calibrated = False
        self.rejected: list[str] = []
        self.current: StaticTables | None = self._adopt()

    def _path(self, table_id: int) -> Path:
        return self.directory / f"{self.namespace}-{self.level.name}-{table_id:08x}{_SUFFIX}"

    def _read(self, path: Path) -> StaticTables | None:
        try:
            tab = read_table_file(path, namespace=self.namespace, level=self.level, geometry=self.geometry)
        except (TableFileError, OSError) as e:
            log.warning("%s", e)
            self.rejected.append(str(path))
            return None
        if tab.run_lens(self.shape[2]) is None:
            log.warning(
                "codec table file %s: table switching cannot code %d-token chunks; not used", path, self.shape[2]
            )
            return None
        self._sets[int(tab.table_id)] = tab
        return tab

    def _adopt(self) -> StaticTables | None:
        """The oldest valid file of this namespace and level in the directory, or None."""
        files = sorted(
            self.directory.glob(f"{self.namespace}-{self.level.name}-*{_SUFFIX}"),
            key=lambda p: (p.stat().st_mtime, p.name),
        )
        for p in files:
            tab = self._read(p)
            if tab is not None:
                return tab
        return None

    def observe(self, chunk: torch.Tensor) -> StaticTables | None:
        """Hand one stored chunk (typed ``[L, 2, T, H, D]``, CPU or CUDA) to calibration; returns
        :attr:`current`. Does nothing once a set is current, calibration is off or enough chunks
        were handed over.

        The caller pays one copy of the chunk to host memory; counting, fitting and writing the file
        run in a background thread of this object (at most :data:`QUEUE_CHUNKS` chunks wait for it:
        a chunk arriving while they do is skipped, so calibration takes a few more stored chunks
        instead of host memory or the caller's time). :meth:`wait` waits for the result."""
        if self.current is not None or self._off:
            return self.current
        with self._lock:
            if self.current is not None or self._off or self._handed >= self.chunks or self._queue.full():
                return self.current
            self._handed += 1
            if self._worker is None:
                self._worker = threading.Thread(target=self._work, name="lmtier-codec-calibrate", daemon=True)
                self._worker.start()
        try:
            self._queue.put_nowait(chunk.detach().to("cpu", copy=True).contiguous())
        except queue.Full:  # not reached: only put under the count above, the queue drains
            with self._lock:
                self._handed -= 1
        return self.current

    def _work(self) -> None:
        """Background thread: count the queued chunks, fit and persist once enough were counted."""
        background_priority()
        try:
            while True:
                c = self._queue.get()
                if c is None or self._off:
                    return
                if self._cal is not None:
                    self._cal.add(c)
                else:
                    self._kept.append(c)
                self._seen += 1
                if self._seen >= self.chunks:
                    self._finish()
                    return
        except Exception as e:  # noqa: BLE001 - calibration is an optimisation: per-stream tables stay
            log.warning(
                "codec tables for %s/%s: calibration failed (%r); per-stream tables", self.namespace, self.level.name, e
            )
            self.disable()
        finally:
            self._done.set()

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until calibration finished (or failed, or :meth:`close`); True if it did within
        ``timeout`` seconds (True at once when a set was adopted at start)."""
        if self.current is not None and self._worker is None:
            return True
        return self._done.wait(timeout)

    def close(self) -> None:
        """Stop calibrating; the background thread ends after the chunk it is counting."""
        self.disable()
        with contextlib.suppress(queue.Full):
            self._queue.put_nowait(None)

    def _finish(self) -> None:
        tab, arrays = self._cal.finish() if self._cal is not None else calibrate(self._kept, self.level)
        self._kept = []
        other = self._adopt()  # another process may have written a set meanwhile
        if other is not None:
            log.info("codec tables for %s/%s: adopted %s", self.namespace, self.level.name, self._path(other.table_id))
            self.current = other
            return
        path = self._path(int(tab.table_id))
        try:
            write_table_file(path, table_file_bytes(self.namespace, self.level, tab, arrays))
        except OSError as e:  # unpersisted tables would make records no other process (or restart) can read
            log.warning(
                "codec tables for %s/%s: cannot write %s (%s); not used (per-stream tables)",
                self.namespace,
                self.level.name,
                path,
                e,
            )
            self.disable()
            return
        log.info(
            "codec tables for %s/%s calibrated on %d chunks: %s", self.namespace, self.level.name, self._seen, path
        )
        self._sets[int(tab.table_id)] = tab
        self.calibrated = True
        self.current = tab

    def disable(self) -> None:
        """Stop calibrating (after a failure): :meth:`observe` does nothing from now on."""
        with self._lock:
            self._off = True
            self._kept = []

    def lookup(self, table_id: int) -> StaticTables | None:
        """The set with ``table_id``: held, or read from the directory (another process's file);
        None when there is no valid file for it (the directory is asked again after
        :data:`RETRY_S` seconds, not on every record)."""
        tid = int(table_id)
        tab = self._sets.get(tid)
        if tab is not None:
            return tab
        with self._lock:
            tab = self._sets.get(tid)
            miss_at = self._missing.get(tid)
            if tab is None and (miss_at is None or time.monotonic() - miss_at >= RETRY_S):
                p = self._path(tid)
                tab = self._read(p) if p.exists() else None
                if tab is None:
                    self._missing[tid] = time.monotonic()
                else:
                    self._missing.pop(tid, None)
            return tab
