"""The soak's fault kinds (tests/soak/run_soak.py): one :class:`Fault` entry per kind in :data:`FAULTS`.

An entry says how to put the fault in place (``inject``), what to repeat every second while it lasts
(``tick``, optional), how to end it (``clear``) and what observation proves the faulted tier works again
(``recovered``, evaluated about once a second after ``clear``). The episode logic (when a fault ends,
when recovery is judged) lives in run_soak.py and is the same for every kind; a new kind is one
function set and one entry here.

Recovery conditions (observed after the fault cleared, against a :class:`Baseline` taken at the clear):
Redis faults — Redis's key count grows (stores resume); Mooncake faults — the master counts new
completed puts (stores resume; read from the master's own ``/metrics``); disk faults — new record files
appear or disk hits are served; server_kill — the restarted server serves lmtier hits from disk or the
remote (warm).

A fault of one remote (``needs_remote``) is skipped, with the reason, when the soak runs the other one
(``--remote``).
"""

from __future__ import annotations

import os
import random
import shutil
import stat
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from lmtier.testing.mooncake import MooncakeCluster
from lmtier.testing.redis import RedisServer

__all__ = [
    "SoakState",
    "Episode",
    "Baseline",
    "Fault",
    "FAULTS",
    "REMOTES",
    "ALL_FAULTS",
    "CI_FAULTS",
    "TMPFS_FAULTS",
    "disk_records",
    "disk_tmp_files",
]


def disk_records(root: Path) -> list[Path]:
    """The disk tier's record files under ``root`` (``<shard>/<key>.lmt``)."""
    return list(root.glob("*/*.lmt"))


def disk_tmp_files(root: Path) -> list[Path]:
    """Half-written records under ``root`` (``<shard>/.<key>.tmp``)."""
    return list(root.glob("*/.*.tmp"))


class SoakState(Protocol):
    """What a fault may use of the running soak (run_soak.Soak implements it)."""

    disk: Path  # the disk tier's folder (a tmpfs mount when ``tmpfs``)
    tmpfs: bool
    redis: RedisServer | None  # the remote when ``--remote redis``
    mooncake: MooncakeCluster | None  # the remote (master + one store server) when ``--remote mooncake``
    seed: int

    def redis_keys(self) -> int | None:
        """Redis's key count (None while it cannot answer or with no Redis)."""

    def mooncake_counts(self) -> dict[str, int] | None:
        """From the Mooncake master's ``/metrics``: ``keys`` (``master_key_count``) and ``puts`` (completed
        puts since the master started: PutEnd requests plus BatchPutEnd items, less failures); None while
        it cannot answer (paused, killed) or with no Mooncake."""

    def hits_now(self) -> dict[str, float]:
        """lmtier hit tokens per tier (``cpu``/``disk``/``remote``), summed over server generations."""

    def kill_server(self, ep: Episode) -> None:
        """SIGKILL the server's process group (requests it cuts are retried by the clients)."""

    def restart_server(self, ep: Episode) -> None:
        """Start the server again on the same port and disk folder and wait until it is healthy."""


@dataclass
class Episode:
    """One fault episode. Times are seconds since the soak started (monotonic clock).

    ``outcome``: ``"recovered"``; ``"not_recovered"`` (enough requests after the clear, and at least
    the minimum watch time, without the recovery observation); ``"too_slow"`` (the episode's cap hit
    before enough requests were observed: no verdict on recovery); ``"harness_error"`` (injecting or
    clearing the fault failed).
    """

    fault: str
    rep: int
    t0: float
    t1: float = float("nan")  # fault cleared
    t_end: float = float("nan")  # episode judged
    outcome: str | None = None
    verdict: str = ""  # one line, e.g. "machine too slow to observe recovery: 3 requests in the episode"
    requests_during: int = 0  # requests served while the fault was in place
    requests_after: int = 0  # requests served (attempt started) after the fault cleared
    controls_after: int = 0  # of them control requests (fresh salt: a full miss that stores every chunk)
    detail: dict[str, Any] = field(default_factory=dict)

    @property
    def recovered(self) -> bool:
        return self.outcome == "recovered"


@dataclass(frozen=True)
class Baseline:
    """Taken when the fault cleared: hit tokens per tier, Redis key count, disk record count, the
    Mooncake master's counts (:meth:`SoakState.mooncake_counts`)."""

    hits: dict[str, float]
    redis_keys: int | None
    disk_files: int
    mooncake: dict[str, int] | None = None


