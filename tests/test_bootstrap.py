"""scripts/bootstrap.sh and its system-package step (scripts/lib/apt.sh), run with fakes: a fake
``apt-get`` / ``id`` on a PATH without the real redis-server, and a copy of the scripts in a temp tree
whose venv, build and model steps are stubs. Seconds, no network, no root needed.

issue 20 §5: when apt-get failed because another process held the dpkg lock, bootstrap printed
"continuing without them" and the main job then depended on luck for redis-server; and ~8 minutes of
setup printed nothing.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
LOCK_ERROR = (
    "E: Could not get lock /var/lib/dpkg/lock-frontend. It is held by process 4242 (apt-get)\n"
    "E: Unable to acquire the dpkg frontend lock (/var/lib/dpkg/lock-frontend), is another process using it?"
)
# A checkout's build inputs (scripts/lib/extension_stamp.py hashes them) and an importable lmtier._C.
_EXTENSION_SOURCES = {
    "csrc/ops.cpp": "int f() { return 1; }\n",
    "setup.py": "# setup\n",
    "CMakeLists.txt": "# cmake\n",
    "pyproject.toml": "[project]\n",
    "lmtier/__init__.py": "",
    "lmtier/_C.py": "",
}
TOOLS = ["bash", "cat", "chmod", "dirname", "echo", "ls", "mktemp", "rm", "sed", "sleep", "tail", "touch", "wc"]


def _fake_tree(tmp_path: Path, *, apt_fails: int, uid: int = 0) -> tuple[Path, dict]:
    """A temp checkout (scripts/bootstrap.sh, scripts/lib/apt.sh, stub setup/build/model steps) and the
    environment to run it with: PATH = fakes + the few coreutils the scripts use. The fake apt-get fails
    its first ``apt_fails`` calls with the dpkg lock error, then "installs" redis-server into the fakes."""
    top = tmp_path / "repo"
    (top / "scripts" / "lib").mkdir(parents=True)
    shutil.copy(REPO / "scripts" / "bootstrap.sh", top / "scripts" / "bootstrap.sh")
    shutil.copy(REPO / "scripts" / "lib" / "apt.sh", top / "scripts" / "lib" / "apt.sh")
    calls = tmp_path / "calls.log"
    (top / "scripts" / "setup_venv.sh").write_text(f'#!/usr/bin/env bash\necho "setup_venv $*" >> {calls}\n')
    (top / "scripts" / "setup_mooncake.sh").write_text(f'#!/usr/bin/env bash\necho "setup_mooncake $*" >> {calls}\n')
    shutil.copy(REPO / "scripts" / "lib" / "extension_stamp.py", top / "scripts" / "lib" / "extension_stamp.py")
    for name, text in _EXTENSION_SOURCES.items():
        (top / name).parent.mkdir(parents=True, exist_ok=True)
        (top / name).write_text(text)
    (top / ".venv" / "bin").mkdir(parents=True)
    # The venv's python: the stamp helper runs for real (lmtier importable from the tree), `pip install`
    # "builds" lmtier/_C.fake.so (a name that matches _C*.so and that Python does not import), the rest
    # only logs.
    (top / ".venv" / "bin" / "python").write_text(
        f"""#!/usr/bin/env bash
echo "python $*" >> {calls}
case "$1 $2" in
  "scripts/lib/extension_stamp.py "*) PYTHONPATH={top} exec {sys.executable} "$@";;
  "-m pip") echo built > {top}/lmtier/_C.fake.so;;
esac
"""
    )
    fake = tmp_path / "bin"
    fake.mkdir()
    for tool in TOOLS:
        where = shutil.which(tool)
        if where:
            (fake / tool).symlink_to(where)
    count = tmp_path / "apt.count"
    (fake / "apt-get").write_text(
        f"""#!/usr/bin/env bash
echo "apt-get $*" >> {calls}
n=$(cat {count} 2>/dev/null || echo 0); n=$((n + 1)); echo $n > {count}
if [ "$n" -le {apt_fails} ]; then
  printf '%s\\n' "{LOCK_ERROR}" >&2
  exit 100
fi
case " $* " in *" install "*)
  printf '#!/usr/bin/env bash\\necho fake redis\\n' > {fake}/redis-server; chmod +x {fake}/redis-server;;
