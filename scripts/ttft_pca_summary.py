"""Print the PCA rows of ``lmtier bench ttft`` JSONs (scripts/gpu_run.sh steps ttftpca / ttftspy):
per tier its % of recompute, ratio, record MB (equal for every tier of a level), limit and checks.

    python scripts/ttft_pca_summary.py out/ttft_pca*.json
"""

from __future__ import annotations

import json
import sys


def main(paths: list[str]) -> int:
    for path in paths:
        try:
            d = json.load(open(path))
        except (OSError, ValueError) as e:
            print(f"{path}: {e}")
            continue
        info = d.get("codec_pca_model") or {}
        print(
            f"== {path}: {d.get('model')}; checks_ok {d.get('checks_ok')}; fit {info.get('tokens')} tokens "
            f"({info.get('fit_s', 0):.1f} s), calibration ratios {info.get('calibration_ratios')}"
        )
        for r in d.get("rows", []):
            print(f"  N={r['N']} recompute {r['recompute_ms']:.1f} ms")
            for k in sorted(k for k in r if k.endswith("_pct")):
                tag = k[:-4]
                extra = {x: r.get(f"{tag}_{x}") for x in ("ratio", "MB") if r.get(f"{tag}_{x}") is not None}
                chk = r.get(f"check_{tag}", {})
                print(f"    {tag:28s} {r[k]:6.1f} %  {extra}  kv_exact={chk.get('kv_exact')} ok={chk.get('ok')}")
            for k in sorted(k for k in r if k.startswith("check_records")):
                print(f"    {k}: {r[k]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
