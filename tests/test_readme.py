"""What the README promises a newcomer with a fresh clone (issue 20 §5): links that resolve inside the
repository, no references to documents outside it, vLLM's prefix cache off in the main job as stated,
and the demo's server logs kept after a failed run."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
TOP_DIRS = ("docs", "scripts", "lmtier", "benchmarks", "tests", "examples", "csrc", ".ci")
REPO_PATH = re.compile(r"`((?:" + "|".join(re.escape(d) for d in TOP_DIRS) + r")/[^`\s]*)`")
MD_LINK = re.compile(r"\]\(([^)\s]+)\)")
UP_PATH = re.compile(r"`(\.\./[^`\s]+)`")


@pytest.mark.parametrize("doc", DOCS, ids=[d.name for d in DOCS])
def test_relative_links_and_repo_paths_resolve(doc):
    """Every relative Markdown link, backticked ``../`` path and backticked repository path (``docs/…``,
    ``scripts/…``, …) names a file or folder of the checkout; README linked ../shared/ARCHITECTURE.md
    once, docs/ARCHITECTURE.md still did."""
    text = doc.read_text()
    bad = []
    for m in [*MD_LINK.finditer(text), *UP_PATH.finditer(text)]:
        target = m.group(1)
        if re.match(r"[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
            continue  # a URL or an anchor of this page
        path = (doc.parent / target.split("#", 1)[0]).resolve()
        if not path.exists() or REPO not in path.parents:
            bad.append(f"link {target}")
    for m in REPO_PATH.finditer(text):
        if re.search(r"vllm|vLLM", text[max(0, m.start() - 8) : m.start()]):
            continue  # a path inside vLLM's tree ("vLLM `csrc/cpu/…`")
        path = re.sub(r"[:#].*$", "", m.group(1)).rstrip(".,;)")
        if any(c in path for c in "*<>{}…"):
            continue  # a pattern, not a path
        if not (REPO / path).exists():
            bad.append(f"path {m.group(1)}")
    assert bad == [], f"{doc.name}: {bad}"


def test_no_references_to_documents_outside_the_repository():
    """The project's notes outside the repository (../shared/, FACTS.md, STYLE.md) are not in a clone;
    no tracked file may send a reader there."""
    files = subprocess.run(
        ["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout.splitlines()
    bad = re.compile(r"\.\./shared/|/work/shared|\bFACTS\.md\b|\bSTYLE\.md\b")
    hits = []
    for name in files:
        path = REPO / name
        if name == "tests/test_readme.py" or path.suffix in (".png", ".so", ".npz", ".gguf") or not path.is_file():
            continue
        try:
            text = path.read_text()
        except UnicodeDecodeError:
            continue
        hits += [f"{name}: {m.group(0)}" for m in bad.finditer(text)]
    assert hits == []


def test_the_readme_yaml_loads_as_written(tmp_path, monkeypatch):
    """The example lmtier.yaml under "Using it with vLLM", copied verbatim, loads on an ordinary
    machine (>= 8 GiB of RAM, a >= 20 GiB file system); it asked for a 500 GiB disk tier once, which
    load_config refuses on a smaller disk."""
    from lmtier.config import load_config

    readme = (REPO / "README.md").read_text()
    m = re.search(r"^cat > lmtier\.yaml <<'YAML'\n(.*?)^YAML$", readme, re.S | re.M)
    assert m, "the README's lmtier.yaml block is gone"
    for key in [k for k in os.environ if k.startswith("LMTIER_")]:
        monkeypatch.delenv(key)  # the file as written, no overrides
    (tmp_path / "lmtier.yaml").write_text(m.group(1))
    config = load_config(str(tmp_path / "lmtier.yaml"))
    assert config.chunk_size == 256


def test_main_job_runs_with_vllms_prefix_cache_off_as_the_readme_says():
    readme = (REPO / "README.md").read_text()
    assert "vLLM's own prefix cache off" in readme and "--no-enable-prefix-caching" in readme
    demo = (REPO / "scripts" / "demo.py").read_text()
    assert demo.count('"--no-enable-prefix-caching"') == 1  # the one server command every phase uses
    assert "exec .venv/bin/python scripts/demo.py" in (REPO / "scripts" / "main_job.sh").read_text()


def _demo():
    """scripts/demo.py as a module (by file location: scripts/ is not a package)."""
    name = "lmtier_demo_script"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, REPO / "scripts" / "demo.py")
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod  # its dataclasses look their module up while the class is built
        spec.loader.exec_module(mod)
    return sys.modules[name]


def _work(tmp_path: Path) -> Path:
    work = tmp_path / "lmtier_demo_x"
    (work / "logs").mkdir(parents=True)
    (work / "logs" / "baseline.log").write_text("engine started\n")
    (work / "logs" / "lmtier.log").write_text("Traceback ...\n")
    (work / "lmtier_cpu_disk.yaml").write_text("chunk_size: 256\n")
    (work / "lmtier_disk").mkdir()
    (work / "lmtier_disk" / "record.bin").write_bytes(b"x" * 4096)
    (work / "vllm_cache").mkdir()
    return work


@pytest.mark.parametrize(
    "option,value",
    [
        ("--max-tokens", "0"),
        ("--startup-timeout", "0"),
        ("--request-timeout", "-1"),
        ("--shutdown-timeout", "-1"),
        ("--settle", "nan"),
        ("--onednn-cache", "-2"),
    ],
)
def test_demo_rejects_an_out_of_range_number_before_any_server(option, value, capsys):
    """``--max-tokens 0`` started the baseline server (52 s) and then failed on vLLM's HTTP 400
    "max_tokens must be at least 1"; the numeric options are now checked by argparse."""
    with pytest.raises(SystemExit) as e:
        _demo().parse_args(["--no-lmtier", "--quick", option, value])
    assert e.value.code == 2
    assert f"argument {option}: expected " in capsys.readouterr().err


def test_demo_keeps_server_logs_after_a_failed_run(tmp_path, capsys):
    """issue 20 §5: the demo named its server logs in the failure message, then deleted them with its
    work folder unless --keep-logs was given."""
    demo = _demo()
    work = _work(tmp_path)
    kept = demo.clean_up_work(work, own_work=True, keep_logs=None, failed=True)
    assert sorted(p.name for p in kept) == ["baseline.log", "lmtier.log", "lmtier_cpu_disk.yaml"]
    assert all(p.is_file() for p in kept) and (work / "logs" / "lmtier.log").read_text() == "Traceback ...\n"
    assert not (work / "lmtier_disk").exists() and not (work / "vllm_cache").exists()  # the bulk goes
    out = capsys.readouterr().out
    assert "the run failed" in out and all(str(p) in out for p in kept)


def test_demo_removes_its_work_folder_after_a_successful_run(tmp_path):
    demo = _demo()
    work = _work(tmp_path)
    assert demo.clean_up_work(work, own_work=True, keep_logs=None, failed=False) == []
    assert not work.exists()


def test_demo_keep_logs_copies_then_removes_the_work_folder(tmp_path, capsys):
    demo = _demo()
    work = _work(tmp_path)
    dest = tmp_path / "out" / "logs"
    kept = demo.clean_up_work(work, own_work=True, keep_logs=dest, failed=True)
    assert sorted(p.name for p in dest.iterdir()) == ["baseline.log", "lmtier.log", "lmtier_cpu_disk.yaml"]
    assert set(kept) == set(dest.iterdir()) and not work.exists()
    assert str(dest / "lmtier.log") in capsys.readouterr().out


def test_demo_never_removes_a_work_folder_it_was_given(tmp_path):
    demo = _demo()
    work = _work(tmp_path)
    demo.clean_up_work(work, own_work=False, keep_logs=None, failed=False)
    assert (work / "lmtier_disk" / "record.bin").exists() and (work / "logs" / "lmtier.log").exists()


# ------------------------------------------------------------------ the shared-store phases (issue 15)
def test_demo_runs_the_mooncake_phase_by_default_as_the_readme_says():
    """issue 15: the main job gains two servers sharing one Mooncake Store, in its default phases."""
    demo = _demo()
    assert demo.parse_args([]).phase_set == set(demo.PHASES) >= {"baseline", "redis", "mooncake"}
    assert demo.parse_args(["--phases", "mooncake"]).phase_set == {"baseline", "mooncake"}
    assert set(demo.SHARED_STORES) == {"redis", "mooncake", "p2p"}
    readme = " ".join((REPO / "README.md").read_text().split())
    assert "two servers sharing one Redis" in readme and "two sharing one Mooncake Store" in readme


def test_demo_runs_the_p2p_phase_by_default_as_the_readme_says():
    """issue 16: the main job gains node B served from node A's CPU pool over P2P (NIXL), with no
    shared store tier in the config; node B must load from the p2p tier, not only from its own pool."""
    demo = _demo()
    assert "p2p" in demo.parse_args([]).phase_set
    assert demo.parse_args(["--phases", "p2p"]).phase_set == {"baseline", "p2p"}
    assert demo.SHARED_SOURCE == {"redis": "remote", "mooncake": "remote", "p2p": "p2p"}
    readme = " ".join((REPO / "README.md").read_text().split())
    assert "2 nodes + P2P" in readme and "node A's CPU pool over P2P" in readme


def test_demo_p2p_config_has_no_store_tier_and_one_node_id_per_node(tmp_path):
    """The P2P phase's two configs, filled in as the demo does: a CPU pool each, no disk, no remote
    tier, the directory in the demo's redis-server, the token from the variable the demo sets, and
    node ids that differ (node id = p2p_host:port)."""
    demo = _demo()
    token = {demo.P2P_TOKEN_ENV: "t" * 32}
    from lmtier.config import load_config

    cfgs = [
        load_config(
            demo.write_config(demo.SHARED_STORES["p2p"], tmp_path, f"p2p_{n}", token, REDIS_PORT="6390", P2P_PORT=port),
            env=token,
        )
        for n, port in (("A", "28200"), ("B", "28201"))
    ]
    for cfg in cfgs:
        assert cfg.cpu.enabled and cfg.disk.paths == () and not cfg.remote.enabled
        assert cfg.p2p.directory_url == "redis://127.0.0.1:6390/0" and cfg.p2p.token == b"t" * 32
    assert [c.p2p.node_id(0) for c in cfgs] == ["127.0.0.1:28200", "127.0.0.1:28201"]
    with pytest.raises(Exception, match="p2p_token_env"):  # the servers get the token; without it: an error
        demo.write_config(demo.SHARED_STORES["p2p"], tmp_path, "p2p_x", REDIS_PORT="6390", P2P_PORT="1")


def test_demo_fails_a_shared_phase_whose_node_b_never_loaded_from_the_store():
    """Node B's own CPU pool also gives hits (its earlier requests of a scenario): a shared phase
    passes only when B loaded tokens from the store's tier (lmtier's hit counters by tier)."""
    demo = _demo()
    reqs = [demo.Req("system", "q0", [1, 2, 3])]
    rec = {
        "scenario": "system",
        "name": "q0",
        "prompt_tokens": 3,
        "ttft_ms": 5.0,
        "cached_tokens": 256,
        "token_ids": [7],
    }
    d = demo.Demo.__new__(demo.Demo)
    d.reqs = reqs
    hit = 'vllm:lmtier_hit_tokens_total{tier="%s"}'
    d.passes = [
        demo.PassResult("baseline cold", "baseline", [dict(rec, cached_tokens=0)]),
        demo.PassResult("p2p: B (from A)", "p2p-node-B", [rec], metrics={"system": {hit % "cpu": 256.0}}),
        demo.PassResult("redis: B (from A)", "redis-node-B", [rec], metrics={"system": {hit % "remote": 256.0}}),
    ]
    rows, failures = demo.summarize(d)
    assert failures == [
        "system / p2p: B (from A): no tokens claimed from the p2p tier (lmtier hits by tier: {'cpu': 256}): "
        "node A's chunks were not used"
    ]
    assert rows[2]["hits_by_tier"] == {"remote": 256}


@pytest.mark.parametrize("kind", ["redis", "mooncake"])
def test_demo_shared_store_configs_validate(tmp_path, kind):
    """Each shared-store phase's config template, filled in as the demo does, passes lmtier's parser:
    a CPU tier, no disk, the store as the remote tier."""
    demo = _demo()
    values = {"redis": {"REDIS_PORT": "6390"}, "mooncake": {"MOONCAKE_MASTER": "127.0.0.1:50151"}}[kind]
    path = demo.write_config(demo.SHARED_STORES[kind], tmp_path, **values)
    from lmtier.config import load_config

    cfg = load_config(path, env={})
    assert cfg.cpu.enabled and cfg.disk.paths == ()
    if kind == "redis":
        assert cfg.remote.url == "redis://127.0.0.1:6390"
    else:
        assert cfg.remote.url == "mooncakestore://127.0.0.1:50151/"
        mc = cfg.remote.mooncake
        assert mc.master_server_address == "127.0.0.1:50151" and mc.protocol == "tcp"
        assert mc.global_segment_size == 0  # the data lives in the demo's store server, not in the engines
        assert cfg.remote.timeout_s == 5.0  # loads inside a busy 2-core engine took ~1 s


def test_demo_without_mooncake_is_a_setup_error_before_the_baseline(tmp_path, monkeypatch, capsys):
    """Asked for the mooncake phase on a machine without the client: status 2 at once, naming the fix
    (and no server started: the workload is not even built)."""
    demo = _demo()
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    monkeypatch.setattr(demo, "mooncake_client_importable", lambda: "ImportError: no module named mooncake")
    monkeypatch.setattr(demo, "build_workload", lambda *a: pytest.fail("the demo went on"))
    assert demo.main(["--model", str(model), "--phases", "baseline,mooncake"]) == 2
    err = capsys.readouterr().err
    assert "mooncake phase" in err and "no module named mooncake" in err and "setup_mooncake.sh" in err
    assert demo.missing_prerequisites({"baseline", "redis"}) == []


@pytest.mark.parametrize("kind", ["redis", "mooncake", "p2p"])
def test_demo_fails_a_shared_store_phase_whose_node_b_had_no_hits(kind):
    """Node B's pass must report cached tokens loaded from the store's tier; equal outputs are not enough."""
    demo = _demo()
    rec = {"scenario": "system", "name": "q0", "prompt_tokens": 600, "ttft_ms": 100.0, "token_ids": [1, 2]}
    passes = [
        demo.PassResult("baseline cold", "baseline", records=[{**rec, "cached_tokens": 0}]),
        demo.PassResult(f"{kind}: A cold", f"{kind}-node-A", records=[{**rec, "cached_tokens": 0}]),
        demo.PassResult(f"{kind}: B (from A)", f"{kind}-node-B", records=[{**rec, "cached_tokens": 0}]),
    ]
    run = demo.Demo(demo.parse_args([]), Path("."), [demo.Req("system", "q0", [1] * 600)])
    run.passes = passes
    rows, failures = demo.summarize(run)
    assert [r["equal"] for r in rows] == [1, 1, 1]
    tier = demo.SHARED_SOURCE[kind]
    assert failures == [
        f"system / {kind}: B (from A): no cached tokens reported (expected lmtier hits)",
        f"system / {kind}: B (from A): no tokens claimed from the {tier} tier (lmtier hits by tier: none): "
        "node A's chunks were not used",
    ]
    passes[2].records[0]["cached_tokens"] = 512
    passes[2].metrics = {"system": {f'vllm:lmtier_hit_tokens_total{{tier="{tier}"}}': 512.0}}
    assert demo.summarize(run)[1] == []


def _ab():
    """benchmarks/ab_connectors.py as a module (by file location: benchmarks/ is not a package)."""
    name = "lmtier_ab_connectors_script"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, REPO / "benchmarks" / "ab_connectors.py")
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
    return sys.modules[name]


def test_connector_benchmark_runs_the_demos_two_node_systems():
    """issues 15/16: the connector benchmark measures node B's warm TTFT from node A through P2P,
    Redis and Mooncake (the demo's shared stores and config templates, not copies) and B cold
    (``base``) in one run; a two-node system only makes sense in warm mode (A stores, B loads)."""
    ab = _ab()
    assert ab.STORES.SHARED_STORES is _demo().SHARED_STORES  # one definition: lmtier.testing.stores
    a = ab.parse_args(["--mode", "warm", "--systems", "base,p2p,redis,mooncake", "--kv-cache-gib", "0.25"])
    assert a.system_list == ["base", "p2p", "redis", "mooncake"] and a.kv_cache_gib == 0.25
    assert ab.system_env("p2p@LMTIER_BG_IO=nice+X=1") == ("p2p", {"LMTIER_BG_IO": "nice", "X": "1"})
    with pytest.raises(SystemExit):
        ab.parse_args(["--mode", "cold", "--systems", "base,p2p"])


def test_waiting_for_p2p_publication_counts_only_new_chunks(redis_server):
    """The demo and the connector benchmark wait until node A has published a round's chunks: chunk
    entries not listed before (evictions may remove older ones meanwhile), nothing else."""
    import redis

    demo = _demo()
    r = redis.Redis.from_url(redis_server.url)
    r.hset("lmtier:p2p:00:c:aa", "n:1", b"x")
    r.hset("lmtier:p2p:00:n:127.0.0.1:1", "x", b"x")  # a node record: not a chunk
    before = demo.p2p_directory_names(redis_server.port)
    assert before == {b"lmtier:p2p:00:c:aa"}
    r.delete("lmtier:p2p:00:c:aa")  # evicted meanwhile
    r.hset("lmtier:p2p:00:c:bb", "n:1", b"x")
    assert demo.wait_p2p_published(redis_server.port, 1, timeout_s=5, before=before) == 1
    assert demo.wait_p2p_published(redis_server.port, 2, timeout_s=0.3, before=before) == 1  # gives up
    r.close()


def test_connector_benchmark_can_run_one_pair_at_a_time():
    """--pairs-in-turn: each two-node system in its own turn with the single-server systems (B cold),
    so 3 servers are alive at a time; turns use disjoint round numbers (new prompts)."""
    ab = _ab()
    a = ab.parse_args(["--mode", "warm", "--systems", "base,p2p,redis,mooncake", "--pairs-in-turn"])
    assert ab.turn_systems(a) == [["base", "p2p"], ["base", "redis"], ["base", "mooncake"]]
    assert ab.turn_systems(ab.parse_args(["--mode", "warm", "--systems", "base,p2p"])) == [["base", "p2p"]]
    with pytest.raises(SystemExit):  # nothing to pair a two-node system's rounds with
        ab.parse_args(["--mode", "warm", "--systems", "p2p,redis", "--pairs-in-turn"])
