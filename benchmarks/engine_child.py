"""A benchmark's engine child processes: started with a JSON-lines protocol on stdin / stdout.

The parent writes one JSON command per line to the child's stdin; the child answers each with one
JSON line on stdout (other stdout lines are skipped) and writes its log to a file.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

__all__ = ["ask", "start_child"]


def start_child(script: str, args: list[str], env: dict[str, str], log_path: Path, cwd: Path) -> subprocess.Popen:
    """``python script *args`` with pipes for the protocol, stderr to ``log_path``."""
    log = open(log_path, "w")  # noqa: SIM115 - lives as long as the child
    return subprocess.Popen(
        [sys.executable, script, *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=log,
        text=True,
        env=env,
        cwd=cwd,
    )


def ask(p: subprocess.Popen, cmd: dict | None = None) -> dict:
    """Send ``cmd`` (None: nothing) and return the child's next JSON line.

    Raises:
        RuntimeError: the child exited (its log says why).
    """
    if cmd is not None:
        p.stdin.write(json.dumps(cmd) + "\n")
        p.stdin.flush()
    while True:
        line = p.stdout.readline()
        if not line:
            raise RuntimeError("child exited (see its log)")
        if line.startswith("{"):
            return json.loads(line)
