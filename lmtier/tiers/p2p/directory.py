"""The P2P directory: which node's CPU pool holds which chunk, and how to reach each node, kept in
Redis/Valkey through redis-py.

Redis keys (``<ns>`` is the hex of the 16-byte namespace digest, so only nodes of the same
namespace — model, geometry, dtype, TP rank/size, format — ever see each other's entries)::

    <prefix>p2p:<ns>:c:<chunk key hex>   hash: node id -> Entry (40 bytes + 16-byte MAC)
    <prefix>p2p:<ns>:n:<node id>         string: NodeRecord (NIXL agent metadata, arena address)

A chunk's hash expires ``entry_ttl_s`` after its last publication (a holder refreshes it); a node
record after ``node_ttl_s`` (its heartbeat refreshes it), so a dead node's entries are ignored as
soon as its record is gone, and deleted with their hash later.

Entry (little-endian, ``"<4sHHQQQQQ"`` + 16-byte MAC)::

    magic b"LP2E", version 1, flags 0, epoch (the publishing process), slot offset in the publisher's
    arena (bytes), payload length (bytes), generation (publisher's counter), payload xxh3-64, MAC

The MAC is keyed BLAKE2b-128 (RFC 7693) over the namespace digest, the chunk key, the node id and
the fields above, keyed with the shared token (``p2p_token_env``; unkeyed without one, which only
catches accidents). It binds an entry to its chunk key and namespace: an entry copied under another
chunk's key, namespace or node does not verify. A NodeRecord is MACed the same way over the node id
and its fields. Entries or records that do not verify are refused (counted), never used.

Failure model: socket timeouts of ``timeout_s`` on every call, no retries, one
:class:`~lmtier.tiers.breaker.CircuitBreaker`; a failed call is an empty answer (a miss) or a dropped
publication, never an exception to the caller.

Logging: ``logging.getLogger("lmtier.tiers.p2p")``.
"""

from __future__ import annotations

import collections
import hashlib
import hmac
import logging
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from lmtier.remote_url import RedisEndpoint
from lmtier.tiers.breaker import CircuitBreaker

__all__ = ["Entry", "NodeRecord", "Directory", "MAC_BYTES"]

log = logging.getLogger("lmtier.tiers.p2p")

MAC_BYTES = 16
_ENTRY = struct.Struct("<4sHHQQQQQ")
_ENTRY_MAGIC = b"LP2E"
_NODE = struct.Struct("<4sHHQQQQI")
_NODE_MAGIC = b"LP2N"
_VERSION = 1
_MAX_NODE_RECORD = 1 << 20
# Delete a hash field only while it still holds the value the caller saw (a stale entry), so a
# concurrent re-publication by its owner survives.
_DROP_IF_SAME = (
    "if redis.call('HGET', KEYS[1], ARGV[1]) == ARGV[2] then return redis.call('HDEL', KEYS[1], ARGV[1]) end return 0"
)


def _mac(token: bytes | None, person: bytes, *parts: bytes) -> bytes:
    key = (
        b"" if not token else token if len(token) <= 64 else hashlib.blake2b(token).digest()
    )  # BLAKE2b keys: <= 64 bytes
    h = hashlib.blake2b(digest_size=MAC_BYTES, key=key, person=person)
    for p in parts:
        h.update(struct.pack("<I", len(p)))
        h.update(p)
    return h.digest()


@dataclass(frozen=True)
class Entry:
    """Where one node holds one chunk.

    Attributes:
        epoch: the publishing process's random 64-bit epoch (its NodeRecord carries the same).
        offset: byte offset of the chunk's slot in the publisher's registered arena.
        length: payload bytes.
        generation: the publisher's publication counter (informational; a re-published chunk gets
            a new one).
        xxh3: xxh3-64 of the payload bytes as published (lmtier.record.payload_checksum).
    """

    epoch: int
    offset: int
    length: int
    generation: int
    xxh3: int

    def encode(self, token: bytes | None, namespace: bytes, key: bytes, node_id: str) -> bytes:
        body = _ENTRY.pack(_ENTRY_MAGIC, _VERSION, 0, self.epoch, self.offset, self.length, self.generation, self.xxh3)
        return body + _mac(token, b"lmtier-p2p-e", namespace, key, node_id.encode(), body)

    @classmethod
    def decode(cls, raw: bytes, token: bytes | None, namespace: bytes, key: bytes, node_id: str) -> Entry | None:
        """The entry, or None when ``raw`` is malformed or its MAC does not verify for this
        namespace, chunk key and node."""
        if len(raw) != _ENTRY.size + MAC_BYTES:
            return None
        body, mac = raw[: _ENTRY.size], raw[_ENTRY.size :]
        if not hmac.compare_digest(mac, _mac(token, b"lmtier-p2p-e", namespace, key, node_id.encode(), body)):
            return None
        magic, version, flags, epoch, offset, length, gen, xxh3 = _ENTRY.unpack(body)
        if magic != _ENTRY_MAGIC or version != _VERSION or flags:
            return None
        return cls(epoch, offset, length, gen, xxh3)


