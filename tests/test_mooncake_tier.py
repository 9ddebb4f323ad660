"""The Mooncake Store tier (lmtier.tiers.mooncake) against a real mooncake_master and store server
(lmtier.testing.mooncake, loopback ports per run): round trips, the tier manager, the codec,
corrupt/replaced/evicted values, a lying put (#1817), and master kill / pause / restart.
Skips without the mooncake package, fails instead under LMTIER_REQUIRE_MOONCAKE=1 (CI)."""

from __future__ import annotations

import json
import os
import time

import numpy as np
import pytest
import torch

from lmtier import record as rec
from lmtier.bench.presets import preset
from lmtier.config import LMTierConfig
from lmtier.keys import Namespace
from lmtier.manager import TierManager
from lmtier.tiers.mooncake import MooncakeSettings, MooncakeTier


def K(i: int) -> bytes:
    return i.to_bytes(4, "little") * 8


def payload(i: int, n: int) -> bytes:
    return np.random.default_rng(i).integers(0, 256, n, dtype=np.uint8).tobytes()


def miss_or_record(got, out: bytearray, i: int) -> bool:
    """A get's result is a miss, or the whole record ``payload(i, 1 MiB)`` in ``out`` — never other bytes."""
    return got is None or (got == 1 << 20 and bytes(out) == payload(i, 1 << 20))


def make_tier(store, **kw) -> MooncakeTier:
    kw.setdefault("timeout_s", 1.0)
    kw.setdefault("bounce_bytes", 64 << 20)
    # no segment of its own: the chunks live in the store server (as for an engine that restarts)
    return MooncakeTier(store.url, MooncakeSettings(store.master.address, global_segment_size=0), **kw)


def raw_client(store):
    from mooncake.store import MooncakeDistributedStore

    s = MooncakeDistributedStore()
    assert s.setup("127.0.0.1", "P2PHANDSHAKE", 0, 16 << 20, "tcp", "", store.master.address) == 0
    return s


@pytest.fixture
def tier(mooncake_store):
    t = make_tier(mooncake_store)
    yield t
    t.close()


@pytest.mark.parametrize("n", [8, 32])
def test_round_trip_smollm2_chunks(tier, n):
    size = 256 * preset("smollm2-135m").bytes_per_token()  # one 256-token chunk, 5.9 MB
    keys = [K(1000 * n + i) for i in range(n)]
    data = [payload(i, size) for i in range(n)]
    assert tier.contains_many(keys) == [False] * n
    assert tier.put_many(keys, data) == [True] * n  # 32 chunks > the 64 MiB bounce: several calls
    assert tier.contains_many(keys + [K(7)]) == [True] * n + [False]
    outs = [bytearray(size) for _ in range(n)]
    assert tier.get_many_into(keys, outs) == [size] * n
    assert all(bytes(o) == d for o, d in zip(outs, data))
    out = torch.empty(size, dtype=torch.uint8)  # one by one, into a tensor
    assert tier.get_into(keys[3], out) == size and out.numpy().tobytes() == data[3]
    assert tier.counters["corrupt"] == 0 and tier.counters["put_unconfirmed"] == 0


def test_value_is_one_self_describing_record(tier, mooncake_store):
    assert tier.put(K(1), payload(1, 5000))
    raw = raw_client(mooncake_store)
    try:
        v = raw.get("lmtier:" + K(1).hex())
        h = rec.decode_header(v, expected_key=K(1))
        assert h.payload_offset == 128 and h.payload_bytes == 5000 and len(v) == 5128
        rec.verify_payload(h, v[128:])
    finally:
        raw.close()


def test_out_too_small_is_miss_and_kept(tier):
    assert tier.put(K(2), payload(2, 10000))
    assert tier.get_into(K(2), bytearray(9999)) is None
    assert tier.contains(K(2))
    assert tier.delete(K(2)) and not tier.contains(K(2)) and not tier.delete(K(2))


