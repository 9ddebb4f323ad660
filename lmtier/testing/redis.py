"""A real ``redis-server`` for tests, benchmarks, the demo and the soak: 127.0.0.1, a free port, a
temporary directory, no persistence.

:class:`RedisServer` can be stopped (SIGKILL, to simulate a crash), paused (SIGSTOP, a hung server)
and restarted on the same port; :class:`RedisClusterServers` is a 3-master Redis Cluster. The binary
is :func:`find_redis_server`'s: ``$LMTIER_REDIS_SERVER``, else ``redis-server`` on ``PATH``, else the
checkout's bundle (``scripts/bundle_redis.sh`` -> ``.whl/redis/redis-server``). Tests skip with a
clear reason when there is none (:func:`start_or_skip`), unless ``LMTIER_REQUIRE_REDIS=1`` (CI),
in which case they fail.

Errors: :class:`RedisUnavailable` (no binary, no free port, the server did not answer PING).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

from lmtier import envs
from lmtier.errors import LMTierError
from lmtier.testing.procs import free_port, tail

__all__ = [
    "RedisUnavailable",
    "RedisServer",
    "RedisClusterServers",
    "find_redis_server",
    "free_port",
    "free_cluster_port",
    "start_or_skip",
    "skip_or_fail",
]

_BUNDLE = Path(__file__).resolve().parents[2] / ".whl" / "redis" / "redis-server"


class RedisUnavailable(LMTierError, RuntimeError):
    """No redis-server could be started (the message says why)."""


def find_redis_server() -> str | None:
    """The redis-server to start: ``$LMTIER_REDIS_SERVER`` (None if it is not executable), else
    ``redis-server`` on ``PATH``, else the bundle of ``scripts/bundle_redis.sh`` in the checkout
    (``.whl/redis/redis-server``); None if there is none."""
    env = envs.LMTIER_REDIS_SERVER
    if env:
        return env if os.access(env, os.X_OK) else None
    found = shutil.which("redis-server")
    if found:
        return found
    return str(_BUNDLE) if os.access(_BUNDLE, os.X_OK) else None


def free_cluster_port() -> int:
    """A free port P < 55536 whose cluster-bus port P + 10000 is free too."""
    import random

    for _ in range(200):
        p = random.randint(20000, 30000)
        try:
            with socket.socket() as a, socket.socket() as b:
                a.bind(("127.0.0.1", p))
                b.bind(("127.0.0.1", p + 10000))
            return p
        except OSError:
            continue
    raise RedisUnavailable("no free port pair for a cluster node")


class RedisServer:
    """One redis-server process (call :meth:`start`; :meth:`close` kills it and removes its directory).

    Args:
        password: if set, ``--requirepass``.
        extra_args: more ``redis-server`` arguments.
        port: the port (default: a free one).
        tls: serve TLS only, with a self-signed certificate for 127.0.0.1 (``ca_file``).
        binary: the redis-server executable (default: :func:`find_redis_server`).
        maxmemory: ``--maxmemory`` in bytes (default: none, Redis's unlimited).

    Raises:
        RedisUnavailable: no redis-server binary (or no openssl for ``tls``).
    """

    def __init__(
        self,
        *,
        password: str | None = None,
        extra_args: tuple[str, ...] = (),
        port: int | None = None,
        tls: bool = False,
        binary: str | None = None,
        maxmemory: int | None = None,
    ) -> None:
        binary = binary or find_redis_server()
        if binary is None:
            raise RedisUnavailable(
                "redis-server is not installed (apt-get install redis-server, or set "
                "LMTIER_REDIS_SERVER, or scripts/bundle_redis.sh)"
            )
        if maxmemory is not None:
            extra_args = ("--maxmemory", str(int(maxmemory)), *extra_args)
        self.binary = binary
        self.password = password
        self.extra_args = tuple(extra_args)
        self.dir = tempfile.mkdtemp(prefix="lmtier-redis-")
        self.port = port or free_port()
        self.proc: subprocess.Popen | None = None
        self.tls = tls
        self.ca_file = os.path.join(self.dir, "cert.pem")
        if tls:
            self._make_cert()

    def _make_cert(self) -> None:
        """A self-signed certificate for 127.0.0.1 (its own CA), via the openssl command."""
        if shutil.which("openssl") is None:
            raise RedisUnavailable("openssl is not installed (needed for the TLS test server)")
        r = subprocess.run(
            [
                "openssl",
                "req",
                "-x509",
                "-newkey",
                "rsa:2048",
                "-nodes",
                "-days",
                "2",
                "-keyout",
                os.path.join(self.dir, "key.pem"),
                "-out",
                self.ca_file,
                "-subj",
                "/CN=127.0.0.1",
                "-addext",
                "subjectAltName=IP:127.0.0.1",
            ],
            capture_output=True,
            text=True,
        )
        if r.returncode != 0:
            raise RedisUnavailable(f"openssl failed: {r.stderr[-300:]}")

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        if self.tls:
            return f"rediss://{auth}127.0.0.1:{self.port}/0?ssl_ca_certs={self.ca_file}"
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    @property
    def url_no_auth(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout_s: float = 10.0) -> RedisServer:
        args = [
            self.binary,
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
            "--daemonize",
            "no",
            "--protected-mode",
            "no",
            "--loglevel",
            "warning",
        ]
        if self.password:
            args += ["--requirepass", self.password]
        if self.tls:
            args[1:3] = [
                "--port",
                "0",
                "--tls-port",
                str(self.port),
                "--tls-cert-file",
                self.ca_file,
                "--tls-key-file",
                os.path.join(self.dir, "key.pem"),
                "--tls-ca-cert-file",
                self.ca_file,
                "--tls-auth-clients",
                "no",
            ]
        args += list(self.extra_args)
        # its output goes to a file: a pipe nobody reads would block the server once 64 KiB of
        # warnings had accumulated in a long benchmark or soak
        log_path = os.path.join(self.dir, "redis-server.log")
        with open(log_path, "ab") as log:
            self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RedisUnavailable(f"redis-server exited: {tail(Path(log_path), 20)[-1000:]}")
            if self._ping():
                return self
            time.sleep(0.02)
        self.kill()
        raise RedisUnavailable(f"redis-server did not answer PING within {timeout_s} s")

    def _ping(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as s:
                if self.tls:
                    import ssl

                    ctx = ssl.create_default_context(cafile=self.ca_file)
                    s = ctx.wrap_socket(s, server_hostname="127.0.0.1")
                if self.password:
                    pw = self.password.encode()
                    s.sendall(b"*2\r\n$4\r\nAUTH\r\n$%d\r\n%s\r\n" % (len(pw), pw))
                    s.recv(64)
                s.sendall(b"*1\r\n$4\r\nPING\r\n")
                return s.recv(64).startswith(b"+PONG")
        except OSError:  # includes ssl.SSLError
            return False

    def kill(self) -> None:
        """SIGKILL the server (a crash: no shutdown handshake)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=10)
        self.proc = None

    def pause(self) -> None:
        """SIGSTOP: the server keeps its sockets but answers nothing (a hung server)."""
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        self.proc.send_signal(signal.SIGCONT)

    def restart(self) -> RedisServer:
        self.kill()
        return self.start()

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            try:
                self.proc.send_signal(signal.SIGCONT)
            except OSError:
                pass
        self.kill()
        shutil.rmtree(self.dir, ignore_errors=True)