@dataclass(frozen=True)
class Fault:
    """One fault kind.

    Args:
        name: the ``--faults`` name.
        doc: one line for ``--help``.
        inject: puts the fault in place (returns once it is).
        clear: ends it (returns once the faulted part is back, e.g. a restarted server is healthy).
        recovered: ``(ok, what was observed)`` after the clear, against the baseline taken at the clear.
        tick: repeated about once a second while the fault is in place (more damage, ballast top-up).
        needs_tmpfs: only on the tmpfs disk folder (skipped, and reported, without root).
        outage: the server is down while the fault is in place: no request can complete during it, so
            the fault phase ends as soon as ``inject`` returns (the clients retry across the outage).
        needs_remote: only with this ``--remote`` (one of :data:`REMOTES`; skipped, and reported,
            with the other).
    """

    name: str
    doc: str
    inject: Callable[[SoakState, Episode], None]
    clear: Callable[[SoakState, Episode], None]
    recovered: Callable[[SoakState, Episode, Baseline], tuple[bool, str]]
    tick: Callable[[SoakState, Episode], None] | None = None
    needs_tmpfs: bool = False
    outage: bool = False
    needs_remote: str | None = None


REMOTES = ("redis", "mooncake")
"""The soak's remote tiers (``--remote``; one per run: the server has one ``remote_url``)."""


# ---- Redis -------------------------------------------------------------------------------------


def _redis_recovered(s: SoakState, ep: Episode, b: Baseline) -> tuple[bool, str]:
    keys = s.redis_keys()
    ok = keys is not None and (
        (b.redis_keys is not None and keys > b.redis_keys) or (ep.fault == "redis_kill" and keys > 0)
    )
    return ok, f"redis keys {b.redis_keys} -> {keys}"


def _redis_kill(s: SoakState, ep: Episode) -> None:
    ep.detail["keys_before"] = s.redis_keys()
    s.redis.kill()


def _redis_restart(s: SoakState, ep: Episode) -> None:
    s.redis.start(timeout_s=60.0)  # empty: no persistence


def _redis_pause(s: SoakState, ep: Episode) -> None:
    ep.detail["keys_before"] = s.redis_keys()
    s.redis.pause()


def _redis_resume(s: SoakState, ep: Episode) -> None:
    s.redis.resume()


# ---- Mooncake ----------------------------------------------------------------------------------

# After SIGCONT the master first answers the calls that waited through the pause (puts the tier had
# already given up on): they complete within milliseconds. Waiting this long before the baseline keeps
# them from counting as recovery.
MOONCAKE_SETTLE_S = 2.0


def _mooncake_recovered(s: SoakState, ep: Episode, b: Baseline) -> tuple[bool, str]:
    now = s.mooncake_counts()
    before = b.mooncake or {}
    p0 = before.get("puts")
    if ep.fault == "mooncake_kill":
        p0 = 0  # a restarted master starts from zero: any completed put came after the restart
    ok = now is not None and p0 is not None and now["puts"] > p0
    keys = (before.get("keys"), None if now is None else now["keys"])
    return ok, f"mooncake completed puts {p0} -> {None if now is None else now['puts']}, keys {keys[0]} -> {keys[1]}"


def _mooncake_note(s: SoakState, ep: Episode, key: str) -> None:
    c = s.mooncake_counts()
    ep.detail[key] = None if c is None else c["keys"]


def _mooncake_kill(s: SoakState, ep: Episode) -> None:
    assert s.mooncake is not None
    _mooncake_note(s, ep, "keys_before")
    s.mooncake.master.kill()
    ep.detail["master_killed"] = not s.mooncake.master.alive()


def _mooncake_restart(s: SoakState, ep: Episode) -> None:
    """Start the master again on the same ports (empty: its metadata was in memory); the store server
    and the server's client re-mount by themselves."""
    assert s.mooncake is not None
    t = time.monotonic()
    s.mooncake.master.start(timeout_s=60.0)
    ep.detail["master_restart_s"] = round(time.monotonic() - t, 2)
    ep.detail["store_server_alive"] = all(x.alive() for x in s.mooncake.servers)


def _mooncake_pause(s: SoakState, ep: Episode) -> None:
    assert s.mooncake is not None
    _mooncake_note(s, ep, "keys_before")
    s.mooncake.master.pause()


def _mooncake_resume(s: SoakState, ep: Episode) -> None:
    assert s.mooncake is not None
    s.mooncake.master.resume()
    time.sleep(MOONCAKE_SETTLE_S)
    _mooncake_note(s, ep, "keys_after_resume")


# ---- disk --------------------------------------------------------------------------------------


def _disk_recovered(s: SoakState, ep: Episode, b: Baseline) -> tuple[bool, str]:
    files = len(disk_records(s.disk))
    dh = s.hits_now()["disk"] - b.hits["disk"]
    return files > b.disk_files or dh > 0, f"disk files {b.disk_files} -> {files}, disk hit tokens +{dh:.0f}"


