"""The P2P directory (lmtier.tiers.p2p.directory): entries bound to namespace, chunk key, node and
token; pipelined lookups; compare-and-delete of stale entries; node records. Needs redis-server only."""

from __future__ import annotations

import os

import pytest

from lmtier.remote_url import parse_redis_url
from lmtier.tiers.p2p.directory import Directory, Entry, NodeRecord

NS = bytes(range(16))
TOKEN = b"t" * 20
E = Entry(epoch=7, offset=4096, length=1000, generation=3, xxh3=0x1234)


def test_entry_round_trip_and_binding():
    key = os.urandom(32)
    raw = E.encode(TOKEN, NS, key, "n1:1")
    assert Entry.decode(raw, TOKEN, NS, key, "n1:1") == E
    assert Entry.decode(raw, TOKEN, NS, os.urandom(32), "n1:1") is None  # another chunk key
    assert Entry.decode(raw, TOKEN, bytes(16), key, "n1:1") is None  # another namespace
    assert Entry.decode(raw, TOKEN, NS, key, "n2:1") is None  # another node
    assert Entry.decode(raw, b"u" * 20, NS, key, "n1:1") is None  # another token
    assert Entry.decode(raw, None, NS, key, "n1:1") is None
    for i in range(len(raw)):  # any flipped byte
        bad = bytearray(raw)
        bad[i] ^= 1
        assert Entry.decode(bytes(bad), TOKEN, NS, key, "n1:1") is None
    assert Entry.decode(raw[:-1], TOKEN, NS, key, "n1:1") is None
    long_token = b"x" * 100  # BLAKE2b keys are at most 64 bytes: longer tokens are hashed first
    assert Entry.decode(E.encode(long_token, NS, key, "n"), long_token, NS, key, "n") == E


def test_node_record_round_trip_and_binding():
    rec = NodeRecord(epoch=9, arena_base=1 << 40, arena_bytes=1 << 30, created_ns=5, metadata=os.urandom(300))
    raw = rec.encode(TOKEN, NS, "n1:1")
    assert NodeRecord.decode(raw, TOKEN, NS, "n1:1") == rec
    assert NodeRecord.decode(raw, TOKEN, NS, "n2:1") is None
    assert NodeRecord.decode(raw, None, NS, "n1:1") is None
    assert NodeRecord.decode(raw[:-3] + b"abc", TOKEN, NS, "n1:1") is None


@pytest.fixture
def directory(redis_server):
    d = Directory(parse_redis_url(redis_server.url), NS, token=TOKEN, timeout_s=1.0, entry_ttl_s=60)
    yield d
    d.close()


def test_publish_lookup_unpublish(directory):
    keys = [os.urandom(32) for _ in range(3)]
    assert directory.publish("a:1", [(keys[0], E), (keys[1], E)])
    assert directory.publish("b:1", [(keys[0], Entry(8, 0, 5, 1, 2))])
    found = directory.lookup(keys)
    assert found[0] == {"a:1": E, "b:1": Entry(8, 0, 5, 1, 2)} and found[1] == {"a:1": E} and found[2] == {}
    assert directory.unpublish("a:1", [keys[0]])
    assert directory.lookup(keys[:1]) == [{"b:1": Entry(8, 0, 5, 1, 2)}]


def test_foreign_or_forged_entries_are_refused(directory, redis_server):
    key = os.urandom(32)
    other = Directory(parse_redis_url(redis_server.url), NS, token=b"w" * 20)
    try:
        assert other.publish("evil:1", [(key, E)])  # same namespace, wrong token
    finally:
        other.close()
    assert directory.lookup([key]) == [{}]
    assert directory.counters["bad_entries"] == 1


def test_drop_stale_only_deletes_the_value_seen(directory):
    key = os.urandom(32)
    directory.publish("a:1", [(key, E)])
    newer = Entry(7, 8192, 1000, 4, 0x99)
    directory.publish("a:1", [(key, newer)])  # re-published meanwhile
    assert not directory.drop_stale(key, "a:1", E)
    assert directory.lookup([key]) == [{"a:1": newer}]
    assert directory.drop_stale(key, "a:1", newer)
    assert directory.lookup([key]) == [{}]


def test_node_records_and_an_unreachable_directory(directory, redis_server):
    rec = NodeRecord(1, 2, 3, 4, b"meta")
    assert directory.put_node("a:1", rec)
    assert directory.get_nodes(["a:1", "b:1"]) == {"a:1": rec, "b:1": None}
    assert directory.delete_node("a:1")
    redis_server.kill()
    assert directory.lookup([os.urandom(32)]) is None  # a miss, no exception
    assert directory.get_nodes(["a:1"]) is None
    assert not directory.publish("a:1", [(os.urandom(32), E)])
