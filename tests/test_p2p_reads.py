"""How the P2P tier cuts a batch into NIXL READs (lmtier.tiers.p2p.reads): the halving read plan, the
sub-batches' parts of chunks, and the streaming checksum a chunk split across READs is verified
with. No NIXL or Redis needed: the reads themselves are tested in tests/test_p2p.py."""

from __future__ import annotations

import os
from types import SimpleNamespace

import numpy as np
import pytest

from lmtier import record as rec
from lmtier.tiers.buffers import PAGE_BYTES, address_of
from lmtier.tiers.mooncake.bounce import ALIGN
from lmtier.tiers.p2p.directory import Entry
from lmtier.tiers.p2p.reads import MIN_READ_BYTES, PeerReads, read_plan

MiB = 1 << 20
SMOLLM2_CHUNK = 5_898_240  # bytes of a 256-token SmolLM2-135M chunk (lmtier.bench.presets)
LLAMA8B_CHUNK = 33_554_432  # Llama-3.1-8B


@pytest.mark.parametrize(
    "nbytes",
    [0, 1, PAGE_BYTES, 2 * MIN_READ_BYTES, 2 * MIN_READ_BYTES + 1, 8 * SMOLLM2_CHUNK, 32 * LLAMA8B_CHUNK, 12_345_677],
)
def test_read_plan_halves_down_to_a_small_last_read(nbytes):
    plan = read_plan(nbytes)
    assert sum(plan) == nbytes and all(n > 0 for n in plan)
    if nbytes == 0:
        assert plan == []
        return
    assert plan[-1] <= 2 * MIN_READ_BYTES  # the one READ whose verification nothing overlaps
    left = nbytes
    for n in plan[:-1]:  # each is half of what was left, in whole pages
        assert n % PAGE_BYTES == 0 and n == left // 2 // PAGE_BYTES * PAGE_BYTES
        left -= n
    assert left == plan[-1] and (len(plan) == 1 or left > MIN_READ_BYTES)


def test_read_plan_of_the_bench_batches():
    """8 SmolLM2 chunks (47 MB): 5 READs, the last 2.9 MB; 32 Llama-3.1-8B chunks (1 GiB): 9, the
    last 4 MiB."""
    assert [round(n / 1e6, 1) for n in read_plan(8 * SMOLLM2_CHUNK)] == [23.6, 11.8, 5.9, 2.9, 2.9]
    plan = read_plan(32 * LLAMA8B_CHUNK)
    assert plan == [512 * MiB >> k for k in range(8)] + [4 * MiB]


class _Pool:
    """A CPU pool stand-in: ``writing_slot`` answers for the buffers registered as slots."""

    def __init__(self) -> None:
        self.slots: dict[int, tuple[int, int]] = {}  # address -> (slot index, bytes)

    def writing_slot(self, address: int, nbytes: int) -> int | None:
        s = self.slots.get(address)
        return s[0] if s is not None and nbytes <= s[1] else None


class _Reads(PeerReads):
    def __init__(self, bounce_bytes: int) -> None:
        self._bounce = SimpleNamespace(nbytes=bounce_bytes)
        self.pool = _Pool()


def _batch(lengths, peers, direct, reads):
    outs, choice = [], []
    for i, (n, p) in enumerate(zip(lengths, peers, strict=True)):
        buf = np.empty(n + 100, dtype=np.uint8)  # outs may be larger than their chunk
        outs.append(memoryview(buf))
        if i in direct:
            reads.pool.slots[address_of(outs[-1])] = (i, n + 100)
        choice.append(None if p is None else (SimpleNamespace(node_id=p), Entry(1, 4096 * i, n, i, 0)))
    return outs, choice


@pytest.mark.parametrize("bounce_mib", [256, 4])
@pytest.mark.parametrize("direct", [(), (0, 2, 3, 5), tuple(range(7))], ids=["bounce", "mixed", "direct"])
def test_groups_cover_every_chunk_once_in_order(bounce_mib, direct):
    """Each chosen chunk's parts, in READ order, cover its bytes exactly once; splits fall on page
    boundaries; direct parts land at their slot's address, bounce parts in their group's extent
    (at most half the bounce region); each peer's READs follow its read plan (with room in the
    bounce region: to within a page, as a READ ends inside a chunk on a page boundary only); a
    chunk not chosen, or larger than its out, is in no READ."""
    reads = _Reads(bounce_mib * MiB)
    lengths = [1_441_792, 1_441_792, 999_999, 1_441_792, 5_898_240, 4096, 1_441_792]
    peers = ["a", "b", "a", None, "a", "a", "b"]
    outs, choice = _batch(lengths, peers, direct, reads)
    choice[6] = (choice[6][0], Entry(1, 0, len(outs[6]) + 1, 6, 0))  # larger than its out: skipped
    groups = list(reads._groups(choice, outs))
    covered: dict[int, int] = {}
    for g in groups:
        assert len(set(g.idx)) == len(g.idx), "at most one part of a chunk per READ"
        assert g.nbytes == sum(g.lens) and g.total <= reads._bounce.nbytes // 2
        for i, e, lo, n, off, slot, addr in zip(g.idx, g.entries, g.lo, g.lens, g.offs, g.slots, g.addrs, strict=True):
            assert g.peer.node_id == peers[i] and e.length == lengths[i]
            assert covered.get(i, 0) == lo and lo % PAGE_BYTES == 0 and n > 0
            covered[i] = lo + n
            assert addr == address_of(outs[i]) + lo
            if i in direct:
                assert slot == i and off is None
            else:
                assert slot is None and off is not None and off % ALIGN == 0 and off + n <= g.total
    assert covered == {i: lengths[i] for i in (0, 1, 2, 4, 5)}
    for peer in ("a", "b"):
        sizes = [g.nbytes for g in groups if g.peer.node_id == peer]
        total = sum(n for n, p in zip(lengths[:6], peers[:6], strict=True) if p == peer)
        assert sum(sizes) == total
        plan = read_plan(total)
        if bounce_mib == 256 or all(i in direct for i in range(6) if peers[i] == peer):
            # the plan's READs, each ending at the page boundary of its chunk before the plan's end
            assert len(sizes) == len(plan)
            assert all(0 <= a - b < PAGE_BYTES for a, b in zip(np.cumsum(plan), np.cumsum(sizes), strict=True))
        else:  # where a READ's bounce bytes would not fit half the bounce region: more, smaller READs
            assert len(sizes) > len(plan) if peer == "a" else sizes == plan


def test_a_chunk_split_across_reads_verifies_with_the_streaming_checksum():
    data = os.urandom(3 * MiB + 123)
    h = rec.payload_hasher()
    for lo, hi in [(0, 2 * MiB), (2 * MiB, 3 * MiB), (3 * MiB, len(data))]:
        h.update(memoryview(data)[lo:hi])
    assert h.intdigest() == rec.payload_checksum(data)
    torn = bytearray(data)
    torn[-1] ^= 1
    h = rec.payload_hasher()
    h.update(memoryview(torn)[: 2 * MiB])
    h.update(memoryview(torn)[2 * MiB :])
    assert h.intdigest() != rec.payload_checksum(data)
