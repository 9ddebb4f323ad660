"""Remote tier (tier 3): Redis / Valkey, single instance or Redis Cluster.

One key per chunk, ``<key_prefix><key hex>`` (default prefix ``"lmtier:"``), whose value is a
self-describing record of :mod:`lmtier.record` with the compact header (``payload_offset = 128``)
followed by the payload, written with a single ``SET``: there is no separate metadata key that
could go out of sync. Eviction is Redis's own (``maxmemory`` + ``maxmemory-policy allkeys-lru``)
or an optional per-key TTL.

Client choice (measured, see benchmarks/bench_remote.py and benchmarks/RESULTS.md): for 32 MiB
values on loopback redis-py + hiredis reaches ~0.5–0.6 GB/s (it materialises each value as a
``bytes`` object, and a ``SET`` builds another), valkey-glide ~0.3–0.6 GB/s, while the server itself
(``redis-benchmark``) delivers ~1 GB/s. So single-instance URLs (``redis://``, ``rediss://``,
``unix://``) use a small built-in RESP2 client for the data path: ``SET`` sends header and payload
straight from the caller's buffer (``sendmsg`` scatter/gather, no concatenation) and ``GET`` reads
the value with ``recv_into`` straight into the caller's ``out`` buffer — one kernel copy, no
Python objects the size of the chunk. Redis Cluster (``redis-cluster://h:p,h:p``) goes through
``redis.cluster.RedisCluster`` (slot routing, redirections), with one extra copy per load.

Failure model: every call has a socket timeout (``timeout_s`` per blocking socket operation,
``connect_timeout_s`` for connects); a connection that saw any error is closed, never reused.
Network errors never reach the caller: loads become misses and stores return False, and they are
counted. After ``breaker_failures`` consecutive failures a circuit breaker opens: calls return a
miss/False immediately for ``breaker_reset_s``, then one trial call decides whether it closes.
Authentication failures at construction raise :class:`~lmtier.tiers.base.TierError` (a
configuration error); an unreachable server at construction only logs a warning.

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
import socket
import ssl
import threading
import time
import urllib.parse
from dataclasses import dataclass

from lmtier import record as rec
from lmtier.tiers.base import KEY_BYTES, Tier, TierError, TierUsage
from lmtier.tiers.disk import BouncePool, cuda_nbytes, host_view, is_cuda_tensor

log = logging.getLogger("lmtier.tiers.remote")

HEADER = rec.COMPACT_PAYLOAD_OFFSET
_RECV_CHUNK = 1 << 16


class _NetError(Exception):
    """A transport/protocol failure: the connection is discarded and the call counts as failed."""


class _ReplyError(Exception):
    """The server answered with an error reply (``-ERR ...``); the connection stays usable."""


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
    tls: ssl.SSLContext | None = None
    server_hostname: str | None = None

    def describe(self) -> str:  # never includes the password
        if self.kind == "unix":
            return f"unix://{self.path}"
        if self.kind == "cluster":
            return "redis-cluster://" + ",".join(f"{h}:{p}" for h, p in self.nodes)
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
        tls = ssl.create_default_context(cafile=q.get("ssl_ca_certs"))
        reqs = q.get("ssl_cert_reqs", "required").lower()
        if reqs not in ("required", "optional", "none"):
            raise ValueError(f"remote_url: ssl_cert_reqs must be required/optional/none, got {reqs!r}")
        if q.get("ssl_check_hostname", "true").lower() in ("false", "0", "no") or reqs == "none":
            tls.check_hostname = False
        tls.verify_mode = {"required": ssl.CERT_REQUIRED, "optional": ssl.CERT_OPTIONAL, "none": ssl.CERT_NONE}[reqs]
        if q.get("ssl_certfile"):
            tls.load_cert_chain(q["ssl_certfile"], q.get("ssl_keyfile"))
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
        return _Target("tcp", host=u.hostname, port=port, db=db, username=username, password=password, tls=tls,
                       server_hostname=u.hostname)
    if scheme == "unix":
        if not u.path:
            raise ValueError(f"remote_url {_redact(url)!r}: missing socket path")
        return _Target("unix", path=u.path, db=int(q.get("db", 0)), username=username, password=password)
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


# --------------------------------------------------------------------------------------------
# A minimal RESP2 connection for the data path
# --------------------------------------------------------------------------------------------


def _encode(*args: bytes) -> bytes:
    out = [b"*%d\r\n" % len(args)]
    for a in args:
        out.append(b"$%d\r\n%s\r\n" % (len(a), a))
    return b"".join(out)


class _RespConn:
    """One socket speaking RESP2. Not thread-safe; the pool hands it to one thread at a time."""

    def __init__(self, t: _Target, *, timeout_s: float, connect_timeout_s: float) -> None:
        self._timeout_s = timeout_s
        try:
            if t.kind == "unix":
                s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                s.settimeout(connect_timeout_s)
                s.connect(t.path)
            else:
                s = socket.create_connection((t.host, t.port), timeout=connect_timeout_s)
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                if t.tls is not None:
                    s = t.tls.wrap_socket(s, server_hostname=t.server_hostname)
            for opt in (socket.SO_RCVBUF, socket.SO_SNDBUF):
                try:
                    s.setsockopt(socket.SOL_SOCKET, opt, 4 << 20)
                except OSError:
                    pass
            s.settimeout(timeout_s)
        except (OSError, ssl.SSLError) as e:
            raise _NetError(f"connect to {t.describe()} failed: {e}") from None
        self.sock = s
        self._tls = t.tls is not None
        self._buf = bytearray(_RECV_CHUNK)
        self._view = memoryview(self._buf)
        self._start = 0
        self._end = 0
        if t.password is not None:
            args = [b"AUTH"] + ([t.username.encode()] if t.username else []) + [t.password.encode()]
            try:
                self.call(*args)
            except _ReplyError as e:
                self.close()
                raise TierError(f"authentication to {t.describe()} failed: {str(e).split(' ', 1)[0]} "
                                "(check the password / password_env)") from None
        if t.db:
            self.call(b"SELECT", str(t.db).encode())

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass

    # -- sending --
    def send(self, *parts) -> None:
        try:
            if self._tls or len(parts) == 1:
                for p in parts:
                    self.sock.sendall(p)
            else:
                _sendmsg_all(self.sock, list(parts))
        except (OSError, ssl.SSLError) as e:
            raise _NetError(f"send failed: {e}") from None

    # -- receiving --
    def _fill(self) -> None:
        if self._start == self._end:
            self._start = self._end = 0
        elif self._end == len(self._buf):
            n = self._end - self._start
            self._buf[:n] = self._buf[self._start : self._end]
            self._start, self._end = 0, n
        try:
            k = self.sock.recv_into(self._view[self._end :])
        except (OSError, ssl.SSLError) as e:
            raise _NetError(f"receive failed: {e}") from None
        if k == 0:
            raise _NetError("connection closed by the server")
        self._end += k

    def read_line(self) -> bytes:
        while True:
            i = self._buf.find(b"\r\n", self._start, self._end)
            if i >= 0:
                line = bytes(self._buf[self._start : i])
                self._start = i + 2
                return line
            if self._end - self._start > 1 << 20:
                raise _NetError("protocol error: line too long")
            self._fill()

    def read_exact_into(self, dst: memoryview) -> None:
        """Fill ``dst`` from the buffered bytes, then straight from the socket."""
        n = dst.nbytes
        have = min(n, self._end - self._start)
        if have:
            dst[:have] = self._view[self._start : self._start + have]
            self._start += have
        got = have
        try:
            while got < n:
                k = self.sock.recv_into(dst[got:])
                if k == 0:
                    raise _NetError("connection closed by the server")
                got += k
        except (OSError, ssl.SSLError) as e:
            raise _NetError(f"receive failed: {e}") from None

    def skip(self, n: int) -> None:
        scratch = self._view
        while n > 0:
            have = self._end - self._start
            if have == 0:
                self._fill()
                continue
            k = min(n, have)
            self._start += k
            n -= k
        del scratch

    def read_reply(self):
        line = self.read_line()
        if not line:
            raise _NetError("protocol error: empty line")
        t, rest = line[:1], line[1:]
        if t == b"+":
            return rest
        if t == b"-":
            raise _ReplyError(rest.decode(errors="replace"))
        if t == b":":
            return int(rest)
        if t == b"$":
            n = int(rest)
            if n < 0:
                return None
            dst = bytearray(n + 2)
            self.read_exact_into(memoryview(dst))
            return bytes(dst[:n])
        if t == b"*":
            n = int(rest)
            return None if n < 0 else [self.read_reply() for _ in range(n)]
        raise _NetError(f"protocol error: unexpected reply type {t!r}")

    def call(self, *args: bytes):
        self.send(_encode(*args))
        return self.read_reply()


def _sendmsg_all(sock: socket.socket, parts: list) -> None:
    views = [memoryview(p).cast("B") for p in parts if len(p)]
    while views:
        k = sock.sendmsg(views[:64])
        while k > 0:
            if k >= views[0].nbytes:
                k -= views[0].nbytes
                views.pop(0)
            else:
                views[0] = views[0][k:]
                k = 0


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
# The tier
# --------------------------------------------------------------------------------------------


class RedisTier(Tier):
    """Chunks as Redis/Valkey values (one self-describing record per key).

    Args:
        url: see the module docstring.
        password_env: name of an environment variable holding the password (wins over the URL).
        timeout_s: socket timeout of every blocking send/receive, seconds.
        connect_timeout_s: connect timeout, seconds.
        breaker_failures: consecutive failures that open the circuit breaker.
        breaker_reset_s: seconds the breaker stays open before one trial call.
        max_value_bytes: largest payload stored or accepted when loading (Redis's own limit,
            ``proto-max-bulk-len``, is 512 MB by default).
        max_connections: idle connections kept for reuse (one per concurrent caller is opened).
        key_prefix: prefix of every Redis key.
        ttl_s: optional expiry of stored chunks, seconds (``SET ... EX``); None = no expiry.
        capacity_bytes: reported by :meth:`usage` (Redis's ``maxmemory`` governs the real limit).
        namespace: 16-byte namespace digest written into each record header (informational: the
            key already binds the namespace).

    Raises:
        ValueError: malformed URL/arguments. TierError: authentication rejected by the server.

    Attributes:
        counters: ``collections.Counter`` with ``hits``, ``misses``, ``errors``, ``corrupt``,
            ``puts``, ``put_failures``, ``breaker_rejects``; :attr:`breaker_open` and
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
    ) -> None:
        if timeout_s <= 0 or connect_timeout_s <= 0:
            raise ValueError("RedisTier: timeouts must be > 0")
        if breaker_failures < 1 or breaker_reset_s < 0:
            raise ValueError("RedisTier: breaker_failures must be >= 1 and breaker_reset_s >= 0")
        self._target = parse_url(url, password_env=password_env)
        self.url = self._target.describe()
        self.timeout_s = timeout_s
        self.connect_timeout_s = connect_timeout_s
        self.max_value_bytes = max_value_bytes
        self.max_connections = max_connections
        self.key_prefix = key_prefix.encode()
        self.ttl_s = ttl_s
        self.capacity_bytes = capacity_bytes
        self._meta = rec.RecordMeta(namespace=bytes(namespace))
        self.breaker = CircuitBreaker(breaker_failures, breaker_reset_s)
        self.counters: collections.Counter = collections.Counter()
        self._lock = threading.Lock()
        self._idle: list[_RespConn] = []
        self._pinned: BouncePool | None = None
        self._cluster = None
        if self._target.kind == "cluster":
            self._cluster = self._make_cluster()
        else:
            try:
                conn = self._acquire()
                conn.call(b"PING")
                self._release(conn)
            except TierError:
                raise
            except (_NetError, _ReplyError) as e:
                self.counters["errors"] += 1
                log.warning("remote tier %s not reachable at startup (%s); it degrades to misses", self.url, e)
        log.info("remote tier %s (timeout %.3f s, breaker %d/%.1f s)", self.url, timeout_s, breaker_failures,
                 breaker_reset_s)

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

        def op(conn):
            conn.send(b"".join(_encode(b"EXISTS", n) for n in names))
            return [bool(conn.read_reply()) for _ in names]

        def cop(rc):
            p = rc.pipeline(transaction=False)
            for n in names:
                p.exists(n)
            return [bool(x) for x in p.execute()]

        res = self._do(op, cop)
        return res if res is not None else [False] * len(keys)

    def put(self, key: bytes, payload) -> bool:
        """``SET`` the record (compact header + payload) in one command. Returns success."""
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
            ex = [b"EX", str(int(self.ttl_s)).encode()] if self.ttl_s else []
            prefix = b"*%d\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$%d\r\n" % (3 + len(ex), len(name), name, HEADER + n)
            suffix = b"\r\n" + b"".join(b"$%d\r\n%s\r\n" % (len(a), a) for a in ex)

            def op(conn):
                conn.send(prefix, header, mv, suffix)
                return conn.read_reply() == b"OK"

            def cop(rc):
                kw = {"ex": int(self.ttl_s)} if self.ttl_s else {}
                return bool(rc.set(name, header + bytes(mv), **kw))

            ok = self._do(op, cop)
            self.counters["puts" if ok else "put_failures"] += 1
            return bool(ok)
        finally:
            if bounce is not None:
                self._pinned_pool().release(bounce)

    def get_into(self, key: bytes, out) -> int | None:
        """``GET`` the record straight into ``out`` and verify it.

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
        state = {}

        def op(conn):
            conn.send(_encode(b"GET", name))
            line = conn.read_line()
            if line.startswith(b"-"):
                raise _ReplyError(line[1:].decode(errors="replace"))
            if not line.startswith(b"$"):
                raise _NetError(f"protocol error: {line[:20]!r}")
            total = int(line[1:])
            if total < 0:
                return None
            if total < HEADER:
                conn.skip(total + 2)
                state["corrupt"] = f"value of {total} bytes is shorter than the header"
                return None
            hb = bytearray(HEADER)
            conn.read_exact_into(memoryview(hb))
            rest = total - HEADER
            try:
                hdr = rec.decode_header(hb, expected_key=key, max_payload_bytes=self.max_value_bytes)
                if hdr.payload_offset != HEADER or hdr.payload_bytes != rest:
                    raise rec.RecordError(f"value length {total} != header {HEADER} + payload {hdr.payload_bytes}")
            except rec.RecordError as e:
                conn.skip(rest + 2)
                state["corrupt"] = str(e)
                return None
            if out.nbytes < rest:
                conn.skip(rest + 2)
                log.warning("get_into: out has %d bytes < payload %d", out.nbytes, rest)
                return None
            conn.read_exact_into(out[:rest])
            conn.skip(2)
            try:
                rec.verify_payload(hdr, out[:rest])
            except rec.RecordError as e:
                state["corrupt"] = str(e)
                return None
            return rest

        def cop(rc):
            v = rc.get(name)
            if v is None:
                return None
            try:
                hdr = rec.decode_header(v, expected_key=key, max_payload_bytes=self.max_value_bytes)
                if hdr.payload_offset != HEADER or hdr.payload_bytes != len(v) - HEADER:
                    raise rec.RecordError(f"value length {len(v)} != header + payload {hdr.payload_bytes}")
                if out.nbytes < hdr.payload_bytes:
                    return None
                out[: hdr.payload_bytes] = memoryview(v)[HEADER:]
                rec.verify_payload(hdr, out[: hdr.payload_bytes])
            except rec.RecordError as e:
                state["corrupt"] = str(e)
                return None
            return hdr.payload_bytes

        n = self._do(op, cop)
        if "corrupt" in state:
            log.warning("remote value %s is corrupt (%s); deleting it", name.decode(), state["corrupt"])
            self.counters["corrupt"] += 1
            self.delete(key)
        self.counters["hits" if n is not None else "misses"] += 1
        return n

    def delete(self, key: bytes) -> bool:
        name = self._name(key)
        res = self._do(lambda c: c.call(b"DEL", name), lambda rc: rc.delete(name))
        return bool(res)

    def usage(self) -> TierUsage:
        """``capacity_bytes`` as configured; used bytes from ``INFO memory``; chunks = ``DBSIZE``
        (all keys of the database). Zeros when the server is unreachable."""

        def op(conn):
            info = conn.call(b"INFO", b"memory")
            return info, conn.call(b"DBSIZE")

        def cop(rc):
            return rc.info("memory").get("used_memory", 0), rc.dbsize()

        res = self._do(op, cop)
        if res is None:
            return TierUsage(self.capacity_bytes, 0, 0)
        info, dbsize = res
        if isinstance(info, bytes):
            used = 0
            for line in info.split(b"\r\n"):
                if line.startswith(b"used_memory:"):
                    used = int(line.split(b":", 1)[1])
            info = used
        return TierUsage(self.capacity_bytes, int(info), int(dbsize))

    def ping(self) -> bool:
        return self._do(lambda c: c.call(b"PING") == b"PONG", lambda rc: bool(rc.ping())) is True

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for c in idle:
            c.close()
        if self._cluster is not None:
            try:
                self._cluster.close()
            except Exception:
                pass
        if self._pinned is not None:
            self._pinned.close()

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

    def _acquire(self) -> _RespConn:
        with self._lock:
            if self._idle:
                return self._idle.pop()
        return _RespConn(self._target, timeout_s=self.timeout_s, connect_timeout_s=self.connect_timeout_s)

    def _release(self, conn: _RespConn) -> None:
        with self._lock:
            if len(self._idle) < self.max_connections:
                self._idle.append(conn)
                return
        conn.close()

    def _do(self, op, cluster_op):
        """Run ``op(conn)`` (or ``cluster_op(RedisCluster)``) under the breaker; None on failure."""
        if not self.breaker.allow():
            self.counters["breaker_rejects"] += 1
            return None
        if self._cluster is not None:
            return self._do_cluster(cluster_op)
        conn = None
        try:
            conn = self._acquire()
            res = op(conn)
        except _ReplyError as e:
            # The server is alive and the connection in sync: an error reply is not an outage.
            self._release(conn)
            self.breaker.success()
            self.counters["errors"] += 1
            log.warning("remote tier %s: server error: %s", self.url, e)
            return None
        except (_NetError, TierError, ValueError) as e:
            if conn is not None:
                conn.close()
            self.breaker.failure()
            self.counters["errors"] += 1
            log.debug("remote tier %s: %s", self.url, e)
            return None
        except BaseException:
            if conn is not None:
                conn.close()
            self.breaker.failure()  # never leave a half-open trial pending
            raise
        self._release(conn)
        self.breaker.success()
        return res

    def _make_cluster(self):
        from redis.cluster import ClusterNode, RedisCluster

        t = self._target
        kw = dict(
            startup_nodes=[ClusterNode(h, p) for h, p in t.nodes],
            username=t.username,
            password=t.password,
            socket_timeout=self.timeout_s,
            socket_connect_timeout=self.connect_timeout_s,
        )
        if t.tls is not None:
            kw.update(ssl=True, ssl_cert_reqs=t.tls.verify_mode, ssl_check_hostname=t.tls.check_hostname)
        try:
            return RedisCluster(**kw)
        except Exception as e:  # noqa: BLE001 - redis raises many types here
            if "auth" in type(e).__name__.lower() or "WRONGPASS" in str(e) or "NOAUTH" in str(e):
                raise TierError(f"authentication to {t.describe()} failed (check the password / password_env)") from None
            self.counters["errors"] += 1
            log.warning("remote tier %s not reachable at startup (%s); it degrades to misses", t.describe(),
                        type(e).__name__)
            return _LazyCluster(kw)

    def _do_cluster(self, cluster_op):
        import redis

        try:
            rc = self._cluster.get() if isinstance(self._cluster, _LazyCluster) else self._cluster
            res = cluster_op(rc)
        except redis.exceptions.ResponseError as e:
            # The cluster answered (e.g. WRONGTYPE): not an outage.
            self.breaker.success()
            self.counters["errors"] += 1
            log.warning("remote tier %s: server error: %s", self.url, e)
            return None
        except Exception as e:  # noqa: BLE001 - connection/timeout/cluster-state errors of any kind
            self.breaker.failure()
            self.counters["errors"] += 1
            log.debug("remote tier %s: %s: %s", self.url, type(e).__name__, e)
            return None
        self.breaker.success()
        return res


class _LazyCluster:
    """Builds the RedisCluster client on first successful use (the cluster was down at startup)."""

    def __init__(self, kw: dict) -> None:
        self._kw = kw
        self._rc = None

    def get(self):
        if self._rc is None:
            from redis.cluster import RedisCluster

            self._rc = RedisCluster(**self._kw)
        return self._rc

    def close(self) -> None:
        if self._rc is not None:
            self._rc.close()
