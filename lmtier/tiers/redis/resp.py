"""Reading one record from Redis: the replies of ``EXISTS, STRLEN, GETRANGE piece 0..``.

:class:`RecordReader` assembles and verifies the payload from the replies (whichever way they were
received); :func:`read_record_direct` receives them straight from a redis-py connection's socket
with :class:`SocketReplies`, a minimal RESP2 reader that puts each piece's bytes into the caller's
buffer with ``recv_into`` (see :mod:`lmtier.tiers.redis.tier` for the measurements).
"""

from __future__ import annotations

import logging
import time

import redis

from lmtier import record as rec
from lmtier.errors import LMTierError
from lmtier.tiers.buffers import copy_into

__all__ = ["HEADER", "CorruptValue", "RecordReader", "check_deadline", "SocketReplies", "read_record_direct"]

log = logging.getLogger("lmtier.tiers.remote")

HEADER = rec.COMPACT_PAYLOAD_OFFSET
"""Bytes of the compact record header in front of every stored payload."""


class CorruptValue(LMTierError):
    """The stored value does not verify (or a read was torn by a concurrent overwrite)."""


class RecordReader:
    """Consumes the replies of ``EXISTS, STRLEN, GETRANGE piece 0..`` in order and assembles the
    payload in ``out``; :meth:`finish` verifies it. Every reply must be fed (the connection stays
    in sync); once the value is known to be unusable the remaining pieces are ignored."""

    def __init__(self, key: bytes, out: memoryview, piece: int, max_payload: int) -> None:
        self.key = key
        self.out = out
        self.piece = piece
        self.max_payload = max_payload
        self.i = 0
        self.exists = False
        self.total = 0
        self.hdr: rec.RecordHeader | None = None
        self.n = 0  # payload bytes the header announces
        self.got = 0  # payload bytes copied into out
        self.error: str | None = None
        self.too_small = False
        self.done = False  # nothing more to copy (miss, error, too small)

    def feed(self, reply) -> None:
        """Consume the next reply (an int for EXISTS/STRLEN, bytes for a GETRANGE piece)."""
        i, self.i = self.i, self.i + 1
        if i == 0:
            self.exists = bool(reply)
            self.done = not self.exists
            return
        if i == 1:
            self.total = int(reply)
            return
        if self.done:
            return
        data = memoryview(reply)
        if i == 2:  # piece 0: the header, then the first payload bytes
            if not self.take_header(data[:HEADER], len(data)):
                return
            data = data[HEADER:]
        dst = self.target(i, len(data))
        if dst is not None:
            copy_into(dst, data)  # the GIL released: other I/O threads decode meanwhile
            self.got += len(data)

    def take_header(self, head: memoryview, piece_len: int) -> bool:
        """Decode the record header (the first ``HEADER`` bytes of piece 0, whose reply has
        ``piece_len`` bytes). Returns whether payload bytes should be copied at all."""
        if self.total < HEADER or piece_len < HEADER:
            self._fail(f"value of {max(self.total, piece_len)} bytes is shorter than the header")
            return False
        try:
            hdr = rec.decode_header(head, expected_key=self.key, max_payload_bytes=self.max_payload)
        except rec.RecordError as e:
            self._fail(str(e))
            return False
        if hdr.payload_offset != HEADER or HEADER + hdr.payload_bytes != self.total:
            self._fail(f"value length {self.total} != header {HEADER} + payload {hdr.payload_bytes}")
            return False
        self.hdr, self.n = hdr, hdr.payload_bytes
        if self.n > self.out.nbytes:
            self.too_small, self.done = True, True
            return False
        return True

    def target(self, i: int, k: int) -> memoryview | None:
        """Where the ``k`` payload bytes of reply ``i`` (a GETRANGE piece, after the header for
        piece 0) belong in ``out``; None when they are to be dropped. The caller fills the view
        and adds ``k`` to :attr:`got`."""
        if self.done:
            return None
        dst = 0 if i == 2 else (i - 2) * self.piece - HEADER
        if k == 0:
            return None
        if dst != self.got or dst + k > self.n:
            self._fail("value changed while it was read")  # shorter/longer piece: torn or corrupt
            return None
        return self.out[dst : dst + k]

    def _fail(self, why: str) -> None:
        self.error, self.done = why, True

    def finish(self) -> int | None:
        """Payload bytes; None for a missing key or a too-small ``out``.

        Raises:
            CorruptValue: the value does not verify.
        """
        if not self.exists:
            return None
        if self.error is not None:
            raise CorruptValue(self.error)
        if self.too_small:
            log.warning("get_into: out has %d bytes < payload %d", self.out.nbytes, self.n)
            return None
        if self.hdr is None:
            raise CorruptValue("no header was read")
        if self.got != self.n:
            raise CorruptValue(f"read {self.got} of {self.n} payload bytes")
        try:
            rec.verify_payload(self.hdr, self.out[: self.n])
        except rec.RecordError as e:
            raise CorruptValue(str(e)) from None
        return self.n


