"""Hypothesis fuzzing of every record parser (bounded time: ``max_examples`` per test, no deadline).

Parsers: the tier record header (:func:`lmtier.record.decode_header`), disk records read back by
:meth:`lmtier.tiers.disk.DiskTier.get_into` from mutated files, Redis values read by
:meth:`lmtier.tiers.redis.RedisTier.get_into` from mutated stored values (a real redis-server),
codec records (:func:`lmtier.codec.format.unpack`) and rANS streams (:func:`lmtier.codec.rans.decode`).

Properties: no crash (only the documented error type), no hang (each call is timed), no allocation
sized by an untrusted length field (bounce-buffer requests are recorded and bounded by the caller's
buffer; a 4 GiB claim under a small ``RLIMIT_AS`` fails cleanly), and a mutated record is never
returned as a hit: a hit always returns exactly the original payload.

``LMTIER_FUZZ_EXAMPLES`` scales the example counts (default 1: ~40 s on 2 busy cores).
"""

from __future__ import annotations

import os
import struct
import subprocess
import sys
import time

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lmtier import envs
from lmtier import record as rec
from lmtier.codec import format as fmt
from lmtier.codec import rans
from lmtier.tiers.buffers import BouncePool, round_up
from lmtier.tiers.disk import DiskTier
from lmtier.tiers.disk import tier as disk_tier

SCALE = envs.LMTIER_FUZZ_EXAMPLES
SLOW_CALL_S = 5.0  # any single parse slower than this is a hang


def n_ex(n: int) -> int:
    return max(5, int(n * SCALE))


def fuzz_settings(n: int):
    return settings(
        max_examples=n_ex(n),
        deadline=None,
        derandomize=True,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture, HealthCheck.data_too_large],
    )


KEY = bytes(range(32))
PAYLOAD = bytes((i * 131 + 7) % 251 for i in range(10_000))
PAYLOAD_BYTES = len(PAYLOAD)

# A mutation: a list of (position, new byte) edits, optional truncation, optional appended bytes.
mutations = st.tuples(
    st.lists(st.tuples(st.integers(0, 1 << 30), st.integers(0, 255)), min_size=0, max_size=6),
    st.one_of(st.none(), st.integers(0, 1 << 30)),
    st.binary(max_size=64),
)


def mutate(buf: bytes, m, *, lo: int = 0) -> bytes:
    edits, cut, tail = m
    b = bytearray(buf)
    span = len(b) - lo
    for pos, val in edits:
        if span > 0:
            b[lo + pos % span] = val
    if cut is not None and len(b):
        b = b[: cut % (len(b) + 1)]
    return bytes(b) + tail


def timed(fn, *args, **kw):
    t0 = time.monotonic()
    try:
        return fn(*args, **kw)
    finally:
        assert time.monotonic() - t0 < SLOW_CALL_S, f"{fn.__name__} took {time.monotonic() - t0:.1f}s"


# ------------------------------------------------------------------------------------ headers
def _header(payload_bytes=PAYLOAD_BYTES, offset=rec.COMPACT_PAYLOAD_OFFSET, checksum=None):
    return rec.encode_header(
        KEY, payload_bytes, rec.payload_checksum(PAYLOAD) if checksum is None else checksum, payload_offset=offset
    )


@fuzz_settings(600)
@given(mutations)
def test_decode_header_mutations_rejected(m):
    good = _header()
    bad = mutate(good, m)
    try:
        h = timed(rec.decode_header, bad, expected_key=KEY)
    except rec.RecordError:
        return
    # accepted only if the 128 header bytes are unchanged (trailing bytes are not part of the header)
    assert bad[: rec.HEADER_BYTES] == good, "a mutated header was accepted"
    assert h.payload_bytes == len(PAYLOAD)


@fuzz_settings(400)
@given(st.binary(min_size=0, max_size=300))
def test_decode_header_random_bytes(data):
    with pytest.raises(rec.RecordError):
        timed(rec.decode_header, data)


@pytest.mark.parametrize("claimed", [rec.DEFAULT_MAX_PAYLOAD_BYTES + 1, 1 << 40, (1 << 64) - 1])
def test_huge_length_rejected_before_allocation(claimed):
    """A header with a *valid* checksum that claims a huge payload is refused by the parser."""
    body = bytearray(_header())
    struct.pack_into("<Q", body, 24, claimed)
    import xxhash

    struct.pack_into("<Q", body, 120, xxhash.xxh3_64_intdigest(bytes(body[:120])))
    with pytest.raises(rec.RecordError, match="exceeds the limit"):
        rec.decode_header(bytes(body))


