"""`lmtier bench` CLI: --model-preset and --plot on every subcommand, the codec quality proxy, and
`all` skipping what the machine lacks with a line saying so (tiny sizes, CPU)."""

from __future__ import annotations

import json
import os
import re
import shlex

import pytest

from lmtier import cli
from lmtier.bench import codec as bcodec
from lmtier.bench.presets import PRESETS, preset

pytest.importorskip("matplotlib")


def _png(path) -> bool:
    return path.exists() and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_presets_cover_the_issue():
    assert {"llama-3.1-8b", "llama-3.1-70b-tp8", "qwen2.5-7b", "deepseek-v3-mla"} <= set(PRESETS)
    assert preset("Llama-3.1-8B").bytes_per_token() == 32 * 2 * 8 * 128 * 2
    assert preset("deepseek-v3-mla").bytes_per_token() == 61 * 576 * 2
    with pytest.raises(ValueError, match="unknown model preset"):
        preset("gpt-5")


def test_codec_synthetic_quality_proxy_and_plot(tmp_path):
    js, png = tmp_path / "c.json", tmp_path / "c.png"
    rc = cli.main(
        [
            "bench",
            "codec",
            "--synthetic",
            "--model-preset",
            "qwen2.5-7b",
            "--chunks",
            "1",
            "--chunk-tokens",
            "32",
            "--iters",
            "1",
            "--levels",
            "lossless",
            "high",
            "low",
            "--quiet",
            "--json",
            str(js),
            "--plot",
            str(png),
        ]
    )
    assert rc == 0 and _png(png)
    res = json.loads(js.read_text())
    assert res["synthetic"] is True and res["data"].startswith("SYNTHETIC") and "qwen2.5-7b" in res["data"]
    assert res["geometry"]["L"] == 28 and res["geometry"]["H"] == 4
    rows = {r["level"]: r for r in res["rows"]}
    assert rows["lossless"]["rel_err"] == 0 and rows["lossless"]["attn_rel_err"] == 0
    # more compression, more error: the proxy orders the levels
    assert 1.0 < rows["lossless"]["ratio"] < rows["high"]["ratio"] < rows["low"]["ratio"]
    assert 0 < rows["high"]["rel_err"] < rows["low"]["rel_err"] < 0.5
    assert rows["high"]["snr_db"] > rows["low"]["snr_db"] > 5
    assert 0 < rows["high"]["attn_rel_err"] < rows["low"]["attn_rel_err"]
    assert len(rows["high"]["per_layer"]["snr_k_db"]) == 28
    assert rows["high"]["encode_GBps"] > 0 and rows["high"]["decode_GBps"] > 0


def test_codec_rejects_mla_for_synthetic(tmp_path):
    with pytest.raises(SystemExit, match="MLA"):
        bcodec.main(["--synthetic", "--model-preset", "deepseek-v3-mla", "--chunks", "1", "--quiet"])


def test_codec_model_without_config_is_a_usage_error(tmp_path, capsys):
    """``--model DIR`` naming a directory that is not a transformers model: exit status 2 naming it,
    before any data is made (it used to measure synthetic KV and say so in one line)."""
    with pytest.raises(SystemExit) as e:
        bcodec.main(["--model", str(tmp_path), "--chunks", "1", "--quiet"])
    assert e.value.code == 2
    out, err = capsys.readouterr()
    last = err.strip().splitlines()[-1]
    assert "argument --model" in last and repr(str(tmp_path)) in last and "no config.json" in last, err
    assert out == ""


def test_codec_model_that_does_not_load_is_an_error_naming_it(tmp_path, capsys):
    """A ``--model`` with a config.json that does not load ends the run naming the path; no synthetic row."""
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(SystemExit, match=r"--model '.*' does not load") as e:
        bcodec.main(["--model", str(tmp_path), "--chunks", "1", "--chunk-tokens", "16", "--quiet"])
    assert str(tmp_path) in str(e.value.code)
    assert "SYNTHETIC" not in capsys.readouterr().out