@pytest.mark.parametrize("damage", ["payload_bit", "truncated", "other_key", "garbage"])
def test_corrupt_or_replaced_value_is_miss_and_removed(tier, mooncake_store, damage):
    good = rec.encode_header(K(3), 4096, rec.payload_checksum(payload(3, 4096)), payload_offset=128)
    good += payload(3, 4096)
    bad = bytearray(good)
    if damage == "payload_bit":
        bad[128 + 100] ^= 1
    elif damage == "truncated":
        bad = bad[:-10]
    elif damage == "other_key":
        other = payload(9, 4096)
        bad = bytearray(rec.encode_header(K(9), 4096, rec.payload_checksum(other), payload_offset=128) + other)
    else:
        bad = bytearray(os.urandom(4224))
    raw = raw_client(mooncake_store)
    try:
        assert raw.put("lmtier:" + K(3).hex(), bytes(bad)) == 0
        assert tier.contains(K(3))
        assert tier.get_into(K(3), bytearray(4096)) is None
        assert tier.counters["corrupt"] == 1
        assert not tier.contains(K(3))  # removed
        assert raw.put("lmtier:" + K(3).hex(), bytes(good)) == 0  # a correct record is a hit
        out = bytearray(4096)
        assert tier.get_into(K(3), out) == 4096 and bytes(out) == payload(3, 4096)
    finally:
        raw.close()


def test_removed_between_lookup_and_read_is_miss(tier, mooncake_store):
    """Another client drops the value (as an eviction would) after contains said yes."""
    assert tier.put_many([K(4), K(5)], [payload(4, 8192), payload(5, 8192)]) == [True, True]
    assert tier.contains_many([K(4), K(5)]) == [True, True]
    raw = raw_client(mooncake_store)
    try:
        assert raw.remove("lmtier:" + K(4).hex(), True) == 0
    finally:
        raw.close()
    outs = [bytearray(8192), bytearray(8192)]
    assert tier.get_many_into([K(4), K(5)], outs) == [None, 8192]
    assert bytes(outs[1]) == payload(5, 8192) and tier.counters["corrupt"] == 0


def test_real_eviction_is_miss_never_wrong_bytes():
    """Fill the 512 MiB segment twice over: the master evicts; every read is a verified hit or a miss.
    A short lease (200 ms), so that the objects just written become evictable."""
    from lmtier.testing.mooncake import start_or_skip

    store = start_or_skip(lease_ttl_ms=200)
    t = make_tier(store)
    try:
        size = 8 << 20
        ok = []
        for i in range(0, 128, 8):
            keys = [K(5000 + j) for j in range(i, i + 8)]
            got = t.put_many(keys, [payload(j, size) for j in range(i, i + 8)])
            for _ in range(20):  # the master evicts in the background: a full segment refuses puts until
                if all(got):  # it has (how soon depends on the machine's load, not on lmtier)
                    break
                time.sleep(0.25)
                idx = [j for j, g in enumerate(got) if not g]
                for j, g in zip(idx, t.put_many([keys[j] for j in idx], [payload(i + j, size) for j in idx])):
                    got[j] = g
            ok += got
        assert sum(ok) > 64
        keys = [K(5000 + j) for j in range(128)]
        present = t.contains_many(keys)
        assert 0 < sum(present) < 128  # some evicted
        out = bytearray(size)
        hits = 0
        for j in range(0, 128, 5):
            n = t.get_into(keys[j], out)
            if n is not None:
                hits += 1
                assert bytes(out) == payload(j, size)
        assert hits > 0 and t.counters["corrupt"] == 0
    finally:
        t.close()
        store.close()


def test_put_ok_but_absent_is_not_published(tier, monkeypatch):
    """Mooncake #1817: batch_put_from says 0 but nothing was stored -> put returns False."""

    class Liar:
        def __init__(self, real):
            self.real = real

        def batch_put_from(self, names, ptrs, sizes):
            return [0] * len(names)

        def __getattr__(self, name):
            return getattr(self.real, name)

    monkeypatch.setattr(tier, "_store", Liar(tier._store))
    assert tier.put_many([K(6), K(7)], [b"x" * 100, b"y" * 100]) == [False, False]
    assert tier.counters["put_unconfirmed"] == 2 and not tier.contains(K(6))


def test_master_killed_bounded_misses_then_recovery(mooncake_store):
    t = make_tier(mooncake_store, timeout_s=0.5, breaker_reset_s=1.0)
    try:
        assert t.put(K(10), payload(10, 1 << 20))
        mooncake_store.master.kill()
        for _ in range(10):
            t0 = time.monotonic()
            out = bytearray(1 << 20)  # zeroed per read: a 'hit' that wrote nothing cannot pass
            got = t.get_into(K(10), out)  # a miss, or the verified record (as with a paused master)
            assert miss_or_record(got, out, 10), got
            assert t.get_into(K(11), out) is None
            assert t.contains_many([K(10), K(11)]) == [False, False]
            assert t.put(K(12), payload(12, 4096)) is False
            assert time.monotonic() - t0 < 4 * 0.5 + 0.5  # each call at most timeout_s (+ slack)
        assert t.breaker.times_opened >= 1
        mooncake_store.master.start()  # same port; its metadata is gone, the servers re-mount
        deadline = time.monotonic() + 60
        while not t.put(K(13), payload(13, 1 << 20)):
            assert time.monotonic() < deadline, dict(t.counters)
            time.sleep(0.5)
        out = bytearray(1 << 20)
        assert t.get_into(K(13), out) == 1 << 20 and bytes(out) == payload(13, 1 << 20)
        out = bytearray(1 << 20)
        # stored before the crash: the new master does not list it (a miss), unless the client still
        # reads it as with a paused master above; never other bytes
        got = t.get_into(K(10), out)
        assert miss_or_record(got, out, 10), got
    finally:
        t.close()


