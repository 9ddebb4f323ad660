"""Redis tier against a real redis-server: round trip, pipelined lookups, corruption, auth,
server death/hang (bounded latency), circuit breaker."""

import os
import socket
import time

import numpy as np
import pytest
import torch

from lmtier import record as rec
from lmtier.remote_url import parse_redis_url
from lmtier.tiers.base import TierError
from lmtier.tiers.buffers import AlignedBuffer
from lmtier.tiers.redis import RedisTier

MiB = 1 << 20


def key(i: int) -> bytes:
    return i.to_bytes(4, "little") * 8


def payload(i: int, n: int) -> bytes:
    return np.random.default_rng(i).integers(0, 256, n, dtype=np.uint8).tobytes()


def raw(srv, *args: bytes):
    """One command on a fresh socket (bypasses the tier)."""
    with socket.create_connection(("127.0.0.1", srv.port), timeout=5) as s:
        s.sendall(b"*%d\r\n" % len(args) + b"".join(b"$%d\r\n%s\r\n" % (len(a), a) for a in args))
        time.sleep(0.05)
        return s.recv(1 << 20)


@pytest.fixture
def tier(redis_server):
    t = RedisTier(redis_server.url, timeout_s=0.5, breaker_failures=3, breaker_reset_s=0.5)
    yield t
    t.close()


@pytest.mark.parametrize("n", [0, 1, 127, 128, 4097, 5 * MiB + 3])
def test_round_trip(tier, n):
    d = payload(n, n)
    assert tier.put(key(n), d)
    out = bytearray(n + 10)
    assert tier.get_into(key(n), out) == n
    assert bytes(out[:n]) == d
    a = AlignedBuffer(n)
    assert tier.get_into(key(n), a.mv) == n and bytes(a.mv[:n]) == d
    assert tier.counters["hits"] == 2


def test_tensor_buffers(tier):
    t = torch.randn(1000)
    assert tier.put(key(1), t)
    out = torch.empty(1000)
    assert tier.get_into(key(1), out) == 4000 and torch.equal(out, t)


def test_value_is_one_self_describing_key(tier, redis_server):
    assert tier.put(key(5), b"hello")
    keys = raw(redis_server, b"KEYS", b"*")
    assert b"lmtier:" + key(5).hex().encode() in keys and keys.count(b"lmtier:") == 1
    v = raw(redis_server, b"GET", b"lmtier:" + key(5).hex().encode())
    body = v[v.index(b"\r\n") + 2 :]
    h = rec.decode_header(body, expected_key=key(5))
    assert h.payload_offset == 128 and body[128:133] == b"hello"


def test_contains_many_and_delete(tier):
    for i in range(0, 20, 2):
        assert tier.put(key(i), b"v%d" % i)
    assert tier.contains_many([key(i) for i in range(20)]) == [i % 2 == 0 for i in range(20)]
    assert tier.contains_many([]) == []
    assert tier.delete(key(0)) and not tier.delete(key(0))
    assert not tier.contains(key(0))
    assert tier.get_into(key(1), bytearray(10)) is None
    assert tier.counters["misses"] == 1


def test_out_too_small_is_miss_but_kept(tier):
    assert tier.put(key(1), b"x" * 1000)
    assert tier.get_into(key(1), bytearray(999)) is None
    assert tier.contains(key(1))
    out = bytearray(1000)
    assert tier.get_into(key(1), out) == 1000  # the connection stayed in sync


@pytest.mark.parametrize("damage", ["flip_payload", "truncate", "garbage", "short", "wrong_key", "empty"])
def test_corrupted_value_is_miss_and_deleted(tier, redis_server, damage):
    d = payload(1, 100_000)
    assert tier.put(key(1), d)
    name = b"lmtier:" + key(1).hex().encode()
    if damage == "flip_payload":
        assert raw(redis_server, b"SETRANGE", name, b"50000", b"\x00\x01\x02").startswith(b":")
    elif damage == "truncate":
        v = rec.encode_header(key(1), len(d), rec.payload_checksum(d), payload_offset=128) + d[:-10]
        raw(redis_server, b"SET", name, v)
    elif damage == "garbage":
        raw(redis_server, b"SET", name, os.urandom(5000))
    elif damage == "short":
        raw(redis_server, b"SET", name, b"LMTR")
    elif damage == "wrong_key":
        v = rec.encode_header(key(2), len(d), rec.payload_checksum(d), payload_offset=128) + d
        raw(redis_server, b"SET", name, v)
    elif damage == "empty":
        raw(redis_server, b"SET", name, b"")
    out = bytearray(len(d))
    assert tier.get_into(key(1), out) is None
    assert tier.counters["corrupt"] == 1
    assert not tier.contains(key(1))
    assert tier.put(key(3), b"ok") and tier.get_into(key(3), bytearray(2)) == 2  # connection usable


