"""Sealed remote records (lmtier.tiers.seal): key sources and rotation, the config keys, and the
SealedTier over a real redis-server (and a real Mooncake Store when the package is there).

The attacker of these tests can write to the store and compute chunk keys but does not hold the
seal key: every forged value is a *well-formed* tier record (the Redis record header and its xxh3
checksums recomputed around the tampered sealed bytes), so what rejects it is the seal, not the
checksum. Each must be a miss, counted, and deleted.
"""

from __future__ import annotations

import logging
import struct

import numpy as np
import pytest
import torch

from lmtier import record as rec
from lmtier.config import ConfigError, LMTierConfig
from lmtier.keys import Namespace
from lmtier.manager import TierManager
from lmtier.tiers.seal import KeyRing, SealKey, load_key, parse_sources
from lmtier.tiers.seal.tier import HEADER_BYTES, OVERHEAD_BYTES, SealedTier, Sealer, SealError, SealMode

redis = pytest.importorskip("redis")
from lmtier.tiers.redis import RedisTier  # noqa: E402

MiB = 1 << 20
NS = bytes(range(16))
NS_OTHER = bytes(range(1, 17))
MASTER = {name: bytes([i]) * 32 for i, name in enumerate(["new", "old", "wrong"], start=7)}
RING_KEYS = {name: SealKey.from_bytes(m, source=f"test:{name}") for name, m in MASTER.items()}


def ring(*names: str) -> KeyRing:
    return KeyRing.of(*(RING_KEYS[n] for n in names))


def K(i: int) -> bytes:
    return i.to_bytes(4, "little") * 8


def payload(i: int, n: int) -> bytes:
    return np.random.default_rng(i).integers(0, 256, n, dtype=np.uint8).tobytes()


def write_key(path, master: bytes, mode: int = 0o600) -> str:
    path.write_text(master.hex() + "\n")
    path.chmod(mode)
    return f"file:{path}"


def sealed(srv, keys=("new",), *, ns=NS, mode=SealMode.AUTHENTICATE) -> SealedTier:
    return SealedTier(RedisTier(srv.url, timeout_s=2.0), ring(*keys), namespace=ns, mode=mode)


# ------------------------------------------------------------------------------------ key sources
def test_key_from_file_and_env(tmp_path):
    src = write_key(tmp_path / "k", MASTER["new"])
    k = load_key("remote_auth_key", src, {})
    assert k.key_id == RING_KEYS["new"].key_id and k.aes_key == RING_KEYS["new"].aes_key
    assert (
        load_key("remote_auth_key", "env:SEAL", {"SEAL": " " + MASTER["new"].hex().upper() + "\n"}).key_id == k.key_id
    )
    assert MASTER["new"].hex() not in repr(k) and k.aes_key.hex() not in repr(k) and k.key_id.hex() in repr(k)
    assert len({k.key_id for k in RING_KEYS.values()}) == 3


@pytest.mark.parametrize(
    "content, why",
    [
        ("ab" * 31, "holds a key of 31 bytes"),
        ("ab" * 65, "holds a key of 65 bytes"),
        ("not hex at all, but a pasted password of some length ....................", "must be hex"),
        ("", "holds a key of 0 bytes"),
    ],
)
def test_bad_key_file_is_a_clear_startup_error(tmp_path, content, why):
    p = tmp_path / "k"
    p.write_text(content)
    p.chmod(0o600)
    with pytest.raises(ConfigError, match=why) as e:
        load_key("remote_auth_key", f"file:{p}", {})
    assert "remote_auth_key" in str(e.value) and (not content or content not in str(e.value))


def test_missing_sources_are_clear_errors(tmp_path):
    with pytest.raises(ConfigError, match="cannot read the key file"):
        load_key("remote_auth_key", f"file:{tmp_path / 'absent'}", {})
    with pytest.raises(ConfigError, match="not a regular file"):
        load_key("remote_auth_key", f"file:{tmp_path}", {})
    with pytest.raises(ConfigError, match="SEAL is unset or empty"):
        load_key("remote_auth_key", "env:SEAL", {})


