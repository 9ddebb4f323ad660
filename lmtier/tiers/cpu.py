"""Tier 1: the CPU pool — one pinned host arena carved into fixed-size chunk slots.

The arena is a single :class:`lmtier.memory.HostBuffer` (page-locked and mapped where CUDA is
present, 4 KiB-aligned plain memory otherwise) of ``num_slots * slot_bytes`` bytes, where
``slot_bytes`` is ``chunk_bytes`` rounded up to 4096 and ``num_slots = capacity_bytes // slot_bytes``.
Every chunk occupies exactly one slot, so the pool cannot fragment and never holds more than
``capacity_bytes`` of memory; nothing is allocated after construction.

Slot life cycle (all transitions under one lock; no I/O and no large copy is ever done under it)::

    FREE --reserve(key)--> WRITING --commit(slot, n)--> COMMITTED --(evicted / deleted)--> FREE
                              \\--abort(slot)--> FREE

* A WRITING slot's key is invisible (``contains``/``acquire`` miss) until ``commit``.
* ``acquire(key)`` pins a committed slot for reading (reference count + 1) and marks it most
  recently used; ``release`` unpins. A slot with references is never evicted or reused;
  ``delete`` of a pinned chunk hides it at once and frees the slot at the last ``release``.
* ``hold(idx)`` (a tier that reads straight into a reserved slot and cannot stop a transfer that
  outlived its timeout) keeps a WRITING slot out of use until the matching ``unhold``: it cannot be
  committed, and once aborted it is parked instead of freed, so no later chunk is ever written into
  memory a late transfer may still reach.
* Eviction is LRU over committed, unreferenced slots and happens inside ``reserve`` when no slot is
  free. With eviction listeners registered (:meth:`Tier.add_eviction_listener`; the tier manager's
  write-back to the disk tier is one) the victim is *pinned*, the lock dropped, the listeners
  called with an :class:`~lmtier.tiers.base.Eviction` carrying a read view of the victim
  (``payloads``), and only then is the slot freed and handed to the writer; readers may keep
  reading the victim during write-back (if one did, the victim stays and another is chosen — the
  listeners were told it left: an index then under-claims it, which costs a hit, never
  correctness). Without listeners the victim is dropped under the lock. ``reserve`` returns
  ``None`` (back-pressure) when every slot is pinned or being written.

Tenant budgets (``tenants``: :class:`~lmtier.tiers.tenants.TenantShares`; off by default): every
slot belongs to the tenant named at ``reserve`` (a request's ``cache_salt`` digest,
:func:`~lmtier.tiers.tenants.tenant_id`) and the victim is chosen by
:class:`~lmtier.tiers.tenants.TenantLedger` so that other tenants' stores never evict a tenant's
chunks below its guaranteed share (the policy: :mod:`lmtier.tiers.tenants`). Off, ``tenant`` is
ignored and the eviction order is the plain LRU above.

Handles (:class:`Slot`) are single-use: ``commit``/``abort`` a write handle and ``release`` a read
handle exactly once; anything else raises ``RuntimeError`` (a pin leak or double free would
otherwise corrupt the pool silently).

Logging: ``logging.getLogger("lmtier.tiers.cpu")``.
"""

from __future__ import annotations

import collections
import logging
import threading
from typing import Any

import numpy as np
import torch

from lmtier.tiers.base import KEY_BYTES, Eviction, Tier, TierUsage, check_position
from lmtier.tiers.cpu_populate import PopulateAhead
from lmtier.tiers.tenants import DEFAULT_TENANT, TenantLedger, TenantShares

__all__ = ["CPUPool", "Slot", "SLOT_ALIGN_BYTES", "as_byte_source"]

log = logging.getLogger("lmtier.tiers.cpu")

SLOT_ALIGN_BYTES = 4096

_FREE, _WRITING, _COMMITTED = 0, 1, 2
_READ, _WRITE = "read", "write"