@dataclass(frozen=True)
class NodeRecord:
    """How to reach one node.

    Attributes:
        epoch: random per process (a restarted node gets a new one; its old entries stop matching).
        arena_base: address of the node's registered CPU-pool arena (in the node's address space).
        arena_bytes: its size.
        created_ns: when the process published its first record (ns since the epoch).
        metadata: the node's NIXL agent metadata (``nixl_agent.get_agent_metadata()``).
    """

    epoch: int
    arena_base: int
    arena_bytes: int
    created_ns: int
    metadata: bytes

    def encode(self, token: bytes | None, namespace: bytes, node_id: str) -> bytes:
        body = _NODE.pack(
            _NODE_MAGIC,
            _VERSION,
            0,
            self.epoch,
            self.arena_base,
            self.arena_bytes,
            self.created_ns,
            len(self.metadata),
        )
        body += self.metadata
        return body + _mac(token, b"lmtier-p2p-n", namespace, node_id.encode(), body)

    @classmethod
    def decode(cls, raw: bytes, token: bytes | None, namespace: bytes, node_id: str) -> NodeRecord | None:
        """The record, or None when malformed or its MAC does not verify."""
        if not _NODE.size + MAC_BYTES <= len(raw) <= _MAX_NODE_RECORD:
            return None
        body, mac = raw[:-MAC_BYTES], raw[-MAC_BYTES:]
        if not hmac.compare_digest(mac, _mac(token, b"lmtier-p2p-n", namespace, node_id.encode(), body)):
            return None
        magic, version, flags, epoch, base, nbytes, created, mlen = _NODE.unpack(body[: _NODE.size])
        if magic != _NODE_MAGIC or version != _VERSION or flags or _NODE.size + mlen != len(body):
            return None
        return cls(epoch, base, nbytes, created, bytes(body[_NODE.size :]))