def test_master_paused_bounded_latency_then_recovery(mooncake_store):
    t = make_tier(mooncake_store, timeout_s=0.5, breaker_reset_s=1.0, workers=2)
    try:
        assert t.put(K(20), payload(20, 1 << 20))
        mooncake_store.master.pause()
        worst = 0.0
        t_start = time.monotonic()
        for _ in range(20):
            t0 = time.monotonic()
            # K(20), which this client just stored: a miss, or (2 of ~70 runs here, once in CI) the
            # verified record — the client can read it without the stopped master; never other bytes.
            # (Its contains() is not asserted: whether the client answers that without the master
            # too is Mooncake's business; K(21) below checks the path that needs the master.)
            out = bytearray(1 << 20)  # zeroed per read: a 'hit' that wrote nothing cannot pass
            got = t.get_into(K(20), out)
            assert miss_or_record(got, out, 20), got
            # a key this client never touched needs the master: a miss within the timeout
            assert t.get_into(K(21), out) is None
            assert t.contains(K(21)) is False
            worst = max(worst, time.monotonic() - t0)
        # bounded, not fast: a paused master would block a call without the 0.5 s timeout forever; the
        # slack keeps the verdict independent of the machine's load (issue 20 §4)
        assert worst < 3 * 0.5 + 5 and time.monotonic() - t_start < 60
        assert t.counters["timeouts"] >= 1
        mooncake_store.master.resume()
        deadline = time.monotonic() + 60
        while not t.contains(K(20)):  # batch_is_exist: answered by the resumed master
            assert time.monotonic() < deadline, dict(t.counters)
            time.sleep(0.3)
        out = bytearray(1 << 20)
        assert t.get_into(K(20), out) == 1 << 20 and bytes(out) == payload(20, 1 << 20)
    finally:
        mooncake_store.master.resume()
        t.close()


def test_master_down_at_startup_degrades_then_connects(mooncake_store):
    mooncake_store.master.kill()
    t0 = time.monotonic()
    t = make_tier(mooncake_store, timeout_s=0.5, setup_timeout_s=1.0, breaker_reset_s=0.5)
    try:
        assert time.monotonic() - t0 < 5
        assert t.contains(K(30)) is False and t.put(K(30), b"z" * 100) is False
        mooncake_store.master.start()
        deadline = time.monotonic() + 60
        while not t.put(K(30), b"z" * 100):
            assert time.monotonic() < deadline, dict(t.counters)
            time.sleep(0.5)
        assert t.counters["setups"] >= 2
    finally:
        t.close()


# ------------------------------------------------------------------------------------------------
# through the tier manager (CPU pool + Mooncake), with and without the codec


def _config(store, tmp_path, **extra):
    path = tmp_path / "mooncake.json"
    path.write_text(
        json.dumps(
            {
                "local_hostname": "127.0.0.1",
                "metadata_server": "P2PHANDSHAKE",
                "global_segment_size": 0,
                "local_buffer_size": "16MB",
                "protocol": "tcp",
                "master_server_address": store.master.address,
            }
        )
    )
    values = {"chunk_size": 16, "remote_url": store.url, "remote_timeout_s": 1.0, **extra}
    return LMTierConfig.from_dict(values, env={"MOONCAKE_CONFIG_PATH": str(path)})