class Slot:
    """A single-use handle on one pool slot, returned by :meth:`CPUPool.reserve` (write) or
    :meth:`CPUPool.acquire` (read).

    Attributes:
        key: the 32-byte chunk key.
        index: slot number in ``[0, num_slots)``.
        offset: byte offset of the slot in the arena (multiple of 4096).
        nbytes: write handles: the most bytes that may be written (``chunk_bytes``); read handles:
            the committed payload length.
        view: ``torch.uint8`` CPU tensor ``[nbytes]`` aliasing the slot (valid until the handle is
            committed/aborted/released; do not keep it after that).
        mode: ``"write"`` or ``"read"``.
        tenant: write handles: the tenant named at ``reserve`` (the tier manager writes the chunk
            through to a shared tier for it); read handles: :data:`~lmtier.tiers.tenants.DEFAULT_TENANT`.
        position: the chunk's position (its first token's in its token sequence, tokens; ``int >=
            0``) named at ``reserve`` — on read handles, the committed chunk's — or None (unknown).
            The tier manager passes it to the lower tiers that take it
            (:meth:`~lmtier.tiers.base.Tier.takes_position`).
    """

    __slots__ = ("key", "index", "offset", "nbytes", "view", "mode", "tenant", "position", "_gen", "_open")

    def __init__(
        self,
        key: bytes,
        index: int,
        offset: int,
        nbytes: int,
        view: torch.Tensor,
        mode: str,
        gen: int,
        tenant: str = DEFAULT_TENANT,
        position: int | None = None,
    ):
        self.key = key
        self.tenant = tenant
        self.position = position
        self.index = index
        self.offset = offset
        self.nbytes = nbytes
        self.view = view
        self.mode = mode
        self._gen = gen
        self._open = True

    def memoryview(self) -> memoryview:
        """The slot bytes as a flat uint8 memoryview (writable; same lifetime rules as ``view``)."""
        return memoryview(self.view.numpy())

    def __repr__(self) -> str:
        return (
            f"Slot(key={self.key[:6].hex()}.., index={self.index}, offset={self.offset}, "
            f"nbytes={self.nbytes}, mode={self.mode}, open={self._open})"
        )


def as_byte_source(data: Any) -> torch.Tensor | np.ndarray:
    """A flat uint8 view (no copy) of ``data`` for copying into a slot.

    Args:
        data: a contiguous torch tensor of any dtype and device (viewed as bytes), or any
            C-contiguous buffer-protocol object (bytes, bytearray, memoryview, NumPy array).

    Returns:
        a 1-D ``torch.uint8`` tensor (tensors) or 1-D ``np.uint8`` array (buffers).

    Raises:
        TypeError: unsupported object or non-contiguous data.
    """
    if isinstance(data, torch.Tensor):
        if not data.is_contiguous():
            raise TypeError("data: tensor must be contiguous")
        return data.detach().reshape(-1).view(torch.uint8)
    try:
        mv = memoryview(data)
    except TypeError:
        raise TypeError(f"data must be a torch tensor or a bytes-like object, got {type(data).__name__}") from None
    if not mv.c_contiguous:
        raise TypeError("data: buffer must be C-contiguous")
    return np.frombuffer(mv.cast("B") if (mv.format != "B" or mv.ndim != 1) else mv, dtype=np.uint8)


def _copy_to_slot(dst: torch.Tensor, src: torch.Tensor | np.ndarray) -> None:
    n = src.shape[0]
    if isinstance(src, torch.Tensor):
        dst[:n].copy_(src)  # device->host copies are synchronous here
    else:
        dst[:n].numpy()[:] = src