def test_codec_without_model_keeps_the_synthetic_fallback(tmp_path, monkeypatch):
    """No ``--model`` and no default model under the working directory: synthetic data, and the data line says why."""
    monkeypatch.chdir(tmp_path)
    js = tmp_path / "c.json"
    argv = ["--model-preset", "qwen2.5-7b", "--chunks", "1", "--chunk-tokens", "16", "--iters", "1"]
    assert bcodec.main([*argv, "--levels", "lossless", "--quiet", "--json", str(js)]) == 0
    res = json.loads(js.read_text())
    assert res["synthetic"] is True and f"no local model ({bcodec.DEFAULT_MODEL} absent" in res["data"]
    assert res["geometry"]["L"] == 28 and res["rows"][0]["rel_err"] == 0


def test_attn_proxy_is_zero_for_exact_and_positive_for_noise():
    import torch

    x = bcodec.synthetic_kv(1, 2, 16, 2, 16).float()
    assert bcodec.attn_rel_err(x, x) == 0.0
    assert bcodec.attn_rel_err(x, x + 0.1 * torch.randn_like(x)) > 0


def test_transfer_cpu_plot_and_preset(tmp_path):
    js, png = tmp_path / "t.json", tmp_path / "t.png"
    rc = cli.main(
        [
            "bench",
            "transfer",
            "--device",
            "cpu",
            "--batches",
            "1",
            "--cache-gb",
            "0.05",
            "--model-preset",
            "llama-3.1-70b-tp8",
            "--quiet",
            "--json",
            str(js),
            "--plot",
            str(png),
        ]
    )
    assert rc == 0 and _png(png)
    res = json.loads(js.read_text())
    assert res["geometry"]["name"] == "llama-3.1-70b-tp8"
    assert res["rows"][0]["gather_GBs"] > 0


def test_disk_plot_and_preset(tmp_path):
    js, png = tmp_path / "d.json", tmp_path / "d.png"
    rc = cli.main(
        [
            "bench",
            "disk",
            "--dir",
            str(tmp_path / "d"),
            "--model-preset",
            "smollm2-135m",
            "--count",
            "2",
            "--rounds",
            "1",
            "--threads",
            "2",
            "--sync",
            "none",
            "--inflight",
            "2",
            "--quiet",
            "--json",
            str(js),
            "--plot",
            str(png),
        ]
    )
    assert rc == 0 and _png(png)
    res = json.loads(js.read_text())
    assert res["chunk_bytes"] == 256 * preset("smollm2-135m").bytes_per_token() // 4096 * 4096
    assert res["inflight_rows"][0]["inflight"] == 2


def _fake_subcommands(monkeypatch) -> list[tuple[str, list[str]]]:
    import importlib

    calls = []
    for name in cli.SUBCOMMANDS:
        mod = importlib.import_module(cli.SUBCOMMANDS[name])
        monkeypatch.setattr(mod, "main", lambda a, name=name: calls.append((name, a)) or 0)
    return calls


def _summary(out: str) -> dict[str, str]:
    line = next(ln for ln in out.splitlines() if ln.startswith("==== lmtier bench all: "))
    return dict(item.split(": ", 1) for item in line.removeprefix("==== lmtier bench all: ").split("; "))


def test_all_skips_with_a_line(monkeypatch, capsys):
    calls = _fake_subcommands(monkeypatch)
    monkeypatch.setattr(cli, "_has_gpu", lambda: False)
    monkeypatch.setattr(cli, "_redis_available", lambda: None)
    monkeypatch.setattr(cli, "_mooncake_missing", lambda: "no Mooncake client")
    monkeypatch.setattr(cli, "_nixl_missing", lambda: "no NIXL")
    assert cli.main(["bench", "all", "--model-preset", "qwen2.5-7b", "--plot-dir", "/tmp/x"]) == 0
    out = capsys.readouterr().out
    assert "skipping remote — no Redis" in out and "skipping ttft — no GPU" in out and "skipping rans" in out
    assert "skipping mooncake — no Mooncake client" in out and "skipping p2p — no NIXL" in out
    names = [c[0] for c in calls]
    assert names == ["transfer", "disk", "codec"]
    for _, a in calls:
        assert "--model-preset" in a and "qwen2.5-7b" in a and any(x.endswith(".png") for x in a)
    assert "ttft: skipped (no GPU)" in out
    # mooncake, seal and p2p were left out of the summary, which claims to say what it skips
    assert _summary(out) == {
        "transfer": "ok",
        "disk": "ok",
        "remote": "skipped (no Redis)",
        "mooncake": "skipped (no Mooncake client)",
        "seal": "skipped (no Redis)",
        "p2p": "skipped (no NIXL)",
        "codec": "ok",
        "ttft": "skipped (no GPU)",
        "rans": "skipped (no GPU)",
    }


