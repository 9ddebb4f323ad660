"""The PCA levels as a YAML ``codec_level`` (:class:`lmtier.tiers.codec_pca.PCACodecTier` over a real
:class:`~lmtier.tiers.disk.DiskTier`, the config keys ``codec_level: pca_*`` / ``codec_pca_model``,
the factory): records are :func:`lmtier.codec.pca.encode`'s at the put's position and decode bit for
bit as :func:`~lmtier.codec.pca.decode` does; a chunk without a position is not stored; records carry
their start; other model files, levels and serdes are other key spaces; corrupt records and records
of another geometry are misses and deleted; evictions reach listeners under chunk keys;
:func:`lmtier.codec.pca.codec.max_record_bytes` bounds real records; config errors name the key.

The model is the synthetic one of ``tests/test_codec_pca_product.py`` (L=4, H=2, D=16, G=2)."""

from __future__ import annotations

import dataclasses
import logging
import math
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from lmtier.codec import pca
from lmtier.codec.pca import codec as pca_codec
from lmtier.config import ConfigError, LMTierConfig, load_config
from lmtier.keys import Namespace
from lmtier.manager import TierManager
from lmtier.tiers import factory
from lmtier.tiers.base import Eviction
from lmtier.tiers.codec import CodecTier
from lmtier.tiers.codec_pca import PCACodecTier
from lmtier.tiers.disk import DiskTier
from tests.test_codec_pca_product import D, H, L, _coded, _error_bound, _kv, _parts, _repack, fitted

REPO = Path(__file__).resolve().parents[1]
T = 32
SHAPE = (L, 2, T, H, D)
NBYTES = math.prod(SHAPE) * 2
LEVELS = ("pca_high", "pca_default")
no_torch_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="needs a process where CUDA cannot be used")


def key(i: int) -> bytes:
    return bytes([i]) * 32


