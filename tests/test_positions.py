"""Chunk positions (``Tier.takes_position``, ``Eviction.positions``) carried to the tiers that take
them: the CPU pool's slots, every path of the tier manager into a disk or remote ``put``, and the
vLLM connector's stores and promotions (position = chunk index x chunk size).

The lower tiers are in-memory fakes recording what each ``put`` received; a tier whose ``put`` has
no ``position`` parameter stands for every tier that does not take positions.
"""

from __future__ import annotations

import hashlib
import threading

import numpy as np
import pytest
import torch

from lmtier.tiers.base import Eviction, Tier, TierUsage, check_position
from lmtier.tiers.cpu import CPUPool

CHUNK_BYTES = 5000


def K(i: int) -> bytes:
    return hashlib.blake2b(f"pos-{i}".encode(), digest_size=32).digest()


def data(i: int, n: int = CHUNK_BYTES) -> bytes:
    return np.random.default_rng(i).integers(0, 256, n, dtype=np.uint8).tobytes()


def pool(num_slots: int) -> CPUPool:
    slot = -(-CHUNK_BYTES // 4096) * 4096
    return CPUPool(num_slots * slot, CHUNK_BYTES, arena=torch.empty(num_slots * slot, dtype=torch.uint8))


class PlainTier(Tier):
    """An in-memory tier whose ``put`` takes no keyword at all (as tiers without positions or budgets)."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name
        self.store: dict[bytes, bytes] = {}
        self.lock = threading.Lock()

    def contains(self, key):
        with self.lock:
            return key in self.store

    def get_into(self, key, out):
        with self.lock:
            v = self.store.get(key)
        if v is None:
            return None
        memoryview(out).cast("B")[: len(v)] = v
        return len(v)

    def _keep(self, key, payload) -> None:
        if isinstance(payload, torch.Tensor):
            b = bytes(payload.reshape(-1).view(torch.uint8).cpu().numpy())
        else:
            b = bytes(memoryview(payload).cast("B"))
        with self.lock:
            self.store[key] = b

    def put(self, key, payload):
        self._keep(key, payload)
        return True

    def delete(self, key):
        with self.lock:
            return self.store.pop(key, None) is not None

    def forget(self, key):
        return self.delete(key)

    def usage(self):
        with self.lock:
            return TierUsage(1 << 30, sum(map(len, self.store.values())), len(self.store))


class PositionTier(PlainTier):
    """A tier that takes positions (as :class:`lmtier.tiers.codec_pca.PCACodecTier`): records
    ``(key, position)`` of every put and, like it, refuses a chunk of unknown position."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.puts: list[tuple[bytes, int | None]] = []

    def takes_position(self) -> bool:
        return True

    def put(self, key, payload, *, position=None):
        with self.lock:
            self.puts.append((key, position))
        if position is None:
            return False
        self._keep(key, payload)
        return True


# ------------------------------------------------------------------------------ the CPU pool
def test_check_position():
    assert check_position(None, "x") is None
    assert check_position(0, "x") == 0 and check_position(4096, "x") == 4096
    for bad in (-1, True, False, 1.0, "3", np.int64(3)):
        with pytest.raises(ValueError, match=r"where: position must be None or an int >= 0"):
            check_position(bad, "where")


def test_pool_keeps_positions_on_write_and_read_handles():
    p = pool(4)
    w = p.reserve(K(0), position=512)
    assert w is not None and w.position == 512
    w.view[:10].fill_(7)
    p.commit(w, 10)
    r = p.acquire(K(0))
    assert r is not None and r.position == 512
    p.release(r)
    assert p.put(K(1), data(1), position=0)
    assert p.put(K(2), data(2))  # no position: unknown
    for k, want in ((K(1), 0), (K(2), None)):
        r = p.acquire(k)
        assert r.position == want
        p.release(r)
    w = p.reserve(K(3))
    assert w.position is None
    p.abort(w)


def test_pool_forgets_a_freed_slots_position():
    """A slot reused by a chunk of unknown position does not inherit the previous chunk's."""
    p = pool(1)
    assert p.put(K(0), data(0), position=256)
    assert p.delete(K(0))
    assert p.put(K(1), data(1))
    r = p.acquire(K(1))
    assert r.index == 0 and r.position is None
    p.release(r)
    w = p.reserve(K(2), position=64)  # evicts K(1), no listener
    assert w is not None and w.index == 0 and w.position == 64
    p.abort(w)
    assert p.put(K(3), data(3))
    r = p.acquire(K(3))
    assert r.position is None, "an aborted reservation's position leaked"
    p.release(r)


def test_pool_eviction_names_the_victims_position():
    p = pool(2)
    seen: list[tuple] = []

    def listener(ev: Eviction) -> None:  # payload views are readable only during the call
        seen.append((ev.keys, ev.positions, [bytes(v.numpy()) for v in ev.payloads]))

    p.add_eviction_listener(listener)
    assert p.put(K(0), data(0), position=128)
    assert p.put(K(1), data(1))
    assert p.put(K(2), data(2), position=0)  # evicts K(0) (LRU)
    assert p.put(K(3), data(3), position=384)  # evicts K(1)
    assert seen == [((K(0),), (128,), [data(0)]), ((K(1),), (None,), [data(1)])]


@pytest.mark.parametrize("bad", [-1, True, 2.5, "0"])
def test_pool_refuses_a_bad_position(bad):
    p = pool(2)
    with pytest.raises(ValueError, match=r"CPUPool.reserve: position"):
        p.reserve(K(0), position=bad)
    with pytest.raises(ValueError, match=r"CPUPool.reserve: position"):
        p.put(K(0), data(0), position=bad)
    assert not p.is_present(K(0)) and p.usage().used_bytes == 0, "a refused reservation took a slot"
