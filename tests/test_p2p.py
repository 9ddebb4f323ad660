"""P2P sharing over NIXL (issue 16), library level: two TierManagers in two processes (spawned), NIXL
over UCX on loopback, a real redis-server as the directory.

Skips without NIXL or redis-server; fails instead under LMTIER_REQUIRE_NIXL=1 / LMTIER_REQUIRE_REDIS=1."""

from __future__ import annotations

import os
import time

import numpy as np
import pytest

from lmtier.keys import Namespace
from lmtier.testing.p2p import P2PNode, nixl_missing, skip_or_fail, small_namespace_fields
from lmtier.testing.procs import free_port

TOKEN_ENV = "P2P_TEST_TOKEN"
TOKEN = "p2p-test-token-0123456789abcdef"
NS = small_namespace_fields()
CHUNK = Namespace(**NS).chunk_bytes
TIMEOUT_S = 1.0


@pytest.fixture(scope="module")
def nixl():
    why = nixl_missing()
    if why is not None:
        skip_or_fail(f"NIXL is not importable ({why}); bash scripts/setup_nixl.sh")


@pytest.fixture
def directory(nixl, redis_server):
    return redis_server.url


def node_values(url: str, port: int, **kw) -> dict:
    v = dict(
        chunk_size=NS["chunk_size"],
        max_local_cpu_size=CHUNK * 16 / 2**30,
        enable_p2p=True,
        p2p_host="127.0.0.1",
        p2p_init_ports=[port],
        p2p_directory_url=url,
        p2p_token_env=TOKEN_ENV,
        p2p_timeout_s=TIMEOUT_S,
    )
    v.update(kw)
    return v


def start(url: str, **kw) -> P2PNode:
    env = {TOKEN_ENV: kw.pop("token", TOKEN)}
    return P2PNode(node_values(url, free_port(), **kw), NS, env=env)


def chunks(n: int, seed: int) -> tuple[list[bytes], list[bytes]]:
    keys = [bytes([seed, i]) + os.urandom(30) for i in range(n)]
    return keys, [os.urandom(CHUNK) for _ in range(n)]


@pytest.fixture
def pair(directory):
    a = start(directory)
    b = start(directory)
    yield a, b
    a.close()
    b.close()


def share(a: P2PNode, n: int, seed: int = 1) -> tuple[list[bytes], list[bytes]]:
    keys, data = chunks(n, seed)
    assert a.call("store", keys, data) == [True] * n
    assert a.call("publish_now") is True
    return keys, data


def test_b_hits_chunks_only_a_holds_bit_exact(pair):
    a, b = pair
    keys, data = share(a, 6)
    assert a.call("lookup", keys) == ["cpu"] * 6  # A never reads itself over P2P
    assert b.call("lookup", keys) == ["p2p"] * 6
    got, _ = b.call("fetch", keys, CHUNK)
    assert got == data
    # retrieve_into promotes into B's pool: then B holds (and publishes) them too.
    assert b.call("retrieve", keys[0], CHUNK) == data[0]
    assert b.call("lookup", keys[:1]) == ["cpu"]
    mgr, tier, _ = b.call("counters")
    assert mgr["hits_p2p"] == 7 and tier["hits"] == 7 and tier.get("stale", 0) == 0
    # A prefix: the lookup stops at the first chunk no one holds.
    missing = os.urandom(32)
    assert b.call("lookup", [*keys[1:3], missing, keys[3]]) == ["p2p", "p2p"]


def test_fetch_into_pool_slots_reads_them_directly(pair):
    """The connector's way: fetches into reserved CPU-pool slots are READ straight into them (no
    bounce copy) and verified there; other buffers still go through the bounce region."""
    a, b = pair
    keys, data = share(a, 5)
    got, _, held = b.call("fetch_slots", keys, CHUNK)
    assert got == data and held == 0
    _, tier, _ = b.call("counters")
    assert tier["direct_gets"] == 5 and tier["hits"] == 5
    got, _ = b.call("fetch", keys[:2], CHUNK)
    assert got == data[:2]
    _, tier, _ = b.call("counters")
    assert tier["direct_gets"] == 5 and tier["hits"] == 7


@pytest.mark.parametrize("op", ["fetch", "fetch_slots"])
def test_evicted_and_reused_slot_between_lookup_and_read_is_a_miss(pair, op):
    a, b = pair
    keys, data = share(a, 2)
    assert b.call("lookup", keys) == ["p2p", "p2p"]
    new_key, new_data = chunks(1, 9)
    # A drops keys[0] (no event: the directory still points at its slot) and stores another chunk,
    # which takes the freed slot.
    assert a.call("delete_and_reuse", keys[0], new_key[0], new_data[0]) is True
    got = b.call(op, keys, CHUNK)[0]
    assert got == [None, data[1]]  # a miss, never the new chunk's bytes (direct: in B's slot, aborted)
    _, tier, directory = b.call("counters")
    assert tier["stale"] == 1 and directory["dropped_stale"] == 1
    assert tier.get("direct_gets", 0) == (2 if op == "fetch_slots" else 0)
    assert b.call("lookup", keys[:1]) == []  # the stale entry is gone


