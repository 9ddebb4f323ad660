"""P2P harness for tests and benchmarks: a :class:`~lmtier.manager.TierManager` with P2P sharing in a
child process (``multiprocessing`` spawn: NIXL/UCX state must not be forked), driven over a pipe.

``P2PNode(config_values, namespace)`` starts the child, which builds its manager with
``TierManager.from_config`` (so the config keys, the P2P tier and its publisher are the product's)
and answers :meth:`P2PNode.call` requests: ``store``, ``fill``, ``publish_now``, ``lookup``, ``fetch``,
``fetch_slots`` (into reserved CPU-pool slots, as the connector fetches), ``held``, ``retrieve``,
``delete_and_reuse``, ``counters``. :meth:`P2PNode.kill` SIGKILLs it, :meth:`pause` SIGSTOPs it.

Tests skip without NIXL (:func:`nixl_missing`), unless ``LMTIER_REQUIRE_NIXL=1`` (CI): then they fail.
"""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import os
import signal
import time
from typing import Any

import numpy as np

from lmtier import envs

__all__ = ["P2PNode", "nixl_missing", "skip_or_fail", "small_namespace_fields", "fill_chunks"]


def nixl_missing() -> str | None:
    """Why NIXL cannot be used here (``None`` when it can)."""
    try:
        from lmtier.tiers.p2p.transport import import_nixl

        import_nixl()
    except Exception as e:  # noqa: BLE001 - TierError, or a broken wheel
        return str(e)
    return None


def skip_or_fail(why: str) -> None:
    """``pytest.skip(why)``, or ``pytest.fail`` when ``LMTIER_REQUIRE_NIXL=1`` (CI must not skip)."""
    import pytest

    if envs.LMTIER_REQUIRE_NIXL:
        pytest.fail(f"LMTIER_REQUIRE_NIXL=1 but {why}")
    pytest.skip(why)


def small_namespace_fields(**kw: Any) -> dict[str, Any]:
    """Fields of a small test :class:`~lmtier.keys.Namespace` (64 KiB chunks); ``kw`` overrides."""
    return dict(model="p2p-test", num_layers=2, num_kv_heads=2, head_size=64, kv_dtype="float16", chunk_size=64) | kw


def fill_chunks(count: int, nbytes: int, seed: int) -> tuple[list[bytes], list[np.ndarray]]:
    """``count`` chunk keys and random payloads (``np.uint8 [nbytes]``) of ``seed`` — the same in
    every process (benchmarks fill a node's pool in the child and check the bytes in the parent)."""
    rng = np.random.default_rng(seed)
    keys = [hashlib.blake2b(b"%d/%d" % (seed, i), digest_size=32).digest() for i in range(count)]
    return keys, [rng.integers(0, 256, nbytes, dtype=np.uint8) for _ in range(count)]


def _child(conn: Any, values: dict[str, Any], ns_fields: dict[str, Any], env: dict[str, str]) -> None:
    """The node: build the manager, then serve requests until ``close`` or EOF."""
    os.environ.update(env)
    from lmtier.config import LMTierConfig
    from lmtier.keys import Namespace
    from lmtier.manager import TierManager

    ns = Namespace(**ns_fields)
    try:
        mgr = TierManager.from_config(LMTierConfig.from_dict(values, env=os.environ), ns)
    except Exception as e:  # noqa: BLE001 - reported to the parent
        conn.send(("error", f"{type(e).__name__}: {e}"))
        return
    conn.send(("ready", (os.getpid(), mgr.p2p.node_id)))
    while True:
        try:
            op, args = conn.recv()
        except EOFError:
            break
        try:
            conn.send(("ok", _serve(mgr, op, args)))
        except Exception as e:  # noqa: BLE001
            conn.send(("error", f"{type(e).__name__}: {e}"))
        if op == "close":
            return
    mgr.close(persist=False)


