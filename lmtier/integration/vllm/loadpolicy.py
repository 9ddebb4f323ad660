"""Loads that never make TTFT worse: each tier's effective load bandwidth against the prefill rate.

Loading ``n`` prompt tokens of KV from a tier costs ``n * b / bw`` seconds (``b``: this rank's KV
bytes per token, ``bw``: the tier's effective load bandwidth, bytes/s); recomputing them costs
``n / R`` (``R``: the engine's prefill rate, tokens/s). A load beats recompute iff ``bw > b * R``,
the **break-even bandwidth**. Example: a Llama-3.1-8B-shaped model in bf16 (128 KiB per token)
prefilling ~34,000 tokens/s on an H200 breaks even at ~4.4 GB/s: a 1.8 GB/s disk loses (its load of
a 7,500-token hit took 218 % of the recompute), the pinned CPU pool (~55 GB/s) wins.

* :class:`BusyMeter` (worker side) measures each tier's effective load bandwidth per path
  (``raw``, ``codec``, ``codec+device``; ``scatter`` for the CPU pool): bytes delivered over the
  wall time during which at least one read of that tier was in flight, so the parallel reads of the
  I/O threads count as they really overlap. Its samples travel to the scheduler in the worker
  metadata (:class:`lmtier.integration.vllm.metadata.LMTierWorkerMetadata`), the channel vLLM 0.32
  and 0.33 both aggregate over TP ranks and hand to ``update_connector_output``.
* :class:`StepClock` (scheduler side) times the engine's steps between ``build_connector_meta``
  and ``update_connector_output``: the prefill rate is the tokens of steps that prefill at least
  one chunk (and run no synchronous load) over their wall time — what a recomputed chunk really
  costs the request's TTFT, host overheads included. ``prefill_tokens_per_s`` replaces it with a
  calibrated value.
* :class:`RateEstimate` keeps both online: an exponentially weighted mean of amounts and of seconds
  (large samples weigh more; the mean is of time per byte, which is what a load costs).
* :class:`LoadPolicy` (scheduler side) decides per tier: a tier's chunks load while its bandwidth
  stays above break-even. Until ``min_samples`` samples of a tier (and of the prefill rate) are in,
  a configured prior is used, else the chunk loads (an optimistic cold start: the load is how the
  tier gets measured). Hysteresis keeps the decision from flapping (off below
  ``(1 - h) * break-even``, on again above ``(1 + h) * break-even``). A tier that is off gets a
  probe every ``probe_s`` seconds (at most :data:`PROBE_CHUNKS` of its chunks for one request), so
  a tier that got faster is noticed. Every change is logged once (INFO), with its inputs.

vLLM takes a prefix of tokens from a connector, so the scheduler claims chunks up to the first one
whose tier is off (:meth:`LoadPolicy.plan`); vLLM computes the rest.

Choices and limits. The prefill rate is timed where the decision is taken, from the engine's own
steps: it is the wall time a recomputed chunk adds to a request's TTFT (forward, sampling, host
work, TP collectives), the same in vLLM 0.32 and 0.33 and with or without asynchronous scheduling,
and needs nothing from the workers (CUDA events around the forward would miss the host's share).
A step's fixed costs make the rate a little low, so the break-even errs towards loading by at most
those costs; decode tokens of a mixed step count as tokens (the same linear-layer work). A tier's
bandwidth is its reads only: the write-back of a chunk a promotion evicts from the CPU pool, and the
scatter, are not in it; a layer-by-layer load that overlaps the forward is judged as if it did not.

Nothing here imports vLLM.
"""

from __future__ import annotations

import collections
import logging
import math
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

__all__ = [
    "EWMA_ALPHA",
    "LOAD_POLICIES",
    "PROBE_CHUNKS",
    "BusyMeter",
    "LoadPlan",
    "LoadPolicy",
    "RateEstimate",
    "StepClock",
]

log = logging.getLogger("vllm.lmtier.connector")

LOAD_POLICIES = ("auto", "always")
"""Values of ``load_policy``: ``auto`` loads a tier's chunks only above break-even; ``always`` loads
every hit (the decision is still computed, logged and exported)."""
EWMA_ALPHA = 0.25
"""Weight of a new sample in :class:`RateEstimate` (the last ~4 samples dominate)."""
PROBE_CHUNKS = 2
"""Chunks of a tier that is off one probe may load (bounds what a probe can cost)."""

