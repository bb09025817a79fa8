#!/usr/bin/env python
"""Benchmark ``mmstore ingest`` against bare ``imdecode + resize``, side by side.

Usage::

    .venv/bin/python benchmarks/bench_ingest.py                 # defaults below, ~2-4 min on 2 cores
    .venv/bin/python benchmarks/bench_ingest.py --n 3000 --workers 2 --rss 2000,20000

What it measures (all on the same generated files, page cache warm):

1. ``bare``: one process, ``cv2.setNumThreads(1)``: read the file, ``cv2.imdecode``
   (RGB), centre crop, ``cv2.resize(INTER_AREA)`` to the target. This is the
   per-core speed limit of decoding.
2. ``decode_image``: the same files through ``mmstore.decode.decode_image`` in
   one process (what a worker does per file, without writing).
3. ``ingest --workers W``: the whole CLI pipeline (scan, fingerprint, decode,
   pwrite, checksums, fsync per chunk, commit log, finalize), wall time.
   Reported as a ratio to ``W x bare`` (target >= 0.85).
4. ``--fast-decode`` ingest: speed-up over the exact ingest and the mean
   absolute pixel difference of the two stores.
5. Peak RSS (parent and largest worker, from ``getrusage``) of ingests of
   tiny images with 2,000 and 20,000 inputs: it must not grow with the input
   count.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)


def photo(rng: np.random.Generator, h: int, w: int) -> np.ndarray:
    import cv2

    y, x = np.mgrid[0:h, 0:w].astype(np.float32)
    img = np.empty((h, w, 3), np.float32)
    a, b, c = rng.uniform(-1, 1, 3)
    img[..., 0] = 128 + 100 * np.sin(x / w * 3 * a + y / h * 2 * b)
    img[..., 1] = 128 + 100 * np.cos(y / h * 4 * c)
    img[..., 2] = 255 * (x + y) / (w + h)
    for _ in range(int(rng.integers(3, 8))):
        color = tuple(float(v) for v in rng.integers(0, 256, 3))
        if rng.random() < 0.5:
            cv2.circle(img, (int(rng.integers(0, w)), int(rng.integers(0, h))),
                       int(rng.integers(10, min(h, w) // 3)), color, -1)
        else:
            p1 = (int(rng.integers(0, w)), int(rng.integers(0, h)))
            p2 = (int(rng.integers(0, w)), int(rng.integers(0, h)))
            cv2.rectangle(img, p1, p2, color, -1)
    img = cv2.GaussianBlur(img, (0, 0), 1.5)
    img += rng.normal(0, 8, img.shape).astype(np.float32)
    return np.clip(img, 0, 255).astype(np.uint8)


def generate(root: str, n: int, lo: int, hi: int, seed: int, quality: int = 90) -> float:
    """n JPEGs with sides in [lo, hi] in 10 class folders; returns total MB."""
    import cv2

    rng = np.random.default_rng(seed)
    total = 0
    for i in range(n):
        d = os.path.join(root, f"c{i % 10}")
        os.makedirs(d, exist_ok=True)
        h, w = (int(v) for v in rng.integers(lo, hi + 1, 2))
        ok, buf = cv2.imencode(".jpg", photo(rng, h, w), [cv2.IMWRITE_JPEG_QUALITY, quality])
        buf.tofile(os.path.join(d, f"{i:07d}.jpg"))
        total += buf.size
    return total / 1e6


def files_of(root: str) -> list[str]:
    out = []
    for dp, dn, fn in os.walk(root):
        dn.sort()
        out += [os.path.join(dp, f) for f in sorted(fn)]
    return out


_CPU: dict[str, float] = {}


def bare_rate(files: list[str], size: int) -> float:
    """Images per second; CPU seconds per image go to ``_CPU["bare"]``."""
    import cv2

    cv2.setNumThreads(1)
    c0 = time.process_time()
    t0 = time.perf_counter()
    for f in files:
        buf = np.fromfile(f, np.uint8)
        img = cv2.imdecode(buf, cv2.IMREAD_COLOR_RGB)
        h, w = img.shape[:2]
        s = min(h, w)
        y0, x0 = (h - s) // 2, (w - s) // 2
        cv2.resize(img[y0 : y0 + s, x0 : x0 + s], (size, size), interpolation=cv2.INTER_AREA)
    el = time.perf_counter() - t0
    _CPU["bare"] = (time.process_time() - c0) / len(files)
    return len(files) / el


def decode_rate(files: list[str], size: int, fast: bool = False) -> float:
    import cv2

    from mmstore.decode import DecodeSpec, decode_image, read_bytes

    cv2.setNumThreads(1)
    spec = DecodeSpec((size, size), fast_decode=fast)
    t0 = time.perf_counter()
    for f in files:
        decode_image(read_bytes(f), spec)
    return len(files) / (time.perf_counter() - t0)


_RSS_CHILD = r"""
import json, resource, sys, time
sys.path.insert(0, {repo!r})
from mmstore.ingest import ingest
ru = resource.getrusage(resource.RUSAGE_SELF)
cpu0 = ru.ru_utime + ru.ru_stime
t0 = time.perf_counter()
r = ingest({src!r}, {dest!r}, ({size}, {size}), workers={workers}, quiet=True, fast_decode={fast})
el = time.perf_counter() - t0
me = 0
with open("/proc/self/status") as fh:  # VmHWM: this process's own peak (ru_maxrss survives exec)
    for line in fh:
        if line.startswith("VmHWM:"):
            me = int(line.split()[1])
