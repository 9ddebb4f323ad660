"""The remote tiers' circuit breaker (Redis, Mooncake Store): after a run of failures, fail fast for a while."""

from __future__ import annotations

import logging
import threading
import time

__all__ = ["CircuitBreaker"]

log = logging.getLogger("lmtier.tiers.remote")


class CircuitBreaker:
    """Consecutive-failure circuit breaker (closed -> open -> half-open trial -> closed/open).

    Args:
        failures: consecutive failures that open it.
        reset_s: seconds it stays open before one trial call is let through.
    """

    def __init__(self, failures: int, reset_s: float) -> None:
        self.failures = failures
        self.reset_s = reset_s
        self._lock = threading.Lock()
        self._consecutive = 0
        self._open_until = 0.0
        self._trial = False
        self.times_opened = 0

    @property
    def is_open(self) -> bool:
        with self._lock:
            return self._consecutive >= self.failures

    def allow(self) -> bool:
        with self._lock:
            if self._consecutive < self.failures:
                return True
            if time.monotonic() >= self._open_until and not self._trial:
                self._trial = True
                return True
            return False

    def success(self) -> None:
        with self._lock:
            if self._consecutive >= self.failures:
                log.info("remote tier: circuit breaker closed")
            self._consecutive = 0
            self._trial = False

    def failure(self) -> None:
        with self._lock:
            self._consecutive += 1
            was_trial, self._trial = self._trial, False
            if self._consecutive == self.failures or (was_trial and self._consecutive > self.failures):
                self._open_until = time.monotonic() + self.reset_s
                if self._consecutive == self.failures:
                    self.times_opened += 1
                    log.warning(
                        "remote tier: circuit breaker open for %.1f s after %d failures",
                        self.reset_s,
                        self._consecutive,
                    )
