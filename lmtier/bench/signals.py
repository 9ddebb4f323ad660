"""SIGTERM handling shared by ``lmtier bench`` and ``python -m lmtier.bench.ttft``."""

from __future__ import annotations

import signal
import threading

__all__ = ["exit_on_sigterm"]


def exit_on_sigterm() -> None:
    """Turn SIGTERM (``timeout``, ``kill``) into ``SystemExit(143)`` in the main thread, as Ctrl-C
    raises KeyboardInterrupt: the benchmarks' ``finally`` blocks then stop the servers they started
    (Redis, Mooncake) and remove their temporary folders. Elsewhere than the main thread: no-op."""

    def _exit(signum, frame):
        raise SystemExit(128 + signum)

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _exit)
