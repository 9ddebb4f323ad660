"""Redis tier's direct reads against real and scripted servers: GETRANGE replies received straight
into ``out`` (no redis-py parser) — bit exact at piece boundaries, truncated, stalled, trickling or
mangled replies are misses, never wrong bytes."""

import socket
import threading
import time

import pytest

from lmtier import record as rec
from lmtier.tiers.buffers import AlignedBuffer
from lmtier.tiers.redis import RedisTier
from tests.test_remote_tier import MiB, key, payload, raw

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

        self.reply, self.then = reply, then
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(8)
        self.port = self.sock.getsockname()[1]
        self.stop = threading.Event()
        self.conns = []
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:

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
