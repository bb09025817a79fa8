#!/usr/bin/env python3
"""Single-byte changes of an LMDB store's records.mdb against `verify`.

    python benchmarks/stress_verify_lmdb.py [--flips 200] [--seed 7] [--records 300]

Each trial changes one byte of records.mdb (half of them anywhere, half in
the first 24 bytes of a page: header and node pointers, where a change makes
liblmdb read outside its map and die of SIGBUS/SIGSEGV), then verifies the
copy. All trials run in one child interpreter, so a signal death of verify
itself would end the run; it must finish. (tests/check/test_crafted_stores.py
runs 30 of these.)

Prints: trials, verify deaths (must be 0), stores found damaged, LMDB damage
findings and how many of them were a death of verify's reader child, and the
records named unreadable. Exits 1 if verify died.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path[:0] = [REPO, os.path.join(REPO, "tests")]

from support.stores import write_store  # noqa: E402

CHILD = """
import json, sys
from mmstore.check.verify import verify_store
for p in sys.argv[1:]:
    r = verify_store(p, threads=1)
    died = [x.message for x in r.problems if x.kind == "lmdb-damaged"]
    print(json.dumps([r.ok, bool(died), any("died" in m for m in died),
                      sum(b.what == "unreadable" for b in r.bad_records)]), flush=True)
"""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--flips", type=int, default=200)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--records", type=int, default=300)
    args = ap.parse_args()
    work = tempfile.mkdtemp(prefix="mmstore-stress-verify-")
    try:
        clean = write_store(os.path.join(work, "clean"), args.records, backend="lmdb")
        with open(os.path.join(clean, "records.mdb"), "rb") as fh:
            orig = fh.read()
        rng = random.Random(args.seed)
        paths = []
        for t in range(args.flips):
            if t % 2:
                off = rng.randrange(len(orig))
            else:
                off = rng.randrange(len(orig) // 4096) * 4096 + rng.randrange(24)
            data = bytearray(orig)
            data[off] ^= rng.randrange(1, 256)
            p = os.path.join(work, f"f{t:05d}")
            shutil.copytree(clean, p)
            with open(os.path.join(p, "records.mdb"), "wb") as fh:
                fh.write(data)
            paths.append(p)
        env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
        t0 = time.perf_counter()
        proc = subprocess.run([sys.executable, "-c", CHILD, *paths], capture_output=True, text=True, env=env)
        rows = [json.loads(ln) for ln in proc.stdout.splitlines() if ln.startswith("[")]
        deaths = 0 if proc.returncode == 0 and len(rows) == len(paths) else 1
        print(f"trials {len(paths)}, verify deaths {deaths}, found damaged {sum(not r[0] for r in rows)}, "
              f"LMDB damage {sum(r[1] for r in rows)} (reader child died: {sum(r[2] for r in rows)}), "
              f"records named unreadable {sum(r[3] for r in rows)}, {time.perf_counter() - t0:.0f} s")
        if deaths:
            print(f"verify died: exit {proc.returncode} after {len(rows)} trials\n{proc.stderr[-2000:]}")
        return 1 if deaths else 0
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
