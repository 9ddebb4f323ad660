"""Tier events (``Tier.event_counts``, ``TIER_EVENTS``) through the decorators and the connector's
stats; the sealed tier's batched reads over a batching inner tier (real Mooncake Store)."""

from __future__ import annotations

import collections
import os

import numpy as np
import pytest

from lmtier.integration.vllm.stats import LMTierStats, StatsSink, process_tier_event_totals
from lmtier.tiers.base import TIER_EVENTS
from lmtier.tiers.codec import CodecTier
from lmtier.tiers.seal import KeyRing, SealKey
from lmtier.tiers.seal.tier import SealedTier
from tests.test_fetch_batch import BatchingTier

RING = KeyRing.of(SealKey.from_bytes(b"\x07" * 32, source="test:a"))
WRONG = KeyRing.of(SealKey.from_bytes(b"\x09" * 32, source="test:b"))


def test_event_counts_merge_through_decorators():
    inner = BatchingTier()
    inner.counters["timeouts"] += 2
    seal = SealedTier(inner, RING)
    other = SealedTier(inner, WRONG)
    assert other.put(b"k" * 32, b"x" * 1000)
    assert seal.get_into(b"k" * 32, bytearray(1000)) is None  # another key's record: fails, deleted
    codec = CodecTier(seal, shape=(1, 2, 4, 1, 64), dtype="bfloat16", level="lossless", tables=None)
    got = codec.event_counts()
    assert got["timeouts"] == 2 and got["auth_failures"] == 1 and not inner.contains(b"k" * 32)
    assert set(TIER_EVENTS) >= {"auth_failures", "timeouts", "corrupt"}


class _GrowingCounter(collections.Counter):
    """A ``Counter`` that gains a key while it is iterated, as a tier's counters do when one of its
    threads counts a first event while the connector reads them (a dict copy does not call items())."""

    def items(self):
        for n, item in enumerate(super().items()):
            self[f"new_{n}"] += 1
            yield item


def test_event_counts_reads_a_snapshot_while_threads_add_counters():
    """A counter added while the connector reads them must not raise (it raised RuntimeError "dictionary
    changed size during iteration" in vLLM's step, from get_kv_connector_stats, in a Mooncake matrix row)."""
    tier = BatchingTier()
    tier.counters = _GrowingCounter(timeouts=2, gets=5)
    assert tier.event_counts() == {"timeouts": 2, "gets": 5}


def test_stats_carry_tier_events():
    a, b = LMTierStats(), LMTierStats()
    assert a.is_empty()
    a.add_tier_event("remote", "auth_failures", 2)
    b.add_tier_event("remote", "auth_failures", 1)
    b.add_tier_event("disk", "corrupt", 4)
    assert not a.is_empty()
    a.aggregate(b)
    assert a.data["tier_events"] == {"remote": {"auth_failures": 3}, "disk": {"corrupt": 4}}
    out = a.reduce()
    assert out["lmtier_remote_auth_failures"] == 3 and out["lmtier_disk_corrupt"] == 4
    again = LMTierStats(a.data)  # vLLM rebuilds stats from data across processes
    assert again.data["tier_events"] == a.data["tier_events"]
    a.reset()
    assert a.is_empty()
    before = process_tier_event_totals().get("remote", {}).get("timeouts", 0)
    sink = StatsSink()
    sink.add_tier_event("remote", "timeouts", 5)
    assert process_tier_event_totals()["remote"]["timeouts"] == before + 5
    assert sink.take().data["tier_events"] == {"remote": {"timeouts": 5}}


def test_sealed_tier_batches_over_a_batching_inner():
    inner = BatchingTier()
    seal, wrong = SealedTier(inner, RING), SealedTier(inner, WRONG)
    assert seal.batches_gets()
    keys = [os.urandom(32) for _ in range(6)]
    data = [os.urandom(5000) for _ in keys]
    for i, (k, d) in enumerate(zip(keys, data, strict=True)):
        assert (wrong if i == 3 else seal).put(k, d)
    inner.calls.clear()
    outs = [bytearray(5000) for _ in keys]
    got = seal.get_many_into(keys, outs)
    assert got == [5000, 5000, 5000, None, 5000, 5000] and inner.calls == [6]
    assert all(bytes(outs[i]) == data[i] for i in range(6) if i != 3)
    assert seal.counters["auth_failures"] == 1 and not inner.contains(keys[3])
    with pytest.raises(ValueError, match="2 keys, 1 outs"):
        seal.get_many_into(keys[:2], outs[:1])


def test_sealed_mooncake_batches_one_call(mooncake_store):
    from lmtier.tiers.mooncake import MooncakeSettings, MooncakeTier
    from tests.test_fetch_batch import CountingClient

    mc = MooncakeTier(
        mooncake_store.url, MooncakeSettings(mooncake_store.master.address, global_segment_size=0), timeout_s=10.0
    )
    seal = SealedTier(mc, RING)
    try:
        spy = CountingClient(mc._client())
        mc._store = spy
        keys = [os.urandom(32) for _ in range(5)]
        data = [np.random.default_rng(i).integers(0, 256, 1 << 20, dtype=np.uint8).tobytes() for i in range(5)]
        assert all(seal.put(k, d) for k, d in zip(keys, data, strict=True))
        outs = [bytearray(1 << 20) for _ in keys]
        assert seal.get_many_into(keys, outs) == [1 << 20] * 5
        assert [bytes(o) for o in outs] == data and spy.calls["batch_get_into"] == 1
    finally:
        seal.close()


