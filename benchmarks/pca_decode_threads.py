"""The PCA level's CUDA decode as a tier's I/O threads run it, in a loop (issue 19): ``--threads``
threads each decode one record at a time on its own stream (``lmtier.bench.codec_pca.decode_one``:
``decode_queued(...).result()``), over and over for ``--seconds``; prints GB/s of bf16 KV. ``--op
encode``: the same for ``pca.encode`` of the chunks, each thread on its own stream, as a tier's store
threads encode. ``--op put``: the product's write path, ``PCACodecTier.put`` of page-locked host chunks
(as the CPU pool's slots hand them) with ``encode_device`` on the GPU, over an inner tier whose put
copies the record once (a socket's send or a file's write stand-in). ``--op get``: the product's read
path, each thread reading every chunk with one ``PCACodecTier.get_many_into`` into CUDA destinations
(decodes queued ahead as the tier queues them) from a batching inner tier in memory; ``--get-batch K``:
in calls of ``K`` chunks (1: as the vLLM connector's I/O tasks read by default); ``--get-stream``: each
thread passes its own CUDA stream (the connector's device-decode path: copies queued on it, one
synchronize at the end of the thread's reads) instead of none (each chunk in its destination when
the call returns). Made to run
under ``py-spy record --gil`` (scripts/gpu_run.sh's ``decspy`` step): which Python code holds the GIL
while several threads decode. Llama-3.1-8B geometry at G = 1, the codec_pca bench's synthetic model
and chunks.

    python benchmarks/pca_decode_threads.py [--threads 4] [--chunks 8] [--seconds 20] [--level pca_default]
        [--profile PASSES] [--breakdown PASSES] [--op decode|encode|put|get] [--ceiling]
        [--table-checks bitmap|per-call] [--get-batch K] [--get-stream]

``--profile``: after the timed loop, ``PASSES`` more passes under ``torch.profiler``: how much of the wall
time the GPU was busy (the union of its kernels' and copies' intervals, all streams), and the device time
per record of each kernel name: whether the threads' rate is bound by the device or by the host.
``--table-checks per-call``: the native decode's rANS calls check their tables at each call instead of
reading the level's validity bitmap (an A/B of that bitmap).
``--ceiling``: the copies that bound the op, timed in the same run (the records from page-locked host
memory to the device, as bf16 KV at their ratio; the bf16 KV host to device; a device copy of the KV).
``--breakdown``: ``PASSES`` more passes with the decode's steps timed on each thread (the record's
native scan and checksum, or its Python parse, the native call's queueing and within it
``decode_record``, the wait in ``result``; with ``--op get`` also the tier's batched read, the
inner read and the chunk's copy out; with ``--op encode`` / ``put`` the encode's steps: the kernels
and coder queued, the two waits, the record's packing, and for ``put`` the chunk's upload and the
inner put): which step grows when threads are added.
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

sys.path.append(str(Path(__file__).resolve().parents[1]))  # after PYTHONPATH: an A/B may put another lmtier first

from lmtier.bench import codec_pca as bench  # noqa: E402
from lmtier.codec import pca  # noqa: E402
from lmtier.tiers.base import Tier, TierUsage  # noqa: E402
from lmtier.tiers.codec_pca import PCACodecTier  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=4)
    ap.add_argument("--chunks", type=int, default=8)
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--level", default="pca_default")
    ap.add_argument("--profile", type=int, default=0, metavar="PASSES")
    ap.add_argument("--breakdown", type=int, default=0, metavar="PASSES")
    ap.add_argument("--switch-ms", type=float, default=0.0, help="sys.setswitchinterval (ms; 0: Python's 5 ms)")
    ap.add_argument("--op", choices=("decode", "encode", "put", "get"), default="decode")
    ap.add_argument("--ceiling", action="store_true", help="also time the copies that bound the op (same run)")
    ap.add_argument(
        "--table-checks",
        choices=("bitmap", "per-call"),
        default="bitmap",
        help="decode: the level's tables checked once (the product) or at each rANS call (A/B)",
    )
    ap.add_argument("--get-batch", type=int, default=0, help="get: chunks per get_many_into (0: all)")
    ap.add_argument("--get-stream", action="store_true", help="get: each thread passes its own CUDA stream")
    a = ap.parse_args(argv)
    if a.switch_ms:
        sys.setswitchinterval(a.switch_ms / 1000)
    dev = torch.device("cuda")
    if a.table_checks == "per-call":
        from lmtier.codec.pca import native_decode

        queue = native_decode.queue
        native_decode.queue = lambda *args, **kw: queue(*args, **{**kw, "tables_ok": None})
    geom = (32, 8, 128, 1)
    m = bench.model_for(geom, bench.MIN_CALIB_TOKENS)
    chunks = [bench.synthetic_kv(geom, 256, 256 * i, 100 + i).to(dev) for i in range(a.chunks)]
    recs = [pca.encode(c, start=256 * i, model=m, level=a.level) for i, c in enumerate(chunks)]
    gb = kv_gb = sum(c.numel() * c.element_size() for c in chunks) / 1e9
    records = a.chunks  # decoded (or encoded) a pass
    pool = ThreadPoolExecutor(a.threads, thread_name_prefix=a.op)
    if a.op == "decode":
        one_pass = lambda: list(pool.map(lambda r: bench.decode_one(r, m, dev), recs))  # noqa: E731
    elif a.op == "put":
        one_pass = put_pass(pool, chunks, m, a.level, recs)
    elif a.op == "get":
        one_pass = get_pass(pool, a.threads, chunks, m, a.level, recs, a.get_batch or a.chunks, a.get_stream)
        gb, records = gb * a.threads, records * a.threads  # each thread reads every chunk
    else:
        one_pass = lambda: list(pool.map(lambda i: encode_one(chunks[i], 256 * i, m, a.level), range(a.chunks)))  # noqa: E731
        assert one_pass() == recs, "the encode gave other bytes"
    one_pass()  # warm-up: lookups, handles, streams
    torch.cuda.synchronize()
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < a.seconds:
        one_pass()
        n += 1
    torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    print(
        f"{a.level} {a.op}: {n} passes of {a.chunks} chunks with {a.threads} threads: {n * gb / dt:.1f} GB/s of bf16 KV"
    )
    if a.ceiling:
        ceiling(chunks, recs, kv_gb, a.seconds / 4)
    if a.profile:
        profile(one_pass, a.profile, records, gb)
    if a.breakdown:
        breakdown(one_pass, a.breakdown, records, gb, a.op)
    pool.shutdown()
    return 0


_local = threading.local()


def encode_one(chunk: torch.Tensor, start: int, m: pca.PCAModel, level: str) -> bytes:
    """``pca.encode`` of ``chunk`` on this thread's own stream (made on first use), as a tier's store
    thread encodes."""
    s = _local.__dict__.get("stream")
    if s is None:
        s = _local.stream = torch.cuda.Stream(device=chunk.device)
    s.wait_stream(torch.cuda.current_stream(chunk.device))
    with torch.cuda.stream(s):
        return pca.encode(chunk, start=start, model=m, level=level)


class _Sink(Tier):
    """An inner tier whose put copies the record once into a buffer of its thread with the GIL
    released (a send's or a write's stand-in) and keeps the first record of each key for the check;
    its reads copy the record into the caller's buffer with the GIL released (as the disk tier's
    reads do)."""

    def __init__(self) -> None:
        super().__init__()
        self.last: dict[bytes, bytes] = {}
        self._buf = threading.local()

    def put(self, key: bytes, payload, **kw) -> bool:
        mv = memoryview(payload).cast("B")
        buf = self._buf.__dict__.get("b")
        if buf is None or buf.size < mv.nbytes:
            buf = self._buf.b = np.empty(mv.nbytes, np.uint8)
        # the GIL released, as a disk tier's write or a socket's send copies (a memoryview slice
        # assignment would hold it: a quarter of the GIL-held samples of two storing threads)
        np.copyto(buf[: mv.nbytes], np.frombuffer(mv, np.uint8))
        if key not in self.last:
            self.last[key] = bytes(mv)
        return True

    def contains(self, key: bytes) -> bool:
        return key in self.last

    def get_into(self, key: bytes, out) -> int | None:
        rec = self.last.get(key)
        if rec is None:
            return None
        # the GIL released, as lmtier.tiers.buffers.copy_into (the disk tier's) copies; written out here so
        # an A/B can run this file over an older lmtier
        np.copyto(np.frombuffer(out, np.uint8, count=len(rec)), np.frombuffer(rec, np.uint8))
        return len(rec)

    def get_many_into(self, keys, outs) -> list[int | None]:  # a batching inner tier (Redis, Mooncake)
        return [self.get_into(k, o) for k, o in zip(keys, outs, strict=True)]

    def delete(self, key: bytes) -> bool:
        return False

    def forget(self, key: bytes) -> bool:
        return False

    def usage(self) -> TierUsage:
        return TierUsage(capacity_bytes=0, used_bytes=0, num_chunks=len(self.last))


def put_pass(pool: ThreadPoolExecutor, chunks: list[torch.Tensor], m: pca.PCAModel, level: str, recs: list[bytes]):
    """One pass of ``PCACodecTier.put`` of every chunk from page-locked host memory, the GPU encoding
    (checked once: the records are ``recs``)."""
    c0 = chunks[0]
    sink = _Sink()
    tier = PCACodecTier(sink, shape=tuple(c0.shape), dtype=c0.dtype, level=level, model=m, encode_device=c0.device)
    host = [c.cpu().pin_memory().view(-1).view(torch.uint8) for c in chunks]
    keys = [bytes([i + 1]) * 32 for i in range(len(chunks))]

    def one(i: int) -> bool:
        return tier.put(keys[i], host[i], position=256 * i)

    def one_pass() -> list[bool]:
        return list(pool.map(one, range(len(chunks))))

    def checked_pass() -> list[bool]:
        ok = one_pass()
        c = tier.counters
        assert all(ok) and c["gpu_encode_fallbacks"] == 0 and c["gpu_encodes"] == c["puts"], ("not all on the GPU", c)
        return ok

    checked_pass()
    assert [sink.last[tier.inner_key(k)] for k in keys] == recs, "the tier stored other bytes"
    return checked_pass


def _copy_rate(dst: list[torch.Tensor], src: list[torch.Tensor], seconds: float) -> float:
    """Bytes per second of ``dst[i].copy_(src[i], non_blocking=True)`` for all ``i``, on the current
    stream, repeated for ``seconds`` (synchronised at the end)."""
    nbytes = sum(t.numel() * t.element_size() for t in src)
    torch.cuda.synchronize()
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        for d, s_ in zip(dst, src):
            d.copy_(s_, non_blocking=True)
        torch.cuda.synchronize()
        n += 1
    return n * nbytes / (time.perf_counter() - t0)


def ceiling(chunks: list[torch.Tensor], recs: list[bytes], gb: float, seconds: float) -> None:
    """Print the copies that bound a decode (and an encode) in this run: the records' bytes from
    page-locked host memory to the device (a decode's input; as GB/s of bf16 KV at the records'
    ratio) and a device-to-device copy of the chunks (the KV written once)."""
    dev = chunks[0].device
    host = [torch.frombuffer(bytearray(r), dtype=torch.uint8).pin_memory() for r in recs]
    on_dev = [torch.empty_like(h, device=dev) for h in host]
    h2d = _copy_rate(on_dev, host, seconds)
    ratio = gb * 1e9 / sum(len(r) for r in recs)
    d2d = _copy_rate([torch.empty_like(c) for c in chunks], chunks, seconds)
    host_kv = [c.cpu().pin_memory() for c in chunks]
    h2d_kv = _copy_rate([torch.empty_like(c) for c in chunks], host_kv, seconds)
    print(
        f"ceiling: records host->device {h2d / 1e9:.1f} GB/s x ratio {ratio:.2f} = "
        f"{h2d * ratio / 1e9:.1f} GB/s of bf16 KV; "
        f"bf16 KV host->device {h2d_kv / 1e9:.1f} GB/s; device->device copy of the KV {d2d / 1e9:.1f} GB/s"
    )


def get_pass(pool: ThreadPoolExecutor, threads: int, chunks: list[torch.Tensor], m: pca.PCAModel, level: str,
             recs: list[bytes], batch: int, on_stream: bool):  # fmt: skip
    """One pass of the product's batched read: each of ``threads`` threads reads every chunk, ``batch``
    chunks per ``PCACodecTier.get_many_into``, into its own CUDA destinations (records copied out of a
    batching inner tier in memory; decodes queued ahead as the tier queues them), with its own CUDA
    stream as ``stream=`` (synchronized once at the end of its reads) when ``on_stream``; checked once
    against the chunks' decodes."""
    c0 = chunks[0]
    sink = _Sink()
    tier = PCACodecTier(sink, shape=tuple(c0.shape), dtype=c0.dtype, level=level, model=m)
    keys = [bytes([i + 1]) * 32 for i in range(len(chunks))]
    for k, r in zip(keys, recs, strict=True):
        sink.last[tier.inner_key(k)] = r
    outs = [[torch.empty(c0.numel() * c0.element_size(), dtype=torch.uint8, device=c0.device) for _ in chunks]
            for _ in range(threads)]  # fmt: skip

    streams = [torch.cuda.Stream(device=c0.device) if on_stream else None for _ in range(threads)]

    def one(j: int) -> list[int | None]:
        got: list[int | None] = []
        for b in range(0, len(keys), batch):
            got += tier.get_many_into(keys[b : b + batch], outs[j][b : b + batch], stream=streams[j])
        if streams[j] is not None:
            streams[j].synchronize()
        return got

    def one_pass() -> list[list[int | None]]:
        return list(pool.map(one, range(threads)))

    got = one_pass()
    assert all(n == outs[0][0].numel() for ns in got for n in ns), got
    want = [bench.decode_one(r, m, c0.device).reshape(-1).view(torch.uint8) for r in recs]
    assert all(torch.equal(o, w) for os_ in outs for o, w in zip(os_, want, strict=True)), "another chunk read"
    return one_pass