def skip_or_fail(why: str) -> None:
    """``pytest.skip(why)``, or ``pytest.fail`` when ``LMTIER_REQUIRE_REDIS=1`` (CI must not skip)."""
    import pytest

    if envs.LMTIER_REQUIRE_REDIS:
        pytest.fail(f"LMTIER_REQUIRE_REDIS=1 but {why}")
    pytest.skip(why)


def start_or_skip(**kw) -> RedisServer:
    """Start a :class:`RedisServer` (``kw`` as its constructor), or skip / fail (:func:`skip_or_fail`)."""
    try:
        return RedisServer(**kw).start()
    except RedisUnavailable as e:
        skip_or_fail(f"no redis-server: {e}")
        raise  # not reached: skip_or_fail raises


class RedisClusterServers:
    """A 3-master Redis Cluster on 127.0.0.1 (no replicas), built with ``redis-cli --cluster create``."""

    def __init__(self, *, masters: int = 3) -> None:
        self.nodes = [
            RedisServer(
                port=free_cluster_port(),
                extra_args=(
                    "--cluster-enabled",
                    "yes",
                    "--cluster-config-file",
                    "nodes.conf",
                    "--cluster-node-timeout",
                    "2000",
                ),
            )
            for _ in range(masters)
        ]

    @property
    def url(self) -> str:
        return "redis-cluster://" + ",".join(f"127.0.0.1:{n.port}" for n in self.nodes)

    def start(self, timeout_s: float = 30.0) -> RedisClusterServers:
        cli = shutil.which("redis-cli")
        if cli is None:
            raise RedisUnavailable("redis-cli is not installed")
        try:
            for n in self.nodes:
                n.start()
        except BaseException:
            self.close()
            raise
        r = subprocess.run(
            [
                cli,
                "--cluster",
                "create",
                *[f"127.0.0.1:{n.port}" for n in self.nodes],
                "--cluster-replicas",
                "0",
                "--cluster-yes",
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )
        if r.returncode != 0:
            self.close()
            raise RedisUnavailable(f"redis-cli --cluster create failed: {r.stdout[-500:]} {r.stderr[-500:]}")
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:  # every node must agree (a client may start at any of them)
            if all(
                "cluster_state:ok"
                in subprocess.run([cli, "-p", str(n.port), "cluster", "info"], capture_output=True, text=True).stdout
                for n in self.nodes
            ):
                return self
            time.sleep(0.1)
        self.close()
        raise RedisUnavailable("cluster did not reach cluster_state:ok")

    def close(self) -> None:
        for n in self.nodes:
            n.close()


def start_cluster_or_skip(**kw) -> RedisClusterServers:
    """Start a :class:`RedisClusterServers` (``kw`` as its constructor), or skip / fail (:func:`skip_or_fail`)."""
    try:
        return RedisClusterServers(**kw).start()
    except RedisUnavailable as e:
        skip_or_fail(f"no Redis Cluster: {e}")
        raise  # not reached: skip_or_fail raises