def _disk_corrupt_start(s: SoakState, ep: Episode) -> None:
    ep.detail.update(flipped=0, truncated=0, deleted=0)
    _disk_corrupt_tick(s, ep)


def _disk_corrupt_tick(s: SoakState, ep: Episode) -> None:
    """Flip bits in two random records, truncate one, delete one."""
    rng = random.Random(f"{s.seed}/{ep.fault}/{ep.rep}/{ep.detail['flipped'] + ep.detail['truncated']}")
    files = disk_records(s.disk)
    rng.shuffle(files)
    for f, how in zip(files, ("flip", "flip", "truncate", "delete")):
        try:
            size = f.stat().st_size
            if size == 0 and how != "delete":
                continue  # truncated to nothing by an earlier tick: no byte to flip or cut
            if how == "flip":
                with open(f, "r+b") as fh:
                    for _ in range(4):
                        off = rng.randrange(0, size)
                        fh.seek(off)
                        b = fh.read(1)
                        fh.seek(off)
                        fh.write(bytes([b[0] ^ (1 << rng.randrange(8))]) if b else b"\x01")
                ep.detail["flipped"] += 1
            elif how == "truncate":
                os.truncate(f, rng.randrange(0, size))
                ep.detail["truncated"] += 1
            else:
                f.unlink()
                ep.detail["deleted"] += 1
        except OSError:
            pass


_ODDITIES = ("directory", "symlink", "fifo", "device")


def _oddities_outside(s: SoakState) -> Path:
    return s.disk.parent / "oddity-targets"


def _disk_oddities_start(s: SoakState, ep: Episode) -> None:
    ep.detail.update({how: 0 for how in _ODDITIES}, made=[])
    _oddities_outside(s).mkdir(exist_ok=True)
    _disk_oddities_tick(s, ep)


def _disk_oddities_tick(s: SoakState, ep: Episode) -> None:
    """Replace random records by a directory, a symlink to a valid record outside the disk folder,
    a FIFO and a character device node (each must be a miss: never an error, a hang or a read
    through the link)."""
    rng = random.Random(f"{s.seed}/{ep.fault}/{ep.rep}/{len(ep.detail['made'])}")
    files = [f for f in disk_records(s.disk) if f.is_file() and not f.is_symlink()]
    rng.shuffle(files)
    for f, how in zip(files, _ODDITIES):
        try:
            if how == "symlink":
                target = _oddities_outside(s) / f.name
                shutil.copyfile(f, target)  # a valid record, outside the disk folder
                f.unlink()
                f.symlink_to(target)
            else:
                f.unlink()
                if how == "directory":
                    f.mkdir()
                    (f / "keep").write_bytes(b"not the cache's")
                elif how == "fifo":
                    os.mkfifo(f, 0o600)
                else:
                    os.mknod(f, 0o600 | stat.S_IFCHR, os.makedev(1, 5))  # like /dev/zero
            ep.detail["made"].append(str(f))
            ep.detail[how] += 1
        except OSError:
            pass


def _disk_oddities_clear(s: SoakState, ep: Episode) -> None:
    """Remove what the fault put at record paths (a later store may have replaced it: only odd
    entries are removed) and the link targets."""
    for name in ep.detail.pop("made", []):
        f = Path(name)
        try:
            if f.is_dir() and not f.is_symlink():
                shutil.rmtree(f)
            elif f.is_symlink() or (f.exists() and not f.is_file()):
                f.unlink()
        except OSError:
            pass
    shutil.rmtree(_oddities_outside(s), ignore_errors=True)
    _disk_note_files(s, ep)


def _disk_note_files(s: SoakState, ep: Episode) -> None:
    ep.detail["files_before_recovery"] = len(disk_records(s.disk))


def _disk_readonly(s: SoakState, ep: Episode) -> None:
    # remount,ro fails with EBUSY while a file is open for writing: retry (writes are short)
    for attempt in range(500):  # noqa: B007 - the attempt count is read after the loop
        r = subprocess.run(["mount", "-o", "remount,ro", str(s.disk)], capture_output=True, text=True)
        if r.returncode == 0:
            break
        time.sleep(0.02)
    else:
        raise RuntimeError(f"remount,ro failed: {r.stderr.strip()}")
    ep.detail["remount_attempts"] = attempt + 1


def _disk_writable(s: SoakState, ep: Episode) -> None:
    subprocess.run(["mount", "-o", "remount,rw", str(s.disk)], check=True)
    _disk_note_files(s, ep)