def busy_us(intervals: list[tuple[float, float]]) -> float:
    """Microseconds covered by the union of ``(start, end)`` intervals (µs)."""
    total, end = 0.0, float("-inf")
    for s0, s1 in sorted(intervals):
        if s1 <= end:
            continue
        total += s1 - max(s0, end)
        end = s1
    return total


def profile(run_pass, passes: int, records: int, gb: float) -> None:
    """Print the GPU's busy share of ``passes`` calls of ``run_pass`` (each decoding ``records`` records,
    ``gb`` GB of KV) and each kernel name's device µs per record, from ``torch.profiler``'s CUDA events."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as tprofile

    with tprofile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        for _ in range(passes):
            run_pass()
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) * 1e6
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    iv = [(e.time_range.start, e.time_range.end) for e in events]
    busy = busy_us(iv)
    span = (max(e for _, e in iv) - min(s for s, _ in iv)) if iv else 0.0
    n = passes * records
    rate = passes * gb / wall * 1e6
    print(
        f"profile: {passes} passes, {n} records, wall {wall / n:.0f} µs a record ({rate:.1f} GB/s "
        f"under the profiler); GPU busy {busy / n:.0f} µs a record = {100 * busy / max(span, 1):.0f} % of the span "
        f"of its events ({span / n:.0f} µs a record)"
    )
    per: dict[str, list[float]] = {}
    for e in events:
        per.setdefault(e.name[:60], []).append(e.time_range.end - e.time_range.start)
    for name, ds in sorted(per.items(), key=lambda kv: -sum(kv[1]))[:12]:
        print(f"  {sum(ds) / n:8.1f} µs a record  {len(ds) / n:5.1f} a record  {name}")
    api: dict[str, list[float]] = {}  # the host's CUDA runtime and driver calls: which ones wait
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CPU and e.name.startswith("cu"):
            api.setdefault(e.name[:60], []).append(e.time_range.end - e.time_range.start)
    print("  host CUDA API calls (all threads):")
    for name, ds in sorted(api.items(), key=lambda kv: -sum(kv[1]))[:10]:
        print(f"  {sum(ds) / n:8.1f} µs a record  {len(ds) / n:5.1f} a record  max {max(ds):7.1f} µs  {name}")


def _encode_steps(op: str) -> list[tuple[object, str, str]]:
    """The encode's steps :func:`breakdown` times (``op`` "put": the tier's put, the chunk's upload and
    the inner put too)."""
    from lmtier.codec import format as fmt
    from lmtier.codec.encoder import DeviceEncoder
    from lmtier.codec.pca import codec, kernels, streams

    first = [(PCACodecTier, "put", "put"), (DeviceEncoder, "run", "  upload + encode")] if op == "put" else []
    return (
        first
        + [
            (pca, "encode", "encode"),
            (codec, "_device_sections", "  device sections"),
            (kernels, "encode_queued", "    kernels queued"),
            (streams.QueuedEncode, "__init__", "    coder queued"),
            (streams, "host_arrays", "    host arrays (wait)"),
            (streams.QueuedEncode, "runs", "    coder runs (wait, copies)"),
            (fmt, "pack_runs", "  pack"),
        ]
        + ([(_Sink, "put", "inner put")] if op == "put" else [])
    )


def _decode_steps(op: str) -> list[tuple[object, str, str]]:
    """The decode's steps :func:`breakdown` times (``op`` "get": the tier's batched read, the inner
    read and the chunk's copy out too)."""
    from lmtier.codec.pca import codec, kernels, native_decode, scan

    first = [(bench, "decode_one", "record")]
    if op == "get":
        first = [
            (PCACodecTier, "get_many_into", "get_many_into"),
            (_Sink, "get_many_into", "  inner read"),
            (codec, "decode_queued", "  decode_queued"),
        ]
    return (
        first
        + [
            (scan, "scan", "scan + checksum"),
            (codec, "_parse", "parse + checksum (the records the scan leaves)"),
            (native_decode, "queue", "native queue"),
            (kernels._native(), "decode_record", "  of it decode_record"),
            (codec.PendingChunk, "__init__", "PendingChunk"),
            (codec.PendingChunk, "result", "result (wait)"),
        ]
        + ([(PCACodecTier, "_deliver", "deliver (copy out)")] if op == "get" else [])
    )