def test_wrong_password_is_clear_error(redis_server_auth):
    srv = redis_server_auth
    with pytest.raises(TierError, match="authentication") as ei:
        RedisTier(f"redis://:wrong@127.0.0.1:{srv.port}/0")
    assert "wrong" not in str(ei.value)
    t = RedisTier(srv.url)
    assert t.put(key(1), b"x") and t.get_into(key(1), bytearray(1)) == 1


def test_password_from_env(redis_server_auth, monkeypatch):
    monkeypatch.setenv("LMTIER_TEST_PW", redis_server_auth.password)
    t = RedisTier(redis_server_auth.url_no_auth, password_env="LMTIER_TEST_PW")
    assert t.ping()
    with pytest.raises(ValueError, match="not set"):
        RedisTier(redis_server_auth.url_no_auth, password_env="LMTIER_UNSET_VAR_XYZ")


def test_unix_socket(tmp_path):
    from lmtier.testing.redis import start_or_skip

    sock = str(tmp_path / "r.sock")
    srv = start_or_skip(extra_args=("--unixsocket", sock, "--unixsocketperm", "700"))
    try:
        t = RedisTier(f"unix://{sock}?db=1")
        assert t.put(key(1), b"abc")
        out = bytearray(3)
        assert t.get_into(key(1), out) == 3 and out == b"abc"
    finally:
        srv.close()


def test_server_killed_gives_bounded_misses_and_breaker(redis_server):
    timeout = 0.3
    t = RedisTier(
        redis_server.url, timeout_s=timeout, connect_timeout_s=timeout, breaker_failures=3, breaker_reset_s=1.0
    )
    assert t.put(key(1), b"x" * 1000)
    redis_server.kill()
    out = bytearray(1000)
    for _ in range(10):
        t0 = time.monotonic()
        assert t.get_into(key(1), out) is None
        assert not t.put(key(2), b"y")
        assert t.contains_many([key(1), key(2)]) == [False, False]
        assert time.monotonic() - t0 < 3 * timeout
    assert t.breaker_open
    assert t.breaker.times_opened == 1
    assert t.counters["errors"] == 3 and t.counters["breaker_rejects"] > 0
    redis_server.start()  # same port, empty (no persistence)
    time.sleep(1.1)
    assert t.put(key(3), b"back")  # trial call closes the breaker
    assert not t.breaker_open
    assert t.get_into(key(3), bytearray(4)) == 4


def test_hung_server_bounded_latency(redis_server):
    timeout = 0.3
    t = RedisTier(redis_server.url, timeout_s=timeout, breaker_failures=2, breaker_reset_s=0.5)
    assert t.put(key(1), b"x" * 100_000)
    redis_server.pause()
    try:
        for _ in range(5):
            t0 = time.monotonic()
            assert t.get_into(key(1), bytearray(100_000)) is None
            assert time.monotonic() - t0 < 3 * timeout
        assert t.breaker_open
    finally:
        redis_server.resume()
    time.sleep(0.6)
    out = bytearray(100_000)
    assert t.get_into(key(1), out) == 100_000 and bytes(out) == b"x" * 100_000


def test_breaker_reopens_when_trial_fails(redis_server):
    t = RedisTier(redis_server.url, timeout_s=0.2, breaker_failures=2, breaker_reset_s=0.3)
    redis_server.kill()
    for _ in range(3):
        t.contains(key(1))
    assert t.breaker_open
    time.sleep(0.35)
    t.contains(key(1))  # trial fails
    n_err = t.counters["errors"]
    t.contains(key(1))  # rejected immediately again
    assert t.counters["errors"] == n_err and t.breaker_open


def test_unreachable_at_startup_degrades(redis_server):
    port = redis_server.port
    redis_server.kill()
    t = RedisTier(f"redis://127.0.0.1:{port}/0", timeout_s=0.2, breaker_failures=2, breaker_reset_s=0.2)
    assert t.get_into(key(1), bytearray(1)) is None
    redis_server.start()
    time.sleep(0.25)
    assert t.put(key(1), b"z")


def test_concurrent_callers(tier):
    import threading

    errors = []

    def work(w):
        for i in range(20):
            k = key(w * 100 + i)
            d = payload(w * 100 + i, 200_000)
            if not tier.put(k, d):
                errors.append("put")
            out = bytearray(len(d))
            if tier.get_into(k, out) != len(d) or bytes(out) != d:
                errors.append("get")

    ths = [threading.Thread(target=work, args=(w,)) for w in range(4)]
    for th in ths:
        th.start()
    for th in ths:
        th.join()
    assert errors == []


def test_ttl(redis_server):
    t = RedisTier(redis_server.url, ttl_s=100)
    assert t.put(key(1), b"x")
    assert int(raw(redis_server, b"TTL", b"lmtier:" + key(1).hex().encode())[1:-2]) > 90