ru_s = resource.getrusage(resource.RUSAGE_SELF)
ru_c = resource.getrusage(resource.RUSAGE_CHILDREN)
kids = ru_c.ru_maxrss
cpu = ru_s.ru_utime + ru_s.ru_stime + ru_c.ru_utime + ru_c.ru_stime - cpu0
print(json.dumps(dict(elapsed=el, records=r.records, parent_kb=me, worker_kb=kids, cpu=cpu)))
"""


def run_ingest(src: str, dest: str, size: int, workers: int, fast: bool = False) -> dict:
    code = _RSS_CHILD.format(repo=REPO, src=src, dest=dest, size=size, workers=workers, fast=fast)
    shutil.rmtree(dest, ignore_errors=True)
    t0 = time.perf_counter()
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    res = json.loads(p.stdout.strip().splitlines()[-1])
    res["wall"] = time.perf_counter() - t0
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=2000, help="photo-like JPEGs for the speed test (default 2000)")
    ap.add_argument("--size", type=int, default=224)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--rss", default="2000,20000", help="input counts for the RSS test (tiny images)")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved measurement rounds")
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--keep", action="store_true")
    a = ap.parse_args()
    work = a.workdir or tempfile.mkdtemp(prefix="mmstore-bench-")
    os.makedirs(work, exist_ok=True)
    try:
        src = os.path.join(work, "photos")
        if not os.path.isdir(src):
            t0 = time.perf_counter()
            mb = generate(src, a.n, 300, 640, seed=1)
            print(f"generated {a.n} JPEGs (300-640 px, q90, {mb:.0f} MB) in {time.perf_counter() - t0:.1f} s")
        files = files_of(src)
        for f in files:  # warm the page cache
            with open(f, "rb") as fh:
                fh.read()
        bare_rate(files[:200], a.size)  # warm-up
        dec = decode_rate(files, a.size)
        # The machine may be shared: measure in interleaved rounds and compare
        # each ingest with the bare rate measured right next to it.
        rows = []
        cpu_rows: list[tuple[float]] = []
        cpu_ing: list[tuple[float, int]] = []
        d = None
        for rnd in range(a.rounds):
            b1 = bare_rate(files, a.size)
            cb1 = _CPU["bare"]
            ex = run_ingest(src, os.path.join(work, "exact.store"), a.size, a.workers)
            fa = run_ingest(src, os.path.join(work, "fast.store"), a.size, a.workers, fast=True)
            b2 = bare_rate(files, a.size)
            cbare = (cb1 + _CPU["bare"]) / 2
            bare = (b1 + b2) / 2
            rate = ex["records"] / ex["elapsed"]
            frate = fa["records"] / fa["elapsed"]
            cing = ex["cpu"] / ex["records"]
            cfast = fa["cpu"] / fa["records"]
            rows.append((bare, rate, frate, cbare / cing, cing / cfast))
            cpu_rows.append((cbare,))
            cpu_ing.append((cing, ex["records"]))
            with open("/proc/loadavg") as fh:
                load = fh.read().split()[0]
            print(
                f"round {rnd + 1} (load {load}): bare {b1:6.1f}/{b2:6.1f} img/s, {cbare * 1e3:.2f} ms CPU/img | "
                f"ingest -w{a.workers} {rate:6.1f} img/s = {rate / (a.workers * bare):.2f} x ({a.workers} x bare), "
                f"{cing * 1e3:.2f} ms CPU/img | --fast-decode {frate:6.1f} img/s = {frate / rate:.2f} x exact, "
                f"{cfast * 1e3:.2f} ms CPU/img"
            )
            if d is None:
                import mmstore

                s1 = mmstore.open(os.path.join(work, "exact.store"))
                s2 = mmstore.open(os.path.join(work, "fast.store"))
                diffs = []
                for i in range(0, len(s1), 256):
                    x = s1[i : i + 256]["image"].astype(np.int16)
                    y = s2[i : i + 256]["image"].astype(np.int16)
                    diffs.append(np.abs(x - y).mean(axis=(1, 2, 3)))
                d = np.concatenate(diffs)
                s1.close()
                s2.close()
            shutil.rmtree(os.path.join(work, "exact.store"), ignore_errors=True)
            shutil.rmtree(os.path.join(work, "fast.store"), ignore_errors=True)
        # fixed costs (interpreter start, imports, fork, scan, finalize) measured on
        # 20 of the files, so the marginal CPU per image can be compared with bare
        small = os.path.join(work, "small")
        if not os.path.isdir(small):
            for f in files[:20]:
                dst = os.path.join(small, os.path.relpath(f, src))
                os.makedirs(os.path.dirname(dst), exist_ok=True)
                os.link(f, dst)
        fixed = []
        for _ in range(3):
            sm = run_ingest(small, os.path.join(work, "small.store"), a.size, a.workers)
            fixed.append(sm["cpu"] - sm["records"] * float(np.median([r[0] for r in cpu_rows])))
            shutil.rmtree(os.path.join(work, "small.store"), ignore_errors=True)
        fixed_cpu = float(np.median(fixed))
        marg = [(c_ing * n_rec - fixed_cpu) / n_rec for c_ing, n_rec in cpu_ing]
        med = lambda v: float(np.median(v))  # noqa: E731
        print(
            f"fixed CPU cost of one ingest run     : {fixed_cpu:.2f} s (start-up, imports, fork, scan, finalize)\n"
            f"marginal CPU per image, ingest       : {med(marg) * 1e3:.2f} ms"
            f" vs bare {med([r[0] for r in cpu_rows]) * 1e3:.2f} ms"
            f" -> efficiency {med([r[0] for r in cpu_rows]) / med(marg):.2f}"
        )
        bare = med([r[0] for r in rows])
        print(f"bare imdecode+crop+resize, 1 process : {bare:8.1f} img/s (median of rounds)")
        print(f"mmstore decode_image, 1 process      : {dec:8.1f} img/s")
        print(
            f"ingest --workers {a.workers} / ({a.workers} x bare)       : "
            f"{med([r[1] / (a.workers * r[0]) for r in rows]):.2f} (median; target >= 0.85)"
        )
        print(
            f"CPU efficiency bare/ingest per image : {med([r[3] for r in rows]):.2f} (median; 1 - overhead of "
            "writing, checksums, bookkeeping; load-independent)"
        )
        print(f"--fast-decode CPU speed-up           : {med([r[4] for r in rows]):.2f} x")
        print(
            f"--fast-decode speed-up over exact    : {med([r[2] / r[1] for r in rows]):.2f} x (wall); mean |diff| "
            f"{d.mean():.2f} levels (worst image {d.max():.2f})"
        )
        counts = [int(x) for x in a.rss.split(",") if x]
        if counts:
            tiny = os.path.join(work, "tiny")
            made = 0
            for n in sorted(counts):
                if n > made:
                    generate_tiny(tiny, made, n)
                    made = n
                sub = os.path.join(work, f"tiny{n}")
                if not os.path.isdir(sub):
                    os.makedirs(sub)
                    for i in range(n):
                        c = f"c{i % 10}"
                        os.makedirs(os.path.join(sub, c), exist_ok=True)
                        os.link(os.path.join(tiny, c, f"{i:07d}.jpg"), os.path.join(sub, c, f"{i:07d}.jpg"))
                r = run_ingest(sub, os.path.join(work, f"tiny{n}.store"), 32, a.workers)
                print(
                    f"peak RSS, {n:>6} inputs (48-64 px -> 32x32): parent {r['parent_kb'] / 1024:6.1f} MiB, "
                    f"largest worker {r['worker_kb'] / 1024:6.1f} MiB  [{r['records'] / r['elapsed']:.0f} img/s]"
                )
                shutil.rmtree(os.path.join(work, f"tiny{n}.store"), ignore_errors=True)
    finally:
        if not a.keep and not a.workdir:
            shutil.rmtree(work, ignore_errors=True)
    return 0


def generate_tiny(root: str, start: int, stop: int) -> None:
    import cv2

    rng = np.random.default_rng(start)
    base = [photo(rng, int(rng.integers(48, 65)), int(rng.integers(48, 65))) for _ in range(16)]
    for i in range(start, stop):
        d = os.path.join(root, f"c{i % 10}")
        os.makedirs(d, exist_ok=True)
        img = base[i % 16].copy()
        img[0, 0] = (i % 256, (i >> 8) % 256, 0)
        ok, buf = cv2.imencode(".jpg", img, [cv2.IMWRITE_JPEG_QUALITY, 90])
        buf.tofile(os.path.join(d, f"{i:07d}.jpg"))


if __name__ == "__main__":
    sys.exit(main())
