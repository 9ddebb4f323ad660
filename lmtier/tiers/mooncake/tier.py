"""Remote tier on Mooncake Store (kvcache-ai/Mooncake) through its official client,
``mooncake.store.MooncakeDistributedStore`` (the ``mooncake`` extra: scripts/setup_mooncake.sh).

One Mooncake object per chunk, named ``<key_prefix><key hex>``, whose value is a self-describing
record of :mod:`lmtier.record` with the compact header (``payload_offset = 128``) followed by the
payload, as in the Redis tier: a wrong, torn, truncated or replaced value fails the header, length or
xxh3 check and is a miss (and is removed), never KV handed to attention.

Data path (zero-copy on the client's side). The tier owns one page-aligned bounce region
(``bounce_bytes``, anonymous memory) registered once with ``register_buffer``; batches of records
move with one ``batch_put_from`` / ``batch_get_into`` call between that region and the store (the
transfer engine reads and writes the registered memory directly). The caller's payloads are copied
into the region (put) and verified records are copied out of it (get). The copy is what makes
timeouts safe: the client is blocking C++ that cannot be cancelled, so a call that outlives its
timeout keeps running; it only ever touches the region's extent of that call, which stays reserved
until the call really returns (:class:`_Arena`), so a late write can never land in memory the caller
has reused. CUDA payloads/destinations go through :class:`lmtier.tiers.device.PinnedBounce`.

Failure model (as for Redis): every client call runs on a worker thread and the caller waits at most
``timeout_s`` (``setup_timeout_s`` for ``setup``); a call that times out, raises or returns an
outage code (RPC/transfer failures) counts as a failure of the circuit breaker
(:class:`lmtier.tiers.breaker.CircuitBreaker`); while it is open, calls return misses / False at
once. When all ``workers`` threads are stuck (a paused master holds each call ~30 s), further calls
fail at once instead of queueing. Loads become misses and stores return False; nothing raises to
the caller. Measured here (0.3.13.post1): with the master SIGSTOPped a client call blocks ~30 s (its
RPC timeout; the data calls release the GIL), with it killed ~4 s; after a master restart the client
re-mounts its segment by itself (its ping thread), so the tier recovers without a new client. A
client whose ``setup`` failed (master down at startup) is replaced by a new one on a later call, at
most once per ``breaker_reset_s``. ``setup`` itself holds the GIL while it runs (~90 s against a
dead master), so it is only called once a TCP connect to the master succeeded (a dead master costs
a refused connect); the residual risk is a master that accepts connections but does not answer
(paused) exactly while a client is being set up: the process then stalls until the client's RPC
timeout.

Visibility (Mooncake #1817: ``put`` may return OK on failure): a put returns True only when
``batch_put_from`` returned 0 for the record **and** ``batch_is_exist`` then confirms it; only then
does the tier manager publish the chunk (index events, ``stored_remote``). ``contains`` asks the
master (``batch_is_exist``, one call per batch): there is no local index, so chunks other processes
stored are found, and a value evicted or removed between lookup and read is a miss (the read returns
OBJECT_NOT_FOUND, or the record does not verify).

Logging: ``logging.getLogger("lmtier.tiers.remote")``.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import logging
import mmap
import socket
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from lmtier import record as rec
from lmtier.remote_url import MooncakeEndpoint, parse_mooncake_url
from lmtier.tiers.base import KEY_BYTES, Tier, TierError, TierUsage
from lmtier.tiers.breaker import CircuitBreaker
from lmtier.tiers.buffers import address_of, round_up
from lmtier.tiers.device import PinnedBounce, is_cuda_tensor
from lmtier.tiers.mooncake.settings import MooncakeSettings, local_address_towards

if TYPE_CHECKING:
    from lmtier.config import RemoteConfig

__all__ = ["MooncakeTier", "HEADER", "NOT_FOUND_CODES", "is_outage"]

log = logging.getLogger("lmtier.tiers.remote")

HEADER = rec.COMPACT_PAYLOAD_OFFSET
"""Bytes of the compact record header in front of every stored payload."""
_ALIGN = 64  # records in the bounce region start on cache lines

NOT_FOUND_CODES = frozenset({-703, -704, -707})
"""Mooncake error codes that mean "not there (yet/any more)": REPLICA_IS_NOT_READY, OBJECT_NOT_FOUND,
LEASE_EXPIRED — a miss, not an outage."""


def is_outage(code: int) -> bool:
    """True for Mooncake error codes that say the store is unreachable or failing: INTERNAL_ERROR
    (-1), TRANSFER_FAIL (-800..-899), RPC_FAIL / RPC_TIMEOUT (-900..-999), etcd/HA states (<= -1000)."""
    return code == -1 or code <= -800


class _Failed(Exception):
    """A client call did not complete (breaker open, all workers stuck, timeout, exception)."""


class _Arena:
    """The registered bounce region and a first-fit allocator of its extents (64-byte aligned).

    An extent handed to a client call is released by :meth:`release` only once that call returned
    (a timed-out call releases from its future's done callback)."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes = round_up(nbytes)
        self.map = mmap.mmap(-1, self.nbytes)
        self.mv = memoryview(self.map)
        self.address = address_of(self.mv)
        self._free: list[tuple[int, int]] = [(0, self.nbytes)]  # (offset, size), sorted, coalesced
        self._cond = threading.Condition()

    def acquire(self, n: int, timeout_s: float) -> int | None:
        """Offset of a free extent of ``n`` bytes, waiting up to ``timeout_s``; None if none freed up."""
        n = round_up(max(n, 1), _ALIGN)
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while True:
                for i, (off, size) in enumerate(self._free):
                    if size >= n:
                        if size == n:
                            del self._free[i]
                        else:
                            self._free[i] = (off + n, size - n)
                        return off
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self._cond.wait(left)

    def release(self, off: int, n: int) -> None:
        n = round_up(max(n, 1), _ALIGN)
        with self._cond:
            free = sorted([*self._free, (off, n)])
            merged: list[tuple[int, int]] = []
            for o, s in free:
                if merged and merged[-1][0] + merged[-1][1] == o:
                    merged[-1] = (merged[-1][0], merged[-1][1] + s)
                else:
                    merged.append((o, s))
            self._free = merged
            self._cond.notify_all()

    def close(self) -> None:
        self.mv.release()
        with contextlib.suppress(BufferError):
            self.map.close()


class MooncakeTier(Tier):
    """Chunks as Mooncake Store objects (one self-describing record each), through the official client.

    Args:
        endpoint: the master: a :class:`lmtier.remote_url.MooncakeEndpoint` (as the config parsed
            it) or a ``mooncakestore://HOST:PORT/`` URL.
        settings: client settings (:class:`~lmtier.tiers.mooncake.settings.MooncakeSettings`);
            default: the defaults for ``endpoint`` (tcp, P2PHANDSHAKE, 1 GiB segment).
        timeout_s: longest a caller waits for one client call, seconds.
        setup_timeout_s: longest a caller waits for the client's ``setup``, seconds.
        breaker_failures: consecutive failures that open the circuit breaker.
        breaker_reset_s: seconds it stays open before one trial call.
        workers: client calls in flight at most (threads); further calls while all are busy fail.
        bounce_bytes: size of the registered bounce region; larger batches move in several calls.
        key_prefix: prefix of every object name.
        max_value_bytes: largest payload stored or accepted when loading.
        capacity_bytes: reported by :meth:`usage` (default: the mounted segment size).
        namespace: 16-byte namespace digest written into each record header (informational).

    Raises:
        TierError: the ``mooncake`` package is not installed (``pip install lmtier[mooncake]`` /
            scripts/setup_mooncake.sh). An unreachable master only logs a warning (misses).
        ValueError: malformed URL or arguments.

    Attributes:
        counters: ``collections.Counter``: ``hits``, ``misses``, ``errors``, ``timeouts``,
            ``busy`` (all workers stuck), ``corrupt``, ``puts``, ``put_failures``,
            ``put_unconfirmed`` (put said OK, ``batch_is_exist`` disagreed: #1817),
            ``breaker_rejects``, ``bounce_full``, ``setups``.
    """

    name = "remote"

    def __init__(
        self,
        endpoint: MooncakeEndpoint | str,
        settings: MooncakeSettings | None = None,
        *,
        timeout_s: float = 1.0,
        setup_timeout_s: float = 10.0,
        breaker_failures: int = 3,
        breaker_reset_s: float = 2.0,
        workers: int = 4,
        bounce_bytes: int = 256 << 20,
        key_prefix: str = "lmtier:",
        max_value_bytes: int = rec.DEFAULT_MAX_PAYLOAD_BYTES,
        capacity_bytes: int | None = None,
        namespace: bytes = bytes(16),
    ) -> None:
        super().__init__()
        if timeout_s <= 0 or setup_timeout_s <= 0:
            raise ValueError("MooncakeTier: timeouts must be > 0")
        if breaker_failures < 1 or breaker_reset_s < 0:
            raise ValueError("MooncakeTier: breaker_failures must be >= 1 and breaker_reset_s >= 0")
        if workers < 1 or bounce_bytes < (1 << 20):
            raise ValueError("MooncakeTier: workers must be >= 1 and bounce_bytes >= 1 MiB")
        if isinstance(endpoint, str):
            endpoint = parse_mooncake_url(endpoint)
        if not isinstance(endpoint, MooncakeEndpoint):
            raise TypeError(
                f"MooncakeTier: endpoint must be a MooncakeEndpoint or a URL, got {type(endpoint).__name__}"
            )
        settings = settings or MooncakeSettings(master_server_address=endpoint.master_address)
        if settings.master_server_address != endpoint.master_address:
            raise ValueError(
                f"MooncakeTier: settings name master {settings.master_server_address!r}, the endpoint "
                f"{endpoint.master_address!r}"
            )
        try:
            from mooncake.store import MooncakeDistributedStore
        except ImportError as e:
            raise TierError(
                f"the Mooncake tier needs the mooncake package ({e}); install it with "
                "scripts/setup_mooncake.sh or pip install 'lmtier[mooncake]' (and Debian's libibverbs1 "
                "librdmacm1 libnuma1)"
            ) from None
        self._store_cls = MooncakeDistributedStore
        self.endpoint = endpoint
        self.url = endpoint.describe()
        self.settings = settings
        self.local_hostname = settings.local_hostname or local_address_towards(endpoint.host, endpoint.port)
        self.timeout_s = float(timeout_s)
        self.setup_timeout_s = float(setup_timeout_s)
        self.workers = workers
        self.key_prefix = key_prefix
        self.max_value_bytes = max_value_bytes
        self.capacity_bytes = settings.global_segment_size if capacity_bytes is None else capacity_bytes
        self._meta = rec.RecordMeta(namespace=bytes(namespace))
        self.breaker = CircuitBreaker(breaker_failures, breaker_reset_s)
        self.counters: collections.Counter = collections.Counter()
        self._device = PinnedBounce(max_cached=2)
        self._arena = _Arena(bounce_bytes)
        self._pool = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="lmtier-mooncake")
        self._lock = threading.Lock()
        self._inflight = 0
        self._store: Any = None  # a set-up client with the arena registered, or None
        self._next_setup = 0.0
        self._closed = False
        with self._lock:
            ok = self._setup_locked()
        if not ok:
            log.warning("remote tier %s not reachable at startup; it degrades to misses and retries", self.url)
        log.info(
            "remote tier %s via mooncake (%s, metadata %s, segment %d MiB, timeout %.3f s, breaker %d/%.1f s)",
            self.url,
            settings.protocol,
            settings.metadata_server,
            settings.global_segment_size >> 20,
            timeout_s,
            breaker_failures,
            breaker_reset_s,
        )

    @classmethod
    def from_config(cls, remote: RemoteConfig, **kwargs: Any) -> MooncakeTier:
        """The tier of a loaded configuration: the endpoint and settings the config resolved and
        ``remote_timeout_s``; ``kwargs`` go to the constructor.

        Raises:
            ValueError: the remote tier is off or is not ``mooncakestore://``.
        """
        if not isinstance(remote.endpoint, MooncakeEndpoint) or remote.mooncake is None:
            raise ValueError("MooncakeTier.from_config: remote_url is not mooncakestore://")
        kwargs.setdefault("timeout_s", remote.timeout_s)
        return cls(remote.endpoint, remote.mooncake, **kwargs)

    @property
    def breaker_open(self) -> bool:
        return self.breaker.is_open

    # ---- public API ------------------------------------------------------------------------

    def contains(self, key: bytes) -> bool:
        return self.contains_many([key])[0]

    def contains_many(self, keys: Sequence[bytes]) -> list[bool]:
        """One ``batch_is_exist`` call; all False on any failure."""
        if not keys:
            return []
        names = [self._name(k) for k in keys]
        try:
            codes = self._call(lambda s: s.batch_is_exist(names))
        except _Failed:
            return [False] * len(keys)
        if any(c < 0 for c in codes):
            self.counters["errors"] += 1
        return [c == 1 for c in codes]

    def put(self, key: bytes, payload: Any) -> bool:
        """Store one record; True only once the store confirms it (see the module doc)."""
        return self.put_many([key], [payload])[0]

    def put_many(self, keys: Sequence[bytes], payloads: Sequence[Any]) -> list[bool]:
        """Store several records with as few ``batch_put_from`` calls as the bounce region allows.

        Args:
            keys: 32-byte chunk keys.
            payloads: read-only contiguous host buffers or CUDA tensors, one per key.

        Returns:
            Per key: True when stored and confirmed by ``batch_is_exist``.
        """
        if len(keys) != len(payloads):
            raise ValueError("MooncakeTier.put_many: keys and payloads differ in length")
        keys = [bytes(k) for k in keys]
        names = [self._name(k) for k in keys]
        out = [False] * len(keys)
        with contextlib.ExitStack() as stack:
            views = [stack.enter_context(self._device.host_payload(p)) for p in payloads]
            todo = []
            for i, mv in enumerate(views):
                if mv.nbytes > self.max_value_bytes:
                    log.warning("put: payload of %d bytes exceeds max_value_bytes %d", mv.nbytes, self.max_value_bytes)
                    continue
                todo.append(i)
            for batch in self._batches(todo, [HEADER + views[i].nbytes for i in range(len(views))]):
                ok = self._put_batch([keys[i] for i in batch], [names[i] for i in batch], [views[i] for i in batch])
                for i, r in zip(batch, ok, strict=True):
                    out[i] = r
        for r in out:
            self.counters["puts" if r else "put_failures"] += 1
        return out

    def get_into(self, key: bytes, out: Any) -> int | None:
        """Read and verify one record into ``out`` (host buffer or CUDA tensor); payload bytes or None."""
        key = bytes(key)
        if is_cuda_tensor(out):
            return self._device.get_into(out, lambda mv: self.get_many_into([key], [mv])[0])
        return self.get_many_into([key], [out])[0]

    def get_many_into(self, keys: Sequence[bytes], outs: Sequence[Any]) -> list[int | None]:
        """Read several records with as few ``batch_get_into`` calls as the bounce region allows.

        Args:
            keys: 32-byte chunk keys.
            outs: writable contiguous host buffers, each >= its payload.

        Returns:
            Per key: the payload bytes copied into its ``out`` (verified), or None (miss, too
            small ``out``, failure, a record that does not verify — which is then removed).
        """
        if len(keys) != len(outs):
            raise ValueError("MooncakeTier.get_many_into: keys and outs differ in length")
        from lmtier.tiers.buffers import host_view

        keys = [bytes(k) for k in keys]
        names = [self._name(k) for k in keys]
        views = [host_view(o, writable=True) for o in outs]
        res: list[int | None] = [None] * len(keys)
        caps = [HEADER + min(v.nbytes, self.max_value_bytes) for v in views]
        for batch in self._batches(list(range(len(keys))), caps):
            got = self._get_batch([keys[i] for i in batch], [names[i] for i in batch], [views[i] for i in batch])
            for i, n in zip(batch, got, strict=True):
                res[i] = n
        for n in res:
            self.counters["hits" if n is not None else "misses"] += 1
        return res

    def delete(self, key: bytes) -> bool:
        """Remove the object (``remove(force=True)``); True if it was removed."""
        name = self._name(key)
        try:
            return self._call(lambda s: s.remove(name, True)) == 0
        except _Failed:
            return False

    def forget(self, key: bytes) -> bool:
        """Always False: this tier keeps no local index (every lookup asks the master)."""
        self._name(key)
        return False

    def usage(self) -> TierUsage:
        """``capacity_bytes``; used bytes and chunks are not reported by the client (0)."""
        return TierUsage(self.capacity_bytes, 0, 0)

    def ping(self) -> bool:
        """True when the client reports itself healthy (``health_check() == 0``)."""
        try:
            return self._call(lambda s: s.health_check()) == 0
        except _Failed:
            return False

    def close(self) -> None:
        """Close the client (bounded by ``timeout_s``) and free the bounce region once no call runs."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            store, self._store = self._store, None
        stuck = self._inflight > 0
        if store is not None and not stuck:
            fut = self._pool.submit(self._close_store, store)
            with contextlib.suppress(Exception):
                fut.result(self.timeout_s)
        self._pool.shutdown(wait=False)
        if not stuck:
            self._arena.close()  # else left to the stuck calls' process lifetime
        self._device.close()

    def _close_store(self, store: Any) -> None:
        with contextlib.suppress(Exception):
            store.unregister_buffer(self._arena.address)
        store.close()

    # ---- data path -------------------------------------------------------------------------

    def _batches(self, idx: list[int], sizes: list[int]) -> list[list[int]]:
        """``idx`` split into runs whose records fit the bounce region together."""
        out: list[list[int]] = []
        cur: list[int] = []
        room = 0
        for i in idx:
            n = round_up(sizes[i], _ALIGN)
            if n > self._arena.nbytes:
                log.warning("record of %d bytes exceeds the bounce region (%d bytes); skipped", n, self._arena.nbytes)
                continue
            if cur and room + n > self._arena.nbytes:
                out.append(cur)
                cur, room = [], 0
            cur.append(i)
            room += n
        if cur:
            out.append(cur)
        return out

    def _layout(self, sizes: list[int]) -> tuple[list[int], int]:
        offs, total = [], 0
        for n in sizes:
            offs.append(total)
            total += round_up(n, _ALIGN)
        return offs, total

    def _put_batch(self, keys: list[bytes], names: list[str], views: list[memoryview]) -> list[bool]:
        sizes = [HEADER + mv.nbytes for mv in views]
        offs, total = self._layout(sizes)
        base = self._arena.acquire(total, self.timeout_s)
        if base is None:
            self.counters["bounce_full"] += 1
            return [False] * len(keys)
        release = [True]
        try:
            arena = self._arena.mv
            for key, mv, off in zip(keys, views, offs, strict=True):
                o = base + off
                n = mv.nbytes
                header = rec.encode_header(key, n, rec.payload_checksum(mv), payload_offset=HEADER, meta=self._meta)
                arena[o : o + HEADER] = header
                arena[o + HEADER : o + HEADER + n] = mv
            ptrs = [self._arena.address + base + off for off in offs]
            try:
                codes = self._call(
                    lambda s: s.batch_put_from(names, ptrs, sizes), extent=(base, total), release=release
                )
            except _Failed:
                return [False] * len(keys)
        finally:
            if release[0]:
                self._arena.release(base, total)
        if any(is_outage(c) for c in codes):
            self.counters["errors"] += 1
        sent = [i for i, c in enumerate(codes) if c == 0]
        if not sent:
            return [False] * len(keys)
        try:  # Mooncake #1817: a 0 is not proof; the master must list the object
            there = self._call(lambda s: s.batch_is_exist([names[i] for i in sent]))
        except _Failed:
            return [False] * len(keys)
        ok = [False] * len(keys)
        for i, e in zip(sent, there, strict=True):
            ok[i] = e == 1
            if e != 1:
                self.counters["put_unconfirmed"] += 1
                log.warning("put %s: the client said OK but the object is not there (Mooncake #1817)", names[i])
        return ok

    def _get_batch(self, keys: list[bytes], names: list[str], views: list[memoryview]) -> list[int | None]:
        caps = [HEADER + min(v.nbytes, self.max_value_bytes) for v in views]
        offs, total = self._layout(caps)
        base = self._arena.acquire(total, self.timeout_s)
        if base is None:
            self.counters["bounce_full"] += 1
            return [None] * len(keys)
        release = [True]
        res: list[int | None] = [None] * len(keys)
        corrupt: list[tuple[str, str]] = []
        try:
            ptrs = [self._arena.address + base + off for off in offs]
            try:
                codes = self._call(lambda s: s.batch_get_into(names, ptrs, caps), extent=(base, total), release=release)
            except _Failed:
                return res
            if any(is_outage(c) for c in codes):
                self.counters["errors"] += 1
            arena = self._arena.mv
            for i, code in enumerate(codes):
                if code < 0:
                    if code == -600:  # INVALID_PARAMS: the value is larger than out
                        log.warning("get_into: out has %d bytes < value %s", views[i].nbytes, names[i])
                    continue
                o = base + offs[i]
                why = self._verify(keys[i], arena[o : o + code], views[i].nbytes)
                if isinstance(why, str):
                    corrupt.append((names[i], why))
                    continue
                if why is None:
                    continue
                n = why
                views[i][:n] = arena[o + HEADER : o + HEADER + n]
                res[i] = n
        finally:
            if release[0]:
                self._arena.release(base, total)
        for name, why in corrupt:
            log.warning("remote value %s is corrupt (%s); removing it", name, why)
            self.counters["corrupt"] += 1
            with contextlib.suppress(_Failed):
                self._call(lambda s, name=name: s.remove(name, True))
        return res

    def _verify(self, key: bytes, value: memoryview, cap: int) -> int | str | None:
        """Payload length of a verified record, a reason string when it does not verify, None when
        ``out`` (``cap`` bytes) is too small."""
        if value.nbytes < HEADER:
            return f"value of {value.nbytes} bytes is shorter than the header"
        try:
            hdr = rec.decode_header(value[:HEADER], expected_key=key, max_payload_bytes=self.max_value_bytes)
        except rec.RecordError as e:
            return str(e)
        if hdr.payload_offset != HEADER or HEADER + hdr.payload_bytes != value.nbytes:
            return f"value length {value.nbytes} != header {HEADER} + payload {hdr.payload_bytes}"
        if hdr.payload_bytes > cap:
            log.warning("get_into: out has %d bytes < payload %d", cap, hdr.payload_bytes)
            return None
        try:
            rec.verify_payload(hdr, value[HEADER:])
        except rec.RecordError as e:
            return str(e)
        return hdr.payload_bytes

    # ---- plumbing --------------------------------------------------------------------------

    def _name(self, key: bytes) -> str:
        key = bytes(key)
        if len(key) != KEY_BYTES:
            raise ValueError(f"MooncakeTier: key must be {KEY_BYTES} bytes, got {len(key)}")
        return self.key_prefix + key.hex()

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
        return True

    def _client(self) -> Any:
        """The set-up client; a new one is set up at most once per ``breaker_reset_s`` while there is none."""
        with self._lock:
            if self._closed:
                raise _Failed("closed")
            if self._store is None:
                if time.monotonic() < self._next_setup or not self._setup_locked():
                    raise _Failed("no client")
            return self._store

    def _call(
        self,
        fn: Callable[[Any], Any],
        *,
        extent: tuple[int, int] | None = None,
        release: list[bool] | None = None,
    ) -> Any:
        """``fn(client)`` on a worker thread, waited for at most ``timeout_s``, under the breaker.

        A call that times out keeps running; when it finally returns, the bounce ``extent``
        (offset, bytes) is released by the future and ``release[0]`` is set False so the caller
        does not release it too.

        Raises:
            _Failed: breaker open, no client, all workers busy, timeout, exception, an outage code.
        """
        if not self.breaker.allow():
            self.counters["breaker_rejects"] += 1
            raise _Failed("breaker open")
        try:
            client = self._client()
        except _Failed:
            self.breaker.failure()
            raise
        with self._lock:
            if self._inflight >= self.workers:
                busy = True
            else:
                busy = False
                self._inflight += 1
        if busy:
            self.counters["busy"] += 1
            self.breaker.failure()
            raise _Failed("all workers busy")

        def done(_f: concurrent.futures.Future) -> None:
            with self._lock:
                self._inflight -= 1

        try:
            fut = self._pool.submit(fn, client)
        except RuntimeError:  # the pool is shut down (closed)
            done(None)
            raise _Failed("closed") from None
        fut.add_done_callback(done)
        try:
            res = fut.result(self.timeout_s)
        except concurrent.futures.TimeoutError:
            if extent is not None and release is not None:
                release[0] = False
                off, n = extent
                fut.add_done_callback(lambda _f: self._arena.release(off, n))
            self.counters["timeouts"] += 1
            self.breaker.failure()
            log.debug("remote tier %s: call timed out after %.3f s", self.url, self.timeout_s)
            raise _Failed("timeout") from None
        except Exception as e:  # noqa: BLE001
            self.counters["errors"] += 1
            self.breaker.failure()
            log.debug("remote tier %s: %s: %s", self.url, type(e).__name__, e)
            raise _Failed(str(e)) from None
        codes = res if isinstance(res, list) else [res]
        if codes and all(isinstance(c, int) and is_outage(c) for c in codes):
            self.breaker.failure()
            raise _Failed(f"outage code {codes[0]}")
        self.breaker.success()
        return res
