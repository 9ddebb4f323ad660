"""Remote tier (tier 3): Redis / Valkey, single instance or Redis Cluster, through redis-py.

One key per chunk, ``<key_prefix><key hex>`` (default prefix ``"lmtier:"``), whose value is a
self-describing record of :mod:`lmtier.record` with the compact header (``payload_offset = 128``)
followed by the payload: there is no separate metadata key that could go out of sync. Eviction is
Redis's own (``maxmemory`` + ``maxmemory-policy allkeys-lru``) or an optional per-key TTL.

Client: redis-py (with hiredis as its reply parser when installed) for every scheme —
``redis.Redis`` over a ``BlockingConnectionPool`` for ``redis://``, ``rediss://``, ``unix://``
and ``redis.cluster.RedisCluster`` for ``redis-cluster://``. Measured with
benchmarks/bench_remote.py (32 MiB values, loopback, interleaved with ``redis-benchmark -c 1``
on the same server; a loaded 2-core VM, two runs): this tier with 1 MiB pieces stored at
0.61/0.85 GB/s and loaded at 1.06/1.62 GB/s where ``redis-benchmark`` did 0.31/0.18 (SET) and
0.31/0.39 (GET), stock redis-py ``SET``/``GET`` of ``bytes`` 0.22/0.18 and 0.26/0.30, and
valkey-glide 0.36/0.29 and 0.25/0.22. Large values therefore move in pieces of ``piece_bytes``
(1 MiB by default, the best of 1/2/4/8/16 MiB in both runs: pieces that stay cache-resident beat
one huge value on both ends):

* **put**: a record that fits in one piece is one ``SET``. A larger one is written under a
  temporary key, ``{<name>}.tmp.<random>`` (same hash slot as the final key), in one pipelined
  round trip: ``SETRANGE`` of the last payload piece first (the server allocates the whole value
  once), ``EXPIRE`` of the temporary key (an interrupted write cannot leave an orphan for long),
  the other pieces, the header, then ``RENAME`` onto the final key and ``PERSIST`` (or
  ``EXPIRE ttl_s``). ``RENAME`` is atomic, so readers see the old value or the complete new one,
  never a partial record. The payload pieces are sent as memoryviews of the caller's buffer
  (redis-py's pure-Python command packer, which sends large arguments by reference; its hiredis
  packer would copy every argument into a new ``bytes``).
* **get_into**: one pipelined round trip of ``EXISTS``, ``STRLEN`` and ``GETRANGE`` pieces that
  cover ``128 + len(out)`` bytes. On a single instance (``redis://``, ``rediss://``, ``unix://``)
  the commands go out on a pooled redis-py connection and the replies are received from its
  socket by :class:`_SocketReplies`, a minimal RESP2 reader: each piece's bytes go straight into
  ``out`` with ``recv_into`` (one kernel copy, no ``bytes`` per piece, the GIL released while
  the kernel copies; ~28 receives and as many polls per 5.7 MB record where redis-py's parser
  makes ~175 of each); the header, in the first piece, is decoded before anything is copied; the
  connection goes back to the pool only when exactly the expected replies were consumed, and is
  closed on any error. ``direct_reads=False`` reads the same replies through redis-py's parser
  instead (a ``bytes`` per piece, copied into ``out``). Measured (benchmarks/bench_remote.py,
  6 MiB values, loopback, redis-py 6.4 + hiredis, H200 host, 16 cores): 2.20 GB/s with one
  caller and 2.94 GB/s with 4 in flight (69 % / 97 % of a raw-socket ``GETRANGE`` client in the
  same run) where the parser path did 1.73 / 1.27 (benchmarks/RESULTS.md). Redis Cluster goes through
  redis-py's cluster pipeline (slot routing, redirections) and copies after the round trip;
  its node clients keep redis-py's default packer (``RedisCluster`` passes neither
  ``command_packer`` nor ``connection_class`` to them), which copies each piece once on put.
  The value length (``STRLEN``) must equal header + payload and the xxh3 checksum must match
  the assembled payload. The pieces are separate commands, so a concurrent overwrite between
  them could tear a read: a record that fails these checks is read once more inside
  ``MULTI``/``EXEC`` (atomic), and only when that copy fails too is it corrupt — counted,
  deleted, a miss. A torn read is never returned as data.

Failure model: every socket operation has a timeout (``timeout_s``; ``connect_timeout_s`` for
connects), redis-py does not retry (``Retry(NoBackoff(), 0)``) and a connection that saw an error
is closed. Network errors never reach the caller: loads become misses and stores return False,
and they are counted. After ``breaker_failures`` consecutive failures a circuit breaker opens:
calls return a miss/False immediately for ``breaker_reset_s``, then one trial call decides
whether it closes. Authentication failures at construction raise
:class:`~lmtier.tiers.base.TierError` (a configuration error); an unreachable server at
construction only logs a warning.

URLs:
  * ``redis://[[user]:password@]host[:port][/db]``
  * ``rediss://...`` TLS; query parameters ``ssl_ca_certs``, ``ssl_certfile``, ``ssl_keyfile``,
    ``ssl_cert_reqs`` (``required`` | ``optional`` | ``none``), ``ssl_check_hostname`` (true/false)
  * ``unix:///path/to/redis.sock[?db=N][&password=...]``
  * ``redis-cluster://[[user]:password@]host:port,host:port,...`` (``rediss-cluster://`` for TLS)
The password may instead come from the environment variable named by ``password_env`` (it wins
over the URL). Passwords are never logged.
"""