def test_parse_url():
    """The tier's URLs go through lmtier.remote_url (tests/test_remote_url.py has the grammar).
    (``redis-cluster://a`` was an error here and a node on port 6379 for the config: one parser
    now, the config's meaning: a node without a port is on 6379, as for ``redis://a``.)"""
    t = parse_redis_url("redis://u:p%40ss@h:1234/3")
    assert (t.kind, t.host, t.port, t.db, t.username, t.password) == ("tcp", "h", 1234, 3, "u", "p@ss")
    assert "p@ss" not in t.describe() and "p@ss" not in repr(t)
    t = parse_redis_url("rediss://h?ssl_cert_reqs=none")
    assert t.tls is not None and not t.tls.check_hostname
    t = parse_redis_url("redis-cluster://:pw@a:1,b:2")
    assert t.hosts == (("a", 1), ("b", 2)) and t.password == "pw"
    assert parse_redis_url("redis-cluster://a").hosts == (("a", 6379),)
    for bad in ("http://h", "redis://", "redis://h/x"):
        with pytest.raises(ValueError):
            parse_redis_url(bad)
        with pytest.raises(ValueError):
            RedisTier(bad)


def test_redis_cluster(redis_cluster):
    t = RedisTier(redis_cluster.url, timeout_s=1.0)
    keys = [key(i) for i in range(30)]
    for i, k in enumerate(keys[::2]):
        assert t.put(k, payload(i, 50_000 + i))
    assert t.contains_many(keys) == [i % 2 == 0 for i in range(30)]
    for i, k in enumerate(keys[::2]):
        out = bytearray(60_000)
        assert t.get_into(k, out) == 50_000 + i and bytes(out[: 50_000 + i]) == payload(i, 50_000 + i)
    # corrupt one value through the cluster client: a miss, and deleted
    import redis.cluster

    rc = redis.cluster.RedisCluster(host="127.0.0.1", port=redis_cluster.nodes[0].port)
    name = "lmtier:" + keys[0].hex()
    rc.setrange(name, 200, b"\xff\xff")
    assert t.get_into(keys[0], bytearray(60_000)) is None
    assert not rc.exists(name)
    assert t.delete(keys[2]) and not t.contains(keys[2])
    # all nodes dead: bounded misses, no exception
    for n in redis_cluster.nodes:
        n.kill()
    for _ in range(5):
        t0 = time.monotonic()
        assert t.get_into(keys[4], bytearray(60_000)) is None
        assert time.monotonic() - t0 < 5.0
    assert t.breaker_open


def test_tls(tmp_path):
    from lmtier.testing.redis import start_or_skip

    srv = start_or_skip(tls=True)
    try:
        t = RedisTier(srv.url, timeout_s=1.0)
        d = payload(1, 3 * MiB + 1)
        assert t.put(key(1), d)
        out = bytearray(len(d))
        assert t.get_into(key(1), out) == len(d) and bytes(out) == d
        assert t.contains_many([key(1), key(2)]) == [True, False]
        # a client that does not trust the certificate gets nothing (and no exception)
        bad = RedisTier(f"rediss://127.0.0.1:{srv.port}/0", timeout_s=0.5)
        assert bad.get_into(key(1), out) is None and bad.counters["errors"] >= 1
    finally:
        srv.close()


# ---- pieces: SETRANGE onto a temporary key + RENAME, GETRANGE pieces into out ----------------


@pytest.mark.parametrize("n", [4096 - 128, 4096 - 127, 3 * 4096, 5 * 4096 + 77])
def test_pieces_round_trip_no_temp_keys(redis_server, n):
    t = RedisTier(redis_server.url, piece_bytes=4096)
    d = payload(n, n)
    assert t.put(key(1), d)
    for cap in (n, n + 1, n + 3 * 4096 + 5):  # out larger than the value: speculative pieces are empty
        out = bytearray(cap)
        assert t.get_into(key(1), out) == n and bytes(out[:n]) == d
    assert t.get_into(key(1), bytearray(n - 1)) is None and t.contains(key(1))  # too small: kept
    keys = raw(redis_server, b"KEYS", b"*")
    assert keys.count(b"lmtier:") == 1 and b".tmp." not in keys
    assert raw(redis_server, b"TTL", b"lmtier:" + key(1).hex().encode()) == b":-1\r\n"  # PERSIST after RENAME
    assert t.counters["corrupt"] == 0 and t.counters["torn_reads"] == 0
    t.close()


def test_pieces_ttl(redis_server):
    t = RedisTier(redis_server.url, ttl_s=100, piece_bytes=4096)
    assert t.put(key(1), b"x" * 20000)
    assert int(raw(redis_server, b"TTL", b"lmtier:" + key(1).hex().encode())[1:-2]) > 90


