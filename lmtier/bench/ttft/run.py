"""One ``lmtier bench ttft`` run: per context length, recompute vs each tier's load + lean forward.

:class:`Bench` holds the model, the tiers (:class:`lmtier.manager.TierManager` per tier, built from
a configuration) and measures one length at a time (:meth:`Bench.run_length`); :func:`run` sets up
the tiers and the same-run ceilings, runs every length and returns the JSON result.
"""

from __future__ import annotations

import math
import os
import shutil
import sys
import tempfile
import time

import torch

from lmtier.bench.common import progress, system_header
from lmtier.bench.ttft.ceilings import (
    Dev,
    dd_read_gbps,
    default_disk_dir,
    drop_caches,
    fs_type,
    h2d_gbps,
    odirect_supported,
    redis_raw_gbps,
    timed,
)
from lmtier.bench.ttft.model import GraphForward, LeanDecoder, build_model, prefix_kv
from lmtier.bench.ttft.pipeline import Loader, PagedKV, build_manager, chunk_spans, landing_views
from lmtier.bench.ttft.report import MIN_COS, RTOL, TIERS, break_even, codec_tag, compare
from lmtier.bench.ttft.tables import codec_tables
from lmtier.geometry import torch_dtype
from lmtier.keys import Namespace, chunk_keys
from lmtier.manager import TierManager, codec_chunk_shape
from lmtier.memory import HostBuffer
from lmtier.testing.redis import RedisServer, find_redis_server

__all__ = ["Bench", "run"]


