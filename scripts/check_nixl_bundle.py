#!/usr/bin/env python3
"""Check a NIXL bundle (scripts/bundle_nixl.sh): import ``nixl_cu12`` from the unpacked bundle with any
installed copy hidden, then one loopback transfer between two agents of this process (UCX backend):
a READ and a WRITE of 8 MiB of host memory, bytes compared. Exits 1 on any failure.

    python3 scripts/check_nixl_bundle.py DIR     # DIR: where the bundle was unpacked (tar -xJf ... -C DIR)

Prints the plugins and UCX transports found, and every NIXL/UCX library the process loaded (all must
come from DIR). numpy must be importable (it is imported before the installed packages are hidden).
"""

from __future__ import annotations

import os
import sys
import time


def main() -> int:
    root = os.path.realpath(sys.argv[1])
    import numpy as np  # from the environment, before its site-packages are hidden

    # hide every installed copy: the bundle is the only place nixl_cu12 can come from
    sys.path[:] = [root] + [p for p in sys.path if "site-packages" not in p and "dist-packages" not in p]
    os.environ.setdefault("UCX_MODULES", "^ib")  # the bundle has no IB modules; say so to UCX
    import nixl_cu12._api as api

    assert os.path.realpath(api.__file__).startswith(root), api.__file__
    cfg = api.nixl_agent_config(backends=["UCX"])
    a, b = api.nixl_agent("check-a", cfg), api.nixl_agent("check-b", api.nixl_agent_config(backends=["UCX"]))
    print("plugins:", a.plugin_list, "backends:", list(a.backends))
    n = 8 << 20
    src = np.random.default_rng(0).integers(0, 256, n, dtype=np.uint8)
    dst = np.zeros(n, dtype=np.uint8)
    a.register_memory([(src.ctypes.data, n, 0, "")], "DRAM")
    b.register_memory([(dst.ctypes.data, n, 0, "")], "DRAM")
    peer = b.add_remote_agent(a.get_agent_metadata())
    peer = peer.decode() if isinstance(peer, bytes) else peer
    local = b.get_xfer_descs([(dst.ctypes.data, n, 0)], "DRAM")
    remote = b.get_xfer_descs([(src.ctypes.data, n, 0)], "DRAM")
    ok = True
    for op in ("READ", "WRITE"):
        if op == "WRITE":
            src[:] = 0
        h = b.initialize_xfer(op, local, remote, peer)
        state, t0 = b.transfer(h), time.monotonic()
        while state == "PROC" and time.monotonic() - t0 < 30:
            time.sleep(1e-3)
            state = b.check_xfer_state(h)
        h.release()
        same = np.array_equal(src, dst)
        print(f"{op}: {state}, bytes equal: {same}")
        ok = ok and state == "DONE" and same
    maps = {line.split()[-1] for line in open("/proc/self/maps") if "/" in line}
    libs = sorted(p for p in maps if "nixl" in p or "libuc" in p)
    outside = [p for p in libs if not os.path.realpath(p).startswith(root)]
    ucx = sorted(os.path.basename(p) for p in libs if "/ucx/" in p)
    print(f"loaded {len(libs)} NIXL/UCX libraries, {len(libs) - len(outside)} from the bundle; UCX modules: {ucx}")
    if outside:
        print("loaded from outside the bundle:", *outside, sep="\n  ")
    return 0 if ok and not outside else 1


if __name__ == "__main__":
    sys.exit(main())
