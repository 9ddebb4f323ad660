"""``examples/library_api.py`` at the README's settings (issue 20 section 5): ``chunk_size: 256``
with a CPU + disk config stores and hits chunks and says how many (on main its 130-token prompt
was shorter than one chunk: nothing stored, nothing said), and exits cleanly."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from lmtier.testing.vllm import write_yaml

REPO = Path(__file__).resolve().parents[1]


def _run_example(cfg, cwd) -> subprocess.CompletedProcess:
    """``examples/library_api.py --config cfg`` in ``cwd``, this checkout on PYTHONPATH."""
    return subprocess.run(
        [sys.executable, str(REPO / "examples" / "library_api.py"), "--config", str(cfg)],
        capture_output=True,
        text=True,
        timeout=600,
        env=dict(os.environ, PYTHONPATH=str(REPO)),
        cwd=str(cwd),
    )


def test_example_stores_and_hits_chunks_at_readme_chunk_size(tmp_path):
    cfg = write_yaml(
        tmp_path / "lmtier.yaml",
        {
            "chunk_size": 256,
            "local_cpu": True,
            "max_local_cpu_size": 0.0625,
            "local_disk": f"file://{tmp_path}/disk",
            "max_local_disk_size": 0.25,
        },
    )
    r = _run_example(cfg, tmp_path)
    assert r.returncode == 0 and "terminate called" not in r.stderr, r.stderr[-3000:]
    stored = re.search(r"stored (\d+) chunks", r.stdout)
    hit = re.search(r"hit (\d+) chunks", r.stdout)
    assert stored and hit, r.stdout
    assert int(stored[1]) >= 2 and int(hit[1]) >= 2, r.stdout
    assert list((tmp_path / "disk").glob("*/*.lmt")), "nothing reached the disk tier"


def test_example_with_the_readme_codec_on_its_float32_model_is_one_line(tmp_path):
    """The README's ``remote_serde: cachegen`` with this float32 model was an uncaught ConfigError
    traceback from TierManager.from_config; now one line that says what to change."""
    cfg = write_yaml(
        tmp_path / "lmtier.yaml",
        {
            "chunk_size": 256,
            "local_cpu": True,
            "max_local_cpu_size": 0.0625,
            "remote_url": "redis://127.0.0.1:1",  # refused before any connection
            "remote_serde": "cachegen",
        },
    )
    r = _run_example(cfg, tmp_path)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr[-3000:]
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("library_api.py (a float32 model on CPU): lmtier config: remote_serde='cachegen'"), last
    assert "use remote_serde: naive" in last
