"""Child processes for tests, benchmarks, the demo and the soak: a free port, a process in its own
process group with its output in a log file (the shared-memory segments it leaves behind removed when
it is stopped), and the tail of a log.

No lmtier import beyond the standard library: the demo and benchmarks start servers with it.
"""

from __future__ import annotations

import collections
import logging
import os
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path

__all__ = ["free_port", "tail", "Proc", "proc_stats", "group_pids", "shm_segments", "release_segments"]

logger = logging.getLogger("lmtier.testing")


_HANDED_OUT: collections.deque[int] = collections.deque(maxlen=4096)
_HANDED_OUT_LOCK = threading.Lock()


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (bind to port 0, read it back) and that
    this process has not handed out among its last 4,096 answers.

    The kernel may give the same ephemeral port to two port-0 binds in a row once the first socket
    is closed; two ports taken for one server (a Mooncake master's metrics and HTTP metadata ports)
    then clashed at its start-up ("Address already in use").

    Raises:
        OSError: no port could be bound, or 64 tries all returned ports handed out before.
    """
    with _HANDED_OUT_LOCK:
        for _ in range(64):
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            if port not in _HANDED_OUT:
                _HANDED_OUT.append(port)
                return port
    raise OSError("free_port: 64 port-0 binds returned only ports handed out before")


def tail(path: Path, n: int = 60) -> str:
    """The last ``n`` lines of text file ``path`` (a note instead when it cannot be read)."""
    try:
        lines = Path(path).read_text(errors="replace").splitlines()
    except OSError as e:
        return f"(cannot read {path}: {e})"
    return "\n".join(lines[-n:])


SHM_DIR = "/dev/shm"


def proc_stats():
    """``(pid, fields)`` of every live process, ``fields`` its ``/proc/<pid>/stat`` fields after the
    command name (``fields[0]``: state, ``[1]``: parent pid, ``[2]``: process group)."""
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                st = f.read()
            yield int(d), st[st.rindex(")") + 2 :].split()
        except (OSError, ValueError):
            continue


def group_pids(pgid: int) -> list[int]:
    """The live processes of process group ``pgid`` (from ``/proc``; [] where there is none)."""
    return [pid for pid, fields in proc_stats() if len(fields) > 2 and fields[2] == str(pgid)]


def shm_segments(pids: list[int]) -> set[str]:
    """The files under ``/dev/shm`` that processes ``pids`` have mapped (POSIX shared memory:
    Python's ``SharedMemory`` segments, ``psm_*``, vLLM's among them), from ``/proc/<pid>/maps``."""
    found = set()
    for pid in pids:
        try:
            with open(f"/proc/{pid}/maps") as f:
                for line in f:
                    path = line.rstrip("\n").split(maxsplit=5)[5:]
                    if path and path[0].startswith(SHM_DIR + "/") and not path[0].endswith(" (deleted)"):
                        found.add(path[0])
        except OSError:
            continue
    return found


def release_segments(paths: set[str]) -> list[str]:
    """Unlink the shared-memory files ``paths`` that no live process maps any more (what a process
    killed before its own cleanup leaves in RAM: a vLLM server leaves ~400 MB). Returns those
    removed."""
    if not paths:
        return []
    in_use = shm_segments([int(d) for d in os.listdir("/proc") if d.isdigit()])
    gone = []
    for p in sorted(paths - in_use):
        try:
            os.unlink(p)
            gone.append(p)
        except FileNotFoundError:
            continue
    return gone


class Proc:
    """A child process in its own session/process group, stdout and stderr to ``log_path``.

    Args:
        name: shown in messages.
        cmd: the command line.
        env: its whole environment.
        log_path: output file (created, truncated).
        cwd: working directory (default: the caller's).
        log: where :meth:`stop` reports a forced kill (default: the ``lmtier.testing`` logger).
    """

    def __init__(
        self,
        name: str,
        cmd: list[str],
        env: dict[str, str],
        log_path: Path,
        *,
        cwd: str | os.PathLike | None = None,
        log: Callable[[str], None] | None = None,
    ):
        self.name, self.cmd, self.log_path = name, cmd, Path(log_path)
        self._say = log or logger.warning
        self._log = open(log_path, "wb")
        self.popen = subprocess.Popen(
            cmd,
            env=env,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            cwd=cwd,
        )
        self.pgid = self.popen.pid  # start_new_session: the child leads its own group

    def alive(self) -> bool:
        """True while the leader runs."""
        return self.popen.poll() is None

    def _group_alive(self) -> bool:
        try:
            os.killpg(self.pgid, 0)
            return True
        except ProcessLookupError:
            return False
        except PermissionError:
            return True

    def stop(self, grace_s: float = 60.0) -> None:
        """SIGTERM to the leader (lets vLLM shut its engine and the connector down), then, after
        ``grace_s`` seconds, SIGTERM and SIGKILL to the whole group; then the shared-memory segments
        the group had mapped and nobody maps any more are removed (:func:`release_segments`)."""
        segments = shm_segments(group_pids(self.pgid))
        if self.alive():
            try:
                self.popen.send_signal(signal.SIGTERM)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline:
            self.popen.poll()
            if not self.alive() and not self._group_alive():
                break
            time.sleep(0.2)
        else:
            self._say(f"{self.name}: still running {grace_s:.0f}s after SIGTERM; SIGKILL to its process group")
        for sig in (signal.SIGTERM, signal.SIGKILL):
            if not self._group_alive():
                break
            try:
                os.killpg(self.pgid, sig)
            except ProcessLookupError:
                break
            time.sleep(1.0 if sig == signal.SIGTERM else 0.2)
        try:
            self.popen.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        self._log.close()
        release_segments(segments)

    def kill_group(self) -> None:
        """SIGKILL the whole process group (a crash: no shutdown, no flush), wait for the leader, then
        remove the shared-memory segments the group had mapped and nobody maps any more."""
        segments = shm_segments(group_pids(self.pgid))
        try:
            os.killpg(self.pgid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        try:
            self.popen.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        for _ in range(50):  # the group's other members die after the leader
            if not self._group_alive():
                break
            time.sleep(0.1)
        self._log.close()
        release_segments(segments)