@pytest.mark.parametrize("direct", [True, False])
def test_torn_read_is_reread_atomically(redis_server, monkeypatch, direct):
    """A value overwritten between two GETRANGE pieces (piece 0 from the old value, the rest from
    the new): the checksum catches it, an atomic re-read returns the new value, nothing is deleted."""
    from lmtier.tiers.redis import resp as remote

    t = RedisTier(redis_server.url, piece_bytes=4096, direct_reads=direct)
    n = 5 * 4096
    old, new = payload(1, n), payload(2, n)
    assert t.put(key(1), old)
    old_piece0 = raw(redis_server, b"GETRANGE", b"lmtier:" + key(1).hex().encode(), b"0", b"4095")
    old_piece0 = old_piece0[old_piece0.index(b"\r\n") + 2 : -2]
    assert len(old_piece0) == 4096
    assert t.put(key(1), new)
    reads = []
    if direct:  # the pieces go straight from the socket into out: tear piece 0's payload there
        orig_direct = remote.read_record_direct

        def read_direct(conn, cmds, reader, deadline=None):
            orig_direct(conn, cmds, reader, deadline)  # (its EXISTS reply goes through feed: counted there)
            if len(reads) == 1:
                reader.out[: 4096 - 128] = old_piece0[128:]

        monkeypatch.setattr(remote, "read_record_direct", read_direct)
        orig_feed = remote.RecordReader.feed

        def feed(self, reply):  # the atomic re-read goes through redis-py's MULTI/EXEC pipeline
            if self.i == 0:
                reads.append(self)
            orig_feed(self, reply)

        monkeypatch.setattr(remote.RecordReader, "feed", feed)
    else:
        orig = remote.RecordReader.feed

        def feed(self, reply):
            if self.i == 0:
                reads.append(self)
            if self.i == 2 and len(reads) == 1:  # piece 0 of the first (pipelined) read: the old value's
                reply = old_piece0
            orig(self, reply)

        monkeypatch.setattr(remote.RecordReader, "feed", feed)
    out = bytearray(n)
    assert t.get_into(key(1), out) == n
    assert bytes(out) == new and len(reads) == 2
    assert t.counters["torn_reads"] == 1 and t.counters["corrupt"] == 0 and t.contains(key(1))


def test_concurrent_overwrites_never_mix(redis_server):
    """Writers replace a multi-piece value while readers read it: only whole values come back."""
    import threading

    n = 16 * 4096
    values = [payload(i, n) for i in range(3)]
    t = RedisTier(redis_server.url, piece_bytes=4096, timeout_s=2.0)
    assert t.put(key(1), values[0])
    stop = threading.Event()
    bad = []

    def write(i):
        while not stop.is_set():
            t.put(key(1), values[i])

    def read():
        out = bytearray(n)
        for _ in range(60):
            if t.get_into(key(1), out) == n and bytes(out) not in values:
                bad.append(1)

    ws = [threading.Thread(target=write, args=(i,)) for i in (1, 2)]
    rs = [threading.Thread(target=read) for _ in range(2)]
    for th in ws + rs:
        th.start()
    for th in rs:
        th.join()
    stop.set()
    for th in ws:
        th.join()
    assert bad == [] and t.counters["corrupt"] == 0 and t.counters["hits"] == 120


def test_tmp_name_same_cluster_slot():
    from redis.crc import key_slot

    from lmtier.tiers.redis.tier import _tmp_name

    for name in (b"lmtier:" + key(1).hex().encode(), b"{tenant}:" + key(2).hex().encode(), b"x{y", b"a{b}{}"):
        tmp = _tmp_name(name)
        assert tmp != name and key_slot(tmp) == key_slot(name)
        assert _tmp_name(name) != tmp  # unique per write
    for prefix in ("a{}b", "a{}b{c}"):  # braces but no hash tag: no temporary key can share the slot
        with pytest.raises(ValueError, match="key_prefix"):
            RedisTier("redis://127.0.0.1:1/0", key_prefix=prefix)


def test_redis_cluster_pieces(redis_cluster):
    t = RedisTier(redis_cluster.url, timeout_s=1.0, piece_bytes=4096)
    for i in range(6):
        d = payload(i, 30_000 + i)
        assert t.put(key(i), d)
        out = bytearray(40_000)
        assert t.get_into(key(i), out) == len(d) and bytes(out[: len(d)]) == d
    import redis.cluster

    rc = redis.cluster.RedisCluster(host="127.0.0.1", port=redis_cluster.nodes[0].port)
    assert not [k for k in rc.keys(target_nodes=redis.cluster.RedisCluster.ALL_NODES) if b".tmp." in k]


# ---- direct reads: GETRANGE replies received straight into out (no redis-py parser) ---------

PIECE = 4096
# payload sizes around the piece boundaries (the header takes the first 128 bytes of piece 0) and
# around the reader's 16 KiB scratch buffer
BOUNDARY_SIZES = sorted(
    {0, 1, 127, 128, 129}
    | {k * PIECE - 128 + d for k in (1, 2, 4, 5, 37) for d in (-1, 0, 1)}
    | {16384 - 128 - 10 + d for d in (-1, 0, 1)}
)


