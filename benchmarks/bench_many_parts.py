"""Reading a store of very many parts: a shuffled pass over every record of a
store of one slot per part (format 2.4, its parts in a part table), against
the same records in a store of one segment, each read in a fresh process.

A process may keep only so many files open and mapped, so a reader of a
store of more parts than that keeps a bounded number of parts open (the
least recently used one no read is using is closed when another opens);
this measures what that costs per record: each record of the parts store
is in a part of its own, the worst case, where a part is made, checked and
opened for every record read. The stores are built by ``bench_scale.py``'s
builders (sparse files, one one-byte field).

Two passes per process, each right after every file of the store was read
(so that the page cache holds them: the bookkeeping is measured, not the
disk): ``store[i]`` over a random permutation (the Dataset's path) and one
``Loader`` epoch (batches of 256, shuffled, the default reader threads). Printed per store: microseconds per record of
each, the process's descriptors open at the end and its peak RSS, then the
ratios parts/plain. Run both under the same limits (``ulimit -n``).

Usage::

    python benchmarks/bench_many_parts.py [--parts 100000] [--dir /var/tmp/mmstore-many-parts] [--keep]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_scale import build_parts, build_plain  # noqa: E402

_PROBE = r"""
import json, os, resource, sys, time
import numpy as np
import mmstore
from mmstore.torch import Loader
def warm(root):
    # every file read right before a pass (this machine's page cache does not keep pages for long)
    for d, _, names in os.walk(root):
        for name in names:
            with open(os.path.join(d, name), "rb") as fh:
                while fh.read(1 << 20):
                    pass

s = mmstore.open(sys.argv[1])
n = len(s)
order = np.random.default_rng(0).permutation(n).tolist()
warm(sys.argv[1])
t = time.perf_counter()
for i in order:
    s[i]
item = time.perf_counter() - t
warm(sys.argv[1])
t = time.perf_counter()
got = 0
for b in Loader(s, 256):
    got += len(b["u"])
epoch = time.perf_counter() - t
if got != n:
    raise SystemExit(f"the epoch gave {got} records of {n}")
with open("/proc/self/status") as f:
    peak = next(int(ln.split()[1]) for ln in f if ln.startswith("VmHWM:")) / 1024
print(json.dumps({"records": n, "item_us": item / n * 1e6, "epoch_us": epoch / n * 1e6,
                  "open_files": len(os.listdir("/proc/self/fd")),
                  "nofile_limit": resource.getrlimit(resource.RLIMIT_NOFILE)[0],
                  "on_demand": s.slot_view.backend.parts_on_demand(), "peak_rss_mb": peak}))
"""


def measure(root: str) -> dict[str, float]:
    out = subprocess.run([sys.executable, "-c", _PROBE, root], check=True, capture_output=True, text=True)
    return json.loads(out.stdout)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--parts", type=int, default=100_000)
    ap.add_argument("--dir", default="/var/tmp/mmstore-many-parts")
    ap.add_argument("--keep", action="store_true", help="keep the stores (default: delete them)")
    a = ap.parse_args()
    shutil.rmtree(a.dir, ignore_errors=True)
    os.makedirs(a.dir)
    plain, parts = os.path.join(a.dir, "plain.store"), os.path.join(a.dir, "parts.store")
    try:
        build_plain(plain, a.parts)
        build_parts(parts, a.parts)
        res = {"plain": measure(plain), "parts": measure(parts)}
        for name, r in res.items():
            print(f"{name:6s} {r['records']:>9,} records  store[i] {r['item_us']:7.1f} us  Loader epoch "
                  f"{r['epoch_us']:6.1f} us/record  parts on demand: {r['on_demand']}  open files "
                  f"{r['open_files']:,} (limit {r['nofile_limit']:,})  peak RSS {r['peak_rss_mb']:.0f} MB")
        p, q = res["parts"], res["plain"]
        print(f"parts/plain: store[i] {p['item_us'] / q['item_us']:.1f}x, Loader epoch "
              f"{p['epoch_us'] / q['epoch_us']:.1f}x")
        print(json.dumps(res))
    finally:
        if not a.keep:
            shutil.rmtree(a.dir, ignore_errors=True)


if __name__ == "__main__":
    main()