def _disk_fill(s: SoakState, ep: Episode) -> None:
    """Fill the tmpfs with a ballast file (real ENOSPC); topped up every tick."""
    ballast = s.disk / "ballast.bin"
    st = os.statvfs(s.disk)
    free = st.f_bavail * st.f_frsize
    if free > 0:
        with open(ballast, "ab") as fh:
            try:
                os.posix_fallocate(fh.fileno(), os.fstat(fh.fileno()).st_size, free)
            except OSError:
                pass
    ep.detail["min_free_bytes"] = min(
        ep.detail.get("min_free_bytes", 1 << 62), os.statvfs(s.disk).f_bavail * st.f_frsize
    )


def _disk_unfill(s: SoakState, ep: Episode) -> None:
    (s.disk / "ballast.bin").unlink(missing_ok=True)
    _disk_note_files(s, ep)


# ---- server ------------------------------------------------------------------------------------


def _server_kill(s: SoakState, ep: Episode) -> None:
    s.kill_server(ep)
    ep.detail["tmp_files_after_kill"] = len(disk_tmp_files(s.disk))
    ep.detail["records_after_kill"] = len(disk_records(s.disk))


def _server_restart(s: SoakState, ep: Episode) -> None:
    s.restart_server(ep)
    ep.detail["tmp_files_after_restart"] = len(disk_tmp_files(s.disk))
    ep.detail["records_after_restart"] = len(disk_records(s.disk))


def _server_recovered(s: SoakState, ep: Episode, b: Baseline) -> tuple[bool, str]:
    h = s.hits_now()
    dh = (h["disk"] - b.hits["disk"]) + (h["remote"] - b.hits["remote"])
    return dh > 0, f"disk+remote hit tokens after restart +{dh:.0f} (cpu +{h['cpu'] - b.hits['cpu']:.0f})"


# ---- the table ---------------------------------------------------------------------------------

FAULTS: dict[str, Fault] = {
    f.name: f
    for f in (
        Fault(
            "redis_kill",
            "SIGKILL redis-server; restart it (empty) on the same port when the fault clears",
            inject=_redis_kill,
            clear=_redis_restart,
            recovered=_redis_recovered,
            needs_remote="redis",
        ),
        Fault(
            "redis_pause",
            "SIGSTOP redis-server (a hung server, >> remote_timeout_s); SIGCONT when the fault clears",
            inject=_redis_pause,
            clear=_redis_resume,
            recovered=_redis_recovered,
            needs_remote="redis",
        ),
        Fault(
            "mooncake_kill",
            "SIGKILL mooncake_master; restart it (empty) on the same ports when the fault clears",
            inject=_mooncake_kill,
            clear=_mooncake_restart,
            recovered=_mooncake_recovered,
            needs_remote="mooncake",
        ),
        Fault(
            "mooncake_pause",
            "SIGSTOP mooncake_master (a hung master, >> remote_timeout_s); SIGCONT when the fault clears",
            inject=_mooncake_pause,
            clear=_mooncake_resume,
            recovered=_mooncake_recovered,
            needs_remote="mooncake",
        ),
        Fault(
            "disk_corrupt",
            "every second: flip bits in, truncate, or delete random disk records",
            inject=_disk_corrupt_start,
            tick=_disk_corrupt_tick,
            clear=_disk_note_files,
            recovered=_disk_recovered,
        ),
        Fault(
            "disk_oddities",
            "every second: replace random disk records by a directory, a symlink out of the disk folder, "
            "a FIFO or a device node; removed when the fault clears",
            inject=_disk_oddities_start,
            tick=_disk_oddities_tick,
            clear=_disk_oddities_clear,
            recovered=_disk_recovered,
        ),
        Fault(
            "disk_readonly",
            "mount -o remount,ro the disk tmpfs; remount,rw when the fault clears",
            inject=_disk_readonly,
            clear=_disk_writable,
            recovered=_disk_recovered,
            needs_tmpfs=True,
        ),
        Fault(
            "disk_full",
            "fill the disk tmpfs with a ballast file (topped up every second); remove it when the fault clears",
            inject=_disk_fill,
            tick=_disk_fill,
            clear=_disk_unfill,
            recovered=_disk_recovered,
            needs_tmpfs=True,
        ),
        Fault(
            "server_kill",
            "SIGKILL the server's process group while it serves (and writes); restart it on the same port "
            "and disk folder (requests cut by the kill are retried by the clients)",
            inject=_server_kill,
            clear=_server_restart,
            recovered=_server_recovered,
            outage=True,
        ),
    )
}
"""Every fault kind, in the order the long soak runs them."""

ALL_FAULTS = tuple(FAULTS)
CI_FAULTS = ("redis_kill", "disk_corrupt", "server_kill")
"""The faults of ``--ci`` (tests/test_reliability.py)."""
TMPFS_FAULTS = tuple(f.name for f in FAULTS.values() if f.needs_tmpfs)
