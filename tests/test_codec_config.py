"""The codec's config keys (remote_serde, local_disk_serde, codec_level: defaults, env overrides,
errors that name the key) and TierManager.from_config's wiring of codec tiers (disk, CPU write-back,
evictions and forget, remote). Tiny geometries (tests/codec_cases.py): the whole file runs in seconds."""

from __future__ import annotations

import pytest
import torch

from lmtier import config as cfgmod
from lmtier.codec import chunk as C
from lmtier.codec import levels as L
from lmtier.codec import pca
from lmtier.config import ConfigError, LMTierConfig, load_config
from lmtier.keys import Namespace
from lmtier.manager import TierManager
from lmtier.tiers.codec import CodecTier
from lmtier.tiers.disk import DiskTier
from tests.codec_cases import (
    SHAPE,
    key,
    kv_like,
    reference,
)

# ------------------------------------------------------------------------------------------------
# config


def test_config_defaults_and_keys():
    cfg = LMTierConfig.from_dict({})
    assert cfg.disk.serde == "naive" and cfg.remote.serde == "naive" and cfg.codec_level == "default"
    assert cfg.serde_level("disk") is None and cfg.serde_level("remote") is None
    d = cfg.to_dict()
    assert d["local_disk_serde"] == "naive" and d["codec_level"] == "default" and d["remote_serde"] == "naive"
    assert cfgmod.CODEC_LEVELS == tuple(L.LEVELS)  # config's list stays in step with the codec's
    assert cfgmod.PCA_CODEC_LEVELS == tuple(pca.PCA_LEVELS)  # and the PCA levels' (lmtier.codec.pca)


def test_config_cachegen(tmp_path):
    cfg = LMTierConfig.from_dict({"remote_serde": "cachegen"})  # LMCache's file: lmtier's default level
    assert cfg.serde_level("remote") == "default" and cfg.serde_level("disk") is None
    cfg = LMTierConfig.from_dict(
        {
            "local_disk": f"file://{tmp_path}",
            "max_local_disk_size": 1,
            "local_disk_serde": "cachegen",
            "codec_level": "lossless",
        }
    )
    assert cfg.serde_level("disk") == "lossless" and cfg.serde_level("remote") is None


def test_config_env_overrides(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("remote_serde: cachegen\ncodec_level: high\n")
    cfg = load_config(f, env={"LMTIER_CODEC_LEVEL": "low", "LMTIER_LOCAL_DISK_SERDE": "cachegen"})
    assert cfg.codec_level == "low" and cfg.disk.serde == "cachegen" and cfg.remote.serde == "cachegen"


@pytest.mark.parametrize(
    "values,key",
    [
        ({"codec_level": "medium"}, "codec_level='medium'"),
        ({"codec_level": "cachegen_ref"}, "codec_level"),
        ({"codec_level": 2}, "codec_level=2"),
        ({"codec_level": None}, "codec_level=None"),
        ({"local_disk_serde": "pickle"}, "local_disk_serde='pickle'"),
        ({"local_disk_serde": True}, "local_disk_serde=True"),
        ({"remote_serde": "zstd"}, "remote_serde='zstd'"),
    ],
)
def test_config_bad_values_name_the_key(values, key):
    with pytest.raises(ConfigError, match=key.replace("(", r"\(")):
        LMTierConfig.from_dict(values)


def test_config_bad_env_value_names_the_key():
    with pytest.raises(ConfigError, match="codec_level='best'"):
        load_config(env={"LMTIER_CODEC_LEVEL": "best"})


def test_local_disk_serde_requires_codec(monkeypatch):
    import importlib.util

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ConfigError, match="local_disk_serde.*lmtier.codec"):
        LMTierConfig.from_dict({"local_disk_serde": "cachegen"})


def test_unused_codec_keys_warn(caplog):
    with caplog.at_level("WARNING", logger="lmtier.config"):
        LMTierConfig.from_dict({"codec_level": "high"})
        LMTierConfig.from_dict({"local_disk_serde": "cachegen"})
    assert "codec_level='high' but no serde is 'cachegen'" in caplog.text
    assert "local_disk_serde='cachegen' without local_disk" in caplog.text


# ------------------------------------------------------------------------------------------------
# TierManager.from_config


def _ns(**kw) -> Namespace:
    args = dict(model="m", num_layers=2, num_kv_heads=2, head_size=64, kv_dtype="bfloat16", chunk_size=16)
    args.update(kw)
    return Namespace(**args)