def test_manager_write_through_and_second_engine_loads(mooncake_store, tmp_path):
    ns = Namespace(model="m", num_layers=2, num_kv_heads=2, head_size=64, kv_dtype="bfloat16", chunk_size=16)
    n = ns.chunk_bytes
    cfg = _config(mooncake_store, tmp_path, max_local_cpu_size=4 * n / 2**30)
    assert cfg.remote.mooncake.global_segment_size == 0 and cfg.remote.mooncake.local_buffer_size == 16 << 20
    a = TierManager.from_config(cfg, ns, arena=torch.empty(4 * n, dtype=torch.uint8))
    assert isinstance(a.remote, MooncakeTier)
    for i in range(3):
        assert a.store(K(i), payload(i, n)).result(30)
    assert a.flush(30) and a.counters["stored_remote"] == 3
    a.close()
    b = TierManager.from_config(cfg, ns, arena=torch.empty(4 * n, dtype=torch.uint8))  # "engine B"
    try:
        assert b.lookup([K(0), K(1), K(2), K(3)]) == ["remote"] * 3
        out = torch.empty(n, dtype=torch.uint8)
        for i in range(3):
            assert b.retrieve(K(i), out) and out.numpy().tobytes() == payload(i, n)
        assert b.lookup([K(1)]) == ["cpu"]
    finally:
        b.close()


@pytest.mark.parametrize("level", ["lossless", "default"])
def test_manager_with_codec(mooncake_store, tmp_path, level):
    from lmtier.tiers.codec import CodecTier

    ns = Namespace(model="m", num_layers=2, num_kv_heads=2, head_size=64, kv_dtype="bfloat16", chunk_size=16)
    n = ns.chunk_bytes
    cfg = _config(
        mooncake_store, tmp_path, max_local_cpu_size=4 * n / 2**30, remote_serde="cachegen", codec_level=level
    )
    a = TierManager.from_config(cfg, ns, arena=torch.empty(4 * n, dtype=torch.uint8))
    assert isinstance(a.remote, CodecTier) and isinstance(a.remote.inner, MooncakeTier)
    x = (torch.randn(2, 2, 16, 2, 64, generator=torch.Generator().manual_seed(5)) * 3).to(torch.bfloat16)
    raw = x.view(-1).view(torch.uint8)
    assert a.store(K(40), raw).result(30) and a.flush(30)
    assert a.remote.inner.counters["puts"] == 1
    a.close()
    b = TierManager.from_config(cfg, ns, arena=torch.empty(4 * n, dtype=torch.uint8))
    try:
        out = torch.empty(n, dtype=torch.uint8)
        assert b.lookup([K(40)]) == ["remote"] and b.retrieve(K(40), out)
        y = out.view(torch.bfloat16).view(x.shape)
        if level == "lossless":
            assert torch.equal(out, raw)
        else:  # exactly what the codec's quantizer gives (as tests/test_codec_tier.py checks)
            from lmtier.codec import quant as Q

            sym, side = Q.quantize(x, level)
            assert torch.equal(y, Q.dequantize(sym, side, level, tuple(x.shape), x.dtype))
            assert not torch.equal(out, raw)
    finally:
        b.close()


def test_manager_master_killed_degrades(mooncake_store, tmp_path):
    ns = Namespace(model="m", num_layers=1, num_kv_heads=1, head_size=512, kv_dtype="float32", chunk_size=2)
    cfg = _config(mooncake_store, tmp_path, chunk_size=2, max_local_cpu_size=4 * 8192 / 2**30, remote_timeout_s=0.5)
    m = TierManager.from_config(cfg, ns, arena=torch.empty(4 * 8192, dtype=torch.uint8))
    try:
        assert m.store(K(0), payload(0, 8192)).result(30) and m.flush(30)
        mooncake_store.master.kill()
        t0 = time.monotonic()
        assert m.lookup([K(0), K(1)]) == ["cpu"]
        assert m.retrieve(K(1), torch.empty(8192, dtype=torch.uint8)) is False
        assert m.store(K(2), payload(2, 8192)).result(30) is True  # the CPU pool still serves
        assert m.flush(30) and time.monotonic() - t0 < 10
    finally:
        m.close()


def test_bench_quick(tmp_path):
    """`lmtier bench mooncake --quick`: the tier, the raw client and Redis (when present) in one run."""
    from lmtier import cli
    from lmtier.testing.mooncake import mooncake_client_importable, skip_or_fail

    if mooncake_client_importable() is not None:
        skip_or_fail("the mooncake client cannot be imported")
    out = tmp_path / "b.json"
    assert cli.main(["bench", "mooncake", "--quick", "--no-redis", "--json", str(out)]) == 0
    (row,) = json.loads(out.read_text())["rows"]
    assert row["chunks"] == 8 and row["preset"] == "smollm2-135m"
    assert row["direct_put_GBps"] > 0 and row["direct_get_GBps"] > 0 and row["raw_get_GBps"] > 0
    assert row["direct_get_%raw"] > 0 and "[" in row["direct_get_pairs"]
