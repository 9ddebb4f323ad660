"""Remote tier (tier 3): Redis / Valkey, single instance or Redis Cluster, through redis-py.

One key per chunk, ``<key_prefix><key hex>`` (default prefix ``"lmtier:"``), whose value is a
self-describing record of :mod:`lmtier.record` with the compact header (``payload_offset = 128``)
followed by the payload: there is no separate metadata key that could go out of sync. Eviction is
Redis's own (``maxmemory`` + ``maxmemory-policy allkeys-lru``) or an optional per-key TTL — or,
with per-tenant budgets (``budgets``: ``remote_tenant_share(s)`` + ``remote_tenant_capacity``),
lmtier's: every put ends in a Lua script that evicts by the tenant policy and accounts the record
atomically (:mod:`lmtier.tiers.redis.budget`; then set ``maxmemory-policy`` to ``noeviction`` or
``volatile-*``: under ``allkeys-*`` the budgets do not hold, and lmtier only warns at start-up).

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
  socket by :class:`~lmtier.tiers.redis.resp.SocketReplies`, a minimal RESP2 reader: each piece's bytes go straight into
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
whether it closes. Authentication failures, a database the server refuses and a TLS handshake
that cannot succeed (an untrusted certificate, or a ``rediss://`` URL pointed at a plain-text
server: :mod:`lmtier.tiers.redis.startup`) at construction raise
:class:`~lmtier.tiers.base.TierError` (a configuration error naming the URL, never the password);
an unreachable server at construction only logs a warning.

Endpoints: :class:`lmtier.remote_url.RedisEndpoint`, parsed once by
:func:`lmtier.remote_url.parse_redis_url` (``redis://``, ``rediss://`` with TLS query parameters,
``unix://``, ``redis-cluster://``, ``rediss-cluster://``; see that module for the grammar, the
meaning of a lone ``secret@`` — a password — and ``password_env``). :meth:`RedisTier.from_config`
builds the tier from the config's :class:`lmtier.config.RemoteConfig`, whose endpoint the config
parsed. Passwords are never logged.

CUDA tensors as ``payload`` / ``out`` go through the device adapter
(:class:`lmtier.tiers.device.PinnedBounce`). Module layout: this file (the tier),
:mod:`lmtier.tiers.redis.resp` (reading a record's replies), :mod:`lmtier.tiers.breaker`.
Logging: ``logging.getLogger("lmtier.tiers.remote")`` (the tier's name).
"""

from __future__ import annotations

import collections
import logging
import os
import time
from typing import TYPE_CHECKING, Any

import redis
import redis.cluster
import redis.crc
from redis.backoff import NoBackoff
from redis.connection import Encoder, PythonRespSerializer
from redis.retry import Retry

from lmtier import record as rec
from lmtier.remote_url import RedisEndpoint, parse_redis_url
from lmtier.tiers.base import KEY_BYTES, Tier, TierError, TierUsage
from lmtier.tiers.breaker import CircuitBreaker
from lmtier.tiers.device import PinnedBounce
from lmtier.tiers.redis import resp
from lmtier.tiers.redis.budget import RedisBudget
from lmtier.tiers.redis.resp import HEADER, CorruptValue, RecordReader
from lmtier.tiers.redis.startup import tls_misconfiguration
from lmtier.tiers.tenants import DEFAULT_TENANT, SharedBudgets, check_tenant

if TYPE_CHECKING:
    from lmtier.config import RemoteConfig

__all__ = ["RedisTier", "DEFAULT_PIECE_BYTES", "TMP_TTL_S"]

log = logging.getLogger("lmtier.tiers.remote")

DEFAULT_PIECE_BYTES = 1 << 20
#: Lifetime of a temporary key, so that a write interrupted before its RENAME leaves no orphan.
TMP_TTL_S = 300

# redis-py's pure-Python packer: arguments above 6000 bytes and memoryviews are sent as they are
# (no concatenation), so payload pieces go from the caller's buffer to the socket.
_PACKER = PythonRespSerializer(6000, Encoder("utf-8", "strict", False).encode)


def _tmp_name(name: bytes) -> bytes:
    """A unique temporary key in the same Redis Cluster hash slot as ``name``."""
    i = name.find(b"{")
    has_tag = i >= 0 and name.find(b"}", i + 1) > i + 1  # Redis's rule: "{}" first means no hash tag
    base = name if has_tag else b"{" + name + b"}"
    return base + b".tmp." + os.urandom(8).hex().encode()


