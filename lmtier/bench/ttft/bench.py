"""The measuring half of ``lmtier bench ttft``: :class:`Bench` holds the model and the tiers
(:class:`lmtier.manager.TierManager` per tier, built from a configuration) and measures one context
length at a time (:meth:`Bench.run_length`)."""

import math
import sys
import time

import torch

from lmtier.bench.ttft.ceilings import (
    Dev,
    drop_caches,
    timed,
)
from lmtier.bench.ttft.model import GraphForward, LeanDecoder, build_model, prefix_kv
from lmtier.bench.ttft.pipeline import Loader, PagedKV, build_manager, chunk_spans, landing_views
from lmtier.bench.ttft.report import REMOTE_KINDS, TIERS, compare
from lmtier.geometry import torch_dtype
from lmtier.keys import Namespace, chunk_keys
from lmtier.manager import TierManager
from lmtier.tiers.buffers import round_up
from lmtier.tiers.factory import codec_chunk_shape

__all__ = ["Bench"]


class Bench:
    """The model, its lean forward, the tiers, and the measurement of one context length."""

    def __init__(self, args) -> None:
        self.args = args
        self.device = torch.device(args.device)
        self.dev = Dev(self.device)
        self.dtype = torch_dtype(args.dtype)
        self.model, self.model_name = build_model(args.preset, args.model, self.device, self.dtype, args.kv_spectrum)
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
        self.codec_tiers: dict[str, object] = {}  # tag -> its CodecTier / PCACodecTier (records, counters)
        self.codec_levels: dict[str, str] = {}  # tag -> level name
        self.tables: dict[str, object] = {}  # level -> CodecTier(tables=...) argument
        self.pca_model_path: str | None = None  # codec_pca_model of the PCA levels (lmtier.bench.ttft.pca_model)
        self.mem: dict[str, TierManager] = {}  # level -> codec records in a CPU pool (no reads)
        self.landing: torch.Tensor | None = None  # host chunk buffers (pinned with CUDA)
        self.disk_odirect = True
        self.disk_par_bw: float | None = None
        self.redis_raw: float | None = None
        # remote kind -> (remote_url, extra configuration keys) of its managers (the codec one too)
        self.remote_urls: dict[str, tuple[str, dict | None]] = {}
        self.max_chunks = 1  # chunks of the longest prefix (set by run())

    # ---- tiers -------------------------------------------------------------------------------

    def codec_manager(
        self,
        level: str,
        *,
        disk_dir: str | None = None,
        remote_url: str | None = None,
        remote_options: dict | None = None,
    ) -> TierManager:
        """A manager whose lower tier stores codec records of ``level``: through the config
        (``*_serde: cachegen``) with the product's shipped tables (``--codec-tables shipped``),
        else through ``from_config``'s tier factory wrapping the tier in
        :class:`~lmtier.tiers.codec.CodecTier` with the tables of ``--codec-tables``. A PCA level:
        through the config alone (``codec_level``, ``codec_pca_model``: :attr:`pca_model_path`), a
        :class:`~lmtier.tiers.codec_pca.PCACodecTier`.

        Raises:
            lmtier.config.ConfigError: what the product refuses (a PCA model file that does not
                load, lacks the level or was calibrated for another geometry).
            RuntimeError: a PCA level without a model file (:attr:`pca_model_path` None).
        """
        from lmtier.codec.pca import PCA_LEVELS
        from lmtier.tiers.codec import CodecTier
        from lmtier.tiers.codec_pca import PCACodecTier
        from lmtier.tiers.factory import default_disk_factory, default_remote_factory

        tables = self.tables.get(level)
        common = dict(
            chunk_tokens=self.T,
            namespace=self.ns,
            disk_dir=disk_dir,
            disk_bytes=self._disk_bytes(),
            io_threads=self.args.disk_threads,
            remote_url=remote_url,
            remote_options=remote_options,
        )
        if level in PCA_LEVELS:
            if self.pca_model_path is None:
                raise RuntimeError("no PCA model file (see the 'PCA model' line above)")
            m = build_manager(**common, serde="cachegen", codec_level=level, codec_pca_model=self.pca_model_path)
        elif tables == "shipped":
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
        want = PCACodecTier if level in PCA_LEVELS else CodecTier
        if not isinstance(tier, want):
            m.close(persist=False)
            raise RuntimeError(f"the manager's tier is not a {want.__name__}")
        return m

    def mem_manager(self, level: str, like) -> TierManager:
        """Codec records of ``level`` in a CPU pool (pinned with CUDA): the same decode without any
        read — ``TierManager(disk=CodecTier(CPUPool))`` (a PCA level: ``PCACodecTier`` with the model
        of ``like``, the disk tier's), built on first use."""
        if level not in self.mem:
            from lmtier.codec.chunk import max_record_bytes
            from lmtier.tiers.codec import CodecTier
            from lmtier.tiers.codec_pca import PCACodecTier
            from lmtier.tiers.cpu import CPUPool

            shape = codec_chunk_shape(self.ns)
            pca = isinstance(like, PCACodecTier)
            rec = like.max_record_bytes if pca else max_record_bytes(shape, level)
            pool = CPUPool(self.max_chunks * round_up(rec) + round_up(rec), rec)
            if pca:
                tier = PCACodecTier(pool, shape=shape, dtype=self.ns.kv_dtype, level=level, model=like.model)
            else:
                tier = CodecTier(pool, shape=shape, dtype=self.ns.kv_dtype, level=level, tables=self.tables.get(level))
            self.mem[level] = TierManager(cpu=None, disk=tier)
        return self.mem[level]

    def _disk_bytes(self) -> int:
        return 2 * self.max_chunks * round_up(self.chunk_bytes) + (64 << 20)

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
        """Store every chunk through ``m.store`` (untimed, like the prefill that made the KV; chunk
        ``c`` at position ``c * chunk_tokens``) and wait."""
        futs = [m.store(key, chunks(c), timeout_s=None, position=c * self.T) for c, key in enumerate(keys)]
        for c, f in enumerate(futs):
            if not f.result():
                raise RuntimeError(f"store of chunk {c} failed ({dict(m.counters)})")

    @staticmethod
    def _lower(m: TierManager, tag: str):
        return m.remote if tag.startswith(REMOTE_KINDS) else m.disk

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
            fetch_batch=a.fetch_batch,
            max_staging_bytes=C * round_up(self.chunk_bytes),
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

        # (3) disk, (4) disk + codec (per level), (5) redis, redis + codec (default, PCA levels), mooncake, ...
        remotes = [t for t in TIERS if t.startswith(REMOTE_KINDS)]
        order = ["disk", *remotes, *(t for t in self.codec_levels if t.startswith("disk+"))]

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
                    if not self._pca(ct):  # records coded with a static table set (all chunks are T tokens here)
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
                    ct = None if level is None else self.codec_tiers[tag]
                    if ct is None or self._lossless(ct):
                        row[f"check_{tag}"] = compare(ref, got, canon, ref_kv)
                    else:
                        # lossy: the decoded KV must equal the reference decoder's bit for bit; the
                        # logits are reported (quality), not judged
                        c_ok = compare(ref, got)
                        c_ok["kv_exact"] = self._codec_kv_exact(ct, canon, padded, spans)
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
        self._check_records_agree(row)
        if self.redis_raw and "redis" in self.managers:
            row["redis_raw_GBs"] = self.redis_raw
            row["redis_limit_pct"] = 100 * (n * self.bpt / self.redis_raw / 1e6) / rec_ms
            for tag in self.codec_levels:
                if tag.startswith("redis+") and row.get(f"{tag}_MB"):
                    row[f"{tag}_limit_pct"] = 100 * (row[f"{tag}_MB"] / self.redis_raw) / rec_ms
        return row

    def _check_records_agree(self, row: dict) -> None:
        """``check_records_<level>``: every tier of one codec level stored records of the same total
        bytes (``<tag>_MB``, counted when encoded). The chunks, positions and codec data are the same
        for each tier and the encoders are deterministic, so a difference means a tier stored records
        of other, valid bytes, which decode to other KV without any check failing (RESULTS §4.1t)."""
        by_level: dict[str, dict[str, float]] = {}
        for tag in self.codec_levels:
            if row.get(f"{tag}_MB") is not None:
                by_level.setdefault(tag.split("+", 1)[1], {})[tag] = row[f"{tag}_MB"]
        for suffix, got in by_level.items():
            if len(got) > 1:
                row[f"check_records_{suffix}"] = {"ok": len(set(got.values())) == 1, "MB": got}

    @staticmethod
    def _pca(tier) -> bool:
        from lmtier.tiers.codec_pca import PCACodecTier

        return isinstance(tier, PCACodecTier)

    def _lossless(self, tier) -> bool:
        """Whether codec tier ``tier`` gives back the KV bit for bit (a lossless CacheGen level)."""
        return not self._pca(tier) and tier.level.lossless

    def _codec_kv_exact(self, tier, canon: torch.Tensor, padded, spans) -> bool:
        """Every loaded chunk equals the reference decoder's output for its record, bit for bit: of
        the padded chunk, :func:`lmtier.codec.quant.quantize` then
        :func:`~lmtier.codec.quant.dequantize` at ``tier``'s level; a PCA tier: the record
        :func:`lmtier.codec.pca.encode` makes of it at its position with the tier's model and level
        (the bytes the tier stored: the encode is deterministic, the same on the CPU and CUDA), then
        :func:`lmtier.codec.pca.decode`, both on the chunk's device."""
        from lmtier.codec import pca, quant

        for c, (s, tc) in enumerate(spans):
            pc = padded(c)
            if self._pca(tier):
                record = pca.encode(pc, start=s, model=tier.model, level=tier.level)
                ref = pca.decode(record, model=tier.model, device=pc.device)
            else:
                sym, side = quant.quantize(pc, tier.level)
                ref = quant.dequantize(sym, side, tier.level, tuple(pc.shape), pc.dtype)
            if not torch.equal(canon[:, :, s : s + tc], ref[:, :, :tc]):
                return False
        return True

    def _codec_in_memory(self, level, tag, keys, loader, forward, padded, spans, canon, ref_kv, row, rec_ms) -> None:
        """The same decode with the records in a CPU pool (no reads): ``{tag}_mem_ms`` splits
        ``{tag}_ms`` into read vs codec cost; also what a compressed CPU tier would give."""
        m = self.mem_manager(level, self.codec_tiers[tag])
        self._store(m, keys, padded)
        try:

            def run_():
                return loader.load(m, forward(), decode_on=self.decode_on)

            canon.fill_(float("nan"))
            run_()
            self.dev.sync()
            ct = self.codec_tiers[tag]
            ok = torch.equal(canon, ref_kv) if self._lossless(ct) else self._codec_kv_exact(ct, canon, padded, spans)
            if not ok:
                raise RuntimeError(f"{tag}: in-memory decode gave different KV than the reference")
            row[f"{tag}_mem_ms"], _, _ = timed(self.dev, run_, self.args.iters, max(0, self.args.warmup - 1))
            row[f"{tag}_mem_pct"] = 100 * row[f"{tag}_mem_ms"] / rec_ms
        finally:
            for key in keys:
                m.disk.delete(key)
            loader.release(m)