# ------------------------------------------------------------------------------------ disk tier
@pytest.fixture(scope="module")
def disk_env(tmp_path_factory):
    root = tmp_path_factory.mktemp("fuzzdisk")
    tier = DiskTier([str(root)], 64 << 20, sync="none")
    assert tier.put(KEY, PAYLOAD)
    path = tier._path(KEY)
    with open(path, "rb") as f:
        original = f.read()
    requested: list[int] = []
    orig_acquire = BouncePool.acquire

    def spy(self, nbytes):
        requested.append(nbytes)
        return orig_acquire(self, nbytes)

    BouncePool.acquire = spy
    yield tier, path, original, requested
    BouncePool.acquire = orig_acquire
    tier.close()


def _restore_disk(tier, path, data):
    """Write ``data`` as the record file and (re)index it, as a restart would find it."""
    with open(path, "wb") as f:
        f.write(data)
    with tier._lock:
        old = tier._index.pop(KEY, None)
        if old is not None:
            tier._used -= old.nbytes
        tier._index[KEY] = disk_tier._Entry(path, round_up(max(len(data), 1)))
        tier._used += tier._index[KEY].nbytes


@fuzz_settings(300)
@given(mutations, st.booleans())
def test_disk_get_into_mutated_file(disk_env, m, aligned):
    tier, path, original, requested = disk_env
    bad = mutate(original, m)
    _restore_disk(tier, path, bad)
    requested.clear()
    raw = np.zeros(len(PAYLOAD) + 2 * 4096, np.uint8)
    off = (-raw.ctypes.data) % 4096 + (0 if aligned else 1)
    out = raw[off : off + len(PAYLOAD)]
    n = timed(tier.get_into, KEY, out)
    assert all(r <= round_up(len(PAYLOAD)) + 2 * 4096 for r in requested), requested
    if n is not None:  # a hit is always the original payload (checksummed); padding edits are harmless
        assert n == len(PAYLOAD) and out.tobytes() == PAYLOAD
    else:
        # a miss needs a reason: changed header/payload bytes, or a file shorter than its padded size
        # (the tier treats a cut in the padding as truncation: conservative, allowed)
        assert bad[: 4096 + len(PAYLOAD)] != original[: 4096 + len(PAYLOAD)] or len(bad) < 4096 + round_up(len(PAYLOAD))
        assert not tier.contains(KEY) or os.path.exists(path)


def test_disk_valid_header_claiming_huge_payload(disk_env, tmp_path):
    """Valid header checksum, payload length just under the 1 GiB limit, tiny file: a miss, no big buffer."""
    tier, path, original, requested = disk_env
    hdr = rec.encode_header(
        KEY, rec.DEFAULT_MAX_PAYLOAD_BYTES - 4096, 0, payload_offset=rec.DISK_PAYLOAD_OFFSET, meta=tier._meta
    )
    _restore_disk(tier, path, hdr + bytes(4096 - len(hdr)) + b"x" * 4096)
    requested.clear()
    out = bytearray(len(PAYLOAD))
    assert tier.get_into(KEY, out) is None
    assert not requested or max(requested) <= 2 * 4096
    # and at startup the index rebuild drops it without reading the claimed length
    _restore_disk(tier, path, hdr + bytes(4096 - len(hdr)) + b"x" * 4096)
    t2 = DiskTier([os.path.dirname(os.path.dirname(path))], 64 << 20, sync="none")
    try:
        assert not t2.contains(KEY) and not os.path.exists(path)
    finally:
        t2.close()
    _restore_disk(tier, path, original)


# ------------------------------------------------------------------------------------ Redis tier
@pytest.fixture(scope="module")
def redis_env():
    from lmtier.testing.redis import start_or_skip

    srv = start_or_skip()
    import redis

    from lmtier.tiers.redis import RedisTier

    tiers = {p: RedisTier(srv.url, timeout_s=2.0, piece_bytes=p) for p in (4096, 1 << 20)}
    raw = redis.Redis(host="127.0.0.1", port=srv.port)
    assert tiers[4096].put(KEY, PAYLOAD)
    name = tiers[4096]._name(KEY)
    original = raw.get(name)
    yield tiers, raw, name, original
    for t in tiers.values():
        t.close()
    raw.close()
    srv.close()