def test_all_quick_runs_every_subcommand_whose_requirements_are_present(monkeypatch, capsys):
    """mooncake, seal and p2p start their own servers and take seconds in quick mode: bench all runs
    them too (they were never run). A $LMTIER_REDIS_URL reaches remote and seal as their URL option
    (remote started a private redis-server instead, and failed without one)."""
    calls = _fake_subcommands(monkeypatch)
    monkeypatch.setattr(cli, "_has_gpu", lambda: True)
    monkeypatch.setattr(cli, "_redis_available", lambda: "redis://127.0.0.1:6379/0")
    monkeypatch.setattr(cli, "_mooncake_missing", lambda: None)
    monkeypatch.setattr(cli, "_nixl_missing", lambda: None)
    assert cli.main(["bench", "all", "--quick"]) == 0
    summary = _summary(capsys.readouterr().out)
    assert set(summary) == set(cli.SUBCOMMANDS) and set(summary.values()) == {"ok"}, summary
    args = dict(calls)
    assert sorted(args) == sorted(cli.SUBCOMMANDS)
    assert "--quick" in args["mooncake"] and "--quick" in args["seal"] and "--quick" in args["p2p"]
    assert args["remote"][args["remote"].index("--url") + 1] == "redis://127.0.0.1:6379/0"
    assert args["seal"][args["seal"].index("--redis-url") + 1] == "redis://127.0.0.1:6379/0"


def test_every_subcommand_is_an_importable_module():
    # issue 14: `lmtier bench disk|remote|rans` ran benchmarks/bench_*.py by path (runpy), which a wheel
    # does not have; every subcommand is now a module of lmtier.bench with main(argv) -> int.
    import importlib

    assert set(cli.SUBCOMMANDS) == {
        "transfer",
        "disk",
        "remote",
        "mooncake",
        "seal",
        "p2p",
        "codec",
        "rans",
        "ttft",
    }
    for name, module in cli.SUBCOMMANDS.items():
        assert module.startswith("lmtier.bench."), name
        assert callable(importlib.import_module(module).main), name
        assert cli.subcommand_main(name) is importlib.import_module(module).main