@pytest.mark.parametrize("level", ["lossless", "low"])
def test_manager_disk_cachegen_end_to_end(tmp_path, level):
    ns = _ns()
    assert ns.chunk_bytes == 16384
    cfg = LMTierConfig.from_dict(
        {
            "chunk_size": 16,
            "local_cpu": False,
            "local_disk": f"file://{tmp_path}",
            "max_local_disk_size": 0.01,
            "local_disk_serde": "cachegen",
            "codec_level": level,
        }
    )
    x = kv_like(seed=21)
    with TierManager.from_config(cfg, ns) as m:
        assert isinstance(m.disk, CodecTier) and m.disk.level.name == level and m.remote is None
        assert m.store(key(21), x.view(-1).view(torch.uint8)).result(30)
        assert m.lookup([key(21), key(22)]) == ["disk"]
        out = torch.empty(16384, dtype=torch.uint8)
        assert m.retrieve(key(21), out)
        assert torch.equal(out.view(torch.bfloat16).view(SHAPE), reference(x, level))
        assert m.counters["hits_disk"] == 1
    # restart: the records are found again by the same configuration
    with TierManager.from_config(cfg, ns) as m2:
        assert m2.lookup([key(21)]) == ["disk"]


def test_manager_cpu_write_back_through_codec(tmp_path):
    # CPU pool of one slot: the second store evicts the first, which is written back as a record;
    # the retrieve promotes it from disk (decoded into a CPU slot)
    ns = _ns()
    cfg = LMTierConfig.from_dict(
        {
            "chunk_size": 16,
            "max_local_cpu_size": 16384 / 2**30,
            "local_disk": f"file://{tmp_path}",
            "max_local_disk_size": 0.01,
            "local_disk_serde": "cachegen",
            "codec_level": "lossless",
        }
    )
    a, b = kv_like(seed=31), kv_like(seed=32)
    with TierManager.from_config(cfg, ns, arena=torch.empty(16384, dtype=torch.uint8)) as m:
        assert m.store(key(31), a.view(-1).view(torch.uint8)).result(30)
        assert m.store(key(32), b.view(-1).view(torch.uint8), timeout_s=None).result(30)
        assert m.lookup([key(31), key(32)]) == ["disk", "cpu"]
        out = torch.empty(16384, dtype=torch.uint8)
        assert m.retrieve(key(31), out) and torch.equal(out, a.view(-1).view(torch.uint8))


