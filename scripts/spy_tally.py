"""Tally py-spy's raw samples (``py-spy record -f raw``, e.g. scripts/gpu_run.sh's ``ttftspy`` step):
samples per function, self and inclusive, over the stacks that pass through a frame matching
``--within`` (default: a tier's ``get_many_into`` / ``get_into``, the load path), and per thread.

    python scripts/spy_tally.py out/spy_gil.txt [--within get_many_into] [--top 40]
"""

from __future__ import annotations

import argparse
import collections
import re

_FRAME = re.compile(r"^(?P<fn>.*) \((?P<file>[^()]*?)(?::(?P<line>\d+))?\)$")


def _name(frame: str) -> str:
    m = _FRAME.match(frame)
    if not m:
        return frame
    file = m["file"].rsplit("/", 2)
    return f"{m['fn']} ({'/'.join(file[-2:])})"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("raw")
    ap.add_argument("--within", default=r"get_many_into|get_into", help="regex a stack's frame must match")
    ap.add_argument("--top", type=int, default=40)
    a = ap.parse_args()
    within = re.compile(a.within)
    self_n, incl_n, threads = collections.Counter(), collections.Counter(), collections.Counter()
    total = kept = 0
    with open(a.raw) as f:
        for line in f:
            stack, _, n = line.rstrip("\n").rpartition(" ")
            frames, n = stack.split(";"), int(n)
            total += n
            if not any(within.search(fr) for fr in frames):
                continue
            kept += n
            names = [_name(fr) for fr in frames if not fr.startswith("thread (")]
            threads[frames[0]] += n
            if names:
                self_n[names[-1]] += n
            for nm in set(names):
                incl_n[nm] += n
    print(f"{kept} of {total} samples within /{a.within}/ ({100 * kept / max(total, 1):.1f} %)")
    print("\nthreads:")
    for t, n in threads.most_common(12):
        print(f"  {n:7d}  {t}")
    for title, c in (("self", self_n), ("inclusive", incl_n)):
        print(f"\n{title}:")
        for nm, n in c.most_common(a.top):
            print(f"  {n:7d} {100 * n / max(kept, 1):5.1f} %  {nm}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