from __future__ import annotations

import collections
import logging
import os
import threading
import time
import urllib.parse
from dataclasses import dataclass

import redis
import redis.cluster
import redis.crc
from redis.backoff import NoBackoff
from redis.connection import Encoder, PythonRespSerializer
from redis.retry import Retry

from lmtier import record as rec
from lmtier.tiers.base import KEY_BYTES, Tier, TierError, TierUsage
from lmtier.tiers.disk import BouncePool, cuda_nbytes, host_view, is_cuda_tensor

log = logging.getLogger("lmtier.tiers.remote")

HEADER = rec.COMPACT_PAYLOAD_OFFSET
DEFAULT_PIECE_BYTES = 1 << 20
#: Lifetime of a temporary key, so that a write interrupted before its RENAME leaves no orphan.
TMP_TTL_S = 300

# redis-py's pure-Python packer: arguments above 6000 bytes and memoryviews are sent as they are
# (no concatenation), so payload pieces go from the caller's buffer to the socket.
_PACKER = PythonRespSerializer(6000, Encoder("utf-8", "strict", False).encode)


@dataclass(frozen=True)
class _TLS:
    ca_certs: str | None = None
    certfile: str | None = None
    keyfile: str | None = None
    cert_reqs: str = "required"
    check_hostname: bool = True


@dataclass(frozen=True)
class _Target:
    kind: str  # "tcp" | "unix" | "cluster"
    host: str = ""
    port: int = 6379
    path: str = ""
    nodes: tuple = ()
    db: int = 0
    username: str | None = None
    password: str | None = None
    tls: _TLS | None = None

    def describe(self) -> str:  # never includes the password
        if self.kind == "unix":
            return f"unix://{self.path}"
        if self.kind == "cluster":
            return f"{'rediss' if self.tls else 'redis'}-cluster://" + ",".join(f"{h}:{p}" for h, p in self.nodes)
        return f"{'rediss' if self.tls else 'redis'}://{self.host}:{self.port}/{self.db}"


