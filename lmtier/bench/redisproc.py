"""A private ``redis-server`` on loopback for the benchmarks (``lmtier bench remote`` / ``ttft``).

No file of the source checkout is read: the binary comes from ``$LMTIER_REDIS_SERVER`` or ``PATH``
(``scripts/gpu_run.sh`` puts the bundle of ``scripts/bundle_redis.sh`` on ``PATH``).
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time

__all__ = ["RedisProc", "find_redis_server"]


def find_redis_server() -> str | None:
    """The redis-server to start: ``$LMTIER_REDIS_SERVER`` (when executable), else ``redis-server``
    on ``PATH``; None if neither."""
    env = os.environ.get("LMTIER_REDIS_SERVER")
    if env:
        return env if os.access(env, os.X_OK) else None
    return shutil.which("redis-server")


class RedisProc:
    """A private redis-server on 127.0.0.1 (free port, temp dir, no persistence), stopped by :meth:`stop`.

    Args:
        binary: the ``redis-server`` executable.
        maxmemory: ``--maxmemory`` in bytes (None: the server's default, no limit).
        extra_args: more ``redis-server`` arguments.

    Raises:
        RuntimeError: the server did not answer ``PING`` within 10 s (it is stopped).
    """

    def __init__(self, binary: str, maxmemory: int | None = None, *, extra_args: tuple[str, ...] = ()) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.binary = binary
        self.dir = tempfile.mkdtemp(prefix="lmtier-bench-redis-")
        cmd = [
            binary,
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            self.dir,
            "--protected-mode",
            "no",
        ]
        if maxmemory is not None:
            cmd += ["--maxmemory", str(maxmemory)]
        self.proc = subprocess.Popen([*cmd, *extra_args], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.time() + 10
        while time.time() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as c:
                    c.sendall(b"PING\r\n")
                    if c.recv(16).startswith(b"+PONG"):
                        return
            except OSError:
                time.sleep(0.05)
        self.stop()
        raise RuntimeError("redis-server did not answer PING within 10 s")

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def stop(self) -> None:
        """Terminate the server (kill after 5 s) and remove its directory. Idempotent."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        shutil.rmtree(self.dir, ignore_errors=True)