BIG_NS = small_namespace_fields(num_layers=44)  # 1.375 MiB chunks


@pytest.mark.parametrize("op", ["fetch", "fetch_slots"])
def test_torn_or_replaced_chunks_inside_a_pipelined_batch_are_exactly_the_misses(directory, op):
    """7 chunks of 1.375 MiB are READ in 3 sub-batches (the read plan: 3.5, 1.75 and 1.75 chunks), so
    chunks 3 and 5 are each split across two READs and verified with a streaming xxh3. A chunk
    replaced in the first READ (1) and one torn in its last page only, which the third READ moves
    (5), are exactly the misses; chunk 3, split across the first two READs, and every other chunk
    hit with their bytes; both through B's pool slots (direct) and through the bounce region."""
    from lmtier.tiers.p2p.reads import read_plan

    big = Namespace(**BIG_NS).chunk_bytes
    ends = np.cumsum(read_plan(7 * big)) / big
    assert ends.tolist() == [3.5, 5.25, 7.0]
    values = dict(max_local_cpu_size=big * 12 / 2**30)
    a = P2PNode(node_values(directory, free_port(), **values), BIG_NS, env={TOKEN_ENV: TOKEN})
    b = P2PNode(node_values(directory, free_port(), **values), BIG_NS, env={TOKEN_ENV: TOKEN})
    try:
        keys = [bytes([12, i]) + os.urandom(30) for i in range(7)]
        data = [os.urandom(big) for _ in range(7)]
        assert a.call("store", keys, data) == [True] * 7 and a.call("publish_now") is True
        assert b.call("lookup", keys) == ["p2p"] * 7
        # A drops chunks 1 and 5 without telling the directory, and their slots take other chunks:
        # another chunk's bytes in 1's slot; in 5's, the same bytes except the last page.
        assert a.call("delete_and_reuse", keys[1], os.urandom(32), os.urandom(big)) is True
        torn = data[5][:-4096] + bytes(b ^ 0xFF for b in data[5][-4096:])
        assert a.call("delete_and_reuse", keys[5], os.urandom(32), torn) is True
        got = b.call(op, keys, big)[0]
        assert got == [data[0], None, data[2], data[3], data[4], None, data[6]]
        _, tier, directory_counters = b.call("counters")
        assert tier["stale"] == 2 and tier["hits"] == 5 and directory_counters["dropped_stale"] == 2
        assert tier.get("direct_gets", 0) == (7 if op == "fetch_slots" else 0)
        assert b.call("lookup", keys) == ["p2p"]  # the prefix ends at the dropped entry of chunk 1
    finally:
        a.close()
        b.close()


def test_real_eviction_never_yields_wrong_bytes(directory):
    a = start(directory, max_local_cpu_size=CHUNK * 2 / 2**30)  # two slots
    b = start(directory)
    try:
        keys, data = chunks(6, 3)
        for k, d in zip(keys, data, strict=True):
            a.call("store", [k], [d])
            a.call("publish_now")
        got, _ = b.call("fetch", keys, CHUNK)
        for g, d in zip(got, data, strict=True):
            assert g is None or g == d
        assert got[-2:] == data[-2:]  # the two A still holds
    finally:
        a.close()
        b.close()


def test_sigkilled_peer_is_a_miss_within_the_timeout(pair):
    a, b = pair
    keys, _ = share(a, 4)
    assert b.call("lookup", keys) == ["p2p"] * 4
    a.kill()
    t0 = time.monotonic()
    got, dt = b.call("fetch", keys, CHUNK)
    assert got == [None] * 4
    # bounded, not fast (a dead peer without the timeout blocks the READ); slack for a loaded machine
    assert dt < TIMEOUT_S + 5 and time.monotonic() - t0 < TIMEOUT_S + 30
    for _ in range(3):  # the breaker opens; later calls are misses at once
        got, dt = b.call("fetch", keys, CHUNK)
        assert got == [None] * 4 and dt < TIMEOUT_S + 5


def test_paused_peer_costs_bounded_time(pair):
    a, b = pair
    keys, data = share(a, 2)
    a.pause()
    try:
        got, dt = b.call("fetch", keys, CHUNK)
        assert got == [None, None]
        assert dt < TIMEOUT_S + 5
        _, tier, _ = b.call("counters")
        assert tier["timeouts"] >= 1 and tier.get("stuck", 0) == 0  # NIXL cancelled the READ
    finally:
        a.resume()


def test_paused_peer_direct_read_holds_its_slots_until_it_completes(pair):
    """A READ straight into B's slots that outlives its wait is not trusted to be cancelled: the slots
    stay held (never committed, not reused) and the peer hidden until the READ completes (A resumed)."""
    a, b = pair
    keys, data = share(a, 2)
    a.pause()
    try:
        got, dt, held = b.call("fetch_slots", keys, CHUNK)
        assert got == [None, None] and dt < TIMEOUT_S + 1.0
        assert held == 2, "both slots held after the caller gave up"
        assert b.call("lookup", keys) == [], "the peer is hidden while its READ runs"
        _, tier, _ = b.call("counters")
        assert tier["timeouts"] >= 1 and tier.get("stuck", 0) == 0
    finally:
        a.resume()
    deadline = time.monotonic() + 15
    while b.call("held") and time.monotonic() < deadline:
        time.sleep(0.1)
    assert b.call("held") == 0, "freed once the READ completed"
    time.sleep(2.5)  # the peer's breaker resets
    got, _, held = b.call("fetch_slots", keys, CHUNK)
    assert got == data and held == 0