@fuzz_settings(300)
@given(mutations, st.sampled_from([4096, 1 << 20]), st.integers(0, 3))
def test_redis_get_into_mutated_value(redis_env, m, piece, extra_out):
    tiers, raw, name, original = redis_env
    bad = mutate(original, m)
    raw.set(name, bad)
    out = bytearray(len(PAYLOAD) + extra_out * 1000)
    t = tiers[piece]
    n = timed(t.get_into, KEY, out)
    if n is not None:
        assert n == len(PAYLOAD) and bytes(out[:n]) == PAYLOAD
        assert bad == original  # a Redis value has no padding: any change must be rejected
    else:
        assert bad != original
        assert raw.exists(name) == 0  # a corrupt value is deleted


def test_redis_valid_header_huge_length(redis_env):
    tiers, raw, name, original = redis_env
    hdr = rec.encode_header(KEY, (1 << 30) - 1, 0, payload_offset=rec.COMPACT_PAYLOAD_OFFSET)
    raw.set(name, hdr + b"y" * 100)
    assert tiers[4096].get_into(KEY, bytearray(len(PAYLOAD))) is None
    raw.set(name, original)


# ------------------------------------------------------------------------------------ codec records
@pytest.fixture(scope="module")
def codec_record():
    rng = np.random.default_rng(1)
    info = fmt.RecordInfo(
        level_id=2,
        num_layers=3,
        num_planes=2,
        num_tokens=256,
        num_heads=4,
        head_size=64,
        dtype=fmt.DType.BFLOAT16,
        sections_per_layer=2,
        table_id=7,
    )
    streams = [np.clip(rng.laplace(128, 3, int(n)), 0, 255).astype(np.uint8) for n in rng.integers(1, 2000, 6)]
    tables = np.stack([rans.table_from_symbols(np.concatenate(streams))])
    batch = rans.encode(streams, 0, tables, seg_log2=10)
    blob = fmt.pack(info, [np.asarray(batch.stream(i)) for i in range(len(batch))], b"meta-bytes")
    return blob, streams, tables


@fuzz_settings(500)
@given(mutations)
def test_codec_unpack_mutations(codec_record, m):
    blob, _, _ = codec_record
    bad = mutate(blob, m)
    try:
        r = timed(fmt.unpack, bad)
    except ValueError:
        return
    assert bad[: r.nbytes] == blob[: r.nbytes] and r.nbytes == len(blob), "a mutated codec record verified"


@fuzz_settings(300)
@given(mutations)
def test_codec_unpack_structure_only(codec_record, m):
    """Without the checksum (layer-by-layer decoding) the structure checks alone must keep every
    section inside the buffer."""
    blob, _, _ = codec_record
    bad = mutate(blob, m)
    try:
        r = timed(fmt.unpack, bad, verify_checksum=False)
    except ValueError:
        return
    for layer in range(r.info.num_layers):
        for s in range(r.info.sections_per_layer):
            sec = r.section(layer, s)
            assert sec.nbytes <= len(bad)
        off, n = r.layer_span(layer)
        assert 0 <= off and off + n <= len(bad)


@fuzz_settings(300)
@given(st.binary(max_size=400))
def test_codec_unpack_random(data):
    with pytest.raises(ValueError):
        timed(fmt.unpack, fmt.MAGIC + data)


def test_codec_huge_geometry_fields():
    """Header fields claiming 2**24 sections or a 2**63-byte payload: rejected, nothing allocated."""
    import xxhash

    head = fmt._HEADER.pack(
        fmt.MAGIC, fmt.FORMAT_VERSION, 64, 2, 1, 0xFFFF, 7, 256, 2, 256, 8, 128, 0xFFFFFFFF, (1 << 63), 0, 0
    )
    for blob in (head, head + bytes(4096)):
        with pytest.raises(ValueError):
            fmt.unpack(blob)
    h = xxhash.xxh3_64()
    h.update(head[:56])
    with pytest.raises(ValueError):
        fmt.unpack(head[:56] + struct.pack("<Q", h.intdigest()))


# ------------------------------------------------------------------------------------ rANS streams
@fuzz_settings(400)
@given(mutations, st.booleans())
def test_rans_decode_mutated(codec_record, m, with_lengths):
    _, streams, tables = codec_record
    x = streams[0]
    enc = bytes(np.asarray(rans.encode([x], 0, tables, seg_log2=10).stream(0)))
    bad = mutate(enc, m)
    src = np.frombuffer(bad, np.uint8).copy() if bad else np.zeros(0, np.uint8)
    try:
        out = timed(rans.decode, [src], tables, lengths=[x.size] if with_lengths else None)
    except ValueError:
        return
    assert out[0].size <= max(x.size, rans.MAX_STREAM_SYMBOLS)
    if with_lengths:
        assert out[0].size == x.size


