"""Redis tier store/load bandwidth for large values vs ``redis-benchmark`` and other clients.

Usage::

    python benchmarks/bench_remote.py [--url redis://host:port/0] [--size-mib 32] [--iters 20]
        [--json out.json]

Without ``--url`` a private ``redis-server`` is started on 127.0.0.1 (no persistence,
``proto-max-bulk-len`` raised). Bytes declared: payload bytes per value. Rows:

* ``redis-benchmark`` ``-d SIZE -t set,get -n N -c 1`` (the server's own C client; the ceiling)
  and ``-c 2``;
* redis-py (+ hiredis when installed): ``SET`` of a ``bytes`` value, ``GET`` returning ``bytes``,
  and ``GET`` + copy into a caller buffer (what a tier must do);
* redis-py pipelined ``GETRANGE`` in 4 MiB pieces into a caller buffer;
* valkey-glide (async client, when installed): ``SET``/``GET``;
* ``RedisTier.put`` / ``RedisTier.get_into`` (record header, xxh3 checksum on both sides).

Median of ``iters`` timed calls after warm-up, single caller, loopback. Also runnable as
``pytest benchmarks/bench_remote.py`` (a tiny smoke run).
"""

from __future__ import annotations

import argparse
import asyncio
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

from lmtier.bench.common import print_table, system_header, write_json  # noqa: E402
from lmtier.tiers.disk import AlignedBuffer  # noqa: E402
from lmtier.tiers.remote import RedisTier  # noqa: E402

MiB = 1 << 20


def _median_gbps(fn, size: int, iters: int, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
    ts = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return size / statistics.median(ts) / 1e9


def redis_benchmark(host: str, port: int, size: int, n: int, clients: int) -> dict:
    exe = shutil.which("redis-benchmark")
    if exe is None:
        return {}
    r = subprocess.run([exe, "-h", host, "-p", str(port), "-d", str(size), "-t", "set,get", "-n", str(n),
                        "-c", str(clients), "-q"], capture_output=True, text=True, timeout=600)
    out = {}
    for op, rps in re.findall(r"(SET|GET): ([\d.]+) requests per second", r.stdout.replace("\r", "\n")):
        out[op.lower()] = float(rps) * size / 1e9 * 1.0
    return out


def bench(url: str, *, size: int, iters: int, rb_n: int) -> dict:
    u = urllib.parse.urlsplit(url)
    host, port = u.hostname, u.port or 6379
    data = os.urandom(size)
    src = AlignedBuffer(size)
    src.mv[:size] = data
    out = AlignedBuffer(size)
    rows = []
    for c in (1, 2):
        rb = redis_benchmark(host, port, size, rb_n, c)
        if rb:
            rows.append({"client": f"redis-benchmark -c {c}", "set_GBps": rb.get("set"), "get_GBps": rb.get("get")})

    import redis

    try:
        import hiredis  # noqa: F401

        parser = "hiredis"
    except ImportError:
        parser = "python"
    r = redis.Redis.from_url(url, socket_timeout=30)
    r.set("bench:py", data)
    row = {"client": f"redis-py {redis.__version__} ({parser})",
           "set_GBps": _median_gbps(lambda: r.set("bench:py", data), size, iters),
           "get_GBps": _median_gbps(lambda: r.get("bench:py"), size, iters)}
    rows.append(row)

    def get_copy():
        out.mv[:size] = r.get("bench:py")

    rows.append({"client": "redis-py GET + copy into buffer", "get_GBps": _median_gbps(get_copy, size, iters)})
    piece = 4 * MiB

    def getrange():
        p = r.pipeline(transaction=False)
        for off in range(0, size, piece):
            p.getrange("bench:py", off, min(off + piece, size) - 1)
        o = 0
        for b in p.execute():
            out.mv[o : o + len(b)] = b
            o += len(b)

    rows.append({"client": "redis-py pipelined GETRANGE 4 MiB", "get_GBps": _median_gbps(getrange, size, iters)})
    r.delete("bench:py")
    r.close()

    try:
        import glide

        async def glide_bench():
            from glide import GlideClient, GlideClientConfiguration, NodeAddress

            c = await GlideClient.create(GlideClientConfiguration([NodeAddress(host, port)], request_timeout=30000))
            res = {}
            for op in ("set", "get"):
                ts = []
                for i in range(iters + 2):
                    t0 = time.perf_counter()
                    if op == "set":
                        await c.set("bench:glide", data)
                    else:
                        await c.get("bench:glide")
                    if i >= 2:
                        ts.append(time.perf_counter() - t0)
                res[op] = size / statistics.median(ts) / 1e9
            await c.delete(["bench:glide"])
            await c.close()
            return res

        g = asyncio.run(glide_bench())
        from importlib.metadata import version

        rows.append({"client": f"valkey-glide {version('valkey-glide')} (async)", "set_GBps": g["set"],
                     "get_GBps": g["get"]})
    except ImportError:
        pass

    tier = RedisTier(url, timeout_s=5.0)
    k = b"\x01" * 32
    rows.append({"client": "lmtier RedisTier (put / get_into, checksummed)",
                 "set_GBps": _median_gbps(lambda: tier.put(k, src.mv[:size]), size, iters),
                 "get_GBps": _median_gbps(lambda: tier.get_into(k, out.mv), size, iters)})
    assert bytes(out.mv[:size]) == data
    tier.delete(k)
    tier.close()
    ceiling = rows[0] if rows[0]["client"].startswith("redis-benchmark") else None
    if ceiling:
        for row in rows:
            for op in ("set", "get"):
                if row.get(f"{op}_GBps") and ceiling.get(f"{op}_GBps"):
                    row[f"{op}_%rb"] = 100 * row[f"{op}_GBps"] / ceiling[f"{op}_GBps"]
    return {"system": system_header(), "url": url.split("@")[-1], "value_bytes": size, "iters": iters, "rows": rows}


def run(url: str | None, *, size: int, iters: int, rb_n: int) -> dict:
    if url:
        return bench(url, size=size, iters=iters, rb_n=rb_n)
    from redis_server import RedisServer

    srv = RedisServer(extra_args=("--proto-max-bulk-len", "1gb", "--client-query-buffer-limit", "1gb")).start()
    try:
        res = bench(srv.url, size=size, iters=iters, rb_n=rb_n)
        res["server"] = subprocess.run([srv.binary, "--version"], capture_output=True, text=True).stdout.strip()
        return res
    finally:
        srv.close()


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--url")
    ap.add_argument("--size-mib", type=int, default=32)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--rb-requests", type=int, default=50, help="redis-benchmark -n")
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    res = run(a.url, size=a.size_mib * MiB, iters=a.iters, rb_n=a.rb_requests)
    print(f"# {res['system']} {res.get('server', '')}")
    print(f"# {a.size_mib} MiB values, loopback, one caller")
    print_table(res["rows"], ["client", "set_GBps", "set_%rb", "get_GBps", "get_%rb"])
    write_json(a.json, res)


def test_bench_remote_smoke():
    import pytest

    if shutil.which("redis-server") is None:
        pytest.skip("redis-server not installed")
    res = run(None, size=1 * MiB, iters=3, rb_n=5)
    assert any(r["client"].startswith("lmtier") and r["get_GBps"] > 0 for r in res["rows"])


if __name__ == "__main__":
    main()