@pytest.mark.parametrize("n", BOUNDARY_SIZES)
def test_direct_reads_bit_exact_at_piece_boundaries(redis_server, n):
    """Same bytes as the redis-py parser path, for every size around the piece boundaries, into
    exact-size, larger and misaligned buffers; a too-small buffer is a miss and the connection
    stays in sync."""
    direct = RedisTier(redis_server.url, piece_bytes=PIECE, direct_reads=True, timeout_s=2.0)
    parser = RedisTier(redis_server.url, piece_bytes=PIECE, direct_reads=False, timeout_s=2.0)
    d = payload(n + 7, n)
    assert direct.put(key(1), d)
    for cap in {n, n + 1, n + PIECE + 1}:
        a, b = bytearray(cap + 3), bytearray(cap)
        assert direct.get_into(key(1), memoryview(a)[3:]) == n  # misaligned destination
        assert parser.get_into(key(1), b) == n
        assert bytes(a[3 : 3 + n]) == bytes(b[:n]) == d
        assert bytes(a[3 + n :]) == bytes(cap - n)  # nothing written past the payload
    if n:
        assert direct.get_into(key(1), bytearray(n - 1)) is None
    assert direct.get_into(key(1), bytearray(n)) == n  # the connection stayed in sync
    assert direct.counters["corrupt"] == 0 and direct.counters["errors"] == 0
    direct.close()
    parser.close()


def test_direct_reads_many_pieces_and_large(redis_server):
    t = RedisTier(redis_server.url, timeout_s=5.0)  # 1 MiB pieces
    for n in (MiB - 128, MiB - 127, 6 * MiB + 12345, 33 * MiB):
        d = payload(n, n)
        assert t.put(key(n % 1000), d)
        out = AlignedBuffer(n)
        assert t.get_into(key(n % 1000), out.mv) == n and bytes(out.mv[:n]) == d
    assert t.counters["hits"] == 4 and t.counters["errors"] == 0


@pytest.mark.parametrize("cut", [-1, 0, 1, 130])
def test_direct_reads_truncated_at_piece_boundary_is_miss(redis_server, cut):
    """A value cut just before/at/after a piece boundary (a missing or short last piece): miss,
    counted corrupt, deleted; never wrong bytes."""
    t = RedisTier(redis_server.url, piece_bytes=PIECE, timeout_s=2.0)
    n = 5 * PIECE
    d = payload(3, n)
    assert t.put(key(1), d)
    name = b"lmtier:" + key(1).hex().encode()
    v = rec.encode_header(key(1), n, rec.payload_checksum(d), payload_offset=128) + d
    raw(redis_server, b"SET", name, v[: 3 * PIECE + cut])
    out = bytearray(n)
    assert t.get_into(key(1), out) is None
    assert t.counters["corrupt"] == 1 and not t.contains(key(1))
    assert t.put(key(2), d) and t.get_into(key(2), out) == n and bytes(out) == d


def test_direct_reads_wrong_type_is_error_miss(redis_server):
    t = RedisTier(redis_server.url, piece_bytes=PIECE, timeout_s=2.0)
    raw(redis_server, b"RPUSH", b"lmtier:" + key(1).hex().encode(), b"x")
    assert t.get_into(key(1), bytearray(100)) is None
    assert t.counters["errors"] == 1 and not t.breaker_open
    assert t.put(key(2), b"ok") and t.get_into(key(2), bytearray(2)) == 2


def test_direct_reads_concurrent_gets(redis_server):
    """8 threads reading multi-piece values through a 4-connection pool: all bit-exact."""
    import threading

    t = RedisTier(redis_server.url, piece_bytes=PIECE, max_connections=4, timeout_s=5.0)
    values = {i: payload(i, 3 * PIECE + 17 * i) for i in range(16)}
    for i, d in values.items():
        assert t.put(key(i), d)
    bad = []

    def work(w):
        out = bytearray(4 * PIECE + 1000)
        for j in range(40):
            i = (w * 7 + j) % 16
            if t.get_into(key(i), out) != len(values[i]) or bytes(out[: len(values[i])]) != values[i]:
                bad.append(i)

    ths = [threading.Thread(target=work, args=(w,)) for w in range(8)]
    for th in ths:
        th.start()
    for th in ths:
        th.join()
    assert bad == [] and t.counters["hits"] == 320 and t.counters["errors"] == 0