class RedisTier(Tier):
    """Chunks as Redis/Valkey values (one self-describing record per key), through redis-py.

    Args:
        endpoint: where to connect: a :class:`lmtier.remote_url.RedisEndpoint` (as the config
            parsed it, :meth:`from_config`), or a URL string, parsed here by
            :func:`lmtier.remote_url.parse_redis_url`.
        password_env: with a URL string only: the environment variable holding the password
            (the URL must then carry none).
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
        budgets: per-tenant budgets (:class:`~lmtier.tiers.tenants.SharedBudgets`;
            :mod:`lmtier.tiers.redis.budget`), or None (Redis's own eviction). Single instance only.

    Raises:
        ValueError: malformed URL (:class:`lmtier.remote_url.RemoteURLError`) or arguments; budgets
            with Redis Cluster.
        TierError: authentication rejected by the server; the server refuses the URL's database;
            a TLS handshake that cannot succeed (certificate not trusted, plain-text server).

    Attributes:
        endpoint: the :class:`~lmtier.remote_url.RedisEndpoint` it connects to.
        url: ``endpoint.describe()`` (for logs: no password).
        counters: ``collections.Counter`` with ``hits``, ``misses``, ``errors``, ``corrupt``,
            ``torn_reads`` (verification failed, the atomic re-read succeeded), ``puts``,
            ``put_failures``, ``breaker_rejects``, ``budget_denied`` (puts refused by the
            tenant policy); :attr:`breaker_open` and ``breaker.times_opened``.
        budget: the :class:`~lmtier.tiers.redis.budget.RedisBudget`, or None.
    """

    name = "remote"

    def __init__(
        self,
        endpoint: RedisEndpoint | str,
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
        budgets: SharedBudgets | None = None,
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
            raise ValueError(
                f"RedisTier: key_prefix {key_prefix!r} has braces that are no hash tag; a temporary "
                "key could not share the chunk key's cluster slot"
            )
        if isinstance(endpoint, str):
            endpoint = parse_redis_url(endpoint, password_env=password_env)

        elif password_env is not None:
            raise ValueError("RedisTier: password_env applies to a URL string; an endpoint carries its password")
        if not isinstance(endpoint, RedisEndpoint):
            raise TypeError(f"RedisTier: endpoint must be a RedisEndpoint or a URL, got {type(endpoint).__name__}")
        if budgets is not None and endpoint.kind == "cluster":
            raise ValueError(
                "RedisTier: per-tenant budgets need a single instance (a script must see the accounting "
                "and the record in one hash slot); not available with Redis Cluster"
            )
        self.endpoint = endpoint
        self.url = endpoint.describe()
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
        self.budget = None if budgets is None else RedisBudget(budgets, self.key_prefix, ttl_s=ttl_s)
        if budgets is not None and capacity_bytes == 0:
            self.capacity_bytes = budgets.capacity_bytes
        self.breaker = CircuitBreaker(breaker_failures, breaker_reset_s)
        self.counters: collections.Counter = collections.Counter()
        self._device = PinnedBounce(max_cached=2)  # CUDA payloads / destinations
        self._cluster = None
        self._client: redis.Redis | None = None
        if self.endpoint.kind == "cluster":
            self._cluster = self._make_cluster()
        else:
            self._client = redis.Redis(connection_pool=self._make_pool())
            try:
                self._client.ping()
                if self.budget is not None:
                    self.budget.load(self._client)
                    self.budget.check_server(self._client)
            except (
                redis.exceptions.AuthenticationError,
                redis.exceptions.AuthenticationWrongNumberOfArgsError,
                redis.exceptions.NoPermissionError,
            ) as e:
                self._client.close()
                raise TierError(
                    f"authentication to {self.url} failed: {type(e).__name__} (check the password / password_env)"
                ) from None
            except Exception as e:  # noqa: BLE001 - unreachable, timeouts: degrade
                if isinstance(e, redis.exceptions.ResponseError) and "DB index" in str(e):
                    self._client.close()  # the server refused the URL's database: a setting, not an outage
                    raise TierError(
                        f"remote_url {self.url}: the server refuses database {self.endpoint.db}: {e}"
                    ) from None
                self._refuse_tls_misconfiguration(e, self._client.close)
                self.counters["errors"] += 1
                log.warning(
                    "remote tier %s not reachable at startup (%s: %s); it degrades to misses",
                    self.url,
                    type(e).__name__,
                    e,
                )
        log.info(
            "remote tier %s via redis-py %s (timeout %.3f s, breaker %d/%.1f s, pieces %d KiB)",
            self.url,
            redis.__version__,
            timeout_s,
            breaker_failures,
            breaker_reset_s,
            piece_bytes >> 10,
        )

    @classmethod
    def from_config(cls, remote: RemoteConfig, **kwargs: Any) -> RedisTier:
        """The tier of a loaded configuration: the endpoint the config parsed (no second parse),
        ``remote_timeout_s`` and the per-tenant budgets (``remote_tenant_*``); ``kwargs`` go to the
        constructor (pieces, TTL, ...).

        Raises:
            ValueError: the remote tier is off in ``remote``.
            TierError: as the constructor (authentication, database, TLS).
        """
        if remote.endpoint is None:
            raise ValueError("RedisTier.from_config: the remote tier is off (remote_url is not set)")
        kwargs.setdefault("timeout_s", remote.timeout_s)
        kwargs.setdefault("budgets", remote.tenants)
        return cls(remote.endpoint, **kwargs)

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

    @property
    def tenant_budgets(self) -> SharedBudgets | None:
        """The per-tenant budgets, or None (Redis's own eviction)."""
        return None if self.budget is None else self.budget.budgets

    def tenant_stats(self) -> dict[str, dict[str, int]]:
        """Per tenant, this node's budget counts (:meth:`RedisBudget.tenant_stats
        <lmtier.tiers.redis.budget.RedisBudget.tenant_stats>`); ``{}`` without budgets."""
        return {} if self.budget is None else self.budget.tenant_stats()

    def budget_usage(self) -> dict[str, dict[str, int]] | None:
        """The store's per-tenant accounting now (:meth:`RedisBudget.usage
        <lmtier.tiers.redis.budget.RedisBudget.usage>`); None without budgets or on failure."""
        b = self.budget
        return None if b is None else self._do(b.usage)

    def reconcile_budgets(self) -> int | None:
        """A whole reconcile pass (accounting of records deleted behind lmtier's back); the entries
        removed, or None without budgets or on failure. Puts run one step now and then by themselves."""
        b = self.budget
        return None if b is None else self._do(b.reconcile_all)

    def put(self, key: bytes, payload, *, tenant: str = DEFAULT_TENANT) -> bool:
        """Store the record (compact header + payload); visible only once complete. Returns success
        (False also when the tenant policy denies it: ``counters["budget_denied"]``).

        ``tenant``: the chunk's tenant (:func:`~lmtier.tiers.tenants.tenant_id`), used with budgets.

        Raises:
            ValueError: a key that is not 32 bytes; with budgets, a ``tenant`` that is no tenant id.
        """
        key = bytes(key)
        if self.budget is not None:
            check_tenant(tenant)
        if len(key) != KEY_BYTES:
            raise ValueError(f"RedisTier.put: key must be {KEY_BYTES} bytes, got {len(key)}")
        with self._device.host_payload(payload) as mv:
            n = mv.nbytes
            if n > self.max_value_bytes:
                log.warning("put: payload of %d bytes exceeds max_value_bytes %d", n, self.max_value_bytes)
                return False
            header = rec.encode_header(key, n, rec.payload_checksum(mv), payload_offset=HEADER, meta=self._meta)
            name = self._name(key)
            ok = self._do(lambda client: self._put_op(client, name, header, mv, tenant))
            self.counters["puts" if ok else "put_failures"] += 1
            b = self.budget
            if b is not None and b.reconcile_due():
                self._do(b.reconcile_step)
            return bool(ok)

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
        return self._device.get_into(out, lambda mv: self._get_host(key, mv))

    def _get_host(self, key: bytes, out: memoryview) -> int | None:
        """:meth:`get_into` into the host view ``out``."""
        name = self._name(key)
        state: dict = {}

        def op(client):
            try:
                return self._get_op(client, name, key, out, atomic=False)
            except CorruptValue as first:
                # The pieces are separate commands: a concurrent overwrite may have torn the read.
                # Decide on an atomic (MULTI/EXEC) copy.
                try:
                    n = self._get_op(client, name, key, out, atomic=True)
                except CorruptValue as e:
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
        if n is not None and self.budget is not None:
            batch = self.budget.touched(name)
            if batch:
                b = self.budget
                self._do(lambda client: b.touch(client, batch))
        return n

    def delete(self, key: bytes) -> bool:
        """Delete the record (with budgets: and its accounting, in one script)."""
        name = self._name(key)
        b = self.budget
        if b is not None:
            return bool(self._do(lambda client: b.drop(client, name)))
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
        b = self.budget
        if b is not None and self._client is not None:
            batch = b.take_touched()
            if batch:
                self._do(lambda client: b.touch(client, batch))
        if self._client is not None:
            self._client.close()
            self._client.connection_pool.disconnect()
        if self._cluster is not None:
            try:
                self._cluster.close()
            except Exception:  # noqa: BLE001
                pass
        self._device.close()

    # ---- data path -------------------------------------------------------------------------

    def _put_op(self, client, name: bytes, header: bytes, mv: memoryview, tenant: str = DEFAULT_TENANT) -> bool:
        n, piece = mv.nbytes, self.piece_bytes
        b = self.budget
        if HEADER + n <= piece and b is None:  # one piece: a single SET (the small concatenation is cheap)
            kw = {"ex": int(self.ttl_s)} if self.ttl_s else {}
            return bool(client.set(name, b"".join((header, mv)), **kw))
        tmp = _tmp_name(name)
        offs = list(range(0, n, piece))
        p = client.pipeline(transaction=False)
        if HEADER + n <= piece:  # budgets: SET under the temporary key, the script renames it
            p.execute_command("SET", tmp, b"".join((header, mv)), "EX", TMP_TTL_S)
        else:
            p.execute_command("SETRANGE", tmp, HEADER + offs[-1], mv[offs[-1] :])  # allocates the whole value
            p.execute_command("EXPIRE", tmp, TMP_TTL_S)
            for o in offs[:-1]:
                p.execute_command("SETRANGE", tmp, HEADER + o, mv[o : o + piece])
            p.execute_command("SETRANGE", tmp, 0, header)
        if b is not None:  # the commit script checks the length, evicts, renames and accounts at once
            call = b.queue_commit(p, tmp, name, tenant, HEADER + n)
            replies = p.execute(raise_on_error=False)
            for r in replies[:-1]:
                if isinstance(r, Exception):
                    raise r
            status = b.finish_commit(client, replies[-1], call, tenant)
            if status == 0:
                self.counters["budget_denied"] += 1
            return status == 1
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
        reader = RecordReader(key, out[:cap], self.piece_bytes, self.max_value_bytes)
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
                    resp.read_record_direct(conn, cmds, reader, deadline)
                else:
                    conn.send_packed_command(conn.pack_commands(cmds))
                    for _ in cmds:
                        resp.check_deadline(deadline)
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

    def _conn_kwargs(self) -> dict:
        t = self.endpoint
        # protocol=2: the direct reads' reader (resp.SocketReplies) speaks RESP2. redis-py 8 would
        # negotiate RESP3 (HELLO 3) and subscribe to maintenance notifications, whose out-of-band
        # push frames (Redis Enterprise/Cloud) can arrive ahead of any reply.
        kw = dict(
            username=t.username,
            password=t.password,
            socket_timeout=self.timeout_s,
            socket_connect_timeout=self.connect_timeout_s,
            protocol=2,
        )
        if t.tls is not None:
            kw.update(
                ssl=True,
                ssl_ca_certs=t.tls.ca_certs,
                ssl_certfile=t.tls.certfile,
                ssl_keyfile=t.tls.keyfile,
                ssl_cert_reqs=t.tls.cert_reqs,
                ssl_check_hostname=t.tls.check_hostname,
            )
        return kw

    def _make_pool(self) -> redis.BlockingConnectionPool:
        t = self.endpoint
        kw = self._conn_kwargs()
        if kw.pop("ssl", False):
            kw["connection_class"] = redis.SSLConnection
            kw.update(host=t.host, port=t.port)
        elif t.kind == "unix":
            kw["connection_class"] = redis.UnixDomainSocketConnection
            kw["path"] = t.socket_path
        else:
            kw.update(host=t.host, port=t.port)
        return redis.BlockingConnectionPool(
            max_connections=self.max_connections,
            timeout=self.timeout_s,
            db=t.db,
            retry=Retry(NoBackoff(), 0),
            command_packer=_PACKER,
            **kw,
        )

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

    def _refuse_tls_misconfiguration(self, e: Exception, close) -> None:
        """Raise TierError (after ``close()``) when the start-up failure ``e`` is a TLS setting that
        cannot work (:func:`lmtier.tiers.redis.startup.tls_misconfiguration`); return on an outage."""
        why = tls_misconfiguration(self.endpoint, e, connect_timeout_s=self.connect_timeout_s, timeout_s=self.timeout_s)
        if why is not None:
            close()
            raise TierError(f"remote_url {self.url}: {why}") from None

    def _make_cluster(self):
        t = self.endpoint
        kw = self._conn_kwargs()
        kw.update(
            startup_nodes=[redis.cluster.ClusterNode(h, p) for h, p in t.hosts], max_connections=self.max_connections
        )
        try:
            return redis.cluster.RedisCluster(**kw)
        except Exception as e:  # noqa: BLE001 - redis raises many types here
            if isinstance(e, redis.exceptions.AuthenticationError) or "WRONGPASS" in str(e) or "NOAUTH" in str(e):
                raise TierError(
                    f"authentication to {t.describe()} failed (check the password / password_env)"
                ) from None
            self._refuse_tls_misconfiguration(e, lambda: None)
            self.counters["errors"] += 1
            log.warning(
                "remote tier %s not reachable at startup (%s); it degrades to misses", t.describe(), type(e).__name__
            )
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
