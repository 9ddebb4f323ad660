"""The NIXL side of P2P sharing: one agent (UCX backend) per tier, memory registration, peers loaded
from their published metadata, and one-sided READs with a deadline.

NIXL (ai-dynamo/nixl) Python API of the ``nixl-cu12`` wheel (module ``nixl_cu12``; the ``nixl``
meta package's module ``nixl`` is accepted too): ``nixl_agent``, ``register_memory``,
``get_agent_metadata`` / ``add_remote_agent`` / ``remove_remote_agent``, ``get_xfer_descs`` from
``(address, bytes, device id)`` tuples, ``initialize_xfer("READ", local, remote, peer)``,
``transfer``, ``check_xfer_state`` -> ``"PROC"`` / ``"DONE"`` / ``"ERR"``, ``release_xfer_handle``
(which cancels an unfinished transfer, or raises when it cannot). Measured here (nixl-cu12 1.5.1,
UCX over TCP on loopback, two processes): a READ from a SIGKILLed peer raises
``nixlRemoteDisconnectError`` at once; a paused peer leaves the transfer in ``"PROC"``.

The agent runs in NIXL's ``STRICT`` thread-sync mode (its own lock), so tier threads may share it.
Reads are non-blocking (:meth:`NixlTransport.start_read`, :meth:`~NixlTransport.poll`,
:meth:`~NixlTransport.end`): the tier polls them from the calling thread
(:mod:`lmtier.tiers.p2p.reads`); :meth:`NixlTransport.read` is the blocking form with a deadline.

Logging: ``logging.getLogger("lmtier.tiers.p2p")``.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Sequence
from typing import Any

from lmtier import envs
from lmtier.affinity import unpinned
from lmtier.tiers.base import TierError

__all__ = [
    "NixlTransport",
    "import_nixl",
    "new_agent",
    "PROGRESS_DELAY_US",
    "DONE",
    "ERR",
    "TIMEOUT",
    "STUCK",
    "POLL_MIN_S",
    "POLL_MAX_S",
]

log = logging.getLogger("lmtier.tiers.p2p")

DONE, ERR, TIMEOUT, STUCK = "DONE", "ERR", "TIMEOUT", "STUCK"
"""Outcomes of :meth:`NixlTransport.read`: complete; failed (nothing more will be written); past the
deadline and cancelled (nothing more will be written); past the deadline and NOT cancellable (the
local memory may still be written: never reuse it)."""

POLL_MIN_S = 20e-6
"""First pause between two polls of a running READ (seconds); doubled up to :data:`POLL_MAX_S`."""
POLL_MAX_S = 1e-3
PROGRESS_DELAY_US = 100
"""Pause of the agent's UCX progress thread between two idle polls (microseconds; NIXL's
``nixlAgentConfig.pthrDelay``). The wheel's ``nixl_agent`` hard-codes 0: the thread busy-polls, a
sizeable share of a core per agent even when idle (0.3 cores measured on the 2-core box), which
slows every other thread of the host. With 100 µs it idles at ~0.01 cores and READs are not slower
(benchmarks/RESULTS.md §3.5)."""

_agent_lock = threading.Lock()


def new_agent(api: Any, name: str, cfg: Any, delay_us: int) -> Any:
    """``api.nixl_agent(name, cfg)`` with the progress thread's ``pthrDelay`` set to ``delay_us``
    (the wheel's constructor overwrites it with 0 just before it builds the C++ agent, so the
    constructor is given, for the duration of the call, a view of its bindings module whose
    ``nixlAgent`` sets ``pthrDelay`` first; everything else is the module's own)."""
    real = api.nixlBind

    class _Bind:
        def __getattr__(self, attr: str) -> Any:
            return getattr(real, attr)

        @staticmethod
        def nixlAgent(agent_name: str, agent_config: Any) -> Any:  # noqa: N802 - NIXL's name
            agent_config.pthrDelay = delay_us
            return real.nixlAgent(agent_name, agent_config)

    with _agent_lock:
        api.nixlBind = _Bind()
        try:
            return api.nixl_agent(name, cfg)
        finally:
            api.nixlBind = real


def _ucx_modules_default() -> None:
    """Work around a crash at process exit (nixl-cu12 1.5.1 wheel, measured here): on a host without
    RDMA devices, once an agent started, the process dies with SIGSEGV in the bundled libnl-route's
    destructor (``rtnl_tc_unregister`` from ``_dl_fini``; libnl is loaded by UCX's IB transport
    modules). With UCX's IB modules not loaded (``UCX_MODULES=^ib``) it exits cleanly. So on a host
    with no ``/sys/class/infiniband`` device, and unless ``UCX_MODULES`` is set, this sets
    ``UCX_MODULES=^ib`` before the first agent starts (no IB device: nothing is lost). Hosts with
    RDMA devices keep UCX's defaults."""
    if envs.get("UCX_MODULES") is not None:
        return
    try:
        has_ib = bool(os.listdir("/sys/class/infiniband"))
    except OSError:
        has_ib = False
    if not has_ib:
        os.environ["UCX_MODULES"] = "^ib"


def import_nixl() -> Any:
    """NIXL's ``_api`` module (``nixl_cu12._api``, else ``nixl._api``).

    Raises:
        TierError: neither is installed (``scripts/setup_nixl.sh`` / ``pip install 'lmtier[p2p]'``).
    """
    try:
        import nixl_cu12._api as api
    except ImportError:
        try:
            import nixl._api as api  # type: ignore[no-redef]
        except ImportError as e:
            raise TierError(
                f"P2P sharing needs NIXL ({e}); install it with scripts/setup_nixl.sh "
                "(pip install nixl-cu12==1.5.1 --no-deps) or pip install 'lmtier[p2p]'"
            ) from None
    return api


class NixlTransport:
    """One NIXL agent with the UCX backend. Thread-safe.

    Args:
        agent_name: unique among the peers (the tier uses ``lmtier-p2p-<node id>-<epoch hex>``).

    Raises:
        TierError: NIXL is not installed or the agent could not be created.
    """

    def __init__(self, agent_name: str) -> None:
        api = import_nixl()
        _ucx_modules_default()
        try:
            cfg = api.nixl_agent_config(
                enable_prog_thread=True,
                enable_listen_thread=False,
                backends=["UCX"],
                sync_mode=api.nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT,
            )
            with unpinned():  # the agent's progress and UCX threads inherit this thread's CPUs
                self.agent = new_agent(api, agent_name, cfg, PROGRESS_DELAY_US)
        except Exception as e:  # noqa: BLE001 - NIXL raises its own exception types
            raise TierError(f"NIXL agent {agent_name!r} could not start: {type(e).__name__}: {e}") from None
        if "UCX" not in self.agent.backends:
            raise TierError(f"NIXL agent {agent_name!r}: the UCX backend is not available")
        self.name = agent_name
        self._lock = threading.Lock()
        self._regs: list[Any] = []
        self._peers: dict[str, bytes] = {}  # agent name -> the metadata loaded for it

    def register(self, address: int, nbytes: int) -> None:
        """Register host memory ``[address, address + nbytes)`` (DRAM) with every backend.

        Raises:
            TierError: NIXL refused.
        """
        try:
            reg = self.agent.register_memory([(address, nbytes, 0, "")], "DRAM")
        except Exception as e:  # noqa: BLE001
            raise TierError(f"NIXL register_memory of {nbytes} bytes failed: {type(e).__name__}: {e}") from None
        with self._lock:
            self._regs.append(reg)

    def metadata(self) -> bytes:
        """This agent's metadata (connection info and registered memory) for peers."""
        return bytes(self.agent.get_agent_metadata())

    def load_peer(self, agent_name: str, metadata: bytes) -> bool:
        """Make ``agent_name`` (published ``metadata``) readable; a no-op if that metadata is loaded.
        Returns False when NIXL rejects the metadata or it names another agent."""
        with self._lock:
            if self._peers.get(agent_name) == metadata:
                return True
            if agent_name in self._peers:
                self._drop_locked(agent_name)
            try:
                got = self.agent.add_remote_agent(metadata)
            except Exception as e:  # noqa: BLE001
                log.warning("p2p: NIXL rejected the metadata of %s: %s: %s", agent_name, type(e).__name__, e)
                return False
            got = got.decode() if isinstance(got, bytes) else str(got)
            if got != agent_name:
                log.warning("p2p: metadata published for agent %s names agent %s; refused", agent_name, got)
                self._drop_locked(got)
                return False
            self._peers[agent_name] = metadata
            return True

    def drop_peer(self, agent_name: str) -> None:
        """Forget a peer (disconnect); a no-op if unknown."""
        with self._lock:
            if agent_name in self._peers:
                self._drop_locked(agent_name)

    def _drop_locked(self, agent_name: str) -> None:
        self._peers.pop(agent_name, None)
        try:
            self.agent.remove_remote_agent(agent_name)
        except Exception as e:  # noqa: BLE001
            log.debug("p2p: remove_remote_agent(%s): %s", agent_name, e)

    def start_read(self, peer: str, pieces: Sequence[tuple[int, int, int]]) -> tuple[Any, str]:
        """Start a one-sided READ of ``pieces`` from ``peer`` without waiting for it.

        Args:
            peer: a loaded peer's agent name.
            pieces: ``(local address, remote address, bytes)`` per piece; local memory registered
                here, remote memory registered by the peer.

        Returns:
            ``(handle, state)``: state ``"PROC"`` (poll the handle with :meth:`poll`, end it with
            :meth:`end`), :data:`DONE` or :data:`ERR` (the handle is already released; None on
            ERR before a handle existed). Never raises for transfer failures.
        """
        agent = self.agent
        handle = None
        try:
            local = agent.get_xfer_descs([(a, n, 0) for a, _, n in pieces], "DRAM")
            remote = agent.get_xfer_descs([(r, n, 0) for _, r, n in pieces], "DRAM")
            handle = agent.initialize_xfer("READ", local, remote, peer)
            state = agent.transfer(handle)
        except Exception as e:  # noqa: BLE001 - nixlRemoteDisconnectError and other NIXL errors
            log.debug("p2p: READ from %s failed to start: %s: %s", peer, type(e).__name__, e)
            self.end(handle)
            return None, ERR
        if state == "PROC":
            return handle, "PROC"
        self.end(handle)
        return None, DONE if state == "DONE" else ERR

    def poll(self, handle: Any) -> str:
        """``"PROC"`` while a started READ runs, then :data:`DONE` or :data:`ERR` (never raises)."""
        try:
            state = self.agent.check_xfer_state(handle)
        except Exception as e:  # noqa: BLE001
            log.debug("p2p: READ failed: %s: %s", type(e).__name__, e)
            return ERR
        return "PROC" if state == "PROC" else DONE if state == "DONE" else ERR

    def end(self, handle: Any, *, running: bool = False) -> str:
        """Release a READ's handle. ``running``: it has not completed — NIXL cancels it; returns
        :data:`TIMEOUT` when that worked, :data:`STUCK` when NIXL refused (the local memory may
        still be written: never reuse it). Otherwise returns :data:`DONE` (released)."""
        if handle is None:
            return DONE
        try:
            handle.release()  # cancels an unfinished transfer, or raises when it cannot
        except Exception as e:  # noqa: BLE001
            if running:
                log.warning("p2p: a READ could not be cancelled: %s", e)
                return STUCK
            log.debug("p2p: releasing a transfer handle: %s", e)
        return TIMEOUT if running else DONE

    def read(self, peer: str, pieces: Sequence[tuple[int, int, int]], deadline: float) -> str:
        """One-sided READ of ``pieces`` from ``peer``, polled until done or cancelled at ``deadline``
        (``time.monotonic()``): :data:`DONE`, :data:`ERR`, :data:`TIMEOUT` or :data:`STUCK`. (The tier
        polls its READs itself and does not cancel them at a deadline: :mod:`lmtier.tiers.p2p.reads`.)"""
        handle, state = self.start_read(peer, pieces)
        pause = POLL_MIN_S
        while state == "PROC":
            if time.monotonic() >= deadline:
                return self.end(handle, running=True)
            time.sleep(pause)
            pause = min(pause * 2, POLL_MAX_S)
            state = self.poll(handle)
        self.end(handle)
        return state

    def close(self) -> None:
        """Forget every peer and deregister memory (the agent itself goes with the object)."""
        with self._lock:
            for name in list(self._peers):
                self._drop_locked(name)
            regs, self._regs = self._regs, []
        for reg in regs:
            try:
                self.agent.deregister_memory(reg)
            except Exception as e:  # noqa: BLE001
                log.debug("p2p: deregister_memory: %s", e)