class _FakeServer:
    """A TCP server that answers PING with +PONG, other connection set-up commands with +OK, and
    the first command of a record read (EXISTS) with ``reply``, then closes (``then="close"``) or
    goes silent (``"hang"``)."""

    def __init__(self, reply: bytes, then: str) -> None:
        import threading

        self.reply, self.then = reply, then
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(8)
        self.port = self.sock.getsockname()[1]
        self.stop = threading.Event()
        self.conns = []
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        import threading

        while not self.stop.is_set():
            try:
                c, _ = self.sock.accept()
            except OSError:
                return
            self.conns.append(c)
            threading.Thread(target=self._client, args=(c,), daemon=True).start()

    def _client(self, c) -> None:
        buf, state = b"", {}
        try:
            while not self.stop.is_set():
                data = c.recv(1 << 16)
                if not data:
                    return
                buf += data
                while True:  # complete commands (RESP arrays of bulk strings) at the front of buf
                    cmd, buf = self._command(buf)
                    if cmd is None:
                        break
                    if self._answer(c, cmd, state):
                        return
        except OSError:
            return

    def _answer(self, c, cmd: list, state: dict) -> bool:
        """Answer one command on connection ``c``; True ends the connection's thread."""
        if cmd[0].upper() == b"PING":
            c.sendall(b"+PONG\r\n")
        elif cmd[0].upper() == b"EXISTS":  # the first command of a record read
            c.sendall(self.reply)
            if self.then == "close":
                c.close()
            else:
                self.stop.wait(10)  # hang
            return True
        else:  # HELLO/CLIENT SETINFO/SELECT... on connect
            c.sendall(b"+OK\r\n")
        return False

    @staticmethod
    def _command(buf: bytes):
        if not buf.startswith(b"*") or b"\r\n" not in buf:
            return None, buf
        head, rest = buf.split(b"\r\n", 1)
        args = []
        for _ in range(int(head[1:])):
            if b"\r\n" not in rest:
                return None, buf
            ln, body = rest.split(b"\r\n", 1)
            k = int(ln[1:])
            if len(body) < k + 2:
                return None, buf
            args.append(body[:k])
            rest = body[k + 2 :]
        return args, rest

    def close(self) -> None:
        self.stop.set()
        self.sock.close()
        for c in self.conns:
            try:
                c.close()
            except OSError:
                pass


def _fake_reply(n: int, sent: int, extra: bytes = b"") -> bytes:
    d = payload(5, n)
    v = rec.encode_header(key(1), n, rec.payload_checksum(d), payload_offset=128) + d
    out = b":1\r\n:%d\r\n" % len(v)
    for o in range(0, len(v), PIECE):
        piece = v[o : o + PIECE]
        out += b"$%d\r\n%s\r\n" % (len(piece), piece)
    return out[:sent] + extra


@pytest.mark.parametrize(
    "then,sent,extra",
    [
        ("close", 20, b""),
        ("close", 5000, b""),
        ("close", 9000, b""),  # server dies mid-reply
        ("hang", 20, b""),
        ("hang", 9000, b""),  # server stalls mid-reply
        ("close", 0, b"*1\r\n:1\r\n"),
        ("close", 0, b":1\r\n:999\r\n$4\r\nabcdXY"),  # protocol garbage
        ("close", 0, b":1\r\n:4224\r\n$-7\r\n"),
        ("close", 0, b":1\r\n:" + b"9" * 5000),
        ("hang", 0, b":1\r\n:16512\r\n$99999999999\r\n" + b"x" * 5000),  # longer than the range asked for
    ],
)
def test_direct_reads_server_dies_or_stalls_mid_reply(then, sent, extra):
    """A reply cut short (connection closed), a stalled server or a malformed reply: a miss within
    the timeout, counted as an error, never a hang or wrong bytes."""
    n = 4 * PIECE
    full = _fake_reply(n, 10**9)
    srv = _FakeServer(full[:sent] + extra if sent else extra, then)
    timeout = 0.3
    try:
        t = RedisTier(
            f"redis://127.0.0.1:{srv.port}/0", piece_bytes=PIECE, timeout_s=timeout, connect_timeout_s=timeout
        )
        out = bytearray(n)
        e0 = t.counters["errors"]  # (the fake server's answers to redis-py's start-up may count one)
        t0 = time.monotonic()
        assert t.get_into(key(1), out) is None
        assert time.monotonic() - t0 < 3 * timeout
        assert t.counters["errors"] == e0 + 1 and t.counters["hits"] == 0
        t.close()
    finally:
        srv.close()


def test_direct_reads_fake_server_full_reply_is_hit():
    """Control for the test above: the complete scripted reply verifies."""
    n = 4 * PIECE
    srv = _FakeServer(_fake_reply(n, 10**9), "close")
    try:
        t = RedisTier(f"redis://127.0.0.1:{srv.port}/0", piece_bytes=PIECE, timeout_s=1.0)
        out = bytearray(n)
        assert t.get_into(key(1), out) == n and bytes(out) == payload(5, n)
        t.close()
    finally:
        srv.close()


def test_direct_reads_real_server_killed_mid_get(redis_server):
    """SIGKILL while 32 MiB values are being read: each call returns the exact value or a miss, and
    the calls after the kill return within the timeout."""
    import threading

    n = 32 * MiB
    d = payload(9, n)
    timeout = 0.5
    t = RedisTier(redis_server.url, timeout_s=timeout, connect_timeout_s=timeout, breaker_failures=1000)
    assert t.put(key(1), d)
    out = AlignedBuffer(n)
    results = []
    killer = threading.Timer(0.15, redis_server.kill)
    killer.start()
    t_end = time.monotonic() + 1.5
    while time.monotonic() < t_end:
        t0 = time.monotonic()
        got = t.get_into(key(1), out.mv)
        results.append((got, time.monotonic() - t0, got == n and bytes(out.mv[:n]) == d))
    killer.join()
    assert all(ok for got, _, ok in results if got is not None)  # never wrong bytes
    assert results[-1][0] is None and all(dt < 3 * timeout for _, dt, _ in results[-3:])
    assert t.counters["errors"] >= 1


