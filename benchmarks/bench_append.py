#!/usr/bin/env python3
"""Append benchmark: ``mmstore.append`` of 1 % new records vs a full
re-ingest of the result.

What it does
------------
* Writes ``--records`` JPEGs of a real photograph (random crops of
  matplotlib's ``grace_hopper.jpg``, 200 to 500 pixels a side, quality 90)
  as an ImageFolder of 10 classes in ``--dir`` (default: a fresh directory
  on a real disk, never tmpfs; removed at the end unless ``--keep``): the
  first ``1 - --share`` of each class in ``old/``, the rest in ``new/``,
  and every file in ``all/``.
* Ingests ``old/`` at ``--size`` (not timed), then, for each of ``--reps``
  repetitions on a fresh copy of that store (hard links, not timed): the
  append of ``new/`` (``mmstore.append``: the new part's decode, the links
  of the old data, the bookkeeping of all slots, the exchange), and the
  full ingest of ``all/`` into a fresh store, interleaved, the page cache
  warm for both (the JPEGs read once before).
* Reports the median of each and the ratio append / re-ingest (target:
  at most 0.05), and the bytes the append wrote (the new part and the
  bookkeeping) against the store's size.

Both runs use the same ``--workers``; ratios come from the same run only.

    .venv/bin/python benchmarks/bench_append.py --quick
    .venv/bin/python benchmarks/bench_append.py --records 20000 --reps 3  # 200 new records
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import mmstore  # noqa: E402


def _photos(root: str, n: int, share: float, seed: int = 0) -> tuple[int, int]:
    """``old/``, ``new/`` and ``all/`` ImageFolders of ``n`` JPEG crops of a real photograph."""
    import cv2
    from matplotlib import cbook

    photo = cv2.imread(str(cbook.get_sample_data("grace_hopper.jpg", asfileobj=False)), cv2.IMREAD_COLOR)
    photo = cv2.resize(photo, (photo.shape[1] * 2, photo.shape[0] * 2), interpolation=cv2.INTER_CUBIC)
    rng = np.random.default_rng(seed)
    classes = [f"c{k:02d}" for k in range(10)]
    n_old = n_new = 0
    for k, c in enumerate(classes):
        per = n // len(classes) + (1 if k < n % len(classes) else 0)
        cut = per - max(1, round(per * share))
        for d in ("old", "new", "all"):
            os.makedirs(os.path.join(root, d, c), exist_ok=True)
        for i in range(per):
            h, w = (int(v) for v in rng.integers(200, 500, 2))
            y, x = int(rng.integers(0, photo.shape[0] - h)), int(rng.integers(0, photo.shape[1] - w))
            ok, buf = cv2.imencode(".jpg", photo[y:y + h, x:x + w], [cv2.IMWRITE_JPEG_QUALITY, 90])
            name = f"{c}_{i:06d}.jpg"
            side = "old" if i < cut else "new"
            with open(os.path.join(root, side, c, name), "wb") as fh:
                fh.write(buf.tobytes())
            os.link(os.path.join(root, side, c, name), os.path.join(root, "all", c, name))
            n_old += side == "old"
            n_new += side == "new"
    return n_old, n_new


def _read_all(root: str) -> None:
    for d, _, files in os.walk(root):
        for f in files:
            with open(os.path.join(d, f), "rb") as fh:
                fh.read()


def _written(path: str, before: set[tuple[int, int]]) -> int:
    """Bytes of the files of store ``path`` that are not among the inodes ``before``."""
    tot = 0
    for d, _, files in os.walk(path):
        for f in files:
            st = os.stat(os.path.join(d, f))
            if (st.st_dev, st.st_ino) not in before:
                tot += st.st_size
    return tot


def _inodes(path: str) -> set[tuple[int, int]]:
    out = set()
    for d, _, files in os.walk(path):
        for f in files:
            st = os.stat(os.path.join(d, f))
            out.add((st.st_dev, st.st_ino))
    return out


def _link_tree(src: str, dst: str) -> None:
    shutil.copytree(src, dst, copy_function=os.link)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--records", type=int, default=20000, help="records of the result (default %(default)s)")
    ap.add_argument("--share", type=float, default=0.01, help="share of new records (default %(default)s)")
    ap.add_argument("--size", type=int, default=224, help="stored side (default %(default)s)")
    ap.add_argument("--workers", type=int, default=None, help="decoder processes (default: the CPU cores)")
    ap.add_argument("--reps", type=int, default=1)
    ap.add_argument("--quick", action="store_true", help="2000 records, 1 repetition")
    ap.add_argument("--dir", help="work directory (default: a fresh one under the current directory)")
    ap.add_argument("--keep", action="store_true", help="keep the work directory")
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args()
    if args.quick:
        args.records, args.reps = 2000, 1
    work = args.dir or tempfile.mkdtemp(prefix="bench_append.", dir=os.getcwd())
    os.makedirs(work, exist_ok=True)
    try:
        n_old, n_new = _photos(os.path.join(work, "src"), args.records, args.share)
        _read_all(os.path.join(work, "src"))
        base = os.path.join(work, "base.store")
        mmstore.ingest(os.path.join(work, "src", "old"), base, size=args.size, workers=args.workers, quiet=True)
        t_app, t_full, wrote = [], [], []
        for r in range(args.reps):
            dest = os.path.join(work, f"grown{r}.store")
            _link_tree(base, dest)
            before = _inodes(dest)
            t0 = time.perf_counter()
            mmstore.append(dest, os.path.join(work, "src", "new"), workers=args.workers, quiet=True)
            t_app.append(time.perf_counter() - t0)
            wrote.append(_written(dest, before))
            full = os.path.join(work, f"full{r}.store")
            t0 = time.perf_counter()
            mmstore.ingest(os.path.join(work, "src", "all"), full, size=args.size, workers=args.workers, quiet=True)
            t_full.append(time.perf_counter() - t0)
            if r == 0:
                a, b = mmstore.open(dest), mmstore.open(full)
                if len(a) != len(b) or sorted(a.key(i) for i in range(len(a))) != sorted(
                        b.key(i) for i in range(len(b))):
                    raise SystemExit("the appended store and the full ingest differ")
            shutil.rmtree(full)
            shutil.rmtree(dest)
        store_bytes = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(base) for f in fs)
        res = {
            "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.python_version()}",
            "records": n_old + n_new, "new_records": n_new, "size": args.size, "workers": args.workers,
            "reps": args.reps,
            "append_s": round(statistics.median(t_app), 3), "full_ingest_s": round(statistics.median(t_full), 3),
            "ratio": round(statistics.median(t_app) / statistics.median(t_full), 4),
            "append_wrote_bytes": int(statistics.median(wrote)), "old_store_bytes": store_bytes,
        }
        print(f"{res['records']} records ({n_new} new) at {args.size}x{args.size}, {res['machine']}")
        print(f"  append of {n_new}:        {res['append_s']:8.3f} s  (wrote {res['append_wrote_bytes']:,} bytes; "
              f"the old store is {store_bytes:,})")
        print(f"  full re-ingest of {res['records']}: {res['full_ingest_s']:8.3f} s")
        print(f"  ratio append / re-ingest: {res['ratio']:.4f}  (target <= 0.05)")
        if args.json:
            with open(args.json, "w") as fh:
                json.dump(res, fh, indent=1)
        return 0
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    raise SystemExit(main())
