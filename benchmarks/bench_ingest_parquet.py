#!/usr/bin/env python
"""Benchmark a Parquet ingest against a bare loop of the same decode + resize over the same bytes in memory.

Usage::

    .venv/bin/python benchmarks/bench_ingest_parquet.py                  # defaults below, about a minute on 2 cores
    .venv/bin/python benchmarks/bench_ingest_parquet.py --n 4000 --workers 4 --rounds 3

The images: random crops of real photographs (the samples of scikit-image and scikit-learn,
``compact_common.real_photos``, where installed, else matplotlib's ``grace_hopper.jpg``), 300 to 640 px a
side (at most the photograph's), JPEG quality 90, written in img2dataset's Parquet
layout (``key``, ``jpg`` bytes, ``caption``, ``similarity``, ``width``, ``height``) into ``--files`` files of
row groups of ``--row-group`` rows (img2dataset writes 100 at a time), page cache warm (the inputs are
read again right before each timed ingest).

1. ``bare``: one process, ``cv2.setNumThreads(1)``, the JPEG bytes already in a Python list:
   ``cv2.imdecode`` (RGB), centre crop, ``cv2.resize(INTER_AREA)`` to ``--size``. The per-core limit.
2. ``ingest --workers W``: ``mmstore ingest 'DIR/*.parquet' DEST --size S --image-column jpg
   --caption-column caption --columns similarity,width`` in a child process, wall time from the call to
   its return (scan of the footers, workers reading row groups, decode, writes, checksums, commits,
   manifest). Reported as a ratio to ``W x bare`` measured right next to it (target >= 0.8), and as a
   CPU efficiency (bare CPU per image / the ingest's CPU per image, its workers included), which does not
   depend on what else the machine runs.
3. ``parquet-image``: the same files with ``--image-column jpg`` alone (no caption or columns stored), to
   tell the source's own cost from the cost of storing the caption and metadata fields.
4. ``folder``: the same JPEGs as files in a folder, ``mmstore ingest FOLDER DEST --size S``, measured the
   same way, for comparison.
5. With ``--baseline DIR`` (a checkout of another version of mmstore: the directory that holds its
   ``mmstore`` package), 1 and 3 again with that version, in the same rounds: old and new side by side.

Each line also gives the CPU time per image (the child's and its workers', in ms), which a loaded or
shared machine changes less than the wall time.
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

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, REPO)
sys.path.insert(0, HERE)


def real_photographs() -> list[np.ndarray]:
    """RGB real photographs: scikit-image's and scikit-learn's samples (``compact_common.real_photos``)
    where those packages are installed, else matplotlib's ``grace_hopper.jpg``."""
    try:
        from compact_common import real_photos

        return [p for _, p in real_photos()]
    except ImportError:
        import cv2
        from matplotlib import cbook

        path = str(cbook.get_sample_data("grace_hopper.jpg", asfileobj=False))
        return [cv2.imread(path, cv2.IMREAD_COLOR_RGB)]


def make_jpegs(n: int, seed: int = 0) -> tuple[list[bytes], list[tuple[int, int]]]:
    """``n`` JPEGs (quality 90) of random crops, 300-640 px a side, of the real sample photos, and their (h, w)."""
    import cv2

    photos = real_photographs()
    rng = np.random.default_rng(seed)
    out, sizes = [], []
    for i in range(n):
        p = photos[i % len(photos)]
        h = int(rng.integers(min(300, p.shape[0]), min(640, p.shape[0]) + 1))
        w = int(rng.integers(min(300, p.shape[1]), min(640, p.shape[1]) + 1))
        y, x = int(rng.integers(0, p.shape[0] - h + 1)), int(rng.integers(0, p.shape[1] - w + 1))
        ok, buf = cv2.imencode(".jpg", np.ascontiguousarray(p[y : y + h, x : x + w, ::-1]),
                               [cv2.IMWRITE_JPEG_QUALITY, 90])
        out.append(buf.tobytes())
        sizes.append((h, w))
    return out, sizes


def write_parquet(d: str, jpegs: list[bytes], sizes: list[tuple[int, int]], files: int, row_group: int) -> float:
    """img2dataset's layout in ``files`` files; returns their total MB."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    os.makedirs(d, exist_ok=True)
    per = -(-len(jpegs) // files)
    total = 0
    for f in range(files):
        rows = range(f * per, min(len(jpegs), (f + 1) * per))
        t = pa.table({"key": [f"{i:09d}" for i in rows], "jpg": pa.array([jpegs[i] for i in rows], pa.binary()),
                      "caption": [f"photo {i}" for i in rows], "similarity": [0.3 + 1e-4 * i for i in rows],
                      "width": [sizes[i][1] for i in rows], "height": [sizes[i][0] for i in rows]})
        path = os.path.join(d, f"{f:05d}.parquet")
        pq.write_table(t, path, row_group_size=row_group)
        total += os.path.getsize(path)
    return total / 1e6


def bare_rate(jpegs: list[bytes], size: int) -> float:
    """Images per second of decode + centre crop + resize over bytes in memory, one process."""
    import cv2

    cv2.setNumThreads(1)
    t0 = time.perf_counter()
    for b in jpegs:
        img = cv2.imdecode(np.frombuffer(b, np.uint8), cv2.IMREAD_COLOR_RGB)
        h, w = img.shape[:2]
        s = min(h, w)
        y0, x0 = (h - s) // 2, (w - s) // 2
        cv2.resize(img[y0 : y0 + s, x0 : x0 + s], (size, size), interpolation=cv2.INTER_AREA)
    return len(jpegs) / (time.perf_counter() - t0)


_CHILD = r"""
import json, resource, sys, time
sys.path.insert(0, {repo!r})
import mmstore
def cpu():
    a, b = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return a.ru_utime + a.ru_stime + b.ru_utime + b.ru_stime
