"""Tier events (``Tier.event_counts``, ``TIER_EVENTS``) through the decorators and the connector's
stats; the sealed tier's batched reads over a batching inner tier (real Mooncake Store)."""

from __future__ import annotations

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
    metrics"). Before, TIER_EVENTS left both out: the counts never left the tier."""
    import errno
    from types import SimpleNamespace

    from lmtier.integration.vllm.worker_role import LMTierWorker
    from lmtier.tiers.disk import DiskTier

    disk = DiskTier([str(tmp_path / "d")], 16 << 20, io_threads=1)
    try:
        worker = SimpleNamespace(manager=SimpleNamespace(disk=disk, remote=None), _stats=StatsSink())
        worker._tier_event_counts = lambda: LMTierWorker._tier_event_counts(worker)
        worker._events_seen = worker._tier_event_counts()
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
        LMTierWorker.report_tier_events(worker)
        taken = worker._stats.take()
        assert taken is not None, "no tier event reported"
        events = taken.data["tier_events"]
        assert events == {"disk": {"not_regular": 1, "get_errors": 1}}, events
        assert {"not_regular", "get_errors"} <= set(TIER_EVENTS)
    finally:
        disk.close()
