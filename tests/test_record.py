"""Record format: round trip and every corruption class."""

import os
import struct

import pytest
import xxhash

from lmtier import record as rec

KEY = bytes(range(32))


def make(payload: bytes, *, offset=rec.DISK_PAYLOAD_OFFSET, key=KEY, meta=rec.DEFAULT_META):
    return rec.encode_header(key, len(payload), rec.payload_checksum(payload), payload_offset=offset, meta=meta)


@pytest.mark.parametrize("n", [0, 1, 4095, 4096, 123457])
@pytest.mark.parametrize("offset", [rec.COMPACT_PAYLOAD_OFFSET, rec.DISK_PAYLOAD_OFFSET])
def test_round_trip(n, offset):
    payload = os.urandom(n)
    meta = rec.RecordMeta(
        namespace=b"n" * 16,
        codec=0,
        dtype_code=3,
        num_layers=30,
        num_planes=2,
        num_tokens=256,
        num_kv_heads=3,
        head_size=64,
    )
    h = make(payload, offset=offset, meta=meta)
    assert len(h) == rec.HEADER_BYTES
    d = rec.decode_header(h, expected_key=KEY)
    assert (d.payload_bytes, d.payload_offset, d.key, d.meta, d.version) == (n, offset, KEY, meta, 1)
    assert d.record_bytes == offset + n
    rec.verify_payload(d, payload)
    rec.verify_payload(d, memoryview(bytearray(payload)))


def test_layout_is_little_endian_and_fixed():
    h = make(b"abc")
    assert h[:4] == b"LMTR"
    assert struct.unpack_from("<H", h, 4)[0] == 1
    assert struct.unpack_from("<Q", h, 24)[0] == 3
    assert h[40:72] == KEY
    assert struct.unpack_from("<Q", h, 120)[0] == xxhash.xxh3_64_intdigest(h[:120])


def _rehash(h: bytearray) -> bytes:
    struct.pack_into("<Q", h, 120, xxhash.xxh3_64_intdigest(bytes(h[:120])))
    return bytes(h)


@pytest.mark.parametrize(
    "mutate, msg",
    [
        (lambda h: h.__setitem__(slice(0, 4), b"XXXX"), "bad magic"),
        (lambda h: struct.pack_into("<H", h, 4, 2), "version"),
        (lambda h: struct.pack_into("<H", h, 6, 64), "header size"),
        (lambda h: struct.pack_into("<I", h, 8, 1), "flags"),
        (lambda h: struct.pack_into("<I", h, 16, 100), "payload offset"),
        (lambda h: struct.pack_into("<Q", h, 24, 1 << 50), "exceeds the limit"),
    ],
)
def test_header_corruption_with_valid_header_checksum(mutate, msg):
    h = bytearray(make(b"x" * 10))
    mutate(h)
    with pytest.raises(rec.RecordError, match=msg):
        rec.decode_header(_rehash(h))


@pytest.mark.parametrize("bit", [0, 7, 8 * 30, 8 * 50, 8 * 100, 8 * 127])
def test_any_flipped_header_bit_is_rejected(bit):
    h = bytearray(make(b"payload"))
    h[bit // 8] ^= 1 << (bit % 8)
    with pytest.raises(rec.RecordError):
        rec.decode_header(bytes(h), expected_key=KEY)


def test_truncated_header():
    with pytest.raises(rec.RecordError, match="truncated header"):
        rec.decode_header(make(b"abc")[:100])
    with pytest.raises(rec.RecordError, match="truncated header"):
        rec.decode_header(b"")


def test_wrong_key():
    with pytest.raises(rec.RecordError, match="key mismatch"):
        rec.decode_header(make(b"abc"), expected_key=bytes(32))


def test_absurd_length_rejected_before_allocation():
    h = rec.encode_header(KEY, 1 << 40, 0)
    with pytest.raises(rec.RecordError, match="exceeds"):
        rec.decode_header(h)
    assert rec.decode_header(h, max_payload_bytes=1 << 41).payload_bytes == 1 << 40


def test_payload_corruption():
    payload = bytearray(os.urandom(5000))
    d = rec.decode_header(make(bytes(payload)))
    payload[1234] ^= 0x10
    with pytest.raises(rec.RecordError, match="checksum"):
        rec.verify_payload(d, payload)
    with pytest.raises(rec.RecordError, match="truncated"):
        rec.verify_payload(d, payload[:-1])


def test_encode_rejects_bad_arguments():
    with pytest.raises(ValueError):
        rec.encode_header(b"short", 1, 0)
    with pytest.raises(ValueError):
        rec.encode_header(KEY, 1, 0, payload_offset=100)
    with pytest.raises(ValueError):
        rec.encode_header(KEY, -1, 0)
    with pytest.raises(ValueError):
        rec.encode_header(KEY, 1, 0, meta=rec.RecordMeta(namespace=b"x"))


def test_random_garbage_never_decodes():
    for _ in range(200):
        with pytest.raises(rec.RecordError):
            rec.decode_header(b"LMTR" + os.urandom(124))