def test_peer_not_on_the_allow_list_is_refused(directory):
    a = start(directory)
    c = start(directory, p2p_init_ports=[free_port()])
    b = start(directory, p2p_allowed_peers=a.node_id)
    try:
        ka, da = share(a, 2, seed=4)
        kc, _ = share(c, 2, seed=5)
        assert b.call("lookup", ka) == ["p2p", "p2p"]
        assert b.call("lookup", kc) == []
        got, _ = b.call("fetch", kc, CHUNK)
        assert got == [None, None]
        _, tier, _ = b.call("counters")
        assert tier["refused"] >= 2
    finally:
        for n in (a, b, c):
            n.close()


def test_peer_with_another_token_is_refused(directory):
    a = start(directory, token="another-token-of-enough-length!")
    b = start(directory)
    try:
        keys, _ = share(a, 2, seed=6)
        assert b.call("lookup", keys) == []
        _, _, d = b.call("counters")
        assert d["bad_entries"] >= 2
    finally:
        a.close()
        b.close()


def test_other_namespace_cannot_find_entries(directory):
    a = start(directory)
    b = P2PNode(
        node_values(directory, free_port()), small_namespace_fields(model="another-model"), env={TOKEN_ENV: TOKEN}
    )
    try:
        keys, _ = share(a, 2, seed=7)
        assert b.call("lookup", keys) == []
    finally:
        a.close()
        b.close()


def test_closed_peer_withdraws_its_entries(pair):
    a, b = pair
    keys, _ = share(a, 2, seed=8)
    assert b.call("lookup", keys) == ["p2p", "p2p"]
    a.close()
    assert b.call("lookup", keys) == []


def test_node_process_exits_cleanly(directory):
    """nixl-cu12 1.5.1 on a host without RDMA devices: a process that started an agent died with
    SIGSEGV at exit (libnl-route's destructor) until the transport set UCX_MODULES=^ib there."""
    a = start(directory)
    a.close()
    assert a.proc.exitcode == 0


def test_bench_p2p_smoke(nixl, redis_server):
    """``lmtier bench p2p --quick`` at a tiny size, as a separate process (its NIXL agents must not
    crash it at exit either)."""
    import subprocess
    import sys

    r = subprocess.run(
        [sys.executable, "-m", "lmtier.cli", "bench", "p2p", "--quick", "--chunk-tokens", "16", "--bounce-mib", "8"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert "direct_%raw" in r.stdout and "raw_sleep_GBps" in r.stdout


def test_lookup_only_tier_sees_peers_but_reads_nothing(directory):
    """A P2PTier without a pool (a process that only decides, e.g. a vLLM scheduler): no NIXL
    agent, nothing published; it finds peers' chunks and its own node's are excluded."""
    from lmtier.remote_url import parse_redis_url
    from lmtier.tiers.p2p.tier import P2PTier

    a = start(directory)
    try:
        keys, _ = share(a, 2, seed=11)
        digest = Namespace(**NS).digest()[:16]
        view = P2PTier(None, parse_redis_url(directory), namespace=digest, node_id="sched:1", token=TOKEN.encode())
        mine = P2PTier(None, parse_redis_url(directory), namespace=digest, node_id=a.node_id, token=TOKEN.encode())
        try:
            assert view.transport is None and view.contains_many(keys) == [True, True]
            assert view.get_many_into(keys, [bytearray(CHUNK) for _ in keys]) == [None, None]
            assert mine.contains_many(keys) == [False, False]
        finally:
            view.close()
            mine.close()
    finally:
        a.close()


def test_agent_progress_thread_does_not_busy_poll(nixl, monkeypatch):
    """The tier's agent is built with ``pthrDelay = PROGRESS_DELAY_US`` (the wheel's ``nixl_agent``
    passes 0: a busy-polling progress thread), through the wheel's own constructor, and the
    constructor's module is left as it was."""
    from lmtier.tiers.p2p import transport as T

    api = T.import_nixl()
    bind = api.nixlBind
    seen = []
    real = bind.nixlAgent

    def spy(name, cfg):
        seen.append((name, cfg.pthrDelay, cfg.useProgThread))
        return real(name, cfg)

    monkeypatch.setattr(bind, "nixlAgent", spy)
    t = T.NixlTransport("lmtier-test-delay")
    try:
        assert T.PROGRESS_DELAY_US > 0
        assert seen == [("lmtier-test-delay", T.PROGRESS_DELAY_US, True)]
        assert api.nixlBind is bind
        assert "UCX" in t.agent.backends
    finally:
        t.close()