def test_key_pasted_into_config_is_rejected_without_echo():
    secret = MASTER["new"].hex()
    for value in (secret, f"env:{secret[:8]}-x", f"file:/a,{secret}"):
        with pytest.raises(ConfigError, match="file:PATH' or 'env:NAME'") as e:
            parse_sources("remote_auth_key", value)
        assert secret not in str(e.value)


def test_group_readable_key_file_warns(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="lmtier.tiers.seal"):
        load_key("remote_auth_key", write_key(tmp_path / "k", MASTER["new"], 0o644), {})
    assert "chmod 600" in caplog.text and MASTER["new"].hex() not in caplog.text


def test_keyring_rejects_a_key_listed_twice():
    with pytest.raises(ValueError, match="listed twice"):
        ring("new", "old", "new")


# ------------------------------------------------------------------------------------------ config
def test_config_keys(tmp_path, redis_server, caplog):
    new, old = write_key(tmp_path / "new", MASTER["new"]), write_key(tmp_path / "old", MASTER["old"])
    cfg = LMTierConfig.from_dict(
        {
            "remote_url": redis_server.url,
            "remote_auth_key": new,
            "remote_auth_accept_keys": f"{old}, env:OLDER",
            "remote_encrypt": True,
        },
        env={"OLDER": MASTER["wrong"].hex()},
    )
    r = cfg.remote
    assert r.keyring.signing.key_id == RING_KEYS["new"].key_id and r.encrypt
    assert set(r.keyring.accepted) == {k.key_id for k in RING_KEYS.values()}
    assert hash(cfg) == hash(LMTierConfig.from_dict(cfg.to_dict(), env={"OLDER": MASTER["wrong"].hex()}))
    d = cfg.to_dict()
    assert d["remote_auth_key"] == new and d["remote_auth_accept_keys"] == f"{old},env:OLDER" and d["remote_encrypt"]
    with caplog.at_level(logging.INFO, logger="lmtier.config"):
        cfg.log_effective()
    text = caplog.text + repr(cfg)
    assert all(m.hex() not in text for m in MASTER.values())
    assert all(k.aes_key.hex() not in text for k in RING_KEYS.values())


@pytest.mark.parametrize(
    "values, key",
    [
        ({"remote_encrypt": True}, "remote_encrypt"),
        ({"remote_auth_accept_keys": "env:X"}, "remote_auth_accept_keys"),
        ({"remote_auth_key": "env:A,env:B"}, "remote_auth_key"),
        ({"remote_auth_key": "env:UNSET"}, "remote_auth_key"),
        ({"remote_auth_key": "env:A", "remote_auth_accept_keys": "env:A"}, "remote_auth_accept_keys"),
        ({"remote_encrypt": "yes"}, "remote_encrypt"),
    ],
)
def test_config_errors_name_the_key(redis_server, values, key):
    with pytest.raises(ConfigError, match=key):
        LMTierConfig.from_dict({"remote_url": redis_server.url, **values}, env={"A": MASTER["new"].hex()})


def test_keys_without_remote_url_warn(caplog):
    with caplog.at_level(logging.WARNING, logger="lmtier.config"):
        cfg = LMTierConfig.from_dict({"remote_auth_key": "env:A", "remote_encrypt": True})
    assert cfg.remote.keyring is None and "remote_auth_key='env:A' without remote_url" in caplog.text


