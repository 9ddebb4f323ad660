"""The Mooncake tier's client calls: every call of the blocking client on a worker thread, waited for
at most ``timeout_s`` under a circuit breaker, and the client's set-up (with the registrations of the
bounce region and of an attached CPU pool). :class:`ClientCalls` is a mixin of
:class:`~lmtier.tiers.mooncake.tier.MooncakeTier` (which owns the attributes it uses); the failure
model is described there.

Logging: ``logging.getLogger("lmtier.tiers.remote")``.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import socket
import time
from collections.abc import Callable
from typing import Any

from lmtier.errors import LMTierError

__all__ = ["ClientCalls", "Failed", "Pending", "NOT_FOUND_CODES", "is_outage"]

log = logging.getLogger("lmtier.tiers.remote")

NOT_FOUND_CODES = frozenset({-703, -704, -707})
"""Mooncake error codes that mean "not there (yet/any more)": REPLICA_IS_NOT_READY, OBJECT_NOT_FOUND,
LEASE_EXPIRED — a miss, not an outage."""


def is_outage(code: int) -> bool:
    """True for Mooncake error codes that say the store is unreachable or failing: INTERNAL_ERROR
    (-1), TRANSFER_FAIL (-800..-899), RPC_FAIL / RPC_TIMEOUT (-900..-999), etcd/HA states (<= -1000)."""
    return code == -1 or code <= -800


class Failed(LMTierError):
    """A client call did not complete (breaker open, all workers stuck, timeout, exception)."""


@dataclasses.dataclass(eq=False)
class Pending:
    """A started client call and the monotonic time its caller stops waiting."""

    fut: concurrent.futures.Future
    deadline: float


class ClientCalls:
    """Client set-up and calls for :class:`~lmtier.tiers.mooncake.tier.MooncakeTier` (a mixin: it
    uses the tier's ``_lock``, ``_pool`` (the worker threads), ``_store``, ``_arena``, ``breaker``,
    ``counters``, settings and timeouts)."""

    # attributes of the tier this mixin uses (set by MooncakeTier.__init__)
    _lock: Any
    _pool: concurrent.futures.ThreadPoolExecutor
    _store: Any
    _arena: Any
    _store_cls: Any
    _closed: bool
    _next_setup: float
    _inflight: int
    _cpu: Any
    _cpu_base: int
    _cpu_bytes: int
    _cpu_registered: bool
    breaker: Any
    counters: Any
    settings: Any
    endpoint: Any
    url: str
    local_hostname: str
    timeout_s: float
    setup_timeout_s: float
    workers: int
    direct: bool

    def _setup_locked(self) -> bool:
        """Create, set up and register a new client (caller holds ``_lock``); False on failure."""
        s = self.settings
        self.counters["setups"] += 1
        self._next_setup = time.monotonic() + self.breaker.reset_s
        # setup() holds the GIL for as long as it runs (~90 s against a dead master, measured):
        # never call it unless the master accepts connections.
        try:
            socket.create_connection((self.endpoint.host, self.endpoint.port), min(self.timeout_s, 1.0)).close()
        except OSError as e:
            log.debug("remote tier %s: master not reachable (%s)", self.url, e)
            return False
        store = self._store_cls()
        arena = self._arena

        def setup() -> int:
            rc = store.setup(
                self.local_hostname,
                s.metadata_server,
                s.global_segment_size,
                s.local_buffer_size,
                s.protocol,
                s.device_name,
                s.master_server_address,
            )
            if rc != 0:
                return rc
            return store.register_buffer(arena.address, arena.nbytes)

        self._cpu_registered = False
        fut = self._pool.submit(setup)
        try:
            rc = fut.result(self.setup_timeout_s)
        except concurrent.futures.TimeoutError:
            log.warning("remote tier %s: client setup still running after %.1f s", self.url, self.setup_timeout_s)
            return False
        except Exception as e:  # noqa: BLE001 - the client raises RuntimeError and others
            log.warning("remote tier %s: client setup failed: %s: %s", self.url, type(e).__name__, e)
            return False
        if rc != 0:
            log.warning("remote tier %s: client setup returned %d", self.url, rc)
            return False
        self._store = store
        self._register_cpu_locked()
        return True

    def _register_cpu_locked(self) -> None:
        """Register the attached pool's arena with the current client (caller holds ``_lock``);
        a refusal leaves the bounce path (logged)."""
        if self._cpu is None or self._store is None or not self.direct:
            return
        fut = self._pool.submit(self._store.register_buffer, self._cpu_base, self._cpu_bytes)
        try:
            rc = fut.result(self.setup_timeout_s)
        except Exception as e:  # noqa: BLE001 - a timeout or the client's exception
            rc = f"{type(e).__name__}: {e}"
        self._cpu_registered = rc == 0
        if rc != 0:
            log.warning(
                "remote tier %s: registering the CPU pool (%d MiB) failed (%s); chunks go through the bounce region",
                self.url,
                self._cpu_bytes >> 20,
                rc,
            )

    def _client(self) -> Any:
        """The set-up client; a new one is set up at most once per ``breaker_reset_s`` while there is none."""
        with self._lock:
            if self._closed:
                raise Failed("closed")
            if self._store is None:
                if time.monotonic() < self._next_setup or not self._setup_locked():
                    raise Failed("no client")
            return self._store

    def _call(self, fn: Callable[[Any], Any]) -> Any:
        """``fn(client)`` on a worker thread, waited for at most ``timeout_s``, under the breaker.

        Raises:
            Failed: breaker open, no client, all workers busy, timeout, exception, an outage code.
        """
        pending = self._start(fn)
        assert pending is not None
        return self._wait(pending)

    def _start(self, fn: Callable[[Any], Any], *, optional: bool = False) -> Pending | None:
        """Start ``fn(client)`` on a worker thread. ``optional``: a pipelined call that may wait its
        turn — it starts only while the breaker is closed and a worker is free, else returns None
        without counting a failure.

        Raises:
            Failed: (not ``optional``) breaker open, no client, all workers busy, pool closed.
        """
        if optional and self.breaker.is_open:
            return None
        if not self.breaker.allow():
            self.counters["breaker_rejects"] += 1
            raise Failed("breaker open")
        try:
            client = self._client()
        except Failed:
            self.breaker.failure()
            raise
        with self._lock:
            busy = self._inflight >= self.workers
            if not busy:
                self._inflight += 1
        if busy:
            if optional:
                return None
            self.counters["busy"] += 1
            self.breaker.failure()
            raise Failed("all workers busy")

        def done(_f: concurrent.futures.Future | None) -> None:
            with self._lock:
                self._inflight -= 1

        try:
            fut = self._pool.submit(fn, client)
        except RuntimeError:  # the pool is shut down (closed)
            done(None)
            raise Failed("closed") from None
        fut.add_done_callback(done)
        return Pending(fut, time.monotonic() + self.timeout_s)

    def _wait(
        self,
        pending: Pending,
        *,
        extent: tuple[int, int] | None = None,
        release: list[bool] | None = None,
        outage_ok: bool = False,
        on_late: Callable[[], Callable[[concurrent.futures.Future], None]] | None = None,
    ) -> Any:
        """The result of a started call, waiting until ``timeout_s`` after its start.

        A call that times out keeps running; when it finally returns, the bounce ``extent``
        (offset, bytes) is released by the future and ``release[0]`` is set False so the caller
        does not release it too; ``on_late()`` runs then (before this returns) and the callback
        it returns runs when the call returns. ``outage_ok``: return outage codes instead of
        raising (the caller retries those records another way).

        Raises:
            Failed: timeout, exception, an outage code.
        """
        fut = pending.fut
        try:
            res = fut.result(max(0.0, pending.deadline - time.monotonic()))
        except concurrent.futures.TimeoutError:
            if on_late is not None:
                fut.add_done_callback(on_late())
            if extent is not None and release is not None:
                release[0] = False
                off, n = extent
                fut.add_done_callback(lambda _f: self._arena.release(off, n))
            self.counters["timeouts"] += 1
            self.breaker.failure()
            log.debug("remote tier %s: call timed out after %.3f s", self.url, self.timeout_s)
            raise Failed("timeout") from None
        except Exception as e:  # noqa: BLE001
            self.counters["errors"] += 1
            self.breaker.failure()
            log.debug("remote tier %s: %s: %s", self.url, type(e).__name__, e)
            raise Failed(str(e)) from None
        codes = res if isinstance(res, list) else [res]
        if codes and all(isinstance(c, int) and is_outage(c) for c in codes):
            if outage_ok:  # neither a success nor a failure: the caller retries these another way
                return res
            self.breaker.failure()
            raise Failed(f"outage code {codes[0]}")
        self.breaker.success()
        return res