class CPUPool(Tier):
    """Fixed-slot LRU chunk pool in one host arena. Thread-safe; implements :class:`Tier`.

    Args:
        capacity_bytes: the most host memory the pool may use (bytes, >= one slot).
        chunk_bytes: the largest chunk payload in bytes (> 0); slots are this rounded up to 4096.
        arena: optional pre-allocated arena — a 1-D contiguous ``torch.uint8`` CPU tensor or an
            object with a ``.tensor`` attribute of that kind (e.g. ``HostBuffer``) — of at least
            ``num_slots * slot_bytes`` bytes (tests, sharing). Default: a new ``HostBuffer``
            (pinned when CUDA is usable).
        populate: how the default (unpinned) arena's pages get mapped: ``"ahead"`` (default) keeps a
            window of :data:`~lmtier.tiers.cpu_populate.POPULATE_AHEAD_BYTES` mapped ahead of the
            slots in use, on a daemon thread (``madvise(MADV_POPULATE_WRITE)``), so stores into
            never-used slots take no first-touch page faults in the serving path while resident
            memory still grows only with use; ``"now"`` / ``"background"`` map the whole arena at
            construction / on a daemon thread (resident = capacity from the start); ``"lazy"`` never
            (pages fault on first write).
        tenants: per-tenant guaranteed shares (:mod:`lmtier.tiers.tenants`), or None (default: one
            LRU over all chunks, ``tenant`` arguments ignored).

    Raises:
        ValueError: non-positive sizes, capacity below one slot, arena too small or not uint8/CPU.
    """

    name = "cpu"

    def __init__(
        self,
        capacity_bytes: int,
        chunk_bytes: int,
        *,
        arena: Any = None,
        populate: str = "ahead",
        tenants: TenantShares | None = None,
    ) -> None:
        super().__init__()
        if type(chunk_bytes) is not int or chunk_bytes <= 0:
            raise ValueError(f"CPUPool: chunk_bytes must be a positive int, got {chunk_bytes!r}")
        if type(capacity_bytes) is not int or capacity_bytes <= 0:
            raise ValueError(f"CPUPool: capacity_bytes must be a positive int, got {capacity_bytes!r}")
        self.chunk_bytes = chunk_bytes
        self.slot_bytes = -(-chunk_bytes // SLOT_ALIGN_BYTES) * SLOT_ALIGN_BYTES
        self.num_slots = capacity_bytes // self.slot_bytes
        if self.num_slots < 1:
            raise ValueError(
                f"CPUPool: capacity_bytes={capacity_bytes} is smaller than one slot ({self.slot_bytes} bytes)"
            )
        arena_bytes = self.num_slots * self.slot_bytes
        self._owner = None
        if arena is None:
            from lmtier.memory import HostBuffer

            if populate not in ("ahead", "now", "background", "lazy"):
                raise ValueError(f"CPUPool: populate must be 'ahead', 'now', 'background' or 'lazy', got {populate!r}")
            self._owner = HostBuffer(arena_bytes, populate="lazy" if populate == "ahead" else populate)
            tensor = self._owner.tensor
        else:
            self._owner = arena
            tensor = arena if isinstance(arena, torch.Tensor) else getattr(arena, "tensor", None)
            if not isinstance(tensor, torch.Tensor):
                raise ValueError(f"CPUPool: arena must be a uint8 tensor or have .tensor, got {type(arena).__name__}")
            if tensor.dtype != torch.uint8 or tensor.device.type != "cpu" or tensor.dim() != 1:
                raise ValueError(f"CPUPool: arena must be a 1-D CPU uint8 tensor, got {tensor.dtype} {tensor.device}")
            if not tensor.is_contiguous() or tensor.numel() < arena_bytes:
                raise ValueError(f"CPUPool: arena must be contiguous with >= {arena_bytes} bytes, got {tensor.numel()}")
        self.arena = tensor[:arena_bytes]
        self.pinned = bool(getattr(self._owner, "pinned", False)) or bool(self.arena.is_pinned())
        self._views = [self.arena[i * self.slot_bytes : (i + 1) * self.slot_bytes] for i in range(self.num_slots)]
        self._lock = threading.Lock()
        self._state = [_FREE] * self.num_slots
        self._refs = [0] * self.num_slots
        self._keys: list[bytes | None] = [None] * self.num_slots
        self._nbytes = [0] * self.num_slots
        self._positions: list[int | None] = [None] * self.num_slots  # per slot, as named at reserve
        self._gen = [0] * self.num_slots
        self._doomed = [False] * self.num_slots
        self._held = [0] * self.num_slots  # hold() counts: kept out of use while a transfer may write
        self._parked: set[int] = set()  # freed while held: back to _free at the last unhold
        self._free = list(range(self.num_slots - 1, -1, -1))  # pop() hands out slot 0 first
        self._index: dict[bytes, int] = {}  # committed (visible) keys
        self._pending: dict[bytes, int] = {}  # reserved, not yet committed
        self._lru: collections.OrderedDict[int, None] = collections.OrderedDict()  # evictable, LRU first
        self._closed = False
        self.counters: collections.Counter[str] = collections.Counter()
        self._ledger = None if tenants is None else TenantLedger(tenants, self.num_slots, self.slot_bytes)
        # Populate-ahead (lmtier.tiers.cpu_populate): slots mapped ahead of the highest one handed out.
        self._populator: PopulateAhead | None = None
        if populate == "ahead" and arena is None and not self.pinned:
            self._populator = PopulateAhead(self.arena, self.slot_bytes, self.num_slots, self._lock, self.counters)

    # ---- writer side ---------------------------------------------------------------------------

    def reserve(self, key: bytes, *, tenant: str = DEFAULT_TENANT, position: int | None = None) -> Slot | None:
        """Allocate a slot for writing ``key``'s chunk, evicting the LRU unreferenced chunk if needed.

        ``tenant``: the chunk's tenant (:func:`~lmtier.tiers.tenants.tenant_id`); with budgets on,
        the victim is chosen by the tenant policy (:mod:`lmtier.tiers.tenants`) and ``None`` is also
        returned when every evictable chunk is protected by its tenant's share
        (``counters["reserve_budget"]``).

        ``position``: the chunk's position (its first token's in its token sequence, ``chunk index *
        chunk_size`` tokens; ``int >= 0``) or None (unknown): kept with the chunk while it is in the
        pool (:attr:`Slot.position` of the write handle and of later read handles,
        :attr:`Eviction.positions <lmtier.tiers.base.Eviction.positions>`) for the lower tiers that
        take it (:meth:`~lmtier.tiers.base.Tier.takes_position`). The pool itself stores chunks of
        unknown position.

        Returns:
            a write :class:`Slot` (``nbytes == chunk_bytes``) to fill and then ``commit`` or
            ``abort``; or ``None`` when the key is already stored or being written (nothing to
            do; see :meth:`is_present`) or when every slot is pinned/being written (back-pressure).

        Raises:
            TypeError: a key that is not 32 bytes. ValueError: a bad ``position`` (nothing reserved).
            RuntimeError: the pool is closed.

        May block while eviction listeners run (write-back I/O), never under the lock: each gets an
        :class:`~lmtier.tiers.base.Eviction` of the victim (``payloads``: its ``torch.uint8
        [nbytes]`` slot view, valid only during the call; ``positions``: its position); an exception
        is logged and counted (``counters["evict_listener_errors"]``) and the chunk is evicted anyway.
        """
        _check_key(key)
        check_position(position, "CPUPool.reserve")
        for _ in range(self.num_slots + 1):
            with self._lock:
                self._check_open()
                if key in self._index or key in self._pending:
                    self.counters["reserve_present"] += 1
                    return None
                if self._free:
                    return self._start_write_locked(self._free.pop(), key, tenant, position)
                if not self._lru:
                    self.counters["reserve_full"] += 1
                    return None
                ledger = self._ledger
                if ledger is None:
                    idx, _ = self._lru.popitem(last=False)
                else:
                    vic = ledger.victim(tenant)
                    if vic is None:
                        self.counters["reserve_budget"] += 1
                        return None
                    idx = vic
                    del self._lru[idx]
                victim = self._keys[idx]
                assert victim is not None
                if not self.has_eviction_listeners():
                    self._evicted_locked(idx, victim, tenant)
                    return self._start_write_locked(idx, key, tenant, position)
                self._refs[idx] += 1  # pin the victim during write-back
                view = self._views[idx][: self._nbytes[idx]]
                pos = self._positions[idx]
            # A listener failing loses at most a cache entry: the chunk is evicted anyway.
            failed = self._notify_evicted(Eviction(self.name, (victim,), (view,), (pos,)))
            with self._lock:
                if failed:
                    self.counters["evict_listener_errors"] += failed
                self._refs[idx] -= 1
                if self._refs[idx] > 0:
                    continue  # a reader pinned it during write-back: it is hot, keep it
                if self._doomed[idx]:  # deleted during write-back
                    self._free_locked(idx)
                    continue
                self._evicted_locked(idx, victim, tenant)
                if key in self._index or key in self._pending or self._closed:
                    self._free_locked(idx)
                    self.counters["reserve_present"] += 1
                    return None
                return self._start_write_locked(idx, key, tenant, position)
        with self._lock:
            self.counters["reserve_full"] += 1
        return None

    def commit(self, slot: Slot, nbytes: int) -> None:
        """Make a reserved chunk visible with payload length ``nbytes`` (``1..chunk_bytes``).

        The caller must have finished writing ``slot.view[:nbytes]`` (and synchronised any device
        copy into it). Raises ``RuntimeError`` for a non-write or already closed handle,
        ``ValueError`` for a bad length (the slot stays reserved; ``abort`` it).
        """
        if type(nbytes) is not int or not 0 < nbytes <= self.chunk_bytes:
            raise ValueError(f"CPUPool.commit: nbytes must be in 1..{self.chunk_bytes}, got {nbytes!r}")
        with self._lock:
            idx = self._check_handle_locked(slot, _WRITE)
            if self._held[idx]:
                raise RuntimeError(f"CPUPool.commit: {slot!r} is held (a transfer may still write into it); abort it")
            slot._open = False
            del self._pending[slot.key]
            self._state[idx] = _COMMITTED
            self._nbytes[idx] = nbytes
            self._index[slot.key] = idx
            self._lru[idx] = None
            if self._ledger is not None:
                self._ledger.committed(idx)
            self.counters["commits"] += 1

    def abort(self, slot: Slot) -> None:
        """Give back a reserved slot without making it visible (cancelled or failed write)."""
        with self._lock:
            idx = self._check_handle_locked(slot, _WRITE)
            slot._open = False
            del self._pending[slot.key]
            self._free_locked(idx)
            self.counters["aborts"] += 1

    # ---- slots a transfer may still write -----------------------------------------------------

    def writing_slot(self, address: int, nbytes: int) -> int | None:
        """The index of the slot being written (reserved, not committed) that contains all of the
        arena bytes ``[address, address + nbytes)`` (absolute addresses), else None: outside the
        arena, across two slots, or a slot in any other state. A tier may let a transfer it cannot
        always stop write into a caller's buffer only when this is not None (it can :meth:`hold`
        that slot)."""
        base = self.arena.data_ptr()
        off = address - base
        if nbytes <= 0 or off < 0 or off + nbytes > self.num_slots * self.slot_bytes:
            return None
        idx = off // self.slot_bytes
        if (off + nbytes - 1) // self.slot_bytes != idx:
            return None
        with self._lock:
            return idx if self._state[idx] == _WRITING else None

    def hold(self, idx: int) -> None:
        """Keep slot ``idx`` (being written) out of use until :meth:`unhold`: a transfer that outlived
        its timeout may still write into it. While held it cannot be committed (``RuntimeError``),
        and an ``abort`` parks it instead of freeing it; the last ``unhold`` frees a parked slot.
        Counted (``counters["held"]``). Thread-safe.

        Raises:
            RuntimeError: the slot is not being written.
        """
        with self._lock:
            if self._state[idx] != _WRITING:
                raise RuntimeError(f"CPUPool.hold: slot {idx} is not being written")
            self._held[idx] += 1
            self.counters["held"] += 1

    def unhold(self, idx: int) -> None:
        """Undo one :meth:`hold` (the transfer finished or failed: nothing more is written); a slot
        aborted meanwhile becomes free now."""
        with self._lock:
            if self._held[idx] <= 0:
                raise RuntimeError(f"CPUPool.unhold: slot {idx} is not held")
            self._held[idx] -= 1
            if self._held[idx] == 0 and idx in self._parked:
                self._parked.discard(idx)
                self._free.append(idx)

    def is_held(self, address: int, nbytes: int = 1) -> bool:
        """Whether any slot overlapping ``[address, address + nbytes)`` is held (a buffer no tier
        may fill: see :meth:`hold`). False outside the arena."""
        off = address - self.arena.data_ptr()
        end = min(off + max(nbytes, 1), self.num_slots * self.slot_bytes)
        if off < 0 or off >= end:
            return False
        with self._lock:
            return any(self._held[i] for i in range(off // self.slot_bytes, (end - 1) // self.slot_bytes + 1))

    def num_held(self) -> int:
        """Slots currently held (:meth:`hold`)."""
        with self._lock:
            return sum(1 for h in self._held if h)

    # ---- reader side ---------------------------------------------------------------------------

    def acquire(self, key: bytes) -> Slot | None:
        """Pin ``key``'s committed chunk for reading and mark it most recently used.

        Returns a read :class:`Slot` (``view`` is the payload, ``nbytes`` its length) that must be
        ``release``d, or ``None`` on a miss (absent, or still being written).
        """
        _check_key(key)
        with self._lock:
            idx = self._index.get(key)
            if idx is None:
                self.counters["misses"] += 1
                return None
            self._refs[idx] += 1
            self._lru.pop(idx, None)
            if self._ledger is not None:
                self._ledger.pinned(idx)
            self.counters["hits"] += 1
            nbytes, gen, pos = self._nbytes[idx], self._gen[idx], self._positions[idx]
        return Slot(key, idx, idx * self.slot_bytes, nbytes, self._views[idx][:nbytes], _READ, gen, position=pos)

    def release(self, slot: Slot) -> None:
        """Unpin a read handle. The chunk becomes evictable again (most recently used)."""
        with self._lock:
            idx = self._check_handle_locked(slot, _READ)
            slot._open = False
            self._refs[idx] -= 1
            if self._refs[idx] == 0:
                if self._doomed[idx]:
                    self._free_locked(idx)
                else:
                    self._lru[idx] = None
                    if self._ledger is not None:
                        self._ledger.evictable(idx)

    # ---- Tier interface ------------------------------------------------------------------------

    def contains(self, key: bytes) -> bool:
        """True if ``key`` is committed (being written does not count)."""
        with self._lock:
            return key in self._index

    def is_present(self, key: bytes) -> bool:
        """True if ``key`` is committed *or* currently reserved by a writer."""
        with self._lock:
            return key in self._index or key in self._pending

    def get_into(self, key: bytes, out: Any) -> int | None:
        """Copy the chunk into ``out`` (writable buffer or torch tensor on any device with
        ``>= nbytes`` bytes). Returns the payload length, or ``None`` on a miss.

        Raises ``ValueError`` when ``out`` is too small (nothing is written).
        """
        slot = self.acquire(key)
        if slot is None:
            return None
        try:
            dst = _as_byte_dest(out)
            if dst.shape[0] < slot.nbytes:
                raise ValueError(f"CPUPool.get_into: out has {dst.shape[0]} bytes, chunk has {slot.nbytes}")
            if isinstance(dst, torch.Tensor):
                dst[: slot.nbytes].copy_(slot.view)
            else:
                dst[: slot.nbytes] = slot.view.numpy()
            return slot.nbytes
        finally:
            self.release(slot)

    def put(self, key: bytes, payload: Any, *, tenant: str = DEFAULT_TENANT, position: int | None = None) -> bool:
        """Store ``payload`` (tensor or bytes-like, ``1..chunk_bytes`` bytes) under ``key``
        (``tenant``, ``position``: as for :meth:`reserve`).

        Returns True when stored or already present, False on back-pressure.
        Raises ``ValueError`` for an empty or oversized payload or a bad ``position``.
        """
        src = as_byte_source(payload)
        n = int(src.shape[0])
        if not 0 < n <= self.chunk_bytes:
            raise ValueError(f"CPUPool.put: payload must be 1..{self.chunk_bytes} bytes, got {n}")
        slot = self.reserve(key, tenant=tenant, position=position)
        if slot is None:
            return self.is_present(key)
        try:
            _copy_to_slot(slot.view, src)
        except BaseException:
            self.abort(slot)
            raise
        self.commit(slot, n)
        return True

    def delete(self, key: bytes) -> bool:
        """Hide ``key`` at once; its slot is freed now, or at the last ``release`` if pinned.
        A key that is only being written is not affected (returns False)."""
        with self._lock:
            idx = self._index.pop(key, None)
            if idx is None:
                return False
            if self._refs[idx] == 0:
                self._lru.pop(idx, None)
                if self._ledger is not None:
                    self._ledger.pinned(idx)
                self._free_locked(idx)
            else:
                self._doomed[idx] = True
            self.counters["deletes"] += 1
            return True

    def forget(self, key: bytes) -> bool:
        """Same as :meth:`delete`: the pool is private to this process (its index and its bytes are
        one), so there is no other process's deletion to follow."""
        return self.delete(key)

    def usage(self) -> TierUsage:
        """``capacity_bytes`` = arena size; ``used_bytes`` = slots not free (committed, being
        written, pinned-after-delete or held) × ``slot_bytes``; ``num_chunks`` = visible chunks."""
        with self._lock:
            used = (self.num_slots - len(self._free)) * self.slot_bytes
            return TierUsage(
                capacity_bytes=self.num_slots * self.slot_bytes, used_bytes=used, num_chunks=len(self._index)
            )

    def keys(self) -> list[bytes]:
        """Committed keys, least recently used first among the unpinned ones (snapshot)."""
        with self._lock:
            lru = [self._keys[i] for i in self._lru]
            pinned = [k for k, i in self._index.items() if i not in self._lru]
            return lru + pinned  # type: ignore[return-value]

    @property
    def tenant_budgets(self) -> TenantShares | None:
        """The configured tenant shares, or None (budgets off)."""
        return None if self._ledger is None else self._ledger.shares

    def tenant_stats(self) -> dict[str, dict[str, int]]:
        """Per-tenant usage and eviction counts (:meth:`TenantLedger.stats
        <lmtier.tiers.tenants.TenantLedger.stats>`: ``held_bytes``, ``guaranteed_bytes``,
        ``commits``, ``evicted_by_self``, ``evicted_by_others``, ``evicted_others``, ``denied``),
        keyed by tenant id; ``{}`` with budgets off (a snapshot)."""
        with self._lock:
            return {} if self._ledger is None else self._ledger.stats()

    def num_pinned(self) -> int:
        """Slots with outstanding read references (including eviction write-back)."""
        with self._lock:
            return sum(1 for r in self._refs if r)

    def close(self) -> None:
        """Refuse further reservations and stop and join the populate thread (it calls torch, which
        must not run on a daemon thread at interpreter exit: :mod:`lmtier.memory`). The arena is
        freed when the pool is garbage-collected."""
        with self._lock:
            self._closed = True
        if self._populator is not None:
            self._populator.close()

    def __len__(self) -> int:
        with self._lock:
            return len(self._index)

    def __repr__(self) -> str:
        u = self.usage()
        return (
            f"CPUPool(slots={self.num_slots}, slot_bytes={self.slot_bytes}, chunks={u.num_chunks}, "
            f"used={u.used_bytes}/{u.capacity_bytes}, pinned={self.pinned})"
        )

    # ---- internals (lock held) -----------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("CPUPool is closed")

    def _start_write_locked(self, idx: int, key: bytes, tenant: str, position: int | None) -> Slot:
        if self._populator is not None:
            self._populator.slot_used_locked(idx)
        self._state[idx] = _WRITING
        self._keys[idx] = key
        self._nbytes[idx] = 0
        self._positions[idx] = position
        self._refs[idx] = 0
        self._doomed[idx] = False
        self._pending[key] = idx
        if self._ledger is not None:
            self._ledger.assign(idx, tenant)
        self.counters["reserves"] += 1
        return Slot(
            key,
            idx,
            idx * self.slot_bytes,
            self.chunk_bytes,
            self._views[idx][: self.chunk_bytes],
            _WRITE,
            self._gen[idx],
            tenant,
            position,
        )

    def _evicted_locked(self, idx: int, victim: bytes, tenant: str) -> None:
        del self._index[victim]
        self.counters["evictions"] += 1
        if self._ledger is not None:
            self._ledger.evicted(idx, tenant)

    def _free_locked(self, idx: int) -> None:
        self._state[idx] = _FREE
        self._keys[idx] = None
        self._nbytes[idx] = 0
        self._positions[idx] = None
        self._doomed[idx] = False
        self._gen[idx] += 1
        if self._held[idx]:
            self._parked.add(idx)  # a late transfer may still write it: free at the last unhold
        else:
            self._free.append(idx)
        if self._ledger is not None:
            self._ledger.free(idx)

    def _check_handle_locked(self, slot: Slot, mode: str) -> int:
        if not isinstance(slot, Slot):
            raise TypeError(f"expected a Slot, got {type(slot).__name__}")
        if slot.mode != mode:
            raise RuntimeError(f"CPUPool: {slot!r} is not a {mode} handle")
        if not slot._open or self._gen[slot.index] != slot._gen:
            raise RuntimeError(f"CPUPool: {slot!r} was already committed/aborted/released")
        return slot.index


def _check_key(key: bytes) -> None:
    if not isinstance(key, bytes) or len(key) != KEY_BYTES:
        length = len(key) if isinstance(key, (bytes, bytearray)) else "?"
        raise TypeError(f"chunk key must be {KEY_BYTES} bytes, got {type(key).__name__} of length {length}")


def _as_byte_dest(out: Any) -> torch.Tensor | np.ndarray:
    if isinstance(out, torch.Tensor):
        if not out.is_contiguous():
            raise TypeError("out: tensor must be contiguous")
        return out.reshape(-1).view(torch.uint8)
    mv = memoryview(out)
    if mv.readonly:
        raise TypeError("out: buffer is read-only")
    if not mv.c_contiguous:
        raise TypeError("out: buffer must be C-contiguous")
    return np.frombuffer(mv.cast("B") if (mv.format != "B" or mv.ndim != 1) else mv, dtype=np.uint8)
