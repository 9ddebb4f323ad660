"""Child processes for tests, benchmarks, the demo and the soak: a free port, a process in its own
process group with its output in a log file, and the tail of a log.

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

__all__ = ["free_port", "tail", "Proc"]

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
        ``grace_s`` seconds, SIGTERM and SIGKILL to the whole group."""
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