def test_bench_package_imports_neither_the_cli_nor_runpy():
    # issue 14: lmtier.cli <-> lmtier.bench.codec was an import cycle (codec's --kernels imported the
    # CLI's runpy helper); nothing under lmtier/bench may import lmtier.cli or run files by path.
    import ast
    import pathlib

    import lmtier.bench

    root = pathlib.Path(lmtier.bench.__file__).parent
    files = sorted(root.rglob("*.py"))
    assert len(files) > 8
    for f in [*files, pathlib.Path(cli.__file__)]:
        tree = ast.parse(f.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            for n in names:
                assert n != "runpy" and not n.startswith("lmtier.cli"), (f.name, n)


def test_subcommands_run_outside_the_checkout(tmp_path):
    # issue 14: from an installed package (no benchmarks/ or scripts/ next to it) `lmtier bench disk`
    # must run; before, it printed "benchmarks/bench_disk.py not found" and returned 2.
    import os
    import shutil
    import subprocess
    import sys

    import lmtier

    site = tmp_path / "site"
    shutil.copytree(os.path.dirname(lmtier.__file__), site / "lmtier", ignore=shutil.ignore_patterns("__pycache__"))
    work = tmp_path / "work"
    work.mkdir()
    env = dict(os.environ, PYTHONPATH=str(site))
    js = work / "d.json"
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "lmtier.cli",
            "bench",
            "disk",
            "--dir",
            str(work / "d"),
            "--size-mib",
            "1",
            "--count",
            "1",
            "--rounds",
            "1",
            "--threads",
            "1",
            "--sync",
            "none",
            "--inflight",
            "1",
            "--quiet",
            "--json",
            str(js),
        ],
        cwd=work,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, (r.stdout + r.stderr)[-2000:]
    assert json.loads(js.read_text())["rows"]
    for sub in ("remote", "rans", "ttft"):
        r = subprocess.run(
            [sys.executable, "-m", "lmtier.cli", "bench", sub, "--help"],
            cwd=work,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert r.returncode == 0 and f"lmtier bench {sub}" in r.stdout, (sub, r.stderr[-1000:])


@pytest.mark.parametrize(
    "argv,rc", [(["--help"], 0), (["-h"], 0), (["bench", "--help"], 0), ([], 2), (["bench"], 2), (["frobnicate"], 2)]
)
def test_cli_help_exits_zero_and_usage_errors_two(argv, rc, capsys):
    """``lmtier --help`` is a request (usage on stdout, exit 0; it used to exit 2); a missing or unknown
    command is a usage error (usage on stderr, exit 2)."""
    from lmtier import cli

    assert cli.main(argv) == rc
    out, err = capsys.readouterr()
    assert "lmtier bench" in (out if rc == 0 else err)
    if argv == ["frobnicate"]:  # the word that was wrong is named
        assert err.startswith("lmtier: expected 'bench', got 'frobnicate'"), err
    if argv == ["bench"]:
        assert err.startswith("lmtier: expected a subcommand"), err


def test_unknown_subcommand_lists_the_valid_ones(capsys):
    from lmtier import cli

    assert cli.main(["bench", "nosuch"]) == 2
    err = capsys.readouterr().err
    assert "unknown subcommand 'nosuch' (one of: " in err and all(s in err for s in [*cli.SUBCOMMANDS, "all"])


def test_sigterm_runs_the_benchmarks_cleanup():
    """SIGTERM (``timeout``, ``kill``) of a benchmark process ends it as Ctrl-C does: its ``finally``
    blocks run (they stop the servers a bench started and remove its temporary folders), exit 143.
    Without it a killed ``lmtier bench ttft`` left its Redis and Mooncake servers running."""
    import subprocess
    import sys

    code = (
        "import os, signal, time\n"
        "from lmtier.bench.signals import exit_on_sigterm\n"
        "exit_on_sigterm()\n"
        "try:\n"
        "    os.kill(os.getpid(), signal.SIGTERM)\n"
        "    time.sleep(30)\n"
        "finally:\n"
        "    print('cleaned up', flush=True)\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 143 and r.stdout == "cleaned up\n", (r.returncode, r.stdout, r.stderr[-500:])


def test_help_lists_every_subcommand(capsys):
    """``lmtier --help`` names every subcommand ``lmtier bench`` runs (the usage line and a line each):
    ``mooncake`` was runnable but missing from the help."""
    from lmtier import cli

    assert cli.main(["--help"]) == 0
    out = capsys.readouterr().out
    first, *lines = out.splitlines()
    listed = first.split("{", 1)[1].split("}", 1)[0].split(",")
    assert sorted(listed) == sorted([*cli.SUBCOMMANDS, "all"]), first
    described = {ln.split()[0] for ln in lines if ln.startswith("  ") and ln.split()}
    assert set(listed) <= described, (listed, described)


def test_version_prints_the_package_version(capsys):
    """issue 20 §5: ``lmtier --version`` printed the usage and exited 2; it prints ``lmtier <__version__>``
    (lmtier/__init__.py, the one definition) and exits 0."""
    import lmtier

    for flag in ("--version", "-V"):
        assert cli.main([flag]) == 0
        assert capsys.readouterr().out.strip() == f"lmtier {lmtier.__version__}"


BAD_VALUES = [
    ("transfer", ["--batches", "abc"], "--batches", "abc"),
    ("transfer", ["--batches", "1,0"], "--batches", "1,0"),
    ("transfer", ["--orders", "LBNHC,XYZ"], "--orders", "LBNHC,XYZ"),
    ("transfer", ["--cache-gb", "nan"], "--cache-gb", "nan"),
    ("transfer", ["--multi-gpu", "--gpus", "-1"], "--gpus", "-1"),
    ("disk", ["--threads", "x"], "--threads", "x"),
    ("disk", ["--inflight", "1,,2"], "--inflight", "1,,2"),
    ("disk", ["--sync", "data,fast"], "--sync", "data,fast"),
    ("disk", ["--count", "0"], "--count", "0"),
    ("remote", ["--inflight", "q"], "--inflight", "q"),
    ("remote", ["--pieces-mib", "1,big"], "--pieces-mib", "1,big"),
    ("codec", ["--chunks", "0"], "--chunks", "0"),
    ("codec", ["--model", "/nope"], "--model", "/nope"),  # was a silent synthetic run
    ("rans", ["--seg-log2", "99"], "--seg-log2", "99"),
    ("rans", ["--cases", "bogus"], "--cases", "bogus"),
    ("ttft", ["--lengths", "1024,a"], "--lengths", "1024,a"),
    ("ttft", ["--codec-levels", "default,foo"], "--codec-levels", "default,foo"),
    ("ttft", ["--iters", "0"], "--iters", "0"),
    ("remote", ["--url", "http://x"], "--url", "http://x"),  # was redis-py's ValueError traceback
    ("remote", ["--url", "redis-cluster://a:1,b:2"], "--url", "redis-cluster://a:1,b:2"),
    ("seal", ["--redis-url", "nope"], "--redis-url", "nope"),  # was a RemoteURLError traceback
    # outputs written at the end: a missing directory was a traceback after the whole run
    *[(sub, ["--json", "/nonexistent/r.json"], "--json", "/nonexistent/r.json") for sub in cli.SUBCOMMANDS],
    ("disk", ["--plot", "/nonexistent/d.png"], "--plot", "/nonexistent/d.png"),
    ("ttft", ["--plot", "/nonexistent/t.png"], "--plot", "/nonexistent/t.png"),
]


@pytest.mark.parametrize("sub,args,option,value", BAD_VALUES, ids=[f"{s}{a[0]}={a[-1]}" for s, a, _, _ in BAD_VALUES])
def test_bad_option_values_are_usage_errors(sub, args, option, value, capsys):
    """issue 20 §5: ``lmtier bench transfer --batches abc`` (and every list option parsed later with
    ``int(x)``) ended in a ValueError traceback; a bad value is now argparse's usage error: exit status 2,
    the last stderr line names the subcommand, the option and the value, and nothing ran."""
    with pytest.raises(SystemExit) as e:
        cli.main(["bench", sub, *args])
    assert e.value.code == 2
    out, err = capsys.readouterr()
    last = err.strip().splitlines()[-1]
    assert last.startswith(f"lmtier bench {sub}") and f"argument {option}" in last and repr(value) in last, err
    assert "Traceback" not in err and out == ""


def test_bench_parsers_use_the_shared_argument_types():
    """One definition of the numeric / list option types (lmtier.bench.args): no bare ``type=int`` /
    ``type=float`` (unbounded: ``--count 0`` crashed in the body) and no ``.split(",")`` of an option."""
    import pathlib

    import lmtier.bench

    root = pathlib.Path(lmtier.bench.__file__).parent
    for f in sorted(root.rglob("*.py")):
        src = f.read_text()
        assert not re.search(r"type=(int|float)\b", src), f.name
        assert not re.search(r"\b(a|args)\.\w+\.split\(", src), f.name


def test_output_directories_are_created_or_a_usage_error_before_the_run(tmp_path, capsys):
    """``--model-cache`` (codec_pca: a traceback after the minutes-long fit when the folder was
    missing) and ``bench all``'s ``--plot-dir`` / ``--json-dir``: a missing folder is created, a file in
    the way is a usage error naming it, before any work."""
    import argparse

    from lmtier.bench import codec_pca
    from lmtier.bench.args import output_directory

    d = tmp_path / "a" / "b"
    assert output_directory(str(d)) == str(d) and d.is_dir()
    f = tmp_path / "f"
    f.write_text("x")
    with pytest.raises(argparse.ArgumentTypeError, match="cannot create the directory"):
        output_directory(str(f / "c"))
    with pytest.raises(SystemExit) as e:
        codec_pca.main(["--device", "cpu", "--model-cache", str(f), "--geometry", "2,1,8,1"])
    assert e.value.code == 2 and "argument --model-cache" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        cli.main(["bench", "all", "--json-dir", str(f / "c")])
    assert e.value.code == 2 and "argument --json-dir" in capsys.readouterr().err


def test_disk_dir_that_is_a_file_is_a_usage_error(tmp_path, capsys):
    """Was a FileExistsError traceback from os.makedirs inside the run."""
    f = tmp_path / "a_file"
    f.write_text("x")
    with pytest.raises(SystemExit) as e:
        cli.main(["bench", "disk", "--dir", str(f), "--count", "1"])
    assert e.value.code == 2
    assert "argument --dir" not in (err := capsys.readouterr().err) and f"--dir {str(f)!r}: File exists" in err


def test_transfer_chunk_tokens_not_a_multiple_of_the_block_size_is_a_usage_error(capsys):
    """Was a ValueError traceback from slot_mapping_from_block_ids after the cache was built."""
    with pytest.raises(SystemExit) as e:
        cli.main(["bench", "transfer", "--device", "cpu", "--chunk-tokens", "17", "--block-size", "16"])
    assert e.value.code == 2
    assert "--block-size 16 does not divide --chunk-tokens 17" in capsys.readouterr().err


@pytest.mark.parametrize("sub,option", [("remote", "--url"), ("seal", "--redis-url")])
def test_unreachable_redis_is_one_line(sub, option, capsys):
    """A URL nobody listens on was a redis-py ConnectionError traceback (remote)."""
    with pytest.raises(SystemExit) as e:
        cli.main(["bench", sub, option, "redis://:secret@127.0.0.1:1"])
    msg = str(e.value.code)
    assert msg.startswith(f"lmtier bench {sub}: cannot reach redis://:***@127.0.0.1:1: ConnectionError"), msg
    assert "secret" not in msg + capsys.readouterr().err


@pytest.mark.parametrize("sub", list(cli.SUBCOMMANDS))
def test_usage_says_which_subcommands_take_model_preset_and_plot(sub, capsys):
    """``lmtier --help`` said every subcommand but rans, seal and mooncake takes --model-preset and
    --plot; p2p takes neither."""
    line = next(ln for ln in cli.USAGE.splitlines() if ln.startswith("every subcommand but "))
    excluded = set(re.findall(r"[a-z0-9]+", line.split(" takes ")[0].removeprefix("every subcommand but "))) - {"and"}
    with pytest.raises(SystemExit):
        cli.main(["bench", sub, "--help"])
    out = capsys.readouterr().out
    takes = "--model-preset" in out and "--plot" in out
    assert takes == (sub not in excluded), (sub, excluded)


@pytest.mark.parametrize("sub", [*cli.SUBCOMMANDS, "all"])
def test_subcommand_help_names_itself(sub, capsys):
    """``lmtier bench disk --help`` called itself ``bench_disk.py`` once; every subcommand's usage line
    names the command a user typed."""
    with pytest.raises(SystemExit) as e:
        cli.main(["bench", sub, "--help"])
    assert e.value.code == 0
    assert capsys.readouterr().out.startswith(f"usage: lmtier bench {sub} ")


def test_argument_types_parse_and_reject():
    import argparse

    from lmtier.bench.args import bounded_float, bounded_int, float_list, int_list, name_list

    assert int_list(min_value=1)(" 1, 4,8 ") == [1, 4, 8]
    assert int_list(min_value=1, allow_empty=True)("") == []
    assert float_list(above=0)("1,0.5") == [1.0, 0.5]
    assert name_list(("data", "none"))("none") == ["none"]
    assert bounded_int(min_value=0, max_value=3)("3") == 3
    assert bounded_float(min_value=0)("0") == 0.0
    for fn, text in [
        (int_list(min_value=1), ""),
        (int_list(min_value=1), "1.5"),
        (float_list(above=0), "inf"),
        (name_list(("a",)), "a,b"),
        (bounded_int(max_value=3), "4"),
        (bounded_float(above=0), "0"),
    ]:
        with pytest.raises(argparse.ArgumentTypeError, match=re.escape(repr(text))):
            fn(text)


def test_disk_dir_that_is_not_writable_is_a_usage_error(tmp_path, monkeypatch, capsys):
    """An existing directory on a read-only file system was a CalledProcessError traceback from the
    first dd; now a probe file is created (and removed) before any work. The probe is made to fail
    the way a read-only mount fails it, since chmod 0555 does not stop root."""
    import errno
    import tempfile

    from lmtier.bench import disk

    d = tmp_path / "ro"
    d.mkdir()
    real_mkstemp = tempfile.mkstemp

    def mkstemp(*args, dir=None, **kw):
        if dir is not None and os.path.samefile(dir, d):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), os.path.join(dir, "probe"))
        return real_mkstemp(*args, dir=dir, **kw)

    monkeypatch.setattr(tempfile, "mkstemp", mkstemp)
    monkeypatch.setattr(disk, "run", lambda *a, **k: pytest.fail("the benchmark ran in an unwritable --dir"))
    with pytest.raises(SystemExit) as e:
        cli.main(["bench", "disk", "--dir", str(d), "--model-preset", "tiny", "--count", "4", "--rounds", "1"])
    assert e.value.code == 2
    assert f"--dir {str(d)!r}: Read-only file system" in capsys.readouterr().err


