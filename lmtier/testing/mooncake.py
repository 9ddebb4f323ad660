"""A real Mooncake Store for tests, benchmarks and the soak: ``mooncake_master`` on 127.0.0.1 with
ports chosen per run, and optionally standalone store servers (``mooncake_client``) that hold the
data, so that it outlives the engines that stored it (two engines one after the other share it).

:class:`MooncakeMaster` can be killed (SIGKILL, a crash), paused (SIGSTOP, a hung master), resumed
and restarted on the same ports (its metadata is lost on a restart: Mooncake's master keeps it in
memory unless HA is set up). :class:`MooncakeStoreServer` is one ``mooncake_client`` process that
mounts ``segment_bytes`` of its memory into the store; it can be killed and restarted as well.
:class:`MooncakeCluster` is a master plus N store servers with one ``url`` and ``close``.

The binaries come with the ``mooncake-transfer-engine-non-cuda`` wheel (scripts/setup_mooncake.sh);
:func:`find_mooncake_bin` looks next to the running interpreter, then in the ``mooncake`` package,
then on ``PATH``. Tests skip with a clear reason when the package or the binaries are missing
(:func:`start_or_skip`), unless ``LMTIER_REQUIRE_MOONCAKE=1`` (CI), in which case they fail.

Errors: :class:`MooncakeUnavailable`.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
from pathlib import Path

from lmtier import envs
from lmtier.errors import LMTierError
from lmtier.testing.procs import Proc, free_port, tail

__all__ = [
    "MooncakeUnavailable",
    "MooncakeMaster",
    "MooncakeStoreServer",
    "MooncakeCluster",
    "find_mooncake_bin",
    "mooncake_client_importable",
    "skip_or_fail",
    "start_or_skip",
]


class MooncakeUnavailable(LMTierError, RuntimeError):
    """No Mooncake Store could be started (the message says why)."""


def mooncake_client_importable() -> str | None:
    """None when ``from mooncake.store import MooncakeDistributedStore`` works, else why not."""
    try:
        from mooncake.store import MooncakeDistributedStore  # noqa: F401
    except Exception as e:  # noqa: BLE001 - ImportError, or OSError for a missing libibverbs
        return f"{type(e).__name__}: {e}"
    return None


def find_mooncake_bin(name: str) -> str | None:
    """``mooncake_master`` / ``mooncake_client``: next to ``sys.executable`` (a venv's bin), in the
    installed ``mooncake`` package, or on ``PATH``; None if none is executable."""
    cands = [Path(sys.executable).parent / name]
    try:
        import importlib.util

        spec = importlib.util.find_spec("mooncake")
        if spec is not None and spec.submodule_search_locations:
            cands += [Path(p) / name for p in spec.submodule_search_locations]
    except (ImportError, ValueError):
        pass
    for c in cands:
        if os.access(c, os.X_OK):
            return str(c)
    return shutil.which(name)


def _wait_port(port: int, proc: Proc, what: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not proc.alive():
            raise MooncakeUnavailable(f"{what} exited: {tail(proc.log_path, 20)}")
        try:
            socket.create_connection(("127.0.0.1", port), 0.2).close()
            return
        except OSError:
            time.sleep(0.05)
    raise MooncakeUnavailable(f"{what} did not listen on 127.0.0.1:{port} within {timeout_s:.0f} s")


class _Process:
    """A restartable child on fixed ports: :meth:`kill` (SIGKILL), :meth:`pause` / :meth:`resume`."""

    what = "process"
    proc: Proc | None = None

    def _cmd(self) -> list[str]:  # pragma: no cover - overridden
        raise NotImplementedError

    def _port(self) -> int:  # pragma: no cover - overridden
        raise NotImplementedError

    def start(self, timeout_s: float = 30.0) -> _Process:
        """Start it and wait until its port accepts connections.

        Raises:
            MooncakeUnavailable: it exited or did not listen in time.
        """
        self.starts += 1
        log = Path(self.dir) / f"{self.what}.{self.starts}.log"
        self.proc = Proc(self.what, self._cmd(), dict(os.environ), log)
        try:
            _wait_port(self._port(), self.proc, self.what, timeout_s)
        except BaseException:
            self.kill()
            raise
        return self

    def alive(self) -> bool:
        return self.proc is not None and self.proc.alive()

    def kill(self) -> None:
        """SIGKILL (a crash); a no-op when it is not running."""
        if self.proc is not None and self.proc.alive():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pgid, signal.SIGKILL)
                os.killpg(self.proc.pgid, signal.SIGCONT)
            self.proc.popen.wait(timeout=10)
        if self.proc is not None:
            self.proc.stop(grace_s=5)  # reaps the (dead) group and closes the log

    def pause(self) -> None:
        """SIGSTOP: it hangs (connections stay open, nothing answers)."""
        assert self.proc is not None
        os.killpg(self.proc.pgid, signal.SIGSTOP)

    def resume(self) -> None:
        """SIGCONT after :meth:`pause`."""
        assert self.proc is not None
        os.killpg(self.proc.pgid, signal.SIGCONT)

    def restart(self, timeout_s: float = 30.0) -> _Process:
        """Kill, then start on the same ports."""
        self.kill()
        return self.start(timeout_s)

    def log_tail(self, n: int = 40) -> str:
        return tail(self.proc.log_path, n) if self.proc is not None else ""


class MooncakeMaster(_Process):
    """One ``mooncake_master`` on 127.0.0.1 (call :meth:`start`; :meth:`close` kills it).

    Args:
        rpc_port, metrics_port, http_metadata_port: ports (default: free ones, fixed for restarts).
        lease_ttl_ms: ``-default_kv_lease_ttl`` (Mooncake's default, 10 s): a reader's lease on an
            object; it cannot be evicted or removed without force meanwhile, and a read whose
            transfer outlasts it fails with LEASE_EXPIRED (-707; a miss for the tier).
        client_ttl_s: ``-client_ttl``: seconds until a silent client's segments are unmounted.
        extra_args: more ``mooncake_master`` flags.
        binary: the executable (default: :func:`find_mooncake_bin`).

    The master also serves the HTTP metadata service (``metadata_url``) for clients configured with
    ``metadata_server: http://...``; the default ``P2PHANDSHAKE`` does not need it.

    Raises:
        MooncakeUnavailable: no binary.
    """

    what = "mooncake_master"

    def __init__(
        self,
        *,
        rpc_port: int | None = None,
        metrics_port: int | None = None,
        http_metadata_port: int | None = None,
        lease_ttl_ms: int = 10_000,
        client_ttl_s: int = 10,
        extra_args: tuple[str, ...] = (),
        binary: str | None = None,
    ) -> None:
        binary = binary or find_mooncake_bin("mooncake_master")
        if binary is None:
            raise MooncakeUnavailable("mooncake_master not found (bash scripts/setup_mooncake.sh)")
        self.binary = binary
        self.rpc_port = rpc_port or free_port()
        self.metrics_port = metrics_port or free_port()
        self.http_metadata_port = http_metadata_port or free_port()
        self.lease_ttl_ms = lease_ttl_ms
        self.client_ttl_s = client_ttl_s
        self.extra_args = tuple(extra_args)
        self.dir = tempfile.mkdtemp(prefix="lmtier-mooncake-")
        self.starts = 0

    @property
    def address(self) -> str:
        """``127.0.0.1:PORT``, the master's RPC address (``master_server_address``)."""
        return f"127.0.0.1:{self.rpc_port}"

    @property
    def url(self) -> str:
        """``mooncakestore://127.0.0.1:PORT/`` for ``remote_url``."""
        return f"mooncakestore://{self.address}/"

    @property
    def metadata_url(self) -> str:
        return f"http://127.0.0.1:{self.http_metadata_port}/metadata"

    def _port(self) -> int:
        return self.rpc_port

    def _cmd(self) -> list[str]:
        return [
            self.binary,
            f"-rpc_port={self.rpc_port}",
            "-rpc_address=127.0.0.1",
            f"-metrics_port={self.metrics_port}",
            "-enable_http_metadata_server=true",
            "-http_metadata_server_host=127.0.0.1",
            f"-http_metadata_server_port={self.http_metadata_port}",
            f"-default_kv_lease_ttl={self.lease_ttl_ms}",
            f"-client_ttl={self.client_ttl_s}",
            *self.extra_args,
        ]

    def close(self) -> None:
        self.kill()
        shutil.rmtree(self.dir, ignore_errors=True)


class MooncakeStoreServer(_Process):
    """One standalone ``mooncake_client`` that mounts ``segment_bytes`` of memory into the store of
    ``master`` (the data then lives in this process, not in the engines').

    Args:
        master: the :class:`MooncakeMaster`.
        segment_bytes: memory it contributes.
        port: its service port (default: a free one).
        binary: the executable (default: :func:`find_mooncake_bin`).
    """

    what = "mooncake_client"

    def __init__(
        self,
        master: MooncakeMaster,
        *,
        segment_bytes: int = 512 << 20,
        port: int | None = None,
        binary: str | None = None,
    ) -> None:
        binary = binary or find_mooncake_bin("mooncake_client")
        if binary is None:
            raise MooncakeUnavailable("mooncake_client not found (bash scripts/setup_mooncake.sh)")
        self.binary = binary
        self.master = master
        self.segment_bytes = segment_bytes
        self.port = port or free_port()
        self.dir = master.dir
        self.starts = 0

    def _port(self) -> int:
        return self.port

    def _cmd(self) -> list[str]:
        return [
            self.binary,
            f"-master_server_address={self.master.address}",
            "-metadata_server=P2PHANDSHAKE",
            "-host=127.0.0.1",
            f"-port={self.port}",
            f"-global_segment_size={self.segment_bytes}",
            "-protocol=tcp",
        ]

    def close(self) -> None:
        self.kill()


class MooncakeCluster:
    """A master and ``servers`` store servers (each mounting ``segment_bytes``) on 127.0.0.1.

    ``start`` starts them in order; ``close`` kills all and removes the temporary directory.
    """

    def __init__(self, *, servers: int = 1, segment_bytes: int = 512 << 20, **master_kw) -> None:
        self.master = MooncakeMaster(**master_kw)
        self.servers = [MooncakeStoreServer(self.master, segment_bytes=segment_bytes) for _ in range(servers)]

    @property
    def url(self) -> str:
        return self.master.url

    def start(self, timeout_s: float = 30.0) -> MooncakeCluster:
        try:
            self.master.start(timeout_s)
            for s in self.servers:
                s.start(timeout_s)
        except BaseException:
            self.close()
            raise
        return self

    def restart_master(self, timeout_s: float = 30.0) -> None:
        """Kill and restart the master on its ports; the store servers re-mount their segments
        by themselves (their ping threads), which takes a second or two."""
        self.master.restart(timeout_s)

    def close(self) -> None:
        for s in self.servers:
            s.close()
        self.master.close()


def skip_or_fail(why: str) -> None:
    """``pytest.skip(why)``, or ``pytest.fail`` when ``LMTIER_REQUIRE_MOONCAKE=1`` (CI must not skip)."""
    import pytest

    if envs.LMTIER_REQUIRE_MOONCAKE:
        pytest.fail(f"LMTIER_REQUIRE_MOONCAKE=1 but {why}")
    pytest.skip(why)


def start_or_skip(*, servers: int = 1, **kw) -> MooncakeCluster:
    """A started :class:`MooncakeCluster` (``kw`` as its constructor), or skip / fail
    (:func:`skip_or_fail`) when the client package or the binaries are missing."""
    why = mooncake_client_importable()
    if why is not None:
        skip_or_fail(f"the mooncake client cannot be imported ({why}); bash scripts/setup_mooncake.sh")
    try:
        return MooncakeCluster(servers=servers, **kw).start()
    except MooncakeUnavailable as e:
        skip_or_fail(f"no Mooncake Store: {e}")
        raise  # not reached: skip_or_fail raises
