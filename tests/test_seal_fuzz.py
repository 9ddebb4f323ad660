"""Hypothesis fuzzing of sealed records (lmtier.tiers.seal), in the harness of test_fuzz_records.py.

Properties: opening a mutated sealed record raises only :class:`SealError` (or returns None for a
too-small destination), never hangs, and never returns a payload other than the original — a hit
happens only for the unmodified record. Header fields chosen freely (magic, version, algorithm,
reserved bits, key id — accepted or not —, lengths, chunk key, namespace) with any tag never open.
Through a real redis-server, mutated sealed values planted as well-formed tier records are misses
and deleted.
"""

from __future__ import annotations

import struct
import time

import pytest
from hypothesis import given
from hypothesis import strategies as st

from lmtier import record as rec
from lmtier.tiers.seal.keys import KeyRing, SealKey
from lmtier.tiers.seal.tier import HEADER_BYTES, OVERHEAD_BYTES, SealedTier, Sealer, SealError, SealMode
from tests.test_fuzz_records import SLOW_CALL_S, fuzz_settings, mutations

KEY = bytes(range(32))
NS = bytes(range(100, 116))
PAYLOAD = bytes((i * 131 + 7) % 251 for i in range(3000))
RING = KeyRing.of(SealKey.from_bytes(b"\x11" * 32, source="a"), SealKey.from_bytes(b"\x22" * 32, source="b"))
SEALERS = {m: Sealer(RING, namespace=NS, mode=m) for m in SealMode}


def sealed(mode: SealMode) -> bytes:
    buf = bytearray(Sealer.sealed_bytes(len(PAYLOAD)))
    SEALERS[mode].seal_into(memoryview(buf), memoryview(PAYLOAD), KEY)
    return bytes(buf)


ORIGINAL = {m: sealed(m) for m in SealMode}


def mutate(value: bytes, m) -> bytes:
    edits, cut, extra = m
    b = bytearray(value)
    for pos, byte in edits:
        b[pos % len(b)] = byte
    if cut:
        del b[len(b) - (cut % (len(b) + 1)) :]
    return bytes(b) + extra


def open_checked(mode: SealMode, value: bytes, out_bytes: int = len(PAYLOAD)):
    out = bytearray(out_bytes)
    t0 = time.monotonic()
    try:
        n = SEALERS[mode].open_into(memoryview(value), memoryview(out), KEY)
    except SealError:
        n = "rejected"
    assert time.monotonic() - t0 < SLOW_CALL_S
    if isinstance(n, int):
        assert value == ORIGINAL_ANY.get(value) and bytes(out[:n]) == PAYLOAD, "a modified record opened"
    return n


ORIGINAL_ANY = {v: v for v in ORIGINAL.values()}


@pytest.mark.parametrize("mode", list(SealMode))
@fuzz_settings(300)
@given(m=mutations)
def test_mutated_sealed_records_never_open(mode, m):
    value = mutate(ORIGINAL[mode], m)
    n = open_checked(mode, value)
    assert (n == len(PAYLOAD)) == (value == ORIGINAL[mode]) or n is None


@fuzz_settings(300)
@given(
    magic=st.sampled_from([b"LMSL", b"LMSM", b"\x00\x00\x00\x00"]),
    version=st.integers(0, 255),
    alg=st.integers(0, 255),
    r0=st.integers(0, 0xFFFF),
    kid=st.sampled_from([k.key_id for k in RING.accepted.values()] + [bytes(8), b"\xff" * 8]),
    nonce=st.binary(min_size=12, max_size=12),
    r1=st.integers(0, 0xFFFFFFFF),
    n=st.integers(0, (1 << 64) - 1),
    ckey=st.sampled_from([KEY, bytes(32)]),
    ns=st.sampled_from([NS, bytes(16)]),
    r2=st.binary(min_size=8, max_size=8),
    body=st.binary(max_size=200),
    tag=st.binary(min_size=16, max_size=16),
)
def test_free_header_fields_never_open(magic, version, alg, r0, kid, nonce, r1, n, ckey, ns, r2, body, tag):
    head = struct.pack("<4sBBH8s12sIQ32s16s8s", magic, version, alg, r0, kid, nonce, r1, n, ckey, ns, r2)
    assert len(head) == HEADER_BYTES
    value = head + body + tag
    for mode in SealMode:  # the reader's mode does not matter: it accepts both algorithms
        out = bytearray(len(body))
        with pytest.raises(SealError):
            SEALERS[mode].open_into(memoryview(value), memoryview(out), KEY)


@pytest.mark.parametrize("mode", list(SealMode))
@fuzz_settings(40)
@given(m=mutations)
def test_mutated_values_in_redis_are_misses_and_deleted(redis_server, mode, m):
    redis = pytest.importorskip("redis")
    from lmtier.tiers.redis import RedisTier

    t = SealedTier(RedisTier(redis_server.url, timeout_s=2.0), RING, namespace=NS, mode=mode)
    r = redis.Redis.from_url(redis_server.url)
    name = b"lmtier:" + KEY.hex().encode()
    try:
        value = mutate(ORIGINAL[mode], m)
        header = rec.encode_header(
            KEY, len(value), rec.payload_checksum(value), payload_offset=rec.COMPACT_PAYLOAD_OFFSET
        )
        r.set(name, header + value)
        out = bytearray(len(PAYLOAD) + OVERHEAD_BYTES)
        got = t.get_into(KEY, out)
        if value == ORIGINAL[mode]:
            assert got == len(PAYLOAD) and bytes(out[:got]) == PAYLOAD
        else:
            assert got is None and t.counters["auth_failures"] == 1 and not r.exists(name)
    finally:
        r.delete(name)
        r.close()
        t.close()
