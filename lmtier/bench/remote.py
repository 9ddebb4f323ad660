"""Redis tier store/load bandwidth for large values vs a raw-socket ceiling, ``redis-benchmark``
and the Python clients.

Usage::

    lmtier bench remote [--url redis://host:port/0] [--size-mib 32] [--iters 5]
        [--rounds 3] [--rb-requests 50] [--pieces-mib 1,2,4,8,16] [--inflight 1,4]
        [--io-threads N] [--json out.json]

Without ``--url`` a private ``redis-server`` is started on 127.0.0.1 (no persistence,
``proto-max-bulk-len`` raised; ``--io-threads N`` adds ``io-threads N`` and
``io-threads-do-reads yes``). Bytes counted: payload bytes per value. Rows:

* ``raw socket GETRANGE <first --pieces-mib> pieces -> recv_into`` (GET loads only; the ceiling,
  ``%ceil`` divides by it): a plain TCP socket sends the pipelined ``GETRANGE`` pieces and
  receives each bulk reply straight into a caller buffer with ``recv_into`` — no client library,
  no copy besides the kernel's, no checks: what the server and the loopback deliver to a Python
  caller. ``raw socket GET -> recv_into`` is the same with one ``GET`` of the whole value (slower
  for large values: the server builds one value-sized reply buffer per GET);
* ``redis-benchmark -d SIZE -t set,get -n N -c 1`` (the server's own C client; it builds each
  reply in a growing buffer, so with large values it is slower than the raw socket) and, once,
  ``-c 2``; the ``%rb`` columns divide by ``-c 1``;
* redis-py (+ hiredis when installed), stock client: ``SET`` of a ``bytes`` value, ``GET``
  returning ``bytes``, and ``GET`` + copy into a caller buffer (what a tier must do);
* valkey-glide (when installed): ``SET``/``GET`` (bytes) through its async client;
* ``RedisTier.put`` / ``RedisTier.get_into`` (record header, xxh3 checksum on both sides,
  visibility-on-complete writes, verified reads) for each piece size in ``--pieces-mib``, with the
  pieces received straight into the buffer (``direct``, the default) and through redis-py's reply
  parser (``parser``, ``direct_reads=False``, the path before).

GET loads are also measured with k callers in flight for each k in ``--inflight`` (each on its own
connection and buffer, all reading at once; GB/s = all bytes / wall time), which is how the TTFT
bench reads (4 in flight). The machine may be shared and noisy, so the measurement is interleaved:
each of ``--rounds`` rounds runs ``redis-benchmark -c 1`` and then ``--iters`` timed calls of every
row; a row's GB/s is the median of all its timed calls, the ``redis-benchmark`` ceiling the median
of the rounds' results (all listed in the JSON). Loopback. A tiny smoke run: ``pytest
benchmarks/bench_remote.py``.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import concurrent.futures
import os
import re
import shutil
import socket
import statistics
import subprocess
import time
import urllib.parse

from lmtier.bench.args import bounded_float, bounded_int, float_list, int_list, output_file, ping_redis, redis_url
from lmtier.bench.common import (
    add_common_args,
    plot_bars,
    print_table,
    progress,
    report_plot,
    system_header,
    write_json,
)
from lmtier.bench.presets import preset
from lmtier.testing.redis import RedisServer, find_redis_server
from lmtier.tiers.buffers import AlignedBuffer
from lmtier.tiers.redis import RedisTier

MiB = 1 << 20


def redis_benchmark(host: str, port: int, size: int, n: int, clients: int) -> dict:
    exe = shutil.which("redis-benchmark")
    if exe is None:
        return {}
    r = subprocess.run(
        [exe, "-h", host, "-p", str(port), "-d", str(size), "-t", "set,get", "-n", str(n), "-c", str(clients), "-q"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    return {
        op.lower(): float(rps) * size / 1e9
        for op, rps in re.findall(r"(SET|GET): ([\d.]+) requests per second", r.stdout.replace("\r", "\n"))
    }


class RawGet:
    """``GET`` on a plain socket, the bulk reply received with ``recv_into`` into ``out`` (the
    ceiling row; no checks beyond the RESP framing)."""

    def __init__(self, host: str, port: int, password: str | None = None) -> None:
        self.sock = socket.create_connection((host, port), timeout=30)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if password:
            pw = password.encode()
            self.sock.sendall(b"*2\r\n$4\r\nAUTH\r\n$%d\r\n%s\r\n" % (len(pw), pw))
            if not self.sock.recv(64).startswith(b"+OK"):
                raise RuntimeError("raw socket: AUTH failed")
        self.line = bytearray(64)

    def get_into(self, name: bytes, out: memoryview, piece: int = 0) -> int:
        """``GET name`` (``piece`` 0) or pipelined ``GETRANGE`` pieces of ``piece`` bytes that
        cover ``len(out)`` bytes; returns the bytes received into ``out``."""
        if piece:
            a = [str(o).encode() for o in range(0, len(out), piece)]
            b = [str(min(o + piece, len(out)) - 1).encode() for o in range(0, len(out), piece)]
            self.sock.sendall(
                b"".join(
                    b"*4\r\n$8\r\nGETRANGE\r\n$%d\r\n%s\r\n$%d\r\n%s\r\n$%d\r\n%s\r\n"
                    % (len(name), name, len(x), x, len(y), y)
                    for x, y in zip(a, b)
                )
            )
        else:
            self.sock.sendall(b"*2\r\n$3\r\nGET\r\n$%d\r\n%s\r\n" % (len(name), name))
        pos = 0
        for _ in range(len(a) if piece else 1):
            pos += self._bulk_into(out[pos:])
        return pos

    def _bulk_into(self, out: memoryview) -> int:
        lv, got = memoryview(self.line), 0
        while (j := self.line.find(b"\r\n", 0, got)) < 0:  # small reads until the "$<n>" line is in
            got += self.sock.recv_into(lv[got:], 16)
        n = int(self.line[1:j])
        pre = got - (j + 2)
        out[:pre] = lv[j + 2 : got]
        pos = pre
        while pos < n + 2:
            if pos < n:
                pos += self.sock.recv_into(out[pos:n])
            else:
                pos += self.sock.recv_into(lv[: n + 2 - pos])
        return n

    def close(self) -> None:
        self.sock.close()


def _clients(url: str, host: str, port: int, size: int, pieces: list[int], callers: int):
    """(row name, {op: callable}) for every client row, plus a cleanup callable. ``get``
    callables take the caller index ``j`` (< ``callers``): each caller has its own buffer."""
    import redis

    data = os.urandom(size)
    src = AlignedBuffer(size)
    src.mv[:size] = data
    outs = [AlignedBuffer(size) for _ in range(callers)]
    rows, cleanup = [], []
    try:
        import hiredis  # noqa: F401

        parser = "hiredis"
    except ImportError:
        parser = "python"
    r = redis.Redis.from_url(url, socket_timeout=30, max_connections=callers + 2)
    r.set("bench:py", data)

    password = urllib.parse.unquote(urllib.parse.urlsplit(url).password or "") or None
    raws = [RawGet(host, port, password) for _ in range(callers)]
    assert raws[0].get_into(b"bench:py", outs[0].mv) == size and bytes(outs[0].mv[:size]) == data
    rows.append(
        (
            f"raw socket GETRANGE {pieces[0] / MiB:g} MiB pieces -> recv_into (ceiling)",
            {"get": lambda j=0: raws[j].get_into(b"bench:py", outs[j].mv, pieces[0])},
        )
    )
    rows.append(("raw socket GET -> recv_into", {"get": lambda j=0: raws[j].get_into(b"bench:py", outs[j].mv)}))
    cleanup.append(lambda: [x.close() for x in raws])

    def get_copy(j=0):
        outs[j].mv[:size] = r.get("bench:py")

    rows.append(
        (
            f"redis-py {redis.__version__} ({parser}) SET/GET bytes",
            {"set": lambda: r.set("bench:py", data), "get": lambda j=0: r.get("bench:py")},
        )
    )
    rows.append(("redis-py GET + copy into buffer", {"get": get_copy}))
    cleanup.append(lambda: (r.delete("bench:py"), r.close()))

    try:
        from importlib.metadata import version

        from glide import GlideClient, GlideClientConfiguration, NodeAddress

        loop = asyncio.new_event_loop()
        g = loop.run_until_complete(
            GlideClient.create(GlideClientConfiguration([NodeAddress(host, port)], request_timeout=30000))
        )
        loop.run_until_complete(g.set("bench:glide", data))
        rows.append(
            (
                f"valkey-glide {version('valkey-glide')} (async) SET/GET bytes",
                {
                    "set": lambda: loop.run_until_complete(g.set("bench:glide", data)),
                    "get": lambda j=0: loop.run_until_complete(g.get("bench:glide")),
                },
            )
        )  # one caller only

        def glide_close():
            loop.run_until_complete(g.delete(["bench:glide"]))
            loop.run_until_complete(g.close())
            loop.close()

        cleanup.append(glide_close)
    except ImportError:
        pass

    for p in pieces:
        for direct in (True, False):
            tier = RedisTier(url, timeout_s=30.0, piece_bytes=p, direct_reads=direct, max_connections=callers + 1)
            k = (b"\x01" * 31) + bytes([p.bit_length()])
            if direct:
                assert tier.put(k, src.mv[:size])
            assert tier.get_into(k, outs[0].mv) == size and bytes(outs[0].mv[:size]) == data

            def get(j=0, tier=tier, k=k):
                assert tier.get_into(k, outs[j].mv) == size

            ops = {"get": get}
            if direct:  # put does not depend on direct_reads: measured once per piece size
                ops["set"] = lambda tier=tier, k=k: tier.put(k, src.mv[:size])
            rows.append(
                (
                    f"lmtier RedisTier, {p / MiB:g} MiB pieces, {'direct' if direct else 'parser'}"
                    f"{' (put / get_into)' if direct else ' (get_into before)'}",
                    ops,
                )
            )
            cleanup.append(lambda tier=tier, k=k, direct=direct: (tier.delete(k) if direct else None, tier.close()))
    return rows, cleanup


def _timed(fn, k: int, pool) -> float:
    """Seconds for ``k`` concurrent calls ``fn(0..k-1)`` (one call when k == 1)."""
    t0 = time.perf_counter()
    if k == 1:
        fn(0)
    else:
        for f in [pool.submit(fn, j) for j in range(k)]:
            f.result()
    return time.perf_counter() - t0


def bench(
    url: str,
    *,
    size: int,
    iters: int,
    rounds: int,
    rb_n: int,
    pieces: list[int],
    inflight: list[int] = (1,),
    quiet: bool = True,
) -> dict:
    u = urllib.parse.urlsplit(url)
    host, port = u.hostname, u.port or 6379
    inflight = sorted(set(inflight) | {1})
    rows, cleanup = _clients(url, host, port, size, pieces, max(inflight))
    single = {name for name, _ in rows if name.startswith("valkey-glide")}  # one event loop: one caller
    samples: dict = collections.defaultdict(list)
    rb_rounds = []
    pool = concurrent.futures.ThreadPoolExecutor(max(inflight))
    try:
        for _ in progress(range(rounds), desc="redis rounds", disable=quiet):
            rb = redis_benchmark(host, port, size, rb_n, 1)
            if rb:
                rb_rounds.append(rb)
            for op_pass in ("get", "set"):  # all loads, then all stores: no load right after a put
                for name, ops in rows:
                    if op_pass not in ops:
                        continue
                    op, fn = op_pass, ops[op_pass]
                    for k in inflight if op == "get" and name not in single else [1]:
                        call = fn if op == "get" else (lambda j, fn=fn: fn())
                        _timed(call, k, pool)  # warm-up
                        for _ in range(iters):
                            samples[(name, op, k)].append(k * size / _timed(call, k, pool) / 1e9)
        rb2 = redis_benchmark(host, port, size, rb_n, 2)
    finally:
        pool.shutdown()
        for c in cleanup:
            c()
    table = []
    if rb_rounds:
        table.append(
            {
                "client": "redis-benchmark -c 1",
                "set_GBps": statistics.median(r["set"] for r in rb_rounds),
                "get_GBps": statistics.median(r["get"] for r in rb_rounds),
                "rounds": rb_rounds,
            }
        )
    if rb2:
        table.append({"client": "redis-benchmark -c 2", "set_GBps": rb2.get("set"), "get_GBps": rb2.get("get")})
    for name, ops in rows:
        row = {"client": name}
        for op in ops:
            row[f"{op}_GBps"] = statistics.median(samples[(name, op, 1)])
            row[f"{op}_samples"] = samples[(name, op, 1)]
        if "get" in ops and name not in single:
            for k in inflight[1:]:
                row[f"get_x{k}_GBps"] = statistics.median(samples[(name, "get", k)])
                row[f"get_x{k}_samples"] = samples[(name, "get", k)]
        table.append(row)
    rb = table[0] if rb_rounds else None
    ceil = next(r for r in table if r["client"].startswith("raw socket GETRANGE"))
    for row in table:
        for op in ("set", "get"):
            if rb and row.get(f"{op}_GBps") and rb.get(f"{op}_GBps"):
                row[f"{op}_%rb"] = 100 * row[f"{op}_GBps"] / rb[f"{op}_GBps"]
        for col in ["get_GBps"] + [f"get_x{k}_GBps" for k in inflight[1:]]:
            if row.get(col) and ceil.get(col):
                row[col.replace("_GBps", "_%ceil")] = 100 * row[col] / ceil[col]
    return {
        "system": system_header(),
        "url": url.split("@")[-1],
        "value_bytes": size,
        "iters": iters,
        "rounds": rounds,
        "rb_requests": rb_n,
        "inflight": inflight,
        "rows": table,
    }


def run(
    url: str | None,
    *,
    size: int,
    iters: int,
    rounds: int = 3,
    rb_n: int = 50,
    pieces: list[int] = (MiB,),
    inflight: list[int] = (1,),
    io_threads: int = 1,
    quiet: bool = True,
) -> dict:
    kw = dict(
        size=size, iters=iters, rounds=rounds, rb_n=rb_n, pieces=list(pieces), inflight=list(inflight), quiet=quiet
    )
    if url:
        return bench(url, **kw)
    binary = find_redis_server()
    if binary is None:
        raise SystemExit("lmtier bench remote: no --url and no redis-server (PATH or $LMTIER_REDIS_SERVER)")
    extra = ("--proto-max-bulk-len", "1gb", "--client-query-buffer-limit", "1gb")
    if io_threads > 1:
        extra += ("--io-threads", str(io_threads), "--io-threads-do-reads", "yes")
    srv = RedisServer(extra_args=extra, binary=binary).start()
    try:
        res = bench(srv.url, **kw)
        res["server"] = subprocess.run([binary, "--version"], capture_output=True, text=True).stdout.strip()
        res["io_threads"] = io_threads
        return res
    finally:
        srv.close()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="lmtier bench remote", description=__doc__.split("\n")[0])
    ap.add_argument("--url", type=redis_url, help="an existing Redis/Valkey (default: a private redis-server)")
    ap.add_argument(
        "--size-mib",
        type=bounded_float(above=0),
        default=None,
        help="value size (default: one 256-token chunk of --model-preset; 32 MiB for Llama-3.1-8B)",
    )
    ap.add_argument("--iters", type=bounded_int(min_value=1), default=5, help="timed calls per row and round")
    ap.add_argument("--rounds", type=bounded_int(min_value=1), default=3)
    ap.add_argument("--rb-requests", type=bounded_int(min_value=1), default=50, help="redis-benchmark -n")
    ap.add_argument("--pieces-mib", type=float_list(above=0), default="1,4", help="RedisTier piece sizes to measure")
    ap.add_argument(
        "--inflight", type=int_list(min_value=1), default="1,4", help="GET callers in flight at once, comma-separated"
    )
    ap.add_argument(
        "--io-threads",
        type=bounded_int(min_value=1),
        default=1,
        help="private server only: io-threads N (+ io-threads-do-reads yes) when N > 1",
    )
    ap.add_argument("--json", type=output_file)
    add_common_args(ap)
    a = ap.parse_args(argv)
    if a.url:
        ping_redis(ap.prog, a.url)
    pieces = [int(x * MiB) for x in a.pieces_mib]
    inflight = a.inflight
    size = int(a.size_mib * MiB) if a.size_mib else 256 * preset(a.model_preset).bytes_per_token()
    a.size_mib = size / MiB
    res = run(
        a.url,
        size=size,
        iters=a.iters,
        rounds=a.rounds,
        rb_n=a.rb_requests,
        pieces=pieces,
        inflight=inflight,
        io_threads=a.io_threads,
        quiet=a.quiet,
    )
    res["model_preset"] = a.model_preset
    print(
        f"# {res['system']} {res.get('server', '')}"
        f"{' io-threads ' + str(a.io_threads) if a.io_threads > 1 and not a.url else ''}; load {os.getloadavg()}"
    )
    print(
        f"# {a.size_mib:.2f} MiB values, loopback; {a.rounds} interleaved rounds x {a.iters} calls; "
        f"%rb = % of redis-benchmark -c 1, %ceil = % of the raw-socket GETRANGE ceiling with as many callers in flight"
    )
    cols = ["client", "set_GBps", "set_%rb", "get_GBps", "get_%ceil"]
    for k in res["inflight"][1:]:
        cols += [f"get_x{k}_GBps", f"get_x{k}_%ceil"]
    print_table(res["rows"], cols)
    write_json(a.json, res)
    if a.plot:
        rows = res["rows"]
        why = plot_bars(
            a.plot,
            [r["client"] for r in rows],
            {
                "SET / put": [r.get("set_GBps") for r in rows],
                "GET / get_into": [r.get("get_GBps") for r in rows],
                **{f"GET, {k} in flight": [r.get(f"get_x{k}_GBps") for r in rows] for k in res["inflight"][1:]},
            },
            title=f"Redis on loopback, {a.size_mib:.1f} MiB values ({a.model_preset})",
            ylabel="GB/s",
        )
        report_plot(a.plot, why)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
