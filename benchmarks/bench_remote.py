"""Redis tier store/load bandwidth for large values vs ``redis-benchmark`` and the Python clients.

Usage::

    python benchmarks/bench_remote.py [--url redis://host:port/0] [--size-mib 32] [--iters 5]
        [--rounds 3] [--rb-requests 50] [--pieces-mib 1,2,4,8,16] [--json out.json]

Without ``--url`` a private ``redis-server`` is started on 127.0.0.1 (no persistence,
``proto-max-bulk-len`` raised). Bytes counted: payload bytes per value. Rows:

* ``redis-benchmark -d SIZE -t set,get -n N -c 1`` (the server's own C client: the ceiling that
  the ``%rb`` columns divide by) and, once, ``-c 2``;
* redis-py (+ hiredis when installed), stock client: ``SET`` of a ``bytes`` value, ``GET``
  returning ``bytes``, and ``GET`` + copy into a caller buffer (what a tier must do);
* valkey-glide (when installed): ``SET``/``GET`` (bytes) through its async client;
* ``RedisTier.put`` / ``RedisTier.get_into`` (record header, xxh3 checksum on both sides,
  visibility-on-complete writes, verified reads) for each piece size in ``--pieces-mib``.

The machine may be shared and noisy, so the measurement is interleaved: each of ``--rounds``
rounds runs ``redis-benchmark -c 1`` and then ``--iters`` timed calls of every client row;
a row's GB/s is the median of all its timed calls, the ceiling the median of the rounds'
``redis-benchmark`` results (both listed in the JSON). Single caller, loopback. Also runnable as
``pytest benchmarks/bench_remote.py`` (a tiny smoke run).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
import urllib.parse

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))

from lmtier.bench.common import (add_common_args, plot_bars, preset, print_table, progress,  # noqa: E402
                                 report_plot, system_header, write_json)
from lmtier.tiers.disk import AlignedBuffer  # noqa: E402
from lmtier.tiers.remote import RedisTier  # noqa: E402

MiB = 1 << 20


def redis_benchmark(host: str, port: int, size: int, n: int, clients: int) -> dict:
    exe = shutil.which("redis-benchmark")
    if exe is None:
        return {}
    r = subprocess.run([exe, "-h", host, "-p", str(port), "-d", str(size), "-t", "set,get", "-n", str(n),
                        "-c", str(clients), "-q"], capture_output=True, text=True, timeout=600)
    return {op.lower(): float(rps) * size / 1e9
            for op, rps in re.findall(r"(SET|GET): ([\d.]+) requests per second", r.stdout.replace("\r", "\n"))}


def _clients(url: str, host: str, port: int, size: int, pieces: list[int]):
    """(row name, {op: callable}) for every client row, plus a cleanup callable."""
    import redis

    data = os.urandom(size)
    src = AlignedBuffer(size)
    src.mv[:size] = data
    out = AlignedBuffer(size)
    rows, cleanup = [], []
    try:
        import hiredis  # noqa: F401

        parser = "hiredis"
    except ImportError:
        parser = "python"
    r = redis.Redis.from_url(url, socket_timeout=30)
    r.set("bench:py", data)

    def get_copy():
        out.mv[:size] = r.get("bench:py")

    rows.append((f"redis-py {redis.__version__} ({parser}) SET/GET bytes",
                 {"set": lambda: r.set("bench:py", data), "get": lambda: r.get("bench:py")}))
    rows.append(("redis-py GET + copy into buffer", {"get": get_copy}))
    cleanup.append(lambda: (r.delete("bench:py"), r.close()))

    try:
        from importlib.metadata import version

        from glide import GlideClient, GlideClientConfiguration, NodeAddress

        loop = asyncio.new_event_loop()
        g = loop.run_until_complete(GlideClient.create(
            GlideClientConfiguration([NodeAddress(host, port)], request_timeout=30000)))
        loop.run_until_complete(g.set("bench:glide", data))
        rows.append((f"valkey-glide {version('valkey-glide')} (async) SET/GET bytes",
                     {"set": lambda: loop.run_until_complete(g.set("bench:glide", data)),
                      "get": lambda: loop.run_until_complete(g.get("bench:glide"))}))

        def glide_close():
            loop.run_until_complete(g.delete(["bench:glide"]))
            loop.run_until_complete(g.close())
            loop.close()

        cleanup.append(glide_close)
    except ImportError:
        pass

    for p in pieces:
        tier = RedisTier(url, timeout_s=5.0, piece_bytes=p)
        k = (b"\x01" * 31) + bytes([p.bit_length()])
        assert tier.put(k, src.mv[:size]) and tier.get_into(k, out.mv) == size and bytes(out.mv[:size]) == data

        def get(tier=tier, k=k):
            assert tier.get_into(k, out.mv) == size

        rows.append((f"lmtier RedisTier, {p / MiB:g} MiB pieces (put / get_into)",
                     {"set": lambda tier=tier, k=k: tier.put(k, src.mv[:size]), "get": get}))
        cleanup.append(lambda tier=tier, k=k: (tier.delete(k), tier.close()))
    return rows, cleanup


def bench(url: str, *, size: int, iters: int, rounds: int, rb_n: int, pieces: list[int], quiet: bool = True) -> dict:
    u = urllib.parse.urlsplit(url)
    host, port = u.hostname, u.port or 6379
    rows, cleanup = _clients(url, host, port, size, pieces)
    samples: dict = collections.defaultdict(list)
    rb_rounds = []
    try:
        for _ in progress(range(rounds), desc="redis rounds", disable=quiet):
            rb = redis_benchmark(host, port, size, rb_n, 1)
            if rb:
                rb_rounds.append(rb)
            for name, ops in rows:
                for op, fn in ops.items():
                    fn()  # warm-up
                    for _ in range(iters):
                        t0 = time.perf_counter()
                        fn()
                        samples[(name, op)].append(size / (time.perf_counter() - t0) / 1e9)
        rb2 = redis_benchmark(host, port, size, rb_n, 2)
    finally:
        for c in cleanup:
            c()
    table = []
    if rb_rounds:
        table.append({"client": "redis-benchmark -c 1 (ceiling)",
                      "set_GBps": statistics.median(r["set"] for r in rb_rounds),
                      "get_GBps": statistics.median(r["get"] for r in rb_rounds),
                      "rounds": rb_rounds})
    if rb2:
        table.append({"client": "redis-benchmark -c 2", "set_GBps": rb2.get("set"), "get_GBps": rb2.get("get")})
    for name, ops in rows:
        row = {"client": name}
        for op in ops:
            row[f"{op}_GBps"] = statistics.median(samples[(name, op)])
            row[f"{op}_samples"] = samples[(name, op)]
        table.append(row)
    ceiling = table[0] if rb_rounds else None
    if ceiling:
        for row in table:
            for op in ("set", "get"):
                if row.get(f"{op}_GBps") and ceiling.get(f"{op}_GBps"):
                    row[f"{op}_%rb"] = 100 * row[f"{op}_GBps"] / ceiling[f"{op}_GBps"]
    return {"system": system_header(), "url": url.split("@")[-1], "value_bytes": size, "iters": iters,
            "rounds": rounds, "rb_requests": rb_n, "rows": table}


def run(url: str | None, *, size: int, iters: int, rounds: int = 3, rb_n: int = 50,
        pieces: list[int] = (MiB,), quiet: bool = True) -> dict:
    if url:
        return bench(url, size=size, iters=iters, rounds=rounds, rb_n=rb_n, pieces=list(pieces), quiet=quiet)
    from redis_server import RedisServer

    srv = RedisServer(extra_args=("--proto-max-bulk-len", "1gb", "--client-query-buffer-limit", "1gb")).start()
    try:
        res = bench(srv.url, size=size, iters=iters, rounds=rounds, rb_n=rb_n, pieces=list(pieces), quiet=quiet)
        res["server"] = subprocess.run([srv.binary, "--version"], capture_output=True, text=True).stdout.strip()
        return res
    finally:
        srv.close()


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--url")
    ap.add_argument("--size-mib", type=float, default=None,
                    help="value size (default: one 256-token chunk of --model-preset; 32 MiB for Llama-3.1-8B)")
    ap.add_argument("--iters", type=int, default=5, help="timed calls per row and round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--rb-requests", type=int, default=50, help="redis-benchmark -n")
    ap.add_argument("--pieces-mib", default="1,2,4,8,16", help="RedisTier piece sizes to measure")
    ap.add_argument("--json")
    add_common_args(ap)
    a = ap.parse_args(argv)
    pieces = [int(float(x) * MiB) for x in a.pieces_mib.split(",")]
    size = int(a.size_mib * MiB) if a.size_mib else 256 * preset(a.model_preset).bytes_per_token()
    a.size_mib = size / MiB
    res = run(a.url, size=size, iters=a.iters, rounds=a.rounds, rb_n=a.rb_requests, pieces=pieces, quiet=a.quiet)
    res["model_preset"] = a.model_preset
    print(f"# {res['system']} {res.get('server', '')}")
    print(f"# {a.size_mib:.1f} MiB values, loopback, one caller; {a.rounds} interleaved rounds x {a.iters} calls; "
          f"%rb = % of redis-benchmark -c 1 in this run")
    print_table(res["rows"], ["client", "set_GBps", "set_%rb", "get_GBps", "get_%rb"])
    write_json(a.json, res)
    if a.plot:
        rows = res["rows"]
        why = plot_bars(a.plot, [r["client"] for r in rows],
                        {"SET / put": [r.get("set_GBps") for r in rows], "GET / get_into": [r.get("get_GBps") for r in rows]},
                        title=f"Redis on loopback, {a.size_mib:.1f} MiB values ({a.model_preset})", ylabel="GB/s")
        report_plot(a.plot, why)


def test_bench_remote_smoke():
    import pytest

    if shutil.which("redis-server") is None:
        pytest.skip("redis-server not installed")
    res = run(None, size=1 * MiB, iters=2, rounds=1, rb_n=5, pieces=[256 << 10])
    assert any(r["client"].startswith("lmtier") and r["get_GBps"] > 0 for r in res["rows"])


if __name__ == "__main__":
    main()