def parse_url(url: str, *, password_env: str | None = None) -> _Target:
    """Parse a remote URL (see the module docstring). Raises ``ValueError`` on a malformed URL."""
    u = urllib.parse.urlsplit(url)
    q = {k: v[-1] for k, v in urllib.parse.parse_qs(u.query).items()}
    scheme = u.scheme.lower()
    username = urllib.parse.unquote(u.username) if u.username else None
    password = urllib.parse.unquote(u.password) if u.password else q.get("password")
    if password_env:
        env = os.environ.get(password_env)
        if env is not None:
            password = env
        elif password is None:
            raise ValueError(f"remote_url: password_env {password_env!r} is not set in the environment")
    tls = None
    if scheme in ("rediss", "rediss-cluster"):
        reqs = q.get("ssl_cert_reqs", "required").lower()
        if reqs not in ("required", "optional", "none"):
            raise ValueError(f"remote_url: ssl_cert_reqs must be required/optional/none, got {reqs!r}")
        check = q.get("ssl_check_hostname", "true").lower() not in ("false", "0", "no") and reqs != "none"
        for f in ("ssl_ca_certs", "ssl_certfile", "ssl_keyfile"):
            if q.get(f) and not os.path.isfile(q[f]):
                raise ValueError(f"remote_url: {f} {q[f]!r} is not a file")
        tls = _TLS(ca_certs=q.get("ssl_ca_certs"), certfile=q.get("ssl_certfile"), keyfile=q.get("ssl_keyfile"),
                   cert_reqs=reqs, check_hostname=check)
    if scheme in ("redis", "rediss"):
        if not u.hostname:
            raise ValueError(f"remote_url {_redact(url)!r}: missing host")
        path = u.path.strip("/")
        try:
            db = int(path or q.get("db", 0))
        except ValueError:
            raise ValueError(f"remote_url {_redact(url)!r}: database {path!r} is not an integer") from None
        try:
            port = u.port or 6379
        except ValueError as e:
            raise ValueError(f"remote_url {_redact(url)!r}: {e}") from None
        return _Target("tcp", host=u.hostname, port=port, db=db, username=username, password=password, tls=tls)
    if scheme == "unix":
        if not u.path:
            raise ValueError(f"remote_url {_redact(url)!r}: missing socket path")
        try:
            db = int(q.get("db", 0))
        except ValueError:
            raise ValueError(f"remote_url {_redact(url)!r}: db {q.get('db')!r} is not an integer") from None
        return _Target("unix", path=u.path, db=db, username=username, password=password)
    if scheme in ("redis-cluster", "rediss-cluster"):
        netloc = u.netloc.rsplit("@", 1)[-1]
        nodes = []
        for part in netloc.split(","):
            host, _, port = part.strip().rpartition(":")
            if not host or not port.isdigit():
                raise ValueError(f"remote_url {_redact(url)!r}: cluster node {part!r} is not host:port")
            nodes.append((host.strip("[]"), int(port)))
        return _Target("cluster", nodes=tuple(nodes), username=username, password=password, tls=tls)
    raise ValueError(f"remote_url {_redact(url)!r}: scheme must be redis, rediss, unix, redis-cluster or rediss-cluster")


def _redact(url: str) -> str:
    u = urllib.parse.urlsplit(url)
    if u.password:
        netloc = u.netloc.replace(":" + u.password + "@", ":***@", 1)
        u = u._replace(netloc=netloc)
    q = urllib.parse.parse_qsl(u.query)
    if any(k == "password" for k, _ in q):
        u = u._replace(query=urllib.parse.urlencode([(k, "***" if k == "password" else v) for k, v in q]))
    return urllib.parse.urlunsplit(u)


def _tmp_name(name: bytes) -> bytes:
    """A unique temporary key in the same Redis Cluster hash slot as ``name``."""
    i = name.find(b"{")
    has_tag = i >= 0 and name.find(b"}", i + 1) > i + 1  # Redis's rule: "{}" first means no hash tag
    base = name if has_tag else b"{" + name + b"}"
    return base + b".tmp." + os.urandom(8).hex().encode()


class _Corrupt(Exception):
    """The stored value does not verify (or a read was torn by a concurrent overwrite)."""


# --------------------------------------------------------------------------------------------
# Circuit breaker
# --------------------------------------------------------------------------------------------


class CircuitBreaker:
    """Consecutive-failure circuit breaker (closed -> open -> half-open trial -> closed/open).

    Args:
        failures: consecutive failures that open it.
        reset_s: seconds it stays open before one trial call is let through.
    """

    def __init__(self, failures: int, reset_s: float) -> None:
        self.failures = failures
        self.reset_s = reset_s
        self._lock = threading.Lock()
        self._consecutive = 0
        self._open_until = 0.0
        self._trial = False
        self.times_opened = 0

    @property
    def is_open(self) -> bool:
        with self._lock:
            return self._consecutive >= self.failures

    def allow(self) -> bool:
        with self._lock:
            if self._consecutive < self.failures:
                return True
            if time.monotonic() >= self._open_until and not self._trial:
                self._trial = True
                return True
            return False

    def success(self) -> None:
        with self._lock:
            if self._consecutive >= self.failures:
                log.info("remote tier: circuit breaker closed")
            self._consecutive = 0
            self._trial = False

    def failure(self) -> None:
        with self._lock:
            self._consecutive += 1
            was_trial, self._trial = self._trial, False
            if self._consecutive == self.failures or (was_trial and self._consecutive > self.failures):
                self._open_until = time.monotonic() + self.reset_s
                if self._consecutive == self.failures:
                    self.times_opened += 1
                    log.warning("remote tier: circuit breaker open for %.1f s after %d failures",
                                self.reset_s, self._consecutive)


