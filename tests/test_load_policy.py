"""The load policy's parts, deterministic (injected clocks and samples; no vLLM, no timing asserts).

:mod:`lmtier.integration.vllm.loadpolicy`: :class:`RateEstimate` (EWMA of amounts and seconds),
:class:`BusyMeter` (busy-period throughput of overlapping reads), :class:`StepClock` (prefill steps
timed on the scheduler side, with vLLM's asynchronous scheduling) and :class:`LoadPolicy` (break-even
bandwidth, cold start, priors, hysteresis, probes, the prefix it claims, one log line per change).
The integration through vLLM's scheduler is in tests/test_load_policy_connector.py, the engine in
tests/test_load_policy_e2e.py.
"""

from __future__ import annotations

import logging

import pytest

from lmtier.integration.vllm.loadpolicy import PROBE_CHUNKS, BusyMeter, LoadPolicy, RateEstimate, StepClock
from lmtier.manager import TierManager
from lmtier.tiers.base import Tier
from lmtier.tiers.cpu import CPUPool


class Clock:
    """A settable clock (seconds)."""

    def __init__(self, t: float = 100.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


# ------------------------------------------------------------------------------ RateEstimate
def test_rate_estimate_first_sample_then_ewma_of_amounts_and_seconds():
    e = RateEstimate(alpha=0.25)
    assert e.rate is None and e.count == 0
    e.add(100, 1.0)
    assert e.rate == 100.0 and e.count == 1
    e.add(300, 1.0)  # amount 100 + 0.25 * 200 = 150, seconds 1
    assert e.rate == pytest.approx(150.0)
    # time per unit is averaged, not rates: 150 units in 1 s, then 150 units in 3 s -> 150 / 1.5
    e2 = RateEstimate(alpha=0.25)
    e2.add(150, 1.0)
    e2.add(150, 3.0)
    assert e2.rate == pytest.approx(150 / 1.5)


@pytest.mark.parametrize("bad", [(1.0, 0.0), (1.0, -1.0), (-1.0, 1.0), (float("nan"), 1.0), (1.0, float("inf"))])
def test_rate_estimate_ignores_bad_samples(bad):
    e = RateEstimate()
    e.add(10, 2.0)
    e.add(*bad)
    assert e.count == 1 and e.rate == 5.0


@pytest.mark.parametrize("alpha", [0, -0.1, 1.5])
def test_rate_estimate_alpha_range(alpha):
    with pytest.raises(ValueError, match="alpha"):
        RateEstimate(alpha)


# ------------------------------------------------------------------------------ BusyMeter
def test_busy_meter_overlapping_reads_are_one_period():
    c = Clock(0.0)
    m = BusyMeter(clock=c, max_period_s=100)
    a = m.begin("disk", "raw")
    c.t = 1.0
    b = m.begin("disk", "raw")
    c.t = 2.0
    m.end(a, 100)
    assert m.take() == []  # b still in flight
    c.t = 4.0
    m.end(b, 200)
    assert m.take() == [("disk", "raw", 300, 4.0)]  # 300 bytes over the 4 s the tier was busy
    assert m.take() == []


def test_busy_meter_separate_periods_keys_and_misses():
    c = Clock(0.0)
    m = BusyMeter(clock=c, max_period_s=100)
    t = m.begin("disk", "raw")
    c.t = 0.5
    m.end(t, 1000)
    c.t = 10.0  # idle time between periods is not counted
    t = m.begin("disk", "raw")
    r = m.begin("remote", "codec")
    c.t = 11.0
    m.end(t, 0)  # a period of misses only (or corrupt records): no sample
    c.t = 12.0
    t = m.begin("disk", "raw")
    u = m.begin("disk", "raw")
    m.end(r, 64)
    c.t = 13.0
    m.end(t, 0)  # a miss inside a period that delivered bytes: its time counts
    c.t = 14.0
    m.end(u, 500)
    assert m.take() == [("disk", "raw", 1000, 0.5), ("remote", "codec", 64, 2.0), ("disk", "raw", 500, 2.0)]


def test_busy_meter_cuts_long_periods_and_records():
    c = Clock(0.0)
    m = BusyMeter(clock=c, max_period_s=1.0)
    a = m.begin("disk", "raw")
    c.t = 0.5
    b = m.begin("disk", "raw")
    c.t = 1.5
    m.end(a, 10)  # the period is 1.5 s old: cut, b still in flight
    c.t = 2.0
    m.end(b, 20)
    m.record("cpu", "scatter", 4096, 0.25)
    m.record("cpu", "scatter", 4096, 0.0)  # not a sample
    assert m.take() == [("disk", "raw", 10, 1.5), ("disk", "raw", 20, 0.5), ("cpu", "scatter", 4096, 0.25)]


def test_busy_meter_keeps_the_newest_samples():
    m = BusyMeter(max_samples=3)
    for i in range(5):
        m.record("disk", "raw", i, 1.0)
    assert [s[2] for s in m.take()] == [2, 3, 4]


class _Tier(Tier):
    """A lower tier that delivers ``n`` bytes per hit (``None``: every read misses)."""

    name = "disk"

    def __init__(self, n):
        super().__init__()
        self.n = n

    def contains(self, key):
        return self.n is not None

    def get_into(self, key, out):
        return self.n

    def put(self, key, payload):
        return False

    def delete(self, key):
        return False

    def forget(self, key):
        return False

    def usage(self):
        raise NotImplementedError


@pytest.mark.parametrize("n, want", [(4096, [("disk", "raw", 2 * 4096, 1.0)]), (None, [])])
def test_manager_meters_lower_tier_reads(n, want):
    m = TierManager(cpu=CPUPool(1 << 20, 4096), disk=_Tier(n))
    ticks = iter(range(100))
    meter = BusyMeter(clock=lambda: float(next(ticks)))
    m.set_load_meter(meter)
    m.fetch_lower_many([bytes(32), bytes([1] * 32)], [bytearray(4096), bytearray(4096)])
    assert meter.take() == want  # one call for both chunks, begun at 0, ended at 1 (misses: no sample)
    m.set_load_meter(None)
    m.fetch_lower_many([bytes(32)], [bytearray(4096)])
    assert meter.take() == []
    m.close(persist=False)


def test_fetch_lower_many_skips_tiers():
    class Remote(_Tier):
        name = "remote"

    disk, remote = _Tier(4096), Remote(4096)
    reads = []
    for t in (disk, remote):
        t.get_into = lambda key, out, t=t: reads.append(t.name) or t.n
    m = TierManager(cpu=None, disk=disk, remote=remote)
    meter = BusyMeter()
    m.set_load_meter(meter)
    assert m.fetch_lower_many([bytes(32)], [bytearray(4096)]) == [4096] and reads == ["disk"]
    assert m.fetch_lower_many([bytes(32)], [bytearray(4096)], skip=("disk",)) == [4096] and reads[1:] == ["remote"]
    assert m.fetch_lower_many([bytes(32)], [bytearray(4096)], skip=("disk", "remote")) == [None] and len(reads) == 2
    assert [s[0] for s in meter.take()] == ["disk", "remote"]  # a skipped tier is not timed
    m.close(persist=False)


# ------------------------------------------------------------------------------ StepClock
def test_step_clock_sync_and_async_scheduling():
    c = Clock(0.0)
    s = StepClock(min_prefill_tokens=256, clock=c)
    s.scheduled(600, 600, sync_loads=False)
    c.t = 0.5
    assert s.finished() == (600, 0.5)
    # asynchronous scheduling: step 2 is scheduled while step 1 still runs; it runs after step 1
    c.t = 1.0
    s.scheduled(512, 512, sync_loads=False)
    c.t = 1.1
    s.scheduled(300, 260, sync_loads=False)
    c.t = 1.4
    assert s.finished() == (512, pytest.approx(0.4))
    c.t = 1.6
    assert s.finished() == (300, pytest.approx(0.2))  # from step 1's end, not from its schedule
    # idle time before a schedule does not count
    c.t = 9.0
    s.scheduled(256, 256, sync_loads=False)
    c.t = 9.25
    assert s.finished() == (256, 0.25)


def test_step_clock_skips_decodes_and_sync_loads():
    c = Clock(0.0)
    s = StepClock(min_prefill_tokens=256, clock=c)
    s.scheduled(300, 255, sync_loads=False)  # too little prefill
    c.t = 1.0
    assert s.finished() is None
    s.scheduled(600, 600, sync_loads=True)  # its time includes a KV load
    c.t = 2.0
    assert s.finished() is None
    assert s.finished() is None  # nothing pending
    s.scheduled(0, 0, sync_loads=False)
    c.t = 3.0
    assert s.finished() is None


# ------------------------------------------------------------------------------ LoadPolicy
BPT = 1000.0  # KV bytes per token
TPS = 1000.0  # prefill tokens/s -> break-even 1e6 bytes/s = 0.001 GB/s


def policy(**kw) -> tuple[LoadPolicy, Clock]:
    c = Clock()
    kw.setdefault("prefill_tokens_per_s", TPS)
    kw.setdefault("probe_s", 0)
    return LoadPolicy(bytes_per_token=BPT, clock=c, **kw), c


def feed(p: LoadPolicy, tier: str, bytes_per_s: float, n: int = 1, path: str = "raw") -> bool:
    p.add_load_samples([(tier, path, int(bytes_per_s), 1.0)] * n)
    return p.refresh()


def test_breakeven_is_bytes_per_token_times_prefill_rate():
    p, _ = policy()
    assert p.prefill_rate() == TPS and p.breakeven() == BPT * TPS


def test_cold_start_loads_until_min_samples():
    p, _ = policy(min_samples=3)
    tiers = ["cpu", "cpu", "disk", "disk"]
    assert p.plan(tiers).chunks == 4  # nothing measured: optimistic
    assert feed(p, "disk", 0.5e6, n=2) is False  # 2 < 3 samples: still undecided
    assert p.loads("disk") and p.bandwidth("disk") is None
    assert feed(p, "disk", 0.5e6) is True
    assert not p.loads("disk") and p.bandwidth("disk") == pytest.approx(0.5e6)
    plan = p.plan(tiers)
    assert (plan.chunks, plan.skipped, plan.probe) == (2, ["disk", "disk"], None)
    assert p.plan(["disk", "cpu"]).chunks == 0  # the claim is a prefix: nothing after a slow chunk


def test_plan_starts_at_the_chunks_vllm_does_not_hold():
    p, _ = policy(min_samples=1)
    feed(p, "disk", 0.1e6)
    assert p.plan(["disk", "disk", "disk"], first=2).chunks == 2  # vLLM holds 0-1; chunk 2 is slow
    assert p.plan(["cpu", "disk"], first=5).chunks == 2  # vLLM holds more than is cached: nothing judged
    assert p.plan([], first=0).chunks == 0


def test_measured_prefill_rate_needs_min_samples():
    p, _ = policy(prefill_tokens_per_s=None, min_samples=2)
    feed(p, "disk", 0.1e6, n=2)
    assert p.breakeven() is None and p.loads("disk")  # no prefill rate yet: loads
    p.add_prefill_sample(1000, 1.0)
    p.refresh()
    assert p.loads("disk")
    p.add_prefill_sample(3000, 1.0)  # 1000 + 0.25 * 2000 = 1500 tokens/s
    assert p.refresh() is True
    assert p.prefill_rate() == pytest.approx(1500.0) and p.breakeven() == pytest.approx(1.5e6)
    assert not p.loads("disk")


def test_hysteresis_keeps_a_decision_inside_the_band():
    p, _ = policy(min_samples=1, hysteresis=0.1, alpha=1.0)  # alpha 1: the estimate is the last sample
    be = BPT * TPS
    assert feed(p, "disk", 1.05 * be) and p.loads("disk")  # first decision: plain comparison
    assert not feed(p, "disk", 0.95 * be) and p.loads("disk")  # inside the band: stays on
    assert feed(p, "disk", 0.89 * be) and not p.loads("disk")
    assert not feed(p, "disk", 1.05 * be) and not p.loads("disk")  # inside the band: stays off
    assert not feed(p, "disk", 1.1 * be) and not p.loads("disk")  # must exceed (1 + h)
    assert feed(p, "disk", 1.11 * be) and p.loads("disk")


def test_prefill_rate_change_moves_the_decision():
    p, _ = policy(prefill_tokens_per_s=None, min_samples=1, alpha=1.0)
    p.add_prefill_sample(1000, 1.0)
    assert feed(p, "disk", 0.5e6) and not p.loads("disk")  # 0.5 MB/s < 1 MB/s
    p.add_prefill_sample(200, 1.0)  # the engine got slower (busy): break-even 0.2 MB/s
    assert p.refresh() and p.loads("disk")


def test_prior_decides_before_measurements():
    p, _ = policy(priors_gbps={"disk": 0.0005}, min_samples=2, alpha=1.0)  # 0.5 MB/s < 1 MB/s
    p.refresh()
    assert not p.loads("disk") and p.loads("cpu")
    assert p.plan(["cpu", "disk"]).chunks == 1
    feed(p, "disk", 5e6)  # one measurement: still the prior
    assert not p.loads("disk")
    assert feed(p, "disk", 5e6) and p.loads("disk")  # measured now
    assert p.bandwidth("disk") == 5e6


def test_always_loads_but_decides_logs_and_exports(caplog):
    p, _ = policy(mode="always", min_samples=1)
    with caplog.at_level(logging.INFO, logger="vllm.lmtier.connector"):
        feed(p, "disk", 0.1e6, path="codec")
    assert p.loads("disk") and p.plan(["disk", "disk"]).chunks == 2
    assert "loaded anyway (load_policy: always)" in caplog.text
    snap = p.snapshot()
    assert snap["tiers"]["disk"] == {
        "gbps": pytest.approx(1e-4),
        "path": "codec",
        "samples": 1,
        "loads": 1,
        "probes": 0,
    }


def test_one_log_line_per_change(caplog):
    p, _ = policy(min_samples=1, alpha=1.0)
    with caplog.at_level(logging.INFO, logger="vllm.lmtier.connector"):
        for _ in range(5):
            feed(p, "disk", 0.2e6)
        for _ in range(5):
            feed(p, "disk", 5e6)
    lines = [r.getMessage() for r in caplog.records if "load policy" in r.getMessage()]
    assert len(lines) == 2, lines
    assert "tier disk (raw) are recomputed" in lines[0] and "0.000 GB/s (measured) < break-even 0.001 GB/s" in lines[0]
    assert "1000 KV bytes/token x 1000 prefill tokens/s, calibrated" in lines[0]
    assert "tier disk (raw) are loaded" in lines[1]


def test_probe_of_a_tier_that_is_off():
    p, c = policy(min_samples=1, probe_s=30)
    feed(p, "disk", 0.1e6)
    tiers = ["cpu"] + ["disk"] * 5
    assert p.plan(tiers).chunks == 1  # just measured: no probe due
    c.t += 29.9
    assert p.plan(tiers).chunks == 1
    c.t += 0.2
    plan = p.plan(tiers)
    assert (plan.chunks, plan.probe) == (1 + PROBE_CHUNKS, "disk")
    assert plan.skipped == ["disk"] * (5 - PROBE_CHUNKS)
    assert p.plan(tiers).probe == "disk"  # side-effect free until the probe is issued
    p.probed("disk")
    assert p.plan(tiers).chunks == 1 and p.snapshot()["tiers"]["disk"]["probes"] == 1
    c.t += 31
    feed(p, "disk", 0.1e6)  # a sample (e.g. from a load already in flight) restarts the wait too
    assert p.plan(tiers).chunks == 1


def test_first_probe_of_a_prior_is_probe_s_after_the_start():
    p, c = policy(priors_gbps={"disk": 1e-6}, probe_s=30)
    p.refresh()
    assert p.plan(["disk"]).chunks == 0  # off from the start, no probe yet
    c.t += 30
    assert p.plan(["disk"]).probe == "disk"


def test_probe_off_and_probe_only_the_slow_tier():
    p, c = policy(min_samples=1, probe_s=0)
    feed(p, "disk", 0.1e6)
    c.t += 1e6
    assert p.plan(["disk"]).probe is None
    p2, c2 = policy(min_samples=1, probe_s=5)
    feed(p2, "disk", 0.1e6)
    feed(p2, "remote", 0.1e6)
    c2.t += 10
    plan = p2.plan(["disk", "remote", "remote"])
    assert (plan.chunks, plan.probe, plan.skipped) == (1, "disk", ["remote", "remote"])


def test_snapshot_before_and_after():
    p, _ = policy(prefill_tokens_per_s=None, min_samples=1)
    assert p.snapshot() == {"prefill_tokens_per_s": None, "breakeven_gbps": None, "bytes_per_token": BPT, "tiers": {}}
    p.add_prefill_sample(2000, 1.0)
    feed(p, "disk", 4e6)
    s = p.snapshot()
    assert s["prefill_tokens_per_s"] == 2000 and s["breakeven_gbps"] == pytest.approx(0.002)
    assert s["tiers"]["disk"]["gbps"] == pytest.approx(0.004) and s["tiers"]["disk"]["loads"] == 1


@pytest.mark.parametrize(
    "kw",
    [
        {"mode": "never"},
        {"bytes_per_token": 0},
        {"min_samples": 0},
        {"hysteresis": 1.0},
        {"hysteresis": -0.1},
        {"probe_s": -1},
        {"prefill_tokens_per_s": 0},
    ],
)
def test_bad_settings(kw):
    kw = {"bytes_per_token": BPT, **kw}
    with pytest.raises(ValueError):
        LoadPolicy(**kw)


# ------------------------------------------------------------------------------ stats and metrics
SNAP = {
    "prefill_tokens_per_s": 2000.0,
    "breakeven_gbps": 0.002,
    "bytes_per_token": 1000.0,
    "tiers": {"disk": {"gbps": 0.0005, "path": "raw", "samples": 4, "loads": 0, "probes": 1}},
}


def test_stats_carry_decisions_and_the_newest_policy():
    from lmtier.integration.vllm.stats import LMTierStats, StatsSink, process_decision_totals, process_load_policy

    a, b = LMTierStats(), LMTierStats()
    a.add_decision("disk", "skipped", 3)
    a.data["policy"] = {"breakeven_gbps": 1.0, "prefill_tokens_per_s": 1.0, "tiers": {}}
    b.add_decision("disk", "skipped", 2)
    b.add_decision("cpu", "loaded", 4)
    b.data["policy"] = dict(SNAP)
    a.aggregate(b)
    assert a.data["decisions"] == {"disk": {"skipped": 5}, "cpu": {"loaded": 4}}
    assert a.data["policy"] == SNAP  # a gauge: the newer one
    out = a.reduce()
    assert out["lmtier_disk_chunks_recomputed"] == 5 and "lmtier_cpu_chunks_recomputed" not in out
    assert (out["lmtier_breakeven_gbps"], out["lmtier_prefill_tok_s"], out["lmtier_disk_load_gbps"]) == (
        0.002,
        2000.0,
        0.0005,
    )
    again = LMTierStats(a.data)  # vLLM rebuilds stats from data across processes
    assert again.data["decisions"] == a.data["decisions"] and again.data["policy"] == SNAP
    a.reset()
    assert a.is_empty()
    only_policy = LMTierStats({"policy": SNAP})
    assert not only_policy.is_empty()
    sink = StatsSink()
    before = process_decision_totals().get("p2p", {}).get("skipped", 0)
    sink.add_decision("p2p", "skipped", 7)
    sink.set_policy(SNAP)
    assert process_decision_totals()["p2p"]["skipped"] == before + 7 and process_load_policy() == SNAP
    got = sink.take().data
    assert got["decisions"] == {"p2p": {"skipped": 7}} and got["policy"] == SNAP


def test_prometheus_series_of_the_policy():
    from types import SimpleNamespace

    from lmtier.testing.vllm import require_vllm

    require_vllm()
    import functools

    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

    from lmtier.integration.vllm.stats import LMTierPromMetrics

    reg = CollectorRegistry()
    types = {cls: functools.partial(cls, registry=reg) for cls in (Counter, Gauge, Histogram)}
    prom = LMTierPromMetrics(SimpleNamespace(kv_transfer_config=None), types, ["engine"], {0: ["0"]})
    prom.observe({"decisions": {"disk": {"skipped": 5, "loaded": 1}, "nvme": {"loaded": 9}}, "policy": SNAP})
    text = generate_latest(reg).decode()
    for line in (
        'vllm:lmtier_load_decisions_total{decision="skipped",engine="0",tier="disk"} 5.0',
        'vllm:lmtier_load_decisions_total{decision="loaded",engine="0",tier="disk"} 1.0',
        'vllm:lmtier_tier_load_gbps{engine="0",path="raw",tier="disk"} 0.0005',
        'vllm:lmtier_tier_loads{engine="0",tier="disk"} 0.0',
        'vllm:lmtier_breakeven_gbps{engine="0"} 0.002',
        'vllm:lmtier_prefill_tokens_per_second{engine="0"} 2000.0',
    ):
        assert line in text, (line, [ln for ln in text.splitlines() if "lmtier_" in ln and "#" not in ln])
    assert "nvme" not in text  # only lmtier's tier names become labels