@pytest.fixture(scope="module")
def switching_record():
    """A real codec record coded with table-switching tables (lmtier.codec.calibrate) + its chunk."""
    import torch

    from lmtier.codec import calibrate as CAL
    from lmtier.codec import chunk as CH

    g = torch.Generator().manual_seed(3)
    shape = (2, 2, 64, 2, 64)
    x = (torch.randn(shape, generator=g) * (torch.rand(2, 2, 1, 2, 64, generator=g) * 2 + 0.1)).to(torch.bfloat16)
    tab, _ = CAL.calibrate([x], "default")
    blob = CH.encode_chunk(x, shape=shape, dtype=torch.bfloat16, level="default", tables=tab)
    return blob, x, tab, shape


def _rechecksum(buf: bytes) -> bytes:
    import xxhash

    if len(buf) < fmt.HEADER_BYTES:
        return buf
    b = bytearray(buf)
    try:
        end = fmt.unpack(bytes(b), verify_checksum=False).nbytes
    except ValueError:
        return buf
    h = xxhash.xxh3_64()
    h.update(bytes(b[:56]))
    h.update(bytes(b[fmt.HEADER_BYTES : end]))
    b[56:64] = struct.pack("<Q", h.intdigest())
    return bytes(b)


@fuzz_settings(300)
@given(mutations)
def test_switching_record_mutated_with_valid_checksum(switching_record, m):
    """Mutated table-switching records whose checksum is recomputed (an adversary, not bit rot) decode or
    raise CodecRecordError — no crash, no hang, nothing written outside ``out``."""
    import torch

    from lmtier.codec import chunk as CH

    blob, x, tab, shape = switching_record
    bad = _rechecksum(mutate(blob, m, lo=fmt.HEADER_BYTES))
    out = torch.zeros(x.numel() * 2 + 64, dtype=torch.uint8)
    try:
        timed(CH.decode_chunk, bad, out, expected_shape=shape, dtype=torch.bfloat16, tables=tab)
    except CH.CodecRecordError:
        pass
    assert int(out[x.numel() * 2 :].sum()) == 0
    if bad == blob:
        CH.decode_chunk(bad, out, expected_shape=shape, dtype=torch.bfloat16, tables=tab)


@fuzz_settings(300)
@given(mutations, st.booleans())
def test_rans_switching_stream_mutated(m, with_lengths):
    rng = np.random.default_rng(5)
    tables = np.stack([rans.build_table(rng.integers(1, 50, 13), alphabet_size=13) for _ in range(40)])
    x = rng.integers(0, 13, 64 * 40, dtype=np.uint8)
    enc = bytes(np.asarray(rans.encode([x], 0, tables, seg_log2=10, run_lens=64).stream(0)))
    bad = mutate(enc, m)
    src = np.frombuffer(bad, np.uint8).copy() if bad else np.zeros(0, np.uint8)
    try:
        out = timed(rans.decode, [src], tables, lengths=[x.size] if with_lengths else None)
    except ValueError:
        return
    if with_lengths:
        assert out[0].size == x.size


def test_rans_hostile_symbol_count_does_not_allocate():
    """A 16-byte header claiming 2**32-1 symbols, decoded without ``lengths`` under an address-space limit
    of what the process uses + 1 GiB: a clean ValueError, not a 4 GiB allocation (regression: decode() sized its output
    from the untrusted header)."""
    code = (
        "import numpy as np, resource\n"
        "from lmtier.codec import rans\n"
        "t = np.stack([rans.build_table(np.ones(256))])\n"
        "import re\n"
        "vm = int(re.search(r'VmSize:\\s+(\\d+)', open('/proc/self/status').read()).group(1)) * 1024\n"
        "resource.setrlimit(resource.RLIMIT_AS, (vm + (1 << 30), vm + (1 << 30)))\n"
        "for n in (2**32 - 1, 2**31 + 1, 2**31):\n"
        "    h = np.array([(0x534E524C, 2, 0, 20, 5, 0, 0, n)], "
        "dtype=np.dtype('<u4,u1,u1,u1,u1,<u2,<u2,<u4')).tobytes()\n"
        "    try:\n"
        "        rans.decode([np.frombuffer(h + bytes(64), np.uint8)], t)\n"
        "        raise SystemExit('decoded?')\n"
        "    except ValueError as e:\n"
        "        print('ok', e)\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.count("ok") == 3, r.stdout + r.stderr