def breakdown(run_pass, passes: int, records: int, gb: float, op: str = "decode") -> None:
    """Print the mean µs a record of each step over ``passes`` calls of ``run_pass``, timed on the
    threads that run them (module attributes wrapped for the duration): the decode's steps
    (:func:`_decode_steps`), or for ``op`` "encode" and "put" the encode's (:func:`_encode_steps`)."""
    spent: dict[str, list[float]] = {}

    def timed(name, fn):
        def wrapper(*args, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kw)
            finally:
                spent.setdefault(name, []).append(time.perf_counter() - t0)

        return wrapper

    patches = _encode_steps(op) if op in ("encode", "put") else _decode_steps(op)
    saved = [(obj, attr, getattr(obj, attr)) for obj, attr, _ in patches]
    for obj, attr, name in patches:
        setattr(obj, attr, timed(name, getattr(obj, attr)))
    try:
        t0 = time.perf_counter()
        for _ in range(passes):
            run_pass()
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    finally:
        for obj, attr, fn in saved:
            setattr(obj, attr, fn)
    n = passes * records
    print(f"breakdown: {n} records, {passes * gb / wall:.1f} GB/s, wall {wall / n * 1e6:.0f} µs a record; per record:")
    for _, _, name in patches:
        ds = spent.get(name, [])
        print(f"  {1e6 * sum(ds) / n:8.0f} µs  {name} ({len(ds)} calls)")


if __name__ == "__main__":
    raise SystemExit(main())