c0 = cpu()
t0 = time.perf_counter()
r = mmstore.ingest({src!r}, {dest!r}, size={size}, workers={workers}, quiet=True, **{opts!r})
print(json.dumps(dict(elapsed=time.perf_counter() - t0, cpu=cpu() - c0, records=r.records, skipped=r.skipped)))
"""

PARQUET_OPTS = {"image_column": "jpg", "caption_column": "caption", "columns": "similarity,width"}
IMAGE_ONLY = {"image_column": "jpg"}


def warm(src: str) -> None:
    """Read the ingest's input files (the folder's, or the ``*.parquet`` files) right before it is timed: a VM
    may hand cached pages back to its host within seconds, so a warm-up at the start alone does not last."""
    import glob

    paths = glob.glob(src) if "*" in src else [os.path.join(src, n) for n in os.listdir(src)]
    for path in paths:
        with open(path, "rb") as fh:
            while fh.read(1 << 24):
                pass


def run_ingest(src: str, dest: str, size: int, workers: int, opts: dict, repo: str = REPO) -> dict:
    shutil.rmtree(dest, ignore_errors=True)
    warm(src)
    code = _CHILD.format(repo=repo, src=src, dest=dest, size=size, workers=workers, opts=opts)
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return json.loads(p.stdout.strip().splitlines()[-1])


def bare_cpu(jpegs: list[bytes], size: int) -> tuple[float, float]:
    """(images per second, CPU seconds per image) of :func:`bare_rate`."""
    c0 = time.process_time()
    rate = bare_rate(jpegs, size)
    return rate, (time.process_time() - c0) / len(jpegs)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=1500, help="images (default 1500)")
    ap.add_argument("--size", type=int, default=224)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--files", type=int, default=4)
    ap.add_argument("--row-group", type=int, default=100)
    ap.add_argument("--rounds", type=int, default=3, help="interleaved measurement rounds")
    ap.add_argument("--baseline", metavar="DIR", help="also measure the mmstore package under DIR (old vs new)")
    a = ap.parse_args()
    work = tempfile.mkdtemp(prefix="mmstore-bench-parquet-")
    try:
        t0 = time.perf_counter()
        jpegs, sizes = make_jpegs(a.n)
        d = os.path.join(work, "data")
        mb = write_parquet(d, jpegs, sizes, a.files, a.row_group)
        print(f"{a.n} JPEGs of real photos in {a.files} Parquet files, row groups of {a.row_group} ({mb:.0f} MB), "
              f"made in {time.perf_counter() - t0:.1f} s; {os.cpu_count()} CPUs, load "
              f"{open('/proc/loadavg').read().split()[0]}")
        src = os.path.join(d, "*.parquet")
        bare_rate(jpegs[:100], a.size)  # warm-up
        folder = os.path.join(work, "folder")  # the same JPEGs as files: the folder ingest, side by side
        os.makedirs(folder)
        for i, b in enumerate(jpegs):
            with open(os.path.join(folder, f"{i:07d}.jpg"), "wb") as fh:
                fh.write(b)
        rows: dict[str, list[tuple[float, float, float]]] = {"parquet": [], "parquet-image": [], "folder": []}
        if a.baseline:
            rows.update({"parquet (baseline)": [], "parquet-image (baseline)": []})
        for rnd in range(a.rounds):
            b1, c1 = bare_cpu(jpegs, a.size)
            got = {"parquet": run_ingest(src, os.path.join(work, "s"), a.size, a.workers, PARQUET_OPTS),
                   "parquet-image": run_ingest(src, os.path.join(work, "i"), a.size, a.workers, IMAGE_ONLY),
                   "folder": run_ingest(folder, os.path.join(work, "f"), a.size, a.workers, {})}
            if a.baseline:
                got["parquet (baseline)"] = run_ingest(src, os.path.join(work, "s"), a.size, a.workers, PARQUET_OPTS,
                                                       a.baseline)
                got["parquet-image (baseline)"] = run_ingest(src, os.path.join(work, "i"), a.size, a.workers,
                                                             IMAGE_ONLY, a.baseline)
            b2, c2 = bare_cpu(jpegs, a.size)
            bare, cbare = (b1 + b2) / 2, (c1 + c2) / 2
            line = [f"round {rnd + 1}: bare {b1:6.1f}/{b2:6.1f} img/s, {1e3 * cbare:.2f} ms CPU/img"]
            for name, r in got.items():
                rate = r["records"] / r["elapsed"]
                ratio, eff = rate / (a.workers * bare), cbare / (r["cpu"] / r["records"])
                rows[name].append((ratio, eff, 1e3 * r["cpu"] / r["records"]))
                line.append(f"{name} -w{a.workers} {rate:6.1f} img/s = {ratio:.2f} x ({a.workers} x bare), CPU "
                            f"efficiency {eff:.2f}, {1e3 * r['cpu'] / r['records']:.2f} ms CPU/img")
            print(" | ".join(line))
        labels = {"parquet": "parquet ingest", "parquet-image": "parquet, image column only",
                  "folder": "folder ingest (same JPEGs)", "parquet (baseline)": "parquet ingest, baseline",
                  "parquet-image (baseline)": "parquet image only, baseline"}
        for name, values in rows.items():
            med = np.median(np.array(values), axis=0)
            print(f"{labels[name]:28s}/ ({a.workers} x bare decode+resize in memory): {med[0]:.2f} (median of "
                  f"rounds; target >= 0.8); CPU efficiency bare/ingest per image {med[1]:.2f} (load-independent), "
                  f"{med[2]:.2f} ms CPU/img")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