esac
exit 0
"""
    )
    (fake / "id").write_text(f"#!/usr/bin/env bash\necho {uid}\n")
    for f in [*fake.iterdir(), *(top / "scripts").glob("*.sh"), top / ".venv" / "bin" / "python"]:
        if not f.is_symlink():
            f.chmod(0o755)
    env = {
        "PATH": str(fake),
        "HOME": str(tmp_path),
        "TMPDIR": str(tmp_path),
        "LMTIER_APT_RETRY_SLEEP": "0",
    }
    return top, env


def _calls(tmp_path: Path) -> list[str]:
    f = tmp_path / "calls.log"
    return f.read_text().splitlines() if f.exists() else []


def _ensure(top: Path, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", "-c", 'set -euo pipefail; source "$1"; ensure_system_packages', "_", str(top / "scripts/lib/apt.sh")],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


needs_bash = pytest.mark.skipif(shutil.which("bash") is None, reason="no bash")


@needs_bash
def test_apt_waits_for_the_lock_and_retries_once(tmp_path):
    top, env = _fake_tree(tmp_path, apt_fails=1)
    r = _ensure(top, env)
    assert r.returncode == 0, r.stderr
    assert "Could not get lock" in r.stderr and "retrying" in r.stderr
    apt = [c for c in _calls(tmp_path) if c.startswith("apt-get")]
    assert all("-o DPkg::Lock::Timeout=600" in c for c in apt), apt
    assert " install -y redis-server" in apt[-1], apt
    assert os.access(tmp_path / "bin" / "redis-server", os.X_OK)


@needs_bash
def test_apt_failing_twice_stops_naming_the_required_package(tmp_path):
    top, env = _fake_tree(tmp_path, apt_fails=99)
    r = _ensure(top, env)
    assert r.returncode != 0
    assert "attempt 2 of 2" in r.stderr and "Could not get lock" in r.stderr
    assert "ERROR: required package redis-server is missing" in r.stderr
    assert "continuing without them" not in r.stderr + r.stdout
    assert len([c for c in _calls(tmp_path) if c.startswith("apt-get") and " update" in c]) == 2


@needs_bash
def test_missing_required_package_may_be_allowed_explicitly(tmp_path):
    top, env = _fake_tree(tmp_path, apt_fails=99)
    r = _ensure(top, {**env, "LMTIER_ALLOW_MISSING_PACKAGES": "1"})
    assert r.returncode == 0 and "WARNING: required package redis-server is missing" in r.stderr


@needs_bash
def test_not_root_without_redis_fails_without_calling_apt(tmp_path):
    top, env = _fake_tree(tmp_path, apt_fails=0, uid=1000)
    r = _ensure(top, env)
    assert r.returncode != 0 and "required package redis-server is missing" in r.stderr
    assert "apt-get install redis-server" in r.stderr
    assert not [c for c in _calls(tmp_path) if c.startswith("apt-get")]


@needs_bash
def test_redis_server_from_the_environment_counts(tmp_path):
    top, env = _fake_tree(tmp_path, apt_fails=99, uid=1000)
    binary = tmp_path / "my-redis-server"
    binary.write_text("#!/bin/sh\n")
    binary.chmod(0o755)
    r = _ensure(top, {**env, "LMTIER_REDIS_SERVER": str(binary)})
    assert r.returncode == 0 and "required package" not in r.stderr, r.stderr


@needs_bash
def test_bootstrap_prints_numbered_steps_with_timings(tmp_path):
    top, env = _fake_tree(tmp_path, apt_fails=1)
    r = subprocess.run(["bash", str(top / "scripts/bootstrap.sh")], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    opened = [x for x in lines if x.startswith("[bootstrap ") and "done in" not in x]
    done = [x for x in lines if x.startswith("[bootstrap ") and " done in " in x]
    assert [x.split("]")[0] for x in opened] == [f"[bootstrap {i}/5" for i in range(1, 6)], lines
    assert len(done) == 5 and all(x.endswith(" s") for x in done), lines
    assert any("CUDA/C++ extension" in x and "min" in x for x in opened)
    assert lines[-1].startswith("[bootstrap] ready in ")
    calls = _calls(tmp_path)
    assert any(c.startswith("setup_venv") for c in calls) and any("make_model.py" in c for c in calls)
    assert any(c.startswith("setup_mooncake") for c in calls)


@needs_bash
def test_bootstrap_stops_before_the_venv_when_redis_is_missing(tmp_path):
    top, env = _fake_tree(tmp_path, apt_fails=99)
    r = subprocess.run(["bash", str(top / "scripts/bootstrap.sh")], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "required package redis-server is missing" in r.stderr
    assert not [c for c in _calls(tmp_path) if c.startswith(("setup_venv", "python"))]


@needs_bash
def test_have_tcmalloc_agrees_with_the_demo_s_search(monkeypatch):
    """apt.sh's check and the demo's (lmtier.testing.procmem.tcmalloc_path) find the same installed
    libtcmalloc_minimal: the check used to `ls` two globs at once and fail whenever /usr/lib64 did not
    exist (Debian), reinstalling the package and printing that it was missing although the demo's
    servers then preloaded it."""
    from lmtier.testing import procmem

    monkeypatch.delenv("LMTIER_TCMALLOC", raising=False)
    monkeypatch.setattr(procmem.envs, "LMTIER_TCMALLOC", None, raising=False)
    found = procmem.tcmalloc_path()
    want = found is not None and found.endswith("libtcmalloc_minimal.so.4")
    r = subprocess.run(
        ["bash", "-c", 'source "$1"; have_tcmalloc', "_", str(REPO / "scripts/lib/apt.sh")],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert (r.returncode == 0) == want, (found, r.returncode, r.stderr)


def _bootstrap(top: Path, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(top / "scripts/bootstrap.sh")], env=env, capture_output=True, text=True, timeout=60
    )


def _pip_runs(tmp_path: Path) -> int:
    return len([c for c in _calls(tmp_path) if c.startswith("python -m pip install")])


@needs_bash
def test_bootstrap_builds_the_extension_only_when_it_is_out_of_date(tmp_path):
    """Step 4 ran `pip install -e .` (53-68 s of C++/CUDA build) on every run although bootstrap says
    it is idempotent; it now builds on a fresh clone, after a source or setting changes, or when
    forced, and otherwise says it skipped and why."""
    top, env = _fake_tree(tmp_path, apt_fails=0)
    r = _bootstrap(top, env)
    assert r.returncode == 0, r.stderr
    assert "bootstrap: building: no lmtier/_C*.so" in r.stdout and _pip_runs(tmp_path) == 1
    assert (top / "build" / "extension.stamp").is_file()

    r = _bootstrap(top, env)
    assert r.returncode == 0, r.stderr
    assert "bootstrap: build skipped, the extension is up to date" in r.stdout, r.stdout
    assert "LMTIER_REBUILD=1 forces a build" in r.stdout and _pip_runs(tmp_path) == 1

    (top / "csrc" / "ops.cpp").write_text("int f() { return 2; }\n")
    r = _bootstrap(top, env)
    assert "bootstrap: building: csrc/, setup.py, CMakeLists.txt, pyproject.toml or the build settings changed" in (
        r.stdout
    )
    assert r.returncode == 0 and _pip_runs(tmp_path) == 2, r.stderr

    r = _bootstrap(top, {**env, "LMTIER_CUDA_ARCHS": "80;90"})  # another build setting
    assert r.returncode == 0 and "bootstrap: building: " in r.stdout and _pip_runs(tmp_path) == 3

    r = _bootstrap(top, {**env, "LMTIER_CUDA_ARCHS": "80;90", "LMTIER_REBUILD": "1"})
    assert r.returncode == 0 and "bootstrap: building: LMTIER_REBUILD=1" in r.stdout and _pip_runs(tmp_path) == 4


def test_extension_stamp_needs_an_importable_extension_from_this_checkout(tmp_path):
    """A matching stamp is not enough: lmtier._C must import from the checkout (a new venv without
    the editable install, a .so that does not load)."""
    top, _ = _fake_tree(tmp_path, apt_fails=0)
    (top / "lmtier" / "_C.fake.so").write_text("built")
    helper = [sys.executable, str(top / "scripts/lib/extension_stamp.py")]
    stamp = str(tmp_path / "extension.stamp")
    assert subprocess.run([*helper, "write", stamp], timeout=60).returncode == 0
    ok = subprocess.run([*helper, "check", stamp], env={**os.environ, "PYTHONPATH": str(top)}, capture_output=True)
    assert ok.returncode == 0, ok.stdout
    (top / "lmtier" / "_C.py").unlink()
    r = subprocess.run(
        [*helper, "check", stamp], env={**os.environ, "PYTHONPATH": str(top)}, capture_output=True, text=True
    )
    # no lmtier._C at all, or (a Python with lmtier installed from another checkout) that one's
    assert r.returncode == 1 and ("import lmtier._C fails" in r.stdout or "not this checkout's" in r.stdout), r.stdout