Sample = tuple[str, str, int, float]
"""A load sample: ``(tier, path, bytes delivered, seconds)``."""


class BusyMeter:
    """Effective read throughput per ``(tier, path)``, as busy-period samples (worker side).

    A busy period of a key starts when a read of it begins while none is in flight and ends when
    none is in flight any more; its sample is ``(tier, path, bytes delivered, period seconds)`` —
    the throughput with the parallelism the reads really had. A period longer than
    ``max_period_s`` is cut there (a tier that is never idle still reports). A read that misses
    delivers 0 bytes and its time counts; a period that delivered nothing at all (misses, corrupt
    records: the load-failure policy's business) is no sample.

    Args:
        clock: seconds (monotonic); injectable for tests.
        max_period_s: the longest period one sample covers.
        max_samples: samples kept until :meth:`take` (the oldest are dropped beyond it).

    Thread-safe (I/O threads call :meth:`begin` / :meth:`end`, the worker thread :meth:`take`).
    """

    def __init__(
        self, *, clock: Callable[[], float] = time.perf_counter, max_period_s: float = 0.5, max_samples: int = 256
    ) -> None:
        self._clock = clock
        self._max_period = max_period_s
        self._lock = threading.Lock()
        self._open: dict[tuple[str, str], list] = {}  # key -> [reads in flight, period start, bytes]
        self._samples: collections.deque[Sample] = collections.deque(maxlen=max_samples)

    def begin(self, tier: str, path: str) -> tuple[str, str]:
        """A read of ``tier`` by ``path`` starts; pass the returned token to :meth:`end`."""
        key = (tier, path)
        now = self._clock()
        with self._lock:
            st = self._open.get(key)
            if st is None:
                st = self._open[key] = [0, now, 0]
            st[0] += 1
        return key

    def end(self, token: tuple[str, str], nbytes: int) -> None:
        """The read of ``token`` (from :meth:`begin`) ended, having delivered ``nbytes`` bytes."""
        now = self._clock()
        with self._lock:
            st = self._open.get(token)
            if st is None:  # pragma: no cover - an end without a begin
                return
            st[0] -= 1
            st[2] += max(0, int(nbytes))
            if st[0] <= 0 or now - st[1] >= self._max_period:
                if now > st[1] and st[2] > 0:
                    self._samples.append((token[0], token[1], st[2], now - st[1]))
                st[1], st[2] = now, 0
                if st[0] <= 0:
                    del self._open[token]

    def record(self, tier: str, path: str, nbytes: int, seconds: float) -> None:
        """A sample timed by the caller (an operation that does not overlap others of its key, e.g. a
        scatter on the worker thread, or a copy timed with CUDA events)."""
        if seconds > 0:
            with self._lock:
                self._samples.append((tier, path, max(0, int(nbytes)), float(seconds)))

    def take(self) -> list[Sample]:
        """The samples since the last call, oldest first."""
        if not self._samples:  # (every step; a racing append is taken by the next call)
            return []
        with self._lock:
            out = list(self._samples)
            self._samples.clear()
        return out


class RateEstimate:
    """Online rate from ``(amount, seconds)`` samples: ``ewma(amount) / ewma(seconds)``.

    Large samples weigh more than small ones, and the mean is of time per unit (a harmonic mean of
    rates: what loading a byte, or computing a token, costs on average).

    Args:
        alpha: weight of a new sample, in (0, 1].

    Attributes:
        count: samples taken (non-finite, negative or zero-duration samples are ignored).
    """

    def __init__(self, alpha: float = EWMA_ALPHA) -> None:
        if not 0 < alpha <= 1:
            raise ValueError(f"RateEstimate: alpha must be in (0, 1], got {alpha}")
        self.alpha = alpha
        self.count = 0
        self._amount = 0.0
        self._seconds = 0.0

    def add(self, amount: float, seconds: float) -> None:
        """Take one sample: ``amount`` units (bytes, tokens) in ``seconds``."""
        if not (math.isfinite(amount) and math.isfinite(seconds)) or amount < 0 or seconds <= 0:
            return
        if self.count == 0:
            self._amount, self._seconds = float(amount), float(seconds)
        else:
            self._amount += self.alpha * (amount - self._amount)
            self._seconds += self.alpha * (seconds - self._seconds)
        self.count += 1

    @property
    def rate(self) -> float | None:
        """Units per second (None before the first sample)."""
        return self._amount / self._seconds if self.count and self._seconds > 0 else None