def _round4k(n: int) -> int:
    return -(-n // 4096) * 4096


class Bench:
    """The model, its lean forward, the tiers, and the measurement of one context length."""

    def __init__(self, args) -> None:
        self.args = args
        self.device = torch.device(args.device)
        self.dev = Dev(self.device)
        self.dtype = torch_dtype(args.dtype)
        self.model, self.model_name = build_model(args.preset, args.model, self.device, self.dtype)
        self.lean = LeanDecoder(self.model)
        self.L, self.H, self.D = self.lean.num_layers, self.lean.hkv, self.lean.head_dim
        self.esize = torch.tensor([], dtype=self.dtype).element_size()
        self.bpt = self.L * 2 * self.H * self.D * self.esize  # canonical bytes per token
        self.T = args.chunk_tokens
        self.chunk_bytes = self.T * self.bpt
        self.block_size = args.block_size or math.gcd(self.T, 16)
        if self.T % self.block_size:
            raise SystemExit(
                f"lmtier bench ttft: --block-size {self.block_size} does not divide --chunk-tokens {self.T}"
            )
        self.lpw = args.layers_per_wait or max(1, self.L // 8)
        if not 1 <= self.lpw <= self.L:
            raise SystemExit(f"lmtier bench ttft: --layers-per-wait must be in [1, {self.L}]")
        self.ns = Namespace(
            model=self.model_name,
            num_layers=self.L,
            num_kv_heads=self.H,
            head_size=self.D,
            kv_dtype=args.dtype,
            chunk_size=self.T,
        )
        self.codec_device = self.dev.cuda and args.codec_decode == "device"
        self.decode_on = "device" if self.codec_device else "host"  # the connector worker's, for codec tiers
        self.gf: GraphForward | None = None
        self.managers: dict[str, TierManager] = {}  # tag -> the tier's manager
        self.codec_tiers: dict[str, object] = {}  # tag -> its CodecTier (records, tables, counters)
        self.codec_levels: dict[str, str] = {}  # tag -> level name
        self.tables: dict[str, object] = {}  # level -> CodecTier(tables=...) argument
        self.mem: dict[str, TierManager] = {}  # level -> codec records in a CPU pool (no reads)
        self.landing: torch.Tensor | None = None  # host chunk buffers (pinned with CUDA)
        self.disk_odirect = True
        self.disk_par_bw: float | None = None
        self.redis_raw: float | None = None
        self.max_chunks = 1  # chunks of the longest prefix (set by run())

    # ---- tiers -------------------------------------------------------------------------------

    def codec_manager(self, level: str, *, disk_dir: str | None = None, remote_url: str | None = None) -> TierManager:
        """A manager whose lower tier stores codec records of ``level``: through the config
        (``*_serde: cachegen``) with the product's shipped tables (``--codec-tables shipped``),
        else through ``from_config``'s tier factory wrapping the tier in
        :class:`~lmtier.tiers.codec.CodecTier` with the tables of ``--codec-tables``."""
        from lmtier.manager import default_disk_factory, default_remote_factory
        from lmtier.tiers.codec import CodecTier

        tables = self.tables.get(level)
        common = dict(
            chunk_tokens=self.T,
            namespace=self.ns,
            disk_dir=disk_dir,
            disk_bytes=self._disk_bytes(),
            io_threads=self.args.disk_threads,
            remote_url=remote_url,
        )
        if tables == "shipped":
            m = build_manager(**common, serde="cachegen", codec_level=level)
        else:
            key = "local_disk_serde" if disk_dir else "remote_serde"

            def wrap(factory):
                def make(cfg, ns, *rest):
                    return CodecTier(
                        factory(cfg, ns, *rest),
                        shape=codec_chunk_shape(ns),
                        dtype=ns.kv_dtype,
                        level=level,
                        tables=tables,
                        config_key=key,
                    )

                return make

            m = build_manager(
                **common, disk_factory=wrap(default_disk_factory), remote_factory=wrap(default_remote_factory)
            )
        tier = m.disk if disk_dir else m.remote
        if not isinstance(tier, CodecTier):
            m.close(persist=False)
            raise RuntimeError("the manager's tier is not a CodecTier")
        return m

    def mem_manager(self, level: str) -> TierManager:
        """Codec records of ``level`` in a CPU pool (pinned with CUDA): the same decode without any
        read — ``TierManager(disk=CodecTier(CPUPool))``, built on first use."""
        if level not in self.mem:
            from lmtier.codec.chunk import max_record_bytes
            from lmtier.tiers.codec import CodecTier
            from lmtier.tiers.cpu import CPUPool

            shape = codec_chunk_shape(self.ns)
            rec = max_record_bytes(shape, level)
            pool = CPUPool(self.max_chunks * _round4k(rec) + _round4k(rec), rec)
            self.mem[level] = TierManager(
                cpu=None,
                disk=CodecTier(pool, shape=shape, dtype=self.ns.kv_dtype, level=level, tables=self.tables.get(level)),
            )
        return self.mem[level]

    def _disk_bytes(self) -> int:
        return 2 * self.max_chunks * _round4k(self.chunk_bytes) + (64 << 20)

    def close(self) -> None:
        for m in [*self.managers.values(), *self.mem.values()]:
            try:
                m.close(persist=False)
            except Exception as e:  # noqa: BLE001 - closing must not hide the results
                print(f"lmtier bench ttft: closing a tier failed: {e}", file=sys.stderr)
        self.managers, self.mem = {}, {}

    # ---- forward -------------------------------------------------------------------------------

    def fwd(self, n: int, kv: PagedKV, tok, pos, wait=None, eager: bool = False) -> torch.Tensor:
        """The lean last-token forward over ``kv``: the CUDA graphs captured for this N when there
        are (and ``eager`` is False), else the eager :meth:`LeanDecoder.forward`."""
        if self.gf is not None and not eager:
            return self.gf.run(wait)
        return self.lean.forward(tok, pos, n, *kv.views(), wait=wait)

    def make_graphs(self, n: int, kv: PagedKV, tok, pos) -> str:
        """Capture the lean forward for this N (``--graphs``); returns the mode used, and on failure
        falls back to eager with a printed reason."""
        self.close_graphs()
        want = self.args.graphs
        if want == "off":
            return "eager (--graphs off)"
        if want == "nocapture":
            self.gf = GraphForward(self.lean, tok, pos, *kv.views(), capture=False)
            return "static buffers, no capture (--graphs nocapture)"
        if not self.dev.cuda:
            return "eager (no CUDA: graphs need a GPU)"
        try:
            self.gf = GraphForward(self.lean, tok, pos, *kv.views(), capture=True)
            return "cuda-graphs"
        except Exception as e:  # noqa: BLE001 - any capture failure: measure eagerly instead
            self.close_graphs()
            try:
                torch.cuda.synchronize(self.device)
            except Exception:  # noqa: BLE001
                pass
            why = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
            print(
                f"lmtier bench ttft: N={n}: CUDA graph capture of the lean forward failed ({why}); "
                "using the eager forward",
                file=sys.stderr,
                flush=True,
            )
            return f"eager (graph capture failed: {why})"

    def close_graphs(self) -> None:
        if self.gf is not None:
            self.gf.close()
            self.gf = None

    # ---- one context length ----------------------------------------------------------------

    def _store(self, m: TierManager, keys: list[bytes], chunks) -> None:
        """Store every chunk through ``m.store`` (untimed, like the prefill that made the KV) and wait."""
        futs = [m.store(key, chunks(c), timeout_s=None) for c, key in enumerate(keys)]
        for c, f in enumerate(futs):
            if not f.result():
                raise RuntimeError(f"store of chunk {c} failed ({dict(m.counters)})")

    @staticmethod
    def _lower(m: TierManager, tag: str):
        return m.remote if tag.startswith("redis") else m.disk

    def run_length(self, n: int, ids: torch.Tensor, h2d: float | None, disk_bw: float | None, drop_note: list) -> dict:
        a, dev = self.args, self.dev
        it, wu = a.iters, a.warmup
        L, H, D, T = self.L, self.H, self.D, self.T
        row: dict = {"N": n, "kv_MB": n * self.bpt / 1e6}
        model = self.model
        inp = ids[:, : n + 1]
        tok = ids[:, n : n + 1]
        pos = torch.tensor([[n]], device=self.device)

        # (1) recompute
        with torch.no_grad():
            rec_ms, rec_all, ref = timed(
                dev, lambda: model(input_ids=inp, use_cache=False, logits_to_keep=1).logits[:, -1], it, wu
            )
        ref = ref.float()
        row["recompute_ms"] = rec_ms
        row["recompute_all_ms"] = rec_all

        # the prefix KV (prefill of N tokens, canonical [L, 2, n, H, D]): what every load must reproduce
        spans = chunk_spans(n, T)
        C = len(spans)
        ref_kv = prefix_kv(model, ids, n, L)
        salt = f"lmtier-bench-ttft-N{n}"
        keys = chunk_keys(ids[0, : C * T].cpu(), self.ns, cache_salt=salt)
        host = landing_views(self.landing, C, self.chunk_bytes)

        kv = PagedKV(
            num_layers=L,
            num_heads=H,
            head_size=D,
            num_tokens=n,
            block_size=self.block_size,
            dtype=self.dtype,
            device=self.device,
            chunk_tokens=T,
        )
        canon = kv.canonical()
        # the timed loads: the vLLM connector's worker over this cache, one per tier manager
        loader = Loader(
            kv,
            chunk_tokens=T,
            namespace=self.ns,
            token_ids=ids[0, : C * T].tolist(),
            cache_salt=salt,
            layers_per_wait=self.lpw,
            io_threads=max(1, a.inflight),
            max_staging_bytes=C * _round4k(self.chunk_bytes),
        )
        try:
            return self._run_length(
                n, row, rec_ms, ref, spans, ref_kv, keys, host, kv, canon, loader, tok, pos, h2d, disk_bw, drop_note
            )
        finally:
            loader.close()

    def _run_length(
        self, n, row, rec_ms, ref, spans, ref_kv, keys, host, kv, canon, loader, tok, pos, h2d, disk_bw, drop_note
    ) -> dict:
        """:meth:`run_length` from the cached paths on (``loader`` times them)."""
        a, dev = self.args, self.dev
        it, wu = a.iters, a.warmup
        L, H, D, T = self.L, self.H, self.D, self.T
        C = len(spans)

        def padded(c: int) -> torch.Tensor:
            """Chunk ``c`` zero-padded to T tokens, on the model's device (what the codec encodes)."""
            s, tc = spans[c]
            pc = torch.zeros(L, 2, T, H, D, dtype=self.dtype, device=self.device)
            pc[:, :, :tc].copy_(ref_kv[:, :, s : s + tc])
            return pc

        def stage_host() -> None:
            """The canonical (padded) chunks into the host buffers ``host``."""
            for c, (s, tc) in enumerate(spans):
                v = host[c].view(self.dtype).view(L, 2, T, H, D)
                if tc < T:
                    v[:, :, tc:].zero_()
                v[:, :, :tc].copy_(ref_kv[:, :, s : s + tc])
            dev.sync()

        # the lean forward for this N: CUDA graphs (captured over the paged cache, tok, pos) or eager
        canon.copy_(ref_kv)
        row["fwd_mode"] = self.make_graphs(n, kv, tok, pos)
        if self.gf is not None:
            with torch.no_grad():
                g_out = self.fwd(n, kv, tok, pos).float().clone()
                e_out = self.fwd(n, kv, tok, pos, eager=True).float()
            row["graph_vs_eager_maxdiff"] = (g_out - e_out).abs().max().item()
            del g_out, e_out

        def forward(eager: bool = False):
            return lambda wait: self.fwd(n, kv, tok, pos, wait, eager)

        # (2) CPU tier: the chunks stored into the pool through the manager, loaded from the slots
        cpu = self.managers["cpu"]
        stage_host()
        self._store(cpu, keys, lambda c: host[c])
        kv.buf.fill_(float("nan"))  # a skipped byte cannot pass
        with torch.no_grad():
            got = loader.load(cpu, forward())
        dev.sync()
        row["check_cpu"] = compare(ref, got, canon, ref_kv)
        # control: what a wrong-index load looks like — chunk 1's place holds chunk 0's KV. (A
        # permutation of whole (K, V) pairs would be invisible: attention is a set operation.)
        if C > 1:
            with torch.no_grad():
                canon.copy_(ref_kv)
                s1, t1 = spans[1]
                canon[:, :, s1 : s1 + t1].copy_(ref_kv[:, :, :t1])
                got_w = self.lean.forward(tok, pos, n, *kv.views())
            row["check_control_wrong_kv"] = compare(ref, got_w, canon, ref_kv)

        with torch.no_grad():
            row["cpu_ms"], row["cpu_all_ms"], _ = timed(dev, lambda: loader.load(cpu, forward()), it, wu)
            if self.gf is not None:
                row["cpu_eager_ms"], _, _ = timed(dev, lambda: loader.load(cpu, forward(eager=True)), it, wu)
            # load alone (the worker's synchronous load), forward alone, and the contiguous-[1,H,N,D] alternative
            row["load_ms"], _, _ = timed(
                dev, lambda: loader.load(cpu, lambda wait: None, forward_only_after=True), it, wu
            )
            row["fwd_ms"], _, _ = timed(dev, lambda: self.fwd(n, kv, tok, pos), it, wu)
            if self.gf is not None:
                row["fwd_eager_ms"], _, _ = timed(dev, lambda: self.fwd(n, kv, tok, pos, eager=True), it, wu)
            else:
                row["fwd_eager_ms"] = row["fwd_ms"]
            if a.compare_layouts:
                hnd = torch.empty(L, 2, H, n + 1, D, dtype=self.dtype, device=self.device)
                full = kv.canonical(n + 1)
                row["transpose_ms"], _, _ = timed(dev, lambda: hnd.copy_(full.permute(0, 1, 3, 2, 4)), it, wu)
                row["fwd_contig_ms"], _, _ = timed(
                    dev,
                    lambda: self.lean.forward(
                        tok,
                        pos,
                        n,
                        lambda l: hnd[l, 0].unsqueeze(0),
                        lambda l: hnd[l, 1].unsqueeze(0),
                        lambda l: hnd[l, 0, :, n],
                        lambda l: hnd[l, 1, :, n],
                    ),
                    it,
                    wu,
                )
                del hnd, full
        for key in keys:
            cpu.cpu.delete(key)
        loader.release(cpu)
        if h2d:
            row["h2d_GBs"] = h2d
            row["cpu_limit_ms"] = n * self.bpt / h2d / 1e6
            row["cpu_limit_pct"] = 100 * row["cpu_limit_ms"] / rec_ms
            row["load_GBs"] = n * self.bpt / row["load_ms"] / 1e6
        row["cpu_pct"] = 100 * row["cpu_ms"] / rec_ms

        # (3) disk, (4) disk + codec (per level), (5) redis, redis + codec
        order = ["disk", "redis", "redis+codec", *(t for t in self.codec_levels if t.startswith("disk+"))]

        def drop():
            why = drop_caches()
            if why and not drop_note:
                drop_note.append(why)

        for tag in order:
            m = self.managers.get(tag)
            if m is None:
                continue
            level = self.codec_levels.get(tag)
            tier = self._lower(m, tag)
            try:
                if level is None:
                    stage_host()
                    self._store(m, keys, lambda c: host[c])
                else:  # encode once, when stored (untimed, like the prefill that made the KV)
                    ct = self.codec_tiers[tag]
                    before_bytes = ct.counters["record_bytes_out"]
                    t0 = time.perf_counter()
                    self._store(m, keys, padded)
                    row[f"{tag}_encode_s"] = time.perf_counter() - t0
                    stored = ct.counters["record_bytes_out"] - before_bytes
                    # records coded with a static table set (all chunks are T tokens long here)
                    row[f"{tag}_static_records"] = (
                        C if (ct.tables is not None and ct.tables.run_lens(T) is not None) else 0
                    )
                    row[f"{tag}_ratio"] = n * self.bpt / stored
                    row[f"{tag}_MB"] = stored / 1e6
                decode_on = "auto" if level is None else self.decode_on

                def load(m=m, decode_on=decode_on):
                    return loader.load(m, forward(), decode_on=decode_on)

                # O_DIRECT reads bypass the page cache: drop it once; without O_DIRECT before every load
                is_disk = tag.startswith("disk")
                before = drop if (is_disk and not self.disk_odirect) else None
                kv.buf.fill_(float("nan"))
                with torch.no_grad():
                    if is_disk:
                        drop()
                    got = load()
                    dev.sync()
                    lv = None if level is None else self.codec_tiers[tag].level
                    if lv is None or lv.lossless:
                        row[f"check_{tag}"] = compare(ref, got, canon, ref_kv)
                    else:
                        # lossy: the decoded KV must equal the reference decoder's bit for bit; the
                        # logits are reported (quality), not judged
                        c_ok = compare(ref, got)
                        c_ok["kv_exact"] = self._codec_kv_exact(lv, canon, padded, spans)
                        c_ok["lossy"] = True
                        c_ok["kv_rel_err"] = ((canon.float() - ref_kv.float()).norm() / ref_kv.float().norm()).item()
                        c_ok["ok"] = bool(c_ok["kv_exact"] and math.isfinite(c_ok["max_abs_diff"]))
                        row[f"check_{tag}"] = c_ok
                    # the correctness load above warmed this path up: one warm-up fewer
                    row[f"{tag}_ms"], row[f"{tag}_all_ms"], _ = timed(dev, load, it, max(0, wu - 2), before=before)
                    if level is not None and is_disk:
                        self._codec_in_memory(
                            level, tag, keys, loader, forward, padded, spans, canon, ref_kv, row, rec_ms
                        )
                row[f"{tag}_pct"] = 100 * row[f"{tag}_ms"] / rec_ms
                row[f"{tag}_GBs"] = n * self.bpt / row[f"{tag}_ms"] / 1e6  # effective (KV delivered)
            except torch.cuda.OutOfMemoryError:
                raise
            except Exception as e:  # noqa: BLE001 - one tier failing must not lose the other numbers
                row[f"{tag}_error"] = f"{type(e).__name__}: {e}"
                print(f"N={n}: {tag} tier failed: {row[f'{tag}_error']}", file=sys.stderr)
                row[f"check_{tag}"] = {
                    "ok": False,
                    "logits_ok": False,
                    "error": row[f"{tag}_error"],
                    "max_abs_diff": float("nan"),
                    "ref_absmax": float("nan"),
                    "cosine": float("nan"),
                }
                for k in (f"{tag}_ms", f"{tag}_pct", f"{tag}_GBs"):
                    row.pop(k, None)
            finally:
                for key in keys:
                    tier.delete(key)
                loader.release(m)
        self.close_graphs()
        if "disk" in self.managers and disk_bw:
            row["disk_dd_GBs"] = disk_bw
            row["disk_limit_pct"] = 100 * (n * self.bpt / disk_bw / 1e6) / rec_ms
            par = self.disk_par_bw
            if par:
                row["disk_par_GBs"] = par
            best = max(disk_bw, par or 0)
            for tag in self.codec_levels:
                if tag.startswith("disk+") and row.get(f"{tag}_MB"):
                    # the read alone at the best same-run device ceiling (dd or parallel O_DIRECT)
                    row[f"{tag}_limit_pct"] = 100 * (row[f"{tag}_MB"] / best) / rec_ms  # MB / (GB/s) = ms
        if self.redis_raw and "redis" in self.managers:
            row["redis_raw_GBs"] = self.redis_raw
            row["redis_limit_pct"] = 100 * (n * self.bpt / self.redis_raw / 1e6) / rec_ms
            if row.get("redis+codec_MB"):
                row["redis+codec_limit_pct"] = 100 * (row["redis+codec_MB"] / self.redis_raw) / rec_ms
        return row

    def _codec_kv_exact(self, lv, canon: torch.Tensor, padded, spans) -> bool:
        """Every loaded chunk equals the reference decoder's output for its record, bit for bit
        (:func:`lmtier.codec.quant.quantize` then :func:`~lmtier.codec.quant.dequantize` of the
        padded chunk)."""
        from lmtier.codec import quant

        for c, (s, tc) in enumerate(spans):
            pc = padded(c)
            sym, side = quant.quantize(pc, lv)
            ref = quant.dequantize(sym, side, lv, tuple(pc.shape), pc.dtype)
            if not torch.equal(canon[:, :, s : s + tc], ref[:, :, :tc]):
                return False
        return True

    def _codec_in_memory(self, level, tag, keys, loader, forward, padded, spans, canon, ref_kv, row, rec_ms) -> None:
        """The same decode with the records in a CPU pool (no reads): ``{tag}_mem_ms`` splits
        ``{tag}_ms`` into read vs codec cost; also what a compressed CPU tier would give."""
        m = self.mem_manager(level)
        self._store(m, keys, padded)
        try:

            def run_():
                return loader.load(m, forward(), decode_on=self.decode_on)

            canon.fill_(float("nan"))
            run_()
            self.dev.sync()
            lv = self.codec_tiers[tag].level
            ok = torch.equal(canon, ref_kv) if lv.lossless else self._codec_kv_exact(lv, canon, padded, spans)
            if not ok:
                raise RuntimeError(f"{tag}: in-memory decode gave different KV than the reference")
            row[f"{tag}_mem_ms"], _, _ = timed(self.dev, run_, self.args.iters, max(0, self.args.warmup - 1))
            row[f"{tag}_mem_pct"] = 100 * row[f"{tag}_mem_ms"] / rec_ms
        finally:
            for key in keys:
                m.disk.delete(key)
            loader.release(m)


def _setup_disk(b: Bench, args, say) -> tuple[str | None, str | None, dict, list]:
    """The disk tiers (plain and per codec level) under one temp dir, and the disk ceilings."""
    levels = [x.strip() for x in (args.codec_levels or "").split(",") if x.strip()]
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
    host_bytes = b.max_chunks * _round4k(b.chunk_bytes)
    dd = dd_read_gbps(disk_dir, max(16 << 20, min(args.dd_bytes, host_bytes)), inflight=args.inflight)
    b.disk_par_bw = dd.get("read_par")
    why = drop_caches()
    say(
        f"disk tier: {disk_dir} ({fs_type(disk_dir)}), O_DIRECT {'on' if odirect else 'OFF (unsupported here)'}, "
        f"disk_io_threads {args.disk_threads}, {args.inflight} chunk reads in flight (manager.fetch_lower); "
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
    lengths = sorted({int(x) for x in args.lengths.split(",") if x.strip()})
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

    host_owner = HostBuffer(b.max_chunks * _round4k(b.chunk_bytes), pinned=dev.cuda)
    b.landing = host_owner.tensor
    h2d = h2d_gbps(dev, b.landing, min(b.landing.numel(), 1 << 30))
    if h2d:
        say(f"pinned H2D ceiling (contiguous copy, same run): {h2d:.1f} GB/s")

    root = redis_proc = None
    res_disk: dict = {}
    disk_dir = None
    drop_note: list[str] = []
    codec_info = None
    try:
        b.managers["cpu"] = build_manager(
            chunk_tokens=b.T, namespace=b.ns, cpu_bytes=(b.max_chunks + 1) * _round4k(b.chunk_bytes)
        )
        disk_dir, root, res_disk, levels = _setup_disk(b, args, say)

        # redis
        binary = find_redis_server()
        url = args.redis_url or os.environ.get("LMTIER_REDIS_URL")
        if args.no_redis:
            say("redis: skipped (--no-redis)")
        elif url is None and binary is None:
            say(
                "redis: skipped — no server given (--redis-url / LMTIER_REDIS_URL) and no redis-server binary "
                "(PATH, LMTIER_REDIS_SERVER; scripts/bundle_redis.sh packs one for machines without it)"
            )
        else:
            try:
                if url is None:
                    redis_proc = RedisServer(
                        binary=binary, maxmemory=b.max_chunks * _round4k(b.chunk_bytes) * 3 + (256 << 20)
                    ).start()
                    url = redis_proc.url
                m = build_manager(chunk_tokens=b.T, namespace=b.ns, remote_url=url)
                b.managers["redis"] = m
                probe = bytes(range(32))
                if not (
                    m.store(probe, b"\x01" * 4096, timeout_s=None).result()
                    and m.fetch_lower(probe, bytearray(4096)) == 4096
                ):
                    raise RuntimeError(f"no answer from {url}")
                m.remote.delete(probe)
                b.redis_raw = redis_raw_gbps(url, _round4k(b.chunk_bytes), inflight=args.inflight)
                say(
                    f"redis: {'private redis-server (' + binary + ')' if redis_proc else 'server'} on {url}, RedisTier "
                    f"built by TierManager.from_config, {args.inflight} chunk reads in flight; raw-socket GETRANGE "
                    f"ceiling ({args.inflight} x one chunk): "
                    + (f"{b.redis_raw:.2f} GB/s" if b.redis_raw else "not measured (no TCP redis:// URL)")
                )
            except Exception as e:  # noqa: BLE001
                say(f"redis: skipped — could not start/connect ({type(e).__name__}: {e})")
                m = b.managers.pop("redis", None)
                if m is not None:
                    m.close(persist=False)
                if redis_proc:
                    redis_proc.close()
                redis_proc = None

        gen = torch.Generator().manual_seed(1234)
        ids = torch.randint(0, cfg.vocab_size, (1, max(maxn + 1, b.max_chunks * b.T)), generator=gen).to(b.device)

        # codec tiers: tables first (CodecTier takes them at construction), untimed
        if levels and (root is not None or "redis" in b.managers):
            b.tables, codec_info = codec_tables(
                levels,
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
        if "redis" in b.managers and "default" in levels:
            targets.append(("redis+codec", "default", None, url))
        for tag, lv, ddir, rurl in targets:
            try:
                if ddir:
                    os.makedirs(ddir)
                m = b.codec_manager(lv, disk_dir=ddir, remote_url=rurl)
                b.managers[tag] = m
                b.codec_tiers[tag] = m.disk if ddir else m.remote
                b.codec_levels[tag] = lv
            except Exception as e:  # noqa: BLE001 - codec missing / not built / wrong dtype
                say(f"{tag} ({lv}): skipped — {type(e).__name__}: {e}")
        if b.codec_levels:
            say(
                "codec tiers: "
                + ", ".join(f"{t} = level {lv}" for t, lv in b.codec_levels.items())
                + "; lmtier.tiers.codec.CodecTier, records encoded once when stored, decoded by CodecTier.get_into "
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
        if root is not None and not args.keep_disk:
            shutil.rmtree(root, ignore_errors=True)
            if not args.disk_dir and disk_dir:
                shutil.rmtree(disk_dir, ignore_errors=True)
        if redis_proc is not None:
            redis_proc.close()
    if drop_note:
        say(f"note: page cache could not be dropped ({drop_note[0]}); DiskTier reads use O_DIRECT, so it is bypassed")

    res = {
        "bench": "ttft",
        "system": system_header(),
        "model": b.model_name,
        "device": args.device,
        "dtype": args.dtype,
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
            "codec": "lmtier.tiers.codec.CodecTier",
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
            "hard_guard": "loaded KV bit-identical to the prefill's (lossy codec: to the reference decoder's)",
        },
        "graphs": args.graphs,
        "codec_levels": {t: lv for t, lv in b.codec_levels.items() if t.startswith("disk+")},
        "codec_tables": codec_info,
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
