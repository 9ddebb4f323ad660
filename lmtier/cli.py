"""``lmtier`` command line: ``lmtier bench <subcommand> [options]`` (see :data:`USAGE`) and ``lmtier --version``."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable

SUBCOMMANDS: dict[str, str] = {
    "transfer": "lmtier.bench.transfer",
    "disk": "lmtier.bench.disk",
    "remote": "lmtier.bench.remote",
    "mooncake": "lmtier.bench.mooncake",
    "seal": "lmtier.bench.seal",
    "p2p": "lmtier.bench.p2p",
    "codec": "lmtier.bench.codec",
    "rans": "lmtier.bench.rans",
    "ttft": "lmtier.bench.ttft",
}
"""``lmtier bench <name>`` -> the module whose ``main(argv) -> int`` runs it (importable from a wheel)."""


def subcommand_main(name: str) -> Callable[[list[str]], int]:
    """The ``main(argv)`` of subcommand ``name`` (its module imported now, so a test may replace it).

    Raises:
        KeyError: an unknown subcommand.
    """
    return importlib.import_module(SUBCOMMANDS[name]).main


def _run_sub(name: str, argv: list[str]) -> int:
    return int(subcommand_main(name)(argv) or 0)


def _has_gpu() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:  # noqa: BLE001
        return False


def _redis_available() -> str | None:
    """How the remote bench would reach Redis (a URL or a redis-server binary), or None."""
    from lmtier import envs

    if envs.LMTIER_REDIS_URL:
        return envs.LMTIER_REDIS_URL
    from lmtier.testing.redis import find_redis_server

    return find_redis_server()


def _mooncake_missing() -> str | None:
    """Why ``lmtier bench mooncake`` (a private Mooncake master and store server) cannot run here, or None."""
    from lmtier.testing.mooncake import find_mooncake_bin, mooncake_client_importable

    if mooncake_client_importable() is not None:
        return "no Mooncake client"
    missing = [b for b in ("mooncake_master", "mooncake_client") if find_mooncake_bin(b) is None]
    return f"no {' or '.join(missing)}" if missing else None


def _nixl_missing() -> str | None:
    """Why ``lmtier bench p2p`` (NIXL, and a private redis-server for the P2P directory) cannot run here, or None."""
    from lmtier.testing.p2p import nixl_missing
    from lmtier.testing.redis import find_redis_server

    if nixl_missing() is not None:
        return "no NIXL"
    return None if find_redis_server() else "no redis-server for the P2P directory"


def run_all(rest: list[str]) -> int:
    """``lmtier bench all [--model-preset P] [--plot-dir DIR] [--json-dir DIR] [--quick]``: every
    subcommand this machine supports, a line for each one skipped."""
    import argparse
    import os
    import shutil

    from lmtier.bench.args import output_directory
    from lmtier.bench.presets import PRESETS

    p = argparse.ArgumentParser(prog="lmtier bench all")
    p.add_argument("--model-preset", type=str.lower, default="llama-3.1-8b", choices=sorted(PRESETS))
    p.add_argument("--plot-dir", type=output_directory, default=None, help="write <subcommand>.png here")
    p.add_argument("--json-dir", type=output_directory, default=None, help="write <subcommand>.json here")
    p.add_argument("--quick", action="store_true", help="small sizes (a minute or two on a laptop)")
    a = p.parse_args(rest)

    def extra(name: str, plot: bool = True, preset: bool = True) -> list[str]:
        out = ["--model-preset", a.model_preset] if preset else []
        if plot and a.plot_dir:
            out += ["--plot", os.path.join(a.plot_dir, f"{name}.png")]
        if a.json_dir:
            out += ["--json", os.path.join(a.json_dir, f"{name}.json")]
        return out

    gpu = _has_gpu()
    results: dict[str, str] = {}

    def step(name: str, fn, args: list[str]) -> None:
        print(f"==== lmtier bench {name} {' '.join(args)}", flush=True)
        try:
            rc = fn(args)
        except SystemExit as e:
            rc = int(e.code or 0) if not isinstance(e.code, str) else 1
            if isinstance(e.code, str):
                print(e.code)
        except Exception as e:  # noqa: BLE001 - one failing subcommand must not stop the others
            print(f"lmtier bench {name}: failed: {type(e).__name__}: {e}")
            rc = 1
        results[name] = "ok" if rc == 0 else f"rc={rc}"

    def sub(name: str) -> Callable[[list[str]], int]:
        return lambda argv: _run_sub(name, argv)

    quick_t = ["--batches", "1,8", "--cache-gb", "2"] if a.quick else []
    step("transfer", sub("transfer"), ["--quiet", *quick_t, *extra("transfer")])
    if shutil.which("dd"):
        step(
            "disk",
            sub("disk"),
            [
                *(["--count", "4", "--threads", "4", "--sync", "data", "--inflight", "1,4"] if a.quick else []),
                *extra("disk"),
            ],
        )
    else:
        print("lmtier bench all: skipping disk — no dd for the raw-device ceiling")
        results["disk"] = "skipped (no dd)"
    redis = _redis_available()
    redis_url = redis if redis is not None and "://" in redis else None  # else a redis-server binary
    if redis:
        step(
            "remote",
            sub("remote"),
            [
                *(["--iters", "2", "--rounds", "1", "--pieces-mib", "1"] if a.quick else []),
                *(["--url", redis_url] if redis_url else []),
                *extra("remote"),
            ],
        )
    else:
        print(
            "lmtier bench all: skipping remote — no Redis (no redis-server on PATH or $LMTIER_REDIS_SERVER, "
            "no $LMTIER_REDIS_URL)"
        )
        results["remote"] = "skipped (no Redis)"
    no_mooncake = _mooncake_missing()
    if no_mooncake is None:
        step("mooncake", sub("mooncake"), [*(["--quick"] if a.quick else []), *extra("mooncake", False, False)])
    else:
        print(f"lmtier bench all: skipping mooncake — {no_mooncake} (bash scripts/setup_mooncake.sh)")
        results["mooncake"] = f"skipped ({no_mooncake})"
    if redis:
        on_url = ["--redis-url", redis_url] if redis_url else []
        step("seal", sub("seal"), [*(["--quick"] if a.quick else []), *on_url, *extra("seal", False, False)])
    else:
        print("lmtier bench all: skipping seal — no Redis (its tier rows need one)")
        results["seal"] = "skipped (no Redis)"
    no_nixl = _nixl_missing()
    if no_nixl is None:
        step("p2p", sub("p2p"), [*(["--quick"] if a.quick else []), *extra("p2p", False, False)])
    else:
        print(f"lmtier bench all: skipping p2p — {no_nixl} (bash scripts/setup_nixl.sh)")
        results["p2p"] = f"skipped ({no_nixl})"
    step("codec", sub("codec"), [*(["--chunks", "1", "--iters", "1"] if a.quick else []), *extra("codec")])
    if gpu:
        step("ttft", sub("ttft"), [*(["--lengths", "1024,4096,7500"] if a.quick else []), *extra("ttft")])
    else:
        print(
            "lmtier bench all: skipping ttft — no GPU (its CPU smoke run: lmtier bench ttft --device cpu "
            "--preset tiny --lengths 128,512 --chunk-tokens 64)"
        )
        results["ttft"] = "skipped (no GPU)"
    if gpu:
        step("rans", sub("rans"), extra("rans", plot=False, preset=False))
    else:
        print("lmtier bench all: skipping rans — its benchmark needs a GPU (the CPU coder is in pytest benchmarks/)")
        results["rans"] = "skipped (no GPU)"
    print("==== lmtier bench all: " + "; ".join(f"{k}: {v}" for k, v in results.items()))
    return 0 if all(v == "ok" or v.startswith("skipped") for v in results.values()) else 1


USAGE = """usage: lmtier bench {transfer,disk,remote,mooncake,seal,p2p,codec,rans,ttft,all} [options]
       lmtier --version | --help
  transfer  paged KV <-> pinned host (GPU; CPU gather/scatter without one)
  disk      disk tier vs O_DIRECT dd on the same directory (+ pipelined loads)
  remote    Redis tier vs redis-benchmark on the same server
  mooncake  Mooncake Store tier vs the raw Mooncake client vs the Redis tier (a private store)
  seal      Redis tier with checksum only / MAC / MAC + encryption (sealed records), and the primitives
  p2p       P2P fetch over NIXL vs a raw NIXL READ of the same bytes vs the Redis tier
  codec     ratio, quality proxy (SNR, attention error) and encode/decode speed per level
  rans      the entropy coder alone (GPU)
  ttft      time to first token: recompute vs loading the KV from each tier
  all       everything this machine supports, saying what it skips
every subcommand but rans, seal, mooncake and p2p takes --model-preset NAME and --plot PATH.png;
`all` takes --plot-dir DIR; `lmtier bench <subcommand> --help` lists its options"""


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv in (["-V"], ["--version"]):
        from lmtier import __version__

        print(f"lmtier {__version__}")
        return 0
    if argv in (["-h"], ["--help"], ["bench", "-h"], ["bench", "--help"]):
        print(USAGE)  # asked for: stdout, success
        return 0
    if len(argv) < 2 or argv[0] != "bench":
        what = "a subcommand" if argv[:1] == ["bench"] else f"'bench', got {argv[0]!r}" if argv else "'bench'"
        print(f"lmtier: expected {what}\n{USAGE}", file=sys.stderr)
        return 2
    sub, rest = argv[1], argv[2:]
    if sub in SUBCOMMANDS or sub == "all":
        from lmtier.bench.signals import exit_on_sigterm

        exit_on_sigterm()
        return _run_sub(sub, rest) if sub != "all" else run_all(rest)
    print(f"lmtier bench: unknown subcommand {sub!r} (one of: {', '.join([*SUBCOMMANDS, 'all'])})", file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
