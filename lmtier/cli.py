"""``lmtier`` command line: ``lmtier bench <transfer|disk|remote|codec|rans|ttft|all> [options]``."""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

_REPO_BENCH = Path(__file__).resolve().parent.parent / "benchmarks"


def _script(name: str, argv: list[str]) -> int:
    path = _REPO_BENCH / f"bench_{name}.py"
    if not path.exists():
        print(f"lmtier bench {name}: {path} not found (run from a source checkout)", file=sys.stderr)
        return 2
    sys.argv = [str(path), *argv]
    try:
        runpy.run_path(str(path), run_name="__main__")
    except SystemExit as e:  # the scripts exit with their status
        return int(e.code or 0)
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) < 2 or argv[0] != "bench" or argv[1] in ("-h", "--help"):
        print("usage: lmtier bench {transfer,disk,remote,codec,rans,ttft,all} [options]\n"
              "  transfer  paged KV <-> pinned host (GPU; CPU gather/scatter without one)\n"
              "  disk      disk tier vs O_DIRECT dd on the same directory\n"
              "  remote    Redis tier vs redis-benchmark on the same server\n"
              "  codec     quantize+encode / decode+dequantize throughput and ratio per level\n"
              "  rans      the entropy coder alone\n"
              "  ttft      time to first token: recompute vs loading the KV from each tier\n"
              "  all       everything this machine supports", file=sys.stderr)
        return 0 if len(argv) >= 2 else 2
    sub, rest = argv[1], argv[2:]
    if sub == "transfer":
        from lmtier.bench.transfer import main as transfer_main

        return transfer_main(rest)
    if sub == "ttft":
        from lmtier.bench.ttft import main as ttft_main

        return ttft_main(rest)
    if sub in ("disk", "remote", "codec", "rans"):
        return _script(sub, rest)
    if sub == "all":
        rc = 0
        from lmtier.bench.transfer import main as transfer_main

        rc |= transfer_main(["--quiet"])
        rc |= _script("disk", [])
        import shutil

        if shutil.which("redis-server"):
            rc |= _script("remote", [])
        else:
            print("lmtier bench all: skipping remote — redis-server is not installed")
        return rc
    print(f"lmtier bench: unknown subcommand {sub!r}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