def _serve(mgr: Any, op: str, args: tuple) -> Any:
    if op == "store":  # (keys, payloads): store and wait; True per stored chunk
        return [mgr.store(k, p, timeout_s=None).result(30) for k, p in zip(*args, strict=True)]
    if op == "fill":  # (count, nbytes, seed): store fill_chunks(...) and publish; returns the keys
        keys, payloads = fill_chunks(*args)
        ok = [mgr.store(k, p, timeout_s=None).result(60) for k, p in zip(keys, payloads, strict=True)]
        return keys if all(ok) and mgr.p2p.publish_now(60.0) else None
    if op == "publish_now":
        return mgr.p2p.publish_now(10.0)
    if op == "lookup":
        return mgr.lookup(args[0])
    if op == "fetch":  # (keys, nbytes): through fetch_lower_many (disk, p2p, remote), timed
        keys, nbytes = args
        outs = [bytearray(nbytes) for _ in keys]
        t0 = time.monotonic()
        got = mgr.fetch_lower_many(keys, outs)
        dt = time.monotonic() - t0
        return [None if n is None else bytes(o[:n]) for n, o in zip(got, outs, strict=True)], dt
    if op == "fetch_slots":  # (keys, nbytes): as "fetch", into reserved CPU-pool slots (the connector's way)
        keys, nbytes = args
        slots = [mgr.cpu.reserve(os.urandom(32)) for _ in keys]
        try:
            t0 = time.monotonic()
            got = mgr.fetch_lower_many(keys, [s.view[:nbytes] for s in slots])
            dt = time.monotonic() - t0
            data = [None if n is None else s.view[:n].numpy().tobytes() for n, s in zip(got, slots, strict=True)]
            return data, dt, mgr.cpu.num_held()
        finally:
            for s in slots:
                mgr.cpu.abort(s)
    if op == "held":  # CPU-pool slots held (a READ that outlived its wait may still write them)
        return mgr.cpu.num_held()
    if op == "retrieve":  # (key, nbytes): through retrieve_into (promotion into the CPU pool)
        out = bytearray(args[1])
        n = mgr.retrieve_into(args[0], out)
        return None if n is None else bytes(out[:n])
    if op == "delete_and_reuse":  # (old key, new key, payload): the old slot holds the new chunk
        assert mgr.cpu.delete(args[0])
        return mgr.cpu.put(args[1], args[2])
    if op == "counters":
        tier = mgr.p2p
        return dict(mgr.counters), dict(tier.counters), dict(tier.directory.counters)
    if op == "close":
        mgr.close(persist=False)
        return True
    raise ValueError(f"unknown op {op!r}")


class P2PNode:
    """A TierManager with P2P sharing in a spawned child process.

    Args:
        values: the config keys (``LMTierConfig.from_dict``).
        ns_fields: the :class:`~lmtier.keys.Namespace` fields.
        env: extra environment variables of the child (e.g. the token variable).
        start_timeout_s: how long to wait for the child's manager (a hang guard, not a speed check: a
            spawned child imports torch and NIXL, which took over 60 s at load average 37 on 2 cores).

    Raises:
        RuntimeError: the child failed to build its manager (the message carries its error).

    Attributes:
        pid: the child's process id. node_id: its P2P node id (``p2p_host:port``).
    """

    def __init__(
        self,
        values: dict[str, Any],
        ns_fields: dict[str, Any],
        *,
        env: dict[str, str] | None = None,
        start_timeout_s: float = 300.0,
    ) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_child, args=(child, values, ns_fields, env or {}), daemon=True)
        self.proc.start()
        child.close()
        if not self.conn.poll(start_timeout_s):
            self.kill()
            raise RuntimeError(f"P2P node did not start within {start_timeout_s:.0f} s (hang guard)")
        status, value = self.conn.recv()
        if status != "ready":
            self.proc.join(5)
            raise RuntimeError(f"P2P node failed: {value}")
        self.pid, self.node_id = value

    def call(self, op: str, *args: Any, timeout_s: float = 60.0) -> Any:
        """Run ``op`` in the child and return its result.

        Raises:
            TimeoutError: no answer within ``timeout_s``. RuntimeError: the child raised.
        """
        self.conn.send((op, args))
        if not self.conn.poll(timeout_s):
            raise TimeoutError(f"P2P node: {op} did not answer within {timeout_s} s")
        status, value = self.conn.recv()
        if status != "ok":
            raise RuntimeError(f"P2P node: {op}: {value}")
        return value

    def kill(self) -> None:
        """SIGKILL the child (a crash)."""
        if self.proc.is_alive():
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.join(10)

    def pause(self) -> None:
        os.kill(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        os.kill(self.proc.pid, signal.SIGCONT)

    def close(self) -> None:
        """Close the manager (withdrawing its directory entries) and end the child."""
        if self.proc.is_alive():
            try:
                self.resume()
                self.call("close", timeout_s=30)
            except (TimeoutError, RuntimeError, OSError, EOFError):
                pass
        self.proc.join(10)
        if self.proc.is_alive():
            self.kill()
        self.conn.close()
