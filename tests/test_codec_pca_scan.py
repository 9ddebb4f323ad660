"""The native scan of a PCA record's host checks (`lmtier.codec.pca.scan`, `csrc/pca_scan.cpp`): it
gives the fields the Python checks give, accepts nothing they refuse (every byte of the header, index,
metadata, exact bitmap and stream headers changed, the checksum made to match again), refuses by name a
checksum that does not match, and refuses the records the decode must name to the Python checks.
Synthetic KV and models of ``test_codec_pca_product``."""

from __future__ import annotations

import numpy as np
import pytest
import xxhash

from lmtier.codec import format as fmt
from lmtier.codec import pca
from lmtier.codec.pca import codec, scan, streams
from tests.test_codec_pca_product import _kv, _parts, _repack, fitted

pytestmark = pytest.mark.skipif(not scan.available(), reason="an extension built without the scan")


@pytest.fixture(scope="module")
def model() -> pca.PCAModel:
    return fitted("plain")


def _python(record, m: pca.PCAModel) -> scan.Scanned:
    """What the Python checks give (``codec._parse`` and ``streams.check_spans``), as a Scanned."""
    p = codec._parse(record, m)
    r2, t = 2 * m.rows, p.tokens
    spans = p.rec.index[: r2 + 3]
    offs, lens = spans["offset"].astype(np.int64), spans["length"].astype(np.int64)
    payload = np.frombuffer(p.rec.payload, np.uint8)
    streams.check_spans(payload, offs[:r2], lens[:r2], m.vector_size * streams.run_length(t), m.vector_size)
    return scan.Scanned(p.level, p.start, p.n_esc, p.dtype, t, payload, offs, lens, p.exact)


def _same(a: scan.Scanned, b: scan.Scanned) -> None:
    assert (a.level, a.start, a.n_esc, a.dtype, a.tokens) == (b.level, b.start, b.n_esc, b.dtype, b.tokens)
    for x, y in ((a.payload, b.payload), (a.offs, b.offs), (a.lens, b.lens), (a.exact, b.exact)):
        assert x.dtype == y.dtype and np.array_equal(x, y)


def _records(m: pca.PCAModel) -> list[bytes]:
    """Records of both levels, several token counts (one not a multiple of 8 or 32), starts (exact
    first positions included) and planted loud tokens (escapes, exact tokens)."""
    out = []
    for i, (t, start, loud) in enumerate([(8, 0, ()), (17, 4, ((1, 0, 3),)), (33, 100, ()), (64, 2, ((0, 1, 9),))]):
        for level in ("pca_high", "pca_default"):
            out.append(pca.encode(_kv(t, start, 40 + i, loud=loud), start=start, model=m, level=level))
    return out


def test_the_scan_gives_what_the_python_checks_give(model):
    recs = _records(model)
    assert any(codec.record_meta(r).escapes for r in recs) and any(codec.record_meta(r).exact_tokens for r in recs)
    for r in recs:
        got = scan.scan(r, model)
        assert got is not None
        _same(got, _python(r, model))
        assert np.shares_memory(got.payload, np.frombuffer(r, np.uint8))  # a view, no copy
        assert got.offs.dtype == np.int64 and got.exact.dtype == bool and got.exact.size == got.tokens
    arr = np.frombuffer(_records(model)[0], np.uint8)  # a NumPy record is taken as bytes are
    _same(scan.scan(arr, model), _python(arr, model))


def _resealed(b: bytearray) -> bytes:
    """``b`` with its checksum recomputed when its header still parses (else as it is)."""
    try:
        _, _, _, end, mv, _ = fmt._parse(bytes(b))
    except ValueError:
        return bytes(b)
    h = xxhash.xxh3_64()
    h.update(mv[:56])
    h.update(mv[fmt.HEADER_BYTES : end])
    b[56:64] = h.intdigest().to_bytes(8, "little")
    return bytes(b)


