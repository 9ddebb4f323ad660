"""One ``lmtier bench ttft`` run: :func:`run` sets up the tiers and the same-run ceilings, runs
every length through :class:`lmtier.bench.ttft.bench.Bench` and returns the JSON result."""

import os
import shutil
import tempfile
import time

import torch

from lmtier.bench.common import progress, system_header
from lmtier.bench.ttft.bench import Bench
from lmtier.bench.ttft.ceilings import (
    dd_read_gbps,
    default_disk_dir,
    drop_caches,
    fs_type,
    h2d_gbps,
    odirect_supported,
    redis_raw_gbps,
)
from lmtier.bench.ttft.model import prefix_kv
from lmtier.bench.ttft.pca_model import pca_model_file
from lmtier.bench.ttft.pipeline import build_manager
from lmtier.bench.ttft.report import MIN_COS, REMOTE_CODEC_LEVELS, REMOTE_KINDS, RTOL, TIERS, break_even, codec_tag
from lmtier.bench.ttft.tables import codec_tables
from lmtier.codec.pca import PCA_LEVELS
from lmtier.memory import HostBuffer
from lmtier.testing.redis import RedisServer, find_redis_server
from lmtier.tiers.buffers import round_up

__all__ = ["run"]


def _setup_disk(b: Bench, args, say) -> tuple[str | None, str | None, dict, list]:
    """The disk tiers (plain and per codec level) under one temp dir, and the disk ceilings."""
    levels = list(args.codec_levels)
    if args.no_disk:
        say("disk tier: skipped (--no-disk)")
        say("disk+codec: skipped (no disk tier)")
        return None, None, {}, levels
    disk_dir = args.disk_dir or default_disk_dir()
    os.makedirs(disk_dir, exist_ok=True)
    root = tempfile.mkdtemp(prefix="tier-", dir=disk_dir)
    os.makedirs(os.path.join(root, "disk"))
    b.managers["disk"] = build_manager(
        chunk_tokens=b.T,
        namespace=b.ns,
        disk_dir=os.path.join(root, "disk"),
        disk_bytes=b._disk_bytes(),
        io_threads=args.disk_threads,
    )
    b.disk_odirect = odirect = odirect_supported(root)
    host_bytes = b.max_chunks * round_up(b.chunk_bytes)
    dd = dd_read_gbps(disk_dir, max(16 << 20, min(args.dd_bytes, host_bytes)), inflight=args.inflight)
    b.disk_par_bw = dd.get("read_par")
    why = drop_caches()
    say(
        f"disk tier: {disk_dir} ({fs_type(disk_dir)}), O_DIRECT {'on' if odirect else 'OFF (unsupported here)'}, "
        f"disk_io_threads {args.disk_threads}, {args.inflight} chunk reads in flight (manager.fetch_lower_many); "
        "dd O_DIRECT 16 MiB: "
        + (
            f"read {dd['read']:.2f} GB/s, write {dd['write']:.2f} GB/s"
            if "read" in dd
            else f"failed ({dd.get('error')})"
        )
        + (f"; O_DIRECT {args.inflight} x 8 MiB reads in flight: {dd['read_par']:.2f} GB/s" if "read_par" in dd else "")
        + ("" if why is None else f"; page cache can NOT be dropped ({why})")
        + (
            "; O_DIRECT reads bypass the page cache (dropped once per tier and N)"
            if odirect
            else "; page cache dropped before every load"
        )
    )
    if not levels:
        say("disk+codec: skipped (--codec-levels '')")
    return disk_dir, root, dd, levels


def _probe(m, what: str) -> None:
    """One 4 KiB store and load through manager ``m``'s remote tier (``RuntimeError`` when it fails)."""
    probe = bytes(range(32))
    if not (m.store(probe, b"\x01" * 4096, timeout_s=None).result() and m.fetch_lower(probe, bytearray(4096)) == 4096):
        raise RuntimeError(f"no answer from {what}")
    m.remote.delete(probe)