def check_deadline(deadline: float | None) -> None:
    """Raise ``redis.exceptions.TimeoutError`` once ``time.monotonic()`` is past ``deadline`` (None: never)."""
    if deadline is not None and time.monotonic() > deadline:
        raise redis.exceptions.TimeoutError("read deadline passed (the server sends too slowly)")


class SocketReplies:
    """A minimal RESP2 reader over a connected socket, for the replies of one pipelined batch of
    ``EXISTS, STRLEN, GETRANGE...`` that this module sent on a redis-py connection.

    Lines (``:n``, ``$n``, ``-ERR``) go through a small scratch buffer; the body of a bulk reply is
    copied out of the scratch for the bytes already there and the rest is received with
    ``recv_into`` straight into its destination (exact byte counts, so nothing past the reply is
    consumed). redis-py's parser is never used for these replies, so its buffer stays empty and
    the connection can go back to the pool once every reply was consumed (:meth:`drained`); on
    any exception the caller disconnects it. Every ``recv_into`` runs under the socket's timeout,
    and none starts after ``deadline`` (``time.monotonic()`` seconds; a server that trickles bytes
    just inside the socket timeout cannot hold a read forever).
    """

    SCRATCH = 16 << 10
    MAX_LINE = 4096

    def __init__(self, sock, parse_error=None, deadline: float | None = None) -> None:
        self.sock = sock
        self.parse_error = parse_error  # redis-py's mapping of "-ERR ..." to exception classes
        self.deadline = deadline
        self.buf = bytearray(self.SCRATCH)
        self.mv = memoryview(self.buf)
        self.r = self.w = 0

    def _recv(self, dst: memoryview) -> int:
        check_deadline(self.deadline)
        n = self.sock.recv_into(dst)
        if n == 0:
            raise redis.exceptions.ConnectionError("connection closed by the server mid-reply")
        return n

    def _line(self) -> bytes:
        while True:
            j = self.buf.find(b"\r\n", self.r, self.w)
            if j >= 0:
                line, self.r = bytes(self.mv[self.r : j]), j + 2
                return line
            if self.w - self.r > self.MAX_LINE:
                raise redis.exceptions.InvalidResponse("reply line too long")
            if self.r == self.w:
                self.r = self.w = 0
            elif self.w == len(self.buf):
                k = self.w - self.r
                self.buf[:k] = bytes(self.mv[self.r : self.w])  # (no overlapping memoryview copy)
                self.r, self.w = 0, k
            self.w += self._recv(self.mv[self.w :])

    def _check(self, line: bytes, kind: bytes) -> int:
        if line[:1] == b"-":
            msg = line[1:].decode("utf-8", "replace")
            err = self.parse_error(msg) if self.parse_error is not None else None
            raise err if isinstance(err, redis.exceptions.RedisError) else redis.exceptions.ResponseError(msg)
        if line[:1] != kind:
            raise redis.exceptions.InvalidResponse(f"unexpected reply {line[:32]!r}")
        try:
            return int(line[1:])
        except ValueError:
            raise redis.exceptions.InvalidResponse(f"malformed reply {line[:32]!r}") from None

    def integer(self) -> int:
        """An integer reply (``:n``); a server error raises ``ResponseError``."""
        return self._check(self._line(), b":")

    def bulk_len(self) -> int:
        """The length of the next bulk reply (``$n``); -1 for a null bulk (no body, no CRLF)."""
        n = self._check(self._line(), b"$")
        if n < -1:
            raise redis.exceptions.InvalidResponse(f"bulk length {n}")
        return n

    def read_into(self, dst: memoryview) -> None:
        """Fill ``dst`` with the next ``len(dst)`` body bytes."""
        k = len(dst)
        a = min(k, self.w - self.r)
        if a:
            dst[:a] = self.mv[self.r : self.r + a]
            self.r += a
        while a < k:
            a += self._recv(dst[a:])

    def skip(self, k: int) -> None:
        """Drop the next ``k`` body bytes."""
        while k > 0:
            if self.r == self.w:
                self.r = self.w = 0
                self.w = self._recv(self.mv)
            a = min(k, self.w - self.r)
            self.r += a
            k -= a

    def end_bulk(self) -> None:
        """The CRLF that ends a bulk body."""
        crlf = bytearray(2)
        self.read_into(memoryview(crlf))
        if crlf != b"\r\n":
            raise redis.exceptions.InvalidResponse("bulk reply not terminated by CRLF")

    def drained(self) -> bool:
        """True when nothing past the expected replies was received."""
        return self.r == self.w


