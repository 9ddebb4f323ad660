"""CPU smoke tests of ``lmtier bench ttft`` on the tiny preset (a 2-layer random Llama)."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("transformers")

from lmtier.bench import ttft  # noqa: E402
from lmtier.testing.redis import RedisServer, find_redis_server  # noqa: E402


def _run(tmp_path, *extra):
    out = tmp_path / "ttft.json"
    rc = ttft.main(
        [
            "--device",
            "cpu",
            "--preset",
            "tiny",
            "--chunk-tokens",
            "64",
            "--iters",
            "2",
            "--warmup",
            "1",
            "--no-redis",
            "--no-mooncake",
            "--quiet",
            "--json",
            str(out),
            *extra,
        ]
    )
    return rc, json.loads(out.read_text())


def test_smoke_bf16_cpu_and_disk(tmp_path):
    # 100 tokens: a full chunk + a 36-token tail chunk; 200: three full chunks + a tail.
    rc, res = _run(tmp_path, "--lengths", "100,200", "--disk-dir", str(tmp_path / "disk"), "--dd-bytes", str(16 << 20))
    assert rc == 0
    for k in (
        "system",
        "model",
        "geometry",
        "rows",
        "break_even",
        "ceilings",
        "tolerance",
        "checks_ok",
        "control_detected",
        "skipped",
        "copy_mode",
        "notes",
    ):
        assert k in res, k
    assert res["checks_ok"] is True
    assert [r["N"] for r in res["rows"]] == [100, 200]
    assert set(res["break_even"]) == {
        "cpu",
        "disk",
        "disk+codec",
        "disk+lossless",
        "disk+pca_high",
        "disk+pca_default",
        *(t for k in ("redis", "mooncake") for t in (k, f"{k}+codec", f"{k}+pca_high", f"{k}+pca_default")),
    }
    assert res["codec_pca_model"] is None  # no PCA level asked for
    assert res["codec_levels"] == {"disk+codec": "default", "disk+lossless": "lossless"}
    assert res["ceilings"]["disk_dd_GBs"].get("read", 0) > 0
    # the parallel O_DIRECT read ceiling (--inflight reads in flight) is measured in the same run
    assert res["ceilings"]["disk_dd_GBs"].get("read_par", 0) > 0
    assert res["ceilings"]["disk_dd_GBs"]["read_par_inflight"] == 4
    for r in res["rows"]:
        for k in (
            "recompute_ms",
            "cpu_ms",
            "cpu_pct",
            "load_ms",
            "fwd_ms",
            "disk_ms",
            "disk_pct",
            "disk_dd_GBs",
            "disk_limit_pct",
        ):
            assert isinstance(r[k], float) and r[k] > 0, (r["N"], k)
        assert r["fwd_mode"].startswith("eager")
        for tier in ("cpu", "disk", "disk+lossless"):
            c = r[f"check_{tier}"]
            assert c["kv_exact"] is True, (r["N"], tier)
            assert c["max_abs_diff"] <= ttft.RTOL * c["ref_absmax"], (r["N"], tier, c)
            assert c["cosine"] >= ttft.MIN_COS
        # disk + codec: records smaller than bf16, decoded KV bit-identical to the reference decoder
        for tag, lo, hi in (("disk+codec", 2.0, 8.0), ("disk+lossless", 1.0, 1.6)):
            assert lo < r[f"{tag}_ratio"] < hi, (r["N"], tag, r[f"{tag}_ratio"])
            assert r[f"{tag}_ms"] > 0 and r[f"{tag}_pct"] > 0
            assert r[f"{tag}_mem_ms"] > 0  # same decode with the records in pinned memory (no reads)
            assert r[f"check_{tag}"]["ok"] is True and r[f"check_{tag}"]["kv_exact"] is True, r[f"check_{tag}"]
        assert r["check_disk+codec"]["lossy"] is True
        # the read-only limit of the compressed tier: record bytes / best same-run read ceiling
        assert 0 < r["disk+codec_limit_pct"] < r["disk_limit_pct"] * 1.5 / 2.0
        assert 0 < r["check_disk+codec"]["kv_rel_err"] < 0.2
        # a wrong-index load is visible in the logits and in the KV comparison
        ctl = r["check_control_wrong_kv"]
        assert ctl["ok"] is False and ctl["kv_exact"] is False and ctl["logits_ok"] is False
    assert res["control_detected"] is True
    assert not any(k.startswith("redis_") for k in res["rows"][0])
    # the disk directory given is left in place but its tier files are gone
    assert (tmp_path / "disk").is_dir()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_graph_path_without_capture_equals_eager(tmp_path, dtype):
    # --graphs nocapture runs GraphForward's static-buffer steps (precomputed RoPE, in-place hidden
    # state, one step per layer) eagerly: the exact code the CUDA graphs capture. It must give the
    # eager lean forward's logits bit for bit, and pass the checks over loaded KV.
    rc, res = _run(tmp_path, "--lengths", "150", "--dtype", dtype, "--no-disk", "--graphs", "nocapture")
    assert rc == 0
    (r,) = res["rows"]
    assert r["fwd_mode"].startswith("static buffers")
    assert r["graph_vs_eager_maxdiff"] == 0.0
    assert r["check_cpu"]["ok"] is True and r["check_cpu"]["kv_exact"] is True
    assert r["fwd_ms"] > 0 and r["fwd_eager_ms"] > 0 and r["cpu_eager_ms"] > 0


def test_codec_only_lossless_level(tmp_path):
    # 300 tokens = 5 chunks, 2 reads in flight, a staging ring of 3
    rc, res = _run(
        tmp_path,
        "--lengths",
        "300",
        "--disk-dir",
        str(tmp_path / "d"),
        "--dd-bytes",
        str(16 << 20),
        "--codec-levels",
        "lossless",
        "--ring",
        "3",
        "--inflight",
        "2",
    )
    assert rc == 0
    (r,) = res["rows"]
    assert "disk+codec_ms" not in r and r["check_disk+lossless"]["kv_exact"] is True


def test_compare_tolerance():
    import torch

    ref = torch.linspace(-5, 5, 1000)
    kv = torch.zeros(4)
    # bf16-like drift: a few % of the absmax spread over the logits passes
    noisy = ref + 0.06 * 5 * torch.sin(torch.arange(1000.0))
    c = ttft.compare(ref, noisy, kv, kv.clone())
    assert c["logits_ok"] and c["kv_exact"] and c["ok"]
    # same logits but a KV that differs in one element: the hard guard fails it
    kv2 = kv.clone()
    kv2[1] = 1e-3
    assert ttft.compare(ref, ref, kv, kv2)["ok"] is False
    # a different direction (cosine < MIN_COS) fails even within the max-abs bound
    c = ttft.compare(ref, ref + 0.09 * 5 * torch.sign(torch.randn(1000, generator=torch.Generator().manual_seed(0))))
    assert c["cosine"] < ttft.MIN_COS and c["logits_ok"] is False
    assert ttft.compare(ref, ref * float("nan"))["ok"] is False


def test_lean_forward_matches_recompute_fp32(tmp_path):
    # In float32 the lean last-token forward over loaded KV equals transformers' full prefill closely:
    # this pins the forward's math (RoPE position, GQA grouping, scaling), not just the load.
    rc, res = _run(tmp_path, "--lengths", "150", "--dtype", "float32", "--no-disk", "--compare-layouts")
    assert rc == 0
    (r,) = res["rows"]
    c = r["check_cpu"]
    assert c["kv_exact"] is True
    assert c["max_abs_diff"] <= 1e-4 * max(1.0, c["ref_absmax"]), c
    assert r["fwd_contig_ms"] > 0 and r["transpose_ms"] > 0
    assert "disk_ms" not in r


def test_break_even():
    rows = [
        {"N": 1024, "recompute_ms": 30.0, "cpu_ms": 31.0, "disk_ms": 500.0},
        {"N": 2048, "recompute_ms": 60.0, "cpu_ms": 20.0, "disk_ms": 900.0},
    ]
    assert ttft.break_even(rows, "cpu") == 2048
    assert ttft.break_even(rows, "disk") is None
    assert ttft.break_even(rows, "redis") is None


def test_cli_dispatch(tmp_path, capsys):
    from lmtier import cli

    out = tmp_path / "t.json"
    rc = cli.main(
        [
            "bench",
            "ttft",
            "--device",
            "cpu",
            "--preset",
            "tiny",
            "--lengths",
            "70",
            "--chunk-tokens",
            "64",
            "--iters",
            "1",
            "--warmup",
            "0",
            "--no-disk",
            "--no-redis",
            "--no-mooncake",
            "--quiet",
            "--json",
            str(out),
        ]
    )
    assert rc == 0
    assert json.loads(out.read_text())["rows"][0]["N"] == 70
    assert "break-even cpu" in capsys.readouterr().out


def _remote_rows_ok(res, kind="redis"):
    assert res["checks_ok"] is True
    (r,) = res["rows"]
    for tag in (kind, f"{kind}+codec"):
        assert r[f"{tag}_ms"] > 0 and r[f"{tag}_pct"] > 0, tag
        assert r[f"check_{tag}"]["kv_exact"] is True, (tag, r[f"check_{tag}"])
    assert 2.0 < r[f"{kind}+codec_ratio"] < 8.0
    assert r[f"check_{kind}+codec"]["lossy"] is True
    assert f"{kind}+codec_mem_ms" not in r  # the in-memory split is measured once, on the disk tier


def test_mooncake_tiers_private_cluster(tmp_path):
    """The Mooncake Store tiers (plain and codec) through the product path, against a private
    master and store server the bench starts (Mooncake required in CI: LMTIER_REQUIRE_MOONCAKE)."""
    from lmtier.testing.mooncake import mooncake_client_importable, skip_or_fail

    why = mooncake_client_importable()
    if why is not None:
        skip_or_fail(f"the mooncake client cannot be imported ({why})")
    out = tmp_path / "t.json"
    args = ["--device", "cpu", "--preset", "tiny", "--chunk-tokens", "64", "--iters", "1", "--warmup", "1"]
    args += ["--lengths", "150", "--no-disk", "--no-redis", "--codec-levels", "default", "--quiet"]
    assert ttft.main([*args, "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    _remote_rows_ok(res, "mooncake")
    assert not any(k.startswith("redis") for k in res["rows"][0])
    assert any("mooncake: private mooncake_master" in line for line in res["notes"])


def _redis_bench(tmp_path, *extra, preset_flag="--preset"):
    """``lmtier bench ttft`` with the Redis tiers (plain and codec) on the tiny preset, one length,
    ``extra`` naming the server; returns the JSON results after :func:`_remote_rows_ok`."""
    out = tmp_path / "t.json"
    args = ["--device", "cpu", preset_flag, "tiny", "--chunk-tokens", "64", "--iters", "1", "--warmup", "1"]
    args += ["--lengths", "150", "--disk-dir", str(tmp_path / "d"), "--dd-bytes", str(16 << 20)]
    args += ["--codec-levels", "default", *extra, "--quiet", "--no-mooncake", "--json", str(out)]
    assert ttft.main(args) == 0
    res = json.loads(out.read_text())
    _remote_rows_ok(res)
    return res


def _redis_server_binary() -> str:
    import shutil

    binary = shutil.which("redis-server") or find_redis_server()
    if binary is None:
        pytest.skip("no redis-server")
    return binary


def test_redis_tiers_private_server(tmp_path, monkeypatch):
    monkeypatch.setenv("LMTIER_REDIS_SERVER", _redis_server_binary())
    res = _redis_bench(tmp_path)
    assert any("private redis-server" in line for line in res["notes"])


def test_redis_tiers_given_url(tmp_path):
    proc = RedisServer(binary=_redis_server_binary(), maxmemory=256 << 20).start()
    try:
        res = _redis_bench(tmp_path, "--redis-url", proc.url, preset_flag="--model-preset")
        assert any(f"server on {proc.url}" in line for line in res["notes"])
    finally:
        proc.close()


def test_bundled_redis_server_runs(tmp_path):
    # scripts/bundle_redis.sh packs redis-server with its loader and libraries into .whl/redis for the
    # GPU machine; when the bundle exists here, it must start and answer through RedisTier.
    import os

    bundled = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), ".whl", "redis", "redis-server")
    if not os.access(bundled, os.X_OK):
        pytest.skip("no bundle (run scripts/bundle_redis.sh)")
    from lmtier.tiers.redis import RedisTier

    proc = RedisServer(binary=bundled, maxmemory=64 << 20).start()
    try:
        t = RedisTier(proc.url, timeout_s=5.0, connect_timeout_s=2.0)
        key = bytes(range(32))
        assert t.put(key, b"x" * 100_000)
        buf = bytearray(100_000)
        assert t.get_into(key, buf) == 100_000 and bytes(buf) == b"x" * 100_000
        t.close()
    finally:
        proc.close()


def test_unknown_preset_is_a_clear_error(capsys):
    with pytest.raises(SystemExit):
        ttft.main(["--device", "cpu", "--model-preset", "deepseek-v3-mla", "--lengths", "64"])
    assert "builds a Llama-shaped transformers model" in capsys.readouterr().err


def test_codec_static_tables_calibrated_saved_and_per_stream(tmp_path):
    # default --codec-tables calibrate: static tables fitted on other input of the same model; the
    # chunks of N = 150 (2 x 64 and the 22-token tail, stored zero-padded to 64 tokens like every
    # chunk a tier holds) are coded with them; decode
    # through the static set is bit-exact vs the reference decoder. A PATH saves them; a second run
    # loads them (same table set id, same record bytes); 'none' gives per-stream records only.
    common = [
        "--lengths",
        "150",
        "--disk-dir",
        str(tmp_path / "d"),
        "--dd-bytes",
        str(16 << 20),
        "--codec-levels",
        "default,lossless",
    ]
    path = tmp_path / "tables.npz"
    rc, res = _run(tmp_path, *common, "--codec-tables", str(path), "--codec-calib-tokens", "512")
    assert rc == 0 and res["checks_ok"] is True
    info = res["codec_tables"]
    lv = info["levels"]["default"]
    assert info["calib_seed"] == ttft.CALIB_SEED != 1234 and info["calib_tokens"] == 512
    assert info["channels_per_table"] == 1 and lv["source"] == "calibrated"
    assert lv["num_tables"] == 2 * 2 * 2 * 16 + 2 * 2  # (layer, K/V, head, channel) + (layer, K/V) scale tables
    (r,) = res["rows"]
    assert r["disk+codec_static_records"] == 3 and r["disk+lossless_static_records"] == 0
    assert r["check_disk+codec"]["kv_exact"] is True and r["check_disk+lossless"]["kv_exact"] is True
    assert 2.0 < r["disk+codec_ratio"] < 8.0
    assert path.exists()
    rc, res2 = _run(tmp_path, *common, "--codec-tables", str(path))
    assert rc == 0 and res2["checks_ok"] is True
    assert res2["codec_tables"]["levels"]["default"]["source"] == "file"
    assert res2["codec_tables"]["levels"]["default"]["table_id"] == lv["table_id"]
    assert res2["rows"][0]["disk+codec_MB"] == r["disk+codec_MB"]
    assert res2["rows"][0]["check_disk+codec"]["kv_exact"] is True
    rc, res3 = _run(tmp_path, *common, "--codec-tables", "none")
    assert rc == 0 and res3["codec_tables"] is None
    (r3,) = res3["rows"]
    assert r3["disk+codec_static_records"] == 0 and r3["check_disk+codec"]["kv_exact"] is True
    assert r3["disk+codec_MB"] != r["disk+codec_MB"]


def test_codec_tables_file_of_other_geometry_is_refused(tmp_path):
    import numpy as np

    from lmtier.codec import calibrate as ccal

    path = tmp_path / "other.npz"
    ccal.save(
        path,
        {
            "default": {
                "sym": np.zeros((1, 1), np.uint16),
                "scale": np.zeros((2, 256), np.uint16),
                "geometry": np.asarray([30, 3, 64], np.int64),
            }
        },
    )
    with pytest.raises(SystemExit, match="geometry"):
        _run(
            tmp_path,
            "--lengths",
            "70",
            "--disk-dir",
            str(tmp_path / "d"),
            "--dd-bytes",
            str(16 << 20),
            "--codec-levels",
            "default",
            "--codec-tables",
            str(path),
        )


def test_timed_paths_are_the_products(tmp_path, monkeypatch):
    # issue 14: the TTFT figures came from the bench's own copy/decode pipeline, which never called
    # TierManager, the tiers' codec or lmtier's copy ops. Every load must now go through them, driven
    # by the vLLM connector's data path (ConnectorWorker: load_layerwise + wait_layer per layer +
    # finish_layerwise; load for load_ms): the tiers built by TierManager.from_config, CPU-pool hits
    # pinned in the pool, disk hits through TierManager.fetch_lower_many, codec records through
    # lmtier.tiers.codec.CodecTier, the KV into the paged cache by lmtier.ops.scatter (CUDA:
    # CudaTransferEngine.load_layerwise).
    import collections

    from lmtier import ops
    from lmtier.integration.vllm.worker import ConnectorWorker
    from lmtier.manager import TierManager
    from lmtier.tiers.codec import CodecTier
    from lmtier.tiers.cpu import CPUPool

    calls = collections.Counter()

    def spy(owner, name, tag):
        orig = getattr(owner, name)

        def wrapper(*a, **k):
            calls[tag] += 1
            return orig(*a, **k)

        monkeypatch.setattr(owner, name, wrapper)

    spy(TierManager, "from_config", "from_config")
    spy(TierManager, "fetch_lower_many", "fetch_lower")
    spy(CPUPool, "acquire", "pool_acquire")
    spy(CodecTier, "get_many_into", "codec_get_into")
    spy(CodecTier, "put", "codec_put")
    spy(ops, "scatter", "scatter")
    spy(ConnectorWorker, "load_layerwise", "worker_load_layerwise")
    spy(ConnectorWorker, "wait_layer", "worker_wait_layer")
    spy(ConnectorWorker, "finish_layerwise", "worker_finish_layerwise")
    spy(ConnectorWorker, "load", "worker_load")
    rc, res = _run(
        tmp_path,
        "--lengths",
        "150",
        "--disk-dir",
        str(tmp_path / "d"),
        "--dd-bytes",
        str(16 << 20),
        "--codec-levels",
        "default",
    )
    assert rc == 0 and res["checks_ok"] is True
    # cpu, disk, disk+codec managers (+ none for Redis: --no-redis)
    assert calls["from_config"] == 3
    C = 3  # 150 tokens = 2 x 64 + a 22-token tail
    # loads: cpu = 1 check + (1 warm-up + 2 timed) TTFT + (1 + 2) load alone; disk, disk+codec and the
    # codec's in-memory variant = 1 check + 2 timed each (their warm-ups are 0 here)
    assert calls["pool_acquire"] >= 7 * C
    assert calls["fetch_lower"] >= 3 * 3 * C
    assert calls["codec_put"] == 2 * C  # the disk tier and the in-memory (no reads) variant
    assert calls["codec_get_into"] >= 2 * 3 * C
    assert calls["scatter"] >= 7 + 3 * 3
    # the connector worker drives every timed load: cpu 1 check + 3 TTFT, disk, disk+codec and the
    # in-memory codec 3 each, layer by layer with the forward waiting for every layer; 3 loads alone
    assert calls["worker_load_layerwise"] == 4 + 3 * 3 and calls["worker_load"] == 3
    assert calls["worker_finish_layerwise"] >= calls["worker_load_layerwise"]
    assert calls["worker_wait_layer"] == calls["worker_load_layerwise"] * res["geometry"]["num_layers"]
    assert "ConnectorWorker" in res["load_path"]["worker"]
    lp = res["load_path"]
    assert lp["tiers"] == "lmtier.manager.TierManager.from_config" and lp["codec"] == "lmtier.tiers.codec.CodecTier"
    assert res["copy_mode"] == "lmtier.ops.scatter (CPU)"


def test_shipped_tables_through_the_config(tmp_path):
    # --codec-tables shipped: local_disk_serde cachegen straight through the config (the product's
    # default tables; the tiny geometry has none shipped: per-stream records)
    rc, res = _run(
        tmp_path,
        "--lengths",
        "70",
        "--disk-dir",
        str(tmp_path / "d"),
        "--dd-bytes",
        str(16 << 20),
        "--codec-levels",
        "default",
        "--codec-tables",
        "shipped",
    )
    assert rc == 0 and res["checks_ok"] is True and res["codec_tables"] is None
    (r,) = res["rows"]
    assert r["disk+codec_static_records"] == 0 and r["check_disk+codec"]["kv_exact"] is True


@pytest.mark.parametrize("n,block", [(1, 16), (63, 16), (64, 16), (150, 16), (150, 64)])
def test_paged_kv_views_read_what_the_product_writes(n, block):
    # the lean forward's K/V views over the paged cache must see exactly the canonical chunks that
    # lmtier.ops.scatter writes through the cache's KVLayout (K and V side by side per token row);
    # tokens at or past N (the tail chunk's padding) are never written
    import torch

    from lmtier import ops
    from lmtier.bench.ttft.pipeline import PagedKV, chunk_spans

    L, H, D, T = 2, 3, 8, 64
    kv = PagedKV(
        num_layers=L,
        num_heads=H,
        head_size=D,
        num_tokens=n,
        block_size=block,
        dtype=torch.float32,
        device=torch.device("cpu"),
    )
    kv.buf.fill_(float("nan"))
    ref = torch.randn(L, 2, n, H, D)
    chunks = []
    for s, tc in chunk_spans(n, T):
        c = torch.zeros(L, 2, T, H, D)
        c[:, :, :tc] = ref[:, :, s : s + tc]
        chunks.append(c.reshape(-1).view(torch.uint8))
    ops.scatter(kv.layout, kv.slot_mapping(T), chunks)
    assert torch.equal(kv.canonical(), ref)
    for l in range(L):
        assert torch.equal(kv.k_of(l)[0, :, :n], ref[l, 0].transpose(0, 1))
        assert torch.equal(kv.v_of(l)[0, :, :n], ref[l, 1].transpose(0, 1))
        assert kv.k_of(l).shape == (1, H, n + 1, D)
        assert torch.isnan(kv.k_of(l)[0, :, n]).all() and torch.isnan(kv.new_v(l)).all()
    assert torch.isnan(kv.region[:, n:]).all()


# ---- PCA codec levels (codec_level: pca_*, codec_pca_model) ---------------------------------------


def _pca_spies(monkeypatch):
    """Spies on lmtier.codec.pca.encode and lmtier.codec.pca.codec.decode_queued (every decode: the PCA
    tier's and, through lmtier.codec.pca.decode, the bench guard's) and on PCACodecTier.get_many_into;
    returns ``(records by (start, level), counters)``."""
    import collections

    from lmtier.codec import pca
    from lmtier.codec.pca import codec as pca_codec
    from lmtier.tiers.codec_pca import PCACodecTier

    records = collections.defaultdict(set)
    calls = collections.Counter()
    enc, dec, get = pca.encode, pca_codec.decode_queued, PCACodecTier.get_many_into

    def encode(chunk, *, start, model, level, **kw):
        rec = enc(chunk, start=start, model=model, level=level, **kw)
        records[(start, getattr(level, "name", level))].add(bytes(rec))
        return rec

    def decode(*a, **k):
        calls["decode"] += 1
        return dec(*a, **k)

    def get_many_into(self, keys, outs, **k):
        got = get(self, keys, outs, **k)
        calls["hits"] += sum(n is not None for n in got)
        calls["misses"] += sum(n is None for n in got)
        return got

    monkeypatch.setattr(pca, "encode", encode)
    monkeypatch.setattr(pca_codec, "decode_queued", decode)
    monkeypatch.setattr(PCACodecTier, "get_many_into", get_many_into)
    return records, calls


def _pca_row_ok(r, tag, chunks):
    assert r[f"{tag}_ms"] > 0 and r[f"{tag}_pct"] > 0, r.get(f"{tag}_error")
    c = r[f"check_{tag}"]
    # the hard guard: the loaded KV equals lmtier.codec.pca.decode of the records, bit for bit
    assert c["ok"] is True and c["kv_exact"] is True and c["lossy"] is True, c
    assert 0 < c["kv_rel_err"] < 0.5
    assert r[f"{tag}_ratio"] > 1.5
    assert f"{tag}_static_records" not in r  # a CacheGen notion (the PCA tables are in the model file)


def _pca_records_agree(records, chunks, chunk_tokens, levels):
    # every encode of a chunk at its position (the tier's store, the in-memory variant's, the
    # guard's) gave the same record: the guard decodes exactly the bytes the tier stored
    assert {k for k in records} == {(c * chunk_tokens, lv) for c in range(chunks) for lv in levels}
    assert all(len(v) == 1 for v in records.values()), {k: len(v) for k, v in records.items()}


def _run_disk_pca(tmp_path, *extra):
    """:func:`_run` of 150 tokens on the disk tier at ``default`` and ``pca_default``."""
    disk = ["--disk-dir", str(tmp_path / "d"), "--dd-bytes", str(16 << 20)]
    return _run(tmp_path, "--lengths", "150", *disk, "--codec-levels", "default,pca_default", *extra)


def test_pca_level_model_fitted_by_the_bench(tmp_path, monkeypatch):
    # no --codec-pca-model: the bench fits one, untimed, on the KV of other token ids than the
    # measured prompt's (tiny: L=2, H=2, D=16 -> G=2, N=64 -> 16 x 64 = 1,024 tokens = 16 chunks of
    # 64), with the model's rotary frequencies; the disk+pca_default tier is a PCACodecTier built by
    # from_config from codec_level + codec_pca_model, its loads are hits, its KV the reference decoder's
    from lmtier.codec import pca

    prefills, fit = [], pca.fit

    def spy_fit(kvs, starts, **kw):
        prefills.append((len(kvs), list(starts)))
        return fit(kvs, starts, **kw)

    monkeypatch.setattr(pca, "fit", spy_fit)
    records, calls = _pca_spies(monkeypatch)
    rc, res = _run_disk_pca(tmp_path)
    assert rc == 0 and res["checks_ok"] is True
    (r,) = res["rows"]
    _pca_row_ok(r, "disk+pca_default", 3)
    assert r["disk+pca_default_mem_ms"] > 0
    assert r["check_disk+codec"]["kv_exact"] is True  # the CacheGen level beside it, unchanged
    _pca_records_agree(records, 3, 64, ["pca_default"])
    # loads: 1 check + 2 timed from the disk, 1 + 2 from memory, 3 chunks each: all hits
    assert calls["hits"] >= 6 * 3 and calls["misses"] == 0
    assert calls["decode"] >= calls["hits"] + 2 * 3  # the tier's decodes and the guard's (2 checks)
    info = res["codec_pca_model"]
    assert info["source"] == "fitted" and info["path"] is None
    assert info["what"].startswith("fitted by the bench on 1024 tokens of the prefill KV of other random token ids")
    assert "seed 4321, not the measured prompt" in info["what"] and "16 per value of N" in info["what"]
    assert info["tokens"] == 1024 and info["chunks"] == 16 and info["layer_group"] == 2
    assert prefills == [(16, list(range(0, 1024, 64)))]
    assert info["rope"].startswith("undone") and set(info["levels"]) == {"pca_high", "pca_default"}
    assert any(line.startswith("PCA model (codec_pca_model): fitted by the bench") for line in res["notes"])
    assert res["codec_levels"] == {"disk+codec": "default", "disk+pca_default": "pca_default"}
    lp = res["load_path"]
    assert lp["codec_tiers"] == {
        "disk+codec": "lmtier.tiers.codec.CodecTier",
        "disk+pca_default": "lmtier.tiers.codec_pca.PCACodecTier",
    }
    assert lp["codec"] == "lmtier.tiers.codec.CodecTier, lmtier.tiers.codec_pca.PCACodecTier"
    assert res["break_even"]["disk+pca_default"] in (None, 150)


def test_pca_fit_tokens_option(tmp_path):
    # --codec-pca-fit-tokens: the calibration prompt's tokens, cut to whole chunks; below 2 x N the
    # fit is refused (the calibrate command's floor) and the PCA tier skipped with the reason
    rc, res = _run_disk_pca(tmp_path, "--codec-pca-fit-tokens", "200")
    assert rc == 0 and res["checks_ok"] is True
    info = res["codec_pca_model"]
    assert info["tokens"] == 192 and info["chunks"] == 3 and "3 per value of N" in info["what"]
    _pca_row_ok(res["rows"][0], "disk+pca_default", 3)
    (tmp_path / "b").mkdir()
    rc, res = _run_disk_pca(tmp_path / "b", "--codec-pca-fit-tokens", "100")
    assert rc == 0 and res["codec_pca_model"]["error"].startswith("a fit needs at least 2 x N = 128 tokens")
    assert "this one would have 64" in res["codec_pca_model"]["error"]
    assert not any(k.startswith("disk+pca") for k in res["rows"][0])


def _fit_file(path, geometry=None, levels=None, *, tokens=256):
    """A PCA model file: fitted as a user would (``python -m lmtier.codec.pca``) on the tiny preset's
    KV of other token ids, RoPE undone; with ``geometry`` (``(L, H, D)``) on random KV, RoPE kept."""
    import torch

    from lmtier.bench.ttft.model import build_model, prefix_kv
    from lmtier.codec import pca
    from lmtier.codec.pca.hf import rotary_inv_freq

    gen = torch.Generator().manual_seed(5)
    if geometry is None:
        model, _ = build_model("tiny", None, torch.device("cpu"), torch.bfloat16)
        ids = torch.randint(0, model.config.vocab_size, (1, tokens), generator=gen)
        kv, inv_freq = prefix_kv(model, ids, tokens, model.config.num_hidden_layers), rotary_inv_freq(model)
    else:
        nl, h, d = geometry
        kv, inv_freq = torch.randn(nl, 2, tokens, h, d, generator=gen).to(torch.bfloat16), None
    kw = {} if levels is None else {"levels": [pca.PCA_LEVELS[lv] for lv in levels]}
    m = pca.fit([kv], [0], inv_freq=inv_freq, layer_group=kv.shape[0], name="test", **kw)
    pca.save(m, path)
    return m


def test_pca_levels_with_a_given_model_file(tmp_path, monkeypatch):
    path = tmp_path / "m.lmtpca"
    model = _fit_file(path)
    records, calls = _pca_spies(monkeypatch)
    rc, res = _run(
        tmp_path,
        "--lengths",
        "100",
        "--disk-dir",
        str(tmp_path / "d"),
        "--dd-bytes",
        str(16 << 20),
        "--codec-levels",
        "pca_high,pca_default",
        "--codec-pca-model",
        str(path),
    )
    assert rc == 0 and res["checks_ok"] is True
    (r,) = res["rows"]
    for tag in ("disk+pca_high", "disk+pca_default"):
        _pca_row_ok(r, tag, 2)
    assert r["disk+pca_high_ratio"] < r["disk+pca_default_ratio"]
    _pca_records_agree(records, 2, 64, ["pca_high", "pca_default"])
    assert calls["misses"] == 0
    info = res["codec_pca_model"]
    assert info["source"] == "given" and info["path"] == str(path) and info["what"] == f"given: {path}"
    assert info["model_id"] == f"{model.model_id:#010x}" and info["rope"] == "undone"
    assert res["codec_tables"] is None  # no CacheGen level: no tables calibrated
    assert "disk" in res["break_even"] and r["disk_ms"] > 0


@pytest.mark.parametrize("bad", ["not_a_model", "other_geometry", "lacks_level"])
def test_pca_level_with_an_unusable_model_file_is_skipped(tmp_path, bad):
    # the product refuses the file when the tier is built (ConfigError naming codec_pca_model): the
    # tier is skipped with the reason printed, like other unavailable tiers; the others still run
    path = tmp_path / "m.lmtpca"
    if bad == "not_a_model":
        path.write_bytes(b"not a PCA model file" * 10)
        why = "not a usable PCA model file"
    elif bad == "other_geometry":
        _fit_file(path, geometry=(2, 1, 16))
        why = "calibrated for L=2 layers, H=1 KV heads"
    else:
        _fit_file(path, levels=["pca_high"])
        why = "has no level 'pca_default'"
    rc, res = _run(
        tmp_path,
        "--lengths",
        "70",
        "--disk-dir",
        str(tmp_path / "d"),
        "--dd-bytes",
        str(16 << 20),
        "--codec-levels",
        "pca_default",
        "--codec-pca-model",
        str(path),
    )
    assert rc == 0 and res["checks_ok"] is True
    (r,) = res["rows"]
    assert not any(k.startswith("disk+pca") or k.startswith("check_disk+pca") for k in r)
    assert r["disk_ms"] > 0 and res["codec_levels"] == {}
    (line,) = [x for x in res["notes"] if x.startswith("disk+pca_default (pca_default): skipped")]
    assert "ConfigError" in line and "codec_pca_model" in line and why in line, line
    assert (res["codec_pca_model"].get("error") is not None) == (bad == "not_a_model")


def test_pca_model_option_errors(tmp_path, capsys):
    common = ["--device", "cpu", "--preset", "tiny", "--lengths", "70", "--no-redis", "--no-mooncake"]
    with pytest.raises(SystemExit) as e:
        ttft.main([*common, "--codec-levels", "pca_default", "--codec-pca-model", str(tmp_path / "missing")])
    assert e.value.code == 2 and "not a readable file" in capsys.readouterr().err
    path = tmp_path / "m.lmtpca"
    path.write_bytes(b"x")
    with pytest.raises(SystemExit) as e:
        ttft.main([*common, "--codec-levels", "default", "--codec-pca-model", str(path)])
    assert e.value.code == 2 and "no PCA level" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        ttft.main([*common, "--codec-levels", "pca_low"])
    assert e.value.code == 2 and "'pca_low' is not one" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        ttft.main(
            [*common, "--codec-levels", "pca_default", "--codec-pca-model", str(path), "--codec-pca-fit-tokens", "9"]
        )
    assert e.value.code == 2 and "fits no PCA model file when --codec-pca-model" in capsys.readouterr().err


def test_pca_level_on_the_redis_tier(tmp_path, monkeypatch):
    # redis+pca_default: the Redis tier at a PCA level (remote_serde cachegen + codec_pca_model),
    # the fitted model shared with disk+pca_default; positions reach the remote tier's puts too
    monkeypatch.setenv("LMTIER_REDIS_SERVER", _redis_server_binary())
    records, calls = _pca_spies(monkeypatch)
    out = tmp_path / "t.json"
    args = ["--device", "cpu", "--preset", "tiny", "--chunk-tokens", "64", "--iters", "1", "--warmup", "1"]
    args += ["--lengths", "150", "--disk-dir", str(tmp_path / "d"), "--dd-bytes", str(16 << 20)]
    args += ["--codec-levels", "pca_default", "--quiet", "--no-mooncake", "--json", str(out)]
    assert ttft.main(args) == 0
    res = json.loads(out.read_text())
    assert res["checks_ok"] is True
    (r,) = res["rows"]
    for tag in ("disk+pca_default", "redis+pca_default"):
        _pca_row_ok(r, tag, 3)
    assert "redis+codec_ms" not in r and r["redis_ms"] > 0  # no CacheGen level asked for
    assert "redis+pca_default_mem_ms" not in r  # the in-memory split is measured once, on the disk tier
    assert res["load_path"]["codec_tiers"]["redis+pca_default"] == "lmtier.tiers.codec_pca.PCACodecTier"
    _pca_records_agree(records, 3, 64, ["pca_default"])
    assert calls["misses"] == 0
    agree = r["check_records_pca_default"]
    assert agree["ok"] is True and set(agree["MB"]) == {"disk+pca_default", "redis+pca_default"}
    assert agree["MB"]["disk+pca_default"] == agree["MB"]["redis+pca_default"] == r["disk+pca_default_MB"] > 0


def test_tiers_storing_other_record_bytes_fail_the_checks():
    """Tiers of one codec level whose stored record totals differ (one stored records of other,
    valid bytes: RESULTS §4.1t) give a failing ``check_records_<level>``, which fails the run's
    checks; a level on one tier only gives none."""
    from types import SimpleNamespace

    from lmtier.bench.ttft.bench import Bench

    b = SimpleNamespace(codec_levels={"disk+pca_default": "pca_default", "redis+pca_default": "pca_default",
                                      "disk+codec": "default"})  # fmt: skip
    row = {"disk+pca_default_MB": 272.980376, "redis+pca_default_MB": 272.971468, "disk+codec_MB": 175.0}
    Bench._check_records_agree(b, row)
    assert row["check_records_pca_default"] == {
        "ok": False,
        "MB": {"disk+pca_default": 272.980376, "redis+pca_default": 272.971468},
    }
    assert "check_records_codec" not in row
    row["redis+pca_default_MB"] = 272.980376
    Bench._check_records_agree(b, row)
    assert row["check_records_pca_default"]["ok"] is True


def test_kv_spectrum_trained_concentrates_the_kv_energy_as_measured(tmp_path):
    """``--kv-spectrum trained``: each layer's k_proj / v_proj of the random model gets singular values
    ``i**(-alpha / 2)`` (TRAINED_KV_ALPHA) at its Frobenius norm, so the KV of random tokens follows the
    power law: its top components hold far more energy than the random model's (near isotropic)."""
    import torch

    from lmtier.bench.ttft.model import TRAINED_KV_ALPHA, build_model

    def top_share(model, kind: str) -> float:
        """Energy share of the top eighth of the components of layer 1's K or V outputs."""
        got = []
        proj = getattr(model.model.layers[1].self_attn, f"{kind}_proj")
        hook = proj.register_forward_hook(lambda mod, i, o: got.append(o[0].float()))
        with torch.no_grad():
            model(torch.randint(0, model.config.vocab_size, (1, 1024), generator=torch.Generator().manual_seed(3)))
        hook.remove()
        x = got[0] - got[0].mean(0)
        ev = torch.linalg.eigvalsh(x.T @ x).flip(0)
        return float(ev[: max(1, ev.numel() // 8)].sum() / ev.sum())

    dev, dt = torch.device("cpu"), torch.float32
    plain, name = build_model("smollm2-135m", None, dev, dt)
    shaped, shaped_name = build_model("smollm2-135m", None, dev, dt, kv_spectrum="trained")
    assert "K/V spectra of a trained model's" in shaped_name and "K/V" not in name
    shares = {}
    for kind in ("k", "v"):
        w0 = getattr(plain.model.layers[1].self_attn, f"{kind}_proj").weight
        w1 = getattr(shaped.model.layers[1].self_attn, f"{kind}_proj").weight
        assert torch.allclose(w0.norm(), w1.norm(), rtol=1e-4)
        sv = torch.linalg.svdvals(w1.double())
        want = torch.arange(1, sv.numel() + 1, dtype=torch.float64) ** (-TRAINED_KV_ALPHA[kind] / 2)
        assert torch.allclose(sv / sv[0], want / want[0], rtol=1e-3)
        # SmolLM2's own KV: 73 % (K) and 53 % (V) of the energy in the top eighth
        shares[kind] = top_share(plain, kind), top_share(shaped, kind)
    assert shares["k"][0] < 0.45 and shares["k"][1] > 0.65 and shares["v"][0] < 0.45 and shares["v"][1] > 0.45
    with pytest.raises(ValueError, match="a local model keeps its own"):
        build_model("tiny", str(tmp_path), dev, dt, kv_spectrum="trained")
    with pytest.raises(ValueError, match="kv_spectrum must be"):
        build_model("tiny", None, dev, dt, kv_spectrum="flat")


def test_kv_spectrum_option_runs_and_is_reported(tmp_path, capsys):
    # with the disk tier at both codec kinds: the PCA level's fit and checks on the reshaped KV
    rc, res = _run_disk_pca(tmp_path, "--kv-spectrum", "trained")
    assert rc == 0 and res["checks_ok"] is True and res["kv_spectrum"] == "trained"
    (r,) = res["rows"]
    assert r["check_disk+pca_default"]["kv_exact"] is True and r["check_disk+codec"]["kv_exact"] is True
    assert res["model"].endswith("(random weights, K/V spectra of a trained model's)")
    with pytest.raises(SystemExit):
        ttft.main(["--device", "cpu", "--model", str(tmp_path), "--kv-spectrum", "trained"])
    assert "a --model keeps its own weights" in capsys.readouterr().err
