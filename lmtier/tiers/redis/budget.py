"""Per-tenant budgets of the Redis/Valkey tier (issue 18): the accounting lives in the same server as
the records and changes only inside Lua scripts that also change the records, so any number of
nodes can write for the same tenant without a lock and a node that dies leaves nothing behind.

Policy: the CPU pool's (:mod:`lmtier.tiers.tenants`) in bytes of stored records. ``capacity`` =
``remote_tenant_capacity``; tenant ``t`` is guaranteed ``g(t) = floor(share(t) * capacity)`` bytes
and may borrow free capacity. When a record of ``n`` bytes for writer ``w`` does not fit
(``total + n > capacity``), the script deletes, one record at a time, the least recently used record of

1. ``w`` itself, when ``used(w) + n > g(w)`` (a writer over its guarantee recycles its own records);
2. else the tenant ``t != w`` whose oldest record is the oldest among the tenants that keep at least
   ``g(t)`` bytes without it (reclaiming borrowed bytes);
3. else ``w``'s own (guarantees oversubscribed);
4. else none: the put is **denied** (the new record is dropped; nothing of a tenant within its
   guarantee is deleted).

So **another tenant's writes never take a tenant below its guarantee**; only that tenant's own
writes, Redis itself (see below) or an operator do.

Data model (``P`` = the tier's ``key_prefix``; records stay ``P<64 hex>``, so lookups need no tenant):

* ``P tb:own`` hash: record hex -> ``"<tenant> <bytes>"`` (who owns it, how large it is);
* ``P tb:lru:<tenant>`` sorted set: record hex, scored at its last write or read by a logical clock
  (``P tb:clock``, ``INCR`` in the script: one order for all nodes, no ties, no wall clocks);
* ``P tb:used`` hash: tenant -> bytes; ``P tb:total``: their sum; ``P tb:g`` hash: tenant -> its
  guarantee (written by its writers); ``P tb:over`` set: tenants holding more than their guarantee
  (the candidates of rule 2, so an eviction scans only borrowers); ``P tb:cfg``: the settings of the
  last node that started (a node with other settings logs a warning).

Scripts (EVALSHA; loaded at start and again after ``NOSCRIPT``):

* ``commit``: the last step of every put. The record was written under a temporary key in the same
  pipeline (``SET ... EX 300``, or the pieces of a large record, as without budgets); the script
  checks its length, evicts as above, ``RENAME``s it onto the record's key and accounts it — one
  atomic step, so the record and its accounting appear together or not at all. (The record is not
  an argument of the script: Redis 7.0 spent ~25 µs per 16 KiB turning an argument into a Lua
  string, ~220 µs per 128 KiB; the temporary key costs one ``SET``.)
* ``touch``: reads refresh their records' scores. Hits are buffered and sent in batches (every
  ``touch_batch`` hits or ``touch_max_age_s``), one round trip per batch; a lost batch only ages
  the order.
* ``drop``: ``delete`` of a record with its accounting.
* ``reconcile``: ``HSCAN`` of ``P tb:own`` in steps of ``reconcile_batch`` entries, at most every
  ``reconcile_every_s`` seconds, piggybacked on puts: entries whose record is gone (``ttl_s``
  expiry, Redis's own eviction, an operator's ``DEL``) are un-accounted. Eviction (rules 1-3)
  un-accounts such entries too when it meets them.

Multi-node safety: every change of the accounting is inside one script (Redis runs a script
atomically), together with the record change it accounts; nodes keep no accounting state. A node
that dies mid-put leaves only its temporary key (expires in 300 s, never accounted); one that dies
after the script left consistent state. Hence no lost-node leak; the only drift is records deleted
behind lmtier's back, which the reconcile sweep and eviction repair.

Redis's own eviction: budgets need lmtier to be the one that evicts. ``maxmemory-policy`` must not
be ``allkeys-*`` (those evict any key: other tenants' records within their guarantees, and the
accounting keys themselves); use ``noeviction`` (recommended: Redis then refuses writes when full
instead of choosing victims; set ``maxmemory`` above ``remote_tenant_capacity`` plus Redis's own
overhead, or leave it 0) or a ``volatile-*`` policy (evicts only keys with a TTL: the temporary keys
of writes in flight, which then fail cleanly, and records when ``ttl_s`` is set, reconciled as
above). :meth:`RedisBudget.check_server` reads the policy at start (``CONFIG GET``; managed services
that refuse it get a log line saying what to check) and warns about ``allkeys-*`` and a
``maxmemory`` below the capacity.

Not supported: Redis Cluster (a script must find the accounting and the record in one hash slot;
records are named by chunk key alone, so per-tenant hash tags would put the tenant into every
lookup) — :class:`~lmtier.tiers.redis.RedisTier` refuses budgets there.

Thread-safe. Logging: ``logging.getLogger("lmtier.tiers.remote")``.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from typing import Any

import redis

from lmtier.tiers.tenants import SharedBudgets

__all__ = ["RedisBudget", "TOUCH_BATCH", "TOUCH_MAX_AGE_S", "RECONCILE_EVERY_S", "RECONCILE_BATCH"]

log = logging.getLogger("lmtier.tiers.remote")

TOUCH_BATCH = 32
"""Hits buffered before one ``touch`` round trip."""
TOUCH_MAX_AGE_S = 1.0
"""Oldest buffered hit before the next hit sends the batch (seconds)."""
RECONCILE_EVERY_S = 10.0
"""Least seconds between two reconcile steps of one node."""
RECONCILE_BATCH = 512
"""``HSCAN COUNT`` of one reconcile step."""

_COUNTERS = ("commits", "evicted_by_self", "evicted_by_others", "evicted_others", "denied")

# ARGV[1] is always the key prefix P.
_PRELUDE = """
local P = ARGV[1]
local OWN, USED, G, OVER, TOTAL = P..'tb:own', P..'tb:used', P..'tb:g', P..'tb:over', P..'tb:total'
local function lru(t) return P..'tb:lru:'..t end
local function tick() return redis.call('INCR', P..'tb:clock') end
local function used(t) return tonumber(redis.call('HGET', USED, t) or '0') end
local function gbytes(t) return tonumber(redis.call('HGET', G, t) or '0') end
local function parse(v)
  if not v then return nil, nil end
  local sp = string.find(v, ' ', 1, true)
  return string.sub(v, 1, sp - 1), tonumber(string.sub(v, sp + 1))
