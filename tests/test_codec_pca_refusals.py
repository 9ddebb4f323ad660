"""The PCA codec levels (`lmtier.codec.pca`) refuse, by name, every bad input: chunks (non-finite,
wrong geometry, dtype, positions), records (another model's or level's, hostile counts, other dtypes,
corruption, a colliding model id), model files (truncated, corrupted, inconsistent or malformed
headers, values the arithmetic cannot use) and fits; and code models of more tables than the rANS
coder's 16-bit ids. Synthetic KV and models of ``test_codec_pca_product``."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
import struct
import tracemalloc

import numpy as np
import pytest
import torch

from lmtier.codec import format as fmt
from lmtier.codec import pca
from lmtier.codec.chunk import CodecRecordError
from lmtier.codec.pca import model as pca_model
from lmtier.codec.quant import CodecInputError
from tests.test_codec_pca_product import (
    INV_FREQ,
    D,
    G,
    H,
    L,
    N,
    R,
    _calibration,
    _kv,
    _parts,
    _repack,
    fitted,
)


@pytest.fixture(scope="module")
def model() -> pca.PCAModel:
    return fitted("plain")


@pytest.fixture(scope="module")
def metric_model() -> pca.PCAModel:
    return fitted("metric")


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_chunk_is_refused(model, bad):
    kv = _kv(8, 0, 16)
    kv[1, 0, 3, 1, 2] = bad
    with pytest.raises(CodecInputError, match="NaN or inf"):
        pca.encode(kv, start=0, model=model, level="pca_high")


@pytest.mark.parametrize(
    "shape", [(L, 2, 8, H + 1, D), (L - 1, 2, 8, H, D), (L, 1, 8, H, D), (L, 2, 8, H, D // 2), (L, 2, H, D)]
)
def test_wrong_geometry_is_refused(model, shape):
    with pytest.raises(ValueError, match=r"does not fit the PCA model's \[L=4, 2, T, H=2, D=16\]"):
        pca.encode(torch.zeros(shape, dtype=torch.bfloat16), start=0, model=model, level="pca_high")


def test_bad_encode_arguments_are_refused(model):
    kv = _kv(8, 0, 17)
    with pytest.raises(ValueError, match=r"start must be an integer in \[0, 4503599627370496 - T\], got -1"):
        pca.encode(kv, start=-1, model=model, level="pca_high")
    with pytest.raises(ValueError, match="unknown PCA codec level 'pca_ultra'"):
        pca.encode(kv, start=0, model=model, level="pca_ultra")
    with pytest.raises(ValueError, match="unknown PCA codec level 3"):
        pca.encode(kv, start=0, model=model, level=3)
    with pytest.raises(TypeError, match="chunk dtype must be one of"):
        pca.encode(kv.float(), start=0, model=model, level="pca_high")
    kvs, starts = _calibration()
    only_default = pca.fit(kvs, starts, inv_freq=INV_FREQ, layer_group=G, levels=[pca.PCA_LEVELS["pca_default"]])
    with pytest.raises(ValueError, match="has no level 'pca_high'"):
        pca.encode(kv, start=0, model=only_default, level="pca_high")


def test_bad_decode_devices_are_refused(model):
    """``decode(device=)``: a device that is not the host or CUDA, one that does not parse, and a CUDA
    index beyond the visible devices (all of them on a machine without a GPU) are refused before
    any work; the host works."""
    record = pca.encode(_kv(8, 4, 18), start=4, model=model, level="pca_default")
    assert torch.equal(pca.decode(record, model=model, device="cpu"), pca.decode(record, model=model))
    with pytest.raises(ValueError, match="host or a CUDA device, got meta"):
        pca.decode(record, model=model, device="meta")
    with pytest.raises(ValueError, match="host or a CUDA device, got 'gpu0'"):
        pca.decode(record, model=model, device="gpu0")
    with pytest.raises(ValueError, match="no such CUDA device here"):
        pca.decode(record, model=model, device=f"cuda:{torch.cuda.device_count()}")


def test_records_of_other_models_or_levels_are_refused(model, metric_model):
    kv = _kv(20, 0, 18)
    record = pca.encode(kv, start=0, model=model, level="pca_high")
    want = f"coded with PCA model {model.model_id:#010x}, this model is {metric_model.model_id:#010x}"
    assert model.model_id != metric_model.model_id
    with pytest.raises(CodecRecordError, match=want):
        pca.decode(record, model=metric_model)
    kvs, starts = _calibration()
    only_default = pca.fit(kvs, starts, inv_freq=INV_FREQ, layer_group=G, levels=[pca.PCA_LEVELS["pca_default"]])
    with pytest.raises(CodecRecordError, match="codec record of level pca_high: PCA model '' lacks it"):
        pca.decode(record, model=only_default)


def _replace(info: fmt.RecordInfo, **kw) -> fmt.RecordInfo:
    return dataclasses.replace(info, **kw)


def test_a_hostile_token_count_allocates_nothing_it_announces(model):
    """A record announcing 2**22 tokens (a consistent 512 KiB exact bitmap) around rANS streams of a
    few symbols: CodecRecordError, and decode allocates by the streams' bytes, not by the header's
    count (which would be N * 2**22 bytes per stream, 1 GiB in all)."""
    record = pca.encode(_kv(8, 0, 22), start=0, model=model, level="pca_high")
    info, secs, (start, _, n_esc) = _parts(record)
    t = 1 << 22
    secs[2 * R + 1], secs[2 * R + 2] = bytes(t // 8), b""
    bad = _repack(record, info=_replace(info, num_tokens=t), secs=secs, meta=(start, 0, n_esc))
    tracemalloc.start()
    try:
        with pytest.raises(CodecRecordError, match=rf"rANS streams of \[{N * 32}\] symbols, {N * t} expected"):
            pca.decode(bad, model=model)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 16 << 20, f"decode allocated {peak} bytes"


@pytest.mark.parametrize("code", [c for c in fmt.DType if c not in (fmt.DType.BFLOAT16, fmt.DType.FLOAT16)])
def test_records_of_other_dtypes_are_refused(model, code):
    """A well-sealed record whose header names another element type: CodecRecordError, not a
    KeyError from the dtype table."""
    record = pca.encode(_kv(8, 0, 21), start=0, model=model, level="pca_high")
    info, _, _ = _parts(record)
    with pytest.raises(CodecRecordError, match=f"dtype {code.name}: a PCA record holds bf16 or fp16"):
        pca.decode(_repack(record, info=_replace(info, dtype=code)), model=model)


def _flip(record: bytes, at: int) -> bytes:
    b = bytearray(record)
    b[at] ^= 0x10
    return bytes(b)


def test_corrupted_records_are_refused(model):
    """Flipped bytes (header, payload, checksum), truncation and every inconsistency a re-sealed
    (hostile) record can carry: CodecRecordError naming the problem."""
    kv = _kv(50, 0, 19, loud=(5,))
    record = pca.encode(kv, start=0, model=model, level="pca_high")
    info, secs, meta = _parts(record)
    for at in (len(record) // 2, len(record) - 1, 13, 60):
        with pytest.raises(CodecRecordError, match="checksum mismatch"):
            pca.decode(_flip(record, at), model=model)
    for n in (10, 100, len(record) - 1):
        with pytest.raises(CodecRecordError, match="truncated"):
            pca.decode(record[:n], model=model)
    with pytest.raises(CodecRecordError, match="not a codec record"):
        pca.decode(b"X" + record[1:], model=model)

    def hostile(**kw) -> bytes:
        return _repack(record, **kw)

    rep = lambda i, b: [b if j == i else s for j, s in enumerate(secs)]  # noqa: E731
    cases = [
        (hostile(meta=(-1, *meta[1:])), "section sizes do not match"),
        (hostile(meta=(0, meta[1] + 1, meta[2])), "section sizes do not match"),
        (hostile(meta=(0, 2**32 - 1, meta[2])), "section sizes do not match"),
        (hostile(meta=(0, meta[1], 2**32 - 1)), "section sizes do not match"),
        (hostile(secs=rep(2 * R + 1, secs[2 * R + 1] + b"\0")), "section sizes do not match"),
        (hostile(secs=rep(2 * R + 3, b"\0\0\0\0")), "section sizes do not match"),
        (hostile(secs=rep(2 * R + 1, bytes([secs[2 * R + 1][0] ^ 2]) + secs[2 * R + 1][1:])), "2 announced"),
        (hostile(secs=rep(0, secs[0][:20])), "corrupted PCA codec record: rans decode failed .*stream 0: "),
        (hostile(secs=rep(1, b"")), "corrupted PCA codec record: stream 1: rans stream truncated"),
        (hostile(secs=rep(2, secs[2][:-4])), "corrupted PCA codec record: (stream 2: )?rans"),
        (hostile(info=_replace(info, level_id=3)), "level id 3: not a PCA level"),
        (hostile(info=_replace(info, num_heads=H + 1)), "geometry L=4 P=2 H=3 D=16"),
        (hostile(info=_replace(info, num_planes=1)), "geometry L=4 P=1"),
        (hostile(info=_replace(info, table_id=fmt.NO_TABLE)), "coded with PCA model 0xffffffff"),
        (hostile(info=_replace(info, num_tokens=57)), "section sizes do not match"),
    ]
    for bad, match in cases:
        with pytest.raises(CodecRecordError, match=match):
            pca.decode(bad, model=model)
    short_meta = fmt.pack(info, secs, struct.pack("<qI", *meta[:2]))
    with pytest.raises(CodecRecordError, match="metadata of 12 bytes, a PCA record has 32"):
        pca.decode(short_meta, model=model)


def escape_liars(model: pca.PCAModel) -> list[tuple[bytes, str]]:
    """Re-sealed records whose escaped coefficients disagree in number with their escape symbols
    (none announced, one fewer), each with the refusal's text; ``tests/test_gpu_codec_pca.py`` decodes
    them on CUDA, where the kernels count the symbols."""
    record = pca.encode(_kv(50, 0, 19), start=0, model=model, level="pca_high")
    _, secs, meta = _parts(record)
    n = meta[2]
    assert n >= 2, "the case needs escapes"
    esc = lambda b: [b if j == 2 * R else x for j, x in enumerate(secs)]  # noqa: E731
    none = _repack(record, meta=(*meta[:2], 0), secs=esc(b""))
    fewer = _repack(record, meta=(*meta[:2], n - 1), secs=esc(secs[2 * R][:-2]))
    return [(none, f"{n} escape symbols, 0 announced"), (fewer, f"{n} escape symbols, {n - 1} announced")]


def test_escape_counts_that_lie_are_refused(model):
    for bad, match in escape_liars(model):
        with pytest.raises(CodecRecordError, match=f"corrupted PCA codec record: {match}"):
            pca.decode(bad, model=model)


@pytest.fixture(scope="module")
def model_file(model) -> bytes:
    return pca_model.to_bytes(model)


def _resealed(data: bytes) -> bytes:
    return data[:-32] + hashlib.sha256(data[:-32]).digest()


def test_bad_model_files_are_refused(model_file, tmp_path):
    path = tmp_path / "bad.lmtpca"
    version_2 = model_file[:8] + struct.pack("<I", 2) + model_file[12:]
    cases = [
        (model_file[:20], r"truncated \(20 bytes\)"),
        (model_file[:-1], "checksum mismatch"),
        (model_file[: len(model_file) // 2], "checksum mismatch"),
        (_flip(model_file, len(model_file) // 2), "checksum mismatch"),
        (_flip(model_file, len(model_file) - 5), "checksum mismatch"),
        (b"LMTPCB\0\0" + model_file[8:], "not a PCA model file"),
        (version_2, "version 2, this reader knows 1"),
        (_resealed(version_2[:8] + struct.pack("<I", 1) + struct.pack("<I", 1 << 30) + model_file[16:]), "header of"),
    ]
    for data, match in cases:
        path.write_bytes(data)
        with pytest.raises(pca.PCAModelError, match=f"PCA model {re.escape(str(path))}: .*{match}"):
            pca.load(path)
    with pytest.raises(OSError):
        pca.load(tmp_path / "missing.lmtpca")


def _with_header(data: bytes, edit) -> bytes:
    """``data`` with its JSON header edited by ``edit`` (arrays moved to the new 64-byte aligned
    start), resealed: a well-formed file of inconsistent content."""
    hlen = struct.unpack_from("<I", data, 12)[0]
    head = json.loads(data[16 : 16 + hlen])
    edit(head)
    new = json.dumps(head, sort_keys=True).encode()
    old_start, new_start = -(-(16 + hlen) // 64) * 64, -(-(16 + len(new)) // 64) * 64
    out = data[:12] + struct.pack("<I", len(new)) + new.ljust(new_start - 16, b"\0") + data[old_start:-32]
    return out + hashlib.sha256(out).digest()


def test_inconsistent_model_headers_are_refused(model_file):
    """Well-sealed files whose header disagrees with the arrays: PCAModelError naming the field."""

    def shape(h):
        h["arrays"]["e_int"]["shape"][-1] -= 1

    def dtype(h):
        h["arrays"]["d_int"]["dtype"] = "<i4"

    def outside(h):
        h["arrays"]["mu_raw"]["offset"] = 1 << 40

    def geometry(h):
        h["scalars"]["num_heads"] = 1

    def group(h):
        h["scalars"]["layer_group"] = 3

    def no_level(h):
        h["scalars"]["levels"] = {"pca_high": 0.105, "pca_ultra": 0.5}

    for edit, match in (
        (shape, r"PCAModel.e_int must be int16 \(2, 2, 64, 64\), got int16 \(2, 2, 64, 63\)"),
        (dtype, "arrays d_int and mu_raw overlap"),  # int32 at int16's offset runs into the next array
        (outside, "array mu_raw lies outside the file"),
        (geometry, r"PCAModel.mu_int must be int32 \(2, 2, 32\), got int32 \(2, 2, 64\)"),
        (group, "layer group 3: G must divide L"),
        (no_level, r"malformed header \(KeyError: 'pca_ultra.step'\)"),
    ):
        with pytest.raises(pca.PCAModelError, match=match):
            pca_model.from_bytes(_with_header(model_file, edit))


def test_malformed_model_headers_are_refused_once(model_file):
    """Well-sealed files whose JSON header has the wrong structure (a list for a mapping) raise
    PCAModelError, not AttributeError; every message names the file and its reason once."""
    edits = {
        "arrays": lambda h: h.update(arrays=[]),
        "levels": lambda h: h["scalars"].update(levels=[1]),
        "scalars": lambda h: h.update(scalars=[]),
        "entry": lambda h: h["arrays"].update(mu_raw=[]),
        "outside": lambda h: h["arrays"]["mu_raw"].update(offset=1 << 40),
    }
    for what, edit in edits.items():
        with pytest.raises(pca.PCAModelError) as e:
            pca_model.from_bytes(_with_header(model_file, edit), "f.lmtpca")
        msg = str(e.value)
        assert msg.startswith("PCA model f.lmtpca: ") and msg.count("PCA model f.lmtpca") == 1, (what, msg)
        assert msg.count("not used") == 1, (what, msg)


def test_vectors_beyond_exact_float64_sums_are_refused():
    """``N = G*H*D`` above 8192 would take the float64 GEMM and energy sums past 2**53 (no longer
    exact, so no longer reproducible): refused by the fit before any work (the wrong metric shape
    would be the next refusal: a fit that missed the check fails fast) and by the model."""
    kv = torch.zeros(2, 2, 4, 1, 4104, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"N = G\*H\*D = 8208 exceeds 8192"):
        pca.fit([kv], [0], inv_freq=None, layer_group=2, metric=torch.zeros(1))
    z = np.zeros(1)
    with pytest.raises(pca.PCAModelError, match=r"N = G\*H\*D = 8208 exceeds 8192"):
        pca.PCAModel("big", 2, 1, 4104, 2, None, 1, z, z, z, z, z, z, {})


def test_bad_fits_are_refused():
    kvs, starts = _calibration()
    fit = lambda **kw: pca.fit(**{"kvs": kvs, "starts": starts, "inv_freq": INV_FREQ, "layer_group": G, **kw})  # noqa: E731
    with pytest.raises(ValueError, match="layer_group 3 must divide the 4 layers"):
        fit(layer_group=3)
    with pytest.raises(ValueError, match="layer_group 0 must divide"):
        fit(layer_group=0)
    for share in (1.0, -0.1):
        with pytest.raises(ValueError, match=f"outlier_share must be in \\[0, 1\\), got {share}"):
            fit(outlier_share=share)
    with pytest.raises(ValueError, match="need one start per KV tensor .* got 2 / 1"):
        fit(starts=[0])
    with pytest.raises(ValueError, match="need one start per KV tensor and at least one tensor, got 0 / 0"):
        fit(kvs=[], starts=[])
    with pytest.raises(ValueError, match=r"metric must be \[L=4, 2, 32, 32\], got \(4, 2, 16, 16\)"):
        fit(metric=torch.eye(16, dtype=torch.float64).expand(L, 2, 16, 16))
    with pytest.raises(ValueError, match="one geometry"):
        fit(kvs=[kvs[0], kvs[1][:, :, :, :1]])
    with pytest.raises(ValueError, match="inv_freq must be float64 \\[8\\]"):
        fit(inv_freq=INV_FREQ[:4])
    with pytest.raises(ValueError, match="x_headroom must be >= 1"):
        fit(x_headroom=0.5)
    with pytest.raises(ValueError, match=r"calibration KV tensors \[1\] hold no tokens"):
        fit(kvs=[kvs[0], kvs[1][:, :, :0]])
    bad = kvs[0].clone()
    bad[0, 0, 0, 0, 0] = float("nan")
    with pytest.raises(ValueError, match="NaN or inf"):
        fit(kvs=[bad], starts=[0])
    with pytest.raises(ValueError, match="start and tokens must be >= 0"):
        fit(starts=[0, -1])
    flat = [kv.clone() for kv in kvs]
    for kv in flat:
        kv[2:4, 1] = 0.5  # V of the second layer group constant: zero spread, no step to fit
    with pytest.raises(ValueError, match=r"calibration KV of layers 2-3 \(V\) does not vary"):
        fit(kvs=flat)


def test_more_tables_than_the_coders_16_bit_ids():
    """2 * L * H * D tables (here 65,536, as an 8B model's 32 layers x 8 heads x 128) exceed the rANS
    coder's 16-bit table ids: each (layer group, K/V) stream is coded with its own N tables, so the
    record still codes and decodes (identity transforms: decoded = the quantized fixed point)."""
    nl, h, d = 64, 4, 128
    n = h * d
    eye = np.broadcast_to(np.eye(n, dtype=np.int16), (nl, 2, n, n)).copy()
    zeros = np.zeros((nl, 2, n))
    k = np.full((nl, 2, n), 1 / 64)
    level = pca_model.PCALevelData(
        0.1,
        np.ones((nl, 2)),
        k,
        1 / k,
        np.full((nl, 2), np.iinfo(np.int64).max),
        np.full((nl * 2 * n, 256), 16, np.uint16),
    )
    m = pca.PCAModel(
        "wide",
        nl,
        h,
        d,
        1,
        None,
        0,
        np.ones((nl, 2)),
        zeros.astype(np.int32),
        eye,
        zeros.astype(np.int64),
        eye,
        zeros,
        {"pca_default": level},
    )
    assert m.levels["pca_default"].tables.shape[0] == 65536 > 0xFFFF
    g = torch.Generator().manual_seed(3)
    kv = (torch.randn(nl, 2, 32, h, d, generator=g) * 500).round().to(torch.bfloat16)
    dec = pca.decode(pca.encode(kv, start=0, model=m, level="pca_default"), model=m)
    want = (torch.round(kv.double() / 64) * 64).float().to(torch.bfloat16)
    assert torch.equal(dec, want)


def test_positions_beyond_float64_exactness_and_non_models_are_refused(model):
    """RoPE angles are ``position * inv_freq`` in float64: ``start + T`` must stay within
    ``MAX_POSITION`` (2**52) in encode and in a record's metadata; ``True`` is not a position; the model
    must be a PCAModel (a path or None is a TypeError that says how to get one)."""
    from lmtier.codec.pca.codec import MAX_POSITION

    kv = _kv(8, 0, 18)
    for start in (MAX_POSITION - 7, 2**63 - 1, 2**64, True):
        with pytest.raises(ValueError, match="start must be an integer in"):
            pca.encode(kv, start=start, model=model, level="pca_high")
    pca.encode(kv, start=MAX_POSITION - 8, model=model, level="pca_high")
    record = pca.encode(kv, start=5, model=model, level="pca_high")
    _, _, (_, n_exact, n_esc) = _parts(record)
    with pytest.raises(CodecRecordError, match="section sizes do not match its metadata"):
        pca.decode(_repack(record, meta=(MAX_POSITION - 7, n_exact, n_esc)), model=model)
    for bad in (None, "model.lmtpca"):
        with pytest.raises(TypeError, match="model must be a lmtier.codec.pca.PCAModel"):
            pca.encode(kv, start=0, model=bad, level="pca_high")
        with pytest.raises(TypeError, match="model must be a lmtier.codec.pca.PCAModel"):
            pca.decode(record, model=bad)


@pytest.mark.parametrize(
    ("array", "index", "value", "match"),
    [
        ("inv_x_scale", (0, 1), 0.0, r"inv_x_scale at \(0, 1\) is 0.0: must be finite and > 0"),
        ("inv_x_scale", (1, 0), float("inf"), "inv_x_scale at .* must be finite and > 0"),
        ("mu_raw", (0, 0, 3), float("nan"), "mu_raw at .* must be finite"),
        ("inv_freq", (2,), float("-inf"), "inv_freq at .* must be finite and >= 0"),
        ("pca_default.f", (0, 0, 0), float("inf"), "f at .* must be finite and >= 0"),
        ("pca_high.k", (1, 1, 5), -1.0, "k at .* must be finite and >= 0"),
        ("pca_high.step", (0, 0), 0.0, "step at .* must be finite and > 0"),
        ("pca_default.energy_threshold", (0, 1), -5, "energy_threshold at .* must be >= 0"),
        ("e_mu", (0, 0, 0), 12345, "e_mu is not mu_int @ e_int"),
    ],
)
def test_model_values_the_arithmetic_cannot_use_are_refused(model, array, index, value, match):
    """A model (or a well-sealed file from a faulty writer) with non-finite or non-positive scales,
    non-finite means or frequencies, negative thresholds or an inconsistent ``e_mu`` is refused: it
    would decode NaN or garbage without an error."""
    if "." in array:
        lv, name = array.split(".")
        arr = getattr(model.levels[lv], name).copy()
        arr[index] = value
        levels = {**model.levels, lv: dataclasses.replace(model.levels[lv], **{name: arr})}
        edit = dict(levels=levels)
    else:
        arr = getattr(model, array).copy()
        arr[index] = value
        edit = {array: arr}
    with pytest.raises(pca.PCAModelError, match=match):
        dataclasses.replace(model, **edit)


def test_a_record_of_other_model_data_with_a_colliding_id_is_refused(model):
    """Records carry 16 bytes of the model file's SHA-256 besides the 32-bit id in ``table_id``: a
    record whose id matches but whose digest does not (two model files with colliding ids) is
    refused, never decoded into plausible wrong KV."""
    record = pca.encode(_kv(16, 3, 19), start=3, model=model, level="pca_default")
    meta = pca.record_meta(record)
    assert meta.model_digest == model.digest == hashlib.sha256(pca_model.to_bytes(model)[:-32]).digest()[:16]
    assert meta.start == 3 and model.model_id == int.from_bytes(model.digest[:4], "little")
    other = bytes(b ^ 1 for b in model.digest[4:])
    with pytest.raises(CodecRecordError, match=f"coded with PCA model data {model.digest[:4].hex()}"):
        pca.decode(_repack(record, digest=model.digest[:4] + other), model=model)
    pca.decode(_repack(record), model=model)


def test_device_names_resolve_as_before_their_answers_are_cached(monkeypatch):
    """``device_key`` and the decode's device check keep what fixes one device (the host, an indexed
    CUDA device) and never a bare ``"cuda"``, whose answer follows the current device; a CUDA device
    this machine lacks is refused every time, not remembered."""
    from lmtier.codec.pca import codec as pca_codec
    from lmtier.codec.pca import imatmul

    monkeypatch.setattr(pca_codec, "_CHECKED", {})  # what earlier tests' decodes left
    monkeypatch.setattr(imatmul, "_KEYS", {})
    assert imatmul.device_key("cpu") == imatmul.device_key(torch.device("cpu")) == "cpu"
    assert imatmul.device_key(torch.device("cuda", 3)) == imatmul.device_key("cuda:3") == "cuda:3"
    for now in (0, 2, 1):
        monkeypatch.setattr(torch.cuda, "current_device", lambda now=now: now)
        assert imatmul.device_key("cuda") == imatmul.device_key(torch.device("cuda")) == f"cuda:{now}"
    assert "cuda" not in imatmul._KEYS and torch.device("cuda") not in imatmul._KEYS
    cpu = torch.device("cpu")
    assert pca_codec._device(cpu) == cpu and pca_codec._device(cpu) == cpu and pca_codec._device(None) == cpu
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    for now in (0, 2, 1):
        monkeypatch.setattr(torch.cuda, "current_device", lambda now=now: now)
        assert pca_codec._device(torch.device("cuda")) == pca_codec._device("cuda") == torch.device("cuda", now)
    assert pca_codec._device(torch.device("cuda", 3)) == torch.device("cuda", 3)
    assert torch.device("cuda") not in pca_codec._CHECKED and torch.device("cuda", 3) in pca_codec._CHECKED
    with pytest.raises(ValueError, match="no such CUDA device"):
        pca_codec._device(torch.device("cuda", 4))
    monkeypatch.setattr(pca_codec, "_CHECKED", {})
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for _ in range(2):
        with pytest.raises(ValueError, match="no such CUDA device"):
            pca_codec._device(torch.device("cuda", 0))
    assert torch.device("cuda", 0) not in pca_codec._CHECKED
    with pytest.raises(ValueError, match="the host or a CUDA device"):
        pca_codec._device(torch.device("meta"))