# --------------------------------------------------------------------------------------------
# Reading a record from GETRANGE pieces
# --------------------------------------------------------------------------------------------


class _RecordReader:
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
            dst[:] = data
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
            _Corrupt: the value does not verify.
        """
        if not self.exists:
            return None
        if self.error is not None:
            raise _Corrupt(self.error)
        if self.too_small:
            log.warning("get_into: out has %d bytes < payload %d", self.out.nbytes, self.n)
            return None
        if self.hdr is None:
            raise _Corrupt("no header was read")
        if self.got != self.n:
            raise _Corrupt(f"read {self.got} of {self.n} payload bytes")
        try:
            rec.verify_payload(self.hdr, self.out[: self.n])
        except rec.RecordError as e:
            raise _Corrupt(str(e)) from None
        return self.n


# --------------------------------------------------------------------------------------------
# Direct reads: the GETRANGE replies straight from the socket into the caller's buffer
# --------------------------------------------------------------------------------------------


def _check_deadline(deadline: float | None) -> None:
    """Raise ``redis.exceptions.TimeoutError`` once ``time.monotonic()`` is past ``deadline`` (None: never)."""
    if deadline is not None and time.monotonic() > deadline:
        raise redis.exceptions.TimeoutError("read deadline passed (the server sends too slowly)")


class _SocketReplies:
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
        _check_deadline(self.deadline)
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


def _read_record_direct(conn, cmds: list[tuple], reader: _RecordReader, deadline: float | None = None) -> None:
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
    rd = _SocketReplies(sock, getattr(conn._parser, "parse_error", None), deadline)
    reader.feed(rd.integer())  # EXISTS
    reader.feed(rd.integer())  # STRLEN
    for i in range(2, len(cmds)):
        k = rd.bulk_len()
        reader.i = i + 1
        if k > cmds[i][3] - cmds[i][2] + 1:  # more than the range asked for: not a GETRANGE reply
            raise redis.exceptions.InvalidResponse(f"GETRANGE reply of {k} bytes for a range of "
                                                   f"{cmds[i][3] - cmds[i][2] + 1}")
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


# --------------------------------------------------------------------------------------------
# The tier
# --------------------------------------------------------------------------------------------


class RedisTier(Tier):
    """Chunks as Redis/Valkey values (one self-describing record per key), through redis-py.

    Args:
        url: see the module docstring.
        password_env: name of an environment variable holding the password (wins over the URL).
        timeout_s: socket timeout of every blocking send/receive, seconds; also the longest a
            caller waits for a free pooled connection.
        connect_timeout_s: connect timeout, seconds.
        breaker_failures: consecutive failures that open the circuit breaker.
        breaker_reset_s: seconds the breaker stays open before one trial call.
        max_value_bytes: largest payload stored or accepted when loading (Redis's own limit,
            ``proto-max-bulk-len``, is 512 MB by default).
        max_connections: connections open at once (redis-py ``BlockingConnectionPool``; per node
            for Redis Cluster). A caller beyond waits up to ``timeout_s`` for one.
        key_prefix: prefix of every Redis key.
        ttl_s: optional expiry of stored chunks, seconds; None = no expiry.
        capacity_bytes: reported by :meth:`usage` (Redis's ``maxmemory`` governs the real limit).
        namespace: 16-byte namespace digest written into each record header (informational: the
            key already binds the namespace).
        piece_bytes: size of the ``SETRANGE``/``GETRANGE`` pieces large values move in.
        direct_reads: single instance (``redis://``, ``rediss://``, ``unix://``): receive the
            pieces of ``get_into`` straight from the socket into ``out`` (:class:`_SocketReplies`)
            instead of through redis-py's reply parser (which builds a ``bytes`` per piece that is
            then copied). Same commands, same checks; False restores the parser path (kept for
            comparison in benchmarks/bench_remote.py). Redis Cluster always uses redis-py.
        min_read_bytes_per_s: a single-instance read must average at least this rate: it fails
            (a miss, counted by the breaker) once ``4 * timeout_s + bytes / min_read_bytes_per_s``
            seconds have passed — the socket timeout alone bounds each receive, not a server that
            trickles a byte per timeout. Checked before every receive (direct reads) or reply
            (parser path).

    Raises:
        ValueError: malformed URL/arguments. TierError: authentication rejected by the server.

    Attributes:
        counters: ``collections.Counter`` with ``hits``, ``misses``, ``errors``, ``corrupt``,
            ``torn_reads`` (verification failed, the atomic re-read succeeded), ``puts``,
            ``put_failures``, ``breaker_rejects``; :attr:`breaker_open` and
            ``breaker.times_opened``.
    """

    name = "remote"

    def __init__(
        self,
        url: str,
        *,
        password_env: str | None = None,
        timeout_s: float = 0.5,
        connect_timeout_s: float = 0.5,
        breaker_failures: int = 3,
        breaker_reset_s: float = 5.0,
        max_value_bytes: int = 512 << 20,
        max_connections: int = 8,
        key_prefix: str = "lmtier:",
        ttl_s: int | None = None,
        capacity_bytes: int = 0,
        namespace: bytes = bytes(16),
        piece_bytes: int = DEFAULT_PIECE_BYTES,
        direct_reads: bool = True,
        min_read_bytes_per_s: float = 10e6,
    ) -> None:
        super().__init__()
        if timeout_s <= 0 or connect_timeout_s <= 0:
            raise ValueError("RedisTier: timeouts must be > 0")
        if breaker_failures < 1 or breaker_reset_s < 0:
            raise ValueError("RedisTier: breaker_failures must be >= 1 and breaker_reset_s >= 0")
        if max_connections < 1:
            raise ValueError(f"RedisTier: max_connections must be >= 1, got {max_connections}")
        if piece_bytes < 4096:
            raise ValueError(f"RedisTier: piece_bytes must be >= 4096, got {piece_bytes}")
        if not min_read_bytes_per_s > 0:
            raise ValueError(f"RedisTier: min_read_bytes_per_s must be > 0, got {min_read_bytes_per_s}")
        probe = key_prefix.encode() + bytes(KEY_BYTES).hex().encode()
        if redis.crc.key_slot(_tmp_name(probe)) != redis.crc.key_slot(probe):
            raise ValueError(f"RedisTier: key_prefix {key_prefix!r} has braces that are no hash tag; a temporary "
                             "key could not share the chunk key's cluster slot")
        self._target = parse_url(url, password_env=password_env)
        self.url = self._target.describe()
        self.timeout_s = timeout_s
        self.connect_timeout_s = connect_timeout_s
        self.max_value_bytes = max_value_bytes
        self.max_connections = max_connections
        self.key_prefix = key_prefix.encode()
        self.ttl_s = ttl_s
        self.capacity_bytes = capacity_bytes
        self.piece_bytes = piece_bytes
        self.direct_reads = bool(direct_reads)
        self.min_read_bytes_per_s = float(min_read_bytes_per_s)
        self._meta = rec.RecordMeta(namespace=bytes(namespace))
        self.breaker = CircuitBreaker(breaker_failures, breaker_reset_s)
        self.counters: collections.Counter = collections.Counter()
        self._lock = threading.Lock()
        self._pinned: BouncePool | None = None
        self._cluster = None
        self._client: redis.Redis | None = None
        if self._target.kind == "cluster":
            self._cluster = self._make_cluster()
        else:
            self._client = redis.Redis(connection_pool=self._make_pool())
            try:
                self._client.ping()
            except (redis.exceptions.AuthenticationError, redis.exceptions.AuthenticationWrongNumberOfArgsError,
                    redis.exceptions.NoPermissionError) as e:
                self._client.close()
                raise TierError(f"authentication to {self.url} failed: {type(e).__name__} "
                                "(check the password / password_env)") from None
            except Exception as e:  # noqa: BLE001 - unreachable, TLS handshake, timeouts: degrade
                self.counters["errors"] += 1
                log.warning("remote tier %s not reachable at startup (%s: %s); it degrades to misses", self.url,
                            type(e).__name__, e)
        log.info("remote tier %s via redis-py %s (timeout %.3f s, breaker %d/%.1f s, pieces %d KiB)", self.url,
                 redis.__version__, timeout_s, breaker_failures, breaker_reset_s, piece_bytes >> 10)

    @property
    def breaker_open(self) -> bool:
        return self.breaker.is_open

    # ---- public API ------------------------------------------------------------------------

    def contains(self, key: bytes) -> bool:
        return self.contains_many([key])[0]

    def contains_many(self, keys: list[bytes]) -> list[bool]:
        """One pipelined round trip of ``EXISTS`` per key; all False on any failure."""
        if not keys:
            return []
        names = [self._name(k) for k in keys]

        def op(client):
            p = client.pipeline(transaction=False)
            for n in names:
                p.exists(n)
            return [bool(x) for x in p.execute()]

        res = self._do(op)
        return res if res is not None else [False] * len(keys)

    def put(self, key: bytes, payload) -> bool:
        """Store the record (compact header + payload); visible only once complete. Returns success."""
        key = bytes(key)
        if len(key) != KEY_BYTES:
            raise ValueError(f"RedisTier.put: key must be {KEY_BYTES} bytes, got {len(key)}")
        bounce = None
        try:
            if is_cuda_tensor(payload):
                import torch

                n = cuda_nbytes(payload)
                bounce = self._pinned_pool().acquire(n)
                bounce.tensor(n).copy_(payload.detach().reshape(-1).view(torch.uint8))
                mv = bounce.mv[:n]
            else:
                mv = host_view(payload, writable=False)
            n = mv.nbytes
            if n > self.max_value_bytes:
                log.warning("put: payload of %d bytes exceeds max_value_bytes %d", n, self.max_value_bytes)
                return False
            header = rec.encode_header(key, n, rec.payload_checksum(mv), payload_offset=HEADER, meta=self._meta)
            name = self._name(key)
            ok = self._do(lambda client: self._put_op(client, name, header, mv))
            self.counters["puts" if ok else "put_failures"] += 1
            return bool(ok)
        finally:
            if bounce is not None:
                self._pinned_pool().release(bounce)

    def get_into(self, key: bytes, out) -> int | None:
        """Read the record into ``out`` and verify it.

        Args:
            key: 32-byte chunk key.
            out: writable contiguous host buffer or CUDA tensor of >= payload bytes.

        Returns:
            Payload bytes, or None on a miss, a too-small ``out``, a network failure, an open
            breaker, or a record that does not verify (which is then deleted).
        """
        key = bytes(key)
        if is_cuda_tensor(out):
            import torch

            out_u8 = out.detach().reshape(-1).view(torch.uint8)
            pool = self._pinned_pool()
            buf = pool.acquire(out_u8.numel())
            try:
                n = self.get_into(key, buf.mv[: out_u8.numel()])
                if n is not None:
                    out_u8[:n].copy_(buf.tensor(n))
                return n
            finally:
                pool.release(buf)
        out = host_view(out, writable=True)
        name = self._name(key)
        state: dict = {}

        def op(client):
            try:
                return self._get_op(client, name, key, out, atomic=False)
            except _Corrupt as first:
                # The pieces are separate commands: a concurrent overwrite may have torn the read.
                # Decide on an atomic (MULTI/EXEC) copy.
                try:
                    n = self._get_op(client, name, key, out, atomic=True)
                except _Corrupt as e:
                    state["corrupt"] = str(e)
                    return None
                log.info("remote value %s: torn read (%s); the atomic re-read verified", name.decode(), first)
                self.counters["torn_reads"] += 1
                return n

        n = self._do(op)
        if "corrupt" in state:
            log.warning("remote value %s is corrupt (%s); deleting it", name.decode(), state["corrupt"])
            self.counters["corrupt"] += 1
            self.delete(key)
        self.counters["hits" if n is not None else "misses"] += 1
        return n

    def delete(self, key: bytes) -> bool:
        name = self._name(key)
        return bool(self._do(lambda client: client.delete(name)))

    def forget(self, key: bytes) -> bool:
        """Always False: this tier keeps no local index (every lookup asks the server)."""
        self._name(key)  # validates the key
        return False

    def usage(self) -> TierUsage:
        """``capacity_bytes`` as configured; used bytes from ``INFO memory``; chunks = ``DBSIZE``
        (all keys of the database). Zeros when the server is unreachable."""
        res = self._do(lambda client: (client.info("memory").get("used_memory", 0), client.dbsize()))
        if res is None:
            return TierUsage(self.capacity_bytes, 0, 0)
        return TierUsage(self.capacity_bytes, int(res[0]), int(res[1]))

    def ping(self) -> bool:
        return self._do(lambda client: bool(client.ping())) is True

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client.connection_pool.disconnect()
        if self._cluster is not None:
            try:
                self._cluster.close()
            except Exception:  # noqa: BLE001
                pass
        if self._pinned is not None:
            self._pinned.close()

    # ---- data path -------------------------------------------------------------------------

    def _put_op(self, client, name: bytes, header: bytes, mv: memoryview) -> bool:
        n, piece = mv.nbytes, self.piece_bytes
        if HEADER + n <= piece:  # one piece: a single SET (the small concatenation is cheap)
            kw = {"ex": int(self.ttl_s)} if self.ttl_s else {}
            return bool(client.set(name, b"".join((header, mv)), **kw))
        tmp = _tmp_name(name)
        offs = list(range(0, n, piece))
        p = client.pipeline(transaction=False)
        p.execute_command("SETRANGE", tmp, HEADER + offs[-1], mv[offs[-1] :])  # allocates the whole value
        p.execute_command("EXPIRE", tmp, TMP_TTL_S)
        for o in offs[:-1]:
            p.execute_command("SETRANGE", tmp, HEADER + o, mv[o : o + piece])
        p.execute_command("SETRANGE", tmp, 0, header)
        p.execute_command("RENAME", tmp, name)
        if self.ttl_s:
            p.execute_command("EXPIRE", name, int(self.ttl_s))
        else:
            p.execute_command("PERSIST", name)
        replies = p.execute()
        lengths = [replies[0]] + replies[2 : 2 + len(offs)]  # the pieces and the header
        if any(int(x) != HEADER + n for x in lengths):
            # The temporary key vanished mid-write (evicted under maxmemory): what was renamed is
            # incomplete. Readers would reject it (checksum); remove it now.
            log.warning("put %s: temporary key lost during the write (lengths %s)", name.decode(), set(lengths))
            client.delete(name)
            return False
        return True

    def _get_cmds(self, name: bytes, cap: int) -> list[tuple]:
        end = HEADER + cap
        cmds = [("EXISTS", name), ("STRLEN", name)]
        cmds += [("GETRANGE", name, o, min(o + self.piece_bytes, end) - 1) for o in range(0, end, self.piece_bytes)]
        return cmds

    def _get_op(self, client, name: bytes, key: bytes, out: memoryview, *, atomic: bool) -> int | None:
        cap = min(out.nbytes, self.max_value_bytes)
        cmds = self._get_cmds(name, cap)
        reader = _RecordReader(key, out[:cap], self.piece_bytes, self.max_value_bytes)
        if atomic or self._cluster is not None:
            p = client.pipeline(transaction=atomic)
            for c in cmds:
                p.execute_command(*c)
            for r in p.execute():
                reader.feed(r)
        else:
            # Single instance: receive the pieces straight into ``out`` (direct_reads), or read the
            # replies one by one through redis-py's parser, copying each piece into ``out`` as it
            # arrives (only one piece-sized bytes object alive at a time).
            pool = client.connection_pool
            conn = pool.get_connection()
            deadline = time.monotonic() + 4 * self.timeout_s + cap / self.min_read_bytes_per_s
            try:
                # Direct reads use redis-py's connection internals (``_sock``, ``_parser``, present in
                # redis-py 5 to 8); a connection class without them takes the parser path.
                if self.direct_reads and hasattr(conn, "_sock") and hasattr(conn, "_parser"):
                    _read_record_direct(conn, cmds, reader, deadline)
                else:
                    conn.send_packed_command(conn.pack_commands(cmds))
                    for _ in cmds:
                        _check_deadline(deadline)
                        reader.feed(conn.read_response())
            except BaseException:
                conn.disconnect()  # replies may be left unread: never reuse this connection
                raise
            finally:
                pool.release(conn)
        return reader.finish()

    # ---- plumbing --------------------------------------------------------------------------

    def _name(self, key: bytes) -> bytes:
        key = bytes(key)
        if len(key) != KEY_BYTES:
            raise ValueError(f"RedisTier: key must be {KEY_BYTES} bytes, got {len(key)}")
        return self.key_prefix + key.hex().encode()

    def _pinned_pool(self) -> BouncePool:
        with self._lock:
            if self._pinned is None:
                self._pinned = BouncePool(max_cached=2, pinned=True)
            return self._pinned

    def _conn_kwargs(self) -> dict:
        t = self._target
        # protocol=2: the direct reads' reader (_SocketReplies) speaks RESP2. redis-py 8 would
        # negotiate RESP3 (HELLO 3) and subscribe to maintenance notifications, whose out-of-band
        # push frames (Redis Enterprise/Cloud) can arrive ahead of any reply.
        kw = dict(username=t.username, password=t.password, socket_timeout=self.timeout_s,
                  socket_connect_timeout=self.connect_timeout_s, protocol=2)
        if t.tls is not None:
            kw.update(ssl=True, ssl_ca_certs=t.tls.ca_certs, ssl_certfile=t.tls.certfile, ssl_keyfile=t.tls.keyfile,
                      ssl_cert_reqs=t.tls.cert_reqs, ssl_check_hostname=t.tls.check_hostname)
        return kw

    def _make_pool(self) -> redis.BlockingConnectionPool:
        t = self._target
        kw = self._conn_kwargs()
        if kw.pop("ssl", False):
            kw["connection_class"] = redis.SSLConnection
            kw.update(host=t.host, port=t.port)
        elif t.kind == "unix":
            kw["connection_class"] = redis.UnixDomainSocketConnection
            kw["path"] = t.path
        else:
            kw.update(host=t.host, port=t.port)
        return redis.BlockingConnectionPool(
            max_connections=self.max_connections, timeout=self.timeout_s, db=t.db,
            retry=Retry(NoBackoff(), 0), command_packer=_PACKER, **kw)

    def _do(self, op):
        """Run ``op(client)`` under the breaker; None on failure."""
        if not self.breaker.allow():
            self.counters["breaker_rejects"] += 1
            return None
        try:
            if self._cluster is not None:
                client = self._cluster.get() if isinstance(self._cluster, _LazyCluster) else self._cluster
            else:
                client = self._client
            res = op(client)
        except redis.exceptions.ResponseError as e:
            if isinstance(e, redis.exceptions.ClusterError):  # e.g. CLUSTERDOWN: an outage
                return self._failed(e)
            # The server answered (e.g. WRONGTYPE): not an outage.
            self.breaker.success()
            self.counters["errors"] += 1
            log.warning("remote tier %s: server error: %s", self.url, e)
            return None
        except Exception as e:  # noqa: BLE001 - connection/timeout/TLS/cluster-state errors of any kind
            return self._failed(e)
        except BaseException:
            self.breaker.failure()  # never leave a half-open trial pending
            raise
        self.breaker.success()
        return res

    def _failed(self, e: Exception) -> None:
        self.breaker.failure()
        self.counters["errors"] += 1
        log.debug("remote tier %s: %s: %s", self.url, type(e).__name__, e)
        return None

    def _make_cluster(self):
        t = self._target
        kw = self._conn_kwargs()
        kw.update(startup_nodes=[redis.cluster.ClusterNode(h, p) for h, p in t.nodes],
                  max_connections=self.max_connections)
        try:
            return redis.cluster.RedisCluster(**kw)
        except Exception as e:  # noqa: BLE001 - redis raises many types here
            if isinstance(e, redis.exceptions.AuthenticationError) or "WRONGPASS" in str(e) or "NOAUTH" in str(e):
                raise TierError(f"authentication to {t.describe()} failed (check the password / password_env)") from None
            self.counters["errors"] += 1
            log.warning("remote tier %s not reachable at startup (%s); it degrades to misses", t.describe(),
                        type(e).__name__)
            return _LazyCluster(kw)


class _LazyCluster:
    """Builds the RedisCluster client on first successful use (the cluster was down at startup)."""

    def __init__(self, kw: dict) -> None:
        self._kw = kw
        self._rc = None

    def get(self):
        if self._rc is None:
            self._rc = redis.cluster.RedisCluster(**self._kw)
        return self._rc

    def close(self) -> None:
        if self._rc is not None:
            self._rc.close()