end
local function owner(hex) return parse(redis.call('HGET', OWN, hex)) end
local function add(t, delta)
  local u = redis.call('HINCRBY', USED, t, delta)
  redis.call('INCRBY', TOTAL, delta)
  if u <= 0 then redis.call('HDEL', USED, t); u = 0 end
  if u > gbytes(t) then redis.call('SADD', OVER, t) else redis.call('SREM', OVER, t) end
  return u
end
local function drop(hex, t, sz)
  redis.call('HDEL', OWN, hex)
  redis.call('ZREM', lru(t), hex)
  return add(t, -sz)
end
"""

# KEYS: tmp, name. ARGV: P, hex, tenant, bytes, g(tenant), capacity, ttl (0: none).
# Returns {status, used(tenant), phantoms, victim tenants...}; status 1 stored, 0 denied, -1 the
# temporary key is missing or has the wrong length (lost mid-write).
_COMMIT = (
    _PRELUDE
    + """
local tmp, name, hex, t = KEYS[1], KEYS[2], ARGV[2], ARGV[3]
local n, g, cap, ttl = tonumber(ARGV[4]), tonumber(ARGV[5]), tonumber(ARGV[6]), tonumber(ARGV[7])
if redis.call('STRLEN', tmp) ~= n then redis.call('DEL', tmp); return {-1, used(t), 0} end
redis.call('HSET', G, t, g)
local pt, psz = owner(hex)
if pt and pt ~= t then drop(hex, pt, psz); pt = nil end
local delta = n - (pt and psz or 0)
local total = tonumber(redis.call('GET', TOTAL) or '0')
local uw = used(t)
local res = {1, 0, 0}
while total + delta > cap do
  local vt, vhex = nil, nil
  local own = redis.call('ZRANGE', lru(t), 0, 1)
  local ownv = own[1]
  if ownv == hex then ownv = own[2] end
  if ownv and uw + delta > g then
    vt, vhex = t, ownv
  else
    local best = nil
    for _, u in ipairs(redis.call('SMEMBERS', OVER)) do
      if u ~= t then
        local o = redis.call('ZRANGE', lru(u), 0, 0, 'WITHSCORES')
        if o[1] then
          local _, sz = owner(o[1])
          local score = tonumber(o[2])
          if used(u) - (sz or 0) >= gbytes(u) and (best == nil or score < best) then
            best, vt, vhex = score, u, o[1]
          end
        end
      end
    end
    if not vhex and ownv then vt, vhex = t, ownv end
  end
  if not vhex then
    redis.call('DEL', tmp)
    if pt then redis.call('DEL', name); uw = drop(hex, t, psz) end
    res[1] = 0
    break
  end
  local _, vsz = owner(vhex)
  if vsz == nil then
    redis.call('ZREM', lru(vt), vhex)
  else
    if redis.call('DEL', P..vhex) == 1 then res[#res + 1] = vt else res[3] = res[3] + 1 end
    local u2 = drop(vhex, vt, vsz)
    if vt == t then uw = u2 end
    total = total - vsz
  end
end
if res[1] == 1 then
  redis.call('RENAME', tmp, name)
  if ttl > 0 then redis.call('EXPIRE', name, ttl) else redis.call('PERSIST', name) end
  redis.call('HSET', OWN, hex, t..' '..n)
  redis.call('ZADD', lru(t), tick(), hex)
  uw = add(t, delta)
end
res[2] = uw
return res
"""
)

# ARGV: P, hex... Refreshes the score of each record that is accounted.
_TOUCH = (
    _PRELUDE
    + """
for i = 2, #ARGV do
  local t = owner(ARGV[i])
  if t then redis.call('ZADD', lru(t), 'XX', tick(), ARGV[i]) end
end
return 0
"""
)

# KEYS: name. ARGV: P, hex. DEL with the accounting; returns DEL's reply.
_DROP = (
    _PRELUDE
    + """
local n = redis.call('DEL', KEYS[1])
local t, sz = owner(ARGV[2])
if t then drop(ARGV[2], t, sz) end
return n
"""
)

# ARGV: P, cursor, count. Returns {next cursor, entries un-accounted}.
_RECONCILE = (
    _PRELUDE
    + """
local r = redis.call('HSCAN', OWN, ARGV[2], 'COUNT', tonumber(ARGV[3]))
local kv, fixed = r[2], 0
for i = 1, #kv, 2 do
  if redis.call('EXISTS', P..kv[i]) == 0 then
    local t, sz = parse(kv[i + 1])
    drop(kv[i], t, sz)
    fixed = fixed + 1
  end
end
return {r[1], fixed}
"""
)

_SCRIPTS = {"commit": _COMMIT, "touch": _TOUCH, "drop": _DROP, "reconcile": _RECONCILE}


class RedisBudget:
    """The client side of the budgets of one :class:`~lmtier.tiers.redis.RedisTier` (the module doc):
    builds the script calls, counts per tenant, buffers read refreshes, paces the reconcile sweep.

    Args:
        budgets: the configured shares and capacity.
        key_prefix: the tier's key prefix (bytes); records are ``key_prefix + hex``.
        ttl_s: the tier's record expiry (seconds) or None.
        touch_batch, touch_max_age_s: read refresh batching (:data:`TOUCH_BATCH`, :data:`TOUCH_MAX_AGE_S`).
        reconcile_every_s, reconcile_batch: the sweep's pace (:data:`RECONCILE_EVERY_S`,
            :data:`RECONCILE_BATCH`); ``reconcile_every_s=None`` turns the sweep off.

    Attributes:
        counters: ``reconciled`` (accounting entries of vanished records removed by the sweep or
            met by eviction), ``touch_batches``, ``script_loads``.
    """

    def __init__(
        self,
        budgets: SharedBudgets,
        key_prefix: bytes,
        *,
        ttl_s: int | None = None,
        touch_batch: int = TOUCH_BATCH,
        touch_max_age_s: float = TOUCH_MAX_AGE_S,
        reconcile_every_s: float | None = RECONCILE_EVERY_S,
        reconcile_batch: int = RECONCILE_BATCH,
    ) -> None:
        if touch_batch < 1 or reconcile_batch < 1:
            raise ValueError("RedisBudget: touch_batch and reconcile_batch must be >= 1")
        self.budgets = budgets
        self.prefix = bytes(key_prefix)
        self.ttl_s = int(ttl_s or 0)
        self.touch_batch = touch_batch
        self.touch_max_age_s = touch_max_age_s
        self.reconcile_every_s = reconcile_every_s
        self.reconcile_batch = reconcile_batch
        self._sha: dict[str, str] = {}  # script name -> SHA1 (load)
        self._lock = threading.Lock()
        self._touched: list[bytes] = []
        self._touched_since = 0.0
        self._cursor = b"0"
        self._next_reconcile = time.monotonic() + (reconcile_every_s or 0.0)
        self._tenants: dict[str, collections.Counter[str]] = {}
        self._held: dict[str, int] = {}
        self.counters: collections.Counter[str] = collections.Counter()

    # ---- scripts -----------------------------------------------------------------------------

    def load(self, client: Any) -> None:
        """``SCRIPT LOAD`` every script (their SHA1s are then known)."""
        sha = {name: client.script_load(src) for name, src in _SCRIPTS.items()}
        with self._lock:
            self._sha = sha
        self.counters["script_loads"] += 1

    def _evalsha(self, client: Any, name: str, keys: tuple, args: tuple) -> Any:
        """``EVALSHA`` of script ``name`` on ``client`` (a connection, not a pipeline); loads the
        scripts first if needed or after ``NOSCRIPT`` (a restarted or flushed server)."""
        if name not in self._sha:
            self.load(client)
        try:
            return client.execute_command("EVALSHA", self._sha[name], len(keys), *keys, self.prefix, *args)
        except redis.exceptions.NoScriptError:
            self.load(client)
            return client.execute_command("EVALSHA", self._sha[name], len(keys), *keys, self.prefix, *args)

    def queue_commit(self, pipe: Any, tmp: bytes, name: bytes, tenant: str, nbytes: int) -> tuple:
        """Append the ``commit`` script for record ``name`` (written under ``tmp``, ``nbytes`` long
        with its header) of ``tenant`` to ``pipe``; returns the call's arguments for :meth:`finish_commit`."""
        args = (
            name[len(self.prefix) :],
            tenant,
            nbytes,
            self.budgets.guaranteed_bytes(tenant),
            self.budgets.capacity_bytes,
            self.ttl_s,
        )
        if "commit" in self._sha:
            pipe.execute_command("EVALSHA", self._sha["commit"], 2, tmp, name, self.prefix, *args)
        else:  # not loaded yet (the server was down at start): EVAL this time, EVALSHA after the load
            pipe.execute_command("EVAL", _COMMIT, 2, tmp, name, self.prefix, *args)
        return (tmp, name), args

    def finish_commit(self, client: Any, reply: Any, call: tuple, tenant: str) -> int:
        """Account the commit's ``reply`` (re-running it after ``NOSCRIPT``). Returns its status: 1
        stored, 0 denied by the tenant policy, -1 the temporary key was lost mid-write.

        Raises:
            redis.exceptions.ResponseError: any other error reply (e.g. ``OOM``).
        """
        if isinstance(reply, redis.exceptions.NoScriptError):
            reply = self._evalsha(client, "commit", *call)
        elif "commit" not in self._sha and not isinstance(reply, Exception):
            try:
                self.load(client)
            except redis.exceptions.RedisError:
                pass
        if isinstance(reply, Exception):
            raise reply
        status, used, phantoms = int(reply[0]), int(reply[1]), int(reply[2])
        victims = [v.decode() if isinstance(v, bytes) else str(v) for v in reply[3:]]
        with self._lock:
            c = self._counter(tenant)
            self._held[tenant] = used
            for v in victims:
                if v == tenant:
                    c["evicted_by_self"] += 1
                else:
                    c["evicted_others"] += 1
                    self._counter(v)["evicted_by_others"] += 1
            if phantoms:
                self.counters["reconciled"] += phantoms
            if status == 1:
                c["commits"] += 1
            elif status == 0:
                c["denied"] += 1
        if status == -1:
            log.warning("put %s: temporary key lost during the write", call[0][1].decode())
        return status

    def drop(self, client: Any, name: bytes) -> bool:
        """Delete record ``name`` and its accounting (one script). Returns whether it existed."""
        return bool(self._evalsha(client, "drop", (name,), (name[len(self.prefix) :],)))

    # ---- read refresh ------------------------------------------------------------------------

    def touched(self, name: bytes) -> list[bytes] | None:
        """Note a hit on record ``name``; returns the batch to send now (:meth:`touch`), or None."""
        now = time.monotonic()
        with self._lock:
            if not self._touched:
                self._touched_since = now
            self._touched.append(name[len(self.prefix) :])
            if len(self._touched) < self.touch_batch and now - self._touched_since < self.touch_max_age_s:
                return None
            batch, self._touched = self._touched, []
        return batch

    def take_touched(self) -> list[bytes]:
        """The buffered hits (emptied), e.g. to send before closing."""
        with self._lock:
            batch, self._touched = self._touched, []
        return batch

    def touch(self, client: Any, batch: list[bytes]) -> None:
        """Refresh the last-use score of the records in ``batch`` (hex names)."""
        if batch:
            self._evalsha(client, "touch", (), tuple(batch))
            self.counters["touch_batches"] += 1

    # ---- reconcile ---------------------------------------------------------------------------

    def reconcile_due(self) -> bool:
        """True (once per ``reconcile_every_s``) when this node should run a reconcile step."""
        if self.reconcile_every_s is None:
            return False
        now = time.monotonic()
        with self._lock:
            if now < self._next_reconcile:
                return False
            self._next_reconcile = now + self.reconcile_every_s
        return True

    def reconcile_step(self, client: Any) -> int:
        """One ``reconcile`` step from this node's cursor; returns the entries un-accounted."""
        cursor, fixed = self._evalsha(client, "reconcile", (), (self._cursor, self.reconcile_batch))
        self._cursor = cursor if isinstance(cursor, bytes) else str(cursor).encode()
        self.counters["reconciled"] += int(fixed)
        return int(fixed)

    def reconcile_all(self, client: Any) -> int:
        """A whole pass over ``P tb:own`` (tests, operators); returns the entries un-accounted."""
        self._cursor, total = b"0", 0
        while True:
            total += self.reconcile_step(client)
            if self._cursor in (b"0", "0"):
                return total

    # ---- start-up and stats ------------------------------------------------------------------

    def check_server(self, client: Any) -> list[str]:
        """Start-up checks (the module doc): ``maxmemory-policy`` and ``maxmemory`` against the
        budgets, and the settings against those of the last node that started. Logs each finding
        as a warning and returns them (empty: nothing to report)."""
        found = []
        try:
            cfg = client.config_get("maxmemory*")
        except redis.exceptions.RedisError as e:
            log.info(
                "remote tenant budgets: cannot read the server's maxmemory-policy (%s); make sure it is "
                "noeviction or volatile-*: allkeys-* policies evict across tenants",
                type(e).__name__,
            )
            cfg = {}
        policy = str(cfg.get("maxmemory-policy", ""))
        maxmemory = int(cfg.get("maxmemory", 0) or 0)
        if policy.startswith("allkeys-"):
            found.append(
                f"Redis maxmemory-policy is {policy}: Redis evicts any key when full, other tenants' records "
                "within their guarantees and lmtier's accounting among them; per-tenant budgets are not "
                "guaranteed. Set maxmemory-policy noeviction (or volatile-lru)"
            )
        if maxmemory and maxmemory < self.budgets.capacity_bytes:
            found.append(
                f"Redis maxmemory ({maxmemory} bytes) is below remote_tenant_capacity "
                f"({self.budgets.capacity_bytes} bytes): Redis fills before lmtier evicts"
            )
        fp = self.budgets.fingerprint()
        p = client.pipeline(transaction=False)
        p.get(self.prefix + b"tb:cfg")
        p.set(self.prefix + b"tb:cfg", fp)
        old = p.execute()[0]
        if old is not None and old.decode() != fp:
            found.append(
                f"another node wrote these budgets with other settings ({old.decode()}; this node: {fp}); "
                "all nodes sharing the store should use the same remote_tenant_* settings"
            )
        for f in found:
            log.warning("remote tenant budgets: %s", f)
        return found

    def _counter(self, tenant: str) -> collections.Counter[str]:
        c = self._tenants.get(tenant)
        if c is None:
            c = self._tenants[tenant] = collections.Counter()
        return c

    def tenant_stats(self) -> dict[str, dict[str, int]]:
        """Per tenant this node wrote for or evicted: the counts of this node's puts ``commits``,
        ``evicted_by_self``, ``evicted_by_others`` (its records deleted for another tenant's put
        from this node), ``evicted_others``, ``denied``; ``held_bytes`` (the tenant's bytes in the
        store after this node's last put for it) and ``guaranteed_bytes``."""
        with self._lock:
            out = {}
            for t, c in self._tenants.items():
                row = {k: int(c[k]) for k in _COUNTERS}
                row["held_bytes"] = self._held.get(t, 0)
                row["guaranteed_bytes"] = self.budgets.guaranteed_bytes(t)
                out[t] = row
            return out

    def usage(self, client: Any) -> dict[str, dict[str, int]]:
        """The store's accounting as it is now (one round trip): per tenant ``used_bytes``,
        ``guaranteed_bytes`` (as its writers last wrote it) and ``records``; plus ``"*"`` with the
        ``total_bytes``. For tests and operators."""
        p = client.pipeline(transaction=True)
        p.hgetall(self.prefix + b"tb:used")
        p.hgetall(self.prefix + b"tb:g")
        p.get(self.prefix + b"tb:total")
        used, g, total = p.execute()
        tenants = {k.decode() for k in used} | {k.decode() for k in g}
        p = client.pipeline(transaction=False)
        for t in sorted(tenants):
            p.zcard(self.prefix + b"tb:lru:" + t.encode())
        cards = p.execute()
        out = {
            t: {
                "used_bytes": int(used.get(t.encode(), 0)),
                "guaranteed_bytes": int(g.get(t.encode(), 0)),
                "records": int(n),
            }
            for t, n in zip(sorted(tenants), cards)
        }
        out["*"] = {"total_bytes": int(total or 0)}
        return out