class Directory:
    """The directory of one namespace in one Redis/Valkey instance. Thread-safe.

    Args:
        endpoint: the parsed ``p2p_directory_url`` (single instance: ``redis``, ``rediss``, ``unix``).
        namespace: the 16-byte namespace digest.
        token: the shared token (MAC key) or None.
        timeout_s: socket (and connect) timeout of every call, seconds.
        entry_ttl_s: lifetime of a chunk's hash after its last publication, seconds.
        node_ttl_s: lifetime of a node record after its last heartbeat, seconds.
        key_prefix: prefix of every Redis key.
        breaker_failures, breaker_reset_s: the circuit breaker's settings.

    Attributes:
        counters: ``errors``, ``breaker_rejects``, ``bad_entries`` (malformed or MAC mismatch),
            ``bad_nodes``, ``published``, ``unpublished``, ``dropped_stale``.
    """

    def __init__(
        self,
        endpoint: RedisEndpoint,
        namespace: bytes,
        *,
        token: bytes | None,
        timeout_s: float = 1.0,
        entry_ttl_s: float = 300.0,
        node_ttl_s: float = 15.0,
        key_prefix: str = "lmtier:",
        breaker_failures: int = 3,
        breaker_reset_s: float = 2.0,
    ) -> None:
        if endpoint.kind == "cluster":
            raise ValueError("Directory: needs a single Redis/Valkey instance, not a cluster")
        if len(namespace) != 16:
            raise ValueError(f"Directory: namespace digest must be 16 bytes, got {len(namespace)}")
        self.endpoint = endpoint
        self.url = endpoint.describe()
        self.namespace = bytes(namespace)
        self.token = token
        self.entry_ttl_ms = max(1, int(entry_ttl_s * 1000))
        self.node_ttl_ms = max(1, int(node_ttl_s * 1000))
        self._base = f"{key_prefix}p2p:{self.namespace.hex()}:".encode()
        self.breaker = CircuitBreaker(breaker_failures, breaker_reset_s)
        self.counters: collections.Counter[str] = collections.Counter()
        kw: dict[str, Any] = dict(
            username=endpoint.username,
            password=endpoint.password,
            socket_timeout=timeout_s,
            socket_connect_timeout=timeout_s,
            db=endpoint.db,
            retry=Retry(NoBackoff(), 0),
            max_connections=8,
            timeout=timeout_s,
            protocol=2,
        )
        if endpoint.kind == "unix":
            kw.update(connection_class=redis.UnixDomainSocketConnection, path=endpoint.socket_path)
        else:
            kw.update(host=endpoint.host, port=endpoint.port)
            if endpoint.tls is not None:
                t = endpoint.tls
                kw.update(
                    connection_class=redis.SSLConnection,
                    ssl_ca_certs=t.ca_certs,
                    ssl_certfile=t.certfile,
                    ssl_keyfile=t.keyfile,
                    ssl_cert_reqs=t.cert_reqs,
                    ssl_check_hostname=t.check_hostname,
                )
        self._client = redis.Redis(connection_pool=redis.BlockingConnectionPool(**kw))
        self._drop_script = self._client.register_script(_DROP_IF_SAME)

    # ---- names --------------------------------------------------------------------------------

    def chunk_name(self, key: bytes) -> bytes:
        return self._base + b"c:" + key.hex().encode()

    def node_name(self, node_id: str) -> bytes:
        return self._base + b"n:" + node_id.encode()

    # ---- chunk entries ------------------------------------------------------------------------

    def publish(self, node_id: str, items: Sequence[tuple[bytes, Entry]]) -> bool:
        """Publish this node's entries (one pipelined round trip: ``HSET`` + ``PEXPIRE`` per chunk)."""
        if not items:
            return True

        def op(c: redis.Redis) -> Any:
            p = c.pipeline(transaction=False)
            for key, e in items:
                name = self.chunk_name(key)
                p.hset(name, node_id, e.encode(self.token, self.namespace, key, node_id))
                p.pexpire(name, self.entry_ttl_ms)
            return p.execute()

        ok = self._do(op) is not None
        if ok:
            self.counters["published"] += len(items)
        return ok

    def unpublish(self, node_id: str, keys: Sequence[bytes]) -> bool:
        """Remove this node's entries for ``keys`` (one pipelined round trip of ``HDEL``)."""
        if not keys:
            return True

        def op(c: redis.Redis) -> Any:
            p = c.pipeline(transaction=False)
            for key in keys:
                p.hdel(self.chunk_name(key), node_id)
            return p.execute()

        ok = self._do(op) is not None
        if ok:
            self.counters["unpublished"] += len(keys)
        return ok

    def lookup(self, keys: Sequence[bytes]) -> list[dict[str, Entry]] | None:
        """Every verified entry of each chunk (node id -> Entry), in one pipelined round trip of
        ``HGETALL``; None when the directory is unreachable (breaker open, timeout, error)."""
        if not keys:
            return []

        def op(c: redis.Redis) -> Any:
            p = c.pipeline(transaction=False)
            for key in keys:
                p.hgetall(self.chunk_name(key))
            return p.execute()

        raw = self._do(op)
        if raw is None:
            return None
        out: list[dict[str, Entry]] = []
        for key, fields in zip(keys, raw, strict=True):
            found: dict[str, Entry] = {}
            for node_b, value in fields.items():
                node_id = node_b.decode(errors="replace")
                e = Entry.decode(value, self.token, self.namespace, key, node_id)
                if e is None:
                    self.counters["bad_entries"] += 1
                else:
                    found[node_id] = e
            out.append(found)
        return out

    def drop_stale(self, key: bytes, node_id: str, entry: Entry) -> bool:
        """Delete ``node_id``'s entry of ``key`` if it is still ``entry`` (it did not verify)."""
        raw = entry.encode(self.token, self.namespace, key, node_id)
        res = self._do(lambda c: self._drop_script(keys=[self.chunk_name(key)], args=[node_id, raw], client=c))
        if res:
            self.counters["dropped_stale"] += 1
        return bool(res)

    # ---- node records -------------------------------------------------------------------------

    def put_node(self, node_id: str, rec: NodeRecord) -> bool:
        """Publish or refresh this node's record (``SET ... PX node_ttl``)."""
        value = rec.encode(self.token, self.namespace, node_id)
        return self._do(lambda c: c.set(self.node_name(node_id), value, px=self.node_ttl_ms)) is not None

    def delete_node(self, node_id: str) -> bool:
        return self._do(lambda c: c.delete(self.node_name(node_id))) is not None

    def get_nodes(self, node_ids: Sequence[str]) -> dict[str, NodeRecord | None] | None:
        """The verified records of ``node_ids`` (None per node: absent or not verifying) in one
        ``MGET``; None when the directory is unreachable."""
        if not node_ids:
            return {}
        raw = self._do(lambda c: c.mget([self.node_name(n) for n in node_ids]))
        if raw is None:
            return None
        out: dict[str, NodeRecord | None] = {}
        for n, value in zip(node_ids, raw, strict=True):
            rec = None if value is None else NodeRecord.decode(value, self.token, self.namespace, n)
            if value is not None and rec is None:
                self.counters["bad_nodes"] += 1
            out[n] = rec
        return out

    def close(self) -> None:
        self._client.close()

    # ---- plumbing -----------------------------------------------------------------------------

    def _do(self, op: Callable[[redis.Redis], Any]) -> Any:
        """``op(client)`` under the breaker; None on any failure (logged at debug, counted)."""
        if not self.breaker.allow():
            self.counters["breaker_rejects"] += 1
            return None
        try:
            res = op(self._client)
        except Exception as e:  # noqa: BLE001 - connection, timeout, TLS, server errors: a miss
            self.breaker.failure()
            self.counters["errors"] += 1
            log.debug("p2p directory %s: %s: %s", self.url, type(e).__name__, e)
            return None
        except BaseException:
            self.breaker.failure()
            raise
        self.breaker.success()
        return res