class _TrickleServer(_FakeServer):
    """Answers a record read with the complete reply, ``step`` bytes every ``gap_s`` (each gap well
    inside the client's socket timeout)."""

    step, gap_s = 256, 0.02

    def _answer(self, c, cmd: list, state: dict) -> bool:
        if cmd[0].upper() != b"EXISTS":
            return super()._answer(c, cmd, state)
        for o in range(0, len(self.reply), self.step):
            if self.stop.wait(self.gap_s):
                return True
            c.sendall(self.reply[o : o + self.step])
        return False


@pytest.mark.parametrize("direct", [True, False], ids=["direct", "parser"])
def test_trickling_server_hits_the_read_deadline(direct):
    """A server that sends a byte stream just inside the socket timeout: without an overall deadline
    one read could take forever; with ``min_read_bytes_per_s`` it is a miss once
    ``4 * timeout_s + bytes / rate`` has passed. Control: a low enough rate lets the same reply verify."""
    n = 4 * PIECE
    timeout = 0.2
    for rate, expect_hit in ((1e6, False), (1e3, True)):
        srv = _TrickleServer(_fake_reply(n, 10**9), "hang")
        total_s = len(srv.reply) / srv.step * srv.gap_s
        try:
            t = RedisTier(
                f"redis://127.0.0.1:{srv.port}/0",
                piece_bytes=PIECE,
                timeout_s=timeout,
                connect_timeout_s=timeout,
                direct_reads=direct,
                min_read_bytes_per_s=rate,
            )
            out = bytearray(n)
            t0 = time.monotonic()
            got = t.get_into(key(1), out)
            dt = time.monotonic() - t0
            if expect_hit:
                assert got == n and bytes(out) == payload(5, n), "the control read should verify"
            else:
                deadline = 4 * timeout + n / rate
                assert deadline < total_s * 0.8, "test set-up: the trickle must outlast the deadline"
                assert got is None and t.counters["errors"] >= 1
                assert dt < deadline + 2 * timeout + 0.3, f"read took {dt:.2f} s, deadline {deadline:.2f} s"
            t.close()
        finally:
            srv.close()


def test_min_read_rate_must_be_positive():
    with pytest.raises(ValueError, match="min_read_bytes_per_s"):
        RedisTier("redis://127.0.0.1:1/0", min_read_bytes_per_s=0)


class _Resp3PushServer(_FakeServer):
    """Like _FakeServer, but speaks RESP3 to a client that negotiated it (``HELLO 3``, redis-py 8's
    default, which then subscribes to maintenance notifications) and, as Redis Enterprise/Cloud do
    during maintenance, sends a push frame ahead of the replies of a record read."""

    PUSH = b">4\r\n$6\r\nMOVING\r\n:1\r\n:15\r\n$14\r\n127.0.0.1:6379\r\n"

    def _answer(self, c, cmd: list, state: dict) -> bool:
        name = cmd[0].upper()
        if name == b"HELLO":
            state["proto"] = int(cmd[1])
            c.sendall(b"%2\r\n$6\r\nserver\r\n$5\r\nredis\r\n$5\r\nproto\r\n:3\r\n")
        elif name == b"PING":
            c.sendall(b"+PONG\r\n")
        elif name == b"EXISTS":
            c.sendall((self.PUSH if state.get("proto", 2) == 3 else b"") + self.reply)
        elif name in (b"STRLEN", b"GETRANGE"):
            pass  # answered with EXISTS (the scripted reply holds the whole batch)
        else:
            c.sendall(b"+OK\r\n")
        return False


@pytest.mark.parametrize("direct", [True, False])
def test_reads_not_broken_by_resp3_push_frames(direct):
    """redis-py 8 negotiates RESP3 by default, and a RESP3 server may push out-of-band frames (``>``,
    e.g. maintenance notifications) ahead of a reply. The tier speaks RESP2 (its direct reader is a
    RESP2 reader), so no push frame can reach it: a hit, not an error."""
    n = 4 * PIECE
    srv = _Resp3PushServer(_fake_reply(n, 10**9), "close")
    try:
        t = RedisTier(f"redis://127.0.0.1:{srv.port}/0", piece_bytes=PIECE, timeout_s=1.0, direct_reads=direct)
        out = bytearray(n)
        assert t.get_into(key(1), out) == n and bytes(out) == payload(5, n)
        assert t.counters["errors"] == 0
        t.close()
    finally:
        srv.close()