def test_manager_disk_cachegen_evictions_and_forget(tmp_path):
    """Issue 14, defect 1: with ``local_disk_serde: cachegen`` the disk tier is a CodecTier; its LRU
    evictions reach the manager's index listeners as DISK_EVICTED under the chunk keys (records
    found on disk at startup included), CPU evictions as EVICTED "disk", and ``manager.disk.forget``
    works (the old CodecTier had neither listeners nor ``forget``)."""
    from lmtier.events import IndexEvent
    from lmtier.events import IndexEventKind as E

    ns = _ns()
    xs = {i: kv_like(seed=40 + i) for i in range(8)}
    rec_bytes = {
        i: len(
            C.encode_chunk(
                xs[i].view(-1).view(torch.uint8),
                shape=SHAPE,
                dtype=torch.bfloat16,
                level=L.LEVELS["lossless"],
                tables=None,
            )
        )
        for i in range(8)
    }
    file_bytes = 4096 + -(-max(rec_bytes.values()) // 4096) * 4096
    cfg = LMTierConfig.from_dict(
        {
            "chunk_size": 16,
            "local_cpu": False,
            "local_disk": f"file://{tmp_path}",
            "max_local_disk_size": 3 * file_bytes / 2**30,
            "local_disk_serde": "cachegen",
            "codec_level": "lossless",
        }
    )
    events: list[IndexEvent] = []
    with TierManager.from_config(cfg, ns) as m:
        assert isinstance(m.disk, CodecTier)
        m.add_listener(events.append)
        for i in range(3):
            assert m.store(key(i), xs[i].view(-1).view(torch.uint8), timeout_s=None).result(30)
        assert events == [IndexEvent(E.STORED, key(i), "disk") for i in range(3)]
    events.clear()
    # A restart: the three records are found on disk; evicting them reports their chunk keys.
    with TierManager.from_config(cfg, ns) as m:
        m.add_listener(events.append)
        assert m.lookup([key(0), key(1), key(2)]) == ["disk"] * 3
        for i in (3, 4):
            assert m.store(key(i), xs[i].view(-1).view(torch.uint8), timeout_s=None).result(30)
        evicted = [e.key for e in events if e.kind == E.DISK_EVICTED]
        assert evicted == [key(0), key(1)] and all(e.tier is None for e in events if e.kind == E.DISK_EVICTED)
        assert [e for e in events if e.kind == E.STORED] == [IndexEvent(E.STORED, key(i), "disk") for i in (3, 4)]
        # forget: this process stops claiming key 2; its record stays for other processes
        assert m.disk.forget(key(2)) and not m.disk.forget(key(2))
        assert m.lookup([key(2)]) == []
        m.remove_listener(events.append)
    with TierManager.from_config(cfg, ns) as m:
        assert m.lookup([key(2), key(3), key(4)]) == ["disk"] * 3
    # With a CPU pool of one slot: the evicted chunk is written back as a record first.
    cfg2 = LMTierConfig.from_dict(
        {
            "chunk_size": 16,
            "max_local_cpu_size": 16384 / 2**30,
            "local_disk": f"file://{tmp_path}/2",
            "max_local_disk_size": 0.01,
            "local_disk_serde": "cachegen",
            "codec_level": "lossless",
        }
    )
    events.clear()
    with TierManager.from_config(cfg2, ns, arena=torch.empty(16384, dtype=torch.uint8)) as m:
        m.add_listener(events.append)
        assert m.store(key(5), xs[5].view(-1).view(torch.uint8), timeout_s=None).result(30)
        assert m.store(key(6), xs[6].view(-1).view(torch.uint8), timeout_s=None).result(30)
        assert events == [
            IndexEvent(E.STORED, key(5), "cpu"),
            IndexEvent(E.EVICTED, key(5), "disk"),
            IndexEvent(E.STORED, key(6), "cpu"),
        ]
        assert m.lookup([key(5), key(6)]) == ["disk", "cpu"]


@pytest.mark.parametrize(
    "ns_kw,values,msg",
    [
        ({"kv_dtype": "float32"}, {"local_disk_serde": "cachegen"}, "local_disk_serde='cachegen'.*float32"),
        (
            {"kv_dtype": "float32"},
            {"remote_serde": "cachegen", "remote_url": "redis://127.0.0.1:1"},
            "remote_serde='cachegen'.*float32",
        ),
        (
            {"kv_planes": 1, "num_kv_heads": 1},
            {"local_disk_serde": "cachegen", "codec_level": "lossless"},
            "kv_planes=2",
        ),
        ({"head_size": 48}, {"local_disk_serde": "cachegen"}, "power-of-two head size"),
    ],
)
def test_manager_rejects_unsupported_caches(tmp_path, ns_kw, values, msg):
    cfg = LMTierConfig.from_dict(
        {
            "chunk_size": 16,
            "local_cpu": False,
            "local_disk": f"file://{tmp_path}",
            "max_local_disk_size": 0.01,
            **values,
        }
    )
    with pytest.raises(ConfigError, match=msg):
        TierManager.from_config(cfg, _ns(**ns_kw))


def test_manager_naive_serde_unwrapped_and_lossless_odd_head(tmp_path):
    cfg = LMTierConfig.from_dict(
        {"chunk_size": 16, "local_cpu": False, "local_disk": f"file://{tmp_path}", "max_local_disk_size": 0.01}
    )
    with TierManager.from_config(cfg, _ns(kv_dtype="float32")) as m:
        assert isinstance(m.disk, DiskTier)
    cfg = LMTierConfig.from_dict(
        {
            "chunk_size": 16,
            "local_cpu": False,
            "local_disk": f"file://{tmp_path}",
            "max_local_disk_size": 0.01,
            "local_disk_serde": "cachegen",
            "codec_level": "lossless",
        }
    )
    with TierManager.from_config(cfg, _ns(head_size=48)) as m:
        assert isinstance(m.disk, CodecTier)


def test_manager_remote_cachegen(redis_server):
    cfg = LMTierConfig.from_dict(
        {"chunk_size": 16, "local_cpu": False, "remote_url": redis_server.url, "remote_serde": "cachegen"}
    )
    x = kv_like(seed=41)
    with TierManager.from_config(cfg, _ns()) as m:
        assert isinstance(m.remote, CodecTier) and m.remote.level.name == "default"
        assert m.store(key(41), x.view(-1).view(torch.uint8)).result(30)
        assert m.lookup([key(41)]) == ["remote"]
        out = torch.empty(16384, dtype=torch.uint8)
        assert m.retrieve(key(41), out)
        assert torch.equal(out.view(torch.bfloat16).view(SHAPE), reference(x, "default"))