def _seal_options(args) -> dict:
    """The remote tiers' seal keys for ``--remote-seal``: a random key in a 0600 file removed at exit."""
    if args.remote_seal == "none":
        return {}
    import atexit
    import secrets
    import tempfile

    fd, path = tempfile.mkstemp(prefix="lmtier-bench-seal-", suffix=".key")
    with os.fdopen(fd, "w") as f:  # mkstemp creates it 0600
        f.write(secrets.token_hex(32))
    atexit.register(os.unlink, path)
    return {"remote_auth_key": f"file:{path}", "remote_encrypt": args.remote_seal == "encrypt"}


def _setup_redis(b: Bench, args, say):
    """The Redis tier: ``--redis-url`` / ``$LMTIER_REDIS_URL``, else a private redis-server on loopback;
    sets ``b.managers["redis"]``, ``b.remote_urls["redis"]`` and the raw-socket ceiling. Returns the
    server started here (or None)."""
    binary = find_redis_server()
    url = args.redis_url or os.environ.get("LMTIER_REDIS_URL")
    if args.no_redis:
        say("redis: skipped (--no-redis)")
        return None
    if url is None and binary is None:
        say(
            "redis: skipped — no server given (--redis-url / LMTIER_REDIS_URL) and no redis-server binary "
            "(PATH, LMTIER_REDIS_SERVER; scripts/bundle_redis.sh packs one for machines without it)"
        )
        return None
    proc = None
    try:
        if url is None:
            proc = RedisServer(
                binary=binary, maxmemory=b.max_chunks * round_up(b.chunk_bytes) * 3 + (256 << 20)
            ).start()
            url = proc.url
        opts = _seal_options(args) or None
        m = b.managers["redis"] = build_manager(chunk_tokens=b.T, namespace=b.ns, remote_url=url, remote_options=opts)
        _probe(m, url)
        b.remote_urls["redis"] = (url, opts)
        b.redis_raw = redis_raw_gbps(url, round_up(b.chunk_bytes), inflight=args.inflight)
        say(
            f"redis: {'private redis-server (' + binary + ')' if proc else 'server'} on {url}, RedisTier "
            f"built by TierManager.from_config, {args.inflight} chunk reads in flight; raw-socket GETRANGE "
            f"ceiling ({args.inflight} x one chunk), records sealed: {args.remote_seal}: "
            + (f"{b.redis_raw:.2f} GB/s" if b.redis_raw else "not measured (no TCP redis:// URL)")
        )
        return proc
    except Exception as e:  # noqa: BLE001
        say(f"redis: skipped — could not start/connect ({type(e).__name__}: {e})")
        m = b.managers.pop("redis", None)
        if m is not None:
            m.close(persist=False)
        if proc:
            proc.close()
        return None


def _setup_mooncake(b: Bench, args, say):
    """The Mooncake Store tier: a private master and one store server on loopback (the data lives in
    the store server's segment, as on a store node; the bench's client mounts none:
    ``mooncake_global_segment_size: 0``); sets ``b.managers["mooncake"]`` and ``b.remote_urls``.
    Returns the cluster started here (or None)."""
    from lmtier.testing.mooncake import MooncakeCluster, mooncake_client_importable

    if args.no_mooncake:
        say("mooncake: skipped (--no-mooncake)")
        return None
    why = mooncake_client_importable()
    if why is not None:
        say(f"mooncake: skipped — the client cannot be imported ({why}; scripts/setup_mooncake.sh)")
        return None
    cluster = None
    try:
        # two tiers (plain, codec) of every chunk, and room for the store's own bookkeeping
        segment = 2 * b.max_chunks * round_up(b.chunk_bytes + 4096) + (256 << 20)
        cluster = MooncakeCluster(servers=1, segment_bytes=segment).start()
        opts = {"mooncake_global_segment_size": 0, **_seal_options(args)}
        m = b.managers["mooncake"] = build_manager(
            chunk_tokens=b.T, namespace=b.ns, remote_url=cluster.url, remote_options=opts
        )
        _probe(m, cluster.url)
        b.remote_urls["mooncake"] = (cluster.url, opts)
        say(
            f"mooncake: private mooncake_master + one store server ({segment / 2**30:.1f} GiB segment) on "
            f"{cluster.url}, tcp; MooncakeTier built by TierManager.from_config (this client mounts no "
            f"segment), {args.inflight} chunk reads in flight, records sealed: {args.remote_seal}"
        )
        return cluster
    except Exception as e:  # noqa: BLE001 - MooncakeUnavailable, a setup or probe failure
        say(f"mooncake: skipped — could not start/connect ({type(e).__name__}: {e})")
        m = b.managers.pop("mooncake", None)
        if m is not None:
            m.close(persist=False)
        if cluster is not None:
            cluster.close()
        return None