def as_bytes(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous().view(-1).view(torch.uint8)


@pytest.fixture(scope="module")
def model() -> pca.PCAModel:
    return fitted("plain")


@pytest.fixture
def disk(tmp_path):
    t = DiskTier([str(tmp_path / "d")], 64 << 20, io_threads=1)
    yield t
    t.close()


def _tier(inner, model, level="pca_default", **kw) -> PCACodecTier:
    return PCACodecTier(inner, shape=SHAPE, dtype=torch.bfloat16, level=level, model=model, **kw)


def stored(t: PCACodecTier, k: bytes) -> bytes | None:
    """The record bytes the inner tier holds for chunk ``k`` (None: none)."""
    buf = bytearray(t.max_record_bytes + 4096)
    n = t.inner.get_into(t.inner_key(k), buf)
    return None if n is None else bytes(buf[:n])


def got(t, k: bytes) -> torch.Tensor | None:
    out = torch.empty(NBYTES, dtype=torch.uint8)
    n = t.get_into(k, out)
    return None if n is None else out.view(torch.bfloat16).view(SHAPE)


# ---------------------------------------------------------------------------------------------------
# Round trip and positions


@pytest.mark.parametrize("level", LEVELS)
def test_round_trip_is_the_library_codec_bit_for_bit(disk, model, level):
    t = _tier(disk, model, level)
    assert t.takes_position()
    x = _kv(T, 96, 11, loud=(5,))
    assert t.put(key(1), as_bytes(x), position=96)
    want_record = pca.encode(x, start=96, model=model, level=level)
    assert stored(t, key(1)) == want_record
    dec = got(t, key(1))
    want = pca.decode(want_record, model=model)
    assert dec is not None and torch.equal(dec.view(torch.int16), want.view(torch.int16))
    assert not torch.equal(dec, x)  # lossy: not the raw bytes stored under another name
    assert t.counters["puts"] == 1 and t.counters["hits"] == 1
    assert t.counters["raw_bytes_in"] == NBYTES and t.counters["record_bytes_out"] == len(want_record)
    assert t.contains(key(1)) and t.contains_many([key(1), key(2)]) == [True, False]
    # several at once, one a miss
    outs = [torch.empty(NBYTES, dtype=torch.uint8) for _ in range(2)]
    assert t.get_many_into([key(1), key(2)], outs) == [NBYTES, None]
    assert torch.equal(outs[0].view(torch.bfloat16).view(SHAPE).view(torch.int16), want.view(torch.int16))
    assert t.delete(key(1)) and not t.contains(key(1)) and got(t, key(1)) is None


@pytest.mark.parametrize("budget", [None, 5])
def test_batched_reads_reuse_their_record_buffers(model, monkeypatch, budget):
    """A batched read holds one record buffer per chunk; the tier keeps as many idle as were in use at
    once (a new buffer's page faults cost ~20x a copy into a reused one), so the same read again
    allocates none, except for the miss's buffer (a miss or a failed read may have written any part
    of it: dropped); within ``_IDLE_BYTES``, each idle buffer counted as the pages of the largest
    record read into it, not its ``max_record_bytes`` (here 5 buffers' worth: 5 kept, 6 - 5 + 1 new
    the next time)."""
    from lmtier.tiers import codec_pca
    from lmtier.tiers.buffers import round_up
    from tests.test_fetch_batch import BatchingTier

    t = _tier(BatchingTier(), model)
    keys = [key(i) for i in range(7)]  # the last one a miss
    for i, k in enumerate(keys[:6]):
        assert t.put(k, as_bytes(_kv(T, T * i, 30 + i)), position=T * i)
    largest = round_up(max(len(stored(t, k)) for k in keys[:6]))
    assert 6 * largest < t.max_record_bytes  # counted by their address space, none would be kept
    monkeypatch.setattr(codec_pca, "_IDLE_BYTES", (6 if budget is None else budget) * largest)
    made: list[int] = []
    real = codec_pca.AlignedBuffer
    monkeypatch.setattr(codec_pca, "AlignedBuffer", lambda n: made.append(n) or real(n))
    outs = [torch.empty(NBYTES, dtype=torch.uint8) for _ in keys]
    for new in (7, 1 if budget is None else 2):
        made.clear()
        assert t.get_many_into(keys, outs) == [NBYTES] * 6 + [None]
        assert made == [t.max_record_bytes] * new
    assert len(t._idle) == (6 if budget is None else 5) and t._in_use == 0
    assert all(0 < b.touched <= largest and b.outcome for b in t._idle)
    want = pca.decode(pca.encode(_kv(T, T * 5, 35), start=T * 5, model=model, level="pca_default"), model=model)
    assert torch.equal(outs[5].view(torch.bfloat16).view(SHAPE).view(torch.int16), want.view(torch.int16))


def test_put_without_a_position_is_not_stored(disk, model, caplog):
    t = _tier(disk, model)
    x = _kv(T, 0, 12)
    with caplog.at_level(logging.DEBUG, "lmtier.tiers.codec_pca"):
        assert t.put(key(2), as_bytes(x)) is False
        assert t.put(key(3), as_bytes(x), position=None) is False
    assert t.counters["put_no_position"] == 2 and t.counters["puts"] == 0
    assert disk.usage().num_chunks == 0 and not t.contains(key(2))
    said = [r for r in caplog.records if "without a position" in r.getMessage()]
    assert [r.levelno for r in said] == [logging.WARNING, logging.DEBUG]  # once at warning, then debug


@pytest.mark.parametrize("position", [-1, True, 1.5, "0", np.int64(0)])
def test_put_at_a_bad_position_raises_and_stores_nothing(disk, model, position):
    """A position that is neither None nor an int >= 0 is the caller's bug, as at every tier that
    takes positions (lmtier.tiers.base.check_position): ValueError naming the tier, nothing stored."""
    t = _tier(disk, model)
    with pytest.raises(ValueError, match=r"\.put: position must be None or an int >= 0"):
        t.put(key(2), as_bytes(_kv(T, 0, 12)), position=position)
    assert t.counters["puts"] == 0 and t.counters.get("put_no_position", 0) == 0
    assert disk.usage().num_chunks == 0 and not t.contains(key(2))


def test_put_refuses_bad_payloads_nan_and_positions_past_the_maximum(disk, model):
    t = _tier(disk, model)
    x = _kv(T, 0, 13)
    assert t.put(key(4), as_bytes(x)[:-2], position=0) is False  # not one chunk
    nan = x.clone()
    nan[1, 0, 3, 0, 0] = float("nan")
    assert t.put(key(4), as_bytes(nan), position=0) is False  # CodecInputError
    assert t.put(key(4), as_bytes(x), position=pca_codec.MAX_POSITION) is False  # past MAX_POSITION - T
    assert t.counters["put_failures"] == 3 and disk.usage().num_chunks == 0


def test_records_carry_their_start_and_decode_at_it(disk, model):
    """KV cached at positions 200..: stored at 200 or at a wrong 8, the records differ (RoPE undone
    at other positions), carry their start and decode within the level's bound (a wrong position
    costs quality, never the KV). The same record with its start rewritten to 8 (checksum redone)
    decodes out of the bound: the tier decodes at the record's start, which the key cannot supply."""
    level = "pca_default"
    t = _tier(disk, model, level)
    x = _kv(T, 200, 14)
    assert t.put(key(5), as_bytes(x), position=200) and t.put(key(6), as_bytes(x), position=8)
    right, wrong = stored(t, key(5)), stored(t, key(6))
    assert right != wrong
    assert pca.record_meta(right).start == 200 and pca.record_meta(wrong).start == 8
    for k, rec, start in ((key(5), right, 200), (key(6), wrong, 8)):
        slack = _error_bound(model, level, x, got(t, k), start)[:, :, ~_exact(rec)]
        assert slack.min() >= 0
    _, _, (_, n_exact, n_esc) = _parts(right)
    moved = _repack(right, meta=(8, n_exact, n_esc))
    assert disk.put(t.inner_key(key(7)), memoryview(moved))
    slack = _error_bound(model, level, x, got(t, key(7)), 200)[:, :, ~_exact(right)]
    assert slack.min() < 0


def _exact(record: bytes) -> np.ndarray:
    """The record's exact-token bitmap, bool ``[T]``."""
    return _coded(record, fitted("plain"), "pca_default")[1]


# ---------------------------------------------------------------------------------------------------
# Key spaces, corruption, geometry, evictions


def test_other_model_files_levels_and_serdes_are_other_key_spaces(disk, model):
    t = _tier(disk, model, "pca_default")
    x = _kv(T, 64, 15)
    assert t.put(key(7), as_bytes(x), position=64)
    others = [
        _tier(disk, fitted("metric"), "pca_default"),  # another model file
        _tier(disk, model, "pca_high"),  # the other level
        CodecTier(disk, shape=SHAPE, dtype=torch.bfloat16, level="default", tables=None),  # the CacheGen levels
    ]
    for o in others:
        assert not o.contains(key(7)) and got(o, key(7)) is None
        assert o.counters["corrupt_deleted"] == 0
    assert disk.get_into(key(7), bytearray(NBYTES)) is None  # a naive reader: no raw chunk under the key
    assert len({o.inner_key(key(7)) for o in [t, *others]}) == 4
    assert got(t, key(7)) is not None  # nobody deleted it


@pytest.mark.parametrize("damage", ["flip", "truncate", "garbage"])
def test_corrupted_record_is_a_miss_deleted_and_out_untouched(disk, model, damage):
    t = _tier(disk, model)
    x = _kv(T, 32, 16)
    assert t.put(key(8), as_bytes(x), position=32)
    rec = bytearray(stored(t, key(8)))
    if damage == "flip":
        rec[len(rec) // 2] ^= 0x10
    elif damage == "truncate":
        rec = rec[: len(rec) - 40]
    else:
        rec = bytearray(os.urandom(len(rec)))
    assert disk.put(t.inner_key(key(8)), memoryview(bytes(rec)))
    out = torch.full((NBYTES,), 0xA5, dtype=torch.uint8)
    assert t.get_into(key(8), out) is None
    assert torch.equal(out, torch.full((NBYTES,), 0xA5, dtype=torch.uint8))
    assert t.counters["corrupt_deleted"] == 1 and not disk.contains(t.inner_key(key(8)))


@pytest.mark.parametrize("other", ["tokens", "dtype"])
def test_record_of_another_geometry_is_a_miss_and_deleted(disk, model, other):
    """A valid record of this model and level, but of 16 tokens or fp16, under the tier's key."""
    t = _tier(disk, model)
    x = _kv(16, 0, 17) if other == "tokens" else _kv(T, 0, 17, dtype=torch.float16)
    assert disk.put(t.inner_key(key(9)), memoryview(pca.encode(x, start=0, model=model, level="pca_default")))
    assert got(t, key(9)) is None
    assert t.counters["corrupt_deleted"] == 1 and not disk.contains(t.inner_key(key(9)))


def test_inner_evictions_reach_listeners_under_chunk_keys(tmp_path, model):
    x = _kv(T, 0, 18)
    one = len(pca.encode(x, start=0, model=model, level="pca_default"))
    d = DiskTier([str(tmp_path / "small")], 2 * one + 8192, io_threads=1)  # room for about two records
    t = _tier(d, model)
    seen: list[Eviction] = []
    t.add_eviction_listener(seen.append)
    try:
        for i in range(4):
            assert t.put(key(20 + i), as_bytes(_kv(T, 0, 30 + i)), position=0)
        evicted = [k for ev in seen for k in ev.keys]
        assert evicted and set(evicted) <= {key(20 + i) for i in range(4)}
        assert all(ev.payloads is None and ev.tier == "disk" for ev in seen)
        assert all(not t.contains(k) for k in evicted)
    finally:
        t.close()


# ---------------------------------------------------------------------------------------------------
# The record bound


@pytest.mark.parametrize("tokens", [1, 7, 31, 32, 33, 64])
@pytest.mark.parametrize("case", ["correlated", "all_loud", "random", "huge", "tiny_noise"])
def test_max_record_bytes_bounds_real_records(model, tokens, case):
    g = torch.Generator().manual_seed(tokens)
    if case == "correlated":
        x = _kv(tokens, 40, 19)
    elif case == "all_loud":  # every token exact: raw
        x = _kv(tokens, 40, 19, loud=range(tokens))
    elif case == "random":  # no correlation, just below loud: coefficients escaped
        x = (5.0 * torch.randn(L, 2, tokens, H, D, generator=g)).to(torch.bfloat16)
    elif case == "huge":  # beyond the 16-bit fixed point: exact
        x = (1e4 * torch.randn(L, 2, tokens, H, D, generator=g)).to(torch.bfloat16)
    else:
        x = (1e-3 * torch.randn(L, 2, tokens, H, D, generator=g)).to(torch.bfloat16)
    bound = pca_codec.max_record_bytes(model, tokens)
    for level in reversed(LEVELS):  # pca_default, then pca_high (the finer step: more escapes)
        rec = pca.encode(x, start=40, model=model, level=level)
        assert len(rec) <= bound, (case, level, len(rec), bound)
    meta = pca.record_meta(rec)
    if case in ("all_loud", "huge"):
        assert meta.exact_tokens == tokens
    if case == "random" and tokens >= 32:
        assert meta.escapes > 0


def test_max_record_bytes_is_the_format_arithmetic(model):
    """The bound is the streams' raw bound, 4 bytes per value of the chunk for escapes and exact
    tokens together, the bitmap and the framing: a chunk's raw bytes plus a small overhead."""
    from lmtier.codec import rans

    for t in (1, 32, 100):
        b = pca_codec.max_record_bytes(model, t)
        streams = 2 * model.rows * rans.max_encoded_bytes(model.vector_size * (-(-t // 32) * 32))
        assert streams + 4 * L * H * D * t + -(-t // 8) <= b <= streams + 4 * L * H * D * t + 2048
    with pytest.raises(ValueError, match="tokens"):
        pca_codec.max_record_bytes(model, -1)
    with pytest.raises(TypeError):
        pca_codec.max_record_bytes(object(), 1)


# ---------------------------------------------------------------------------------------------------
# The tier's refusals, the GPU-encode fallback


def test_tier_refuses_geometries_dtypes_and_levels_the_model_file_cannot_take(disk, model):
    with pytest.raises(ConfigError, match=r"codec_pca_model='/m\.lmtpca'.*H=2 KV heads.*H/tp KV heads"):
        PCACodecTier(disk, shape=(L, 2, T, 4, D), dtype="bfloat16", level="pca_default", model=model,
                     model_path="/m.lmtpca")  # fmt: skip
    with pytest.raises(ConfigError, match="L=4 layers"):
        PCACodecTier(disk, shape=(L + 2, 2, T, H, D), dtype="bfloat16", level="pca_default", model=model)
    with pytest.raises(ConfigError, match="local_disk_serde='cachegen'.*bfloat16/float16.*float32"):
        PCACodecTier(disk, shape=SHAPE, dtype="float32", level="pca_default", model=model,
                     config_key="local_disk_serde")  # fmt: skip
    with pytest.raises(ConfigError, match="kv_planes=2"):
        PCACodecTier(disk, shape=(L, 1, T, H, D), dtype="bfloat16", level="pca_default", model=model)
    with pytest.raises(ConfigError, match="codec_level='default': not a PCA level"):
        PCACodecTier(disk, shape=SHAPE, dtype="bfloat16", level="default", model=model)
    high_only = dataclasses.replace(model, levels={"pca_high": model.levels["pca_high"]})
    with pytest.raises(ConfigError, match=r"codec_pca_model.*has no level 'pca_default' \(it has \['pca_high'\]\)"):
        PCACodecTier(disk, shape=SHAPE, dtype="bfloat16", level="pca_default", model=high_only)
    with pytest.raises(TypeError, match="PCAModel"):
        PCACodecTier(disk, shape=SHAPE, dtype="bfloat16", level="pca_default", model="m.lmtpca")
    for t in (1, 5, 256):  # any chunk size
        PCACodecTier(disk, shape=(L, 2, t, H, D), dtype="float16", level="pca_high", model=model)


@no_torch_cuda
def test_gpu_encode_falls_back_to_the_cpu_once(disk, model, caplog):
    t = _tier(disk, model, encode_device="cuda:0")
    assert t.encode_device == torch.device("cuda", 0)
    xs = [_kv(T, 0, 40), _kv(T, 32, 41)]
    with caplog.at_level(logging.WARNING, "lmtier.tiers.codec_pca"):
        assert t.put(key(30), as_bytes(xs[0]), position=0) and t.put(key(31), as_bytes(xs[1]), position=32)
    assert t.counters["gpu_encode_fallbacks"] == 1 and t.counters["gpu_encodes"] == 0 and t.encode_device is None
    assert stored(t, key(30)) == pca.encode(xs[0], start=0, model=model, level="pca_default")
    assert len([r for r in caplog.records if "encoded on the CPU" in r.getMessage()]) == 1


# ---------------------------------------------------------------------------------------------------
# Config and factory


@pytest.fixture(scope="module")
def model_file(tmp_path_factory, model) -> str:
    p = tmp_path_factory.mktemp("pca") / "synthetic.lmtpca"
    pca.save(model, p)
    return str(p)


def _values(tmp_path, model_file, **extra) -> dict:
    return {
        "chunk_size": T,
        "max_local_cpu_size": 0.01,
        "local_disk": f"file://{tmp_path}/disk",
        "max_local_disk_size": 0.01,
        "local_disk_serde": "cachegen",
        "codec_level": "pca_default",
        "codec_pca_model": model_file,
        **extra,
    }


def _ns(heads: int = H, dtype: str = "bfloat16") -> Namespace:
    return Namespace(model="m", num_layers=L, num_kv_heads=heads, head_size=D, kv_dtype=dtype, chunk_size=T)


def test_config_takes_the_pca_levels_and_the_model_file(tmp_path, model_file):
    cfg = LMTierConfig.from_dict(_values(tmp_path, model_file))
    assert cfg.codec_level == "pca_default" and cfg.codec_pca_model == model_file
    assert cfg.to_dict()["codec_pca_model"] == model_file
    f = tmp_path / "lmtier.yaml"
    f.write_text(f"local_disk_serde: cachegen\nlocal_disk: file://{tmp_path}/d\nmax_local_disk_size: 0.01\n")
    env = {"LMTIER_CODEC_LEVEL": "pca_high", "LMTIER_CODEC_PCA_MODEL": model_file}
    cfg = load_config(f, env=env)
    assert (cfg.codec_level, cfg.codec_pca_model) == ("pca_high", model_file)
    assert LMTierConfig.from_dict({}).codec_pca_model is None


@pytest.mark.parametrize(
    "change,msg",
    [
        ({"codec_pca_model": None}, "codec_level='pca_default': a PCA level needs codec_pca_model"),
        ({"codec_level": "default"}, "codec_pca_model=.*set with codec_level='default', which is not a PCA level"),
        ({"local_disk_serde": "naive"}, "codec_pca_model=.*no serde is 'cachegen'"),
        ({"codec_pca_model": "/nonexistent/m.lmtpca"}, "codec_pca_model='/nonexistent/m.lmtpca'.*does not exist"),
        ({"codec_pca_model": "/"}, "codec_pca_model='/'.*not a regular file"),
        ({"codec_pca_model": "file:///m.lmtpca"}, r"does not exist \(a plain path, not a file:// URL as local_disk"),
        ({"codec_level": "pca_medium"}, r"codec_level='pca_medium'.*'pca_high', 'pca_default'"),
    ],
)
def test_config_errors(tmp_path, model_file, change, msg):
    with pytest.raises(ConfigError, match=msg):
        LMTierConfig.from_dict(_values(tmp_path, model_file) | change)


def test_config_error_says_when_codec_level_is_the_default(tmp_path, model_file):
    """codec_pca_model without codec_level: the message says the level is the default, not the user's."""
    values = _values(tmp_path, model_file)
    del values["codec_level"]
    with pytest.raises(ConfigError) as e:
        LMTierConfig.from_dict(values)
    assert "set with codec_level='default' (the default), which is not a PCA level" in str(e.value)
    with pytest.raises(ConfigError) as e:  # written by the user: no "(the default)"
        LMTierConfig.from_dict(values | {"codec_level": "default"})
    assert "set with codec_level='default', which is not a PCA level" in str(e.value)


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads any file")
def test_config_refuses_an_unreadable_model_file(tmp_path, model_file):
    p = tmp_path / "locked.lmtpca"
    p.write_bytes(Path(model_file).read_bytes())
    p.chmod(0)
    with pytest.raises(ConfigError, match="codec_pca_model=.*is not readable"):
        LMTierConfig.from_dict(_values(tmp_path, str(p)))


def test_codec_tables_keys_are_unused_with_a_pca_level(tmp_path, model_file, caplog):
    with caplog.at_level(logging.WARNING, "lmtier.config"):
        LMTierConfig.from_dict(_values(tmp_path, model_file, codec_tables="shipped", codec_tables_dir=str(tmp_path)))
    text = caplog.text
    assert "codec_tables='shipped' with codec_level='pca_default': unused" in text
    assert "codec_tables_dir=" in text and "entropy tables are in codec_pca_model" in text


def test_factory_builds_pca_tiers_for_disk_and_remote_sharing_one_model(tmp_path, model_file):
    cfg = LMTierConfig.from_dict(
        _values(tmp_path, model_file, remote_url="redis://unused:6379", remote_serde="cachegen")
    )

    def remote(_remote, _ns):  # a local stand-in for the remote store
        return DiskTier([str(tmp_path / "remote")], 16 << 20, io_threads=1)

    with TierManager.from_config(cfg, _ns(), remote_factory=remote) as m:
        assert isinstance(m.disk, PCACodecTier) and isinstance(m.remote, PCACodecTier)
        assert m.disk.model is m.remote.model and m.disk.level.name == "pca_default"
        assert m.disk.model.digest == pca.load(model_file).digest
        x = _kv(T, 64, 50)
        assert m.disk.put(key(40), as_bytes(x), position=64) and m.remote.put(key(40), as_bytes(x), position=64)
        want = pca.decode(pca.encode(x, start=64, model=m.disk.model, level="pca_default"), model=m.disk.model)
        for tier in (m.disk, m.remote):
            assert torch.equal(got(tier, key(40)).view(torch.int16), want.view(torch.int16))
    # the disk tier alone, and the model file loaded once per process (same path, size, mtime)
    cfg = LMTierConfig.from_dict(_values(tmp_path, model_file, codec_level="pca_high"))
    with TierManager.from_config(cfg, _ns()) as m1, TierManager.from_config(cfg, _ns()) as m2:
        assert isinstance(m1.disk, PCACodecTier) and m1.remote is None and m1.disk.level.name == "pca_high"
        assert m1.disk.model is m2.disk.model
        assert factory.load_pca_model(cfg) is m1.disk.model
    assert factory.load_pca_model(LMTierConfig.from_dict({})) is None  # no PCA level: nothing loaded


def test_factory_refuses_a_model_file_that_does_not_fit_or_load(tmp_path, model_file):
    cfg = LMTierConfig.from_dict(_values(tmp_path, model_file))
    with pytest.raises(ConfigError, match=r"codec_pca_model=.*H=2 KV heads.*H=4.*H/tp KV heads"):
        TierManager.from_config(cfg, _ns(heads=4))
    with pytest.raises(ConfigError, match="local_disk_serde='cachegen'.*float32"):
        TierManager.from_config(cfg, _ns(dtype="float32"))
    bad = tmp_path / "bad.lmtpca"
    bad.write_bytes(b"LMTPCA\0\0" + os.urandom(200))
    cfg = LMTierConfig.from_dict(_values(tmp_path, str(bad)))
    with pytest.raises(ConfigError, match=r"codec_pca_model='.*bad\.lmtpca': not a usable PCA model file"):
        TierManager.from_config(cfg, _ns())
    assert not (tmp_path / "disk").exists() or not any((tmp_path / "disk").iterdir())  # refused before building


def test_codec_pca_model_is_documented_where_the_keys_are():
    import lmtier.config as cfgmod

    assert "codec_pca_model" in cfgmod.__doc__
    assert "codec_pca_model" in (REPO / "README.md").read_text()
    codec_md = (REPO / "docs" / "codec.md").read_text()
    section = codec_md[codec_md.index("## PCA levels") :]
    section = section[: section.index("\n## ", 1)]
    assert "codec_pca_model" in section and "codec_level: pca_default" in section
    assert "Not a `codec_level` of the YAML yet" not in section


def test_pca_tiers_take_the_connectors_device_decode_path(disk, model, tmp_path):
    """A CUDA cache over PCA codec tiers decodes on the GPU (decode_on "auto"), as over the CacheGen
    levels: the worker's test of its lower tiers accepts every codec tier, never a raw one
    (tests/test_gpu_connector_worker_loads.py runs the path on a GPU)."""
    from lmtier.integration.vllm.fetch import lower_tiers_are_codec

    pca_mgr = TierManager(cpu=None, disk=_tier(disk, model))
    raw_mgr = TierManager(cpu=None, disk=DiskTier([str(tmp_path / "raw")], 1 << 20, io_threads=1))
    try:
        assert lower_tiers_are_codec(pca_mgr) and not lower_tiers_are_codec(raw_mgr)
    finally:
        raw_mgr.close()