def test_disk_record_path_oddities_reach_the_connectors_tier_events(tmp_path, monkeypatch):
    """A directory at a record path and a record that cannot be opened (EACCES) are misses counted
    by the disk tier (``not_regular``, ``get_errors``) and exported by the connector's worker as tier
    events (``vllm:lmtier_tier_events_total{tier="disk",...}``; issue 20 section 2: "counted in the
    metrics"). Before, TIER_EVENTS left both out: the counts never left the tier. The manager's
    write-through counts of the disk tier (``writes_skipped``, ``writes_dropped``) go the same way."""
    import errno

    from lmtier.integration.vllm.stats import TierEventReporter
    from lmtier.manager import TierManager
    from lmtier.tiers.disk import DiskTier

    disk = DiskTier([str(tmp_path / "d")], 16 << 20, io_threads=1)
    manager = TierManager(cpu=None, disk=disk)
    try:
        sink = StatsSink()
        reporter = TierEventReporter(manager, sink)  # the worker's
        keys = [bytes([i]) * 32 for i in (1, 2)]
        for k in keys:
            assert disk.put(k, b"x" * 5000)
        paths = sorted(str(p) for p in (tmp_path / "d").rglob("*.lmt"))
        assert len(paths) == 2
        dir_path = disk._index[keys[0]].path
        os.unlink(dir_path)
        os.mkdir(dir_path)  # a directory where the record was
        real_open = os.open

        def deny(path, flags, *args, **kwargs):
            if os.fspath(path) == disk._index[keys[1]].path:
                raise PermissionError(errno.EACCES, "Permission denied", path)
            return real_open(path, flags, *args, **kwargs)

        monkeypatch.setattr(os, "open", deny)
        assert disk.get_into(keys[1], bytearray(5000)) is None
        monkeypatch.undo()
        assert disk.get_into(keys[0], bytearray(5000)) is None
        reporter.report()
        taken = sink.take()
        assert taken is not None, "no tier event reported"
        events = taken.data["tier_events"]
        assert events == {"disk": {"not_regular": 1, "get_errors": 1}}, events
        assert {"not_regular", "get_errors"} <= set(TIER_EVENTS)
        manager.count("write_back_skipped")  # evicted in the step without a disk copy
        manager.count("disk_skipped_evicted", 2)  # evicted before the write-through ran
        manager.count("disk_dropped_queue_full")
        reporter.report()
        assert sink.take().data["tier_events"] == {"disk": {"writes_skipped": 3, "writes_dropped": 1}}
        with pytest.raises(ValueError, match="'disk' or 'remote'"):
            manager.write_events("cpu")
    finally:
        manager.close(persist=False)


# ---------------------------------------------------------------------------------------- P2P (issue 16)
def test_p2p_tier_events_reach_the_connector_stats(redis_server):
    """The P2P tier's events (a peer off the allow-list, an entry that fails its MAC, a closed
    directory breaker) are TIER_EVENTS under tier "p2p" in the stats the connector reports —
    through the same reporter the worker and a scheduler in another process use. Old code: the P2P
    tier was not reported at all, and its directory's counters were not in its event counts."""
    from types import SimpleNamespace

    import redis

    from lmtier.integration.vllm.stats import TierEventReporter
    from lmtier.remote_url import parse_redis_url
    from lmtier.tiers.p2p.directory import Entry
    from lmtier.tiers.p2p.tier import P2PTier

    ns, token = bytes(range(16)), b"p2p-events-token-0123"
    # A lookups-only tier (no CPU pool, so no NIXL agent), as in a scheduler: it reads only the
    # directory. It accepts peers of host 10.0.0.8 only.
    tier = P2PTier(
        None,
        parse_redis_url(redis_server.url),
        namespace=ns,
        node_id="10.0.0.7:1",
        token=token,
        allowed=lambda node: node.startswith("10.0.0.8:"),
        breaker_failures=1,
        breaker_reset_s=60.0,
    )
    sink = StatsSink()
    reporter = TierEventReporter(SimpleNamespace(disk=None, p2p=tier, remote=None), sink)
    try:
        e = Entry(epoch=1, offset=0, length=1000, generation=1, xxh3=5)
        keys = [os.urandom(32) for _ in range(3)]
        assert tier.directory.publish("10.0.0.9:1", [(k, e) for k in keys[:2]])  # a peer not allowed
        forged = e.encode(b"x" * 20, ns, keys[2], "10.0.0.8:1")  # signed with another token: fails its MAC
        writer = redis.Redis.from_url(redis_server.url)
        writer.hset(tier.directory.chunk_name(keys[2]), "10.0.0.8:1", forged)
        writer.close()
        assert tier.contains_many(keys) == [False, False, False]
        reporter.report()
        assert sink.take().data["tier_events"] == {"p2p": {"refused": 2, "bad_entries": 1}}
        redis_server.kill()  # the directory is gone: one failed call opens its breaker (1 failure)
        assert tier.contains_many(keys) == [False] * 3 and tier.contains_many(keys) == [False] * 3
        reporter.report()
        assert sink.take().data["tier_events"] == {"p2p": {"directory_errors": 1, "breaker_rejects": 1}}
        got = tier.event_counts()
        assert {k for k, v in got.items() if v and k in TIER_EVENTS} == {
            "refused",
            "bad_entries",
            "directory_errors",
            "breaker_rejects",
        }
    finally:
        tier.close()