def _positions(record: bytes, m: pca.PCAModel) -> list[int]:
    """Every byte of the header (but the checksum), index and metadata, the exact bitmap, and the first
    and last stream's header."""
    rec = fmt.unpack(record)
    r2 = 2 * m.rows
    index_end = fmt.HEADER_BYTES + 16 * rec.info.num_sections
    at = [i for i in range(index_end + codec._META.size) if not 56 <= i < 64]
    offs = rec.index["offset"].astype(int) + rec.payload_offset
    lens = rec.index["length"].astype(int)
    at += list(range(offs[r2 + 1], offs[r2 + 1] + lens[r2 + 1]))  # the exact bitmap
    for s in (0, r2 - 1):
        at += list(range(offs[s], offs[s] + 16))
    return at


def test_the_scan_accepts_nothing_the_python_checks_refuse(model):
    """Each byte changed (to 0, 0xFF, and itself ± 1), the checksum made to match: where the scan
    accepts, the Python checks accept and give the same fields; most changes are refused."""
    record = _records(model)[3]  # escapes and exact tokens
    c, spec = scan._native(), scan._spec(model)
    accepted = refused = 0
    for i in _positions(record, model):
        for v in {0, 0xFF, (record[i] + 1) % 256, (record[i] - 1) % 256} - {record[i]}:
            b = bytearray(record)
            b[i] = v
            bad = _resealed(b)
            if c.scan(spec, bad) is None:
                refused += 1
                continue
            accepted += 1
            _same(scan.scan(bad, model), _python(bad, model))
    assert refused > 10 * accepted > 0  # reserved header bytes, padding, the bits past T: accepted


@pytest.mark.parametrize(
    "change",
    [
        "level",
        "model_id",
        "digest",
        "start",
        "escapes",
        "exact",
        "tokens",
        "tokens 0xFFFFFFF9",
        "tokens 0xFFFFFFFF",
        "stream table",
        "dtype",
    ],  # fmt: skip
)
def test_records_the_decode_must_name_are_left_to_the_python_checks(model, change):
    """Hostile, well-formed records (checksum right): the scan refuses each, so the decode's Python
    checks name it."""
    import dataclasses

    from lmtier.geometry import DTypeCode

    record = _records(model)[3]
    info, secs, (start, n_exact, n_esc) = _parts(record)
    kw = {}
    if change == "level":
        kw["info"] = dataclasses.replace(info, level_id=info.level_id ^ 3)
    elif change == "model_id":
        kw["info"] = dataclasses.replace(info, table_id=info.table_id ^ 1)
    elif change == "digest":
        kw["digest"] = bytes(16)
    elif change == "start":
        kw["meta"] = (codec.MAX_POSITION, n_exact, n_esc)
    elif change == "escapes":
        kw["meta"] = (start, n_exact, n_esc + 1)
    elif change == "exact":
        kw["meta"] = (start, n_exact + 1, n_esc)
    elif change == "tokens":
        kw["info"] = dataclasses.replace(info, num_tokens=info.num_tokens + 32)
    elif change.startswith("tokens "):  # near 2**32: the bitmap's size computed without wrapping
        kw["info"] = dataclasses.replace(info, num_tokens=int(change.split()[1], 16))
        kw["secs"] = [*secs[: 2 * model.rows], b"", b"", b"", *secs[2 * model.rows + 3 :]]
        kw["meta"] = (0, 0, 0)
    elif change == "stream table":
        s = bytearray(secs[1])
        s[8] ^= 1  # its header's table id
        kw["secs"] = [secs[0], bytes(s), *secs[2:]]
    else:
        kw["info"] = dataclasses.replace(info, dtype=DTypeCode.FLOAT32)
    bad = _repack(record, **kw)
    fmt.unpack(bad)  # well formed: only the PCA checks can refuse it
    assert scan._native().scan(scan._spec(model), bad) is None
    with pytest.raises(ValueError):
        _python(bad, model)


def test_a_checksum_that_does_not_match_is_refused_by_name(model):
    b = bytearray(_records(model)[0])
    b[-1] ^= 1
    with pytest.raises(ValueError, match="checksum mismatch"):
        scan.scan(bytes(b), model)


def test_a_truncated_record_is_refused(model):
    record = _records(model)[0]
    c, spec = scan._native(), scan._spec(model)
    for n in (0, 10, 63, 64, 200, len(record) - 1):
        assert c.scan(spec, record[:n]) is None
    with pytest.raises(ValueError, match="1-D contiguous byte buffer"):
        c.scan(spec, np.zeros((2, 64), np.uint8))