class StepClock:
    """The engine's steps as the scheduler sees them: ``(tokens, seconds)`` of prefill steps.

    :meth:`scheduled` runs when a step's schedule is final (``build_connector_meta``),
    :meth:`finished` when its output arrived (``update_connector_output``). A step's time is
    ``finish - max(scheduled, previous finish)``: with vLLM's asynchronous scheduling step ``N + 1``
    is scheduled before step ``N``'s output is in, and runs right after ``N``. The schedules not yet
    finished are matched first in, first out (at most ``depth`` kept).

    Args:
        min_prefill_tokens: a step counts when it computes at least this many prompt tokens (a
            step of decodes only is dominated by per-step costs, not by prefill).
        clock: seconds (monotonic); injectable for tests.
        depth: schedules awaiting their output, at most (older ones are dropped).
    """

    def __init__(self, *, min_prefill_tokens: int, clock: Callable[[], float] = time.perf_counter, depth: int = 4):
        self.min_prefill_tokens = min_prefill_tokens
        self._clock = clock
        self._pending: collections.deque[tuple[float, int, bool]] = collections.deque(maxlen=depth)
        self._last_finish: float | None = None

    def scheduled(self, tokens: int, prefill_tokens: int, *, sync_loads: bool) -> None:
        """A step computing ``tokens`` tokens, ``prefill_tokens`` of them prompt tokens, was scheduled;
        ``sync_loads``: it loads KV before its forward (its time is then not prefill)."""
        counts = prefill_tokens >= self.min_prefill_tokens and not sync_loads and tokens > 0
        self._pending.append((self._clock(), int(tokens), counts))

    def finished(self) -> tuple[int, float] | None:
        """The oldest pending step's output arrived: its ``(tokens, seconds)`` when it counts, else None."""
        now = self._clock()
        last, self._last_finish = self._last_finish, now
        if not self._pending:
            return None
        t0, tokens, counts = self._pending.popleft()
        start = t0 if last is None else max(t0, last)
        return (tokens, now - start) if counts and now > start else None


@dataclass
class _TierState:
    est: RateEstimate
    path: str = ""
    loads: bool | None = None  # the decision (None: not taken yet: loads)
    last_seen: float = -math.inf  # creation, last sample or last probe (monotonic seconds)
    probes: int = 0


@dataclass
class LoadPlan:
    """What :meth:`LoadPolicy.plan` allows of a cached prefix.

    Attributes:
        chunks: leading chunks of the prefix to claim (a prefix: vLLM computes the rest).
        skipped: the tiers of the cached chunks not claimed, in order.
        probe: the tier (off) one of whose probes this plan spends, or None.
        avoid: tiers the load must not read from (set by the connector when it found a faster copy
            of chunks in a later tier).
    """

    chunks: int
    skipped: list[str] = field(default_factory=list)
    probe: str | None = None
    avoid: tuple[str, ...] = ()


