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


def test_database_the_server_refuses_is_clear_error(redis_server_auth):
    """redis://host/99 on a 16-database server: was "not reachable at startup ... degrades to misses"
    (every call then failed with the same ResponseError: a setting, not an outage)."""
    srv = redis_server_auth
    with pytest.raises(TierError, match="remote_url .*/99: the server refuses database 99: DB index is out of range"):
        RedisTier(f"redis://:{srv.password}@127.0.0.1:{srv.port}/99")


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
        # a client that does not trust the certificate cannot ever connect: a start-up error naming the
        # URL and the verification failure (it used to log a warning and turn every call into a miss)
        with pytest.raises(TierError, match=rf"remote_url rediss://127.0.0.1:{srv.port}/0: TLS handshake failed "):
            RedisTier(f"rediss://127.0.0.1:{srv.port}/0", timeout_s=0.5)
        # a TLS server that is down or hung at start-up is an outage, not a setting: it still degrades
        srv.pause()
        hung = RedisTier(srv.url, timeout_s=0.3, connect_timeout_s=0.3)
        assert hung.counters["errors"] == 1
        srv.resume()
        assert hung.get_into(key(1), out) == len(d) and bytes(out) == d
        hung.close()
    finally:
        srv.close()


def test_rediss_url_to_a_plain_text_server_is_a_startup_error(redis_server_auth):
    """``rediss://`` pointed at a plain-text Redis: the server reads the ClientHello as an inline command
    and never answers, so the handshake only times out; the tier used to log "not reachable" and miss
    forever. Now a TierError names the URL (no password) and says the server speaks plain text."""
    srv, pw = redis_server_auth, "s3cret-pw"
    for query in ("", "?ssl_cert_reqs=none"):
        t0 = time.monotonic()
        with pytest.raises(TierError) as ei:
            RedisTier(f"rediss://:{pw}@127.0.0.1:{srv.port}/0{query}", timeout_s=0.5, connect_timeout_s=0.5)
        assert time.monotonic() - t0 < 5.0
        msg = str(ei.value)
        assert msg == (
            f"remote_url rediss://127.0.0.1:{srv.port}/0: TLS handshake failed: 127.0.0.1:{srv.port} answers "
            "plain-text Redis, not TLS (use redis:// for a plain-text server, or the server's TLS port)"
        )
        assert pw not in msg and ei.value.__cause__ is None
    # the same server through redis:// is fine (the probe did not disturb it)
    t = RedisTier(f"redis://:{pw}@127.0.0.1:{srv.port}/0")
    assert t.put(key(3), b"x" * 10) and t.get_into(key(3), bytearray(10)) == 10
    t.close()


def test_rediss_cluster_url_to_a_plain_text_cluster_is_a_startup_error(redis_cluster):
    url = redis_cluster.url.replace("redis-cluster://", "rediss-cluster://") + "?ssl_cert_reqs=none"
    with pytest.raises(
        TierError,
        match=r"^remote_url rediss-cluster://127\.0\.0\.1:\d+,.*answers plain-text Redis.*"
        r"use redis-cluster:// for a plain-text server",
    ):
        RedisTier(url, timeout_s=0.5, connect_timeout_s=0.5)


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