def run(args) -> dict:
    """Run the benchmark described by the parsed ``args``; returns the JSON result."""
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("lmtier bench ttft: --device cuda but no CUDA device is available")
    if args.preset is None:
        from lmtier.bench.ttft import DEFAULT_PRESET

        args.preset = DEFAULT_PRESET[args.device]
    if args.device == "cpu":
        torch.set_num_threads(max(1, min(args.threads, os.cpu_count() or 1)))
    lines: list[str] = []

    def say(msg: str) -> None:
        lines.append(msg)
        if not args.quiet:
            print(msg, flush=True)

    t_start = time.perf_counter()
    b = Bench(args)
    dev = b.dev
    cfg = b.model.config
    lengths = sorted(set(args.lengths))
    maxpos = getattr(cfg, "max_position_embeddings", None)
    skipped = []
    if maxpos:
        for n in [n for n in lengths if n + 1 > maxpos]:
            skipped.append({"N": n, "why": f"N + 1 > max_position_embeddings {maxpos}"})
        lengths = [n for n in lengths if n + 1 <= maxpos]
    maxn = max(lengths) if lengths else 0
    b.max_chunks = max(1, -(-maxn // b.T))
    copy_mode = (
        f"ConnectorWorker.load_layerwise: CudaTransferEngine.load_layerwise (staged, {b.lpw} layer(s) "
        "per event); device-decoded codec chunks: lmtier.ops.scatter from device staging"
        if dev.cuda
        else "lmtier.ops.scatter (CPU)"
    )
    say(
        f"model: {b.model_name}: {b.L} layers, {cfg.num_attention_heads} heads, {b.H} KV heads x {b.D}, "
        f"{args.dtype}, {args.device}; {b.bpt:,} B of KV per token; chunks of {b.T} tokens into a paged cache of "
        f"{b.block_size}-token blocks; host -> cache: {copy_mode}"
    )

    host_owner = HostBuffer(b.max_chunks * round_up(b.chunk_bytes), pinned=dev.cuda)
    b.landing = host_owner.tensor
    h2d = h2d_gbps(dev, b.landing, min(b.landing.numel(), 1 << 30))
    if h2d:
        say(f"pinned H2D ceiling (contiguous copy, same run): {h2d:.1f} GB/s")

    root = None
    pca_dir = None  # the fitted PCA model file's directory (removed at the end)
    remotes: list = []  # the servers started here (closed at the end)
    res_disk: dict = {}
    disk_dir = None
    drop_note: list[str] = []
    codec_info = None
    pca_info = None
    codec_classes: dict[str, str] = {}
    try:
        b.managers["cpu"] = build_manager(
            chunk_tokens=b.T, namespace=b.ns, cpu_bytes=(b.max_chunks + 1) * round_up(b.chunk_bytes)
        )
        disk_dir, root, res_disk, levels = _setup_disk(b, args, say)

        remotes.append(_setup_redis(b, args, say))
        remotes.append(_setup_mooncake(b, args, say))

        pca_levels = [lv for lv in levels if lv in PCA_LEVELS]
        has_codec_tier = root is not None or any(k in b.managers for k in REMOTE_KINDS)
        n_ids = max(maxn + 1, b.max_chunks * b.T)
        gen = torch.Generator().manual_seed(1234)  # a longer prompt only appends tokens (same prefix)
        ids = torch.randint(0, cfg.vocab_size, (1, n_ids), generator=gen).to(b.device)

        # codec tiers: tables first (CodecTier takes them at construction), untimed; the PCA levels'
        # model file (PCACodecTier loads it from the configuration)
        if pca_levels and has_codec_tier:
            if args.codec_pca_model is None:
                pca_dir = tempfile.mkdtemp(prefix="lmtier-bench-pca-")
            b.pca_model_path, pca_info = pca_model_file(
                pca_levels,
                given=args.codec_pca_model,
                geometry=(b.L, b.H, b.D),
                kv_dtype=args.dtype,
                chunk_tokens=b.T,
                tokens=args.codec_pca_fit_tokens,
                max_tokens=maxpos,
                vocab_size=cfg.vocab_size,
                device=b.device,
                prefix_kv=lambda x, k: prefix_kv(b.model, x, k, b.L),
                hf_model=b.model,
                model_name=b.model_name,
                out_dir=pca_dir or "",
                say=say,
            )
        cg_levels = [lv for lv in levels if lv not in PCA_LEVELS]
        if cg_levels and has_codec_tier:
            b.tables, codec_info = codec_tables(
                cg_levels,
                mode=args.codec_tables,
                geometry=(b.L, b.H, b.D),
                chunk_tokens=b.T,
                calib_tokens=args.codec_calib_tokens,
                max_tokens=maxpos,
                vocab_size=cfg.vocab_size,
                prefix_kv=lambda x, k: prefix_kv(b.model, x, k, b.L),
                device=b.device,
                say=say,
            )
        targets = []
        if root is not None:
            targets += [(codec_tag(lv), lv, os.path.join(root, codec_tag(lv)), None) for lv in levels]
        for kind in REMOTE_KINDS:
            if kind in b.managers:
                targets += [(codec_tag(lv, kind), lv, None, kind) for lv in REMOTE_CODEC_LEVELS if lv in levels]
        for tag, lv, ddir, kind in targets:
            try:
                if ddir:
                    os.makedirs(ddir)
                url, opts = b.remote_urls.get(kind, (None, None))
                m = b.codec_manager(lv, disk_dir=ddir, remote_url=url, remote_options=opts)
                b.managers[tag] = m
                b.codec_tiers[tag] = m.disk if ddir else m.remote
                b.codec_levels[tag] = lv
            except Exception as e:  # noqa: BLE001 - codec missing / not built / wrong dtype / PCA model refused
                say(f"{tag} ({lv}): skipped — {type(e).__name__}: {e}")
        codec_classes = {t: f"{type(ct).__module__}.{type(ct).__qualname__}" for t, ct in b.codec_tiers.items()}
        if b.codec_levels:
            say(
                "codec tiers: "
                + ", ".join(
                    f"{t} = level {lv} ({codec_classes[t].rsplit('.', 1)[1]})" for t, lv in b.codec_levels.items()
                )
                + "; records encoded once when stored (PCA levels: at the chunk's position), decoded by get_into "
                + (
                    "in the connector worker's device staging (GPU decode) + ops.scatter device -> paged blocks"
                    if b.codec_device
                    else "in the connector worker's host staging (CPU decode) + the host -> cache copy"
                )
            )
        say(
            "lean forward: "
            + (
                "CUDA graphs, one per layer + embed + head, captured per N (eager fallback "
                "on capture failure, reported per N)"
                if args.graphs == "auto" and dev.cuda
                else {
                    "off": "eager (--graphs off)",
                    "nocapture": "static buffers without capture (--graphs nocapture)",
                }.get(args.graphs, "eager (no CUDA)")
            )
        )

        # global warm-up (allocator, cuBLAS/SDPA kernels, lazy transformers setup) before any length
        with torch.no_grad():
            wn = min(64, maxn)
            for _ in range(2):
                b.model(input_ids=ids[:, : wn + 1], use_cache=False, logits_to_keep=1)
            dev.sync()

        rows = []
        for n in progress(lengths, desc="ttft", disable=args.quiet):
            try:
                rows.append(b.run_length(n, ids, h2d, res_disk.get("read"), drop_note))
            except torch.cuda.OutOfMemoryError as e:
                skipped.append({"N": n, "why": f"out of GPU memory ({str(e).splitlines()[0][:120]})"})
                say(f"N={n}: skipped — out of GPU memory")
            finally:
                if dev.cuda:
                    torch.cuda.empty_cache()
    finally:
        b.close()
        if pca_dir is not None:
            shutil.rmtree(pca_dir, ignore_errors=True)
        if root is not None and not args.keep_disk:
            shutil.rmtree(root, ignore_errors=True)
            if not args.disk_dir and disk_dir:
                shutil.rmtree(disk_dir, ignore_errors=True)
        for proc in remotes:
            if proc is not None:
                proc.close()
    if drop_note:
        say(f"note: page cache could not be dropped ({drop_note[0]}); DiskTier reads use O_DIRECT, so it is bypassed")

    res = {
        "bench": "ttft",
        "system": system_header(),
        "model": b.model_name,
        "device": args.device,
        "dtype": args.dtype,
        "kv_spectrum": args.kv_spectrum,
        "pca_python_decode": args.pca_python_decode,
        "geometry": {
            "num_layers": b.L,
            "num_kv_heads": b.H,
            "head_size": b.D,
            "bytes_per_token": b.bpt,
            "chunk_tokens": b.T,
            "block_size": b.block_size,
        },
        "copy_mode": copy_mode,
        "load_path": {
            "tiers": "lmtier.manager.TierManager.from_config",
            "pool": "TierManager.cpu.acquire (pinned slots)",
            "worker": "lmtier.integration.vllm.worker.ConnectorWorker (load_layerwise + wait_layer + "
            "finish_layerwise; load for load_ms)",
            "lower": "TierManager.fetch_lower",
            "codec": ", ".join(dict.fromkeys(sorted(codec_classes.values()))) or None,
            "codec_tiers": codec_classes,
            "codec_decode": "device" if b.codec_device else "host",
            "copy": copy_mode,
            "layers_per_wait": b.lpw if dev.cuda else None,
        },
        "iters": args.iters,
        "warmup": args.warmup,
        "ceilings": {
            "h2d_GBs": h2d,
            "disk_dd_GBs": res_disk or None,
            "disk_dir": disk_dir,
            "page_cache_dropped": (not drop_note) if root is not None else None,
            "redis_raw_GBs": b.redis_raw,
        },
        "tolerance": {
            "rtol_of_logit_absmax": RTOL,
            "min_cosine": MIN_COS,
            "hard_guard": "loaded KV bit-identical to the prefill's (lossy codec: to the reference decoder's, "
            "lmtier.codec.quant.dequantize; PCA levels: lmtier.codec.pca.decode)",
        },
        "graphs": args.graphs,
        "codec_levels": {t: lv for t, lv in b.codec_levels.items() if t.startswith("disk+")},
        "codec_tables": codec_info,
        "codec_pca_model": pca_info,
        "rows": rows,
        "skipped": skipped,
        "break_even": {t: break_even(rows, t) for t in TIERS},
        "notes": lines,
        "elapsed_s": None,
    }
    res["control_detected"] = all(
        not r["check_control_wrong_kv"]["logits_ok"] for r in rows if "check_control_wrong_kv" in r
    )
    res["checks_ok"] = all(
        r[k]["ok"] for r in rows for k in r if k.startswith("check_") and k != "check_control_wrong_kv"
    )
    res["elapsed_s"] = time.perf_counter() - t_start
    return res