# ------------------------------------------------------------------------- round trips over Redis
@pytest.mark.parametrize("mode", list(SealMode))
@pytest.mark.parametrize("n", [0, 1, 4097, 5 * MiB + 3])
def test_round_trip_exact(redis_server, mode, n):
    t = sealed(redis_server, mode=mode)
    try:
        data = payload(n, n)
        assert t.put(K(n), data)
        out = bytearray(n + 5)
        assert t.get_into(K(n), out) == n and bytes(out[:n]) == data
        value = redis.Redis.from_url(redis_server.url).get(b"lmtier:" + K(n).hex().encode())
        assert len(value) == rec.COMPACT_PAYLOAD_OFFSET + n + OVERHEAD_BYTES
        if n >= 64:  # encrypted: no 64-byte run of the payload is stored; authenticated: it is
            assert (data[n // 2 : n // 2 + 64] in value) is (mode == SealMode.AUTHENTICATE)
        assert t.counters["hits"] == 1 and t.counters["auth_failures"] == 0
    finally:
        t.close()


def test_tensors_and_too_small_out(redis_server):
    t = sealed(redis_server, mode=SealMode.ENCRYPT)
    try:
        x = torch.arange(1000, dtype=torch.float32)
        assert t.put(K(1), x)
        y = torch.zeros(1000, dtype=torch.float32)
        assert t.get_into(K(1), y) == 4000 and torch.equal(x, y)
        assert t.get_into(K(1), bytearray(3999)) is None and t.contains(K(1)), "too small: a miss, kept"
        assert t.counters["auth_failures"] == 0
    finally:
        t.close()


# ------------------------------------------------------------------------------- forged records
class Store:
    """Raw access to the values, as an attacker with write access to Redis has it."""

    def __init__(self, srv) -> None:
        self.r = redis.Redis.from_url(srv.url)

    @staticmethod
    def name(key: bytes) -> bytes:
        return b"lmtier:" + key.hex().encode()

    def sealed(self, key: bytes) -> bytes:
        value = self.r.get(self.name(key))
        hdr = rec.decode_header(value, expected_key=key)
        return value[hdr.payload_offset : hdr.record_bytes]

    def plant(self, key: bytes, body: bytes) -> None:
        """Store ``body`` as a well-formed tier record of ``key`` (valid xxh3 header)."""
        header = rec.encode_header(
            key, len(body), rec.payload_checksum(body), payload_offset=rec.COMPACT_PAYLOAD_OFFSET
        )
        self.r.set(self.name(key), header + body)

    def exists(self, key: bytes) -> bool:
        return bool(self.r.exists(self.name(key)))


def assert_rejected(t: SealedTier, store: Store, key: bytes, reason: str, n: int = 3000) -> None:
    before = t.counters["auth_failures"]
    out = bytearray(n)
    assert t.get_into(key, out) is None
    assert t.counters["auth_failures"] == before + 1 and t.counters[f"auth_{reason}"] >= 1, dict(t.counters)
    assert not store.exists(key), "a value that does not open is deleted"


@pytest.mark.parametrize("mode", list(SealMode))
def test_written_without_the_key_is_a_miss_and_deleted(redis_server, mode):
    plain, t, store = RedisTier(redis_server.url), sealed(redis_server, mode=mode), Store(redis_server)
    try:
        assert plain.put(K(2), payload(2, 3000))
        assert t.contains(K(2)), "contains does not verify: the load does"
        assert_rejected(t, store, K(2), "unsealed")
    finally:
        plain.close()
        t.close()


@pytest.mark.parametrize("mode", list(SealMode))
def test_wrong_key_is_a_miss_and_deleted(redis_server, mode):
    attacker, t, store = sealed(redis_server, ("wrong",), mode=mode), sealed(redis_server), Store(redis_server)
    try:
        assert attacker.put(K(3), payload(3, 3000))
        assert_rejected(t, store, K(3), "unknown_key")
    finally:
        attacker.close()
        t.close()


def test_forged_key_id_with_wrong_key_is_bad_tag(redis_server):
    """A forger who copies an accepted key id into a record sealed with another key."""
    attacker, t, store = sealed(redis_server, ("wrong",)), sealed(redis_server), Store(redis_server)
    try:
        assert attacker.put(K(4), payload(4, 3000))
        body = bytearray(store.sealed(K(4)))
        body[8:16] = RING_KEYS["new"].key_id
        store.plant(K(4), bytes(body))
        assert_rejected(t, store, K(4), "bad_tag")
    finally:
        attacker.close()
        t.close()


def test_rotation(redis_server):
    """New-key records verify under [new, old]; old-key records under [new, old] but not [new]."""
    old_writer, new_writer = sealed(redis_server, ("old",)), sealed(redis_server, ("new", "old"))
    both, only_new, store = sealed(redis_server, ("new", "old")), sealed(redis_server, ("new",)), Store(redis_server)
    try:
        assert old_writer.put(K(5), payload(5, 3000)) and new_writer.put(K(6), payload(6, 3000))
        assert both.sealer.ring.signing.key_id == RING_KEYS["new"].key_id
        out = bytearray(3000)
        for k in (K(5), K(6)):
            assert both.get_into(k, out) == 3000 and bytes(out) == payload(int.from_bytes(k[:4], "little"), 3000)
        assert only_new.get_into(K(6), out) == 3000
        assert old_writer.get_into(K(6), out) is None and old_writer.counters["auth_unknown_key"] == 1
        assert new_writer.put(K(6), payload(6, 3000))
        assert_rejected(only_new, store, K(5), "unknown_key")  # rotated out
    finally:
        for t in (old_writer, new_writer, both, only_new):
            t.close()


@pytest.mark.parametrize("mode", list(SealMode))
def test_swapped_values_are_misses_and_deleted(redis_server, mode):
    """The genuine sealed record of one key planted under another (valid MAC, wrong key)."""
    t, store = sealed(redis_server, mode=mode), Store(redis_server)
    try:
        assert t.put(K(7), payload(7, 3000)) and t.put(K(8), payload(8, 3000))
        a, b = store.sealed(K(7)), store.sealed(K(8))
        store.plant(K(7), b)
        store.plant(K(8), a)
        assert_rejected(t, store, K(7), "mismatch")
        assert_rejected(t, store, K(8), "mismatch")
    finally:
        t.close()


def test_other_namespace_is_a_miss(redis_server):
    other, t, store = sealed(redis_server, ns=NS_OTHER), sealed(redis_server), Store(redis_server)
    try:
        assert other.put(K(9), payload(9, 3000))
        assert_rejected(t, store, K(9), "mismatch")
    finally:
        other.close()
        t.close()


N_FLIP = 3000
# (what, offset into the sealed record); negative offsets count from the end.
FLIPS = [
    ("magic", 0),
    ("version", 4),
    ("alg", 5),
    ("reserved", 6),
    ("key id", 9),
    ("nonce", 16),
    ("nonce end", 27),
    ("reserved 2", 30),
    ("body length", 32),
    ("chunk key", 40),
    ("namespace", 80),
    ("reserved 3", 95),
    ("body start", HEADER_BYTES),
    ("body middle", HEADER_BYTES + N_FLIP // 2),
    ("body end", HEADER_BYTES + N_FLIP - 1),
    ("tag", -16),
    ("tag end", -1),
]


@pytest.mark.parametrize("mode", list(SealMode))
@pytest.mark.parametrize("what, off", FLIPS, ids=[f[0] for f in FLIPS])
def test_one_flipped_bit_is_a_miss_and_deleted(redis_server, mode, what, off):
    t, store = sealed(redis_server, mode=mode), Store(redis_server)
    try:
        assert t.put(K(10), payload(10, N_FLIP))
        body = bytearray(store.sealed(K(10)))
        for bit in (0, 7):
            b = bytearray(body)
            b[off] ^= 1 << bit
            store.plant(K(10), bytes(b))
            before = t.counters["auth_failures"]
            assert t.get_into(K(10), bytearray(N_FLIP)) is None, (what, bit)
            assert t.counters["auth_failures"] == before + 1 and not store.exists(K(10))
    finally:
        t.close()


@pytest.mark.parametrize("cut", [1, 16, OVERHEAD_BYTES, N_FLIP + OVERHEAD_BYTES - 3])
def test_truncated_or_extended_is_a_miss(redis_server, cut):
    t, store = sealed(redis_server, mode=SealMode.ENCRYPT), Store(redis_server)
    try:
        assert t.put(K(11), payload(11, N_FLIP))
        body = store.sealed(K(11))
        store.plant(K(11), body[:-cut])
        assert_rejected(t, store, K(11), "malformed" if cut < N_FLIP else "unsealed", n=N_FLIP)
        store.plant(K(11), body + bytes(cut))
        assert_rejected(t, store, K(11), "malformed", n=N_FLIP + cut)
    finally:
        t.close()


def test_encrypted_body_with_gmac_alg_is_rejected():
    """Relabelling an encrypted record as authenticated-only (or back) breaks the tag."""
    s = Sealer(ring("new"), namespace=NS, mode=SealMode.ENCRYPT)
    data = payload(12, 500)
    buf = bytearray(s.sealed_bytes(500))
    s.seal_into(memoryview(buf), memoryview(data), K(12))
    buf[5] = SealMode.AUTHENTICATE
    with pytest.raises(SealError, match="bad_tag"):
        s.open_into(memoryview(buf), memoryview(bytearray(500)), K(12))


def test_header_layout():
    s = Sealer(ring("new"), namespace=NS, mode=SealMode.AUTHENTICATE)
    buf = bytearray(s.sealed_bytes(3))
    assert s.seal_into(memoryview(buf), memoryview(b"abc"), K(13), nonce=bytes(12)) == 3 + OVERHEAD_BYTES
    magic, version, alg, kid, nonce, n, ckey, ns = struct.unpack_from("<4sBB2x8s12s4xQ32s16s", buf)
    assert (magic, version, alg, kid, nonce, n, ckey, ns) == (
        b"LMSL",
        1,
        1,
        RING_KEYS["new"].key_id,
        bytes(12),
        3,
        K(13),
        NS,
    )
    assert buf[HEADER_BYTES : HEADER_BYTES + 3] == b"abc"


# ------------------------------------------------------------------------------ codec and manager
NAMESPACE = Namespace(model="m", num_layers=2, num_kv_heads=2, head_size=64, kv_dtype="bfloat16", chunk_size=16)


def _config(url, tmp_path, **extra) -> LMTierConfig:
    return LMTierConfig.from_dict(
        {
            "chunk_size": 16,
            "max_local_cpu_size": 4 * NAMESPACE.chunk_bytes / 2**30,
            "remote_url": url,
            "remote_auth_key": write_key(tmp_path / "seal.key", MASTER["new"]),
            **extra,
        }
    )


def _chunk(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    x = (torch.randn(2, 2, 16, 2, 64, generator=torch.Generator().manual_seed(seed)) * 3).to(torch.bfloat16)
    return x, x.view(-1).view(torch.uint8)


@pytest.mark.parametrize("encrypt", [False, True])
def test_manager_codec_over_seal_round_trip(redis_server, tmp_path, encrypt):
    """``remote_serde: cachegen`` + ``remote_auth_key``: CodecTier -> SealedTier -> RedisTier; the
    lossless codec round trip is exact; engine B with another key loads nothing and the bad records
    are deleted."""
    from lmtier.tiers.codec import CodecTier

    cfg = _config(redis_server.url, tmp_path, remote_serde="cachegen", codec_level="lossless", remote_encrypt=encrypt)
    n = NAMESPACE.chunk_bytes
    a = TierManager.from_config(cfg, NAMESPACE, arena=torch.empty(4 * n, dtype=torch.uint8))
    assert isinstance(a.remote, CodecTier) and isinstance(a.remote.inner, SealedTier)
    assert isinstance(a.remote.inner.inner, RedisTier)
    assert a.remote.inner.sealer.mode == (SealMode.ENCRYPT if encrypt else SealMode.AUTHENTICATE)
    _, raw = _chunk(1)
    assert a.store(K(20), raw).result(30) and a.flush(30)
    a.close()
    b = TierManager.from_config(cfg, NAMESPACE, arena=torch.empty(4 * n, dtype=torch.uint8))
    try:
        out = torch.empty(n, dtype=torch.uint8)
        assert b.lookup([K(20)]) == ["remote"] and b.retrieve(K(20), out) and torch.equal(out, raw)
        assert b.remote.inner.counters["hits"] == 1
    finally:
        b.close()
    wrong = tmp_path / "wrong"
    wrong.mkdir()
    cfg_wrong = _config(redis_server.url, wrong, remote_serde="cachegen", codec_level="lossless")
    (wrong / "seal.key").write_text(MASTER["wrong"].hex())
    cfg_wrong = LMTierConfig.from_dict({**cfg_wrong.to_dict(), "remote_url": redis_server.url})
    c = TierManager.from_config(cfg_wrong, NAMESPACE, arena=torch.empty(4 * n, dtype=torch.uint8))
    try:
        assert c.lookup([K(20)]) == ["remote"], "present (contains does not verify) ..."
        assert not c.retrieve(K(20), torch.empty(n, dtype=torch.uint8)), "... but it does not load"
        assert c.remote.inner.counters["auth_unknown_key"] == 1 and c.lookup([K(20)]) == []
    finally:
        c.close()


def test_manager_without_key_warns_once(redis_server, caplog):
    from lmtier.tiers.seal import _WARNED_UNSEALED

    _WARNED_UNSEALED.clear()
    cfg = LMTierConfig.from_dict({"chunk_size": 16, "max_local_cpu_size": 0.01, "remote_url": redis_server.url})
    with caplog.at_level(logging.WARNING, logger="lmtier.tiers.seal"):
        for _ in range(2):
            m = TierManager.from_config(cfg, NAMESPACE)
            assert isinstance(m.remote, RedisTier)
            m.close()
    lines = [r for r in caplog.records if "NOT authenticated" in r.getMessage()]
    assert len(lines) == 1 and "plant KV" in lines[0].getMessage()


def test_manager_with_key_does_not_warn(redis_server, tmp_path, caplog):
    from lmtier.tiers.seal import _WARNED_UNSEALED

    _WARNED_UNSEALED.clear()
    with caplog.at_level(logging.INFO, logger="lmtier"):
        m = TierManager.from_config(_config(redis_server.url, tmp_path), NAMESPACE)
        m.close()
    assert "NOT authenticated" not in caplog.text and RING_KEYS["new"].key_id.hex() in caplog.text
    assert MASTER["new"].hex() not in caplog.text


# ------------------------------------------------------------------------------------- Mooncake
def test_mooncake_sealed(mooncake_store, tmp_path):
    """The same seal over a real Mooncake Store: encrypted round trip exact; a record planted by a
    writer without the key is a miss and removed."""
    from lmtier.tiers.mooncake import MooncakeSettings, MooncakeTier

    def inner():
        return MooncakeTier(
            mooncake_store.url,
            MooncakeSettings(mooncake_store.master.address, global_segment_size=0),
            timeout_s=2.0,
            bounce_bytes=16 << 20,
        )

    t = SealedTier(inner(), ring("new"), namespace=NS, mode=SealMode.ENCRYPT)
    plain = inner()
    try:
        data = payload(30, 1 << 20)
        assert t.put(K(30), data)
        out = bytearray(1 << 20)
        assert t.get_into(K(30), out) == 1 << 20 and bytes(out) == data
        assert plain.put(K(31), payload(31, 5000))
        assert t.get_into(K(31), bytearray(5000)) is None and t.counters["auth_unsealed"] == 1
        assert not plain.contains(K(31)), "removed"
    finally:
        t.close()
        plain.close()


def test_sealed_tier_forwards_the_protocol(redis_server):
    t = sealed(redis_server)
    try:
        assert t.name == "remote" and t.batches_contains()
        assert t.put(K(40), b"x" * 100) and t.contains_many([K(40), K(41)]) == [True, False]
        assert t.forget(K(40)) is False and t.delete(K(40)) and not t.contains(K(40))
        assert t.usage().num_chunks == 0
    finally:
        t.close()


def test_bench_quick(tmp_path, redis_server):
    """`lmtier bench seal --quick` (tiny chunks) runs the product's SealedTier in all three settings."""
    import json

    from lmtier.bench import seal as bseal

    out = tmp_path / "seal.json"
    argv = ["--quick", "--chunk-tokens", "4", "--redis-url", redis_server.url, "--json", str(out)]
    assert bseal.main(argv) == 0
    res = json.loads(out.read_text())
    assert {p["primitive"] for p in res["primitives"]} >= {"GMAC (AES-GCM, data as AAD)", "Sealer.open_into mac"}
    (row,) = res["rows"]
    assert all(row[f"{s}_{op}_GBps"] > 0 for s in bseal.SETTINGS for op in ("put", "get"))
