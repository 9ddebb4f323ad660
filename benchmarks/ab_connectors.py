#!/usr/bin/env python3
"""Focused A/B (or A/B/C) TTFT comparison of KV-connector setups at one prompt size, many rounds.

Runs the same vLLM servers as ``benchmarks/bench_connectors.py`` (imported from
``benchmarks/connector_servers.py``: ``Srv``, ``Prompts``, ``write_config``; bf16 SmolLM2, eager,
``--max-num-batched-tokens 8192``, VLLM_CPU_KVCACHE_SPACE=1, every server's OpenMP compute bound to
both cores with VLLM_CPU_OMP_THREADS_BIND=0-1, --gap s of quiet before every request), two or three
servers alive at a time, requests interleaved round by round with the order rotated every round, and
reports (benchmarks/ab_connectors_report.py) per-system medians plus, for every system against the
first one, a paired comparison: the median of the per-round ratios with a distribution-free
(binomial order-statistic) 95 % confidence interval, and a bootstrap 95 % interval of the ratio of
medians (rounds resampled in pairs).

Systems (``--systems``, comma-separated; the first is the reference):
  base         no connector, vLLM prefix caching off
  prefix       no connector, vLLM prefix caching ON (warm mode: vLLM's own prefix-cache hit, the floor)
  lmtier       LMTierConnector, CPU pool + disk tier (benchmarks/peers/lmtier_bench.yaml)
  lmtier-cpu   LMTierConnector, CPU pool only (no disk tier, so no write-through)
  example      vLLM's ExampleConnector (shared_storage_path), same engine
  redis, mooncake, p2p  TWO lmtier servers, node A and node B, with the main job's configs
               (scripts/demo_config/cpu_<store>.yaml: a CPU pool each, no disk; the same templates and
               store helpers as scripts/demo.py's shared phases) sharing a store this script starts on
               loopback for the system: a redis-server (the Redis tier), a Mooncake Store (master + one
               store server holding the data), or -- p2p -- no store tier at all: node B reads node A's
               CPU pool with NIXL READs and a redis-server holds only the P2P directory. Warm mode only:
               the storing request goes to node A, the warm request(s) to node B, which loads the
               prefix from A through the store ("node B's warm TTFT from A"; ``base`` in the same
               rounds is node B cold). p2p: before the warm requests the script waits (<= 30 s) until
               the round's chunks are in the directory (A publishes in the background).
  NAME@ENV=V[+ENV2=V2]  any of the above with extra server environment (e.g. ``lmtier@LMTIER_BG_IO=nice``)

Modes (``--mode``):
  cold   each round every system gets prefix_r + A_r (the same tokens for every system, new every
         round): a cold prefill; connector systems store it.
  warm   each round every system first gets prefix_r + A_r (cold, stores; recorded as "store"), then,
         after all systems stored, prefix_r + B_r (recorded as "warm": a hit of N tokens for
         connector systems and for ``prefix``; a cold prefill for ``base``).

Per request the script also scrapes the server's Prometheus counters and records, for lmtier,
the connector's time in ``wait_for_save`` (``vllm:lmtier_store_seconds``) and its load time
(``vllm:lmtier_load_seconds``), and for every server vLLM's own prefill time
(``vllm:request_prefill_time_seconds``). ``uptime``'s load average is recorded with every request.

Usage (repository root):
  .venv/bin/python benchmarks/ab_connectors.py --n 4096 --rounds 20 --mode cold --systems base,lmtier
  .venv/bin/python benchmarks/ab_connectors.py --n 2048 --rounds 20 --mode warm --systems prefix,lmtier,example
  # node B warm from node A through P2P, Redis and Mooncake, and B cold, one run (7 servers: --kv-cache-gib 0.25)
  .venv/bin/python benchmarks/ab_connectors.py --n 2048 --rounds 10 --mode warm --kv-cache-gib 0.25 \
        --pool-gib 0.25 --systems base,p2p,redis,mooncake [--pairs-in-turn: one pair at a time, 3 servers]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import secrets
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import connector_servers as CS  # noqa: E402  (servers, prompts, configs: the same settings as the side-by-side bench)
from ab_connectors_report import TURN_ROUNDS, interference, report_turns  # noqa: E402

from lmtier.config import load_config  # noqa: E402
from lmtier.testing import procmem  # noqa: E402
from lmtier.testing import stores as STORES  # noqa: E402  (the main job's shared stores and config templates)
from lmtier.testing.procs import free_port  # noqa: E402

log = CS.log
_METRIC = re.compile(
    r"^(vllm:(?:lmtier_store_seconds|lmtier_load_seconds|request_prefill_time_seconds|"
    r"time_to_first_token_seconds|lmtier_stored_chunks_total|lmtier_loaded_chunks_total)"
    r"(?:_sum|_count)?)(?:\{[^}]*\})?\s+(\S+)"
)

CPU_ONLY_YAML = """# lmtier, CPU pool only (ab_connectors.py): no disk tier, so stores are never written through
chunk_size: 256
local_cpu: true
max_local_cpu_size: 3.0
"""


def scrape(srv: CS.Srv) -> dict[str, float]:
    """The few counters this script needs (summed over label sets)."""
    out: dict[str, float] = {}
    try:
        text = srv.session.get(srv.base + "/metrics", timeout=10).text
    except Exception:  # noqa: BLE001
        return out
    for line in text.splitlines():
        m = _METRIC.match(line)
        if m:
            out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(2))
    return out


_TICK = os.sysconf("SC_CLK_TCK")


def cpu_times() -> dict[int, tuple[int, float]]:
    """pid -> (parent pid, user + system CPU seconds) of every process (threads included)."""
    out: dict[int, tuple[int, float]] = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                st = f.read().rsplit(")", 1)[1].split()
            out[int(d)] = (int(st[1]), (int(st[11]) + int(st[12])) / _TICK)
        except (OSError, ValueError, IndexError):
            pass
    return out


def stat_cpu() -> list[int]:
    """The aggregate ``cpu`` line of /proc/stat (user nice system idle iowait irq softirq steal ...) in ticks."""
    with open("/proc/stat") as f:
        return [int(x) for x in f.readline().split()[1:]]


def tree_of(snap: dict[int, tuple[int, float]], root: int) -> set[int]:
    kids: dict[int, list[int]] = {}
    for pid, (ppid, _) in snap.items():
        kids.setdefault(ppid, []).append(pid)
    out, todo = set(), [root]
    while todo:
        p = todo.pop()
        out.add(p)
        todo += kids.get(p, [])
    return out


def system_env(system: str) -> tuple[str, dict[str, str]]:
    """``NAME@ENV=V[+ENV2=V2]`` -> (NAME, {ENV: V, ...})."""
    base, _, envs = system.partition("@")
    env: dict[str, str] = {}
    for kv in filter(None, envs.split("+")):
        k, _, v = kv.partition("=")
        env[k] = v
    return base, env


class AB:
    def __init__(self, a: argparse.Namespace, work: Path):
        self.a, self.work = a, work
        self.prompts = CS.Prompts(a.model)
        self.mem_env, self.notes = procmem.server_mem_env("glibc", None)
        # --kv-cache-gib: vLLM's --kv-cache-memory-bytes (VLLM_CPU_KVCACHE_SPACE takes whole GiB only)
        self.kv_bytes = None if a.kv_cache_gib is None else int(a.kv_cache_gib * 2**30)
        # two-node systems' CPU pools (the templates say 1 GiB): LMTIER_MAX_LOCAL_CPU_SIZE overrides the key
        self.pool_env = {} if a.pool_gib is None else {"LMTIER_MAX_LOCAL_CPU_SIZE": a.pool_gib}
        self.records: list[dict[str, Any]] = []
        self.srvs: dict[str, CS.Srv] = {}  # system -> the server its measured requests go to (node B)
        self.node_a: dict[str, CS.Srv] = {}  # two-node systems: system -> node A (gets the storing requests)
        self.stores: dict[str, tuple[Any, dict[str, str]]] = {}  # two-node systems: system -> (store, values)
        self.chunk_tokens: dict[str, int] = {}  # two-node systems: system -> chunk_size of its config
        self.last: dict[str, dict[str, float]] = {}  # server name -> its counters at the last scrape
        self.generation = 0

    def servers(self) -> list[CS.Srv]:
        """Every server alive (nodes A included)."""
        return [*self.srvs.values(), *self.node_a.values()]

    def start_pair(self, system: str) -> None:
        """Node A and node B of a two-node system (:data:`lmtier.testing.stores.SHARED_STORES`), its store started once
        (kept across server generations): each node gets its own config from the main job's template."""
        kind, env = system_env(system)
        if system not in self.stores:
            self.stores[system] = STORES.start_shared_store(kind, log)
        values = self.stores[system][1]
        token = {STORES.P2P_TOKEN_ENV: secrets.token_urlsafe(24)} if kind == "p2p" else {}
        name = system.replace("/", "_")
        cfgs = [
            STORES.write_config(
                STORES.SHARED_STORES[kind], self.work, f"{name}_{node}", token, P2P_PORT=str(free_port()), **values
            )
            for node in "AB"
        ]
        self.chunk_tokens[system] = load_config(cfgs[0], env=token).chunk_size
        for node, cfg in zip("AB", cfgs, strict=True):
            srv = CS.Srv(
                f"{name}_{node}",
                self.a.python,
                self.work,
                self.a.model,
                CS.lmtier_ktc(self.a),
                {**self.mem_env, **token, "LMTIER_CONFIG_FILE": str(cfg), **self.pool_env, **env},
                kv_cache_bytes=self.kv_bytes,
            )
            (self.node_a if node == "A" else self.srvs)[system] = srv

    def close_stores(self) -> None:
        for store, _ in self.stores.values():
            try:
                store.close()
            except Exception:  # noqa: BLE001
                pass
        self.stores = {}

    def spec(self, system: str) -> tuple[dict | None, dict[str, str], bool]:
        base, env = system_env(system)
        if base in ("base", "prefix"):
            return None, env, base == "prefix"
        if base == "example":
            d = self.work / f"example_store_{len(self.srvs)}"
            d.mkdir(exist_ok=True)
            return (
                {
                    "kv_connector": "ExampleConnector",
                    "kv_role": "kv_both",
                    "kv_connector_extra_config": {"shared_storage_path": str(d)},
                },
                env,
                False,
            )
        if base in ("lmtier", "lmtier-cpu"):
            k = len(self.srvs)
            if base == "lmtier":
                disk = self.work / f"lmtier_disk_{k}"
                disk.mkdir(exist_ok=True)
                cfg = CS.write_config("lmtier_bench.yaml", self.work, DISK_DIR=str(disk))
                cfg = cfg.rename(self.work / f"lmtier_{k}.yaml")
            else:
                cfg = self.work / f"lmtier_cpu_{k}.yaml"
                cfg.write_text(CPU_ONLY_YAML)
            return CS.lmtier_ktc(self.a), {"LMTIER_CONFIG_FILE": str(cfg), **env}, False
        raise SystemExit(f"unknown system {system!r}")

    def start(self) -> None:
        for system in self.a.system_list:
            if system_env(system)[0] in STORES.SHARED_STORES:
                self.start_pair(system)
                continue
            ktc, env, pc = self.spec(system)
            self.srvs[system] = CS.Srv(
                system.replace("/", "_"),
                self.a.python,
                self.work,
                self.a.model,
                ktc,
                {**self.mem_env, **env},
                prefix_caching=pc,
                kv_cache_bytes=self.kv_bytes,
            )
        for s in self.servers():
            s.wait_ready(self.a.startup_timeout)
        for s in self.servers():  # first-request costs, and the oneDNN kernels of this shape
            for i in range(2):
                time.sleep(self.a.gap)
                s.complete(self.prompts.tagged(f"warmup-{s.name}-{i}", 200))
        for w in range(self.a.warmup_rounds):
            self.round(-1 - w, record=False)
        t0 = time.monotonic()
        while os.getloadavg()[0] > self.a.settle_load and time.monotonic() - t0 < self.a.settle_s:
            time.sleep(5)
        log(f"settled {time.monotonic() - t0:.0f}s: loadavg {os.getloadavg()}")

    def rec(
        self, system: str, kind: str, rnd: int, ids: list[int], expect_hit: int, record: bool, rep: int = 0
    ) -> None:
        # two-node systems: the storing request goes to node A, the others to node B
        s = self.node_a[system] if kind == "store" and system in self.node_a else self.srvs[system]
        time.sleep(self.a.gap)
        before = self.last.get(s.name) or scrape(s)
        c0, k0, w0 = cpu_times(), stat_cpu(), time.monotonic()
        r = s.complete(ids)
        k1, c1, w1 = stat_cpu(), cpu_times(), time.monotonic()
        time.sleep(self.a.scrape_delay)  # the engine's stats reach the API server's metrics after the reply
        after = scrape(s)
        self.last[s.name] = after

        def d(name: str) -> float:
            return after.get(name, 0.0) - before.get(name, 0.0)

        # CPU seconds used during the request (the snapshots bracket it): the measured server's process
        # tree, the other servers' trees, and everything else (other jobs, kernel threads, this script)
        mine = tree_of(c1, s.pgid)
        others = set().union(*(tree_of(c1, o.pgid) for o in self.servers() if o is not s))

        def used(pids: set[int] | None) -> float:
            return sum(
                t - c0.get(p, (0, 0.0))[1]
                for p, (_, t) in c1.items()
                if (p in pids if pids is not None else (p not in mine and p not in others))
            )

        r.update(
            {
                "cpu_self_s": round(used(mine), 3),
                "cpu_other_servers_s": round(used(others), 3),
                "cpu_rest_s": round(used(None), 3),
                "wall_s": round(w1 - w0, 3),
                # machine-wide idle / iowait / steal seconds during the request (all cores)
                "idle_s": round((k1[3] - k0[3]) / _TICK, 2),
                "iowait_s": round((k1[4] - k0[4]) / _TICK, 2),
                "steal_s": round((k1[7] - k0[7]) / _TICK, 2) if len(k1) > 7 else 0.0,
            }
        )
        r.update(
            {
                "system": system,
                "server": s.name,
                "kind": kind,
                "round": rnd,
                "rep": rep,
                "generation": self.generation,
                "t": round(time.time(), 2),
                "loadavg": os.getloadavg(),
                "store_ms": 1e3 * d("vllm:lmtier_store_seconds_sum"),
                "load_ms": 1e3 * d("vllm:lmtier_load_seconds_sum"),
                "prefill_ms": 1e3 * d("vllm:request_prefill_time_seconds_sum"),
                "server_ttft_ms": 1e3 * d("vllm:time_to_first_token_seconds_sum"),
                "stored_chunks": d("vllm:lmtier_stored_chunks_total"),
                "loaded_chunks": d("vllm:lmtier_loaded_chunks_total"),
            }
        )
        r.pop("text", None)
        if expect_hit and (r["cached"] or 0) < expect_hit:
            r["miss"] = True
        if record:
            self.records.append(r)
        log(
            f"  r{rnd:<3} {system:<28} {kind:<5} {r['ttft_ms']:8.1f} ms  prefill {r['prefill_ms']:7.1f}  "
            f"store {r['store_ms']:6.1f}  load {r['load_ms']:6.1f}  cached={r['cached']}  "
            f"load1={r['loadavg'][0]:.2f} cpu self/srv/rest {r['cpu_self_s']:.2f}/{r['cpu_other_servers_s']:.2f}/"
            f"{r['cpu_rest_s']:.2f} idle/steal {r['idle_s']:.2f}/{r['steal_s']:.2f}{'  MISS' if r.get('miss') else ''}"
        )

    def outside_cores(self, window_s: float = 2.0) -> float:
        """Cores used over ``window_s`` by processes outside this script and its servers."""
        c0, w0 = cpu_times(), time.monotonic()
        time.sleep(window_s)
        c1, w1 = cpu_times(), time.monotonic()
        ours = tree_of(c1, os.getpid())
        used = sum(t - c0.get(p, (0, 0.0))[1] for p, (_, t) in c1.items() if p not in ours)
        return used / (w1 - w0)

    def wait_calm(self) -> float:
        t0 = time.monotonic()
        while True:
            x = self.outside_cores()
            if x <= self.a.calm_frac or time.monotonic() - t0 > self.a.calm_wait:
                break
        if time.monotonic() - t0 > 3:
            log(f"waited {time.monotonic() - t0:.0f}s for calm: {x:.2f} cores used outside")
        return x

    def round(self, rnd: int, record: bool = True) -> None:
        a = self.a
        if record:
            self.wait_calm()
        n = a.n
        order = a.system_list[rnd % len(a.system_list) :] + a.system_list[: rnd % len(a.system_list)]
        if (rnd // len(a.system_list)) % 2:
            order = order[::-1]
        g = f"g{self.generation}" if rnd < 0 else ""  # warm-up rounds: new prompts in every generation
        pre = self.prompts.tagged(f"ab{a.tag}-r{rnd}{g}-N{n}", n)
        sa = self.prompts.tagged(f"ab{a.tag}-A{rnd}-{n}", CS.NEW_TOKENS)
        sb = self.prompts.tagged(f"ab{a.tag}-B{rnd}-{n}", CS.NEW_TOKENS)
        if a.mode == "cold":
            for system in order:
                self.rec(system, "cold", rnd, pre + sa, 0, record)
            return
        listed = {sy: self.p2p_names(sy) for sy in order if system_env(sy)[0] == "p2p"}
        for system in order:
            self.rec(system, "store", rnd, pre + sa, 0, record)
        for system, before in listed.items():  # node A publishes the round's chunks in the background
            want = (n + CS.NEW_TOKENS) // self.chunk_tokens[system]
            got = STORES.wait_p2p_published(self.stores[system][0].port, want, timeout_s=30, before=before)
            if got < want:
                log(f"  r{rnd:<3} {system}: {got} new chunk entries in the directory after 30 s, {want} expected")
        for k in range(a.warm_reps):  # several warm requests over the same stored prefix (new suffixes)
            sk = sb if k == 0 else self.prompts.tagged(f"ab{a.tag}-B{rnd}.{k}-{n}", CS.NEW_TOKENS)
            for system in order if k % 2 == 0 else order[::-1]:
                hit = 0 if system.split("@")[0] == "base" else n
                self.rec(system, "warm", rnd, pre + sk, hit, record, rep=k)

    def p2p_names(self, system: str) -> set[bytes]:
        """Chunk entries in the P2P directory of two-node system ``system``."""
        return STORES.p2p_directory_names(self.stores[system][0].port)

    def clean_count(self) -> int:
        """Rounds so far in which every request was clean (see ``--clean-frac``)."""
        bad, seen = set(), set()
        kind = "cold" if self.a.mode == "cold" else "warm"
        for r in self.records:
            if r["kind"] != kind:
                continue
            seen.add(r["round"])
            if interference(r) > max(0.03, self.a.clean_frac * r["ttft_ms"] / 1e3):
                bad.add(r["round"])
        return len(seen - bad)

    def stop(self) -> None:
        for s in self.servers():
            try:
                s.stop()
            except Exception:  # noqa: BLE001
                pass


def turn_systems(a: argparse.Namespace) -> list[list[str]]:
    """The systems alive together, turn by turn: all of them at once, or (``--pairs-in-turn``) the
    single-server systems with one two-node system at a time (3 servers on a small machine)."""
    if not a.pairs_in_turn:
        return [list(a.system_list)]
    singles = [s for s in a.system_list if system_env(s)[0] not in STORES.SHARED_STORES]
    return [[*singles, s] for s in a.system_list if s not in singles]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], epilog=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", type=Path, default=CS.REPO_ROOT / "models" / "SmolLM2-135M-Instruct")
    ap.add_argument("--n", type=int, default=4096, help="cached prefix tokens (+64 new)")
    ap.add_argument("--rounds", type=int, default=20, help="rounds at least")
    ap.add_argument(
        "--clean-rounds",
        type=int,
        default=0,
        help="go on after --rounds until this many clean rounds exist (or --max-rounds)",
    )
    ap.add_argument("--max-rounds", type=int, default=40)
    ap.add_argument(
        "--generations",
        type=int,
        default=1,
        help="restart every server this many times over --rounds (server-instance effects)",
    )
    ap.add_argument("--warmup-rounds", type=int, default=1, help="unrecorded rounds of the same shape first")
    ap.add_argument("--mode", choices=("cold", "warm"), default="cold")
    ap.add_argument("--warm-reps", type=int, default=1, help="warm mode: warm requests per system per round")
    ap.add_argument("--systems", default="base,lmtier")
    ap.add_argument(
        "--gap", type=float, default=1.5, help="seconds of quiet before every request (as bench_connectors)"
    )
    ap.add_argument("--scrape-delay", type=float, default=0.3)
    ap.add_argument(
        "--clean-frac",
        type=float,
        default=0.1,
        help="cores used outside the measured server during a request (CPU s / wall s) above which "
        "its round is not clean (default %(default)s)",
    )
    ap.add_argument(
        "--calm-frac",
        type=float,
        default=0.1,
        help="before every round wait until the CPU used outside this benchmark's servers over 2 s "
        "is below this many cores (default %(default)s) ...",
    )
    ap.add_argument("--calm-wait", type=float, default=60, help="... for at most this many seconds")
    ap.add_argument(
        "--settle-load", type=float, default=1.5, help="after warm-up wait for the 1-min load to drop below this"
    )
    ap.add_argument("--settle-s", type=float, default=120, help="... at most this many seconds")
    ap.add_argument("--tag", default="", help="prompt namespace (different runs get different prefixes)")
    ap.add_argument("--lmtier-extra", default="")
    ap.add_argument(
        "--kv-cache-gib",
        type=float,
        help="vLLM's KV cache (GiB) of every server (default: VLLM_CPU_KVCACHE_SPACE=1, bench_connectors' "
        "value); 0.25 holds a 4K prompt and lets 7 servers share a small machine",
    )
    ap.add_argument(
        "--pairs-in-turn",
        action="store_true",
        help="start the two-node systems one at a time (with the single-server systems, restarted per "
        "turn), --rounds each: 3 servers alive instead of 2 per two-node system + 1",
    )
    ap.add_argument(
        "--pool-gib",
        help="CPU pool (GiB) of the two-node systems' servers (default: the template's, 1.0); a round "
        "needs (n + 64) x 23 KiB of bf16 SmolLM2 KV, older rounds are evicted (LRU)",
    )
    ap.add_argument("--python", default=sys.executable)
    ap.add_argument("--startup-timeout", type=float, default=600)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--keep-logs", type=Path)
    a = ap.parse_args(argv)
    a.model = a.model.resolve()
    a.system_list = [s.strip() for s in a.systems.split(",") if s.strip()]
    if not 2 <= len(a.system_list) <= 4:
        ap.error("--systems: 2 to 4 systems")
    two_node = [s for s in a.system_list if system_env(s)[0] in STORES.SHARED_STORES]
    if two_node and a.mode != "warm":
        ap.error(f"--systems {','.join(two_node)}: two-node systems need --mode warm (A stores, B loads)")
    if a.pairs_in_turn and (not two_node or len(two_node) == len(a.system_list)):
        ap.error("--pairs-in-turn: needs two-node systems and at least one single-server system (B cold)")
    if not a.tag:
        a.tag = time.strftime("%H%M%S")
    return a


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="ab_conn_", dir="/work"))
    (work / "logs").mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    log(f"work {work}; {time.strftime('%Y-%m-%d %H:%M:%S', time.gmtime())} UTC; loadavg {os.getloadavg()}")
    ab = AB(a, work)
    status = 0
    turns = turn_systems(a)
    try:
        for t, systems in enumerate(turns):  # one turn unless --pairs-in-turn
            a.system_list = systems
            if t:
                ab.stop()
                ab.close_stores()
                ab.srvs, ab.node_a, ab.last = {}, {}, {}
                ab.generation += 1
                log(f"turn {t}: servers of {', '.join(systems)}")
            ab.start()
            rnd, first = t * TURN_ROUNDS, t * TURN_ROUNDS
            per_gen = -(-a.rounds // a.generations)
            while rnd - first < a.rounds or (
                a.clean_rounds and ab.clean_count() < a.clean_rounds and rnd - first < a.max_rounds
            ):
                if rnd > first and (rnd - first) % per_gen == 0 and rnd - first < a.rounds:
                    # a new generation of servers: each process's own speed (its memory placement) differs
                    # by a few %, which paired rounds inside one generation cannot tell from the system's
                    ab.stop()
                    ab.srvs, ab.node_a, ab.last = {}, {}, {}
                    ab.generation += 1
                    log(f"generation {ab.generation}: restarting the servers")
                    ab.start()
                ab.round(rnd)
                rnd += 1
    except KeyboardInterrupt:
        status = 2
    except Exception as e:  # noqa: BLE001
        import traceback

        traceback.print_exc()
        log(f"FAILED: {e}")
        status = 2
    finally:
        ab.stop()
        ab.close_stores()
    summary = report_turns(a, turns, ab.records) if ab.records else {}
    print(
        f"started {time.strftime('%Y-%m-%d %H:%M:%S', time.gmtime(t0))} UTC, ended "
        f"{time.strftime('%H:%M:%S', time.gmtime())} UTC; loadavg at end {os.getloadavg()}"
    )
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(
            json.dumps(
                {
                    "args": {k: str(v) for k, v in vars(a).items()},
                    "summary": summary,
                    "records": ab.records,
                    "notes": ab.notes,
                    "status": status,
                },
                indent=1,
            )
        )
    if a.keep_logs:
        a.keep_logs.mkdir(parents=True, exist_ok=True)
        for f in (work / "logs").glob("*.log"):
            shutil.copy2(f, a.keep_logs / f.name)
    shutil.rmtree(work, ignore_errors=True)
    return status


if __name__ == "__main__":
    sys.exit(main())