class LoadPolicy:
    """Per tier: load its chunks, or recompute them (scheduler side; see the module docstring).

    Args:
        bytes_per_token: this rank's KV bytes per token (a chunk's bytes / its tokens).
        mode: ``"auto"`` or ``"always"`` (:data:`LOAD_POLICIES`).
        prefill_tokens_per_s: a calibrated prefill rate (tokens/s) used instead of the measured one.
        priors_gbps: tier -> bandwidth (GB/s, 1e9 bytes/s) assumed until ``min_samples`` samples
            of that tier were measured (a tier without one loads until then).
        min_samples: samples of a tier (of the prefill rate) before its measured rate is used.
        hysteresis: ``h`` in [0, 1): a tier that loads goes off below ``(1 - h) * break-even``,
            one that is off loads again above ``(1 + h) * break-even``.
        probe_s: seconds between probes of a tier that is off (0: never probe).
        clock: monotonic seconds (tests inject one).
        alpha: :class:`RateEstimate` weight.
        logger: where decision changes are logged.

    Raises:
        ValueError: a value out of range.

    Not thread-safe: vLLM's scheduler thread calls it.
    """

    def __init__(
        self,
        *,
        bytes_per_token: float,
        mode: str = "auto",
        prefill_tokens_per_s: float | None = None,
        priors_gbps: Mapping[str, float] | None = None,
        min_samples: int = 3,
        hysteresis: float = 0.1,
        probe_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
        alpha: float = EWMA_ALPHA,
        logger: logging.Logger = log,
    ) -> None:
        if mode not in LOAD_POLICIES:
            raise ValueError(f"LoadPolicy: mode must be one of {LOAD_POLICIES}, got {mode!r}")
        if not bytes_per_token > 0 or min_samples < 1 or not 0 <= hysteresis < 1 or probe_s < 0:
            raise ValueError(
                f"LoadPolicy: bad settings (bytes_per_token={bytes_per_token}, min_samples={min_samples}, "
                f"hysteresis={hysteresis}, probe_s={probe_s})"
            )
        if prefill_tokens_per_s is not None and not prefill_tokens_per_s > 0:
            raise ValueError(f"LoadPolicy: prefill_tokens_per_s must be > 0, got {prefill_tokens_per_s}")
        self.bytes_per_token = float(bytes_per_token)
        self.mode = mode
        self.fixed_prefill = prefill_tokens_per_s
        self.priors = {t: float(g) * 1e9 for t, g in (priors_gbps or {}).items()}
        self.min_samples = min_samples
        self.hysteresis = hysteresis
        self.probe_s = probe_s
        self._clock = clock
        self._alpha = alpha
        self._log = logger
        self._prefill = RateEstimate(alpha)
        self._tiers: dict[str, _TierState] = {}
        for t in self.priors:
            self._tier(t)
        self.version = 0  # bumped whenever an estimate or a decision changed (the exported state is stale)

    def _tier(self, name: str) -> _TierState:
        st = self._tiers.get(name)
        if st is None:  # the first probe of a tier a prior turned off is due probe_s from now
            st = self._tiers[name] = _TierState(RateEstimate(self._alpha), last_seen=self._clock())
        return st

    # ---------------------------------------------------------------- inputs
    def add_load_samples(self, samples: Iterable[Sample]) -> None:
        """Take the worker's load samples ``(tier, path, bytes, seconds)``."""
        now = self._clock()
        for tier, path, nbytes, seconds in samples:
            st = self._tier(str(tier))
            st.est.add(float(nbytes), float(seconds))
            st.path = str(path)
            st.last_seen = now
            self.version += 1

    def add_prefill_sample(self, tokens: int, seconds: float) -> None:
        """Take one timed prefill step (:class:`StepClock`)."""
        self._prefill.add(float(tokens), float(seconds))
        self.version += 1

    # ---------------------------------------------------------------- estimates
    def prefill_rate(self) -> float | None:
        """Prefill tokens/s: the calibrated value, else the measured one once ``min_samples`` steps
        were timed, else None."""
        if self.fixed_prefill is not None:
            return self.fixed_prefill
        return self._prefill.rate if self._prefill.count >= self.min_samples else None

    def breakeven(self) -> float | None:
        """The break-even bandwidth in bytes/s (``bytes_per_token * prefill_rate``), or None."""
        r = self.prefill_rate()
        return None if r is None else self.bytes_per_token * r

    def bandwidth(self, tier: str) -> float | None:
        """``tier``'s effective load bandwidth in bytes/s: measured once ``min_samples`` samples are
        in, else its prior, else None."""
        st = self._tiers.get(tier)
        if st is not None and st.est.count >= self.min_samples:
            return st.est.rate
        return self.priors.get(tier)

    # ---------------------------------------------------------------- decisions
    def refresh(self) -> bool:
        """Re-take every tier's decision from the current estimates; log each change. Returns True
        when a decision changed."""
        be = self.breakeven()
        changed = False
        for name, st in self._tiers.items():
            bw = self.bandwidth(name)
            if be is None or bw is None:
                continue  # no decision yet (or keep the last one: estimates never disappear)
            if st.loads is None:
                new = bw >= be
            elif st.loads:
                new = bw >= be * (1 - self.hysteresis)
            else:
                new = bw > be * (1 + self.hysteresis)
            if new != st.loads:
                st.loads = new
                changed = True
                self.version += 1
                self._log_change(name, st, bw, be)
        return changed

    def _log_change(self, name: str, st: _TierState, bw: float, be: float) -> None:
        src = "measured" if st.est.count >= self.min_samples else "prior"
        pre = "calibrated" if self.fixed_prefill is not None else "measured"
        what = "loaded" if st.loads else "recomputed"
        if not st.loads and self.mode == "always":
            what = "slower than recompute, loaded anyway (load_policy: always)"
        self._log.info(
            "lmtier: load policy: chunks in tier %s%s are %s: effective load bandwidth %.3f GB/s (%s) %s "
            "break-even %.3f GB/s (%.0f KV bytes/token x %.0f prefill tokens/s, %s)",
            name,
            f" ({st.path})" if st.path else "",
            what,
            bw / 1e9,
            src,
            ">=" if st.loads else "<",
            be / 1e9,
            self.bytes_per_token,
            be / self.bytes_per_token,
            pre,
        )

    def loads(self, tier: str) -> bool:
        """Whether chunks in ``tier`` are claimed now (``always``: yes; undecided: yes)."""
        if self.mode == "always":
            return True
        st = self._tiers.get(tier)
        return st is None or st.loads is not False

    def probe_due(self, tier: str) -> bool:
        """``tier`` is off and its last sample or probe (or, never measured: the policy's start) is
        ``probe_s`` seconds old (probes on)."""
        if self.probe_s <= 0 or self.loads(tier):
            return False
        return self._clock() - self._tiers[tier].last_seen >= self.probe_s

    def probed(self, tier: str) -> None:
        """A probe of ``tier`` was issued (the next one is due ``probe_s`` seconds from now)."""
        st = self._tier(tier)
        st.last_seen = self._clock()
        st.probes += 1

    def plan(self, tiers: Sequence[str], first: int = 0) -> LoadPlan:
        """Which chunks of a cached prefix to claim.

        Args:
            tiers: the tier of each cached chunk, in prefix order (``TierManager.lookup``).
            first: chunks vLLM holds already (not loaded, not judged).

        Returns:
            a :class:`LoadPlan`: chunks ``[0, chunks)`` are claimed — up to the first chunk whose
            tier is off, or up to :data:`PROBE_CHUNKS` chunks past it when a probe of that tier is
            due — and the tiers of the rest are listed in ``skipped``.
        """
        n = max(0, min(first, len(tiers)))
        probe = None
        while n < len(tiers) and self.loads(tiers[n]):
            n += 1
        if n < len(tiers) and self.probe_due(tiers[n]):
            probe, end = tiers[n], min(len(tiers), n + PROBE_CHUNKS)
            while n < end and tiers[n] == probe:
                n += 1
        return LoadPlan(n, list(tiers[n:]), probe)

    # ---------------------------------------------------------------- export
    def snapshot(self) -> dict:
        """The decision and its inputs (plain data, for metrics and logs): ``prefill_tokens_per_s``,
        ``breakeven_gbps`` (None while unknown), ``bytes_per_token``, and per tier ``gbps`` (the
        bandwidth in use, None while unknown), ``path``, ``samples``, ``loads`` (1 or 0: what the
        connector does) and ``probes``."""
        be = self.breakeven()
        tiers = {}
        for name, st in sorted(self._tiers.items()):
            bw = self.bandwidth(name)
            tiers[name] = {
                "gbps": None if bw is None else bw / 1e9,
                "path": st.path,
                "samples": st.est.count,
                "loads": int(self.loads(name)),
                "probes": st.probes,
            }
        return {
            "prefill_tokens_per_s": self.prefill_rate(),
            "breakeven_gbps": None if be is None else be / 1e9,
            "bytes_per_token": self.bytes_per_token,
            "tiers": tiers,
        }