def _failing_dd(tmp_path, monkeypatch, stderr: str) -> None:
    """Put a stand-in ``dd`` first on PATH that prints ``stderr`` and exits 1."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "dd"
    fake.write_text(f"#!/bin/sh\necho {shlex.quote(stderr)} >&2\nexit 1\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")


def test_disk_dd_failure_is_one_line_naming_the_dir(tmp_path, monkeypatch, capsys):
    """dd failing (here a stand-in dd on PATH that fails as on a read-only mount or on tmpfs without
    O_DIRECT) was a CalledProcessError traceback; now one line with the directory and dd's stderr.
    A --dir that did not exist is created and said so, with the mount it is on (a mistyped mount point
    measured the disk under it, silently)."""
    from lmtier.bench.disk import mount_of

    _failing_dd(tmp_path, monkeypatch, "dd: failed to open 'x': Invalid argument")
    d = tmp_path / "bench"
    argv = ["bench", "disk", "--dir", str(d), "--model-preset", "tiny", "--count", "1", "--rounds", "1"]
    for created in (True, False):
        with pytest.raises(SystemExit) as e:
            cli.main([*argv, "--threads", "1", "--sync", "none", "--inflight", "", "--quiet"])
        msg = str(e.value.code)
        assert msg == f"lmtier bench disk: dd failed in --dir {str(d)!r}: dd: failed to open 'x': Invalid argument"
        assert not (d / "dd-ceiling.bin").exists()
        note = f"lmtier bench disk: --dir {str(d)!r} did not exist: created it (on {mount_of(str(d))})"
        assert (note in capsys.readouterr().err) == created
    assert mount_of(str(d)).startswith("mount /") and mount_of(str(d)) == mount_of(str(tmp_path))


def test_ttft_disk_ceiling_is_the_disk_benchmarks_dd_plus_parallel_reads(tmp_path, monkeypatch):
    """``bench ttft``'s disk ceiling runs :func:`lmtier.bench.disk.dd_ceiling` (one definition of the dd
    measurement), keeps its file for the parallel O_DIRECT reads, and removes it; a failing dd is an
    ``error`` entry, not an exception."""
    from lmtier.bench.disk import dd_path
    from lmtier.bench.ttft.ceilings import dd_read_gbps, odirect_supported

    if not odirect_supported(str(tmp_path)):
        pytest.skip(f"{tmp_path}: no O_DIRECT on this file system")
    res = dd_read_gbps(str(tmp_path), 16 << 20, inflight=2, piece_bytes=4 << 20)
    assert "error" not in res, res
    assert res["write"] > 0 and res["read"] > 0 and res["read_par"] > 0
    assert res["read_par_inflight"] == 2 and res["read_par_piece_MiB"] == 4
    assert not os.path.exists(dd_path(str(tmp_path)))
    _failing_dd(tmp_path, monkeypatch, "dd: no space")
    bad = dd_read_gbps(str(tmp_path), 16 << 20)
    assert bad == {"error": f"dd failed in --dir {str(tmp_path)!r}: dd: no space"}
    assert not os.path.exists(dd_path(str(tmp_path)))