def read_record_direct(conn, cmds: list[tuple], reader: RecordReader, deadline: float | None = None) -> None:
    """Send ``cmds`` (EXISTS, STRLEN, GETRANGE pieces) on the redis-py connection ``conn`` and feed
    their replies to ``reader``, the pieces' payload bytes received straight into its ``out``;
    no receive starts after ``deadline`` (``time.monotonic()`` seconds, None: no deadline).

    Raises:
        redis.exceptions.ResponseError: the server answered an error (e.g. WRONGTYPE).
        redis.exceptions.ConnectionError / InvalidResponse / OSError / TimeoutError: the
            connection failed or is out of sync; the caller must disconnect it.
    """
    conn.send_packed_command(conn.pack_commands(cmds))
    sock = conn._sock  # connected by send_packed_command; redis-py's parser has nothing buffered
    if sock is None:
        raise redis.exceptions.ConnectionError("connection lost")
    rd = SocketReplies(sock, getattr(conn._parser, "parse_error", None), deadline)
    reader.feed(rd.integer())  # EXISTS
    reader.feed(rd.integer())  # STRLEN
    for i in range(2, len(cmds)):
        k = rd.bulk_len()
        reader.i = i + 1
        if k > cmds[i][3] - cmds[i][2] + 1:  # more than the range asked for: not a GETRANGE reply
            raise redis.exceptions.InvalidResponse(
                f"GETRANGE reply of {k} bytes for a range of {cmds[i][3] - cmds[i][2] + 1}"
            )
        if k < 0:  # null bulk: no body and no CRLF (GETRANGE answers "" instead; treat alike)
            if i == 2 and not reader.done:
                reader.take_header(memoryview(b""), 0)  # fails: shorter than the header
            continue
        if i == 2 and not reader.done:  # piece 0: the header first
            head = bytearray(min(k, HEADER))
            rd.read_into(memoryview(head))
            k -= len(head)
            if not reader.take_header(memoryview(head), len(head) + k):
                k = -k  # drop the rest of the piece
        dst = reader.target(i, k) if k > 0 else None
        if dst is None:
            rd.skip(abs(k))
        else:
            rd.read_into(dst)
            reader.got += k
        rd.end_bulk()
    if not rd.drained():
        raise redis.exceptions.InvalidResponse("unexpected bytes after the last reply")