class _ScriptedSocket:
    """``recv_into`` over a fixed byte stream, returning at most up to the next cut point per call (a
    reply split by the network at chosen byte boundaries); b"" (EOF) at the end."""

    def __init__(self, data: bytes, cuts) -> None:
        self.data, self.pos = data, 0
        self.cuts = sorted({c for c in cuts if 0 < c < len(data)})

    def recv_into(self, dst, nbytes=0):
        nxt = next((c for c in self.cuts if c > self.pos), len(self.data))
        k = min(len(dst), nxt - self.pos)
        dst[:k] = self.data[self.pos : self.pos + k]
        self.pos += k
        return k


class _ScriptedConn:
    def __init__(self, sock) -> None:
        self._sock, self._parser = sock, None

    def pack_commands(self, cmds):
        return b""

    def send_packed_command(self, packed) -> None:
        pass


def _scripted_read(stream: bytes, cmds, cap: int, cuts):
    from lmtier.tiers.redis import resp as R

    out = bytearray(cap)
    reader = R.RecordReader(key(1), memoryview(out), PIECE, 512 << 20)
    sock = _ScriptedSocket(stream, cuts)
    R.read_record_direct(_ScriptedConn(sock), cmds, reader)
    return reader, out, sock


def _scripted_reply(n: int, cap: int):
    from lmtier.tiers.redis import resp as R

    d = payload(n + 1, n)
    v = rec.encode_header(key(1), n, rec.payload_checksum(d), payload_offset=R.HEADER) + d
    t = RedisTier.__new__(RedisTier)
    t.piece_bytes = PIECE
    cmds = t._get_cmds(b"x", cap)
    stream = b":1\r\n:%d\r\n" % len(v) + b"".join(
        b"$%d\r\n%s\r\n" % (len(v[c[2] : c[3] + 1]), v[c[2] : c[3] + 1]) for c in cmds[2:]
    )
    return d, cmds, stream


@pytest.mark.parametrize("n,extra", [(200, 0), (PIECE - 128 + 1, 0), (2 * PIECE + 5, PIECE)])
def test_direct_reader_every_split_point(n, extra):
    """The direct reader gets the same bytes whatever the network's segmentation: the batch's replies
    split at every single byte position, and delivered one byte per receive."""
    d, cmds, stream = _scripted_reply(n, n + extra)
    for cuts in [[s] for s in range(len(stream) + 1)] + [range(len(stream))]:
        reader, out, sock = _scripted_read(stream, cmds, n + extra, cuts)
        assert sock.pos == len(stream) and reader.finish() == n and bytes(out[:n]) == d


def test_direct_reader_mangled_replies_never_give_wrong_bytes():
    """Replies with flipped bits, cut short, with bytes inserted/deleted, a length line replaced
    (null, negative, huge, error, wrong type) or trailing bytes: a clean error, a miss or a
    verification failure, or exactly the right bytes; nothing else."""
    import random
    import re

    import redis

    from lmtier.tiers.redis import resp as R

    rng = random.Random(3)
    outcomes = set()
    for _ in range(3000):
        n = rng.choice([0, 5, 200, PIECE - 128, PIECE + 7, 3 * PIECE])
        cap = n + rng.choice([0, 1, PIECE])
        d, cmds, stream = _scripted_reply(n, cap)
        s = bytearray(stream)
        how = rng.randrange(6)
        if how == 0:
            for _ in range(rng.randint(1, 3)):
                s[rng.randrange(len(s))] ^= 1 << rng.randrange(8)
        elif how == 1:
            s = s[: rng.randrange(len(s))]
        elif how == 2:
            i = rng.randrange(len(s) + 1)
            s[i:i] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 8)))
        elif how == 3:
            i = rng.randrange(len(s))
            del s[i : i + rng.randint(1, 8)]
        elif how == 4:
            m = rng.choice(list(re.finditer(rb"[:$]-?\d+\r\n", bytes(s))))
            s[m.start() : m.end()] = rng.choice(
                [
                    b"$-1\r\n",
                    b"$-2\r\n",
                    b"$0\r\n",
                    b"-ERR x\r\n",
                    b":0\r\n",
                    b"$99999999999999999999\r\n",
                    b"*1\r\n",
                    b"+OK\r\n",
                    b"$\r\n",
                ]
            )
        else:
            s += b":1\r\n"
        try:
            reader, out, _ = _scripted_read(bytes(s), cmds, cap, [rng.randint(0, len(s)) for _ in range(3)])
            got = reader.finish()
        except (
            redis.exceptions.ConnectionError,
            redis.exceptions.InvalidResponse,
            redis.exceptions.ResponseError,
        ) as e:
            outcomes.add(type(e).__name__)
            continue
        except R.CorruptValue:
            outcomes.add("corrupt")
            continue
        assert got is None or (got == n and bytes(out[:n]) == d)
        outcomes.add("miss" if got is None else "hit")
    assert {"InvalidResponse", "ConnectionError", "ResponseError", "corrupt", "hit"} <= outcomes
